"""The elastic rule (streamrl_cli.elastic.policy): every branch, with hand-computed numbers."""

from __future__ import annotations

import pytest

from streamrl_cli.elastic.policy import ADD, HOLD, RELEASE, ElasticPolicy, Observation, problems
from streamrl_cli.errors import StreamRLError
from streamrl_cli.recipe.schema import ElasticConfig


def obs(i: int, n: int, t_gen: float, t_train: float, idle: float = 0.0) -> Observation:
    return Observation(iteration=i, instances=n, t_gen=t_gen, t_train=t_train, generator_idle=idle)


def policy(**kw) -> ElasticPolicy:  # type: ignore[no-untyped-def]
    base = dict(enabled=True, min=1, max=4, patience=2, cooldown=1, idle_release=0.5)
    return ElasticPolicy(config=ElasticConfig(**{**base, **kw}))


def test_delta_and_delta_prime_are_the_papers() -> None:
    d = policy().observe(obs(0, 2, t_gen=9.0, t_train=3.0))
    assert d.delta == pytest.approx(6.0)  # T_gen − T_train
    assert d.delta_prime == pytest.approx(3.0)  # T_gen / (n + 1): 9 s on 2 → 6 s on 3


def test_the_long_tail_floor_is_not_counted_as_saved() -> None:
    p = policy(patience=1)
    # 12 s of generation of which 9 s is one long sample: one more instance saves (12 − 9) / 3 = 1 s.
    d = p.observe(
        Observation(iteration=0, instances=2, t_gen=12.0, t_train=11.5, generator_idle=0.0, t_floor=9.0)
    )
    assert d.delta_prime == pytest.approx(1.0)
    assert d.action == HOLD  # Δ 0.5 s < Δ′ 1 s
    d = p.observe(
        Observation(iteration=1, instances=2, t_gen=12.0, t_train=10.0, generator_idle=0.0, t_floor=9.0)
    )
    assert d.action == ADD  # Δ 2 s > Δ′ 1 s
    # A floor above T_gen (clock skew between hosts) saves nothing rather than a negative time.
    d = p.observe(
        Observation(iteration=2, instances=2, t_gen=1.0, t_train=0.5, generator_idle=0.0, t_floor=2.0)
    )
    assert d.delta_prime == 0.0


def test_adds_after_patience_iterations_of_delta_above_delta_prime() -> None:
    p = policy(patience=3)
    assert p.observe(obs(0, 1, 10.0, 2.0)).action == HOLD  # Δ 8 > Δ′ 5, streak 1
    assert p.observe(obs(1, 1, 10.0, 2.0)).action == HOLD  # streak 2
    d = p.observe(obs(2, 1, 10.0, 2.0))
    assert (d.action, d.target) == (ADD, 2)
    assert "3 iteration" in d.reason


def test_no_add_when_one_more_instance_saves_less_than_the_gap() -> None:
    p = policy(patience=1)
    # Δ = 1 s, Δ′ = 6/3 = 2 s: another instance would leave the trainer idle instead.
    assert p.observe(obs(0, 2, 6.0, 5.0)).action == HOLD
    # Equality is not enough either.
    assert p.observe(obs(1, 2, 6.0, 4.0)).action == HOLD


def test_streak_resets_when_balanced_in_between() -> None:
    p = policy(patience=2)
    p.observe(obs(0, 1, 10.0, 2.0))
    p.observe(obs(1, 1, 3.0, 3.0))  # balanced: streak back to 0
    assert p.observe(obs(2, 1, 10.0, 2.0)).action == HOLD
    assert p.observe(obs(3, 1, 10.0, 2.0)).action == ADD


def test_never_above_max() -> None:
    p = policy(max=2, patience=1, cooldown=0)
    d = p.observe(obs(0, 2, 10.0, 1.0))
    assert d.action == HOLD and "max 2" in d.reason


def test_cooldown_holds_then_acts() -> None:
    p = policy(patience=1, cooldown=2)
    assert p.observe(obs(0, 1, 10.0, 1.0)).action == ADD
    assert p.observe(obs(1, 2, 10.0, 1.0)).reason.startswith("cooldown")
    assert p.observe(obs(2, 2, 10.0, 1.0)).reason.startswith("cooldown")
    d = p.observe(obs(3, 2, 10.0, 1.0))  # the streak kept counting through the cooldown
    assert (d.action, d.target) == (ADD, 3)


