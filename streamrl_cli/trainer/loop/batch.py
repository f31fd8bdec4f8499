"""From streamed samples to padded tensors, and the grouping rules of stream pipelining.

A :class:`Rollout` is one sample with everything the loss needs that does not depend on the
current weights: its prompt, the behaviour log-probs, the reward, and (GRPO) its advantage.
:class:`GroupCollector` holds samples until their whole group is in (GRPO normalises within a
group, so a group is the unit that becomes trainable); :func:`collate` pads a list of
rollouts into a :class:`MicroBatch` (prompt + response, right-padded; per-token tensors are
aligned with ``targets = input_ids[:, 1:]``, so position j is the prediction of token j + 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from streamrl_cli.transport.wire import UNROUTED, Sample


@dataclass
class Rollout:
    """One sample, ready to train on."""

    prompt_tokens: list[int]
    sample: Sample
    reward: float
    # False: the reward function returned None ("cannot score"); the sample is kept in its group
    # (the group stays whole) but takes no part in the loss: its tokens are masked out.
    scored: bool = True
    advantage: float = 0.0  # the estimator's, from the group and batch (GAE: computed per token later)
    shaping: float = 0.0  # reward shaping (DAPO's overlong penalty): the loss's reward is reward + shaping
    staleness: int = 0  # trainer's version - the sample's weight version
    iteration: int = 0  # the iteration whose batch it belongs to

    @property
    def response_len(self) -> int:
        return len(self.sample.token_ids)

    @property
    def trained_tokens(self) -> int:
        """Tokens the loss sees: the model's (a trajectory's environment tokens are context only)."""
        return sum(self.sample.loss_mask) if self.sample.loss_mask else self.response_len


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded with 0
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1] = input_ids[:, 1:]
    mask: torch.Tensor  # [B, L-1] float: 1 where the target is a response token
    behaviour_logp: torch.Tensor  # [B, L-1] the generator's log-probs at response positions (0 elsewhere)
    rewards: torch.Tensor  # [B] sequence rewards, shaping included (GAE's)
    advantages: torch.Tensor  # [B] sequence advantages (every estimator but GAE)
    rollouts: list[Rollout] = field(default_factory=list)
    # On-policy distillation: the teacher's log-probs at response positions, and 1 where a token has
    # one (None: no rollout of the batch was scored by a teacher).
    teacher_logp: torch.Tensor | None = None
    teacher_mask: torch.Tensor | None = None
    # Routing replay: the generator's experts at every input position, uint8 [B, L, MoE layers × k],
    # 255 where unknown (padding, a position its engine did not compute; None: no sample carried any).
    routed: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return len(self.rollouts)


def collate(rollouts: Sequence[Rollout], device: torch.device | str = "cpu") -> MicroBatch:
    """Pad rollouts into one micro-batch (an empty list gives a 1-row batch with an all-zero mask)."""
    rows = list(rollouts)
    if not rows:  # a rank with nothing left still takes part in the collectives of a step
        empty = Sample(
            prompt_id="", sample_index=0, token_ids=[0], logprobs=[0.0], finish_reason="stop",
            weight_version=0,
        )  # fmt: skip
        mb = collate([Rollout(prompt_tokens=[0], sample=empty, reward=0.0)], device)
        mb.mask.zero_()
        mb.rollouts = []
        return mb
    length = max(len(r.prompt_tokens) + r.response_len for r in rows)
    n = len(rows)
    ids = torch.zeros(n, length, dtype=torch.long)
    attn = torch.zeros(n, length, dtype=torch.long)
    mask = torch.zeros(n, length - 1)
    blp = torch.zeros(n, length - 1)
    scored = any(r.sample.teacher_logprobs for r in rows)
    tlp = torch.zeros(n, length - 1) if scored else None
    tmask = torch.zeros(n, length - 1) if scored else None
    routed = _routed(rows, length)
    for i, r in enumerate(rows):
        p, resp = len(r.prompt_tokens), r.response_len
        ids[i, : p + resp] = torch.tensor(r.prompt_tokens + list(r.sample.token_ids), dtype=torch.long)
        attn[i, : p + resp] = 1
        # logits at p-1 predict the first response token; a trajectory's environment tokens are
        # context, not trained: out of the loss, the KL and the importance ratios.
        if r.sample.loss_mask:
            mask[i, p - 1 : p - 1 + resp] = torch.tensor(r.sample.loss_mask, dtype=torch.float32) * float(
                r.scored
            )
        else:
            mask[i, p - 1 : p - 1 + resp] = float(r.scored)
        blp[i, p - 1 : p - 1 + resp] = torch.tensor(r.sample.logprobs, dtype=torch.float32)
        if tlp is not None and tmask is not None:
            if len(r.sample.teacher_logprobs) == resp:
                tlp[i, p - 1 : p - 1 + resp] = torch.tensor(r.sample.teacher_logprobs, dtype=torch.float32)
                tmask[i, p - 1 : p - 1 + resp] = 1.0
            else:  # not scored: no teacher signal (the loss counts it as distill/unscored_tokens)
                tlp[i, p - 1 : p - 1 + resp] = blp[i, p - 1 : p - 1 + resp]
    return MicroBatch(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        targets=ids[:, 1:].to(device),
        mask=mask.to(device),
        behaviour_logp=blp.to(device),
        rewards=torch.tensor([r.reward + r.shaping for r in rows], dtype=torch.float32, device=device),
        advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32, device=device),
        rollouts=rows,
        teacher_logp=tlp.to(device) if tlp is not None else None,
        teacher_mask=tmask.to(device) if tmask is not None else None,
        routed=routed.to(device) if routed is not None else None,
    )


def _routed(rows: Sequence[Rollout], length: int) -> torch.Tensor | None:
    """The samples' routed experts in the micro-batch's layout, [B, length, layers × k] (wire.Sample)."""
    carried = [r for r in rows if r.sample.routed_experts]
    if not carried:
        return None
    widths = set()
    for r in carried:
        positions = len(r.prompt_tokens) + r.response_len - 1
        size = len(r.sample.routed_experts)
        if positions < 1 or size % positions:
            raise ValueError(
                f"sample {r.sample.prompt_id}/{r.sample.sample_index}: {size} bytes of routed experts do "
                f"not divide over its {positions} positions (prompt + response - 1)"
            )
        widths.add(size // positions)
    if len(widths) != 1:
        raise ValueError(f"samples carry routed experts of different widths {sorted(widths)} (layers × k)")
    width = widths.pop()
    out = torch.full((len(rows), length, width), UNROUTED, dtype=torch.uint8)
    for i, r in enumerate(rows):
        if r.sample.routed_experts:
            arr = torch.frombuffer(bytearray(r.sample.routed_experts), dtype=torch.uint8)
            out[i, : arr.numel() // width] = arr.view(-1, width)
    return out


def by_tokens(rollouts: Sequence[Rollout], *, rows: int, tokens: int) -> list[list[Rollout]]:
    """Rollouts cut into micro-batches of at most ``rows`` rollouts and ``tokens`` tokens (the sum of
    each rollout's prompt + response tokens: what a packed forward costs), for
    ``train.micro_batch`` and ``train.micro_batch_tokens``.

    The rule: the rollouts keep their order, and a micro-batch takes the next one unless that would
    pass either bound (greedy cuts), so the same list always gives the same micro-batches. A rollout
    longer than ``tokens`` by itself is a micro-batch of its own. ``tokens`` 0: no token bound, the
    row count alone."""
    if rows < 1:
        raise ValueError(f"rows must be at least 1, got {rows}")
    if tokens < 0:
        raise ValueError(f"tokens must be 0 (no bound) or more, got {tokens}")
    out: list[list[Rollout]] = []
    current: list[Rollout] = []
    used = 0
    for r in rollouts:
        n = len(r.prompt_tokens) + r.response_len
        if current and (len(current) == rows or (tokens and used + n > tokens)):
            out.append(current)
            current, used = [], 0
        current.append(r)
        used += n
    if current:
        out.append(current)
    return out


class GroupCollector:
    """Samples in, whole groups out (each group once, in completion order).

    `finish` turns a complete group (its samples in index order) into rollouts: it scores them
    and sets advantages. A group is complete when all `group_size` sample indices arrived.
    """

    def __init__(self, group_size: int, finish: Callable[[str, list[Sample]], list[Rollout]]):
        self.group_size = group_size
        self.finish = finish
        self._open: dict[str, dict[int, Sample]] = {}

    @staticmethod
    def key(sample: Sample) -> str:
        """The group a sample belongs to: its request's, or the group a re-generated sample rejoins."""
        return sample.group_id or sample.prompt_id

    def add(self, sample: Sample) -> list[Rollout]:
        key = self.key(sample)
        group = self._open.setdefault(key, {})
        group[sample.sample_index] = sample
        if len(group) < self.group_size:
            return []
        del self._open[key]
        return self.finish(key, [group[i] for i in sorted(group)])

    @property
    def pending(self) -> int:
        return sum(len(g) for g in self._open.values())

    def take(self, key: str) -> dict[int, Sample]:
        """The samples of an unfinished group so far (sample index -> sample), forgotten here."""
        return self._open.pop(key, {})

    def drop(self, keys: Sequence[str]) -> int:
        """Forget these groups' samples so far; returns how many tokens they had."""
        return sum(len(s.token_ids) for k in keys for s in self._open.pop(k, {}).values())
