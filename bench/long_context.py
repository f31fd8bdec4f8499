"""Long sequences: the trainer's peak memory and speed with chunked log-probs against the whole logits
(issue 43).

    .venv/bin/python bench/long_context.py [--lengths 2048,4096,8192,32768] [--chunks 0,512,1024] [--reps 2]

One training step of the policy as the trainer runs it (`policy_forward`: forward, log-probs and
entropy of the sampled tokens at temperature 1, a policy-gradient loss, backward) on one sequence of
each length, with the LM head and log-softmax unchunked (`roles.trainer.logits_chunk: 0`, the whole
[tokens × vocabulary] fp32 logits) and chunked. The model is the project's tiny builder's Qwen2 (2
layers, hidden 64) with Qwen2.5's real 151,936-token vocabulary: the LM head's 9.7M parameters and
the logits dominate, as they do for long sequences on real models, and it runs on a CPU. At 2k and
8k every chunk size runs; at 4k the whole logits and the default chunk (`logits_chunk`'s schema
default); at 32k the default chunk alone (a step there takes a minute and more on two cores).

Each configuration runs in a process of its own, so its peak resident memory (`ru_maxrss`) is its
own. Reported: the peak, and the step's share of it (the peak less the process after the model
loaded); tokens per second of the best of `--reps` steps after a warm-up (one step, no warm-up,
from 8k on). A configuration whose logits would not fit in this machine's available memory is not
run: the unchunked step holds about five [tokens × vocabulary] fp32 tensors (6.2 GB at 2k tokens),
so at 8k (~25 GB) its memory is the line through the 2k and 4k measurements (the step's memory is
linear in the tokens), marked `~`.

Ends with one JSON line: the step's memory, unchunked ÷ chunked at the default chunk, at 8k tokens
(target: 4×). Also printed: tokens per second at 2k, chunked against unchunked (target: chunked at
most 10% slower).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

VOCAB = 151_936  # Qwen2.5's
TARGET_MEMORY = 4.0  # unchunked ÷ chunked peak memory at 8k tokens
TARGET_SLOWDOWN = 0.10  # chunked at most this much slower at 2k tokens
console = Console(width=200)


def model_dir() -> Path:
    """The tiny builder's Qwen2 with a 151,936-token vocabulary, built once under ~/.cache."""
    path = Path("~/.cache/streamrl/models/bench-long-context-v151936").expanduser()
    if (path / "config.json").exists():
        return path
    from streamrl_cli.models.tiny import TinySpec, _build_model, _build_tokenizer

    spec = TinySpec(max_position_embeddings=65_536)
    tokenizer = _build_tokenizer(spec)
    with console.status("building the 151,936-token model (once, cached) ..."):
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        _build_model(spec, VOCAB, tokenizer).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        tmp.rename(path)
    return path


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def one(length: int, chunk: int, reps: int) -> dict:
    """One configuration, in this process: a step's peak memory and tokens per second."""
    import torch

    from streamrl_cli.trainer.algo.losses import SamplingTransform
    from streamrl_cli.trainer.loop.batch import Rollout, collate
    from streamrl_cli.trainer.role.models import load_policy, policy_forward
    from streamrl_cli.transport.wire import Sample

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    model = load_policy(str(model_dir()), torch.float32).train()
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
    prompt, response = ids[:256], ids[256:]
    sample = Sample(
        prompt_id="p", sample_index=0, token_ids=response, logprobs=[-1.0] * len(response),
        finish_reason="length", weight_version=0,
    )  # fmt: skip
    mb = collate([Rollout(prompt_tokens=prompt, sample=sample, reward=1.0, advantage=1.0)])
    sampling = SamplingTransform.tempered(1.0)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        logp, ent = policy_forward(model, mb, sampling, entropy=True, chunk=chunk)
        loss = -(logp * mb.mask).sum() / mb.mask.sum() - 0.001 * (ent * mb.mask).sum() / mb.mask.sum()
        loss.backward()
        return time.perf_counter() - t0

    loaded = rss_gb()
    # The first step warms up (allocator, thread pools); past 8k a step takes minutes: no warm-up.
    warm = 1 if length <= 8192 else 0
    times = [step() for _ in range(reps + warm)][warm:]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB → GB (Linux)
    return {
        "length": length,
        "chunk": chunk,
        "tokens_s": length / min(times),
        "peak_gb": peak,
        "step_gb": peak - loaded,
    }


