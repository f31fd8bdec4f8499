"""The loop's collaborators (trainer.loop.collaborators): the real parts trainer.main hands the pipeline
have every method and attribute the pipeline calls, so the unit tests' fakes, held to the same
interfaces, stand for them faithfully."""

from __future__ import annotations

import inspect

import pytest

from streamrl_cli.trainer.loop import collaborators as C


def real_parts():
    from streamrl_cli.ranker.base import Ranker
    from streamrl_cli.tasks.sampler import PromptSampler
    from streamrl_cli.trainer.role.publish import WeightPublisher
    from streamrl_cli.trainer.role.ranks import RankDriver
    from streamrl_cli.transport.routing import DispatchService

    return [
        (C.SampleService, DispatchService),
        (C.LearnerDriver, RankDriver),
        (C.WeightPublisher, WeightPublisher),
        (C.PromptSource, PromptSampler),
        (C.LengthRanker, Ranker),
    ]


@pytest.mark.parametrize("protocol,cls", real_parts(), ids=lambda x: x.__name__)
def test_the_real_parts_have_what_the_loop_calls(protocol, cls):
    attributes = set(vars(protocol).get("__annotations__", {}))
    for name in C.members(protocol):
        if name in attributes:  # set in __init__: looked for in its source
            assert any(f"self.{name}" in inspect.getsource(k) for k in cls.__mro__ if k is not object), name
            continue
        assert callable(getattr(cls, name, None)), f"{cls.__name__} has no {name}()"
        wanted = inspect.signature(getattr(protocol, name)).parameters
        have = inspect.signature(getattr(cls, name)).parameters
        assert list(wanted) == list(have), (
            f"{cls.__name__}.{name}{tuple(have)}: the loop calls {tuple(wanted)}"
        )
        for p, q in zip(wanted.values(), have.values(), strict=True):
            assert p.kind == q.kind, (
                f"{cls.__name__}.{name}: {p.name} is {q.kind}, the loop passes it {p.kind}"
            )
