"""Elastic generators: how many generator instances a run should have, and making it so.

- ``policy``: the paper's rule as a pure function of what each iteration measured.
- ``executor``: applies a target instance count to a run (local processes or SLURM array jobs).
- ``follow``: the loop, run by the process that watches the run, that takes scale requests from
  the rendezvous (``streamrl scale`` or the trainer's policy) and hands them to the executor.
"""
