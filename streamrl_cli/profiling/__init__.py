"""Measurement: `streamrl profile` runs the real engines, here or in one SLURM job per hardware kind.

Built on top of the planner (whose profile format it writes, ``planner.profile``) and the launcher
(which submits its jobs); the planner itself stays pure and never imports this package.
"""
