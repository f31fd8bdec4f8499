"""From a typed recipe to what gets launched: one job per (cluster, role), and each role's slice.

Shared knobs (rendezvous file, token path, weight transport between sites) are resolved here,
once, and written as `run_dir/roles/<role>.yaml`; a role process reads only its own file.
Pure functions: no files written, no clusters asked.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from streamrl_cli.recipe.schema import ClusterConfig, PlannerConfig, Recipe
from streamrl_cli.roles.spec import (
    EnvServerSpec,
    GeneratorSpec,
    RendezvousSpec,
    RoleSpec,
    TeacherSpec,
    TrainerSpec,
)
from streamrl_cli.rundir import RunDir

ROLES = ("rendezvous", "trainer", "generator", "teacher", "env_server")


@dataclass(kw_only=True)
class JobSpec:
    """One job (or job array, or set of local processes) for one role on one cluster."""

    role: str
    cluster: str  # recipe key
    launcher: str  # slurm | local
    slurm_cluster: str | None  # -M value (null: the submitting host's cluster)
    partition: str | None
    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    cpus_per_task: int
    mem_gb: int | None
    time_min: int
    array: int | None  # array tasks (generator instances); None for a plain job
    max_running: int | None
    account: str | None = None
    qos: str | None = None
    setup_template: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    site: str = "default"
    sbatch: dict[str, object] = field(default_factory=dict)  # the cluster's extra #SBATCH options
    srun_args: list[str] = field(default_factory=list)  # the cluster's extra srun arguments
    python: str | None = None  # interpreter on the cluster's nodes (null: this host's)
    exclusive: bool = False  # whole nodes: --exclusive
    signal_lead_s: int = 30  # USR2 this long before the time limit (--signal=USR2@N)
    run_root: str | None = None  # the cluster's own directory for runs (no shared filesystem)

    @property
    def processes(self) -> int:
        return (self.array or 1) * self.nodes * self.tasks_per_node

    @property
    def key(self) -> str:
        return f"{self.cluster}-{self.role}"


def role_specs(recipe: Recipe, run_dir: Path) -> dict[str, RoleSpec]:
    """Each role's typed slice of the recipe (see roles.spec)."""
    r = recipe
    t, g, z = r.roles.trainer, r.roles.generator, r.roles.rendezvous
    trainer_site = r.clusters[t.cluster].site
    gen_site = r.clusters[g.cluster].site
    gen_transport = "broadcast" if gen_site == trainer_site else "relay"
    teacher = r.roles.teacher
    expected = {"trainer": trainer_world(recipe), "generator": g.instances}
    if teacher.instances > 0:
        expected["teacher"] = teacher.instances
    envs = r.roles.env_server
    if envs.instances > 0:
        expected["env_server"] = envs.instances
    common = dict(
        run_name=r.run.name,
        run_dir=str(run_dir),
        expected=expected,
        rendezvous_file=str(RunDir(run_dir).endpoint),
        secret_file=str(RunDir(run_dir).secret),
        rendezvous_ca=z.tls_ca,
    )
    z_cluster = z.cluster if z.placement == "job" and z.cluster else t.cluster
    specs: dict[str, RoleSpec] = {
        "trainer": TrainerSpec(
            role="trainer",
            cluster=t.cluster,
            site=trainer_site,
            world=expected["trainer"],
            program=t.program,
            weight_transport="source",
            settings=copy.deepcopy(t),
            model=copy.deepcopy(r.model),
            algorithm=copy.deepcopy(r.algorithm),
            task=copy.deepcopy(r.task),
            train=copy.deepcopy(r.train),
            skewness=copy.deepcopy(r.skewness),
            rollout=copy.deepcopy(r.rollout),
            planner=_absolute(r.planner),
            agent=copy.deepcopy(r.agent),
            generator=copy.deepcopy(g),
            generator_transport=gen_transport,
            teacher=copy.deepcopy(teacher),
            **common,
        ),
        "generator": GeneratorSpec(
            role="generator",
            cluster=g.cluster,
            site=gen_site,
            world=g.instances,
            program=g.program,
            weight_transport=gen_transport,
            settings=copy.deepcopy(g),
            model=copy.deepcopy(r.model),
            task=copy.deepcopy(r.task),
            train=copy.deepcopy(r.train),
            agent=copy.deepcopy(r.agent),
            env_servers=envs.instances,
            max_staleness=r.algorithm.max_staleness,
            routing_replay=r.algorithm.routing_replay,
            **common,
        ),
        "teacher": TeacherSpec(
            role="teacher",
            cluster=teacher.cluster or g.cluster,
            site=r.clusters[teacher.cluster or g.cluster].site,
            world=teacher.instances,
            program=teacher.program,
            weight_transport="none",  # its model is fixed
            settings=copy.deepcopy(teacher),
            model=copy.deepcopy(r.model),
            task=copy.deepcopy(r.task),
            train=copy.deepcopy(r.train),
            **common,
        ),
        "env_server": EnvServerSpec(
            role="env_server",
            cluster=envs.cluster or g.cluster,
            site=r.clusters[envs.cluster or g.cluster].site,
            world=envs.instances,
            program=envs.program,
            weight_transport="none",  # it runs environments, not the model
            settings=copy.deepcopy(envs),
            agent=copy.deepcopy(r.agent),
            train=copy.deepcopy(r.train),
            **common,
        ),
        "rendezvous": RendezvousSpec(
            role="rendezvous",
            cluster=z_cluster,
            site=r.clusters[z_cluster].site,
            world=1,
            program="streamrl_cli.launch.server_role:main",
            weight_transport="none",
            settings=copy.deepcopy(z),
            **common,
        ),
    }
    return {role: spec for role, spec in specs.items() if role in roles_of(recipe)}


