"""From a recipe and the command line to a search, and from its answer back to a recipe.

    recipe roles ──► pools: (cluster, partition) → hardware kind, GPUs per node, site, budget
    --gpus N      ──► one pool of N GPUs where the trainer runs
    --sites SPEC  ──► pools named by the recipe's clusters (`a=16,b.h20=32`) or hypothetical
                      ones by kind (`h800:512@site-a,h20:384`)
    option        ──► recipe overrides (`roles.generator.instances=20`, ...), checked by loading
                      the recipe with them, so `streamrl run` accepts what tune-split writes

A role on a `launcher: local` cluster (or a CPU partition) counts CPU worker processes as its
devices, of kind `cpu`: so the local recipe can be tuned too, from a CPU profile.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from streamrl_cli.errors import RecipeError
from streamrl_cli.planner import PlannerError
from streamrl_cli.planner.costmodel import ProfiledCostModel, make_cost_model
from streamrl_cli.planner.hardware import load_hardware
from streamrl_cli.planner.profile import load_profile
from streamrl_cli.planner.search import Option, Planner, Pool, SearchResult, trainer_counts
from streamrl_cli.planner.workload import Workload, workload_from_recipe
from streamrl_cli.recipe.schema import GPUS_PER_NODE, MODES, NODES, Recipe


@dataclass(frozen=True)
class Placement:
    """Where a role of the recipe runs, as the planner sees it."""

    cluster: str
    partition: str | None
    kind: str
    gpus_per_node: int
    site: str
    max_trainer_gpus: int | None

    def pool(self, gpus: int) -> Pool:
        name = f"{self.cluster}.{self.partition}" if self.partition else self.cluster
        return Pool(
            name=name,
            kind=self.kind,
            gpus=gpus,
            site=self.site,
            gpus_per_node=self.gpus_per_node,
            cluster=self.cluster,
            partition=self.partition,
            max_trainer_gpus=self.max_trainer_gpus,
        )


def placement(r: Recipe, cluster: str, partition: str | None) -> Placement:
    c = r.clusters[cluster]
    if c.launcher == "local":
        return Placement(cluster, None, "cpu", 1, c.site, None)
    if partition is None:
        gpu_parts = [n for n, p in c.partitions.items() if p.gpus_per_node > 0]
        if len(gpu_parts) != 1:
            raise PlannerError(
                f"cluster {cluster!r} has partitions {', '.join(c.partitions)}: "
                f"name one as {cluster}.PARTITION=N in --sites"
            )
        partition = gpu_parts[0]
    p = c.partitions.get(partition)
    if p is None:
        raise PlannerError(
            f"cluster {cluster!r} has no partition {partition!r}; partitions: {', '.join(c.partitions)}"
        )
    if p.gpus_per_node == 0 or p.gpu_type == "none":
        return Placement(cluster, partition, "cpu", 1, c.site, p.max_nodes)
    return Placement(
        cluster, partition, p.gpu_type.lower(), p.gpus_per_node, c.site, p.max_nodes * p.gpus_per_node
    )


def role_devices(r: Recipe, role: str) -> int:
    """Devices (GPUs, or CPU processes) the recipe gives a role now."""
    if role == "trainer":
        t = r.roles.trainer
        return t.nodes * max(t.gpus_per_node, 1)
    g = r.roles.generator
    return g.instances * max(g.gpus_per_instance, 1)


def pools_from_recipe(r: Recipe, gpus: int | None = None, sites: str | None = None) -> list[Pool]:
    t, g = r.roles.trainer, r.roles.generator
    tp_, gp_ = placement(r, t.cluster, t.partition), placement(r, g.cluster, g.partition)
    if gpus is not None and sites is not None:
        raise PlannerError("give either --gpus (one pool) or --sites (several), not both")
    if gpus is not None:
        if gpus < 2:
            raise PlannerError(f"--gpus {gpus}: budget too small, each stage needs at least one GPU")
        return [tp_.pool(gpus)]
    if sites is not None:
        return parse_sites(r, sites)
    if (tp_.cluster, tp_.partition) == (gp_.cluster, gp_.partition):
        return [tp_.pool(role_devices(r, "trainer") + role_devices(r, "generator"))]
    return [gp_.pool(role_devices(r, "generator")), tp_.pool(role_devices(r, "trainer"))]


MAX_POOL_GPUS = NODES * GPUS_PER_NODE  # as `tune-split --gpus`: past it, no cluster there is
SITE_ITEM = re.compile(
    r"^(?P<kind>[\w-]+):(?P<n>\d+)(@(?P<site>[\w.-]+))?$|^(?P<where>[\w.-]+)=(?P<count>\d+)$"
)


def parse_sites(r: Recipe, spec: str) -> list[Pool]:
    """`a=16,b.h20=32` (recipe clusters) or `h800:512@site-a,h20:384` (hypothetical pools)."""
    pools: list[Pool] = []
    problems = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        m = SITE_ITEM.match(item)
        if m is None:
            problems.append(f"{item!r}: expected CLUSTER[.PARTITION]=GPUS or KIND:GPUS[@SITE]")
        elif m["where"]:
            cluster, _, partition = m["where"].partition(".")
            if cluster not in r.clusters:
                problems.append(
                    f"{item!r}: no cluster {cluster!r} in the recipe; clusters: {', '.join(r.clusters)}"
                )
                continue
            try:
                pools.append(placement(r, cluster, partition or None).pool(int(m["count"])))
            except PlannerError as e:
                problems.append(f"{item!r}: {e}")
        else:
            kind = m["kind"].lower()
            pools.append(
                Pool(
                    name=f"{kind}@{m['site'] or 'site'}",
                    kind=kind,
                    gpus=int(m["n"]),
                    site=m["site"] or "site",
                )
            )
    names = [p.name for p in pools]
    problems += [f"pool {n!r} given twice" for n in sorted({n for n in names if names.count(n) > 1})]
    problems += [f"{p.name}: a budget of {p.gpus} GPUs" for p in pools if p.gpus < 1]
    problems += [
        f"{p.name}: a budget of {p.gpus} GPUs, more than the {MAX_POOL_GPUS:,} of the largest clusters"
        for p in pools
        if p.gpus > MAX_POOL_GPUS
    ]
    if problems or not pools:
        raise PlannerError("--sites: " + ("; ".join(problems) or "no pools given"))
    return pools


def current_option(planner: Planner, r: Recipe, pools: list[Pool]) -> Option | None:
    """The recipe's own allocation, for comparison (None if it does not fit or is not in the pools)."""
    t, g = r.roles.trainer, r.roles.generator
    tpl, gpl = placement(r, t.cluster, t.partition), placement(r, g.cluster, g.partition)
    by_place = {(p.cluster, p.partition): p for p in pools}
    tpool, gpool = by_place.get((tpl.cluster, tpl.partition)), by_place.get((gpl.cluster, gpl.partition))
    if tpool is None or gpool is None:
        return None
    y, x = role_devices(r, "trainer"), role_devices(r, "generator")
    fits = x + y <= gpool.gpus if gpool == tpool else (x <= gpool.gpus and y <= tpool.gpus)
    if not fits:
        return None  # the recipe's own allocation is outside the budget being planned
    gen_tp = g.tensor_parallel if g.gpus_per_instance else 1
    gen = planner.gen_model(gpool).plan(gen_tp, g.instances)
    tm = planner.train_model(tpool)
    pp, tp = t.pipeline_parallel, t.tensor_parallel if t.gpus_per_node else 1
    sp, ckpt = planner.wl.sequence_parallel, t.activation_checkpointing
    group = tp * pp * sp
    train = tm.plan(tp, pp, y // group, t.zero_stage, t.cpu_offload, sp, ckpt) if y % group == 0 else None
    if gen is None:
        return None
    if train is not None:
        return planner.evaluate("current", gpool, gen, tpool, train)
    # Its layout does not fit: the same GPUs with their best layout.
    options = [planner.evaluate("current split", gpool, gen, tpool, t) for t in tm.candidates(y)]
    return min(options, key=lambda o: o.estimate.iteration_s, default=None)


def even_option(planner: Planner, pool: Pool) -> Option | None:
    """Half the pool to each stage (the paper's starting point), each with its best plan."""
    hw = planner.spec(pool)
    counts = [y for y in trainer_counts(pool, hw.gpus_per_node) if y <= pool.gpus // 2]
    if not counts:
        return None
    y = counts[-1]
    gen = planner.gen_model(pool).best(pool.gpus - y)
    options = [
        planner.evaluate("even split", pool, gen, pool, train)
        for train in planner.train_model(pool).candidates(y)
        if gen is not None
    ]
    return min(options, key=lambda o: o.estimate.iteration_s, default=None)


def trainer_runs_tp(r: Recipe) -> bool:
    """Whether the recipe checks accept a trainer tensor-parallel degree above 1 (DeepSpeed AutoTP),
    asked of the recipe with TP 2 on an even number of GPUs per node and no Ulysses. Where they refuse
    it (a trainer without AutoTP, LoRA, a mixture of experts, odd heads), tune-split plans the trainer
    at TP 1 only, so that what --write writes runs."""
    from streamrl_cli.recipe import checks

    t = r.roles.trainer
    probe = dataclasses.replace(
        t,
        tensor_parallel=2,
        gpus_per_node=max(2, t.gpus_per_node + t.gpus_per_node % 2),
        sequence_parallel=1,
    )
    tried = dataclasses.replace(r, roles=dataclasses.replace(r.roles, trainer=probe))
    return not any(path == "roles.trainer.tensor_parallel" for path, _ in checks.check(tried))


def overrides(option: Option, r: Recipe) -> list[str]:
    """Recipe overrides that put `option` into effect (validated: the recipe must load with them)."""
    gp, tp = option.gen_pool, option.train_pool
    if gp.cluster is None or tp.cluster is None:
        raise PlannerError(
            f"option uses a hypothetical pool ({gp.name if gp.cluster is None else tp.name}): "
            "nothing in the recipe to write it to; name recipe clusters in --sites (CLUSTER=GPUS)"
        )
    g, t = option.gen, option.train
    if t.ep > 1:
        raise PlannerError(
            f"the recommended trainer ({t.layout}) splits the experts over {t.ep} ranks (expert "
            "parallelism), which the trainer does not run and no recipe key states: tune-split plans it "
            "to show what it would gain; the options without EP in the table are layouts the trainer runs"
        )
    cpu_gen, cpu_train = gp.kind == "cpu", tp.kind == "cpu"
    gpn = tp.gpus_per_node or 1
    nodes, per_node = (t.gpus, 0) if cpu_train else ((t.gpus // gpn, gpn) if t.gpus >= gpn else (1, t.gpus))
    lines = [
        f"roles.generator.cluster={gp.cluster}",
        *([f"roles.generator.partition={gp.partition}"] if gp.partition else []),
        f"roles.generator.instances={g.instances}",
        f"roles.generator.gpus_per_instance={0 if cpu_gen else g.tp}",
        f"roles.generator.tensor_parallel={g.tp}",
        f"roles.trainer.cluster={tp.cluster}",
        *([f"roles.trainer.partition={tp.partition}"] if tp.partition else []),
        f"roles.trainer.nodes={nodes}",
        f"roles.trainer.gpus_per_node={per_node}",
        f"roles.trainer.tensor_parallel={t.tp}",
        f"roles.trainer.pipeline_parallel={t.pp}",
        f"roles.trainer.zero_stage={t.zero}",
        f"roles.trainer.cpu_offload={str(t.offload).lower()}",
        f"roles.trainer.activation_checkpointing={str(t.checkpointing).lower()}",
        f"roles.trainer.sequence_parallel={t.sp}",
    ]
    return lines


def check_overrides(recipe: str, given: list[str], lines: list[str]) -> Recipe:
    """Load the recipe with the written overrides: what tune-split writes must be runnable."""
    from streamrl_cli.recipe.load import load

    try:
        return load(recipe, [*given, *lines]).recipe
    except RecipeError as e:
        raise PlannerError(
            f"the recommendation does not make a valid recipe (a bug in tune-split):\n{e}"
        ) from None


@dataclass(frozen=True)
class Tuned:
    """Everything `streamrl tune-split` shows: the ranked options and what they were planned for."""

    result: SearchResult
    workload: Workload
    pools: tuple[Pool, ...]
    cost_model: str  # analytic | profiled
    profiles: tuple[str, ...]  # files read


def tune(
    r: Recipe,
    *,
    gpus: int | None = None,
    sites: str | None = None,
    mode: str | None = None,
    objective: str = "throughput",
    hardware_files: list[str] = (),
    profile_files: list[str] = (),
) -> Tuned:
    """Plan the recipe's workload on its pools (or those of --gpus/--sites)."""
    hw_files = [*([r.planner.hardware_file] if r.planner.hardware_file else []), *hardware_files]
    prof_files = [*([r.planner.profile_file] if r.planner.profile_file else []), *profile_files]
    hardware = load_hardware(hw_files)
    profiles = [load_profile(f) for f in prof_files]
    if mode is not None and mode not in MODES:
        raise PlannerError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
    wl = workload_from_recipe(r, mode)
    pools = pools_from_recipe(r, gpus, sites)
    for p in pools:
        hardware.get(p.kind)  # unknown kinds fail here, with the list of known ones
    planner = Planner(
        wl, hardware, make_cost_model(profiles), trainer_tps=None if trainer_runs_tp(r) else (1,)
    )
    extra = [o for o in (current_option(planner, r, pools),) if o is not None]
    if len(pools) == 1:
        extra += [o for o in (even_option(planner, pools[0]),) if o is not None]
    result = planner.search(pools, objective, extra)
    source = planner.cm.name
    cm = planner.cm
    if isinstance(cm, ProfiledCostModel):
        if not any(cm.covers(planner.spec(p), wl.model) for p in pools):
            have = ", ".join(f"{p.hardware} × {p.model}" for p in profiles)
            source = f"analytic (the profiles cover {have}, not {wl.model.name} on these pools)"
    return Tuned(result, wl, tuple(pools), source, tuple(prof_files))
