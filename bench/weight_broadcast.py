"""Benchmark: the bucketed weight broadcast (gloo, 2 processes) against a raw loopback socket copy.

    .venv/bin/python bench/weight_broadcast.py [--sizes-mb 128,512,1024] [--reps 3] [--bucket-mb 256]

This process is rank 0 (the trainer); a spawned process is rank 1 (a generator worker). For
each size, a transformer-like state dict (bf16 4096x4096 matrices, fp32 norm vectors) is sent
with ``BroadcastSender.send`` and received two ways: whole (``receive_weights``: the tensors are
kept, as an engine's loader holding them would) and per bucket (``on_bucket``: handed over and
dropped, as a loader copying into its parameters would). The baseline, in the same run between
the same two processes: ``socket.sendall`` of one preallocated buffer of the same byte count
into ``recv_into`` of another, over loopback TCP. Every transfer is timed on the sender from its
start until the receiver acknowledges the end (one byte back on the raw socket); repetitions
are interleaved and the median is reported. Ratio = baseline time / broadcast time (≥ 0.8).

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

from streamrl_cli.weights.broadcast import BroadcastSender, init_weight_group, receive_weights  # noqa: E402

MODES = ("raw socket", "bcast, kept", "bcast, per bucket")
TARGET = 0.8


def model(nbytes: int) -> dict[str, torch.Tensor]:
    """~nbytes of parameters: per layer one bf16 4096x4096 matrix (32 MiB) and two fp32 norms."""
    out, i = {}, 0
    while sum(t.numel() * t.element_size() for t in out.values()) < nbytes:
        out[f"layers.{i}.mlp.weight"] = torch.randn(4096, 4096).to(torch.bfloat16)
        out[f"layers.{i}.norm1.weight"] = torch.ones(4096)
        out[f"layers.{i}.norm2.weight"] = torch.ones(4096)
        i += 1
    return out


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    pos = 0
    while pos < len(view):
        n = sock.recv_into(view[pos:])
        if not n:
            raise ConnectionError("sender went away")
        pos += n


def receiver(group_port: int, raw_port: int, plan: list[tuple[str, int]]) -> None:
    torch.set_num_threads(1)
    group = init_weight_group(f"127.0.0.1:{group_port}", 1, 2, timeout_s=120)
    sock = socket.create_connection(("127.0.0.1", raw_port))
    buf = None
    for mode, nbytes in plan:
        if mode == MODES[0]:
            if buf is None or len(buf) != nbytes:
                buf = bytearray(nbytes)  # reused across repetitions, like a warm receive buffer
            recv_exact(sock, memoryview(buf))
        elif mode == MODES[1]:
            receive_weights(group)
        else:
            receive_weights(group, on_bucket=lambda bucket: None)
        sock.sendall(b"!")
    sock.close()
    group.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", default="128,512,1024")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=256)
    args = p.parse_args()
    console = Console(width=120)
    sizes = [int(s) << 20 for s in args.sizes_mb.split(",")]
    models = {n: model(n) for n in sizes}
    real = {n: sum(t.numel() * t.element_size() for t in m.values()) for n, m in models.items()}
    # One untimed warm-up round per size first: weights move every iteration, so the steady state
    # (buffers allocated and paged in on both sides) is what matters; the first round is reported apart.
    plan = [(mode, real[n]) for n in sizes for _ in range(args.reps + 1) for mode in MODES]

    listener = socket.create_server(("127.0.0.1", 0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        group_port = s.getsockname()[1]
    proc = mp.get_context("spawn").Process(
        target=receiver, args=(group_port, listener.getsockname()[1], plan)
    )
    proc.start()
    group = init_weight_group(f"127.0.0.1:{group_port}", 0, 2, timeout_s=120)
    sock, _ = listener.accept()
    sender = BroadcastSender(group, bucket_bytes=args.bucket_mb << 20)
    src = {n: bytearray(b"\x01") * real[n] for n in sizes}
    ack = bytearray(1)
    times: dict[tuple[str, int], list[float]] = {}
    for version, (mode, nbytes) in enumerate(plan):
        n = next(k for k in sizes if real[k] == nbytes)
        t0 = time.perf_counter()
        if mode == MODES[0]:
            sock.sendall(memoryview(src[n]))
        else:
            sender.send(models[n], version)
        recv_exact(sock, memoryview(ack))
        times.setdefault((mode, nbytes), []).append(time.perf_counter() - t0)
    first = {k: v.pop(0) for k, v in times.items()}  # the warm-up round
    proc.join(timeout=60)

    table = Table(
        title=f"weight broadcast, gloo, 2 processes, {args.bucket_mb} MiB buckets (median of {args.reps})"
    )
    for col in ("parameters", "tensors", "path", "first s", "median s", "best s", "GiB/s", "vs raw"):
        table.add_column(col, justify="right" if col not in ("path",) else "left")
    ratios = {}
    for n in sizes:
        base = statistics.median(times[(MODES[0], real[n])])
        for mode in MODES:
            ts = times[(mode, real[n])]
            med = statistics.median(ts)
            ratios[(mode, n)] = base / med
            row = [f"{real[n] / 2**20:.0f} MiB", str(len(models[n])), mode, f"{first[(mode, real[n])]:.3f}"]
            row += [f"{med:.3f}", f"{min(ts):.3f}"]
            table.add_row(*row, f"{real[n] / med / 2**30:.2f}", f"{base / med:.2f}")
    console.print(table)
    big = sizes[-1]
    worst = min(MODES[1:], key=lambda m: ratios[(m, big)])
    base_gib = real[big] / statistics.median(times[(MODES[0], real[big])]) / 2**30
    ours_gib = real[big] / statistics.median(times[(worst, real[big])]) / 2**30
    record = {
        "bench": "weight_broadcast",
        "metric": f"GiB_per_s_{real[big] >> 20}MiB_broadcast_worst_receive_mode_vs_raw_socket",
        "value": round(ours_gib, 3),
        "baseline": round(base_gib, 3),
        "ratio": round(ours_gib / base_gib, 3),
        "target": TARGET,
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
