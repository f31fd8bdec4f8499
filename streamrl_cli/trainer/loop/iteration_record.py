"""What an iteration records: the one metrics record the trainer writes per iteration.

Rewards, lengths, throughput, where the time went (generation, training, waiting, weight sync), how
idle each side was, staleness (per sample and per token), what over-sampling and partial rollout
did, the data order's digest, the dispatch plan and the ranker's quality, and the timeline that
``streamrl plot`` draws. The loop (``trainer.loop.pipeline``) measures; this module only turns what it
measured into the record (``metrics`` reads it), so a metric is added here and nowhere else.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import xxhash

from streamrl_cli.agent.trajectory import FAILURES
from streamrl_cli.trainer.loop.batch import GroupCollector, Rollout
from streamrl_cli.trainer.loop.batch_state import Batch
from streamrl_cli.trainer.loop.request_id import RequestId
from streamrl_cli.trainer.loop.samples import token_versions

if TYPE_CHECKING:
    from streamrl_cli.trainer.loop.collaborators import LengthRanker


def agent_metrics(rows: Sequence[Rollout]) -> dict[str, Any]:
    """Multi-turn trajectories: turns, tool calls and errors, environment time and reward, model vs
    environment tokens, and why they ended (``agent/stop/<reason>``: counts). None: no trajectory."""
    eps = [r.sample.episode for r in rows if r.sample.episode is not None]
    if not eps:
        return {}
    n = len(eps)
    out: dict[str, Any] = {
        "agent/trajectories": n,
        "agent/turns_mean": sum(e.turns for e in eps) / n,
        "agent/turns_max": max(e.turns for e in eps),
        "agent/turns_cut": sum(e.turns_cut for e in eps),
        "agent/tool_calls": sum(e.tool_calls for e in eps),
        "agent/tool_errors": sum(e.tool_errors for e in eps),
        "agent/tool_calls_per_trajectory": sum(e.tool_calls for e in eps) / n,
        "agent/env_reward_mean": sum(e.env_reward for e in eps) / n,
        "agent/env_s": sum(e.env_s for e in eps),
        "agent/model_tokens": sum(e.model_tokens for e in eps),
        "agent/env_tokens": sum(e.env_tokens for e in eps),
        "agent/failures": sum(e.stop in FAILURES for e in eps),
    }
    for e in eps:
        key = f"agent/stop/{e.stop or 'unknown'}"
        out[key] = out.get(key, 0) + 1
    return out


def iteration_record(
    i: int,
    batch: Batch,
    *,
    mode: str,
    overlong: bool,
    version: int,
    policy: int,
    gen_spans: list[list[float]],
    sync_spans: Sequence[tuple[int, float, float]],
    discarded_tokens: int,
    ranker: LengthRanker | None,
    started: float,
    end: float,
    train_spans: list[list[float]],
    step_span: list[float],
    wait_s: float,
    stats: dict[str, Any],
) -> dict[str, Any]:
    """Iteration `i`'s record, once its step is done. `version`: the weight version the step made;
    `policy`: the batch's own (what its samples are generated with, staleness 0); the spans are
    [start, end] clock times; `overlong`: DAPO's overlong shaping is on (its mean is recorded)."""
    rows = batch.arrived.trained
    # Reward statistics over scored samples (an unscored one has no reward to average).
    rewards = [r.reward for r in rows if r.scored] or [float("nan")]  # none scored: recorded as null
    lengths = sorted(r.response_len for r in rows)
    stale = [r.staleness for r in rows]
    token_stale = [policy - v for r in rows for v in token_versions(r.sample)]
    elapsed = max(end - started, 1e-9)
    busy = sum(b - a for a, b in train_spans) + (step_span[1] - step_span[0])
    gen_busy = _covered(gen_spans + [[batch.planned.dispatched_at, batch.arrived.generated_at]], started, end)
    syncs = [s for s in sync_spans if started <= s[2] <= end + 1e-6]
    tokens = sum(lengths)
    rec = {
        "iteration": i,
        "mode": mode,
        "weight_version": version,
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "reward_max": max(rewards),
        "reward/unscored": sum(not r.scored for r in rows),
        "reward_min": min(rewards),  # with reward_max: the range the plots clip the ±std band to
        "samples": len(rows),
        "tokens": tokens,
        "len/mean": tokens / len(rows),
        "len/p50": lengths[len(lengths) // 2],
        "len/p90": lengths[min(len(lengths) - 1, int(0.9 * len(lengths)))],
        "len/max": lengths[-1],
        # The longest sequence trained (prompt + response): what a micro-batch's memory grows with.
        "len/seq_max": max(len(r.prompt_tokens) + r.response_len for r in rows),
        "samples_per_s": len(rows) / elapsed,
        "tokens_per_s": tokens / elapsed,
        "t/iteration": elapsed,
        "t/generation": batch.arrived.generated_at - batch.planned.dispatched_at,
        "t/train": busy,
        "t/longest_sample": batch.arrived.longest_s,
        "t/tail": _tail(batch, rows),
        "t/wait": wait_s,
        "t/weight_sync": sum(s[2] - s[1] for s in syncs),
        "idle/trainer": max(0.0, 1.0 - busy / elapsed),
        "idle/generator": max(0.0, 1.0 - gen_busy / elapsed),
        "staleness/mean": statistics.fmean(stale),
        "staleness/max": max(stale),
        "staleness/token_mean": statistics.fmean(token_stale) if token_stale else 0.0,
        "staleness/token_max": max(token_stale, default=0),
        "retries": batch.planned.retries,
        "rollout/aborted_groups": len(batch.arrived.aborted),
        "rollout/aborted_prompts": [batch.planned.prompts[rid][0].prompt_id for rid in batch.arrived.aborted],
        "rollout/discarded_tokens": discarded_tokens,
        "rollout/paused_groups": len(batch.arrived.paused),
        "rollout/paused_prompts": [batch.planned.prompts[rid][0].prompt_id for rid in batch.arrived.paused],
        "rollout/resumed_samples": sum(
            r.sample.episode.resumed if r.sample.episode is not None else bool(r.sample.token_versions)
            for r in rows
        ),
        # Which prompts the batch held, in order (a resumed run must repeat the same data order).
        "data/digest": _digest(batch),
        "micro_batches": len(train_spans),
        # What each prompt produced (`streamrl rank --fit` input; the benchmark's true oracle).
        "lengths/by_prompt": batch.arrived.lengths,
        "timeline": {
            "start": started,
            "end": end,
            "generation": [batch.planned.dispatched_at, batch.arrived.generated_at],
            "train": train_spans,
            "step": step_span,
            "weight_sync": [syncs[-1][1], syncs[-1][2]] if syncs else None,
        },
        **agent_metrics(rows),
        **stats,
        **skew_record(batch, ranker),
        **(batch.planned.refill.record() if batch.planned.refill is not None else {}),
    }
    if overlong:  # mean shaping of the scored samples trained (≤ 0)
        shaped = [r.shaping for r in rows if r.scored]
        rec["reward/overlong_penalty"] = statistics.fmean(shaped) if shaped else 0.0
    return rec


def skew_record(batch: Batch, ranker: LengthRanker | None) -> dict[str, Any]:
    """Ranker quality on this batch (predicted before it learned from it), then its update."""
    out: dict[str, Any] = {}
    if batch.planned.decision:
        out["dispatch/long_instances"], out["dispatch/regular_instances"] = batch.planned.decision["split"]
        out["dispatch/estimated_s"] = batch.planned.decision["estimated_s"]
    keys = [k for k in batch.arrived.observed if k in batch.planned.predicted]
    if ranker is None or len(keys) < 2:
        return out
    from streamrl_cli.ranker.quality import quality

    q = quality([batch.arrived.observed[k] for k in keys], [batch.planned.predicted[k] for k in keys])
    out.update({f"ranker/{name}": v for name, v in q.items() if name != "n"})
    ranker.update([batch.planned.prompts[k][0] for k in keys], [batch.arrived.observed[k] for k in keys])
    from streamrl_cli.ranker.turns import TurnLearner, group_turns

    turned = [k for k in keys if k in batch.arrived.turns]
    if turned and isinstance(ranker, TurnLearner):  # multi-turn: turns and tokens per turn too
        seen = [group_turns(batch.arrived.turns[k]) for k in turned]
        ranker.update_turns(
            [batch.planned.prompts[k][0] for k in turned], [t for t, _ in seen], [n for _, n in seen]
        )
    return out


def _tail(batch: Batch, rows: list[Rollout]) -> float:
    """The long tail of a batch's generation, in seconds: from when ⌊90%⌋ of its trained groups were
    generated (at most all but the last) to when the last one was. Counted in groups, because a
    group's samples finish together (0 for a batch of one group)."""
    done: dict[str, float] = {}
    for r in rows:
        key = GroupCollector.key(r.sample)
        done[key] = max(done.get(key, 0.0), batch.arrived.done_at.get((key, r.sample.sample_index), 0.0))
    times = sorted(done.values())
    if len(times) < 2:
        return 0.0
    return times[-1] - times[min(math.floor(0.9 * len(times)), len(times) - 1) - 1]


def _covered(spans: list[list[float]], start: float, end: float) -> float:
    """Length of the union of `spans` clipped to [start, end]."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in spans if b > start and a < end)
    total, cur_a, cur_b = 0.0, None, None
    for a, b in clipped:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def _digest(batch: Batch) -> str:
    """The prompts a batch drew (its groups' own ids, not retries or resumptions), in order."""
    drawn = [p.prompt_id for k, (p, _) in batch.planned.prompts.items() if RequestId.parse(k).is_group]
    return xxhash.xxh64_hexdigest("\n".join(drawn).encode())
