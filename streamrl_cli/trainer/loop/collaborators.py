"""What the trainer's loop needs of the parts it drives, as small typed interfaces.

The pipeline (``trainer.loop.pipeline``) is handed its collaborators by ``trainer.main``; the unit tests
hand it small fakes instead. Each interface below is the whole of what the loop calls, so a fake
that has these methods is a faithful stand-in, and an optional capability is a method every
implementation has (with an answer that means "not here"), never an attribute probed for.

- ``SampleService``: the data plane (``transport.routing.DispatchService``): requests out, samples back.
- ``LearnerDriver``: every trainer rank's learner, driven from rank 0 (``trainer.role.ranks.RankDriver``).
- ``WeightPublisher``: the weight transfer (``trainer.role.publish.WeightPublisher``); the loop keeps
  the one transfer in flight (``trainer.loop.weight_sync.Transfers``).
- ``PromptSource`` and ``LengthRanker``: the prompt sampler and the skewness ranker.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from streamrl_cli.tasks import Prompt
    from streamrl_cli.trainer.loop.batch import Rollout
    from streamrl_cli.transport.wire import Request, Sample


@runtime_checkable
class SampleService(Protocol):
    """Where requests go and samples come from."""

    def submit(self, requests: Iterable[Request]) -> None:
        """Queue requests for the generators."""

    def cancel(self, prompt_ids: Iterable[str], *, keep: bool = False) -> None:
        """Stop these requests; with `keep`, each sample comes back as far as it got (a pause)."""

    def get(self, timeout: float | None = None) -> Sample | None:
        """The next finished sample, or None after `timeout` seconds without one."""

    def generators(self) -> list[str]:
        """The generators connected now (their ids)."""


@runtime_checkable
class LearnerDriver(Protocol):
    """Rank 0's handle on the trainer ranks' learners."""

    def round(self, micro_batches: Sequence[Sequence[Rollout]], *, last: bool) -> None:
        """Forward and backward one micro-batch per rank; `last`: the iteration's last round."""

    def step(self) -> dict[str, float]:
        """The optimizer step; its statistics."""

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model's weights (every rank takes part in gathering them)."""


@runtime_checkable
class Members(Protocol):
    """The rendezvous, as far as catching up newcomers needs it."""

    def members(self, role: str | None = None) -> list[dict[str, Any]]: ...


@runtime_checkable
class WeightPublisher(Protocol):
    """Delivers weight versions to the generators, one transfer at a time, in order."""

    # The rendezvous the publisher proposes versions through; None: no newcomer is caught up.
    rdv: Members | None

    def publish(
        self, tensors: Mapping[str, torch.Tensor], version: int, *, then: Callable[[int], None] | None = None
    ) -> concurrent.futures.Future:
        """Start delivering `version` (after any earlier one); `then(version)` once it is current."""
        ...


@runtime_checkable
class PromptSource(Protocol):
    """The prompt sampler (``tasks.sampler.PromptSampler``)."""

    def next_batch(self, size: int | None = None) -> list[Prompt]: ...

    def state(self) -> dict[str, Any]: ...

    def give_back(self, prompts: Sequence[Prompt]) -> list[int]:
        """Draw these prompts again first; their positions (saved with a later batch's state)."""
        ...

    def positions(self, prompts: Sequence[Prompt]) -> list[int]:
        """Where these prompts are in the data order (to draw them again after a resume)."""
        ...


@runtime_checkable
class LengthRanker(Protocol):
    """Predicts each prompt's output length, and learns from what came out (``ranker``)."""

    def rank(self, prompts: Sequence[Prompt]) -> list[float]: ...

    def update(self, prompts: Sequence[Prompt], lengths: Sequence[float]) -> None: ...


def members(protocol: type) -> list[str]:
    """The names an implementation of `protocol` must have (methods and attributes)."""
    names = [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]
    return sorted([*names, *vars(protocol).get("__annotations__", {})])
