"""Multi-turn rollouts: trajectories built token by token, environments, tools (docs/agents.md).

The pieces the generator's multi-turn engine (``generator.multiturn``) is made of, and that the
trainer reads (a trajectory's stop reasons): pure trajectory bookkeeping (:mod:`.trajectory`), the
environment interface and the tool environment (:mod:`.environment`, :mod:`.tools`), environments
in worker processes (:mod:`.env_host`), rendering one message at a time with the chat template
(:mod:`.render`), and an adapter for TextArena's games (:mod:`.textarena`).
"""
