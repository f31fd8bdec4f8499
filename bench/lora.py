"""LoRA against full weights: a weight version's bytes and time, the trainer's step and memory, learning.

    .venv/bin/python bench/lora.py [--parts sync,train,learn] [--sizes-mb 128,1024] [--ranks 8,64]

* **sync** — one weight version as the generators receive it, for the Qwen2 models of
  `bench/fixed_costs.py` (about 136 MB and 1 GB in float32, as the CPU engines load them; bf16 on
  GPUs halves every row alike): the whole model (a full fine-tune, or LoRA with `sync: merged`)
  against the adapters alone at each rank (`model.lora.sync: adapter`, every attention and MLP
  projection adapted, PEFT's saved names, B filled as after training), on the two paths a version
  takes: the trainer's bucketed broadcast (gloo, to a second process, timed until it acknowledges)
  and the cross-site relay (published on a `WeightServer`, fetched whole by a second process with
  every chunk verified, timed from the publish to the acknowledgement). Baseline: the whole model
  on the same path, in the same run. One untimed warm-up, then the median of `--reps`.
* **train** — one trainer step on the ~136 MB model (`--train-mb`; the DeepSpeed ZeRO-1 learner, packed
  micro-batches of 8, 32 synthetic rollouts): full fine-tune against LoRA at each rank, each in a
  process of its own: seconds per step (best of 2 after a warm-up), trainable parameters and the
  process's peak resident memory (weights, gradients, Adam states, activations, and with the KL
  term on, the reference: a frozen copy of the model for the full fine-tune, none for LoRA, whose
  base with the adapters off is the reference).
* **learn** — `streamrl run local` on the repeat task (bench/algorithms.py's data and settings:
  8 prompts × 8, lr 1e-3, seed 0): LoRA rank 8 with `sync: adapter`, at that lr and at 10×,
  against a full fine-tune and a policy that does not move (lr 0), held-out reward with its
  standard error; the training reward per step of each on one plot (bench/plots/lora_rewards.png).

Ends with one JSON line: the rank-8 adapter's time per version through the relay on the largest
model against the whole model's (ratio = whole ÷ adapter; target: 10× faster).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algorithms import GROUP, LR, PROMPTS_PER_STEP  # noqa: E402
from algorithms import run as run_algorithm  # noqa: E402
from fixed_costs import sized_model, synthetic_rollouts  # noqa: E402
from peer_trl import write_data  # noqa: E402
from rl_modes import console, model_path, plot_rewards  # noqa: E402
from weight_broadcast import recv_exact  # noqa: E402

from streamrl_cli.recipe.schema import LoraConfig  # noqa: E402
from streamrl_cli.weights.broadcast import BroadcastSender, init_weight_group, receive_weights  # noqa: E402
from streamrl_cli.weights.relay import WeightServer, fetch_weights  # noqa: E402

TOKEN = "bench-lora-token-0123456789abcdef"
TARGET = 10.0  # the rank-8 adapter crosses the relay at least this many times faster than the model
PATHS = ("broadcast", "relay")
LORA = ("model.lora.rank=8", "model.lora.alpha=16", "model.lora.sync=adapter")


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def versions(mb: int, ranks: list[int]) -> dict[str, dict[str, torch.Tensor]]:
    """The model of about `mb` MB as the generators receive it, whole and as adapters per rank."""
    from transformers import AutoModelForCausalLM

    from streamrl_cli.trainer.role import lora as lora_

    sized_model(mb)  # built once, cached
    path = model_path(f"sync-{mb}mb")
    out = {"whole model": dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict())}
    g = torch.Generator().manual_seed(0)
    for r in ranks:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        state = lora_.adapter_state(lora_.apply(model, LoraConfig(rank=r)), clone=True)
        for name, t in state.items():  # B starts at zero; after training both factors are dense
            if ".lora_B." in name:
                t.copy_(torch.randn(t.shape, generator=g) * 0.01)
        out[f"LoRA r{r} adapters"] = state
    return out


def receiver(group_port: int, ctl_port: int, relay: str, plan: list[tuple[str, int]]) -> None:
    torch.set_num_threads(1)
    group = init_weight_group(f"127.0.0.1:{group_port}", 1, 2, timeout_s=300)
    sock = socket.create_connection(("127.0.0.1", ctl_port))
    go = bytearray(1)
    for path, version in plan:
        if path == "broadcast":
            receive_weights(group)
        else:
            recv_exact(sock, memoryview(go))  # published: fetch it
            fetch_weights(relay, TOKEN, version=version, delta=False, timeout_s=120)
        sock.sendall(b"!")
    sock.close()
    group.close()


def part_sync(sizes: list[int], ranks: list[int], reps: int) -> tuple[Table, dict]:
    states = {mb: versions(mb, ranks) for mb in sizes}
    items = [(mb, kind, path) for mb in sizes for kind in states[mb] for path in PATHS]
    plan, v = [], 0
    for mb, kind, path in items:
        for _ in range(reps + 1):
            v += 1
            plan.append((mb, kind, path, v))
    server = WeightServer(TOKEN, host="127.0.0.1", delta=False)
    listener = socket.create_server(("127.0.0.1", 0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        group_port = s.getsockname()[1]
    proc = mp.get_context("spawn").Process(
        target=receiver,
        args=(group_port, listener.getsockname()[1], server.address, [(p, ver) for _, _, p, ver in plan]),
    )
    proc.start()
    group = init_weight_group(f"127.0.0.1:{group_port}", 0, 2, timeout_s=300)
    ctl, _ = listener.accept()
    sender = BroadcastSender(group)
    ack = bytearray(1)
    times: dict[tuple[int, str, str], list[float]] = {}
    with console.status("sending weight versions ...") as status:
        for mb, kind, path, ver in plan:
            status.update(f"{mb} MB model, {kind}, {path}: version {ver} of {len(plan)}")
            state = states[mb][kind]
            t0 = time.perf_counter()
            if path == "broadcast":
                sender.send(state, ver)
            else:
                server.publish(ver, state)
                ctl.sendall(b"g")
            recv_exact(ctl, memoryview(ack))
            times.setdefault((mb, kind, path), []).append(time.perf_counter() - t0)
    proc.join(timeout=120)
    server.close()
    group.close()

    table = Table(title=f"one weight version, whole model vs LoRA adapters (float32; median of {reps})")
    for col in ("model", "version", "bytes", "broadcast ms", "relay ms", "relay: whole ÷ this"):
        table.add_column(col, justify="right")
    med = {k: statistics.median(ts[1:]) for k, ts in times.items()}  # ts[0]: the warm-up
    for mb in sizes:
        real = nbytes(states[mb]["whole model"])
        for kind, state in states[mb].items():
            speed = med[(mb, "whole model", "relay")] / med[(mb, kind, "relay")]
            bcast, relay = 1e3 * med[(mb, kind, "broadcast")], 1e3 * med[(mb, kind, "relay")]
            vs = "-" if kind == "whole model" else f"{speed:.1f}×"
            table.add_row(
                f"{real / 1e6:.0f} MB", kind, f"{nbytes(state):,}", f"{bcast:.1f}", f"{relay:.1f}", vs
            )
    big, r = sizes[-1], f"LoRA r{ranks[0]} adapters"
    whole_mb = nbytes(states[big]["whole model"]) >> 20
    value, base = med[(big, r, "relay")], med[(big, "whole model", "relay")]
    record = {
        "bench": "lora",
        "metric": f"ms_per_version_relay_{r.split()[1]}_adapters_vs_whole_{whole_mb}MiB_model",
        "value": round(1e3 * value, 2),
        "baseline": round(1e3 * base, 2),
        "ratio": round(base / value, 1),
        "target": TARGET,
    }
    return table, record


def peak_rss() -> int:
    """This process's peak resident memory in bytes (VmHWM: unlike getrusage's ru_maxrss, which
    keeps the forking parent's peak across exec on Linux, it starts again with the new program)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def train_worker(rank: int, mb: int) -> dict:
    """One learner (rank 0: full fine-tune) and its step time; run in a process of its own."""
    from streamrl_cli.recipe import presets
    from streamrl_cli.recipe.schema import AlgorithmConfig, TrainerConfig
    from streamrl_cli.trainer.loop.batch import collate
    from streamrl_cli.trainer.role.learner import (
        Learner,
        LossConfig,
        OptimConfig,
        init_distributed,
        open_group_store,
    )

    torch.manual_seed(0)
    rows = synthetic_rollouts(32, 0)
    store, address = open_group_store(1, "127.0.0.1")
    init_distributed(0, 1, address, "gloo", store)
    # A KL term, as GRPO with a reference policy has: the full fine-tune holds a frozen copy of the
    # model for it, LoRA none (the base with its adapters switched off is the reference).
    algorithm = AlgorithmConfig(kl_coef=0.001, is_correction="on", lr=1e-5)
    cfg = LossConfig.from_recipe(presets.filled(algorithm, 128), 128)
    opt = OptimConfig(algorithm=algorithm, trainer=TrainerConfig(zero_stage=1))
    learner = Learner(str(model_path(f"sync-{mb}mb")), cfg, opt, torch.device("cpu"), torch.float32,
                      lora=LoraConfig(rank=rank) if rank else None)  # fmt: skip
    trainable = sum(p.numel() for p in learner.actor.module.parameters() if p.requires_grad)

    def step() -> float:
        t0 = time.perf_counter()
        mbs = [rows[k : k + 8] for k in range(0, len(rows), 8)]
        for k, mb in enumerate(mbs):
            learner.micro_step(collate(mb), last=k == len(mbs) - 1)
        learner.step()
        return time.perf_counter() - t0

    step()  # warm-up: Adam's states are allocated here
    best = min(step() for _ in range(2))
    tokens = sum(len(r.prompt_tokens) + r.response_len for r in rows)
    reference = "frozen copy" if learner.ref is not None else "base, adapters off"
    return {"step_s": best, "tokens": tokens, "trainable": trainable, "peak_bytes": peak_rss(),
            "reference": reference}  # fmt: skip


