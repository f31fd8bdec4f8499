"""Algorithm 1 and its two-site and heterogeneous variants: which GPUs go to which stage.

- One pool of n GPUs (one site, one kind) — the StreamRL paper's Algorithm 1: over all
  x + y ≤ n, minimise the iteration time of P_gen(x) and P_train(y), each with its best
  parallelism. P_gen and P_train are first tabulated as best-so-far curves (the fastest plan
  on at most x GPUs), so every y is paired with the best generator on the remaining n − y GPUs
  in one pass: O(n) compositions instead of O(n²) (`brute_force` keeps the literal double loop,
  for tests and the benchmark).
- Two pools (two sites, or two kinds), budgets m for generation and n for training: plan both
  with their full budgets, then shrink the faster stage to the fewest GPUs that still keep up
  with the slower one, and release the rest.
- Several pools: every (generation pool, training pool) pairing is planned as above, and the
  options are ranked by throughput or by throughput per cost.

The iteration time is mode-aware (planner.iteration): streaming and asynchrony change which
split is best.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

from streamrl_cli.planner import PlannerError
from streamrl_cli.planner.costmodel import CostModel
from streamrl_cli.planner.generation import GenerationModel, GenPlan
from streamrl_cli.planner.hardware import GPUSpec, Hardware
from streamrl_cli.planner.iteration import IterationEstimate, compose, engine_swap_s, weight_sync_s
from streamrl_cli.planner.training import TrainingModel, TrainPlan
from streamrl_cli.planner.workload import Workload

OBJECTIVES = ("throughput", "cost")


@dataclass(frozen=True)
class Pool:
    """GPUs of one kind at one site that the search may hand out."""

    name: str  # label in tables ("h800", "a.h800", ...)
    kind: str  # hardware kind (key of the hardware catalogue)
    gpus: int  # budget
    site: str = "default"
    gpus_per_node: int | None = None  # None: the hardware spec's
    cluster: str | None = None  # recipe cluster key (None: a hypothetical pool)
    partition: str | None = None
    max_trainer_gpus: int | None = None  # one trainer job's limit (partition max_nodes × GPUs per node)


@dataclass(frozen=True)
class Option:
    """One allocation: a generation plan and a training plan, and what they achieve."""

    label: str
    gen_pool: Pool
    train_pool: Pool
    gen: GenPlan
    train: TrainPlan
    estimate: IterationEstimate
    released: tuple[tuple[str, int], ...]  # (pool name, GPUs of its budget left unused)
    cost_per_hour: float  # of the GPUs used

    @property
    def samples_per_cost(self) -> float:
        """Samples per unit of cost (relative price × GPU-hours)."""
        return self.estimate.samples_per_s * 3600 / self.cost_per_hour

    def key(self, objective: str) -> tuple:
        if objective == "cost":
            return (-self.samples_per_cost, self.estimate.iteration_s)
        return (self.estimate.iteration_s, self.cost_per_hour)


@dataclass(frozen=True)
class SearchResult:
    options: tuple[Option, ...]  # best first by `objective`
    objective: str

    @property
    def recommended(self) -> Option:
        return self.options[0]


def trainer_counts(pool: Pool, gpn: int) -> list[int]:
    """Trainer sizes a job can take: part of one node, or whole nodes (within the job's limit)."""
    cap = min(pool.gpus, pool.max_trainer_gpus or pool.gpus)
    return [d for d in range(1, gpn + 1) if gpn % d == 0 and d <= cap] + list(range(2 * gpn, cap + 1, gpn))


class Planner:
    """Searches allocations for one workload; stage models are built once per hardware kind."""

    def __init__(
        self,
        wl: Workload,
        hardware: Hardware,
        cm: CostModel,
        layouts: str = "trainer",
        *,
        trainer_tps: tuple[int, ...] | None = None,
        trainer_eps: tuple[int, ...] | None = None,
    ):
        self.wl, self.hardware, self.cm = wl, hardware, cm
        self.layouts = layouts  # training layouts planned (see TrainingModel)
        self.trainer_tps = trainer_tps  # the trainer's TP degrees tried (None: TrainingModel's)
        self.trainer_eps = trainer_eps  # ... and its EP degrees (None: TrainingModel's)
        self._gen: dict[tuple[str, int], GenerationModel] = {}
        self._train: dict[tuple[str, int], TrainingModel] = {}
        self._tables: dict[tuple, list] = {}

    def spec(self, pool: Pool) -> GPUSpec:
        hw = self.hardware.get(pool.kind)
        if pool.gpus_per_node and pool.gpus_per_node != hw.gpus_per_node:
            hw = dataclasses.replace(hw, gpus_per_node=pool.gpus_per_node)
        return hw

    def gen_model(self, pool: Pool) -> GenerationModel:
        hw = self.spec(pool)
        key = (hw.name, hw.gpus_per_node)
        if key not in self._gen:
            self._gen[key] = GenerationModel(self.cm, hw, self.wl)
        return self._gen[key]

    def train_model(self, pool: Pool) -> TrainingModel:
        hw = self.spec(pool)
        key = (hw.name, hw.gpus_per_node)
        if key not in self._train:
            self._train[key] = TrainingModel(
                self.cm,
                hw,
                self.wl,
                self.layouts,
                tensor_parallel=self.trainer_tps,
                expert_parallel=self.trainer_eps,
            )
        return self._train[key]

    def gen_table(self, pool: Pool) -> list[GenPlan | None]:
        key = ("gen", pool.kind, pool.gpus_per_node, pool.gpus)
        if key not in self._tables:
            self._tables[key] = self.gen_model(pool).table(pool.gpus)
        return self._tables[key]

    def train_table(self, pool: Pool) -> list[TrainPlan | None]:
        key = ("train", pool.kind, pool.gpus_per_node, pool.gpus, pool.max_trainer_gpus)
        if key not in self._tables:
            counts = trainer_counts(pool, self.spec(pool).gpus_per_node)
            self._tables[key] = self.train_model(pool).table(counts, pool.gpus)
        return self._tables[key]

    def evaluate(self, label: str, gp: Pool, gen: GenPlan, tp: Pool, train: TrainPlan) -> Option:
        """Compose one allocation into an option (iteration time, cost, released GPUs)."""
        ghw, thw = self.spec(gp), self.spec(tp)
        cross = gp.site != tp.site
        nbytes = self.wl.version_bytes
        sync = weight_sync_s(nbytes, ghw, thw, cross, self.hardware.cross_site_bw)
        est = compose(self.wl, gen, train, sync, engine_swap_s(nbytes, gen, ghw))
        if gp == tp:
            released = ((gp.name, gp.gpus - gen.gpus - train.gpus),)
        else:
            released = ((gp.name, gp.gpus - gen.gpus), (tp.name, tp.gpus - train.gpus))
        cost = gen.gpus * ghw.cost_per_hour + train.gpus * thw.cost_per_hour
        return Option(label, gp, tp, gen, train, est, released, cost)

    def single_pool(self, pool: Pool, objective: str = "throughput") -> list[Option]:
        """Algorithm 1 on one pool: for each trainer size y, the best generator on the n − y GPUs
        left (the best-so-far table makes that one lookup). Best first by `objective`."""
        n = pool.gpus
        gen_t = self.gen_table(pool)
        tm = self.train_model(pool)
        seen: dict[tuple[int, int], Option] = {}
        for y in trainer_counts(pool, self.spec(pool).gpus_per_node):
            gen = gen_t[n - y] if y < n else None
            if gen is None:
                continue
            for train in tm.candidates(y):
                o = self.evaluate("split", pool, gen, pool, train)
                k = (gen.gpus, y)
                if k not in seen or o.key("throughput") < seen[k].key("throughput"):
                    seen[k] = o
        return sorted(seen.values(), key=lambda o: o.key(objective))

    def two_pools(self, gen_pool: Pool, train_pool: Pool) -> Option | None:
        """Both budgets in full, then the faster stage shrunk to keep pace with the slower one."""
        gen_t, train_t = self.gen_table(gen_pool), self.train_table(train_pool)
        gen, train = gen_t[gen_pool.gpus], train_t[train_pool.gpus]
        if gen is None or train is None:
            return None
        if gen.time_s <= train.time_s:
            times = [p.time_s if p else float("inf") for p in gen_t]
            gen = gen_t[_first_at_most(times, train.time_s, gen_pool.gpus)] or gen
        else:
            times = [p.time_s if p else float("inf") for p in train_t]
            train = train_t[_first_at_most(times, gen.time_s, train_pool.gpus)] or train
        options = [
            self.evaluate("shrunk", gen_pool, gen, train_pool, t)
            for t in self.train_model(train_pool).candidates(train.gpus)
        ]
        return min(options, key=lambda o: o.key("throughput"), default=None)

    def search(
        self, pools: list[Pool], objective: str = "throughput", extra: list[Option] = ()
    ) -> SearchResult:
        """Every pairing of pools; the best option of each, plus runners-up of single-pool splits.

        Each pairing is planned for throughput (its budget is what the user has); the objective
        then ranks the options. Ranking by cost never shrinks a budget to chase cost per sample:
        a tail-bound generation stage is always "cheaper" on fewer GPUs, only slower."""
        if objective not in OBJECTIVES:
            raise PlannerError(f"unknown objective {objective!r}; valid: {', '.join(OBJECTIVES)}")
        options: list[Option] = list(extra)
        for gp in pools:
            for tp in pools:
                if gp == tp:
                    options += self.single_pool(gp)[:4]
                else:
                    o = self.two_pools(gp, tp)
                    if o is not None:
                        options.append(o)
        if not options:
            raise self.explain(pools)
        unique: dict[tuple, Option] = {}
        for o in options:  # the labelled extras (current, even split) come first and win
            unique.setdefault(_identity(o), o)
        ranked = sorted(unique.values(), key=lambda o: o.key(objective))
        return SearchResult(tuple(ranked), objective)

    def explain(self, pools: list[Pool]) -> PlannerError:
        """Why no allocation exists: the clearest reason we can find."""
        wl, m = self.wl, self.wl.model
        what = f"{m.name} ({m.params / 1e9:.1f}B, {wl.training_label})"
        lines = []
        for pool in pools:
            hw = self.spec(pool)
            gm, tm = self.gen_model(pool), self.train_model(pool)
            need = tm.smallest_fitting(trainer_counts(Pool(pool.name, pool.kind, 4096), hw.gpus_per_node))
            allowed = min(pool.gpus, pool.max_trainer_gpus or pool.gpus)
            usable = hw.usable_bytes / 1e9
            if not gm.tps:
                lines.append(
                    f"{pool.name}: the weights ({m.weight_bytes / 1e9:.0f} GB) do not fit one generator "
                    f"instance of up to {hw.gpus_per_node} {hw.name} GPUs ({usable:.0f} GB usable each)"
                )
            elif need is None:
                lines.append(f"{pool.name}: no trainer layout of {what} fits up to 4096 {hw.name} GPUs")
            elif len(pools) == 1 and need + min(gm.tps) > pool.gpus:
                lines.append(
                    f"{pool.name}: budget too small: training {what} needs at least {need} {hw.name} GPUs "
                    f"and generation {min(gm.tps)}, but the budget is {pool.gpus}"
                )
            elif need > allowed:
                lines.append(
                    f"{pool.name}: training {what} needs at least {need} {hw.name} GPUs; "
                    f"the budget (or one trainer job) allows {allowed}"
                )
        if not lines:
            lines.append("no pool can host both stages; give more GPUs (--gpus / --sites)")
        return PlannerError("no allocation fits:\n  - " + "\n  - ".join(lines))

    def brute_force(self, pool: Pool) -> Option | None:
        """Algorithm 1 literally: every x + y ≤ n with its best plans (O(n²); tests, benchmark)."""
        gm, tm = self.gen_model(pool), self.train_model(pool)
        best: Option | None = None
        gen_best = [gm.best(x) for x in range(pool.gpus + 1)]
        for y in trainer_counts(pool, self.spec(pool).gpus_per_node):
            train = tm.best(y)
            if train is None:
                continue
            for x in range(1, pool.gpus - y + 1):
                gen = gen_best[x]
                if gen is None:
                    continue
                o = self.evaluate("brute force", pool, gen, pool, train)
                if best is None or o.key("throughput") < best.key("throughput"):
                    best = o
        return best


def _identity(o: Option) -> tuple:
    g, t = o.gen, o.train
    return (o.gen_pool.name, g.gpus, g.tp, g.instances, o.train_pool.name, t.gpus, t.layout)


def _first_at_most(times: list[float], limit: float, upto: int) -> int | None:
    """Smallest index i ≤ upto with times[i] ≤ limit, for a non-increasing `times` (a best-so-far table)."""
    # bisect needs ascending keys: negate the non-increasing times.
    i = bisect.bisect_left([-t for t in times[: upto + 1]], -limit * (1 + 1e-9))
    return i if i <= upto else None
