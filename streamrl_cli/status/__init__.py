"""`streamrl status`: what every part of a run is doing, from three sources that fail separately.

    run directory ── run.json, jobs.json, local.json, members/   (always there)
    SLURM         ── squeue -M <cluster> --json (sacct -M when accounting is on)
    rendezvous    ── GET /v1/status: membership, heartbeats, weight versions, progress, metrics

Each source that cannot be reached is reported as such and the others are still shown, so a
run whose rendezvous server is gone, or a cluster without accounting, still gets a status.
The JSON document (`--json`) is described in docs/status-json.md.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from streamrl_cli import rundir
from streamrl_cli.launch import launcher
from streamrl_cli.rundir import RunDir

if TYPE_CHECKING:
    from streamrl_cli.launch.launcher import Report
    from streamrl_cli.recipe.schema import TrainConfig
    from streamrl_cli.roles.spec import RoleSpec

ROLE_ORDER = ("rendezvous", "trainer", "generator", "teacher", "env_server")
SCHEMA_VERSION = 1


def collect(run: RunDir) -> dict[str, Any]:
    """The whole status of one run as one JSON-able document."""
    info = run.info()
    reports = launcher.reports(run)  # each launcher's units: SLURM jobs, local processes
    rdv = _rendezvous(run)
    members = rdv.pop("_members", [])
    roles = []
    for role in ROLE_ORDER:
        spec = _spec(run, role)
        entry = {
            "role": role,
            "cluster": spec.cluster if spec is not None else None,
            **{rep.key: rep.units.get(role, []) for rep in reports},
            "members": _members(run, role, members, reachable=bool(rdv.get("reachable"))),
        }
        # Only the roles the run launched (its role specs), and any role something of which runs or
        # registered all the same (a directory that lost its specs): not a teacher it never had.
        if spec is not None or entry["members"] or any(rep.units.get(role) for rep in reports):
            roles.append(entry)
    state, problems = _derive_state(info.get("state", "unknown"), reports)
    stall_after_s = _trainer_train(run).stall_after_s
    stalled = stalled_for(state, rdv, info, stall_after_s, time.time())
    if stalled is not None:
        state = "stalled"
        problems.append(
            f"no progress for {stalled:.0f}s (train.stall_after_s={stall_after_s:.0f}); last errors: "
            + (
                "; ".join(f"{m['member_id']}: {m['last_error']}" for m in members if m.get("last_error"))
                or "none reported"
            )
        )
    problems += _member_errors(run)
    problems = [*run.damage(), *problems]
    return {
        "schema": SCHEMA_VERSION,
        "run": run.name,
        "name": info.get("name"),
        "path": str(run.path),
        "state": state,
        "recorded_state": info.get("state"),
        "problems": problems,
        "recipe": info.get("recipe"),
        "overrides": info.get("overrides", []),
        "launchers": info.get("launchers", []),
        "clusters": info.get("clusters", {}),
        "created": info.get("created"),
        "age_s": round(time.time() - info["created"], 1) if info.get("created") else None,
        "rendezvous": rdv,
        "progress": rdv.get("progress") or _progress_from_metrics(run),
        "outcome": None if state in ACTIVE_STATES else outcome(run),
        "sites": sites(members),
        "roles": roles,
    }


def stalled_for(
    state: str, rdv: dict[str, Any], info: dict[str, Any], bound_s: float, now: float
) -> float | None:
    """Seconds without progress, if a running run has made none for longer than `bound_s` (the last
    trained step, or the start while none was): None when it is not stalled, or cannot be told."""
    if state != "running" or not rdv.get("reachable"):
        return None
    since = (rdv.get("progress") or {}).get("updated") or info.get("started")
    if since is None:
        return None
    idle = now - float(since)
    return idle if idle > bound_s else None


def _transfer(rec: dict[str, Any] | None, seconds: str, size: str) -> dict[str, Any] | None:
    """One weight transfer a generator reported (its metrics record), under its seconds/bytes keys."""
    if rec is None:
        return None
    return {"version": rec.get("weights/version"), "at": rec["weights/at"],
            "seconds": rec.get(seconds), "bytes": rec.get(size)}  # fmt: skip


def _wan_transfer(rec: dict[str, Any] | None) -> dict[str, Any] | None:
    """What crossed to a site for one version (the relay's fetch): a transfer, plus whether it came as a
    delta or whole (`mode`), why whole (`reason`), the whole version's size and the ratio of the two."""
    out = _transfer(rec, "weights/wan_s", "weights/wan_bytes")
    if rec is not None and out is not None:
        out["mode"] = rec.get("weights/wan_mode")  # null from generators before delta versions
        out["reason"] = rec.get("weights/wan_reason") or None
        out["full_bytes"] = rec.get("weights/wan_full_bytes")
        out["ratio"] = rec.get("weights/wan_ratio")
    return out


def sites(members: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per site: its members, its relay (at a site without the trainer: the lowest-ranked generator
    past start-up, the rule the generators follow), the weight version its generators serve, and
    the last weight transfer there (as the generators report it in their metrics)."""
    from streamrl_cli.weights.layout import eligible

    trainer_sites = {m.get("site") for m in members if m["role"] == "trainer"}
    out = []
    for site in sorted({m.get("site") or "default" for m in members}):
        here = [m for m in members if (m.get("site") or "default") == site]
        gens = [m for m in here if m["role"] == "generator"]
        far = site not in trainer_sites
        up = eligible(gens) if far else []
        served = [
            m["weight_version"] for m in gens if m["state"] == "alive" and m["weight_version"] is not None
        ]
        transfers = [m["metrics"] for m in gens if "weights/at" in m.get("metrics", {})]
        last = max(transfers, key=lambda r: r["weights/at"]) if transfers else None
        wan = [r for r in transfers if r.get("weights/relay")]
        last_wan = max(wan, key=lambda r: r["weights/at"]) if wan else None
        out.append(
            {
                "site": site,
                "trainer_site": not far,
                "members": [
                    {
                        "member_id": m["member_id"],
                        "state": m["state"],
                        "reported_state": m.get("reported_state"),
                    }
                    for m in sorted(here, key=lambda m: (m["role"], m["rank"]))
                ],
                "relay": up[0]["member_id"] if up else None,
                "weight_version": min(served) if served else None,
                "last_transfer": _transfer(last, "weights/transfer_s", "weights/bytes"),
                # What crossed the inter-site link last (the relay's fetch from the trainer).
                "last_wan_transfer": _wan_transfer(last_wan),
            }
        )
    return out


def _rendezvous(run: RunDir) -> dict[str, Any]:
    endpoint = rundir.read_json(run.endpoint) or {}
    out: dict[str, Any] = {"url": endpoint.get("url"), "reachable": False, "error": None}
    if not endpoint.get("url"):
        out["error"] = "not started (no rendezvous.json)"
        return out
    if endpoint.get("requeued"):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(endpoint["requeued"]))
        out["error"] = f"its job requeued itself at {when} (time limit near); members wait for it"
        return out
    if endpoint.get("stopped"):
        out["error"] = "stopped at " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(endpoint["stopped"]))
        return out
    from streamrl_cli.errors import RendezvousError
    from streamrl_cli.rendezvous.client import RendezvousClient

    rdv_spec = _spec(run, "rendezvous")
    ca = rdv_spec.rendezvous_ca if rdv_spec is not None else None
    try:
        with RendezvousClient.from_run_dir(run.path, timeout=2.0, retry_s=0.0, tls_ca=ca) as client:
            st = client.status()
    except (RendezvousError, OSError) as e:
        out["error"] = f"unreachable: {str(e).splitlines()[0]}"
        return out
    out.update(
        reachable=True,
        uptime_s=st.get("server", {}).get("uptime_s"),
        lease_s=st.get("server", {}).get("lease_s"),
        event_seq=st.get("event_seq"),
        counts=st.get("counts", {}),
        versions=st.get("versions", {}),
        progress=st.get("progress") or {},
        _members=[
            {**m, "metrics": (st.get("metrics", {}).get(m["member_id"]) or {}).get("record", {})}
            for m in st.get("members", [])
        ],
    )
    return out


def _trainer_train(run: RunDir) -> TrainConfig:
    """The trainer's typed train section, or the schema's defaults where its spec is gone or
    unreadable (status must work without it)."""
    from streamrl_cli.errors import StreamRLError
    from streamrl_cli.launch import run_state
    from streamrl_cli.recipe.schema import TrainConfig
    from streamrl_cli.roles.spec import TrainerSpec

    try:
        spec = run_state.role_spec(run, "trainer")
    except StreamRLError:
        return TrainConfig()
    return spec.train if isinstance(spec, TrainerSpec) else TrainConfig()


def _spec(run: RunDir, role: str) -> RoleSpec | None:
    """The role's typed spec; None where it is missing or damaged (status works without it, and
    says what is damaged: RunDir.damage)."""
    from streamrl_cli.errors import StreamRLError
    from streamrl_cli.launch import run_state

    try:
        return run_state.role_spec(run, role)
    except StreamRLError:
        return None


def _members(run: RunDir, role: str, live: list[dict], reachable: bool) -> list[dict]:
    """Members of ``role``: the server's view once any of them registered, else the start records on
    disk: "registering" while the server answers but has not heard from them yet, "unknown" when the
    server cannot be asked, "exited" once a process wrote its exit. The server is no member of
    itself: its own record shows only while it cannot answer (its state is the document's
    ``rendezvous`` section)."""
    rows = [m for m in live if m["role"] == role]
    if role == "rendezvous" and reachable:
        return []
    if rows:
        return [
            {
                "rank": m["rank"],
                "member_id": m["member_id"],
                "state": m["state"],
                "host": m["host"],
                "cluster": m.get("cluster"),
                "site": m.get("site"),
                "last_error": m.get("last_error"),
                "last_heartbeat_s": m.get("last_heartbeat_age_s"),
                "weight_version": m.get("weight_version"),
                "incarnation": m.get("incarnation"),
                "reported_state": m.get("reported_state"),
                "metrics": m.get("metrics", {}),
            }
            for m in sorted(rows, key=lambda m: m["rank"])
        ]
    out = []
    for f in sorted(run.members.glob(f"{role}-*.json")):
        rec = rundir.read_json(f) or {}
        state = "exited" if "exit_code" in rec else "registering" if reachable else "unknown"
        out.append(
            {
                "rank": rec.get("rank"),
                "member_id": None,
                "state": state,
                "host": rec.get("host"),
                "cluster": rec.get("cluster"),
                "site": rec.get("site"),
                "last_error": None,
                "last_heartbeat_s": None,
                "weight_version": None,
                "incarnation": None,
                "reported_state": None,
                "metrics": {},
            }
        )
    return out


def _member_errors(run: RunDir) -> list[str]:
    """The reason each failed process wrote into its record before exiting (its first line)."""
    out = []
    for f in sorted(run.members.glob("*.json")):
        rec = rundir.read_json(f) or {}
        if rec.get("exit_code") and rec.get("error"):
            where = f" on {rec['host']}" if rec.get("host") else ""
            first = str(rec["error"]).strip().splitlines()[0] if str(rec["error"]).strip() else ""
            out.append(
                f"{rec.get('role')} rank {rec.get('rank')}{where} exited with {rec['exit_code']}: {first}"
            )
    return out


ENDINGS = ("failed", "finished", "ended")  # how a run's roles ended, the most telling first


def _derive_state(recorded: str, reports: list[Report]) -> tuple[str, list[str]]:
    """The run's state now; ``recorded`` is what run.json says (it may lag what SLURM knows, or be
    "unknown" when run.json is damaged or gone: then the launchers tell what they can)."""
    problems = [] if recorded == "cancelled" else [p for rep in reports for p in rep.problems]
    if recorded not in ("running", "created", "unknown"):
        return recorded, problems
    started = [rep for rep in reports if rep.started]
    if started and all(rep.ended is not None for rep in started):
        # Every launcher that started roles saw them all end: how tells the run's state.
        state = min((rep.ended for rep in started), key=ENDINGS.index)
        notes = [rep.ended_note for rep in started if rep.ended == state and rep.ended_note]
        return state, problems + notes
    running = any(rep.running for rep in reports)
    pending = any(rep.pending for rep in reports)
    return ("running" if running else "pending" if pending else recorded), problems


ACTIVE_STATES = ("created", "pending", "running", "stalled", "cancelling")


def current_state(run: RunDir, reports: list[Report] | None = None) -> str:
    """The run's state now, from run.json and what its launchers know (no server is asked);
    ``reports``: theirs, when the caller already asked them (launcher.reports)."""
    if reports is None:
        reports = launcher.reports(run)
    state, _ = _derive_state(run.info().get("state", "unknown"), reports)
    return state


def _progress_from_metrics(run: RunDir) -> dict[str, Any]:
    """Without a server (a finished run, or its server gone): progress from the run's records.

    The trainer posts one record per iteration to metrics.jsonl; the last one says how far the
    run got, in the same keys the trainer posts as progress while it runs.
    """
    from streamrl_cli.metrics.read import is_iteration

    try:
        with open(run.metrics, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 262144))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if is_iteration(rec):
            return _progress_of(rec, run.info().get("iterations"))
        record = rec.get("record", rec) if isinstance(rec, dict) else None
        if isinstance(record, dict) and "step" in record:
            return record
    return {}


def _progress_of(rec: dict[str, Any], iterations: Any) -> dict[str, Any]:
    def rounded(key: str, digits: int) -> Any:
        v = rec.get(key)
        return round(v, digits) if isinstance(v, int | float) and not isinstance(v, bool) else None

    out = {
        "step": rec["iteration"] + 1,
        "iterations": iterations if isinstance(iterations, int) else None,
        "reward": rounded("reward_mean", 4),
        "eval_reward": rounded("eval/reward_mean", 4),
        "samples_per_s": rounded("samples_per_s", 2),
        "trainer_idle": rounded("idle/trainer", 3),
        "generator_idle": rounded("idle/generator", 3),
        "tail_s": rounded("t/tail", 3),  # 90% of the batch generated to its last sample
        "aborted_groups": rec.get("rollout/aborted_groups") or None,  # over-sampling, when on
        "paused_groups": rec.get("rollout/paused_groups") or None,  # partial rollout, when on
        "resumed_samples": rec.get("rollout/resumed_samples") or None,
        "token_staleness": rounded("staleness/token_mean", 3) or None,
        # Multi-turn runs: turns and tool use per trajectory, environment failures, the share of a
        # trajectory's tokens the environment added.
        "turns": rounded("agent/turns_mean", 2),
        "tool_calls": rounded("agent/tool_calls_per_trajectory", 2),
        "tool_errors": rec.get("agent/tool_errors") or None,
        "env_failures": rec.get("agent/failures") or None,
        "env_token_share": _share(rec.get("agent/env_tokens"), rec.get("agent/model_tokens")),
        "mode": rec.get("mode"),
        "from": "metrics.jsonl",
    }
    return {k: v for k, v in out.items() if v is not None}


def _share(part: Any, other: Any) -> float | None:
    if not isinstance(part, int) or not isinstance(other, int) or part + other == 0:
        return None
    return round(part / (part + other), 3)


def outcome(run: RunDir) -> dict[str, Any]:
    """How a run ended, from its records: when, and what the last lifecycle event says."""
    info = run.info()
    ended = info.get("ended")
    out: dict[str, Any] = {"ended": ended if isinstance(ended, int | float) else None}
    events = run.events_checked().records  # damaged lines are skipped (collect names them)
    final = next((e for e in reversed(events) if e.get("event") in ("finished", "failed", "cancelled")), None)
    if final:
        out["event"] = final["event"]
        for key in ("failed", "reason", "lost", "job_states"):  # job_states: runs of older versions
            if final.get(key):
                out[key] = final[key]
    if out["ended"] is not None and isinstance(info.get("started"), int | float):
        out["duration_s"] = round(out["ended"] - info["started"], 1)
    return out


def runs_summary() -> list[dict[str, Any]]:
    """One line per catalogued run, cheap enough for many runs: no server is asked."""
    out = []
    for run in rundir.catalog():
        info = run.info()
        jobs = run.jobs()
        progress = _progress_from_metrics(run)
        state = info.get("state", "unknown")
        if state == "running":  # do its roles still run? (SLURM is asked only about runs with jobs)
            reports = launcher.reports(run)
            state = _derive_state(state, reports)[0] if any(r.started for r in reports) else "ended"
        out.append(
            {
                "run": run.name,
                "name": info.get("name"),
                "path": str(run.path),
                "launchers": info.get("launchers", []),
                "clusters": sorted(
                    c.get("slurm_cluster") or k for k, c in (info.get("clusters") or {}).items()
                ),
                "state": state,
                **{k: progress.get(k) for k in ("step", "iterations")},
                "created": info.get("created"),
                "age_s": round(time.time() - info["created"], 1) if info.get("created") else None,
                "jobs": len(jobs),
            }
        )
    return out
