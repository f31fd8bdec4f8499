"""The trainer's loop: dispatch prompts, route samples into groups, train micro-batches, step and
publish (``pipeline``, whose docstring draws the data flow). It imports the maths (``trainer.algo``),
never the role's start-up (``trainer.role``), which hands it its collaborators."""
