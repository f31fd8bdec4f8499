"""The elastic rule for generator instances: pure, no clocks, no I/O (one call per iteration).

After each iteration the trainer measures T_gen (dispatch to last sample of the batch) and T_train
(its micro-batch rounds and optimizer step) and knows how many instances produced the batch (n).

- Δ = T_gen − T_train: how much longer generation takes than training. Positive means the trainer
  waits on the generators.
- Δ′ = the time one more instance would save. Part of T_gen does not shrink with more instances:
  the longest sample's own decoding (T_floor, measured: its first token to its end), which is the
  long tail the paper's skewness-aware dispatch works on. The rest is spread over the instances at
  their measured per-instance throughput, so on n + 1 instances it takes n / (n + 1) of the time:
  Δ′ = (T_gen − T_floor) / (n + 1). (Without a measured floor, T_floor = 0: Δ′ = T_gen / (n + 1).)
- Add one instance when Δ > Δ′ for ``patience`` iterations in a row: generation is the bottleneck
  by more than what another instance recovers, so the instance pays for itself.
- Release one when the generators were idle more than ``idle_release`` of the iteration for
  ``patience`` iterations in a row, and generation with one instance fewer would still not be
  the bottleneck (T_gen · n / (n − 1) ≤ T_train): without that guard a release would be undone by
  the next add.
- Never below ``min`` nor above ``max``; after any change, no other for ``cooldown`` iterations
  (a new instance needs time to start, and the iterations after a change measure the old size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from streamrl_cli.errors import StreamRLError

if TYPE_CHECKING:  # the recipe's section, defined (keys, defaults, meaning) in the schema only
    from streamrl_cli.recipe.schema import ElasticConfig

HOLD, ADD, RELEASE = "hold", "add", "release"


def problems(c: ElasticConfig) -> list[tuple[str, str]]:
    """(key, what is wrong) for each invalid value of the ``roles.generator.elastic`` section; empty
    when it is valid."""
    out = []
    if c.min < 1:
        out.append(("min", f"must be at least 1 (the policy needs an instance to measure), got {c.min}"))
    if c.max < c.min:
        out.append(("max", f"must be at least min ({c.min}), got {c.max}"))
    if c.patience < 1:
        out.append(("patience", f"must be at least 1 iteration, got {c.patience}"))
    if c.cooldown < 0:
        out.append(("cooldown", f"must be 0 or more iterations, got {c.cooldown}"))
    if not 0.0 < c.idle_release < 1.0:
        out.append(("idle_release", f"must be a fraction strictly between 0 and 1, got {c.idle_release}"))
    return out


@dataclass(kw_only=True, frozen=True)
class Observation:
    """What one iteration measured."""

    iteration: int
    instances: int  # generator instances serving during the iteration
    t_gen: float  # seconds from dispatch to the batch's last sample
    t_train: float  # seconds of training (rounds + step)
    generator_idle: float  # fraction of the iteration no generation was running
    t_floor: float = 0.0  # the part of t_gen more instances cannot shorten (the longest sample's decoding)


@dataclass(kw_only=True, frozen=True)
class Decision:
    action: str  # hold | add | release
    target: int  # instances wanted after this decision
    delta: float  # Δ = T_gen − T_train
    delta_prime: float  # Δ′ = (T_gen − T_floor) / (n + 1)
    reason: str


@dataclass(kw_only=True)
class ElasticPolicy:
    """Keeps the streaks and the cooldown between iterations; :meth:`observe` is the whole rule."""

    config: ElasticConfig  # the recipe's roles.generator.elastic
    _add_streak: int = field(default=0, init=False)
    _release_streak: int = field(default=0, init=False)
    _last_change: int | None = field(default=None, init=False)  # iteration of the last add/release

    def __post_init__(self) -> None:
        bad = problems(self.config)
        if bad:
            raise StreamRLError("; ".join(f"elastic.{k} {msg}" for k, msg in bad))

    def observe(self, obs: Observation) -> Decision:
        c, n = self.config, obs.instances
        delta = obs.t_gen - obs.t_train
        delta_prime = max(0.0, obs.t_gen - obs.t_floor) / (n + 1)
        # Streaks count every iteration, also in a cooldown, so a lasting imbalance acts as soon as it ends.
        self._add_streak = self._add_streak + 1 if delta > delta_prime else 0
        fewer_ok = n > 1 and obs.t_gen * n / (n - 1) <= obs.t_train
        self._release_streak = (
            self._release_streak + 1 if obs.generator_idle > c.idle_release and fewer_ok else 0
        )

        def hold(reason: str) -> Decision:
            return Decision(action=HOLD, target=n, delta=delta, delta_prime=delta_prime, reason=reason)

        if n < c.min:  # below the floor (scaled down by hand, an instance lost): back to it first
            return self._change(obs, ADD, c.min, delta, delta_prime, f"{n} instance(s), below min {c.min}")
        if n > c.max:
            return self._change(
                obs, RELEASE, c.max, delta, delta_prime, f"{n} instance(s), above max {c.max}"
            )
        if self._last_change is not None and obs.iteration - self._last_change <= c.cooldown:
            return hold(f"cooldown: last change at iteration {self._last_change}")
        if self._add_streak >= c.patience:
            if n >= c.max:
                return hold(f"Δ {delta:.3g}s > Δ′ {delta_prime:.3g}s but already at max {c.max}")
            return self._change(
                obs, ADD, n + 1, delta, delta_prime,
                f"Δ {delta:.3g}s > Δ′ {delta_prime:.3g}s for {self._add_streak} iteration(s)",
            )  # fmt: skip
        if self._release_streak >= c.patience:
            if n <= c.min:
                return hold(f"generators idle {obs.generator_idle:.0%} but already at min {c.min}")
            return self._change(
                obs, RELEASE, n - 1, delta, delta_prime,
                f"generators idle {obs.generator_idle:.0%} > {c.idle_release:.0%} for "
                f"{self._release_streak} iteration(s)",
            )  # fmt: skip
        return hold("balanced")

    def _change(
        self, obs: Observation, action: str, target: int, delta: float, dp: float, why: str
    ) -> Decision:
        self._last_change = obs.iteration
        self._add_streak = self._release_streak = 0
        return Decision(action=action, target=target, delta=delta, delta_prime=dp, reason=why)