def test_releases_when_idle_beyond_bound_and_one_fewer_is_enough() -> None:
    p = policy(patience=2, idle_release=0.5)
    # 3 instances, T_gen 2 s, T_train 6 s: on 2 instances T_gen = 3 s ≤ 6 s.
    assert p.observe(obs(0, 3, 2.0, 6.0, idle=0.7)).action == HOLD
    d = p.observe(obs(1, 3, 2.0, 6.0, idle=0.7))
    assert (d.action, d.target) == (RELEASE, 2)


def test_no_release_that_the_next_add_would_undo() -> None:
    p = policy(patience=1, idle_release=0.5)
    # Idle, but on one instance fewer generation (2 · 4 / 1 = 8 s) would exceed training (5 s).
    assert p.observe(obs(0, 2, 4.0, 5.0, idle=0.9)).action == HOLD


def test_no_release_below_idle_bound() -> None:
    p = policy(patience=1, idle_release=0.5)
    assert p.observe(obs(0, 3, 2.0, 6.0, idle=0.5)).action == HOLD


def test_never_below_min() -> None:
    p = policy(min=2, patience=1)
    d = p.observe(obs(0, 2, 1.0, 10.0, idle=0.95))
    assert d.action == HOLD and "min 2" in d.reason


def test_back_to_bounds_first() -> None:
    # Scaled below min by hand (or an instance lost): back to min at once, no patience.
    d = policy(min=2).observe(obs(0, 1, 1.0, 1.0))
    assert (d.action, d.target) == (ADD, 2)
    d = policy(max=2).observe(obs(0, 4, 1.0, 1.0))
    assert (d.action, d.target) == (RELEASE, 2)


def test_one_instance_never_released_by_idle() -> None:
    p = ElasticPolicy(config=ElasticConfig(enabled=True, min=1, max=3, patience=1, cooldown=0))
    assert p.observe(obs(0, 1, 0.1, 10.0, idle=0.99)).action == HOLD


def test_growing_outputs_grow_then_shrinking_ones_release() -> None:
    """A run whose generation work grows past training, then falls: 1 → 2 → 3 → 2 → 1."""
    p = policy(patience=2, cooldown=1, max=3)
    n, actions = 1, []
    work = [4, 8, 15, 15, 15, 15, 15, 15, 3, 3, 3, 3, 3, 3, 3]  # instance-seconds of generation per batch
    for i, w in enumerate(work):
        t_gen = w / n
        d = p.observe(obs(i, n, t_gen, 4.0, idle=max(0.0, 1 - t_gen / 4.0)))
        if d.action != HOLD:
            actions.append((i, d.action, d.target))
            n = d.target
    assert [a[1:] for a in actions] == [(ADD, 2), (ADD, 3), (RELEASE, 2), (RELEASE, 1)]


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"min": 0}, "min"),
        ({"min": 3, "max": 2}, "max"),
        ({"patience": 0}, "patience"),
        ({"cooldown": -1}, "cooldown"),
        ({"idle_release": 1.0}, "idle_release"),
        ({"idle_release": 0.0}, "idle_release"),
    ],
)
def test_bad_config_names_the_key(kw: dict, key: str) -> None:
    cfg = ElasticConfig(**kw)
    assert [k for k, _ in problems(cfg)] == [key]
    with pytest.raises(StreamRLError, match=f"elastic.{key}"):
        ElasticPolicy(config=cfg)


def test_the_policy_takes_the_recipe_section_as_loaded() -> None:
    from streamrl_cli.recipe.load import load

    keys = {"enabled": "true", "max": 3, "patience": 4, "cooldown": 0, "idle_release": 0.3}
    r = load("local", [f"roles.generator.elastic.{k}={v}" for k, v in keys.items()]).recipe
    section = r.roles.generator.elastic
    assert section == ElasticConfig(enabled=True, min=1, max=3, patience=4, cooldown=0, idle_release=0.3)
    assert ElasticPolicy(config=section).config is section  # no copy with defaults of its own
