"""Benchmark: the relay's delta versions against whole versions over an emulated WAN link.

    .venv/bin/python bench/relay_wan.py [--layers 4] [--lrs 1e-6,1e-5] [--versions 3]
        [--gbit 1] [--latency-ms 20] [--local-reps 3]

The link: a user-space TCP proxy in a spawned process (asyncio; no root, no tc) between the
relay's ``fetch_weights`` and the trainer's ``WeightServer``, both the project's code on real
loopback sockets. Each direction of the link is one FIFO shared by every connection through it:
bytes leave at `--gbit` (a byte's departure is the link's next free instant) and arrive
`--latency-ms` later; a new connection waits one round trip before its first byte (TCP's
handshake). The proxy counts every byte it carries: "wire" below is what crossed, both ways
(frames, AES-GCM tags, manifests, requests and chunks). An ideal pipe: no loss, no slow start.

The weights: a TinyLlama-shaped decoder (hidden 2048, MLP 5632, 4 KV heads, vocab 32000;
`--layers` layers, ~461 MiB of bf16 at 4), fp32 master weights ~ N(0, 0.02) (norms 1). Each new
version is one real ``torch.optim.Adam`` step on the master weights with fresh moments and a
random gradient: Adam's update is then lr·g/(|g|+eps), i.e. lr·sign(g) on every element — the
largest step Adam takes at that learning rate, so the changed fraction and the delta here bound
a steady-state step's from above. The published version is the master cast to bf16; the relay
compares bf16 bytes only (never fp32), as in a run.

Per version, in this order: the trainer publishes (snapshot, per-tensor digests, delta against
the version before: "encode", timed inside ``WeightServer.publish`` where it calls
``relay_delta``); the relay fetches it as a delta against the version it holds (transfer, then
rebuild + per-tensor xxh3 check: "decode", timed inside ``fetch_weights``); then fetches the same
version whole (``delta=False``), the baseline, through the same link. Both results are compared
byte for byte with the bf16 tensors the trainer published ("bit-exact"). "Limit" is wire bytes /
link rate. A delta version costs encode + its fetch; a whole one its fetch.

Extrapolation (labelled as such): a 70B-parameter bf16 model (140 GB) with the same changed
fraction and delta/whole size ratio, this machine's encode and decode throughput (bytes of
version per second), the same link, and the fixed cost per fetch (round trips) measured here.

Also measured (#31 item 2, where deltas pay inside a site): the same bf16 version broadcast
whole over gloo between two local processes (``BroadcastSender``, as bench/weight_broadcast.py)
against encode + broadcasting the delta stream + decode.

The last line of output is one JSON object for the benchmark record: seconds per delta version
at the first learning rate (encode + fetch), against the whole version's fetch (target ≥ 5×).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from weight_broadcast import MODES, receiver, recv_exact

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamrl_cli.weights import relay_delta as rd  # noqa: E402
from streamrl_cli.weights.broadcast import BroadcastSender, init_weight_group  # noqa: E402
from streamrl_cli.weights.relay import Fetched, WeightServer, fetch_weights  # noqa: E402

TOKEN = "bench-relay-wan-token-0123456789abcdef"
TARGET = 5.0  # issue 31, item 6 (3.0 until the delta encoding was made ~3x faster)
PARAMS_70B = 70e9
READ_BYTES = 256 << 10  # the proxy reads up to this much at a time (2 ms at 1 Gbit/s)
QUEUE_S = 0.004  # a reader stops reading while the link has more than this queued
WINDOW_CHUNKS = 64  # at most this many reads in flight per connection and direction (16 MiB)
MiB = 2**20


# ---- the emulated link (runs in its own process) ----


class Link:
    """One direction of the link, shared by every connection through it: a FIFO of `rate` bytes/s
    whose bytes arrive `latency` s after they leave. Counts what it carried in `counters[index]`."""

    def __init__(self, rate: float, latency: float, counters: Any, index: int):
        self.rate, self.latency, self.counters, self.index = rate, latency, counters, index
        self.free_at = 0.0

    def admit(self, n: int, now: float) -> tuple[float, float]:
        """(when these `n` bytes arrive, how long their reader should pause before reading more)."""
        self.free_at = max(self.free_at, now) + n / self.rate
        self.counters[self.index] += n
        return self.free_at + self.latency, self.free_at - now - QUEUE_S


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue(WINDOW_CHUNKS)

    async def deliver() -> None:
        try:
            while True:
                due, data = await queue.get()
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                if data is None:
                    break
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        writer.close()

    task = asyncio.create_task(deliver())
    try:
        while data := await reader.read(READ_BYTES):
            due, pause = link.admit(len(data), loop.time())
            await queue.put((due, data))
            if pause > 0:
                await asyncio.sleep(pause)
    except OSError:
        pass
    await queue.put((loop.time() + link.latency, None))
    await task


def run_proxy(target: tuple[str, int], rate: float, latency: float, counters: Any, conn: Any) -> None:
    """Listen on loopback, forward each connection to `target` through the emulated link."""

    async def main() -> None:
        up, down = Link(rate, latency, counters, 1), Link(rate, latency, counters, 0)

        async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
            await asyncio.sleep(2 * latency)  # TCP's handshake: one round trip before any byte
            sr, sw = await asyncio.open_connection(*target, limit=4 * READ_BYTES)
            for w in (cw, sw):
                w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.gather(_pump(cr, sw, up), _pump(sr, cw, down))

        server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=4 * READ_BYTES)
        conn.send(server.sockets[0].getsockname()[1])
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# ---- the weights ----


def master_weights(layers: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 master weights of a TinyLlama-shaped decoder: matrices ~ N(0, 0.02), norms 1."""
    g = torch.Generator().manual_seed(seed)
    h, mlp, kv, vocab = 2048, 5632, 256, 32000
    shapes = {"embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h)}
        shapes |= {p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h)}
        shapes |= {p + "mlp.gate_proj.weight": (mlp, h), p + "mlp.up_proj.weight": (mlp, h)}
        shapes |= {p + "mlp.down_proj.weight": (h, mlp)}
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    shapes["norm.weight"] = (h,)
    out = {}
    for name, shape in shapes.items():
        t = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.02
        out[name] = t.requires_grad_()
    return out


