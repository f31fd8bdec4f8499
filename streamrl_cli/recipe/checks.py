"""Cross-field rules of a typed recipe: combinations that cannot run.

Each rule yields ``(key path, message)``; all of them are collected so that a user sees every
problem of a recipe at once. Pure functions over the dataclasses: no files, no clusters.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

from streamrl_cli.recipe import presets
from streamrl_cli.recipe.paths import is_reward_file
from streamrl_cli.recipe.schema import (
    ALGORITHMS,
    LOGGERS,
    MOE_BUILDERS,
    RESERVED_SBATCH,
    RUN_NAME,
    AlgorithmConfig,
    ClusterConfig,
    EnvServerConfig,
    GeneratorConfig,
    ModelConfig,
    Recipe,
    RoleJobConfig,
    TeacherConfig,
)

Problem = tuple[str, str]
SAMPLES_PER_ITERATION = 1 << 22  # prompts × group size (a large run today: 8,192 × 64 = 524,288)
_Pool = TypeVar("_Pool", TeacherConfig, EnvServerConfig)


def templates_dir() -> Path:
    from streamrl_cli.resources import data_dir

    return data_dir("slurm_templates")


def check(r: Recipe) -> list[Problem]:
    return [
        *_run(r),
        *_clusters(r),
        *_trainer(r),
        *_generator(r),
        *_teacher(r),
        *_env_server(r),
        *_rendezvous(r),
        *_run_roots(r),
        *_workload(r),
        *_task(r),
        *_lora(r),
        *_agent(r),
    ]


def resolve(r: Recipe) -> Recipe:
    """Settings whose value follows from others, made explicit once (after ``check`` found nothing):
    the roles read what runs, and the run's config.yaml shows it."""
    a = presets.fill(r.algorithm, r.task.max_output_len)  # the algorithm's defaults for keys left unset
    r.roles.teacher = teacher_placed(r)
    r.roles.env_server = env_server_placed(r)
    if a.is_correction == "auto":  # truncated IS corrects the lag of async or resumed samples
        lags = a.mode == "async" or r.rollout.partial
        # With old_policy=behaviour the loss's own ratio is already against the generators' policy.
        a.is_correction = "on" if lags and a.old_policy == "trainer" else "off"
    return r


def _algorithm_of(r: Recipe) -> AlgorithmConfig:
    """The recipe's algorithm section as it will run (its preset's defaults filled in), for checks."""
    a = r.algorithm
    if a.name not in ALGORITHMS:  # reported by the schema walk; the rest checked as the default's
        a = dataclasses.replace(a, name=AlgorithmConfig().name)
    return presets.filled(a, r.task.max_output_len)


def _run(r: Recipe) -> Iterator[Problem]:
    """The run's name becomes a directory under run.root: nothing that could leave it or mislead."""
    if not RUN_NAME.fullmatch(r.run.name):
        yield (
            "run.name",
            f"{r.run.name!r} is not a run name: use 1-64 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit (it names the run's directory under run.root, its jobs and its logs), e.g. "
            "gsm8k-grpo_7b.v2",
        )


def _clusters(r: Recipe) -> Iterator[Problem]:
    if not r.clusters:
        yield "clusters", "no cluster defined; add one, e.g. `- cluster@clusters.local: local` to defaults"
    for name, c in r.clusters.items():
        if c.launcher == "slurm" and not c.partitions:
            yield f"clusters.{name}.partitions", "a SLURM cluster needs at least one partition"
        if c.launcher == "local" and c.slurm_cluster:
            yield f"clusters.{name}.slurm_cluster", "only meaningful with launcher=slurm"
        if c.setup_template and not (templates_dir() / c.setup_template).is_file():
            have = sorted(p.name for p in templates_dir().glob("*"))
            yield (
                f"clusters.{name}.setup_template",
                f"no file {c.setup_template!r} in slurm_templates/; have: {have}",
            )
        for key in c.sbatch:
            opt = str(key).replace("_", "-")
            if opt.startswith("-") or not opt:
                yield f"clusters.{name}.sbatch", f"write option names without dashes: {opt.lstrip('-')!r}"
            elif opt in RESERVED_SBATCH:
                yield (
                    f"clusters.{name}.sbatch.{key}",
                    f"--{opt} is set by StreamRL from the roles' settings (nodes, GPUs, CPUs, partition, "
                    "time_min, arrays, logs); set it there instead",
                )
        if c.launcher == "local" and (c.sbatch or c.srun_args or c.python or c.exclusive or c.run_root):
            yield (
                f"clusters.{name}",
                "sbatch, srun_args, python, exclusive and run_root apply to launcher=slurm only",
            )
        if c.run_root is not None and not Path(c.run_root).is_absolute():
            yield (
                f"clusters.{name}.run_root",
                f"must be an absolute path on that cluster's nodes, got {c.run_root!r}",
            )
        for pname, p in c.partitions.items():
            for key in ("gpus_per_node", "cpus_per_node", "mem_gb_per_node", "max_nodes"):
                if getattr(p, key) < (0 if key == "gpus_per_node" else 1):
                    yield (
                        f"clusters.{name}.partitions.{pname}.{key}",
                        f"must be positive, got {getattr(p, key)}",
                    )


