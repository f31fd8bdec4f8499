"""Rich rendering of `streamrl status` documents (see streamrl_cli.status)."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.table import Table
from rich.text import Text

from streamrl_cli.rundir import POOL_ROLES

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
    "registering": "yellow",
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


# Columns of the runs table, most important first; narrower terminals drop from the end of
# OPTIONAL, so the run id (the one thing a user copies) is always whole on one line.
ESSENTIAL = ("run", "state", "step")
OPTIONAL = ("age", "name", "clusters", "launcher")


def _runs_cells(r: dict[str, Any]) -> dict[str, str]:
    step = r.get("step")
    total = r.get("iterations")
    return {
        "run": r["run"],
        "name": r["name"] or "-",
        "launcher": ",".join(r["launchers"]) or "-",
        "clusters": ",".join(r["clusters"]) or "-",
        "state": str(r["state"]),
        "step": "-" if step is None else f"{step}/{total}" if total else str(step),
        "age": age(r["age_s"]),
    }


def runs_table(rows: list[dict[str, Any]], width: int | None = None) -> RenderableType:
    """The runs, with as many columns as fit in ``width``; never a cut run id."""
    cells = [_runs_cells(r) for r in rows]

    def needed(cols: list[str]) -> int:  # per column: 2 padding, 1 divider (an upper bound)
        return sum(3 + max([len(c)] + [len(row[c]) for row in cells]) for c in cols)

    columns = [*ESSENTIAL, *OPTIONAL]
    while width is not None and len(columns) > len(ESSENTIAL) and needed(columns) > width:
        columns.pop()
    if width is not None and needed(columns) > width:
        # Narrower than even id, state and step: one plain line per run, the id first and whole.
        # Never wrapped here: a terminal may fold the line, but a copy gives the id back whole.
        lines = [
            Text.assemble(
                c["run"], " ", styled(c["state"]), f" step {c['step']}", no_wrap=True, overflow="ignore"
            )
            for c in cells
        ]
        return Group(*(lines or [Text("no runs yet: streamrl run local")]))
    order = [c for c in ("run", "name", "launcher", "clusters", "state", "step", "age") if c in columns]
    # No vertical rules: more room for the columns, and an id copies without box characters.
    table = Table(title="runs", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in order:
        table.add_column(col, no_wrap=col == "run", min_width=len(col))
    for c in cells:
        table.add_row(*(styled(c[col]) if col == "state" else c[col] for col in order))
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
    p = dict(doc["progress"] or {})
    if "step" in p and p.get("iterations"):
        p["step"] = f"{p['step']}/{p['iterations']}"
    keys = (
        "step", "reward", "eval_reward", "samples_per_s", "trainer_idle", "generator_idle", "tail_s",
        "aborted_groups", "paused_groups", "resumed_samples", "token_staleness", "ranker_recall20",
        "turns", "tool_calls", "tool_errors", "env_failures", "env_token_share",
    )  # fmt: skip
    shown = [f"{k} {p[k]}" for k in keys if k in p]
    pline = Pairs("progress:", shown) if shown else Text("progress: no progress reported yet")
    parts: list[RenderableType] = [head, rline, pline]
    if doc.get("outcome"):
        parts.append(outcome_line(doc["state"], doc["outcome"]))
    parts += [Text(f"! {problem}", style="red") for problem in doc["problems"]]
    if doc.get("sites"):
        parts.append(sites_table(doc["sites"]))
    for role in doc["roles"]:
        parts.append(role_table(role))
    errors = [m for role in doc["roles"] for m in role["members"] if m.get("last_error")]
    parts += [Text(f"{m['member_id']} last error: {m['last_error']}", style="yellow") for m in errors]
    return Group(*parts)


class Pairs:
    """`label k v  k v ...` wrapped between its `k v` pairs, never inside one, at any width."""

    def __init__(self, label: str, pairs: list[str]):
        self.label, self.pairs = label, pairs

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        line, sep = Text(self.label), " "
        for n, pair in enumerate(self.pairs):
            if n and line.cell_len + len(sep) + len(pair) > options.max_width:
                yield line  # the next pair starts a line of its own, under the first
                line, sep = Text(" " * len(self.label)), " "
            line.append(sep + pair)
            sep = "  "
        yield line


def outcome_line(state: str, out: dict[str, Any]) -> Text:
    """`ended: failed 3.2m ago after 12.0m (generator-1)`: how a finished run ended."""
    import time

    text = Text.assemble("ended: ", styled(state))
    if out.get("ended") is not None:
        text.append(f" {age(time.time() - out['ended'])} ago")
    if out.get("duration_s") is not None:
        text.append(f" after {age(out['duration_s'])}")
    detail = out.get("failed") or out.get("job_states")
    if detail:
        text.append(f" ({', '.join(map(str, detail))})")
    if out.get("reason"):
        text.append(f": {out['reason']}")
    if out.get("lost"):
        text.append(f"; lost on the way: {', '.join(map(str, out['lost']))}")
    return text


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
    """`v5: 3.00 MiB in 0.25s, 3s ago`; across sites `v5 delta: 0.12 MiB (25×) in ...` or
    `v5 full: 3.00 MiB in 0.25s, 3s ago (no_base)` (relay_wire.FULL_REASONS: what each reason means)."""
    if not t:
        return "-"
    size = f"{t['bytes'] / 2**20:.2f} MiB" if t.get("bytes") is not None else "? bytes"
    took = f" in {t['seconds']:.2f}s" if t.get("seconds") is not None else ""
    how = f" {t['mode']}" if t.get("mode") else ""  # absent from generators before delta versions
    if t.get("mode") == "delta" and t.get("ratio"):
        size += f" ({t['ratio']:.3g}×)"
    why = f" ({t['reason']})" if t.get("reason") else ""
    return f"v{t['version']}{how}: {size}{took}, {age(time.time() - t['at'])} ago{why}"


def role_table(role: dict[str, Any]) -> Table:
    """One row per job task (SLURM), or per local process, joined with the member of that rank.

    Six columns sized for an 80-column terminal: the job and its task in one cell (SLURM's
    `JOB_TASK`), where it runs (its nodes, or why it waits) in one, the member's state and its last
    heartbeat in one. Short columns never wrap; the long ones fold, none is cut."""
    table = Table(title=f"{role['role']} (cluster {role['cluster'] or '-'})", title_justify="left")
    table.add_column("rank", no_wrap=True)
    table.add_column("job", overflow="fold")
    table.add_column("state", no_wrap=True)
    table.add_column("where", overflow="fold")
    table.add_column("member", no_wrap=True)
    table.add_column("ver", no_wrap=True)
    members = {m["rank"]: m for m in role["members"]}
    rows = 0
    for job in role["jobs"]:
        for t in job["tasks"]:
            rank = _rank(role["role"], t)
            m = members.pop(rank, None) if rank is not None else None
            if t["state"] == "PENDING":
                where = Text(t.get("reason") or "waiting", style="yellow")
            else:
                where = Text(t.get("nodes") or (m or {}).get("host") or t.get("reason") or "-")
            cluster = f"{job['slurm_cluster']}:" if job.get("slurm_cluster") else ""
            task = "" if t["task"] is None else f"_{t['task']}"
            table.add_row(
                "-" if rank is None else str(rank),
                f"{cluster}{job['job_id']}{task}",
                styled(t["state"]),
                where,
                *_member(m),
            )
            rows += 1
    for proc in role["processes"]:
        m = members.pop(proc["rank"], None)
        host = Text((m or {}).get("host") or "-")
        table.add_row(str(proc["rank"]), f"pid {proc['pid']}", styled(proc["state"]), host, *_member(m))
        rows += 1
    for m in members.values():
        table.add_row(str(m["rank"]), "-", "-", Text(m["host"] or "-"), *_member(m))
        rows += 1
    if not rows:
        table.caption = "nothing launched for this role"
    return table


def _rank(role: str, task: dict[str, Any]) -> int | None:
    if role in POOL_ROLES and isinstance(task["task"], int):
        return task["task"]
    return 0 if task["task"] is None and role not in POOL_ROLES else None


def _member(m: dict[str, Any] | None) -> tuple[RenderableType, str]:
    """(its state and how long ago its last heartbeat came, its weight version)."""
    if m is None:
        return Text("-"), "-"
    state = styled(m["state"])
    if m["last_heartbeat_s"] is not None:
        state.append(f" {age(m['last_heartbeat_s'])}")
    return state, str(m["weight_version"]) if m["weight_version"] is not None else "-"
