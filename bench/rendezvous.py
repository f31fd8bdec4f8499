"""Benchmark: how many members one rendezvous server core sustains, against aiohttp's own floor.

    .venv/bin/python bench/rendezvous.py [--sizes 64,256,512] [--seconds 10]

For each N, the server runs in a subprocess pinned to one core and this process, pinned to
another, drives N simulated members with an asyncio aiohttp client: each registers, then
loops heartbeat, heartbeat, heartbeat, metrics as fast as the server answers (closed loop,
concurrency N, one keep-alive connection per member). That finds the sustained rate; a real
member sends one heartbeat per lease/3 (3.3 s by default), so 2000 heartbeats/s is ~6600
members. The same load is then run against a bare aiohttp server on the same core whose
handlers only read the body and answer a constant JSON: the framework's floor. The ratio
(ours / floor, heartbeats/s at N=512) is our overhead: auth, validation, state, metrics.jsonl.

The last line of output is one JSON object for the benchmark record.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from streamrl_cli.rendezvous import create_secret  # noqa: E402

TARGET_HB_PER_S = 2000
METRICS_EVERY = 4  # every 4th request of a member is a metrics post, the others heartbeats


@dataclass
class Result:
    server: str
    n: int
    seconds: float
    heartbeats: int = 0
    metrics: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)
    server_cpu: float = 0.0
    client_cpu: float = 0.0

    @property
    def rps(self) -> float:
        return (self.heartbeats + self.metrics) / self.seconds

    @property
    def hb_per_s(self) -> float:
        return self.heartbeats / self.seconds

    def pct_ms(self, q: float) -> float:
        lat = sorted(self.latencies)
        return 1000 * lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat (fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(kind: str, run_dir: Path, core: int) -> subprocess.Popen:
    if kind == "rendezvous":
        create_secret(run_dir)
        cmd = [sys.executable, "-m", "streamrl_cli.rendezvous", "--run-dir", str(run_dir)]
        cmd += ["--lease-s", "60", "--log-level", "WARNING"]
    else:
        cmd = [sys.executable, __file__, "--baseline-server", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=ROOT, preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    deadline = time.monotonic() + 20
    while not (run_dir / "rendezvous.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{kind} server did not start (exit code {proc.returncode})")
        time.sleep(0.02)
    return proc


async def drive(
    url: str, token: str, ranks: range, start: float, end: float, interval: float | None = None
) -> Result:
    """Members `ranks` until `end`; requests sent in [start, end] are counted.

    Closed loop (next request as soon as the last answers) unless `interval` is given: then each
    member sends one request per `interval` seconds on its own schedule (open loop, paced), which
    is how real members behave and what the latency target is about.
    """
    res = Result("", len(ranks), end - start)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    # The client must outpace the server: strip what a load generator does not need
    # (cookies, decompression, per-request timeouts).
    session = aiohttp.ClientSession(
        url,
        connector=aiohttp.TCPConnector(limit=0),
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=None),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )
    async with session as http:

        async def member(rank: int) -> None:
            async with http.post("/v1/register", json={"role": "generator", "rank": rank}) as r:
                doc = await r.json()
            mid = doc.get("member_id", f"generator-{rank}")
            cred = doc.get("credential", "")  # calls in the member's own name carry it
            hb = json.dumps(
                {"member_id": mid, "credential": cred, "incarnation": doc.get("incarnation", 1)}
            ).encode()
            # Drop the peer list now: 512 of them kept alive would make the client's own
            # garbage collections pause it for a quarter second, and count that against the server.
            del doc
            i = 0
            due = time.monotonic() + (interval or 0) * (rank % 997) / 997  # spread the schedules
            while (t0 := time.monotonic()) < end:
                if interval is not None:
                    await asyncio.sleep(max(0.0, due - t0))
                    due += interval
                    t0 = time.monotonic()
                i += 1
                is_hb = i % METRICS_EVERY != 0
                if is_hb:
                    path, body = "/v1/heartbeat", hb
                else:
                    record = {"step": i, "tokens_per_s": 5000.0 + rank, "idle_ratio": 0.05, "queue_depth": 3}
                    path, body = (
                        "/v1/metrics",
                        json.dumps({"member_id": mid, "credential": cred, "record": record}).encode(),
                    )
                async with http.post(path, data=body) as r:
                    await r.read()
                    ok = r.status == 200
                t1 = time.monotonic()
                if start <= t0 and t1 <= end:
                    res.latencies.append(t1 - t0)
                    if not ok:
                        res.errors += 1
                    elif is_hb:
                        res.heartbeats += 1
                    else:
                        res.metrics += 1

        tasks = [asyncio.create_task(member(rank)) for rank in ranks]
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        own0 = time.process_time()
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        res.client_cpu = 100 * (time.process_time() - own0) / (end - start)
        await asyncio.gather(*tasks)
    return res


def client_process(
    core: int, url: str, token: str, ranks: range, start: float, end: float, interval: float | None
) -> Result:
    os.sched_setaffinity(0, {core})
    return new_loop().run_until_complete(drive(url, token, ranks, start, end, interval))


def run_one(
    kind: str,
    n: int,
    server_core: int,
    client_cores: list[int],
    warmup: float,
    seconds: float,
    interval: float | None = None,
) -> Result:
    """One measurement: a fresh server, N members spread over one client process per core."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{kind}-") as tmp:
        run_dir = Path(tmp)
        proc = start_server(kind, run_dir, server_core)
        try:
            url = json.loads((run_dir / "rendezvous.json").read_text())["url"]
            token = (run_dir / "secret").read_text().strip() if kind == "rendezvous" else "-"
            start = time.monotonic() + 0.3 + warmup  # forks, registrations and warm-up before it
            end = start + seconds
            k = len(client_cores)
            with ProcessPoolExecutor(k, mp_context=multiprocessing.get_context("fork")) as pool:
                futures = [
                    pool.submit(client_process, core, url, token, range(i, n, k), start, end, interval)
                    for i, core in enumerate(client_cores)
                ]
                time.sleep(max(0.0, start - time.monotonic()))
                cpu0 = cpu_seconds(proc.pid)
                time.sleep(max(0.0, end - time.monotonic()))
                server_cpu = 100 * (cpu_seconds(proc.pid) - cpu0) / seconds
                parts = [f.result() for f in futures]
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    res = Result(kind, n, seconds, server_cpu=server_cpu)
    for part in parts:
        res.heartbeats += part.heartbeats
        res.metrics += part.metrics
        res.errors += part.errors
        res.latencies += part.latencies
        res.client_cpu += part.client_cpu
    return res


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop  # the server uses it when installed; the client gets the same advantage

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def baseline_server(run_dir: Path) -> None:
    """aiohttp with nothing of ours: read the body, answer a constant JSON document."""
    from aiohttp import web

    async def trivial(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b'{"ok":true}', content_type="application/json")

    async def serve() -> None:
        app = web.Application()
        for path in ("/healthz", "/v1/register", "/v1/heartbeat", "/v1/metrics"):
            app.router.add_route("*", path, trivial)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        tmp = run_dir / "rendezvous.json.tmp"
        tmp.write_text(json.dumps({"url": f"http://127.0.0.1:{port}"}))
        tmp.rename(run_dir / "rendezvous.json")
        await asyncio.Event().wait()  # until SIGTERM

    new_loop().run_until_complete(serve())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,256,512", help="member counts N (comma-separated)")
    ap.add_argument("--seconds", type=float, default=4.0, help="measured seconds of one repeat")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per N and server; the best is kept")
    ap.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each measurement")
    ap.add_argument("--baseline-server", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline_server:
        return baseline_server(args.baseline_server)

    console = Console(width=130)
    allowed = sorted(os.sched_getaffinity(0))
    server_core, client_cores = allowed[0], allowed[1:] or allowed[:1]
    if len(allowed) < 2:
        console.print("[yellow]only one core available: server and client share it[/]")
    sizes = [int(x) for x in args.sizes.split(",")]
    results: list[Result] = []
    for n in sizes:
        for kind in ("baseline", "rendezvous"):
            # Best of the repeats: other work on the machine only ever slows a repeat down.
            reps = [
                run_one(kind, n, server_core, client_cores, args.warmup, args.seconds)
                for _ in range(args.repeats)
            ]
            r = max(reps, key=lambda x: x.hb_per_s)
            spread = ", ".join(f"{x.hb_per_s:.0f}" for x in reps)
            console.print(
                f"{kind:>10} N={n:<4} heartbeats/s {spread} (best kept); p99 {r.pct_ms(0.99):.1f} ms"
            )
            results.append(r)

    cores = ",".join(map(str, client_cores))
    table = Table(
        title=f"rendezvous server on core {server_core}, load from core(s) {cores}, "
        f"best of {args.repeats} x {args.seconds:g} s",
        caption="server us/req and heartbeats/s @1 core are derived from the server's CPU time: they show "
        "the server's cost even when the client is the bottleneck (client CPU ~100% per core)",
    )
    columns = ["server", "N", "requests/s", "heartbeats/s", "p50 ms", "p99 ms", "server CPU %"]
    columns += ["client CPU %", "server us/req", "heartbeats/s @1 core", "errors"]
    for col in columns:
        table.add_column(col, justify="left" if col == "server" else "right")
    for r in results:
        cpu = max(r.server_cpu, 1e-9) / 100
        table.add_row(
            "aiohttp floor" if r.server == "baseline" else "rendezvous",
            str(r.n),
            f"{r.rps:,.0f}",
            f"{r.hb_per_s:,.0f}",
            f"{r.pct_ms(0.50):.1f}",
            f"{r.pct_ms(0.99):.1f}",
            f"{r.server_cpu:.0f}",
            f"{r.client_cpu:.0f}",
            f"{1e6 * cpu / max(r.rps, 1e-9):.0f}",
            f"{r.hb_per_s / cpu:,.0f}",
            str(r.errors),
        )
    console.print(table)

    # The target itself: 512 members paced to 2,000 heartbeats/s in all (3 heartbeats : 1 metrics
    # post, as above), open loop: is p99 under 50 ms at that rate, on one server core?
    n_ref = 512
    # 5% above the target: timer slip makes a paced loop deliver slightly less than scheduled.
    interval = n_ref / (1.05 * TARGET_HB_PER_S / (1 - 1 / METRICS_EVERY))
    paced = {
        kind: run_one(kind, n_ref, server_core, client_cores, args.warmup, 2 * args.seconds, interval)
        for kind in ("baseline", "rendezvous")
    }
    table = Table(
        title=f"paced: {n_ref} members, one request every {interval * 1000:.0f} ms each (open loop)"
    )
    for col in ("server", "heartbeats/s", "requests/s", "p50 ms", "p99 ms", "server CPU %", "errors"):
        table.add_column(col, justify="left" if col == "server" else "right")
    for kind, r in paced.items():
        table.add_row(
            "aiohttp floor" if kind == "baseline" else "rendezvous",
            f"{r.hb_per_s:,.0f}",
            f"{r.rps:,.0f}",
            f"{r.pct_ms(0.5):.1f}",
            f"{r.pct_ms(0.99):.1f}",
            f"{r.server_cpu:.0f}",
            str(r.errors),
        )
    console.print(table)
    ours, floor = paced["rendezvous"], paced["baseline"]
    record = {
        "bench": "rendezvous",
        "metric": f"p99_ms_at_{ours.hb_per_s:.0f}_heartbeats_per_s_{n_ref}_members",
        "value": round(ours.pct_ms(0.99), 2),
        "baseline": round(floor.pct_ms(0.99), 2),
        "ratio": round(ours.pct_ms(0.99) / floor.pct_ms(0.99), 3),
        "target": 50,
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