def _placement(
    r: Recipe, role: str, job: RoleJobConfig, out: list[Problem]
) -> tuple[ClusterConfig | None, int | None]:
    """Checks the role's cluster/partition into ``out``; returns the cluster and its GPUs per node."""
    c = r.clusters.get(job.cluster)
    if c is None:
        out.extend(_named_cluster(r, role, job.cluster))
        return None, None
    if c.launcher == "local":
        return c, c.local_gpus
    if job.partition is None:
        out.append(
            (
                f"roles.{role}.partition",
                f"required on SLURM cluster {job.cluster!r}; partitions: {', '.join(c.partitions)}",
            )
        )
        return c, None
    p = c.partitions.get(job.partition)
    if p is None:
        close = difflib.get_close_matches(job.partition, list(c.partitions), n=1, cutoff=0.4)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        out.append(
            (
                f"roles.{role}.partition",
                f"cluster {job.cluster!r} has no partition {job.partition!r}{hint}; "
                f"partitions: {', '.join(c.partitions)}",
            )
        )
        return c, None
    # Trainer ranks are one task per GPU, all on the same node: their CPUs add up.
    tasks = max(getattr(job, "gpus_per_node", 1), 1)
    if job.cpus_per_task * tasks > p.cpus_per_node and not c.sbatch.get("overcommit"):
        out.append(
            (
                f"roles.{role}.cpus_per_task",
                f"{job.cpus_per_task} CPUs per task × {tasks} task(s) per node but partition "
                f"{job.partition!r} has {p.cpus_per_node} CPUs per node",
            )
        )
    if job.mem_gb is not None and job.mem_gb > p.mem_gb_per_node:
        out.append(
            (
                f"roles.{role}.mem_gb",
                f"{job.mem_gb} GiB but partition {job.partition!r} nodes have {p.mem_gb_per_node} GiB",
            )
        )
    return c, p.gpus_per_node


def _trainer(r: Recipe) -> Iterator[Problem]:
    t = r.roles.trainer
    placement: list[Problem] = []
    c, gpus_avail = _placement(r, "trainer", t, placement)
    yield from placement
    yield from _common(t, "trainer")
    if t.nodes < 1:
        yield "roles.trainer.nodes", f"must be at least 1, got {t.nodes}"
    yield from _gpus_fit(t, "trainer", "gpus_per_node", c, gpus_avail, "per node")
    if c and c.launcher == "slurm" and t.partition in c.partitions:
        max_nodes = c.partitions[t.partition].max_nodes
        if t.nodes > max_nodes:
            yield "roles.trainer.nodes", f"{t.nodes} nodes but partition {t.partition!r} allows {max_nodes}"
    if t.zero_stage not in (0, 1, 2, 3):
        yield "roles.trainer.zero_stage", f"must be 0, 1, 2 or 3, got {t.zero_stage}"
    if t.attention == "flash_attention_2" and gpus_avail == 0:
        yield (
            "roles.trainer.attention",
            f"flash_attention_2 runs on CUDA GPUs only, and the trainer's cluster {t.cluster!r} gives it "
            "none (it trains on CPUs): use sdpa or eager",
        )
    if t.logits_chunk < 0:
        yield "roles.trainer.logits_chunk", f"must be 0 (unchunked) or more, got {t.logits_chunk}"
    if t.restarts < 0:
        yield "roles.trainer.restarts", f"must be 0 (no restart) or more, got {t.restarts}"
    if t.pipeline_parallel != 1:
        yield (
            "roles.trainer.pipeline_parallel",
            f"{t.pipeline_parallel}: the trainer is ZeRO data parallel (DeepSpeed ZeRO stages 0-3, "
            "optionally with cpu_offload) with tensor or Ulysses sequence parallelism, and runs no "
            "pipeline parallel layout; set it to 1 and shard the model with zero_stage=3 or "
            "tensor_parallel, or split long sequences with sequence_parallel (tune-split plans such layouts)",
        )
    yield from _tensor_parallel(r)
    yield from _sequence_parallel(r)


# config.json keys of a mixture-of-experts model's routed experts per MoE layer, first found wins
# (Qwen-MoE, Mixtral, DeepSeek; models.architecture reads the same).
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def is_moe(m: ModelConfig) -> bool | None:
    """Whether the policy is a mixture of experts, as far as the submit host can tell: its local
    config.json says (experts per MoE layer), or else the builder that makes it (a tiny-moe one or a
    dense one); None where it cannot tell (a hub id, an unreadable config.json)."""
    config = Path(m.path).expanduser() / "config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict):
            return None
        return any(
            isinstance(data.get(k), int) and not isinstance(data[k], bool) and data[k] > 0
            for k in EXPERT_KEYS
        )
    if m.builder is not None:
        return m.builder in MOE_BUILDERS
    return None