def adam_step(master: dict[str, torch.Tensor], lr: float, g: torch.Generator) -> None:
    """One real torch.optim.Adam step with fresh moments on a random gradient (update: lr·sign(g))."""
    for t in master.values():
        t.grad = torch.randn(t.shape, generator=g)
    try:
        opt = torch.optim.Adam(master.values(), lr=lr, fused=True)
    except (RuntimeError, ValueError):
        opt = torch.optim.Adam(master.values(), lr=lr, foreach=False)
    opt.step()
    for t in master.values():
        t.grad = None


def cast(master: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().to(torch.bfloat16) for n, t in master.items()}


def changed_fraction(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> float:
    """Fraction of bf16 values whose bits differ between two versions."""
    diff = sum(int((new[n].view(torch.int16) != old[n].view(torch.int16)).sum()) for n in new)
    return diff / sum(t.numel() for t in new.values())


def bit_exact(got: Fetched, sent: dict[str, torch.Tensor]) -> bool:
    """Every fetched tensor equals the published bf16 one, byte for byte."""
    return got.tensors.keys() == sent.keys() and all(
        torch.equal(got.tensors[n].view(torch.int16), t.view(torch.int16)) for n, t in sent.items()
    )


class Timed:
    """A relay_delta function replaced by itself, timed, where the relay's code calls it (module
    attribute): the real code path, with the seconds of each call and the last result kept."""

    def __init__(self, name: str):
        self.name, self.fn, self.seconds, self.last = name, getattr(rd, name), 0.0, None
        setattr(rd, name, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        self.last = self.fn(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        return self.last

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


# ---- the local comparison (#31 item 2) ----


def local_broadcast(
    full: dict[str, torch.Tensor], deltas: dict[float, bytes], reps: int, progress: Progress
) -> dict[str, float]:
    """Median seconds to broadcast `full`, and each delta stream, over gloo to one other process."""
    payloads = {"full": full} | {
        lr: {"delta": torch.frombuffer(bytearray(p), dtype=torch.uint8)} for lr, p in deltas.items()
    }
    plan = [(key, MODES[1]) for key in payloads for _ in range(reps + 1)]
    listener = socket.create_server(("127.0.0.1", 0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        group_port = s.getsockname()[1]
    args = (group_port, listener.getsockname()[1], [(mode, 0) for _, mode in plan])
    proc = mp.get_context("spawn").Process(target=receiver, args=args)
    proc.start()
    group = init_weight_group(f"127.0.0.1:{group_port}", 0, 2, timeout_s=120)
    sock, _ = listener.accept()
    sender, ack = BroadcastSender(group), bytearray(1)
    times: dict[Any, list[float]] = {}
    task = progress.add_task("local gloo broadcasts", total=len(plan))
    for version, (key, _) in enumerate(plan):
        t0 = time.perf_counter()
        sender.send(payloads[key], version)
        recv_exact(sock, memoryview(ack))  # the receiver holds every tensor
        times.setdefault(key, []).append(time.perf_counter() - t0)
        progress.advance(task)
    proc.join(timeout=60)
    sock.close()
    group.close()
    return {key: statistics.median(ts[1:]) for key, ts in times.items()}  # the first: warm-up


# ---- the run ----


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lrs", default="1e-6,1e-5")
    p.add_argument("--versions", type=int, default=3, help="delta versions per learning rate")
    p.add_argument("--gbit", type=float, default=1.0)
    p.add_argument("--latency-ms", type=float, default=20.0, help="one way")
    p.add_argument("--local-reps", type=int, default=3, help="0: skip the local broadcast comparison")
    args = p.parse_args()
    console = Console(width=200)
    lrs = [float(x) for x in args.lrs.split(",")]
    rate, latency = args.gbit * 1e9 / 8, args.latency_ms / 1000

    encode = [Timed("digests"), Timed("encode")]  # the trainer's work for a delta (in publish)
    decode = Timed("apply")  # the relay's: rebuild and check every tensor (in fetch_weights)
    server = WeightServer(TOKEN, host="127.0.0.1")  # deltas on, as in a run
    ctx = mp.get_context("spawn")
    counters = ctx.Array("q", 2, lock=False)  # bytes server -> relay, relay -> server
    ours, theirs = ctx.Pipe()
    target = ("127.0.0.1", int(server.address.rpartition(":")[2]))
    proxy = ctx.Process(target=run_proxy, args=(target, rate, latency, counters, theirs), daemon=True)
    proxy.start()
    wan = f"127.0.0.1:{ours.recv()}"

    def fetch(**kw: Any) -> tuple[Fetched, float, int]:
        before = counters[0] + counters[1]
        t0 = time.perf_counter()
        got = fetch_weights(wan, TOKEN, timeout_s=60, **kw)
        return got, time.perf_counter() - t0, counters[0] + counters[1] - before

    rows, per_lr, last_delta = [], {lr: [] for lr in lrs}, {}
    g = torch.Generator().manual_seed(1)
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=console, transient=True,
    )  # fmt: skip
    with progress:
        task = progress.add_task("building the model", total=1 + len(lrs) * args.versions)
        master = master_weights(args.layers)
        sent = cast(master)
        nbytes = sum(t.numel() * t.element_size() for t in sent.values())
        version = 1
        progress.update(task, description=f"v{version}: whole (the relay holds nothing)")
        server.publish(version, sent)
        for t in encode:
            t.take()
        held, first_s, first_wire = fetch()
        assert held.stats["mode"] == "full" and bit_exact(held, sent)
        spare, whole_buf = None, None
        progress.advance(task)
        for lr in lrs:
            for _ in range(args.versions):
                version += 1
                progress.update(task, description=f"v{version}: Adam step, lr {lr:g}")
                adam_step(master, lr, g)
                old, sent = sent, cast(master)
                changed = changed_fraction(sent, old)
                del old
                progress.update(task, description=f"v{version}: publish (snapshot + delta)")
                t0 = time.perf_counter()
                server.publish(version, sent)
                publish_s = time.perf_counter() - t0
                enc_s = sum(t.take() for t in encode)
                entries, payload = encode[1].last
                progress.update(task, description=f"v{version}: fetch the delta over the link")
                decode.take()
                got, delta_s, delta_wire = fetch(base=held, out=spare)
                dec_s = decode.take()
                assert got.stats["mode"] == "delta", got.stats
                exact = bit_exact(got, sent)
                progress.update(task, description=f"v{version}: fetch it whole over the link")
                whole, full_s, full_wire = fetch(delta=False, out=whole_buf)
                assert whole.stats["mode"] == "full"
                exact = exact and bit_exact(whole, sent)
                whole_buf, spare, held = whole.buffer, held.buffer, got
                del whole
                kinds = {k: sum(e.kind == k for e in entries) for k in rd.KINDS}
                r = dict(
                    lr=lr, version=version, changed=changed, full_wire=full_wire, delta_wire=delta_wire,
                    full_s=full_s, delta_s=delta_s, enc_s=enc_s, dec_s=dec_s, publish_s=publish_s,
                    exact=exact, payload=len(payload), kinds=kinds,
                )  # fmt: skip
                per_lr[lr].append(r)
                rows.append(r)
                last_delta[lr] = payload
                progress.advance(task)
        del master
        server.close()
        proxy.terminate()
        local = local_broadcast(sent, last_delta, args.local_reps, progress) if args.local_reps else {}

    link = f"{args.gbit:g} Gbit/s, {args.latency_ms:g} ms one way"
    table = Table(
        title=f"relay over an emulated WAN ({link}): {nbytes / MiB:.0f} MiB of bf16 "
        f"({len(sent)} tensors, {nbytes / 2 / 1e6:.0f}M parameters), delta vs whole, per version"
    )
    cols = ["lr", "version", "bf16 changed", "delta kinds", "whole wire MiB", "whole s", "limit s",
            "delta wire MiB", "encode s", "delta fetch s", "of it decode s", "delta total s",
            "speed-up", "bit-exact"]  # fmt: skip
    for c in cols:
        table.add_column(c, justify="left" if c in ("lr", "delta kinds") else "right")
    table.add_row(
        "-", "1", "-", "-", f"{first_wire / MiB:.1f}", f"{first_s:.2f}", f"{first_wire / rate:.2f}",
        "(no base)", "", "", "", "", "", "yes",
    )  # fmt: skip
    for r in rows:
        total = r["enc_s"] + r["delta_s"]
        kinds = ", ".join(f"{n} {k}" for k, n in r["kinds"].items() if n)
        table.add_row(
            f"{r['lr']:g}", str(r["version"]), f"{r['changed']:.2%}", kinds, f"{r['full_wire'] / MiB:.1f}",
            f"{r['full_s']:.2f}", f"{r['full_wire'] / rate:.2f}", f"{r['delta_wire'] / MiB:.2f}",
            f"{r['enc_s']:.2f}", f"{r['delta_s']:.2f}", f"{r['dec_s']:.2f}", f"{total:.2f}",
            f"{r['full_s'] / total:.1f}×", "yes" if r["exact"] else "NO",
        )  # fmt: skip
    console.print(table)

    summary = Table(
        title=f"median per learning rate, measured ({nbytes / MiB:.0f} MiB) and EXTRAPOLATED to a 70B "
        f"bf16 model (140 GB) on the same link at this machine's encode/decode speed"
    )
    cols = ["weights", "lr", "bf16 changed", "delta/whole bytes", "whole s", "encode s", "delta link s",
            "decode s", "delta total s", "speed-up", "encode GiB/s", "decode GiB/s"]  # fmt: skip
    for c in cols:
        summary.add_column(c, justify="left" if c == "weights" else "right")
    medians, big = {}, PARAMS_70B * 2
    for lr, rs in per_lr.items():
        m = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k not in ("exact", "kinds", "lr")}
        medians[lr] = m
        link_s = m["delta_s"] - m["dec_s"]
        total = m["enc_s"] + m["delta_s"]
        enc_rate, dec_rate = nbytes / m["enc_s"], nbytes / m["dec_s"]
        summary.add_row(
            f"measured, {nbytes / MiB:.0f} MiB", f"{lr:g}", f"{m['changed']:.2%}",
            f"{m['delta_wire'] / m['full_wire']:.2%}", f"{m['full_s']:.2f}", f"{m['enc_s']:.2f}",
            f"{link_s:.2f}", f"{m['dec_s']:.2f}", f"{total:.2f}", f"{m['full_s'] / total:.1f}×",
            f"{enc_rate / 2**30:.2f}", f"{dec_rate / 2**30:.2f}",
        )  # fmt: skip
        # Per fetch: a fixed cost (round trips, measured: time beyond wire bytes / rate) + bytes / rate.
        full_fixed = m["full_s"] - m["full_wire"] / rate
        delta_fixed = link_s - m["delta_wire"] / rate
        full_70 = full_fixed + big * (m["full_wire"] / nbytes) / rate
        enc_70, dec_70 = big / enc_rate, big / dec_rate
        link_70 = delta_fixed + big * (m["delta_wire"] / nbytes) / rate
        total_70 = enc_70 + link_70 + dec_70
        m["x70"] = (full_70, total_70)
        summary.add_row(
            "EXTRAPOLATED, 70B (140 GB)", f"{lr:g}", f"{m['changed']:.2%}",
            f"{m['delta_wire'] / m['full_wire']:.2%}", f"{full_70:.0f}", f"{enc_70:.0f}", f"{link_70:.0f}",
            f"{dec_70:.0f}", f"{total_70:.0f}", f"{full_70 / total_70:.1f}×", "", "",
        )  # fmt: skip
    console.print(summary)

    if local:
        lt = Table(
            title=f"inside a site: the same {nbytes / MiB:.0f} MiB version over gloo between two local "
            f"processes, whole vs as a delta (median of {args.local_reps})"
        )
        cols = ["lr", "whole bcast s", "encode s", "delta bcast s", "decode s", "delta total s",
                "delta / whole"]  # fmt: skip
        for c in cols:
            lt.add_column(c, justify="right")
        for lr, m in medians.items():
            total = m["enc_s"] + local[lr] + m["dec_s"]
            lt.add_row(
                f"{lr:g}", f"{local['full']:.3f}", f"{m['enc_s']:.3f}", f"{local[lr]:.3f}",
                f"{m['dec_s']:.3f}", f"{total:.3f}", f"{total / local['full']:.1f}×",
            )  # fmt: skip
        console.print(lt)

    assert all(r["exact"] for r in rows), "a fetched version differed from the published one"
    m = medians[lrs[0]]
    value = m["enc_s"] + m["delta_s"]
    record = {
        "bench": "relay_wan",
        "metric": f"s_per_version_delta_lr{lrs[0]:g}_{nbytes >> 20}MiB_bf16_{args.gbit:g}gbit_"
        f"{2 * args.latency_ms:g}ms_rtt_encode_plus_fetch_vs_whole_fetch",
        "value": round(value, 3),
        "baseline": round(m["full_s"], 3),
        "ratio": round(m["full_s"] / value, 2),
        "target": TARGET,
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