def part_train(ranks: list[int], mb: int) -> Table:
    sized_model(mb)
    results = {}
    for rank in [0, *ranks]:
        label = "full fine-tune" if rank == 0 else f"LoRA r{rank}"
        with console.status(f"trainer step: {label} ..."):
            out = subprocess.run(
                [sys.executable, __file__, "--train-worker", str(rank), "--train-mb", str(mb)],
                capture_output=True, text=True, timeout=900,
            )  # fmt: skip
        if out.returncode != 0:
            raise SystemExit(f"the {label} trainer failed:\n{out.stderr[-3000:]}")
        results[label] = json.loads(out.stdout.strip().splitlines()[-1])
    full = results["full fine-tune"]
    table = Table(
        title=f"one trainer step on the {nbytes_of_model(mb) / 1e6:.0f} MB model: DeepSpeed ZeRO-1 on CPU, "
        f"{full['tokens']} tokens, packed micro-batches of 8"
    )
    for col in (
        "trainer",
        "trainable params",
        "reference for KL",
        "s per step",
        "vs full",
        "peak RSS GB",
        "vs full",
    ):
        table.add_column(col, justify="right")
    for label, r in results.items():
        table.add_row(
            label, f"{r['trainable']:,}", r["reference"],
            f"{r['step_s']:.2f}", f"{r['step_s'] / full['step_s']:.2f}",
            f"{r['peak_bytes'] / 1e9:.2f}", f"{r['peak_bytes'] / full['peak_bytes']:.2f}",
        )  # fmt: skip
    return table