def _tensor_parallel(r: Recipe) -> Iterator[Problem]:
    """DeepSpeed's AutoTP splits every attention and MLP layer of the trainer's models over `tp` ranks
    (trainer.role.tensor_parallel): `tp` must divide the trainer's ranks (the rest is ZeRO's data
    parallelism) and the query and KV heads (each rank computes whole heads). Refused, by name: with
    sequence parallelism (one model-parallel layout per DeepSpeed engine), with LoRA (DeepSpeed's ZeRO
    optimizer does not find the adapters' parameters once AutoTP replaced the layers), and for
    mixture-of-experts models (AutoTP rejects their tensor-parallel plan's expert styles)."""
    t, m = r.roles.trainer, r.model
    tp = t.tensor_parallel
    if tp == 1:
        return
    key = "roles.trainer.tensor_parallel"
    if tp < 1:
        yield key, f"must be at least 1 (1: off), got {tp}"
        return
    world = t.nodes * max(t.gpus_per_node, 1)  # one rank per GPU, one per node on CPUs
    if world % tp:
        yield (
            key,
            f"{tp} does not divide the trainer's {world} ranks (nodes × gpus_per_node, one per node on "
            f"CPUs); valid: {_divisors(world)}",
        )
    heads, kv = m.num_attention_heads, m.num_kv_heads
    if heads % tp or kv % tp:
        yield (
            key,
            f"{tp} does not split the model's {heads} attention heads and {kv} KV heads evenly (AutoTP "
            "gives each rank whole heads); valid: "
            + ", ".join(str(d) for d in range(1, kv + 1) if heads % d == 0 and kv % d == 0),
        )
    if t.sequence_parallel > 1:
        yield (
            key,
            f"{tp} with sequence_parallel={t.sequence_parallel}: DeepSpeed runs one model-parallel layout "
            "per engine (AutoTP's groups or Ulysses' mpu); use one of them: tensor_parallel to split the "
            "layers, sequence_parallel to split long rows",
        )
    if m.lora.rank > 0:
        yield (
            key,
            f"{tp} with model.lora.rank={m.lora.rank}: DeepSpeed's ZeRO optimizer does not find the "
            "adapters' parameters once AutoTP has replaced the layers they wrap; train LoRA with "
            "tensor_parallel=1 (its base weights shard with zero_stage=3)",
        )
    if is_moe(m):
        yield (
            key,
            f"{tp} with a mixture-of-experts model: DeepSpeed's AutoTP rejects the model's tensor-parallel "
            "plan (its expert and packed styles); shard it with zero_stage=3 and tensor_parallel=1",
        )


def _sequence_parallel(r: Recipe) -> Iterator[Problem]:
    """Ulysses splits each row over `sp` ranks and the attention heads over the same ranks: `sp` must
    divide the trainer's ranks (the rest is ZeRO's data parallelism) and the query heads, and the
    KV heads must divide over it or be repeated evenly (sp a multiple of them)."""
    t, m = r.roles.trainer, r.model
    sp = t.sequence_parallel
    if sp == 1:
        return
    if sp < 1:
        yield "roles.trainer.sequence_parallel", f"must be at least 1 (1: off), got {sp}"
        return
    world = t.nodes * max(t.gpus_per_node, 1)  # one rank per GPU, one per node on CPUs
    if world % sp:
        yield (
            "roles.trainer.sequence_parallel",
            f"{sp} does not divide the trainer's {world} ranks (nodes × gpus_per_node, one per node on "
            f"CPUs); valid: {_divisors(world)}",
        )
    heads, kv = m.num_attention_heads, m.num_kv_heads
    if heads % sp or (kv % sp and sp % kv):
        yield (
            "roles.trainer.sequence_parallel",
            f"{sp} does not split the model's {heads} attention heads and {kv} KV heads evenly (Ulysses "
            f"gives each rank heads / {sp}); valid: "
            + ", ".join(
                str(d) for d in range(1, heads + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0)
            ),
        )
    if t.attention == "eager":
        yield (
            "roles.trainer.sequence_parallel",
            "Ulysses needs sdpa or flash_attention_2 attention (eager needs the whole [tokens × tokens] "
            "mask on every rank); set roles.trainer.attention=sdpa",
        )


def _generator(r: Recipe) -> Iterator[Problem]:
    g = r.roles.generator
    if g.instances < 1:
        yield "roles.generator.instances", f"must be at least 1, got {g.instances}"
    yield from _instances(r, "generator", g)
    yield from _heads(r, "generator", g.tensor_parallel)
    yield from _elastic(r)


def teacher_placed(r: Recipe) -> TeacherConfig:
    """roles.teacher with its placement filled in: the generators' cluster (and partition) unless set."""
    return _beside_generators(r, r.roles.teacher)


def env_server_placed(r: Recipe) -> EnvServerConfig:
    """roles.env_server with its placement and workers filled in: the generators' cluster (and
    partition) unless set, agent.env_workers processes each unless set."""
    e = _beside_generators(r, r.roles.env_server)
    return dataclasses.replace(e, workers=r.agent.env_workers if e.workers is None else e.workers)


def _beside_generators(r: Recipe, job: _Pool) -> _Pool:
    g = r.roles.generator
    cluster = job.cluster or g.cluster
    partition = job.partition if job.partition is not None or cluster != g.cluster else g.partition
    return dataclasses.replace(job, cluster=cluster, partition=partition)


def _named_cluster(r: Recipe, role: str, cluster: str | None) -> Iterator[Problem]:
    """A pool's own cluster, where set, is one of the recipe's (even with no instance yet: the run's
    role specs and `streamrl scale` place it there)."""
    if cluster is not None and cluster not in r.clusters:
        close = difflib.get_close_matches(cluster, list(r.clusters), n=1, cutoff=0.4)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        yield f"roles.{role}.cluster", f"no cluster {cluster!r}{hint}; defined: {', '.join(r.clusters)}"


