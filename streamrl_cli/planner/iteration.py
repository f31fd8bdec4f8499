"""From stage times to the time of one iteration: what each pipelining mode overlaps.

    baseline     generate everything, then train on everything, then sync weights:
                 G + T + O + S  (each stage idles while the other works)
    sync-stream  samples stream to the trainer as they finish, micro-batches start at once; the
                 optimizer step and the weight sync still wait for the last sample (on-policy):
                 max_i(arrival_i + T·(1 − done_i), G + T_last) + O + S
    async        generation of the next iteration overlaps training of this one and the weight
                 transfer runs in the background; with staleness s, iteration k+s+1 needs the
                 weights of step k:
                 max(G, T + O, (G + T_last + O + S) / (s + 1))

G: generation makespan (+ loading new weights into the engines), T: streamed forward/backward
work, O: optimizer step and gradient reduction, S: weight transfer, T_last: training the last
(longest) sample after it arrives, arrival_i/done_i: the generation model's finished-token curve.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrl_cli.planner.generation import GenPlan
from streamrl_cli.planner.hardware import GPUSpec
from streamrl_cli.planner.training import TrainPlan
from streamrl_cli.planner.workload import Workload


@dataclass(frozen=True)
class IterationEstimate:
    """Predicted time of one iteration, per stage and in total."""

    mode: str
    generation_s: float
    training_s: float  # forward/backward work (streamed in sync-stream and async)
    optimizer_s: float
    weight_sync_s: float
    swap_s: float  # generators loading a received version into the engine
    iteration_s: float
    samples_per_s: float
    bubble: float  # fraction of the allocated GPU-time idle in pipeline bubbles


def weight_sync_s(
    nbytes: float, gen_hw: GPUSpec, train_hw: GPUSpec, cross_site: bool, cross_site_bw: float
) -> float:
    """Seconds to move one weight version of `nbytes` (Workload.version_bytes) from the trainer to
    every generator.

    Inside a site: a bucketed broadcast, pipelined, so about one pass over the slower NIC. Across
    sites: one copy over the inter-site link to a relay, which rebroadcasts locally while it
    receives (pipelined too: the slower of the two links sets the time).

    A version is the whole model in its dtype, with LoRA too when model.lora.sync is merged (the
    default: base + (alpha / rank)·B·A under the base model's names, trainer.role.lora.merged_state);
    with sync adapter it is the adapters alone, inside a site.
    """
    local_bw = min(gen_hw.internode_bw, train_hw.internode_bw) * train_hw.eff.comm
    local = nbytes / local_bw
    if not cross_site:
        return local
    return max(local, nbytes / cross_site_bw)


def engine_swap_s(nbytes: float, gen: GenPlan, gen_hw: GPUSpec) -> float:
    """Generators pause to copy a received version into the engine: read + write each shard once
    (an adapter: its own bytes, loaded beside the one in use)."""
    return 2 * nbytes / gen.tp / gen_hw.hbm_bw


def compose(wl: Workload, gen: GenPlan, train: TrainPlan, sync_s: float, swap_s: float) -> IterationEstimate:
    """The iteration time of `gen` + `train` in the workload's mode."""
    g, t, o, s = gen.time_s, train.compute_s, train.optimizer_s, sync_s
    if wl.mode == "baseline":
        it = g + swap_s + t + o + s
    elif wl.mode == "sync-stream":
        finish = max(at + t * (1 - done) for at, done in gen.arrival)
        finish = max(finish, g + train.last_sample_s)
        it = finish + o + s + swap_s
    elif wl.mode == "async":
        it = max(g + swap_s, t + o, (g + swap_s + train.last_sample_s + o + s) / (wl.staleness + 1))
    else:
        raise ValueError(f"unknown mode {wl.mode!r}")
    busy = gen.gpus * g + train.gpus * (t + o)
    bubble = max(0.0, 1 - busy / ((gen.gpus + train.gpus) * it))
    return IterationEstimate(
        mode=wl.mode,
        generation_s=g,
        training_s=t,
        optimizer_s=o,
        weight_sync_s=s,
        swap_s=swap_s,
        iteration_s=it,
        samples_per_s=wl.samples / it,
        bubble=bubble,
    )
