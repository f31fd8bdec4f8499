"""Benchmark: the cross-site relay (chunked, checksummed, several streams) against a raw socket copy.

    .venv/bin/python bench/weight_relay.py [--sizes-mb 128,512,1024] [--reps 3] [--streams 1,2,4]

A spawned process plays the trainer: it publishes the weights on a WeightServer and also
serves the baseline, one preallocated buffer of the same byte count written with
``socket.sendall``. This process plays the relay: ``fetch_weights`` (every chunk verified, the
previous version's buffer reused, as a relay does every step) against ``recv_into`` of one
preallocated buffer. Both are timed here, on the receiving side, from the request to the last
verified byte; every fetch is of a newly published version (so the server computes its digests
then, as in a run); one untimed warm-up round per size, then repetitions interleaved, median
reported. The snapshot the trainer takes on publish (a copy of the weights, off the transfer
path) is reported apart. Ratio = baseline time / relay time with the default 4 streams (≥ 0.7).

Also measured, to choose defaults: checksum speeds (crc32, blake2b, xxh3 if installed) and
what lossless compression (zlib level 1, zstd if installed) saves on these weights and costs,
with the link bandwidth below which it would pay.

The last line of output is one JSON object for the benchmark record.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamrl_cli.weights import relay_wire as rw  # noqa: E402
from streamrl_cli.weights.relay import WeightServer, fetch_weights  # noqa: E402

TOKEN = "bench-relay-token-0123456789abcdef"
TARGET = 0.7
DEFAULT_STREAMS = 4


def model(nbytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """~nbytes of trained-looking bf16 weights (normal, std 0.02) and fp32 norms."""
    g = torch.Generator().manual_seed(seed)
    out, i = {}, 0
    while sum(t.numel() * t.element_size() for t in out.values()) < nbytes:
        out[f"layers.{i}.mlp.weight"] = (torch.randn(4096, 4096, generator=g) * 0.02).to(torch.bfloat16)
        out[f"layers.{i}.norm.weight"] = torch.ones(4096)
        i += 1
    return out


def trainer(sizes: list[int], conn, raw_port_q) -> None:
    torch.set_num_threads(1)
    # Default digest: xxh3_64 (crc32 without xxhash). Whole versions only: what this measures is the
    # transfer and the snapshot, not delta versions (their cost: docs/data-plane.md).
    server = WeightServer(TOKEN, host="127.0.0.1", delta=False)
    listener = socket.create_server(("127.0.0.1", 0))
    raw_port_q.put((server.address, listener.getsockname()[1]))
    raw, _ = listener.accept()
    bufs, models = {}, {}
    while True:
        cmd = conn.recv()
        if cmd[0] == "publish":  # a new version: a fresh snapshot, digests not computed yet
            weights = models.setdefault(cmd[1], model(cmd[1]))
            t0 = time.perf_counter()
            m = server.publish(cmd[2], weights)
            conn.send((time.perf_counter() - t0, m.total))
        elif cmd[0] == "raw":  # the receiver asks, we send its size from a warm buffer
            n = cmd[1]
            if n not in bufs:
                bufs[n] = bytearray(b"\x01") * n
            conn.send("ready")
            raw.recv(1)
            raw.sendall(memoryview(bufs[n]))
        else:
            server.close()
            return


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    pos = 0
    while pos < len(view):
        n = sock.recv_into(view[pos:])
        if not n:
            raise ConnectionError("sender went away")
        pos += n


def speeds(sample: bytes) -> Table:
    t = Table(title=f"per-chunk work on {len(sample) >> 20} MiB of these weights (one core)")
    for col in ("what", "GiB/s", "bytes kept", "pays below link of"):
        t.add_column(col, justify="left" if col == "what" else "right")
    for name, fn in rw.CHECKSUMS.items():
        fn(sample[: 1 << 20])
        t0 = time.perf_counter()
        fn(sample)
        t.add_row(f"checksum {name}", f"{len(sample) / (time.perf_counter() - t0) / 2**30:.2f}", "", "")
    for codec in ("zlib", "zstd"):
        try:
            rw.compress(codec, b"probe")
        except rw.WeightTransferError:
            t.add_row(f"compress {codec}", "not installed", "", "")
            continue
        t0 = time.perf_counter()
        packed = rw.compress(codec, sample)
        dt = time.perf_counter() - t0
        kept = len(packed) / len(sample)
        rate = len(sample) / dt  # bytes/s of raw input, one core
        # Compressing pays when sending the saved bytes takes longer than compressing them:
        # link < rate * (1 - kept)  (per core; the relay's streams can use several).
        break_even = rate * (1 - kept)
        row = [f"compress {codec} (level 1)", f"{rate / 2**30:.2f}", f"{kept:.1%}"]
        t.add_row(*row, f"{break_even * 8 / 1e9:.2f} Gbit/s")
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", default="128,512,1024")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--streams", default="1,2,4")
    args = p.parse_args()
    console = Console(width=120)
    sizes = [int(s) << 20 for s in args.sizes_mb.split(",")]
    streams = [int(s) for s in args.streams.split(",")]
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    q = ctx.Queue()
    proc = ctx.Process(target=trainer, args=(sizes, theirs, q))
    proc.start()
    address, raw_port = q.get(timeout=60)
    raw = socket.create_connection(("127.0.0.1", raw_port))

    rows, medians, totals = [], {}, {}
    out = None
    version = 0
    for n in sizes:
        version += 1
        ours.send(("publish", n, version))
        _, total = ours.recv()
        totals[n] = total
        rbuf = bytearray(total)
        times: dict[str, list[float]] = {}
        publish_times = []
        for rep in range(args.reps + 1):
            for mode in ["raw socket", *[f"relay, {s} stream(s)" for s in streams]]:
                if mode != "raw socket":  # every fetch is of a new version, as in a run
                    version += 1
                    ours.send(("publish", n, version))
                    publish_times.append(ours.recv()[0])
                t0 = time.perf_counter()
                if mode == "raw socket":
                    ours.send(("raw", total))
                    ours.recv()
                    t0 = time.perf_counter()
                    raw.sendall(b"g")
                    recv_exact(raw, memoryview(rbuf))
                else:
                    s = int(mode.split(", ")[1].split()[0])
                    got = fetch_weights(address, TOKEN, streams=s, out=out)
                    out = got.buffer
                    assert got.version == version and got.stats["corrupted"] == 0
                dt = time.perf_counter() - t0
                if rep:  # rep 0 is the warm-up
                    times.setdefault(mode, []).append(dt)
        base, publish_s = statistics.median(times["raw socket"]), statistics.median(publish_times)
        for mode, ts in times.items():
            med = medians[(mode, n)] = statistics.median(ts)
            rows.append([f"{total / 2**20:.0f} MiB", mode, f"{med:.3f}", f"{min(ts):.3f}",
                         f"{total / med / 2**30:.2f}", f"{base / med:.2f}", f"{publish_s:.3f}"])  # fmt: skip
    ours.send(("stop",))
    proc.join(timeout=30)

    digest = rw.default_checksum()
    table = Table(title=f"weight relay over loopback TCP, 8 MiB chunks, {digest} (median of {args.reps})")
    for col in ("weights", "path", "median s", "best s", "GiB/s", "vs raw", "publish snapshot s"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for r in rows:
        table.add_row(*r)
    console.print(table)
    sample = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in model(64 << 20).values())
    console.print(speeds(sample[: 64 << 20]))

    big = sizes[-1]
    key = f"relay, {DEFAULT_STREAMS if DEFAULT_STREAMS in streams else streams[-1]} stream(s)"
    total, raw_s, relay_s = totals[big], medians[("raw socket", big)], medians[(key, big)]
    record = {
        "bench": "weight_relay",
        "metric": f"GiB_per_s_{total >> 20}MiB_{key.replace(', ', '_').replace(' ', '_')}_vs_raw_socket",
        "value": round(total / relay_s / 2**30, 3),
        "baseline": round(total / raw_s / 2**30, 3),
        "ratio": round(raw_s / relay_s, 3),
        "target": TARGET,
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