def _env_server(r: Recipe) -> Iterator[Problem]:
    """Environment servers: only for multi-turn rollouts, placed anywhere (no GPU asked)."""
    yield from _named_cluster(r, "env_server", r.roles.env_server.cluster)
    e = env_server_placed(r)
    if e.instances < 0:
        yield (
            "roles.env_server.instances",
            f"must be 0 (environments beside each generator) or more, got {e.instances}",
        )
        return
    if e.instances == 0:
        return
    if not r.agent.enabled:
        yield (
            "roles.env_server.instances",
            f"{e.instances} environment server(s) but no multi-turn task: set agent.env (or agent.tools), "
            "or instances=0",
        )
    if e.workers is not None and e.workers < 1:
        yield "roles.env_server.workers", f"environment processes per server: at least 1, got {e.workers}"
    placement: list[Problem] = []
    _placement(r, "env_server", e, placement)
    yield from placement
    yield from _common(e, "env_server")


def _teacher(r: Recipe) -> Iterator[Problem]:
    """On-policy distillation: a teacher pool exactly when the loss uses it, placed like generators."""
    t, a = teacher_placed(r), r.algorithm
    if a.distill_coef < 0:
        yield (
            "algorithm.distill_coef",
            f"the teacher term's weight: must be ≥ 0 (0: off), got {a.distill_coef}",
        )
    elif a.distill_coef == 0 and not a.distill_task_reward:
        yield "algorithm.distill_task_reward", "has no effect with distill_coef=0 (distillation is off)"
    if a.distill_coef > 0 and (a.temperature, a.top_p, a.top_k, a.min_p) != (1.0, 1.0, 0, 0.0):
        # The teacher's log-probs are of its untempered, untruncated distribution (vLLM's prompt
        # log-probs); the behaviour log-probs they are set against are of the sampling distribution.
        yield (
            "algorithm.distill_coef",
            "the teacher scores tokens at temperature 1 without truncation, so distillation needs the "
            f"policy to sample the same way: temperature=1, top_p=1, top_k=0, min_p=0 (got "
            f"temperature={a.temperature}, top_p={a.top_p}, top_k={a.top_k}, min_p={a.min_p})",
        )
    if t.instances < 0:
        yield "roles.teacher.instances", f"must be 0 (no teacher) or more, got {t.instances}"
        return
    if t.instances == 0:
        yield from _named_cluster(r, "teacher", r.roles.teacher.cluster)
    if a.distill_coef > 0 and t.instances == 0:
        yield (
            "roles.teacher.instances",
            f"algorithm.distill_coef={a.distill_coef} needs a teacher: set roles.teacher.instances ≥ 1 "
            "and roles.teacher.model.path",
        )
    if t.instances == 0:
        return
    if a.distill_coef == 0:
        yield (
            "roles.teacher.instances",
            f"{t.instances} teacher(s) but algorithm.distill_coef=0: their scores would change nothing; "
            "set distill_coef > 0 or instances=0",
        )
    if not t.model.path:
        yield (
            "roles.teacher.model.path",
            "required with roles.teacher.instances ≥ 1: the teacher's model directory",
        )
    if t.model.builder is not None and t.model.warmup_steps < 1:
        yield (
            "roles.teacher.model.warmup_steps",
            f"must be at least 1 with a builder, got {t.model.warmup_steps}",
        )
    yield from _instances(r, "teacher", t)


def _instances(r: Recipe, role: str, job: GeneratorConfig | TeacherConfig) -> Iterator[Problem]:
    """A pool of engine instances (generators, teachers): placement, GPUs, TP, batch and throttle."""
    placement: list[Problem] = []
    c, gpus_avail = _placement(r, role, job, placement)
    yield from placement
    yield from _common(job, role)
    yield from _gpus_fit(job, role, "gpus_per_instance", c, gpus_avail, "per instance (on one node)")
    if job.max_num_seqs < 1:
        yield (
            f"roles.{role}.max_num_seqs",
            f"an instance must run at least 1 sequence, got {job.max_num_seqs}",
        )
    tp, gpus = job.tensor_parallel, job.gpus_per_instance
    if tp < 1:
        yield f"roles.{role}.tensor_parallel", f"must be at least 1, got {tp}"
    elif gpus > 0 and gpus % tp:
        yield (
            f"roles.{role}.tensor_parallel",
            f"{tp} does not divide gpus_per_instance={gpus}; valid: {_divisors(gpus)}",
        )
    if job.max_running is not None and job.max_running < 1:
        yield f"roles.{role}.max_running", f"must be at least 1 (or null), got {job.max_running}"


def _elastic(r: Recipe) -> Iterator[Problem]:
    from streamrl_cli.elastic.policy import problems

    g = r.roles.generator
    e = g.elastic
    bad = problems(e)
    for key, msg in bad:
        yield f"roles.generator.elastic.{key}", msg
    if e.enabled and not bad and not e.min <= g.instances <= e.max:
        yield (
            "roles.generator.instances",
            f"{g.instances} is outside roles.generator.elastic min..max ({e.min}..{e.max}); "
            "the run starts with this many",
        )


def _gpus_fit(
    job: RoleJobConfig, role: str, key: str, c: ClusterConfig | None, avail: int | None, unit: str
) -> Iterator[Problem]:
    """The role's GPUs (``key``: per node, or per instance) are ≥ 0 and fit on one node of its placement."""
    want = getattr(job, key)
    if want < 0:
        yield f"roles.{role}.{key}", f"must be 0 (CPU) or more, got {want}"
    elif avail is not None and want > avail:
        where = (
            f"partition {job.partition!r}"
            if c and c.launcher == "slurm"
            else f"local cluster {job.cluster!r}"
        )
        yield f"roles.{role}.{key}", f"{want} GPUs {unit} but {where} has {avail} per node"


