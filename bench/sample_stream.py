"""Benchmark: what streaming samples costs a generator, and how fast the stream goes.

    .venv/bin/python bench/sample_stream.py [--seconds 5] [--rate 1000] [--tokens 1024] [--flat 20000]

A spawned process plays one generator: it sends 1K-token samples (token ids below 152K, the
Qwen2.5 vocabulary, and float log-probs) through ``ZmqSampleSender`` to a ``ZmqSampleReceiver``
in this process (the trainer), whose consumer thread takes every sample. Two phases:

- paced at ``--rate`` samples/s (the target's operating point, 1,000/s of 1K tokens): the CPU
  the generator process spends on streaming per sample — inside ``send()`` on the engine's
  thread (its CPU time minus that of the same loop without ``send``), in the sender's I/O
  thread and in ZeroMQ's I/O thread (CURVE encryption, TCP), both from
  ``/proc/self/task/*/schedstat`` — against the budget of one
  sample at that rate (1 ms: the generation time it is added to; target < 1%), plus latency
  from ``finished_at`` to the trainer's ``get()``;
- flat out: end-to-end throughput (samples/s, MB/s) with acknowledgements and back-pressure.

Baseline, in the same run: the budget above, and the floor of the transport itself — the same
encoded bytes pushed flat out through a bare ZeroMQ PUSH/PULL pair (no CURVE, no acks).

The last line of output is one JSON object for the benchmark record.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import threading
import time
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


def generator(address: str, tokens: int, rate: float, seconds: float, flat: int, q: mp.Queue) -> None:
    base = template(tokens)
    sender = make_sender(StreamConfig(), address=address, token=TOKEN, generator="generator-0")
    sender.wait_connected(30)
    io_tid = sender._thread.native_id  # the sender's I/O thread (a Python thread)
    res = {}
    # "dry" does everything "paced" does (make each sample, pace) except send(): the difference in
    # this thread's CPU time is what send() costs it, without timing calls around every send().
    for phase, n, interval in (
        ("dry", int(rate * seconds), 1.0 / rate),
        ("paced", int(rate * seconds), 1.0 / rate),
        ("flat", flat, 0.0),
    ):
        zmq_tids = zmq_threads()
        io0, z0, c0 = thread_ns(io_tid), sum(thread_ns(t) for t in zmq_tids), time.thread_time()
        t_start = time.perf_counter()
        for i in range(n):
            if interval:
                delay = t_start + i * interval - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            # A fresh sample, as an engine hands over: new lists, the data hot in cache.
            s = msgspec.structs.replace(
                base, prompt_id=f"{phase}/p{i // 8}", sample_index=i % 8,
                token_ids=[t + 0 for t in base.token_ids], logprobs=[x * 1.0 for x in base.logprobs],
            )  # fmt: skip
            s.finished_at = time.time()
            if phase != "dry":
                sender.send(s, timeout=60)
        sender.flush(60)
        res[phase] = {
            "n": n,
            "wall": time.perf_counter() - t_start,
            "main": time.thread_time() - c0,
            "io": (thread_ns(io_tid) - io0) / 1e9,
            "zmq": (sum(thread_ns(t) for t in zmq_tids) - z0) / 1e9,
        }
    res["paced"]["send"] = max(0.0, res["paced"]["main"] - res["dry"]["main"])
    res["flat"]["send"] = res["flat"]["main"]  # includes making the samples: an upper bound
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
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--flat", type=int, default=20000)
    args = p.parse_args()
    console = Console(width=120)
    receiver = make_receiver(StreamConfig(bind="tcp://127.0.0.1:0"), token=TOKEN)
    latencies: dict[str, list[float]] = {"paced": [], "flat": []}
    arrivals: dict[str, list[float]] = {"paced": [], "flat": []}
    total = int(args.rate * args.seconds) + args.flat

    def consume() -> None:
        for _ in range(total):
            s = receiver.get(timeout=120)
            now = time.time()
            phase = s.prompt_id.split("/")[0]
            latencies[phase].append(now - s.finished_at)
            arrivals[phase].append(time.perf_counter())

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    q = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(
        target=generator, args=(receiver.address, args.tokens, args.rate, args.seconds, args.flat, q)
    )
    proc.start()
    res = q.get(timeout=300)
    consumer.join(timeout=60)
    proc.join(timeout=30)
    receiver.close()
    floor = raw_floor(encode(template(args.tokens)), args.flat)

    paced, flat = res["paced"], res["flat"]
    per = {k: paced[k] / paced["n"] * 1e6 for k in ("send", "io", "zmq")}
    total_us = sum(per.values())
    budget_us = 1e6 / args.rate
    t = Table(
        title=f"sender CPU per {args.tokens}-token sample ({res['size'] / 1024:.1f} KiB) at {args.rate:.0f}/s"
    )
    for col in ("where", "µs / sample", "% of 1 sample's generation time"):
        t.add_column(col, justify="left" if col == "where" else "right")
    t.add_row(
        "send() on the engine's thread (encode, enqueue)",
        f"{per['send']:.2f}",
        f"{per['send'] / budget_us:.2%}",
    )
    t.add_row(
        "sender I/O thread (batching, acks; Python)", f"{per['io']:.2f}", f"{per['io'] / budget_us:.2%}"
    )
    t.add_row(
        "ZeroMQ I/O thread (CURVE encryption, TCP; no GIL)",
        f"{per['zmq']:.2f}",
        f"{per['zmq'] / budget_us:.2%}",
    )
    t.add_row("total", f"{total_us:.2f}", f"{total_us / budget_us:.2%}")
    t.add_row(
        "floor: msgspec encode alone, hot loop",
        f"{res['encode_us']:.2f}",
        f"{res['encode_us'] / budget_us:.2%}",
    )
    t.add_row("budget: one sample's generation time at this rate", f"{budget_us:.0f}", "100%")
    console.print(t)
    console.print("* engine thread CPU while streaming, minus the same loop without send()")

    lat = sorted(latencies["paced"])
    span = arrivals["flat"][-1] - arrivals["flat"][0]
    t2 = Table(title="stream throughput and latency")
    for col in ("what", "value"):
        t2.add_column(col, justify="left" if col == "what" else "right")
    t2.add_row("paced: achieved rate, samples/s", f"{paced['n'] / paced['wall']:.0f}")
    t2.add_row("paced: latency finished -> trainer get(), p50 / p99 ms",
               f"{1e3 * lat[len(lat) // 2]:.2f} / {1e3 * lat[int(0.99 * len(lat))]:.2f}")  # fmt: skip
    t2.add_row("flat out: samples/s (acked, CURVE)", f"{(flat['n'] - 1) / span:.0f}")
    t2.add_row("flat out: MB/s", f"{(flat['n'] - 1) / span * res['size'] / 1e6:.0f}")
    t2.add_row("flat out: sender CPU µs / sample (all threads, incl. making samples)",
               f"{(flat['send'] + flat['io'] + flat['zmq']) / flat['n'] * 1e6:.2f}")  # fmt: skip
    t2.add_row("baseline: bare PUSH/PULL, same bytes, msgs/s", f"{floor['rate']:.0f}")
    t2.add_row("baseline: bare PUSH/PULL, send() µs / msg", f"{floor['send_us']:.2f}")
    console.print(t2)
    record = {
        "bench": "sample_stream",
        "metric": f"sender_cpu_us_per_{args.tokens}_token_sample_at_{args.rate:.0f}_per_s_all_threads",
        "value": round(total_us, 2),
        "baseline": round(budget_us, 1),
        "ratio": round(total_us / budget_us, 4),
        "target": TARGET,
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