def sp_rank(rank: int, address: str, length: int, chunk: int, out: str) -> None:
    """One rank of a sequence-parallel group of two (gloo): a step on one sequence of `length`
    tokens split between the ranks; writes this rank's step memory and time to `out`.<rank>."""
    import torch

    from streamrl_cli.trainer.algo.losses import SamplingTransform
    from streamrl_cli.trainer.loop.batch import Rollout, collate
    from streamrl_cli.trainer.role.learner import init_distributed
    from streamrl_cli.trainer.role.models import load_policy
    from streamrl_cli.trainer.role.sequence_parallel import SequenceParallel
    from streamrl_cli.transport.wire import Sample

    init_distributed(rank, 2, address, "gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    sp = SequenceParallel.setup(2)
    model = sp.install(load_policy(str(model_dir()), torch.float32).train())
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
    sample = Sample(prompt_id="p", sample_index=0, token_ids=ids[256:], logprobs=[-1.0] * (length - 256),
                    finish_reason="length", weight_version=0)  # fmt: skip
    # Two sequences: sequence parallelism runs packed rows (one row of both here).
    rows = [Rollout(prompt_tokens=ids[:256], sample=sample, reward=1.0, advantage=1.0)]
    mb = collate(rows)
    sampling = SamplingTransform.tempered(1.0)
    loaded = rss_gb()
    times = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        logp, ent = sp.policy_forward(model, mb, sampling, entropy=True, chunk=chunk)
        loss = -(logp * mb.mask).sum() / mb.mask.sum() - 0.001 * (ent * mb.mask).sum() / mb.mask.sum()
        loss.backward()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    Path(f"{out}.{rank}").write_text(json.dumps({"step_gb": peak - loaded, "tokens_s": length / min(times)}))


def sp_pair(length: int, chunk: int) -> dict:
    """A step on one `length`-token sequence split over two ranks: the larger rank's step memory."""
    import tempfile

    import torch.multiprocessing as mp

    from streamrl_cli.trainer.role.learner import open_group_store

    store, address = open_group_store(2, "127.0.0.1")
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rank"
        mp.start_processes(sp_rank, args=(address, length, chunk, out), nprocs=2, start_method="spawn")
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    del store
    return {"step_gb": max(r["step_gb"] for r in ranks), "tokens_s": min(r["tokens_s"] for r in ranks)}


def fits(length: int, chunk: int) -> bool:
    """Whether a configuration's logits fit this machine's available memory with room to spare: a
    step holds about five [tokens × vocabulary] fp32 tensors at once unchunked (the logits, the
    log-softmax's and the entropy's temporaries, their gradients: measured 6.2 GB at 2k tokens) and
    three of a chunk's chunked."""
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    copies, rows = (5, length) if chunk == 0 else (3, min(chunk, length))
    return copies * rows * VOCAB * 4 < 0.8 * avail


def plan(lengths: list[int], chunks: list[int], default: int) -> list[tuple[int, int]]:
    """(tokens, chunk) to run: every chunk at 2k and 8k; at 4k the whole logits and the default chunk
    (the second unchunked point, for the line through 2k and 4k where 8k does not fit); at longer
    lengths the default chunk alone (a step there takes minutes on two cores)."""
    out = []
    for length in lengths:
        if length in (2048, 8192):
            out += [(length, c) for c in chunks]
        elif length < 8192:
            out += [(length, 0), (length, default)]
        else:
            out.append((length, default))
    return out


def extrapolated(results: dict, length: int) -> float | None:
    """The unchunked step's memory at `length` on the line through the two shortest lengths measured."""
    known = sorted((n, r["step_gb"]) for (n, c), r in results.items() if c == 0 and r is not None)
    if len(known) < 2:
        return None
    (n0, m0), (n1, m1) = known[:2]
    return m0 + (m1 - m0) * (length - n0) / (n1 - n0)


def main() -> None:
    from streamrl_cli.recipe.schema import TrainerConfig

    LOGITS_CHUNK = TrainerConfig().logits_chunk  # noqa: N806 (the schema's default)
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,4096,8192,32768")
    ap.add_argument("--chunks", default=f"0,512,{LOGITS_CHUNK}")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--one", nargs=2, type=int, help=argparse.SUPPRESS)  # length chunk: a child process
    ap.add_argument(
        "--sp-length", type=int, default=4096, help="SP 1 at this length against SP 2 at twice it"
    )
    ap.add_argument("--sp", nargs=2, type=int, help=argparse.SUPPRESS)  # length chunk: SP 2 in a child
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, args.reps)))
        return
    if args.sp:
        print(json.dumps(sp_pair(*args.sp)))
        return
    model_dir()
    lengths = [int(x) for x in args.lengths.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")]
    configs = plan(lengths, chunks, LOGITS_CHUNK)
    results: dict[tuple[int, int], dict | None] = {}
    with console.status("") as status:
        for length, chunk in configs:
            if not fits(length, chunk):
                results[(length, chunk)] = None
                continue
            status.update(f"{length} tokens, logits_chunk={chunk} ...")
            reps = args.reps if length <= 4096 else 1
            out = subprocess.run(
                [sys.executable, __file__, "--one", str(length), str(chunk), "--reps", str(reps)],
                capture_output=True, text=True, timeout=900,
            )  # fmt: skip
            if out.returncode != 0:
                console.print(f"[red]{length} tokens, chunk {chunk} failed[/red]\n{out.stderr[-2000:]}")
                results[(length, chunk)] = None
                continue
            results[(length, chunk)] = json.loads(out.stdout.strip().splitlines()[-1])

    table = Table(
        title=f"one policy training step, one sequence, tiny Qwen2 (hidden 64) with a {VOCAB:,}-token "
        f"vocabulary, fp32, {os.cpu_count()} CPU cores"
    )
    for col in (
        "tokens",
        "logits_chunk",
        "tokens/s",
        "vs unchunked",
        "peak RSS GB",
        "step GB",
        "unchunked ÷ this",
    ):
        table.add_column(col, justify="right")
    for length, chunk in configs:
        r, base = results[(length, chunk)], results.get((length, 0))
        label = "0 (whole)" if chunk == 0 else str(chunk)
        if r is None:
            guess = extrapolated(results, length) if chunk == 0 else None
            note = f"does not fit (~{guess:.1f} GB)" if guess else "does not fit"
            table.add_row(str(length), label, "-", "-", "-", note, "-")
            continue
        speed = f"{r['tokens_s'] / base['tokens_s']:.2f}" if base and chunk else "-"
        base_gb = base["step_gb"] if base else extrapolated(results, length)
        mem = "-" if not chunk or not base_gb else f"{'' if base else '~'}{base_gb / r['step_gb']:.1f}×"
        table.add_row(
            str(length),
            label,
            f"{r['tokens_s']:,.0f}",
            speed,
            f"{r['peak_gb']:.2f}",
            f"{r['step_gb']:.2f}",
            mem,
        )
    console.print(table)

    # Sequence parallelism: SP 2 at twice the tokens against SP 1 (the same chunked step above).
    single = results.get((args.sp_length, LOGITS_CHUNK))
    with console.status(f"sequence parallel: 2 ranks, {2 * args.sp_length} tokens ..."):
        out = subprocess.run(
            [sys.executable, __file__, "--sp", str(2 * args.sp_length), str(LOGITS_CHUNK)],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
    if single and out.returncode == 0:
        pair = json.loads(out.stdout.strip().splitlines()[-1])
        sp_table = Table(title=f"sequence parallelism: per-rank step memory (chunk {LOGITS_CHUNK})")
        for col in ("layout", "tokens per sequence", "tokens per rank", "step GB per rank", "tokens/s"):
            sp_table.add_column(col, justify="right")
        sp_table.add_row("SP 1", f"{args.sp_length:,}", f"{args.sp_length:,}", f"{single['step_gb']:.2f}",
                         f"{single['tokens_s']:,.0f}")  # fmt: skip
        sp_table.add_row("SP 2 (2 gloo ranks)", f"{2 * args.sp_length:,}", f"{args.sp_length:,}",
                         f"{pair['step_gb']:.2f}", f"{pair['tokens_s']:,.0f}")  # fmt: skip
        console.print(sp_table)
        console.print(
            f"SP 2 holds a sequence twice as long at {pair['step_gb'] / single['step_gb']:.2f}× the per-rank "
            "step memory of SP 1 (target 1 ± 0.15)"
        )
    elif out.returncode != 0:
        console.print(f"[red]sequence parallel step failed[/red]\n{out.stderr[-2000:]}")

    at2k_base, at2k = results.get((2048, 0)), results.get((2048, LOGITS_CHUNK))
    if at2k_base and at2k:
        speed = at2k["tokens_s"] / at2k_base["tokens_s"]
        met = "met" if speed >= 1 - TARGET_SLOWDOWN else "NOT met"
        console.print(
            f"2k tokens/s: unchunked {at2k_base['tokens_s']:,.0f}, chunked ({LOGITS_CHUNK}) "
            f"{at2k['tokens_s']:,.0f}: {speed:.2f}× (target ≥ {1 - TARGET_SLOWDOWN:.2f}×) {met}"
        )
    base, chunked = results.get((8192, 0)), results.get((8192, LOGITS_CHUNK))
    base_gb = base["step_gb"] if base else extrapolated(results, 8192)
    if base_gb and chunked:
        how = "measured" if base else "unchunked extrapolated from 2k and 4k: it does not fit here"
        ratio = base_gb / chunked["step_gb"]
        met = "met" if ratio >= TARGET_MEMORY else "NOT met"
        console.print(
            f"8k step memory: unchunked ÷ chunked = {ratio:.1f}× ({how}; target ≥ {TARGET_MEMORY:.0f}×) {met}"
        )
        print(
            json.dumps(
                {
                    "bench": "long_context",
                    "metric": f"peak memory unchunked/chunked at 8k (step GB, chunk {LOGITS_CHUNK}; {how})",
                    "value": round(chunked["step_gb"], 3),
                    "baseline": round(base_gb, 3),
                    "ratio": round(ratio, 2),
                    "target": TARGET_MEMORY,
                }
            )
        )


if __name__ == "__main__":
    main()