def _common(job: RoleJobConfig, role: str) -> Iterator[Problem]:
    if job.time_min < 1:
        yield f"roles.{role}.time_min", f"must be at least 1 minute, got {job.time_min}"
    if not 10 <= job.signal_lead_s < job.time_min * 60:
        yield (
            f"roles.{role}.signal_lead_s",
            f"must be at least 10 s and less than the time limit (time_min={job.time_min}: "
            f"{job.time_min * 60} s), got {job.signal_lead_s}",
        )
    if job.cpus_per_task < 1:
        yield f"roles.{role}.cpus_per_task", f"must be at least 1, got {job.cpus_per_task}"
    if ":" not in job.program:
        yield f"roles.{role}.program", f"expected `module:function`, got {job.program!r}"


def _heads(r: Recipe, role: str, tp: int) -> Iterator[Problem]:
    heads = r.model.num_attention_heads
    if tp >= 1 and heads % tp:
        yield (
            f"roles.{role}.tensor_parallel",
            (f"{tp} does not divide the model's {heads} attention heads; valid: {_divisors(heads)}"),
        )


def _run_roots(r: Recipe) -> Iterator[Problem]:
    """Only generators run off the run directory's filesystem: the trainer writes checkpoints and
    the rendezvous server the run's metrics and journal, which `status`, `plot` and `--resume` read."""
    z = r.roles.rendezvous
    homes = {"trainer": r.roles.trainer.cluster}
    if z.placement == "job" and z.cluster:
        homes["rendezvous"] = z.cluster
    for role, cluster in homes.items():
        c = r.clusters.get(cluster)
        if c is not None and c.run_root is not None:
            yield (
                f"clusters.{cluster}.run_root",
                f"the {role} runs on {cluster!r} and writes the run's own files (checkpoints, metrics): "
                "it needs the run directory itself; run_root is for clusters that host generators only",
            )


def _rendezvous(r: Recipe) -> Iterator[Problem]:
    z = r.roles.rendezvous
    if z.placement == "job":
        if z.cluster is None:
            yield "roles.rendezvous.cluster", "placement=job needs the cluster of the server's job"
        elif z.cluster not in r.clusters:
            yield "roles.rendezvous.cluster", f"no cluster {z.cluster!r}; defined: {', '.join(r.clusters)}"
        elif (
            r.clusters[z.cluster].launcher == "slurm" and z.partition not in r.clusters[z.cluster].partitions
        ):
            yield (
                "roles.rendezvous.partition",
                (
                    f"{z.partition!r} is not a partition of {z.cluster!r}: "
                    f"{', '.join(r.clusters[z.cluster].partitions)}"
                ),
            )
    if (z.tls_cert is None) != (z.tls_key is None):
        yield "roles.rendezvous.tls_key", "tls_cert and tls_key go together: set both or neither"
    for key in ("tls_cert", "tls_key", "tls_ca"):
        f = getattr(z, key)
        if f is not None and not Path(f).expanduser().is_file():
            yield f"roles.rendezvous.{key}", f"no such file: {f}"
    if z.lease_s <= 0:
        yield "roles.rendezvous.lease_s", f"must be positive, got {z.lease_s}"
    if not 0 <= z.port <= 65535:
        yield "roles.rendezvous.port", f"must be 0-65535, got {z.port}"


def _workload(r: Recipe) -> Iterator[Problem]:
    a, t, task = _algorithm_of(r), r.train, r.task
    if a.group_size < 1:
        yield "algorithm.group_size", f"must be at least 1, got {a.group_size}"
    elif a.advantage in GROUP_BASELINES and a.group_size < 2:
        yield (
            "algorithm.group_size",
            f"advantage={a.advantage} takes its baseline from the other samples of a prompt: "
            "needs group_size ≥ 2",
        )
    elif a.dynamic_sampling and a.group_size < 2:
        yield (
            "algorithm.dynamic_sampling",
            "drops groups whose rewards are all equal, which a group of one always is: needs group_size ≥ 2",
        )
    if a.max_staleness < 0:
        yield "algorithm.max_staleness", f"must be 0 or more, got {a.max_staleness}"
    elif a.mode == "async" and a.max_staleness < 1:
        yield "algorithm.max_staleness", "async mode overlaps one iteration: needs max_staleness ≥ 1"
    for key in ("global_batch", "micro_batch", "iterations"):
        if getattr(t, key) < 1:
            yield f"train.{key}", f"must be at least 1, got {getattr(t, key)}"
    if t.micro_batch_tokens < 0:
        yield "train.micro_batch_tokens", f"must be 0 (no token bound) or more, got {t.micro_batch_tokens}"
    if t.global_batch * max(a.group_size, 1) > SAMPLES_PER_ITERATION:
        yield (
            "train.global_batch",
            f"{t.global_batch} prompts × algorithm.group_size={a.group_size} is "
            f"{t.global_batch * a.group_size:,} samples an iteration, past the bound of "
            f"{SAMPLES_PER_ITERATION:,} (an iteration's samples are held together by the trainer)",
        )
    for key in ("max_prompt_len", "max_output_len"):
        if getattr(task, key) < 1:
            yield f"task.{key}", f"must be at least 1 token, got {getattr(task, key)}"
    yield from _training(r)


