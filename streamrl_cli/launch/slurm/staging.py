"""Staging, for a cluster that does not see the submit host's filesystem (``run_root``).

Its jobs keep the run's files in their own copy of the run directory, ``run_root/<run id>``, with
the same layout; what a role reads there (its spec, the run's secret, the rendezvous address, the
server's CA) travels inside the job script and is written by it before the role starts.
"""

from __future__ import annotations

import base64
import dataclasses
import shlex
from pathlib import Path

from streamrl_cli.launch.plan import JobSpec
from streamrl_cli.rundir import RunDir


def staged_run(job: JobSpec, run_dir: Path) -> RunDir | None:
    """Where a job on a cluster without the submit host's filesystem keeps this run's files
    (``run_root/<run id>``, same layout); None when it reads the run directory itself."""
    return RunDir(Path(job.run_root) / Path(run_dir).name) if job.run_root else None


def staged_files(job: JobSpec, run_dir: Path) -> dict[Path, tuple[bytes, int]]:
    """What a staged job reads, as its cluster's copies: path there -> (content, mode).

    The role spec with its paths moved to the staged directory, the run's secret, the rendezvous
    address once the server published it, and the server's CA when it uses TLS.
    """
    from streamrl_cli.launch import run_state
    from streamrl_cli.roles.spec import spec_yaml

    run, there = RunDir(Path(run_dir)), staged_run(job, run_dir)
    assert there is not None
    spec = run_state.role_spec(run, job.role)
    files: dict[Path, tuple[bytes, int]] = {there.secret: (run.secret.read_bytes(), 0o600)}
    if run.endpoint.is_file():
        files[there.endpoint] = (run.endpoint.read_bytes(), 0o644)
    ca = None
    if spec.rendezvous_ca:
        ca = str(there.staged_ca)
        files[there.staged_ca] = (Path(spec.rendezvous_ca).expanduser().read_bytes(), 0o644)
    spec = dataclasses.replace(
        spec,
        run_dir=str(there.path),
        rendezvous_file=str(there.endpoint),
        secret_file=str(there.secret),
        rendezvous_ca=ca,
    )
    files[there.role_spec(job.role)] = (spec_yaml(spec).encode(), 0o644)
    return files


def stage_lines(job: JobSpec, run_dir: Path) -> list[str]:
    """Shell lines that write the staged files on the job's first node before its role starts.

    The files travel inside the job script (SLURM carries it to the other cluster), base64-encoded;
    each is written beside its place and renamed, so array tasks starting together never read half
    a file. A requeued job writes them again, unchanged.
    """
    there = staged_run(job, run_dir)
    assert there is not None
    lines = [
        "# Staged: this cluster does not see the run directory; what its roles read follows.",
        f"mkdir -p -m 700 {shlex.quote(str(there.path))}",
        f"mkdir -p {shlex.quote(str(there.roles))} {shlex.quote(str(there.role_logs(job.role)))}"
        f" {shlex.quote(str(there.members))}",
    ]
    for path, (data, mode) in staged_files(job, run_dir).items():
        dest = shlex.quote(str(path))
        tmp = shlex.quote(f"{path}.part-") + '"$SLURM_JOB_ID"'
        lines += [
            f"(umask 077; base64 -d > {tmp} <<'STREAMRL_STAGED'",
            *base64.encodebytes(data).decode().splitlines(),
            "STREAMRL_STAGED",
            f"chmod {mode:o} {tmp} && mv -f {tmp} {dest})",
        ]
    return lines
