"""The keeper of a rendezvous server that no `streamrl run` watches.

A run whose roles are all SLURM jobs returns once they are submitted; its rendezvous server stays
up on the submitting host. Should it die (killed, crashed), the run would lose its control plane
with nobody to notice. So there it runs under this small parent, which starts it again from its
journal, like `streamrl run` does for a local run's server, at most RENDEZVOUS_RESTARTS times per
run (counted in run.json, shared with `streamrl run`'s own restarts):

    python -m streamrl_cli.launch.supervise.keeper RUN_DIR -- COMMAND ...

The keeper forwards SIGTERM and SIGINT to the server and ends with its exit code. A server that
exits 0 (stopped on purpose: its run ended, a cancel) or whose run was cancelled is not restarted.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path

from streamrl_cli.rundir import RunDir

log = logging.getLogger("streamrl.keeper")

RENDEZVOUS_RESTARTS = 3  # a rendezvous server that dies is started again from its journal, per run


def stopped_on_purpose(run: RunDir, code: int) -> bool:
    """The server exited 0 (its run ended, a cancel stopped it), its run was cancelled, or its run
    directory was deleted: it is not to be started again."""
    return code == 0 or not run.run_json.exists() or run.info().get("state") in ("cancelling", "cancelled")


def count_restart(run: RunDir, code: int) -> int | None:
    """Record one more restart of the run's rendezvous server, which died with `code`; its number, or
    None once the run's budget of restarts is spent."""
    restarts = int(run.info().get("rendezvous_restarts") or 0)
    if restarts >= RENDEZVOUS_RESTARTS:
        return None
    run.update_info(rendezvous_restarts=restarts + 1)
    run.event("rendezvous_restarted", exit_code=code, restart=restarts + 1)
    return restarts + 1


def keep(run: RunDir, command: list[str]) -> int:
    child: subprocess.Popen | None = None
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, forward)
    while True:
        child = subprocess.Popen(command)
        code = child.wait()
        if stopping or stopped_on_purpose(run, code):
            return code
        n = count_restart(run, code)
        if n is None:
            log.error("the rendezvous server exited with %s; not started again (it died %d times)",
                      code, RENDEZVOUS_RESTARTS + 1)  # fmt: skip
            return code
        log.warning("the rendezvous server exited with %s; starting it again from its journal (%d of %d)",
                    code, n, RENDEZVOUS_RESTARTS)  # fmt: skip


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m streamrl_cli.launch.supervise.keeper RUN_DIR -- COMMAND ...", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return keep(RunDir(Path(argv[0])), argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