def _training(r: Recipe) -> Iterator[Problem]:
    a, t = _algorithm_of(r), r.train
    if a.lr < 0:
        yield "algorithm.lr", f"must be ≥ 0 (0 keeps the policy fixed), got {a.lr}"
    if a.critic_lr <= 0:
        yield "algorithm.critic_lr", f"must be positive, got {a.critic_lr}"
    for key in ("clip_ratio", "clip_ratio_high"):
        if getattr(a, key) <= 0:
            yield f"algorithm.{key}", f"a clip ratio: must be positive, got {getattr(a, key)}"
    if a.temperature <= 0:
        yield "algorithm.temperature", f"must be positive (logits are divided by it), got {a.temperature}"
    if not 0 < a.top_p <= 1:
        yield "algorithm.top_p", f"a probability mass: must be in (0, 1] (1: off), got {a.top_p}"
    if a.top_k < 0:
        yield "algorithm.top_k", f"must be 0 (off) or a number of tokens, got {a.top_k}"
    if not 0 <= a.min_p <= 1:
        yield "algorithm.min_p", f"a probability ratio: must be in [0, 1] (0: off), got {a.min_p}"
    if any(not isinstance(x, str) or not x for x in a.stop):
        yield "algorithm.stop", f"stop strings must be non-empty strings, got {a.stop!r}"
    if a.is_cap < 1:
        yield "algorithm.is_cap", f"importance weights are truncated at is_cap: must be ≥ 1, got {a.is_cap}"
    yield from _algorithm(r, a)
    for key in ("gamma", "lam"):
        if not 0 <= getattr(a, key) <= 1:
            yield f"algorithm.{key}", f"must be in [0, 1], got {getattr(a, key)}"
    unknown = [x for x in t.loggers if x not in LOGGERS]
    if unknown:
        names = ", ".join(map(repr, unknown))
        yield "train.loggers", f"unknown logger(s) {names}; valid: {', '.join(LOGGERS)}"
    k = r.skewness
    if k.ranker == "none" and (k.dispatch == "skewness-aware" or k.schedule == "lpt"):
        what = "skewness-aware dispatch" if k.dispatch == "skewness-aware" else "LPT scheduling"
        yield (
            "skewness.ranker",
            f"{what} orders prompts by predicted length: pick a ranker (learned, history, oracle)",
        )
    if not 0 <= k.long_tail <= 1:
        yield "skewness.long_tail", f"a share of the prompts: must be in [0, 1], got {k.long_tail}"
    o = r.rollout.oversample
    if not 0 <= o <= 1:
        yield "rollout.oversample", f"a fraction of train.global_batch: must be in [0, 1] (0: off), got {o}"
    elif o > 0 and t.reproducible_sampling:
        yield (
            "rollout.oversample",
            "trains the first groups to finish, which vary run to run: set train.reproducible_sampling=false "
            "with it (or rollout.oversample=0)",
        )
    if r.rollout.partial and not o > 0:
        yield (
            "rollout.partial",
            "resumes the over-sampled groups still running when an iteration closes: set rollout.oversample "
            "above 0 with it (e.g. 0.25), or rollout.partial=false",
        )
    elif r.rollout.partial and a.max_staleness < 1:
        yield (
            "algorithm.max_staleness",
            "partial rollout trains samples begun under the previous weights: needs max_staleness ≥ 1",
        )
    if not t.stall_after_s > 0 or t.stall_after_s == float("inf"):
        yield "train.stall_after_s", f"must be a positive number of seconds, got {t.stall_after_s}"
    if t.checkpoint_every < 0:
        yield "train.checkpoint_every", f"must be 0 (only the last) or more, got {t.checkpoint_every}"
    if t.keep_checkpoints < 1:
        yield "train.keep_checkpoints", f"must be at least 1, got {t.keep_checkpoints}"
    for key in ("num_attention_heads", "num_kv_heads"):
        if getattr(r.model, key) < 1:
            yield f"model.{key}", f"must be at least 1, got {getattr(r.model, key)}"
    if min(r.model.num_attention_heads, r.model.num_kv_heads) >= 1 and (
        r.model.num_attention_heads % r.model.num_kv_heads
    ):
        yield (
            "model.num_kv_heads",
            (f"{r.model.num_kv_heads} KV heads do not divide {r.model.num_attention_heads} attention heads"),
        )


# Advantage estimators whose baseline is the other samples of the same prompt.
GROUP_BASELINES = ("grpo", "rloo", "reinforce++-baseline")


