"""GPU specs as data: the analytic cost model's inputs and the price of each kind.

Specs ship in ``hardware.yaml`` next to this module; users add kinds (or correct ours) with their
own YAML file of the same shape, merged field by field over the shipped one. Units in the file
are the ones datasheets use (TFLOP/s, GB, TB/s, GB/s, µs); :class:`GPUSpec` holds SI units so the
cost model never converts. Every problem of a file is reported at once.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from streamrl_cli.planner import PlannerError

SHIPPED = Path(__file__).with_name("hardware.yaml")

# file key -> (GPUSpec attribute, factor to SI units)
SPEC_FIELDS: dict[str, tuple[str, float]] = {
    "flops_tflops": ("flops", 1e12),
    "hbm_gb": ("hbm_bytes", 1e9),
    "hbm_tb_s": ("hbm_bw", 1e12),
    "nvlink_gb_s": ("nvlink_bw", 1e9),
    "internode_gb_s": ("internode_bw", 1e9),
    "pcie_gb_s": ("pcie_bw", 1e9),
    "host_gb_s": ("host_bw", 1e9),
    "collective_us": ("collective_s", 1e-6),
    "gpus_per_node": ("gpus_per_node", 1),
    "cost_per_hour": ("cost_per_hour", 1),
}
EFFICIENCY_FIELDS: dict[str, tuple[str, float]] = {
    "decode_memory": ("decode_memory", 1),
    "decode_compute": ("decode_compute", 1),
    "step_overhead_us": ("step_overhead_s", 1e-6),
    "layer_overhead_us": ("layer_overhead_s", 1e-6),
    "seq_overhead_us": ("seq_overhead_s", 1e-6),
    "train_compute": ("train_compute", 1),
    "micro_batch_overhead_ms": ("micro_batch_overhead_s", 1e-3),
    "comm": ("comm", 1),
    "memory_usable": ("memory_usable", 1),
    "reserve_gb": ("reserve_bytes", 1e9),
}
NETWORK_FIELDS = {"cross_site_gbit_s": 1e9 / 8, "cross_site_efficiency": 1}
FRACTIONS = ("decode_memory", "decode_compute", "train_compute", "comm", "memory_usable")


@dataclass(frozen=True)
class Efficiency:
    """How far real kernels and collectives fall short of the datasheet (all fractions ≤ 1)."""

    decode_memory: float
    decode_compute: float
    step_overhead_s: float
    layer_overhead_s: float
    seq_overhead_s: float
    train_compute: float
    micro_batch_overhead_s: float
    comm: float
    memory_usable: float
    reserve_bytes: float


@dataclass(frozen=True)
class GPUSpec:
    """One hardware kind, SI units (FLOP/s, bytes, bytes/s, seconds)."""

    name: str
    flops: float
    hbm_bytes: float
    hbm_bw: float
    nvlink_bw: float
    internode_bw: float
    pcie_bw: float
    host_bw: float
    collective_s: float
    gpus_per_node: int
    cost_per_hour: float
    eff: Efficiency

    @property
    def usable_bytes(self) -> float:
        """Memory a framework can fill on one device: HBM × usable fraction − reserve."""
        return self.hbm_bytes * self.eff.memory_usable - self.eff.reserve_bytes


@dataclass(frozen=True)
class Hardware:
    """The catalogue: every known kind, and the link between sites."""

    gpus: dict[str, GPUSpec]
    cross_site_bw: float  # bytes/s actually achieved between sites
    sources: tuple[str, ...] = field(default=())  # files merged, for messages

    def get(self, kind: str) -> GPUSpec:
        spec = self.gpus.get(kind.lower())
        if spec is None:
            close = difflib.get_close_matches(kind.lower(), list(self.gpus), n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PlannerError(
                f"no hardware spec for GPU kind {kind!r}{hint}; known: {', '.join(sorted(self.gpus))}. "
                "Add it in a YAML file (same shape as streamrl_cli/planner/hardware.yaml) and pass "
                "--hardware FILE or set planner.hardware_file in the recipe."
            )
        return spec


def load_hardware(extra: list[str | Path] | None = None) -> Hardware:
    """The shipped specs with each file of ``extra`` merged over them, in order."""
    raw = _read(SHIPPED)
    sources = [str(SHIPPED)]
    for f in extra or []:
        path = Path(f).expanduser()
        raw = _merge(raw, _read(path))
        sources.append(str(path))
    return parse(raw, " + ".join(sources))


def parse(raw: dict, source: str) -> Hardware:
    """Validate a merged hardware document and convert it to SI units."""
    problems: list[str] = []
    _unknown(raw, {"efficiency", "network", "gpus"}, "", problems)
    base_eff = raw.get("efficiency") or {}
    _unknown(base_eff, set(EFFICIENCY_FIELDS), "efficiency.", problems)
    net = raw.get("network") or {}
    _unknown(net, set(NETWORK_FIELDS), "network.", problems)
    gpus: dict[str, GPUSpec] = {}
    for name, spec in (raw.get("gpus") or {}).items():
        if not isinstance(spec, dict):
            problems.append(f"gpus.{name}: expected a mapping of spec fields, got {spec!r}")
            continue
        where = f"gpus.{name}."
        _unknown(spec, {*SPEC_FIELDS, "efficiency"}, where, problems)
        eff_raw = {**base_eff, **(spec.get("efficiency") or {})}
        _unknown(spec.get("efficiency") or {}, set(EFFICIENCY_FIELDS), where + "efficiency.", problems)
        values = _numbers(spec, SPEC_FIELDS, where, problems)
        eff = _numbers(eff_raw, EFFICIENCY_FIELDS, where + "efficiency.", problems)
        if values is None or eff is None:
            continue
        for key in FRACTIONS:
            if not 0 < eff[key] <= 1:
                problems.append(f"{where}efficiency.{key}: a fraction in (0, 1], got {eff[key]}")
        for key in ("flops", "hbm_bytes", "hbm_bw", "gpus_per_node"):
            if values[key] <= 0:
                problems.append(f"{where}{key}: must be positive, got {values[key]}")
        values["gpus_per_node"] = int(values["gpus_per_node"])
        gpus[str(name).lower()] = GPUSpec(name=str(name).lower(), eff=Efficiency(**eff), **values)
    cross = _numbers(net, {k: (k, v) for k, v in NETWORK_FIELDS.items()}, "network.", problems)
    if problems:
        raise PlannerError(
            f"{len(problems)} problem(s) in hardware specs ({source}):\n  - " + "\n  - ".join(problems)
        )
    assert cross is not None
    return Hardware(
        gpus=gpus,
        cross_site_bw=cross["cross_site_gbit_s"] * cross["cross_site_efficiency"],
        sources=tuple(source.split(" + ")),
    )


def _read(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise PlannerError(f"cannot read hardware file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise PlannerError(f"hardware file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise PlannerError(f"hardware file {path}: expected a mapping with `gpus:` at the top")
    return data


def _merge(base: Any, top: Any) -> Any:
    if isinstance(base, dict) and isinstance(top, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in top.items()}}
    return top


def _unknown(d: dict, valid: set[str], where: str, problems: list[str]) -> None:
    for key in d:
        if key not in valid:
            close = difflib.get_close_matches(str(key), sorted(valid), n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{where}{key}: unknown key{hint}; valid: {', '.join(sorted(valid))}")


def _numbers(
    d: dict, fields: dict[str, tuple[str, float]], where: str, problems: list[str]
) -> dict[str, float] | None:
    out: dict[str, float] = {}
    ok = True
    for key, (attr, factor) in fields.items():
        v = d.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float):
            problems.append(f"{where}{key}: " + ("missing" if v is None else f"expected a number, got {v!r}"))
            ok = False
        elif v < 0:
            problems.append(f"{where}{key}: must not be negative, got {v}")
            ok = False
        else:
            out[attr] = float(v) * factor
    return out if ok else None


def replace_efficiency(spec: GPUSpec, **changes: float) -> GPUSpec:
    """A copy of ``spec`` with some efficiency factors changed (calibration, what-if studies)."""
    return dataclasses.replace(spec, eff=dataclasses.replace(spec.eff, **changes))