def nbytes_of_model(mb: int) -> int:
    """The float32 weights' bytes of the model of about `mb` MB, from its safetensors files."""
    from safetensors import safe_open

    total = 0
    for f in model_path(f"sync-{mb}mb").glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(st.get_tensor(k).nbytes for k in st.keys())  # noqa: SIM118 - no iteration
    return total


def part_learn(iterations: int, work: Path) -> Table:
    train, test = write_data(work, iterations * PROMPTS_PER_STEP)
    runs = {
        "fixed policy (lr 0)": run_algorithm("grpo", 0.0, train, test, iterations, work / "fixed"),
        "full fine-tune": run_algorithm("grpo", LR, train, test, iterations, work / "full"),
        "LoRA r8, sync: adapter": run_algorithm(
            "grpo", LR, train, test, iterations, work / "lora", extra=LORA
        ),
        # Adapters usually want a larger step than full weights (about 10× in the LoRA literature)
        f"LoRA r8, sync: adapter, lr {10 * LR:g}": run_algorithm(
            "grpo", 10 * LR, train, test, iterations, work / "lora-10x", extra=LORA
        ),
    }  # fmt: skip
    table = Table(title=f"learning on the repeat task: tiny model, {iterations} steps of {PROMPTS_PER_STEP} "
                  f"prompts × {GROUP}, lr {LR:g}, same data and seed")  # fmt: skip
    for col in ("run", "samples/s", "train reward first5→last5", "held-out reward ± se"):
        table.add_column(col, justify="right")
    for label, r in runs.items():
        table.add_row(label, f"{r['samples_per_s']:.1f}", f"{r['first']:.3f}→{r['last']:.3f}",
                      f"{r['held_out']:.3f} ± {r['se']:.3f}")  # fmt: skip
    plot = Path(__file__).resolve().parent / "plots" / "lora_rewards.png"
    plot_rewards(runs, plot, "LoRA r8 (sync: adapter) vs full fine-tune, tiny model, repeat task")
    console.print(f"reward curves: {plot}")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="sync,train,learn")
    ap.add_argument("--sizes-mb", default="128,1024")
    ap.add_argument("--ranks", default="8,64")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--train-worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--train-mb", type=int, default=128, help="the train part's model (a --sizes-mb size)")
    args = ap.parse_args()
    if args.train_worker is not None:
        print(json.dumps(train_worker(args.train_worker, args.train_mb)))
        return
    parts, ranks = args.parts.split(","), [int(r) for r in args.ranks.split(",")]
    record = None
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        if "sync" in parts:
            table, record = part_sync([int(s) for s in args.sizes_mb.split(",")], ranks, args.reps)
            console.print(table)
        if "train" in parts:
            console.print(part_train(ranks, args.train_mb))
        if "learn" in parts:
            console.print(part_learn(args.iterations, Path(tmp)))
    if record is not None:
        print(json.dumps(record))


if __name__ == "__main__":
    main()