def _algorithm(r: Recipe, a: AlgorithmConfig) -> Iterator[Problem]:
    """The algorithm's keys go together (`a` is filled with its preset's defaults)."""
    defaults = AlgorithmConfig()
    if a.routing_replay and r.roles.trainer.sequence_parallel > 1:
        yield (
            "algorithm.routing_replay",
            "replays each token's experts in the trainer's packed rows, which sequence parallelism splits "
            "over ranks (roles.trainer.sequence_parallel > 1): use one or the other",
        )
    if a.routing_replay and (r.agent.env or r.agent.tools):
        yield (
            "algorithm.routing_replay",
            "multi-turn trajectories (agent.env, agent.tools) are generated turn by turn, and their "
            "experts are not captured across turns yet: set it to false for agents",
        )
    if not 0 <= a.router_aux_loss_coef <= 1:
        yield (
            "algorithm.router_aux_loss_coef",
            f"must be from 0 (off) to 1, got {a.router_aux_loss_coef} (MoE models train with 0.001-0.01)",
        )
    if a.advantage == "gae" and a.kl_mode == "loss":
        yield (
            "algorithm.kl_mode",
            "advantage=gae (PPO) puts the KL into the per-token reward: use penalty (or none); "
            "loss is for the other estimators",
        )
    if a.advantage != "gae" and a.kl_mode == "penalty":
        yield (
            "algorithm.kl_mode",
            f"penalty puts the KL into the per-token reward, which only advantage=gae reads; with "
            f"advantage={a.advantage} use loss (or none)",
        )
    if a.policy_loss == "gspo" and a.advantage == "gae":
        yield (
            "algorithm.policy_loss",
            "gspo weighs whole sequences and needs one advantage per sequence; advantage=gae gives one "
            "per token: use grpo, rloo, reinforce++ or reinforce++-baseline",
        )
    if a.old_policy == "behaviour" and a.is_correction == "on":
        yield (
            "algorithm.is_correction",
            "with old_policy=behaviour the loss's ratio is already against the generators' policy: the "
            "importance weights would correct it twice; set is_correction=off or auto "
            "(is_mask still applies)",
        )
    if not 0 <= a.is_mask_low <= 1 <= a.is_mask_high:
        yield (
            "algorithm.is_mask_low",
            f"the kept ratios [is_mask_low, is_mask_high] must contain 1 (an on-policy token's ratio), "
            f"got [{a.is_mask_low}, {a.is_mask_high}]",
        )
    bounds = (a.is_mask_low, a.is_mask_high)
    if a.is_mask == "off" and bounds != (defaults.is_mask_low, defaults.is_mask_high):
        yield "algorithm.is_mask_low", "has no effect with is_mask=off; pick token, sequence or geometric"
    max_len = r.task.max_output_len
    if not 0 <= a.overlong_buffer <= max_len:
        yield (
            "algorithm.overlong_buffer",
            f"tokens before task.max_output_len={max_len}: must be in [0, {max_len}] (0: off), "
            f"got {a.overlong_buffer}",
        )
    if a.overlong_penalty < 0:
        yield "algorithm.overlong_penalty", f"a penalty's size: must be ≥ 0, got {a.overlong_penalty}"
    elif a.overlong_buffer == 0 and a.overlong_penalty != defaults.overlong_penalty:
        yield "algorithm.overlong_penalty", "has no effect with overlong_buffer=0 (the shaping is off)"
    if a.max_refill < 0:
        yield "algorithm.max_refill", f"a fraction of train.global_batch: must be ≥ 0, got {a.max_refill}"
    elif not a.dynamic_sampling and a.max_refill != defaults.max_refill:
        yield "algorithm.max_refill", "has no effect without dynamic_sampling=true"


FILLER_INSTRUCTION_TOKENS = 16  # the repeat task's instruction after its filler words, with room


def _task(r: Recipe) -> Iterator[Problem]:
    """The task's files exist (found here rather than by a trainer that waited in the queue)."""
    t = r.task
    if t.dataset is not None:
        p = Path(t.dataset).expanduser()
        if not p.exists():
            yield (
                "task.dataset",
                f"no such file or directory: {t.dataset} (JSONL, Parquet or a save_to_disk directory)",
            )
        if not t.reward:
            yield (
                "task.reward",
                "a dataset needs a reward function: `module:function` or `path/to/file.py:function` "
                "(shipped: streamrl_cli.tasks.rewards:exact_match, streamrl_cli.tasks.rewards:math_answer)",
            )
    if not t.prompt_key:
        yield "task.prompt_key", "must name the dataset field holding the prompt"
    if t.reward:
        target, sep, attr = t.reward.rpartition(":")
        if not sep or not target or not attr:
            yield (
                "task.reward",
                f"{t.reward!r} is not `module:function` or `path/to/file.py:function`",
            )
        elif is_reward_file(target) and not Path(target).expanduser().is_file():
            yield "task.reward", f"no such file: {target}"
    if t.chat_template is not None:
        if not t.chat_template.strip():
            yield "task.chat_template", "empty; use null (no template), tokenizer, or a Jinja template"
        elif t.chat_template.endswith(".jinja") and not Path(t.chat_template).expanduser().is_file():
            yield "task.chat_template", f"no such file: {t.chat_template}"
    if t.eval_dataset is not None:
        if not Path(t.eval_dataset).expanduser().exists():
            yield "task.eval_dataset", f"no such file or directory: {t.eval_dataset}"
        if not t.reward:
            yield "task.reward", "evaluation scores with the task's reward function: set task.reward"
    else:
        for key, off in (("eval_every", 0), ("eval_samples", None), ("eval_temperature", 0.0)):
            if getattr(t, key) != off:
                yield f"task.{key}", "has no effect without task.eval_dataset (the held-out prompts)"
    if t.eval_every < 0:
        yield "task.eval_every", f"must be 0 (only a final evaluation) or more, got {t.eval_every}"
    if t.eval_samples is not None and t.eval_samples < 1:
        yield "task.eval_samples", f"must be at least 1 (or null: every eval prompt), got {t.eval_samples}"
    if t.eval_temperature < 0:
        yield "task.eval_temperature", f"must be 0 (greedy) or positive, got {t.eval_temperature}"
    if t.system_prompt is not None and t.dataset is None:
        yield "task.system_prompt", "the built-in task has no chat prompts; set task.dataset to use one"
    if t.filler_words:
        if t.dataset is not None or t.name == "calc":
            yield (
                "task.filler_words",
                "only the built-in repeat task (task.dataset null, not calc) takes filler words; a dataset's "
                "prompts are as long as its rows",
            )
        elif t.filler_words + FILLER_INSTRUCTION_TOKENS > t.max_prompt_len:
            yield (
                "task.filler_words",
                f"{t.filler_words} words (one token each) and the instruction do not fit in "
                f"task.max_prompt_len={t.max_prompt_len}; raise task.max_prompt_len to at least "
                f"{t.filler_words + FILLER_INSTRUCTION_TOKENS} or lower task.filler_words",
            )
    if r.model.builder_positions is not None and r.model.builder is None:
        yield (
            "model.builder_positions",
            "only a model a builder makes takes it (model.builder tiny, tiny-warm, tiny-moe or "
            "tiny-moe-warm); a model's own positions are its config.json's max_position_embeddings",
        )


