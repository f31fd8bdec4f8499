"""From a composed recipe to running roles, and watching them until the run ends.

- presubmit: the checks before anything is queued; plan: the recipe as jobs and role specs;
- run: `streamrl run` (render, submit, watch) and cancel; server_role: the rendezvous role's entry;
- launcher: which launcher starts a cluster's roles, and the one `submit` path (base: its interface);
  local: role processes on this machine; slurm/: SLURM jobs through submitit;
- supervise/: the rule that watches a run, one side per launcher, the rendezvous server's keeper;
- scale/: a running role's instance count, requested, followed and carried out;
- run_state: a run's state read back from its directory.
"""
