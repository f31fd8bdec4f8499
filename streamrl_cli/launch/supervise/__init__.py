"""Watching a launched run's roles until it ends: one rule, one side per launcher.

supervisor   the rule and its loop (pure decisions: a member lost, a trainer restarted, the end)
local_watch  the side of local processes: `streamrl run` in the foreground, with live_view's table
slurm_watch  the side of SLURM jobs: the rendezvous role's job watcher (launch.server_role)
keeper       the parent that restarts a rendezvous server no `streamrl run` watches
"""