def _lora(r: Recipe) -> Iterator[Problem]:
    """model.lora: its numbers, and targets that exist in the model (recipe.lora reads its names).
    PPO's critic is not adapted: it trains in full beside the actor's adapters (docs/lora.md); it
    never goes to the generators, so model.lora.sync does not concern it."""
    from streamrl_cli.recipe.lora import matches, target_names

    c = r.model.lora
    if c.rank < 0:
        yield (
            "model.lora.rank",
            f"must be 0 (LoRA off) or a positive adapter rank such as 8 or 16, got {c.rank}",
        )
    if c.sync == "adapter" and c.rank == 0:
        yield (
            "model.lora.sync",
            "adapter sends the LoRA adapters, but model.lora.rank is 0 (LoRA off): set a rank, or "
            "sync: merged (valid: merged, adapter)",
        )
    if c.rank <= 0:
        return
    yield from _lora_sync(r)
    if not c.alpha > 0:
        yield "model.lora.alpha", f"the adapters' scale is alpha / rank: must be positive, got {c.alpha}"
    if not 0 <= c.dropout < 1:
        yield "model.lora.dropout", f"a probability: must be in [0, 1), got {c.dropout}"
    if not c.target_modules:
        yield (
            "model.lora.target_modules",
            "names no module: list the linear layers to adapt (e.g. q_proj, v_proj)",
        )
        return
    modules = target_names(r.model)
    if modules is None:  # a hub id or an unknown architecture: PEFT checks them when the trainer starts
        return
    missing = [t for t in c.target_modules if not matches(t, modules)]
    if missing:
        valid = sorted({m.rsplit(".", 1)[-1] for m in modules})
        yield (
            "model.lora.target_modules",
            f"{', '.join(map(repr, missing))} match(es) no linear layer of {r.model.path}; valid: "
            f"{', '.join(valid)}",
        )


def _lora_sync(r: Recipe) -> Iterator[Problem]:
    """model.lora.sync adapter: what vLLM's LoRA support serves (on every path: the broadcast inside a
    site and the cross-site relay carry adapter versions alike)."""
    from streamrl_cli.recipe.lora import VLLM_MAX_LORA_RANKS, vllm_max_lora_rank

    c = r.model.lora
    if c.sync != "adapter":
        return
    if vllm_max_lora_rank(c.rank) is None:
        yield (
            "model.lora.rank",
            f"{c.rank} is above the largest adapter rank vLLM serves ({VLLM_MAX_LORA_RANKS[-1]}) with "
            "model.lora.sync adapter: use a rank of at most that, or sync: merged",
        )


def _agent(r: Recipe) -> Iterator[Problem]:
    """agent.*: budgets that can hold a turn, a reward that exists, names of the right shape."""
    a = r.agent
    if a.env_args and not a.env:
        yield "agent.env_args", "arguments for an environment, but agent.env names none"
    if a.tool_format is not None and not a.tools:
        yield "agent.tool_format", f"{a.tool_format!r}: a tool-call syntax, but agent.tools names no tool"
    for key, spec in [("agent.env", a.env), *(("agent.tools", t) for t in a.tools)]:
        if spec is not None and not _object_spec(spec):
            yield key, f"{spec!r} is not `module:Name` or `path/to/file.py:Name` (e.g. my_env.py:GuessNumber)"
    if not a.enabled:
        return
    if a.max_turns < 1:
        yield "agent.max_turns", f"model turns per trajectory: must be at least 1, got {a.max_turns}"
    out = r.task.max_output_len
    if a.max_turn_tokens is not None and not 1 <= a.max_turn_tokens <= out:
        yield (
            "agent.max_turn_tokens",
            f"must be in [1, task.max_output_len={out}] or null, got {a.max_turn_tokens}",
        )
    if not a.step_timeout_s > 0:
        yield (
            "agent.step_timeout_s",
            f"seconds for one environment call: must be positive, got {a.step_timeout_s}",
        )
    if a.env_workers < 1:
        yield "agent.env_workers", f"environment processes per generator: at least 1, got {a.env_workers}"
    if a.reward == "env" and not a.env:
        yield (
            "agent.reward",
            "is env, but only tools are set and tools give no reward: use task (the task's reward on the "
            "conversation) or sum, or name an environment (agent.env)",
        )


def _object_spec(spec: str) -> bool:
    target, sep, attr = spec.rpartition(":")
    return bool(sep and target and attr and attr.replace(".", "").replace("_", "").isalnum())


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
