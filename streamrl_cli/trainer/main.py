"""The trainer's program, as recipes name it (``roles.trainer.program``: ``streamrl_cli.trainer.main:main``).

The trainer is three packages: ``trainer.role`` starts the role (``TrainerRole``: ranks, models,
the learner, publishing, checkpoints), ``trainer.loop`` is the loop it runs (dispatch, sample
routing, micro-batches, the step), ``trainer.algo`` is the maths the loss is made of. The
dependencies point that way only (``.importlinter``)."""

from streamrl_cli.trainer.role.main import main

__all__ = ["main"]
