"""Benchmark: the servers of a run under hostile input — peak memory, and whether they still serve.

    .venv/bin/python bench/hostile_input.py [--seed 0]

Each server runs in a process of its own (its memory is measured from outside, every 10 ms,
with psutil) on loopback; this process attacks it, then checks that a well-behaved peer is
still served:

- relay (WeightServer, 64 MiB published): 12 connections announcing a 64 MiB frame before the
  handshake and holding it open (what took protocol 1 from 237 MB to 1 GB), then 2,000
  connections of random bytes.
- sample stream (ZmqSampleReceiver + dispatcher): 20,000 hellos with distinct generator ids
  from a peer holding the run's keys (protocol 1: 20,004 "generators"), 2,000 random frames,
  and one frame past the 64 MiB limit.
- rendezvous: malformed bodies of every kind (random bytes, random JSON, 100,000-deep nesting,
  bodies past the size limit, non-ASCII and wrong tokens, control characters in metrics).

The last line is one JSON object for the benchmark record.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamrl_cli.transport import wire as w  # noqa: E402
from streamrl_cli.transport.zmq_common import curve_keys, make_client_socket  # noqa: E402

TOKEN = "bench-hostile-token-0123456789abcdef"
MB = 1 << 20


class Peak:
    """Samples a process' RSS every 10 ms in a thread; `.mb` is the peak so far."""

    def __init__(self, pid: int):
        self.proc, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def now_mb(self) -> float:
        return self.proc.memory_info().rss / MB

    def stop(self) -> float:
        self._stop.set()
        self._t.join()
        return self.peak / MB


# ---- relay ----


