"""Elastic weight groups with real generator processes (real vLLM on CPU) and the trainer's own
WeightPublisher: a generator killed between versions, one started late (issue #4).

The harness is test_generator_role's (rendezvous server, DispatchService, generators started as
`streamrl run` starts them); the weights go through ``trainer.publish.WeightPublisher``, which
forms a new broadcast group whenever the generators change. Three engine starts in all, never more
than two engines at once; the tests run in file order.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from support.engine import LONG_PROMPT, hf_greedy, randomize
from support.generator_harness import Harness, serving, wait_until

from streamrl_cli.weights.layout import WAITING

pytestmark = pytest.mark.slow

PROMPTS = [LONG_PROMPT[k:] + LONG_PROMPT[:k] for k in range(0, 60, 10)]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    yield from serving(Harness(tmp_path_factory.mktemp("elastic"), instances=2, transport="elastic"))


def publish(h: Harness, version: int, seed: int) -> dict:
    state = randomize(h.hf, seed=seed)  # h.hf now holds these weights: the reference below
    stats = h.publisher.publish(state, version).result(timeout=240)
    assert h.rdv.versions()["current"] == version
    return stats


def greedy_samples(h: Harness, version: int) -> dict[str, set[str]]:
    """Greedy outputs of every prompt equal transformers' on the current weights; who served what."""
    ids = h.submit(PROMPTS, temperature=0.0, max_tokens=12, ignore_eos=True)
    got = {s.prompt_id: s for s in h.receive(len(PROMPTS))}
    assert [got[i].token_ids for i in ids] == [hf_greedy(h.hf, p, 12) for p in PROMPTS]
    assert {got[i].weight_version for i in ids} == {version}
    by: dict[str, set[str]] = {}
    for i in ids:
        by.setdefault(got[i].generator, set()).add(i)
    return by


def served(h: Harness) -> dict[str, tuple[str, int | None]]:
    return {m["member_id"]: (m["state"], m["weight_version"]) for m in h.rdv.members("generator")}


def reported(h: Harness, member_id: str) -> str | None:
    states = {m["member_id"]: m["reported_state"] for m in h.rdv.members("generator")}
    return states.get(member_id)


def test_a_version_reaches_both_generators_on_a_group_formed_for_them(harness):
    stats = publish(harness, 1, seed=11)
    assert (stats["members"], stats["attempts"]) == (2, 1)
    assert set(greedy_samples(harness, 1)) == {"generator-0", "generator-1"}


def test_after_a_generator_is_killed_the_next_version_reaches_the_survivor(harness):
    victim = harness.generators[1]
    os.killpg(victim.pid, signal.SIGKILL)
    assert victim.wait(timeout=30) == -signal.SIGKILL
    # Published at once: the rendezvous still counts generator-1 alive, so the first group is
    # planned with it; it never says it is ready, is marked lost, and the version goes again to
    # a group of the survivor alone, without waiting for any broadcast timeout.
    t0 = time.monotonic()
    stats = publish(harness, 2, seed=12)
    assert time.monotonic() - t0 < harness.publisher.transfer_timeout_s
    assert (stats["members"], stats["attempts"]) == (1, 2)
    assert served(harness) == {"generator-0": ("alive", 2), "generator-1": ("lost", 1)}
    assert set(greedy_samples(harness, 2)) == {"generator-0"}


def test_a_late_generator_loads_the_trainers_weights_before_it_takes_work(harness):
    late = harness.start_generator(2)
    harness.generators.append(late)
    wait_until(lambda: reported(harness, "generator-2") == WAITING or late.poll() is not None,
               240, "the late generator waiting for weights")  # fmt: skip
    assert late.poll() is None, harness.log_tails()
    # The run is at version 2, the newcomer holds the checkpoint's weights: it takes no work.
    assert set(greedy_samples(harness, 2)) == {"generator-0"}
    stats = publish(harness, 3, seed=13)  # the next version goes to a group with the newcomer in it
    assert (stats["members"], stats["attempts"]) == (2, 1)
    assert served(harness)["generator-2"] == ("alive", 3)
    by = greedy_samples(harness, 3)
    assert set(by) == {"generator-0", "generator-2"}, by  # it serves now, and only version 3
