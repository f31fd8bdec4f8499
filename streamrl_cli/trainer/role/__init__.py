"""The trainer role's start-up and its heavy parts: the process entry (``main``: ``TrainerRole``),
the ranks, the models and the DeepSpeed learner, weight publishing, checkpoints and export. It
builds the loop (``trainer.loop``) and hands it these collaborators."""
