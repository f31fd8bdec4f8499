"""Rich rendering of `streamrl status` documents (see streamrl_cli.status)."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

STATE_STYLE = {
    "running": "green",
    "RUNNING": "green",
    "alive": "green",
    "finished": "cyan",
    "COMPLETED": "cyan",
    "exited": "cyan",
    "left": "cyan",
    "pending": "yellow",
    "PENDING": "yellow",
    "created": "yellow",
    "dry-run": "dim",
    "lost": "red",
    "failed": "red",
    "FAILED": "red",
    "cancelled": "magenta",
    "CANCELLED": "magenta",
    "TIMEOUT": "red",
    "UNKNOWN": "dim",
    "unknown": "dim",
    "ended": "yellow",
    "stalled": "red",
}


def styled(state: Any) -> Text:
    text = str(state if state is not None else "-")
    return Text(text, style=STATE_STYLE.get(text, ""))


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def runs_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="runs", title_justify="left")
    for col in ("run", "name", "launcher", "clusters", "state", "step", "age"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["run"],
            r["name"] or "-",
            ",".join(r["launchers"]) or "-",
            ",".join(r["clusters"]) or "-",
            styled(r["state"]),
            str(r["step"]) if r["step"] is not None else "-",
            age(r["age_s"]),
        )
    if not rows:
        table.caption = "no runs yet: streamrl run local"
    return table


def run_view(doc: dict[str, Any]) -> RenderableType:
    rdv = doc["rendezvous"]
    head = Text.assemble(
        ("run ", "bold"),
        (doc["run"], "bold"),
        "  state ",
        styled(doc["state"]),
        f"  age {age(doc['age_s'])}  recipe {doc['recipe']}",
    )
    if rdv["reachable"]:
        counts = ", ".join(
            f"{role} {c['alive']}/{c['alive'] + c['lost']}" for role, c in rdv.get("counts", {}).items()
        )
        version = (rdv.get("versions") or {}).get("current")
        rline = Text(
            f"rendezvous {rdv['url']}: up {age(rdv.get('uptime_s'))}, alive {counts or 'none'}, "
            f"weight version {version if version is not None else '-'}"
        )
    else:
        rline = Text(
            f"rendezvous {rdv['url'] or '-'}: {rdv['error']} (showing what SLURM and the run directory know)",
            style="yellow",
        )
    p = doc["progress"] or {}
    keys = (
        "step",
        "samples_per_s",
        "trainer_idle",
        "generator_idle",
        "reward",
        "eval_reward",
        "ranker_recall20",
    )
    pline = Text(
        "progress: " + ("  ".join(f"{k} {p[k]}" for k in keys if k in p) or "no progress reported yet")
    )
    parts: list[RenderableType] = [head, rline, pline]
    parts += [Text(f"! {problem}", style="red") for problem in doc["problems"]]
    if doc.get("sites"):
        parts.append(sites_table(doc["sites"]))
    for role in doc["roles"]:
        parts.append(role_table(role))
    errors = [m for role in doc["roles"] for m in role["members"] if m.get("last_error")]
    parts += [Text(f"{m['member_id']} last error: {m['last_error']}", style="yellow") for m in errors]
    return Group(*parts)


def sites_table(sites: list[dict[str, Any]]) -> Table:
    """One row per site: members, relay, version served, last transfer there and across sites."""
    import time

    table = Table(title="sites", title_justify="left")
    for col in ("site", "members", "relay", "ver", "last transfer", "across sites"):
        table.add_column(col, overflow="fold")
    for s in sites:
        members = ", ".join(
            m["member_id"] + ("" if m["state"] == "alive" else f" ({m['state']})") for m in s["members"]
        )
        relay = "(trainer's site)" if s["trainer_site"] else s["relay"] or "-"
        ver = str(s["weight_version"]) if s["weight_version"] is not None else "-"
        table.add_row(
            s["site"],
            members,
            relay,
            ver,
            _transfer(s["last_transfer"], time),
            _transfer(s["last_wan_transfer"], time),
        )
    return table


def _transfer(t: dict[str, Any] | None, time: Any) -> str:
    if not t:
        return "-"
    size = f"{t['bytes'] / 2**20:.2f} MiB" if t.get("bytes") is not None else "? bytes"
    took = f" in {t['seconds']:.2f}s" if t.get("seconds") is not None else ""
    return f"v{t['version']}: {size}{took}, {age(time.time() - t['at'])} ago"


def role_table(role: dict[str, Any]) -> Table:
    """One row per job task (SLURM), or per local process, joined with the member of that rank."""
    table = Table(title=f"{role['role']} (cluster {role['cluster'] or '-'})", title_justify="left")
    for col in ("job", "task", "state", "nodes/reason", "member", "beat", "host", "ver"):
        table.add_column(col, overflow="fold")
    members = {m["rank"]: m for m in role["members"]}
    rows = 0
    for job in role["jobs"]:
        for t in job["tasks"]:
            rank = _rank(role["role"], t)
            m = members.pop(rank, None) if rank is not None else None
            detail = t.get("reason") if t["state"] == "PENDING" else t.get("nodes") or t.get("reason") or ""
            where = job.get("slurm_cluster") or "default"
            table.add_row(
                f"{where}:{job['job_id']}",
                "-" if t["task"] is None else str(t["task"]),
                styled(t["state"]),
                detail,
                *_member(m),
            )
            rows += 1
    for proc in role["processes"]:
        m = members.pop(proc["rank"], None)
        table.add_row(f"pid {proc['pid']}", str(proc["rank"]), styled(proc["state"]), "", *_member(m))
        rows += 1
    for m in members.values():
        table.add_row("-", str(m["rank"]), "-", "", *_member(m))
        rows += 1
    if not rows:
        table.caption = "nothing launched for this role"
    return table


def _rank(role: str, task: dict[str, Any]) -> int | None:
    if role == "generator" and isinstance(task["task"], int):
        return task["task"]
    return 0 if task["task"] is None and role != "generator" else None


def _member(m: dict[str, Any] | None) -> tuple[RenderableType, str, str, str]:
    if m is None:
        return Text("-"), "-", "-", "-"
    hb = age(m["last_heartbeat_s"]) if m["last_heartbeat_s"] is not None else "-"
    wv = str(m["weight_version"]) if m["weight_version"] is not None else "-"
    return styled(m["state"]), hb, m["host"] or "-", wv
