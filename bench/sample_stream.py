"""Benchmark: what streaming samples adds to a generator's generation time, and how fast the stream goes.

    .venv/bin/python bench/sample_stream.py [--seconds 4] [--reps 5] [--rate 1000] [--tokens 1024]

A spawned process plays one generator whose engine thread is busy all the time, as a vLLM
engine's main thread is on a GPU node: each sample costs it 1/``--rate`` s of pure-Python work
(output processing, scheduling) before it makes the sample (fresh lists of 1K token ids below
152K, the Qwen2.5 vocabulary, and float log-probs) and hands it to ``ZmqSampleSender``; a
``ZmqSampleReceiver`` in this process (the trainer) takes every sample. ``--placement``:
``gil-core`` (default) pins the engine and the sender's Python I/O thread to core 0 (they share the
GIL, so they never run at once anyway) and ZeroMQ's threads and the trainer to core 1: what slows
the engine is then the streaming work itself and the GIL, not a core lost to the trainer, as on a
GPU node with cores to spare (this VM has two); ``split`` puts the sender's I/O thread on core 1
too, which makes it read every sample across cores (on this VM that doubles its cost); ``os`` pins
nothing (then the trainer's threads take turns on the engine's core, and wall times say little).

Phases, interleaved ``--reps`` times: the engine alone, then the engine streaming. Per streaming
phase, the CPU per sample that holds the GIL — inside ``send()`` on the engine's thread (timed
around each call, the timer's own cost taken off) and in every other Python thread (from
``/proc/self/task/*/schedstat``) — against the budget of one sample at that rate (1 ms: the
generation time it is added to; target < 1%); ZeroMQ's I/O thread (CURVE encryption, TCP; outside
the GIL) alongside; and the engine's wall time against the phase without streaming (the literal
"adds to generation time", noisy on a shared VM). Then a control, as many interleaved pairs again:
the engine alone against the engine burning, per sample, exactly the CPU streaming took and doing
nothing else — on this VM a small CPU addition shows as several times its size in wall time, and the
control says how much. Then flat out: end-to-end throughput with acknowledgements and back-pressure.

Baselines, in the same run: the budget above, msgspec encoding alone, and the floor of the
transport itself — the same encoded bytes pushed flat out through a bare ZeroMQ PUSH/PULL pair
(no CURVE, no acks).

The last line of output is one JSON object for the benchmark record.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time
import timeit
from pathlib import Path

import msgspec
import zmq
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamrl_cli.transport.samples import StreamConfig, make_receiver, make_sender  # noqa: E402
from streamrl_cli.transport.wire import Sample, encode  # noqa: E402

TOKEN = "bench-sample-stream-token-0123456789"
TARGET = 0.01  # of the generation time per sample


def template(tokens: int) -> Sample:
    rng = random.Random(0)
    return Sample(
        prompt_id="",
        sample_index=0,
        token_ids=[rng.randrange(152_000) for _ in range(tokens)],
        logprobs=[-rng.expovariate(1.0) for _ in range(tokens)],
        finish_reason="stop",
        weight_version=7,
    )


def thread_ns(tid: int) -> int:
    """CPU time of one thread of this process, ns (schedstat: exact, unlike stat's 10 ms ticks)."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])


def zmq_threads() -> list[int]:
    out = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().startswith("ZMQbg/IO"):
                out.append(int(tid))
    return out


def python_threads_ns(engine: int) -> int:
    """CPU of every Python thread of this process but the engine's: the sender's I/O thread, and
    pyzmq's garbage collector thread, which lets go of messages sent without a copy."""
    zmq_tids = set(zmq_threads())
    return sum(thread_ns(int(t)) for t in os.listdir("/proc/self/task") if int(t) not in zmq_tids | {engine})


def burn(iterations: int) -> int:
    """Pure-Python work holding the GIL: the engine's own per-sample cost."""
    x = 0
    for i in range(iterations):
        x += i * i
    return x


def calibrate(seconds: float) -> int:
    """Iterations of burn() that take `seconds` on this thread now."""
    n = 1000
    while True:
        t = time.perf_counter()
        burn(n)
        took = time.perf_counter() - t
        if took > 0.05:
            return max(1, int(n * seconds / took))
        n *= 2


def pin(process: int | None, core: int) -> None:
    """Every thread of this process (or just `process`, a thread id) onto one core."""
    for tid in [process] if process else [int(t) for t in os.listdir("/proc/self/task")]:
        os.sched_setaffinity(tid, {core % os.cpu_count()})


def generator(address: str, args: argparse.Namespace, q: mp.Queue) -> None:
    base = template(args.tokens)
    sender = make_sender(StreamConfig(), address=address, token=TOKEN, generator="generator-0")
    sender.wait_connected(30)
    io_tid = sender._thread.native_id  # the sender's I/O thread (a Python thread)
    engine = threading.get_native_id()
    if args.placement != "os":
        pin(None, 1)  # ZeroMQ's threads (and the sender's I/O thread with --placement split) ...
        pin(threading.get_native_id(), 0)  # ... and the engine's own core
    if args.placement == "gil-core":
        pin(io_tid, 0)
    timer = min(timeit.repeat(time.thread_time_ns, number=10_000, repeat=5)) / 10_000 * 1e9  # ns per call
    n = int(args.rate * args.seconds)
    res: dict = {"alone": [], "streaming": [], "alone2": [], "control": []}

    def make(phase: str, i: int) -> Sample:
        # A fresh sample, as an engine hands over: new lists, the data hot in cache.
        s = msgspec.structs.replace(
            base, prompt_id=f"{phase}/p{i // 8}", sample_index=i % 8,
            token_ids=[t + 0 for t in base.token_ids], logprobs=[x * 1.0 for x in base.logprobs],
        )  # fmt: skip
        s.finished_at = time.time()
        return s

    work = calibrate(1.0 / args.rate)
    t0 = time.perf_counter()
    for i in range(200):
        make("cal", i)
    work = max(1, int(work * (1 - (time.perf_counter() - t0) / 200 * args.rate)))  # making it counts too
    extra = 0  # the control's burn per sample: as much CPU as streaming took (known after its phases)
    for pair in (("alone", "streaming"), ("alone2", "control")):
        if pair[1] == "control":
            gil = statistics.median(r["send_us"] + r["io_us"] for r in res["streaming"])
            extra = max(1, int(work * gil * args.rate / 1e6))
        for rep in range(args.reps):
            for phase in pair if rep % 2 == 0 else pair[::-1]:  # ABBA: drift cancels
                zmq_tids = zmq_threads()
                io0, z0 = python_threads_ns(engine), sum(thread_ns(t) for t in zmq_tids)
                in_send = 0
                t_start = time.perf_counter()
                for i in range(n):
                    burn(work)
                    s = make(f"{phase}{rep}", i)
                    if phase == "streaming":
                        c = time.thread_time_ns()
                        sender.send(s, timeout=60)
                        in_send += time.thread_time_ns() - c
                    elif phase == "control":
                        c = time.thread_time_ns()
                        burn(extra)
                        in_send += time.thread_time_ns() - c
                wall = time.perf_counter() - t_start
                sender.flush(60)
                res[phase].append(
                    {
                        "wall": wall,
                        "send_us": max(0.0, in_send / n - timer) / 1e3,
                        "io_us": (python_threads_ns(engine) - io0) / n / 1e3,
                        "zmq_us": (sum(thread_ns(t) for t in zmq_tids) - z0) / n / 1e3,
                    }
                )
    pin(None, 0)
    samples = [make("flat", i) for i in range(args.flat)]  # made first: the sender's CPU alone is timed
    zmq_tids = zmq_threads()
    io0, z0, c0 = python_threads_ns(engine), sum(thread_ns(t) for t in zmq_tids), time.thread_time()
    for s in samples:
        sender.send(s, timeout=60)
    sender.flush(60)
    res["flat_us"] = (
        (
            (time.thread_time() - c0)
            + (python_threads_ns(engine) - io0) / 1e9
            + (sum(thread_ns(t) for t in zmq_tids) - z0) / 1e9
        )
        / args.flat
        * 1e6
    )
    res["size"] = len(encode(base))
    reps = 2000
    c0 = time.thread_time()
    for _ in range(reps):
        encode(base)
    res["encode_us"] = (time.thread_time() - c0) / reps * 1e6
    q.put(res)
    sender.close()


def raw_floor(data: bytes, n: int) -> dict[str, float]:
    """Bare PUSH/PULL, no security, no acks: the transport's own floor for the same bytes."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    done = threading.Event()
    threading.Thread(
        target=lambda: ([pull.recv(copy=False) for _ in range(n)], done.set()), daemon=True
    ).start()
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        push.send(data)
    send_cpu = time.thread_time() - c0
    done.wait(60)
    wall = time.perf_counter() - t0
    ctx.destroy(linger=0)
    return {"rate": n / wall, "send_us": send_cpu / n * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=4.0, help="length of each phase")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions of both phases")
    p.add_argument("--rate", type=float, default=1000.0, help="samples/s the engine makes")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--flat", type=int, default=20000, help="samples sent flat out at the end")
    p.add_argument(
        "--placement", choices=("gil-core", "split", "os"), default="gil-core",
        help="gil-core: the sender's I/O thread on the engine's core (they share the GIL anyway); "
        "split: on the other core with ZeroMQ's threads and the trainer; os: no pinning at all",
    )  # fmt: skip
    args = p.parse_args()
    console = Console(width=120)
    if args.placement != "os":
        pin(None, 1)
    receiver = make_receiver(StreamConfig(bind="tcp://127.0.0.1:0"), token=TOKEN)
    latencies, arrivals = [], []
    total = int(args.rate * args.seconds) * args.reps + args.flat  # (the control phases send nothing)

    def consume() -> None:
        for _ in range(total):
            s = receiver.get(timeout=300)
            now = time.time()
            if s.prompt_id.startswith("streaming"):
                latencies.append(now - s.finished_at)
            elif s.prompt_id.startswith("flat"):
                arrivals.append(time.perf_counter())

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    if args.placement != "os":
        pin(None, 1)
    q = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=generator, args=(receiver.address, args, q))
    with console.status(f"{args.reps} × 2 phases of {args.seconds:.0f} s, then {args.flat} samples flat out"):
        proc.start()
        res = q.get(timeout=600)
        consumer.join(timeout=60)
        proc.join(timeout=30)
    receiver.close()
    floor = raw_floor(encode(template(args.tokens)), args.flat)

    budget_us = 1e6 / args.rate
    alone, streaming = res["alone"], res["streaming"]
    t = Table(title=f"{args.tokens}-token samples ({res['size'] / 1024:.1f} KiB) at {args.rate:.0f}/s, "
                    f"{args.reps} interleaved repetitions")  # fmt: skip
    for col in ("rep", "engine alone s", "engine streaming s", "wall +%", "send() µs", "I/O + gc threads µs",
                "GIL µs / sample", "ZeroMQ thread µs"):  # fmt: skip
        t.add_column(col, justify="right")
    gil = [r["send_us"] + r["io_us"] for r in streaming]
    wall = [b["wall"] / a["wall"] - 1 for a, b in zip(alone, streaming, strict=True)]
    for k, (a, b) in enumerate(zip(alone, streaming, strict=True)):
        t.add_row(str(k), f"{a['wall']:.3f}", f"{b['wall']:.3f}", f"{wall[k]:+.2%}", f"{b['send_us']:.2f}",
                  f"{b['io_us']:.2f}", f"{gil[k]:.2f}", f"{b['zmq_us']:.2f}")  # fmt: skip
    med = {k: statistics.median(r[k] for r in streaming) for k in ("send_us", "io_us", "zmq_us")}
    gil_med, wall_med = statistics.median(gil), statistics.median(wall)
    t.add_row("median", f"{statistics.median(a['wall'] for a in alone):.3f}",
              f"{statistics.median(b['wall'] for b in streaming):.3f}", f"{wall_med:+.2%}",
              f"{med['send_us']:.2f}", f"{med['io_us']:.2f}", f"{gil_med:.2f}", f"{med['zmq_us']:.2f}",
              style="bold")  # fmt: skip
    console.print(t)
    control = [b["wall"] / a["wall"] - 1 for a, b in zip(res["alone2"], res["control"], strict=True)]
    control_cpu = statistics.median(r["send_us"] for r in res["control"])
    control_med = statistics.median(control)
    console.print(
        f"control, {args.reps} more interleaved pairs: the engine burning {control_cpu:.2f} µs more per "
        f"sample (the streaming phases' GIL cost) and nothing else: wall {control_med:+.2%} (per pair: "
        + ", ".join(f"{c:+.1%}" for c in control)
        + f"); streaming: {wall_med:+.2%}. A wall overhead like the control's is the CPU cost itself; "
        "more would be GIL handoffs and cache pollution."
    )
    console.print(
        f"GIL-side cost per sample (send() + the other Python threads): {gil_med:.2f} µs = "
        f"{gil_med / budget_us:.2%} of one sample's {budget_us:.0f} µs (target < {TARGET:.0%}); "
        f"with ZeroMQ's thread (other core, no GIL): {(gil_med + med['zmq_us']) / budget_us:.2%}"
    )
    lat = sorted(latencies)
    span = arrivals[-1] - arrivals[0]
    t2 = Table(title="stream throughput and latency")
    for col in ("what", "value"):
        t2.add_column(col, justify="left" if col == "what" else "right")
    t2.add_row("streaming: latency finished -> trainer get(), p50 / p99 ms",
               f"{1e3 * lat[len(lat) // 2]:.2f} / {1e3 * lat[int(0.99 * len(lat))]:.2f}")  # fmt: skip
    t2.add_row("flat out: samples/s (acked, CURVE)", f"{(args.flat - 1) / span:.0f}")
    t2.add_row("flat out: MB/s", f"{(args.flat - 1) / span * res['size'] / 1e6:.0f}")
    t2.add_row("flat out: sender CPU µs / sample (all threads)", f"{res['flat_us']:.2f}")
    t2.add_row("baseline: msgspec encode alone, hot loop, µs", f"{res['encode_us']:.2f}")
    t2.add_row("baseline: bare PUSH/PULL, same bytes, msgs/s", f"{floor['rate']:.0f}")
    t2.add_row("baseline: bare PUSH/PULL, send() µs / msg", f"{floor['send_us']:.2f}")
    console.print(t2)
    record = {
        "bench": "sample_stream",
        "metric": f"gil_us_per_{args.tokens}_token_sample_at_{args.rate:.0f}_per_s",
        "value": round(gil_med, 2),
        "baseline": round(budget_us, 1),
        "ratio": round(gil_med / budget_us, 4),
        "target": TARGET,
        "all_threads_ratio": round((gil_med + med["zmq_us"]) / budget_us, 4),
        "wall_overhead": round(wall_med, 4),
        "wall_overhead_control_same_cpu": round(control_med, 4),
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
