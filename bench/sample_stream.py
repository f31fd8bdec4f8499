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

Phases, ``--reps`` times each, in an order rotated per repetition (drift spreads over all):
the engine alone; the engine streaming; a control that burns, per sample, exactly the CPU streaming
took from the engine's side of the GIL and does nothing else; and the engine alone while another
generator process streams at the same rate on the other core (what the trainer's receiving and
ZeroMQ's threads there do to the engine's core). While streaming, a thread waits for requests as
the generator role's request loop does; it shares the GIL too. Per streaming phase, the CPU per
sample that holds the GIL -- inside ``send()`` on the engine's thread (timed around each call, the
timer's own cost taken off) and in every other Python thread (from
``/proc/self/task/*/schedstat``) -- against the budget of one sample at that rate (1 ms: the
generation time it is added to; target < 1%); ZeroMQ's I/O thread (CURVE, TCP; outside the GIL)
and page faults alongside; and each phase's wall time against the alone phase of its repetition
(the literal "adds to generation time", noisy on a shared VM: the controls say how noisy). Then
flat out: end-to-end throughput with acknowledgements and back-pressure.

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
from typing import Any

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
    """CPU of every Python thread of this process but the engine's: the sender's I/O thread, the
    request loop, and pyzmq's garbage collector thread, which lets go of messages sent without a copy."""
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


def minor_faults(tid: int | None = None) -> int:
    """Minor page faults of one thread of this process, or all of it (fresh memory touched: kernel time)."""
    with open(f"/proc/self/task/{tid}/stat" if tid else "/proc/self/stat") as f:
        return int(f.read().rpartition(")")[2].split()[7])


PHASES = ("alone", "streaming", "control", "neighbour")


def generator(address: str, args: argparse.Namespace, q: mp.Queue, neighbour: Any) -> None:
    base = template(args.tokens)
    engine = threading.get_native_id()
    sender = make_sender(StreamConfig(), address=address, token=TOKEN, generator="generator-0")
    sender.wait_connected(30)
    io_tid = sender._thread.native_id  # the sender's I/O thread (a Python thread)
    streaming, stop = threading.Event(), threading.Event()

    def request_loop() -> None:
        # As the generator role's request loop (streamrl_cli/generator/main.py), while streaming.
        while not stop.is_set():
            if streaming.wait(0.1):
                sender.requests(timeout=0.5)

    requests_thread = threading.Thread(target=request_loop, daemon=True)
    requests_thread.start()
    if args.placement != "os":
        pin(None, 1)  # ZeroMQ's threads (and the sender's I/O thread with --placement split) ...
        pin(engine, 0)  # ... and the engine's own core, with the request thread (it shares the GIL)
        pin(requests_thread.native_id, 0)
    if args.placement == "gil-core":
        pin(io_tid, 0)
    timer = min(timeit.repeat(time.thread_time_ns, number=10_000, repeat=5)) / 10_000 * 1e9  # ns per call
    n = int(args.rate * args.seconds)
    res: dict = {p: [] for p in PHASES}

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
    extra = 0  # the control's burn per sample: as much CPU as streaming took (known after a warm-up)

    def phase_run(phase: str, tag: str, count: int) -> dict:
        if phase == "streaming":
            streaming.set()
        elif phase == "neighbour":
            neighbour.set()
            time.sleep(0.2)  # its stream in full swing
        zmq_tids = zmq_threads()
        py0, z0 = python_threads_ns(engine), sum(thread_ns(t) for t in zmq_tids)
        in_send, f0, fa0 = 0, minor_faults(engine), minor_faults()
        t_start = time.perf_counter()
        for i in range(count):
            burn(work)
            s = make(tag, i)
            if phase == "streaming":
                c = time.thread_time_ns()
                sender.send(s, timeout=60)
                in_send += time.thread_time_ns() - c
            elif phase == "control":
                c = time.thread_time_ns()
                burn(extra)
                in_send += time.thread_time_ns() - c
        wall = time.perf_counter() - t_start
        faults, faults_all = minor_faults(engine) - f0, minor_faults() - fa0
        neighbour.clear()
        sender.flush(60)
        streaming.clear()
        return {
            "wall": wall,
            "send_us": max(0.0, in_send / count - timer) / 1e3,
            "py_us": (python_threads_ns(engine) - py0) / count / 1e3,
            "zmq_us": (sum(thread_ns(t) for t in zmq_tids) - z0) / count / 1e3,
            "faults": faults / count,
            "faults_all": faults_all / count,
        }

    warm = phase_run("streaming", "warm", n)
    extra = max(1, int(work * (warm["send_us"] + warm["py_us"]) * args.rate / 1e6))
    for rep in range(args.reps):
        for k in range(len(PHASES)):
            phase = PHASES[(k + rep) % len(PHASES)]
            res[phase].append(phase_run(phase, f"{phase}{rep}", n))
    stop.set()
    pin(None, 0)
    samples = [make("flat", i) for i in range(args.flat)]  # made first: the sender's CPU alone is timed
    zmq_tids = zmq_threads()
    io0, z0, c0 = python_threads_ns(engine), sum(thread_ns(t) for t in zmq_tids), time.thread_time()
    for s in samples:
        sender.send(s, timeout=60)
    sender.flush(60)
    res["flat_us"] = (
        (time.thread_time() - c0) * 1e9
        + python_threads_ns(engine) - io0
        + sum(thread_ns(t) for t in zmq_tids) - z0
    ) / args.flat / 1e3  # fmt: skip
    res["size"] = len(encode(base))
    reps = 2000
    c0 = time.thread_time()
    for _ in range(reps):
        encode(base)
    res["encode_us"] = (time.thread_time() - c0) / reps * 1e6
    q.put(res)
    sender.close()


def neighbour_main(address: str, args: argparse.Namespace, go: Any, stop: Any) -> None:
    """Another generator on the other core, streaming at the same rate while `go` is set: the engine's
    process streams nothing meanwhile, so what slows it then is the other core's streaming work (this
    sender, the trainer's receiving, ZeroMQ's threads) and nothing in the engine's process."""
    pin(None, 1)
    base = template(args.tokens)
    sender = make_sender(StreamConfig(), address=address, token=TOKEN, generator="generator-1")
    sender.wait_connected(30)
    i = 0
    while not stop.is_set():
        if not go.wait(0.1):
            continue
        t0 = time.perf_counter()
        sender.send(
            msgspec.structs.replace(base, prompt_id=f"neighbour/p{i // 8}", sample_index=i % 8), timeout=60
        )
        i += 1
        time.sleep(max(0.0, 1.0 / args.rate - (time.perf_counter() - t0)))
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
    console = Console(width=130)
    if args.placement != "os":
        pin(None, 1)
    receiver = make_receiver(StreamConfig(bind="tcp://127.0.0.1:0"), token=TOKEN)
    latencies, arrivals = [], []
    done = threading.Event()

    def consume() -> None:
        while not done.is_set():
            s = receiver.get(timeout=0.2)
            if s is None:
                continue
            now = time.time()
            if s.prompt_id.startswith("streaming"):
                latencies.append(now - s.finished_at)
            elif s.prompt_id.startswith("flat"):
                arrivals.append(time.perf_counter())

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    spawn = mp.get_context("spawn")
    q, go, stop = spawn.Queue(), spawn.Event(), spawn.Event()
    proc = spawn.Process(target=generator, args=(receiver.address, args, q, go))
    other = spawn.Process(target=neighbour_main, args=(receiver.address, args, go, stop))
    other.start()
    with console.status(
        f"{args.reps} × {len(PHASES)} phases of {args.seconds:.0f} s, then {args.flat} samples flat out"
    ):
        proc.start()
        res = q.get(timeout=600)
        deadline = time.monotonic() + 60
        while len(arrivals) < args.flat and time.monotonic() < deadline:
            time.sleep(0.1)
        done.set()
        stop.set()
        consumer.join(timeout=60)
        proc.join(timeout=30)
        other.join(timeout=30)
    receiver.close()
    floor = raw_floor(encode(template(args.tokens)), args.flat)

    budget_us = 1e6 / args.rate
    over = {
        ph: [b["wall"] / a["wall"] - 1 for a, b in zip(res["alone"], res[ph], strict=True)]
        for ph in PHASES[1:]
    }
    med = {
        ph: {k: statistics.median(r[k] for r in res[ph]) for k in res[ph][0]} for ph in PHASES
    }  # fmt: skip
    t = Table(title=f"{args.tokens}-token samples ({res['size'] / 1024:.1f} KiB) at {args.rate:.0f}/s: "
                    f"medians of {args.reps} repetitions, phases in rotated order")  # fmt: skip
    for col in ("engine thread", "wall s", "wall +%", "per repetition", "send() µs",
                "other Python threads µs",
                "ZeroMQ threads µs", "page faults: engine / all"):  # fmt: skip
        t.add_column(col, justify="right")
    names = {
        "alone": "alone",
        "streaming": "streaming",
        "control": "alone, burning streaming's GIL-side CPU",
        "neighbour": "alone, another generator streaming on the other core",
    }
    for ph in PHASES:
        m = med[ph]
        t.add_row(names[ph], f"{m['wall']:.3f}", f"{statistics.median(over[ph]):+.2%}" if ph in over else "",
                  ", ".join(f"{x:+.1%}" for x in over[ph]) if ph in over else "",
                  f"{m['send_us']:.2f}", f"{m['py_us']:.2f}", f"{m['zmq_us']:.2f}",
                  f"{m['faults']:.2f} / {m['faults_all']:.2f}",
                  style="bold" if ph == "streaming" else None)  # fmt: skip
    console.print(t)
    gil = [r["send_us"] + r["py_us"] for r in res["streaming"]]
    gil_med = statistics.median(gil)
    wall = {ph: statistics.median(over[ph]) for ph in over}
    console.print(
        f"GIL-side CPU per sample (send() + the other Python threads): {gil_med:.2f} µs = "
        f"{gil_med / budget_us:.2%} of one sample's {budget_us:.0f} µs "
        f"(target < {TARGET:.0%}; per repetition: "
        + ", ".join(f"{g:.2f}" for g in gil)
        + "); with ZeroMQ's threads (other core, no GIL): "
        + f"{(gil_med + med['streaming']['zmq_us']) / budget_us:.2%}. "
        f"Wall: streaming {wall['streaming']:+.2%}, the control burning {med['control']['send_us']:.2f} µs "
        f"per sample {wall['control']:+.2%}, another generator streaming on the other core "
        f"{wall['neighbour']:+.2%}."
    )
    lat = sorted(latencies)
    span = arrivals[-1] - arrivals[0]
    t2 = Table(title="stream throughput and latency")
    for col in ("what", "value"):
        t2.add_column(col, justify="left" if col == "what" else "right")
    t2.add_row("streaming: latency finished -> trainer get(), p50 / p99 ms",
               f"{1e3 * lat[len(lat) // 2]:.2f} / {1e3 * lat[int(0.99 * len(lat))]:.2f}")  # fmt: skip
    t2.add_row("flat out: samples/s (acked, CURVE)", f"{(len(arrivals) - 1) / span:.0f}")
    t2.add_row("flat out: MB/s", f"{(len(arrivals) - 1) / span * res['size'] / 1e6:.0f}")
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
        "all_threads_ratio": round((gil_med + med["streaming"]["zmq_us"]) / budget_us, 4),
        "wall_overhead": round(wall["streaming"], 4),
        "wall_overhead_control_same_cpu": round(wall["control"], 4),
        "wall_overhead_other_core_streaming": round(wall["neighbour"], 4),
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
