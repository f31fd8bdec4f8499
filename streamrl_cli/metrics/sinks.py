"""Where the trainer mirrors its per-iteration record besides the rendezvous: TensorBoard, W&B.

metrics.jsonl stays the source of truth; these sinks exist because people watch runs in the
dashboards they already use. Both dashboards are optional extras (``streamrl[tensorboard]``,
``streamrl[wandb]``), imported only when a sink is made, and a missing one is a clear user
error rather than an ImportError deep inside the trainer. Dashboards take scalars only, so a
record is flattened (``{"loss": {"kl": x}}`` becomes ``loss/kl``) and the timeline is left out.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from streamrl_cli.metrics import MetricsError

SINKS = ("tensorboard", "wandb")
NOT_SCALARS = frozenset({"timeline"})  # per-iteration intervals: for `streamrl plot`, not a dashboard


class MetricsSink(ABC):
    """Receives one record per trainer step."""

    @abstractmethod
    def log(self, record: dict[str, Any], step: int) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric scalars of a record, nested dicts flattened with "/" (bools and strings dropped)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if not prefix and key in NOT_SCALARS:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    return out


class TensorBoardSink(MetricsSink):
    """Event files under ``log_dir`` (``tensorboard --logdir <run_dir>/tensorboard``)."""

    def __init__(self, log_dir: Path):
        try:
            import tensorboard  # noqa: F401  (torch's writer needs it; checked first for a clear error)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise MetricsError(
                f"metrics sink 'tensorboard' needs the tensorboard package ({e}): "
                "pip install tensorboard, or the extra streamrl[tensorboard]"
            ) from None
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, record: dict[str, Any], step: int) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink(MetricsSink):
    """A W&B run; WANDB_MODE (online, offline, disabled) is honoured, offline runs land in ``dir``."""

    def __init__(self, project: str, run_name: str, dir: Path):
        try:
            import wandb
        except ImportError as e:
            raise MetricsError(
                f"metrics sink 'wandb' needs the wandb package ({e}): "
                "pip install wandb, or the extra streamrl[wandb]"
            ) from None
        Path(dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project, name=run_name, dir=str(dir), mode=os.environ.get("WANDB_MODE") or None
        )

    def log(self, record: dict[str, Any], step: int) -> None:
        self.run.log(scalars(record), step=step)

    def close(self) -> None:
        self.run.finish()


class JsonlSink(MetricsSink):
    """One JSON line per record, flushed at once: a local fallback that needs no package or server."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a")

    def log(self, record: dict[str, Any], step: int) -> None:
        self._fh.write(json.dumps({"step": step, **record}, default=str) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def make_sinks(names: list[str], run_dir: Path, run_name: str, project: str) -> list[MetricsSink]:
    """The sinks named (``tensorboard`` → run_dir/tensorboard, ``wandb`` → project/run_name)."""
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise MetricsError(
            f"unknown metrics sink(s) {', '.join(map(repr, unknown))}; valid: {', '.join(SINKS)}"
        )
    sinks: list[MetricsSink] = []
    try:
        for name in dict.fromkeys(names):  # each once, in the order given
            if name == "tensorboard":
                sinks.append(TensorBoardSink(Path(run_dir) / "tensorboard"))
            else:
                sinks.append(WandbSink(project, run_name, Path(run_dir)))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