def relay_server(q) -> None:  # noqa: ANN001
    import torch

    from streamrl_cli.weights.relay import WeightServer

    srv = WeightServer(TOKEN, host="127.0.0.1", timeout_s=5)
    srv.publish(1, {"w": torch.ones(64 * MB // 4)})
    q.put(srv.address)
    time.sleep(3600)


def attack_relay(rng: random.Random) -> dict:
    from streamrl_cli.weights.relay import fetch_weights

    q = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=relay_server, args=(q,), daemon=True)
    proc.start()
    address = q.get(timeout=120)
    port = int(address.rsplit(":", 1)[1])
    time.sleep(0.5)
    peak = Peak(proc.pid)
    before = peak.now_mb()
    holders, tried = [], 0
    for _ in range(12):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.recv(4096)
        s.sendall(struct.pack(">I", 64 * MB))
        holders.append(s)
        tried += 1
    for _ in range(2000):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(rng.randbytes(rng.randint(0, 512)))
        except OSError:
            pass
        tried += 1
    time.sleep(0.5)
    ok = fetch_weights(address, TOKEN, streams=2, timeout_s=30).version == 1
    for s in holders:
        s.close()
    out = {
        "inputs": tried,
        "rss_before_mb": round(before, 1),
        "rss_peak_mb": round(peak.stop(), 1),
        "serves": ok,
    }
    proc.kill()
    return out


# ---- sample stream ----


def stream_server(q, stats_q) -> None:  # noqa: ANN001
    from streamrl_cli.transport.routing import DispatchService
    from streamrl_cli.transport.samples import StreamConfig

    svc = DispatchService(StreamConfig(bind="tcp://127.0.0.1:0", max_delay_s=0.001), TOKEN)
    svc._send(svc.dispatcher.require_registration(["generator-0"]))  # what watch(rdv) does
    q.put(svc.address)
    while True:
        cmd = stats_q.get()
        stats_q.put(
            {**svc.receiver.stats, "peers": len(svc.receiver.generators()), "alive": svc.generators()}
        )
        if cmd == "last":
            return


def attack_stream(rng: random.Random) -> dict:
    from streamrl_cli.transport.samples import StreamConfig, make_sender

    ctx = mp.get_context("spawn")
    q, stats_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=stream_server, args=(q, stats_q), daemon=True)
    proc.start()
    address = q.get(timeout=120)
    time.sleep(0.5)
    peak = Peak(proc.pid)
    before = peak.now_mb()
    zctx = zmq.Context()
    peer = make_client_socket(zctx, curve_keys(TOKEN))
    peer.sndhwm = 0
    peer.connect(f"tcp://{address}")
    for i in range(20_000):
        peer.send(w.message(w.HELLO, w.Hello(w.PROTOCOL, f"generator-{1000 + i}", "x")))
    for _ in range(2000):
        peer.send(rng.choice([w.HELLO, w.SAMPLES, w.REQUEST_ACK, b"?"]) + rng.randbytes(rng.randint(0, 300)))
    peer.send(b"S" + bytes(w.MAX_MESSAGE + 1))
    time.sleep(3)
    gen = make_sender(StreamConfig(), address=address, token=TOKEN, generator="generator-0")
    gen.wait_connected(30)
    stats_q.put("last")
    time.sleep(0.5)
    stats = stats_q.get(timeout=30)
    gen.close(0)
    zctx.destroy(linger=0)
    out = {
        "inputs": 22_001,
        "rss_before_mb": round(before, 1),
        "rss_peak_mb": round(peak.stop(), 1),
        "peer_table": stats["peers"],
        "generators_taking_work": stats["alive"],
        "malformed": stats["malformed"],
        "serves": stats["alive"] == ["generator-0"],
    }
    proc.kill()
    return out


# ---- rendezvous ----


def rendezvous_server(run_dir: str) -> None:
    from streamrl_cli.rendezvous.server import run

    token = (Path(run_dir) / "secret").read_text().strip()
    asyncio.run(run(Path(run_dir), host="127.0.0.1", port=0, lease_s=30.0, ssl_context=None, token=token))


def attack_rendezvous(rng: random.Random, tmp: Path) -> dict:
    from streamrl_cli.rendezvous import create_secret

    tmp.mkdir(parents=True, exist_ok=True)
    token = create_secret(tmp)
    proc = mp.get_context("spawn").Process(target=rendezvous_server, args=(str(tmp),), daemon=True)
    proc.start()
    deadline = time.monotonic() + 60
    while not (tmp / "rendezvous.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    url = json.loads((tmp / "rendezvous.json").read_text())["url"]
    peak = Peak(proc.pid)
    before = peak.now_mb()
    codes: dict[int, int] = {}
    posts = ["/v1/register", "/v1/heartbeat", "/v1/leave", "/v1/versions/propose", "/v1/versions/confirm",
             "/v1/metrics", "/v1/progress"]  # fmt: skip
    bodies = []
    for _ in range(1500):
        bodies.append(rng.randbytes(rng.randint(0, 600)))
    bodies += [
        b"[" * 100_000 + b"]" * 100_000,
        b"{" + b" " * (300 * 1024) + b"}",
        b'{"role": "x", "rank": -1}',
    ]
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10) as http:
        cred = http.post("/v1/register", json={"role": "generator", "rank": 0}).json()["credential"]
        for _ in range(1500):  # in the member's own name: the strings reach the server's cleaning
            member = {"member_id": "generator-0", "credential": cred}
            bodies.append(json.dumps({**member, "record": {chr(rng.randint(0, 0x3000)): "\x1b[2J"}}).encode())
        for body in bodies:
            r = http.post(rng.choice(posts), content=body, headers={"Content-Type": "application/json"})
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
        for auth in ["Bearer \xe9\xe9".encode("latin-1"), b"Bearer wrong", b"Basic x"]:
            with socket.create_connection((http.base_url.host, http.base_url.port)) as s:
                s.sendall(
                    b"GET /v1/members HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: "
                    + auth
                    + b"\r\n\r\n"
                )
                status = int(s.recv(64).split()[1])
                codes[status] = codes.get(status, 0) + 1
        serves = http.get("/v1/members").status_code == 200
    text = (tmp / "metrics.jsonl").read_bytes().decode()
    out = {
        "inputs": len(bodies) + 3,
        "status_codes": dict(sorted(codes.items())),
        "rss_before_mb": round(before, 1),
        "rss_peak_mb": round(peak.stop(), 1),
        "metrics_lines_with_control_chars": sum(
            any(c in ln for c in "\x1b\u2028\u2029") for ln in text.splitlines()
        ),
        "serves": serves,
    }
    proc.kill()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (
            ("relay", lambda: attack_relay(rng)),
            ("sample_stream", lambda: attack_stream(rng)),
            ("rendezvous", lambda: attack_rendezvous(rng, Path(tmp) / "rdv")),
        ):
            t = time.perf_counter()
            results[name] = {**fn(), "seconds": round(time.perf_counter() - t, 1)}
            print(name, json.dumps(results[name]), flush=True)
    total = sum(r["inputs"] for r in results.values())
    five = sum(n for c, n in results["rendezvous"]["status_codes"].items() if c >= 500)
    # The headline: how much of what the attackers asked the relay to allocate before the handshake
    # (12 frames of 64 MiB, the attack of this run) the worst server actually grew by.
    asked_mb = 12 * 64
    growth = max(r["rss_peak_mb"] - r["rss_before_mb"] for r in results.values())
    print(f"worst server growth {growth:.1f} MB of the {asked_mb} MB the attack asked for; "
          f"{total} malformed inputs, {five} HTTP 5xx")  # fmt: skip
    print(json.dumps({"bench": "hostile_input", "metric": "worst_server_rss_growth_mb_vs_pre_auth_asked",
                      "value": round(growth, 1), "baseline": asked_mb, "ratio": round(growth / asked_mb, 4),
                      "target": 0.05, "malformed_inputs": total, "http_5xx": five,
                      "all_serve": all(r["serves"] for r in results.values()),
                      **{f"{k}_rss_peak_mb": r["rss_peak_mb"] for k, r in results.items()}}))  # fmt: skip
    os._exit(0)


if __name__ == "__main__":
    main()
