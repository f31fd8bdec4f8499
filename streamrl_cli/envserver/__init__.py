"""Environment servers (``roles.env_server``): multi-turn environments in processes of their own, on
any cluster, found by the generators through the rendezvous (docs/agents.md).

:mod:`.server` serves an environment host on an authenticated socket, :mod:`.role` is the role's
program around it, :mod:`.client` is the generators' side: it finds the servers and spreads the
trajectories over them.
"""
