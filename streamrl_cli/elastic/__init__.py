"""Elastic generators: how many generator instances a run should have (the decision, not its execution).

- ``policy``: the paper's rule as a pure function of what each iteration measured.
- ``control``: the trainer's side: feeds the rule each iteration and posts the wanted count to the
  rendezvous.

Making it so is the launcher's part (:mod:`streamrl_cli.launch.scale`: ``executor``, ``follow``,
``request``), so the trainer and the recipe checks import this package without the launcher.
"""