def roles_of(recipe: Recipe) -> tuple[str, ...]:
    """The roles this recipe runs: the teacher only for on-policy distillation, environment servers
    only when the recipe asks for them."""
    pools = {"teacher": recipe.roles.teacher.instances, "env_server": recipe.roles.env_server.instances}
    return tuple(r for r in ROLES if pools.get(r, 1) > 0)


def _absolute(p: PlannerConfig) -> PlannerConfig:
    """Role processes run in the run directory: files the recipe names relative to where
    `streamrl run` ran are made absolute here."""

    def absolute(f: str | None) -> str | None:
        return str(Path(f).expanduser().resolve()) if f else None

    return dataclasses.replace(
        p, hardware_file=absolute(p.hardware_file), profile_file=absolute(p.profile_file)
    )


def trainer_world(recipe: Recipe) -> int:
    t = recipe.roles.trainer
    return t.nodes * max(t.gpus_per_node, 1)


def jobs(recipe: Recipe) -> list[JobSpec]:
    """The jobs to launch, rendezvous first (others need its address)."""
    r = recipe
    t, g, z = r.roles.trainer, r.roles.generator, r.roles.rendezvous
    out = []
    if z.placement == "job" and z.cluster:
        out.append(
            job_spec(
                r,
                "rendezvous",
                z.cluster,
                z.partition,
                nodes=1,
                tasks=1,
                gpus=0,
                cpus=1,
                mem=None,
                time_min=z.time_min,
                array=None,
                max_running=None,
            )
        )
    out.append(
        job_spec(
            r,
            "trainer",
            t.cluster,
            t.partition,
            nodes=t.nodes,
            tasks=max(t.gpus_per_node, 1),
            gpus=t.gpus_per_node,
            cpus=t.cpus_per_task,
            mem=t.mem_gb,
            time_min=t.time_min,
            array=None,
            max_running=None,
            signal_lead_s=t.signal_lead_s,
        )
    )
    # The pools: an array of one-node instances each (teachers and environment servers placed like
    # the generators unless their section says where).
    te, es = r.roles.teacher, r.roles.env_server
    for role, section, cluster, gpus, max_running in (
        ("generator", g, g.cluster, g.gpus_per_instance, g.max_running),
        ("teacher", te, te.cluster or g.cluster, te.gpus_per_instance, te.max_running),
        ("env_server", es, es.cluster or g.cluster, 0, None),
    ):
        if section.instances > 0 or role == "generator":
            out.append(
                job_spec(
                    r,
                    role,
                    cluster,
                    section.partition,
                    nodes=1,
                    tasks=1,
                    gpus=gpus,
                    cpus=section.cpus_per_task,
                    mem=section.mem_gb,
                    time_min=section.time_min,
                    array=section.instances,
                    max_running=max_running,
                    signal_lead_s=section.signal_lead_s,
                )
            )
    return out


def job_spec(
    r: Recipe,
    role: str,
    cluster: str,
    partition: str | None,
    *,
    nodes: int,
    tasks: int,
    gpus: int,
    cpus: int,
    mem: int | None,
    time_min: int,
    array: int | None,
    max_running: int | None,
    signal_lead_s: int = 30,
) -> JobSpec:
    """A job of ``role`` on ``cluster`` with that cluster's launcher, account, setup and env."""
    c = r.clusters[cluster]
    mem, exclusive = memory(c, partition, nodes_gpus=gpus, mem_gb=mem)
    return JobSpec(
        role=role,
        cluster=cluster,
        launcher=c.launcher,
        slurm_cluster=c.slurm_cluster,
        partition=partition if c.launcher == "slurm" else None,
        nodes=nodes,
        tasks_per_node=tasks,
        gpus_per_node=gpus,
        cpus_per_task=cpus,
        mem_gb=mem,
        time_min=time_min,
        array=array,
        max_running=max_running,
        account=c.account,
        qos=c.qos,
        setup_template=c.setup_template,
        env=dict(c.env),
        site=c.site,
        sbatch=dict(c.sbatch),
        srun_args=list(c.srun_args),
        python=c.python,
        exclusive=exclusive,
        signal_lead_s=signal_lead_s,
        run_root=c.run_root,
    )


def memory(
    c: ClusterConfig, partition: str | None, *, nodes_gpus: int, mem_gb: int | None
) -> tuple[int | None, bool]:
    """The job's memory per node (GiB) and whether it takes its nodes exclusively.

    A recipe's own ``mem_gb`` wins. Otherwise a GPU job gets its GPUs' share of the node's memory
    (SLURM's fallback, DefMemPerCPU × CPUs, is sized for CPU jobs: a few GiB, too little to load a
    7B model); a job that takes every GPU of its nodes on a cluster with ``exclusive`` gets the node.
    CPU-only jobs (a rendezvous server) keep the site's default.
    """
    p = c.partitions.get(partition) if partition else None
    if c.launcher != "slurm" or p is None or nodes_gpus <= 0 or p.gpus_per_node <= 0:
        return mem_gb, False
    whole = nodes_gpus >= p.gpus_per_node
    exclusive = c.exclusive and whole
    if mem_gb is not None:
        return mem_gb, exclusive
    if exclusive:
        return 0, True  # --mem=0: all of each node's memory, whatever the node really has
    return max(1, p.mem_gb_per_node * min(nodes_gpus, p.gpus_per_node) // p.gpus_per_node), exclusive
