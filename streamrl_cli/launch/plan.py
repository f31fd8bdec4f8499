"""From a typed recipe to what gets launched: one job per (cluster, role), and each role's slice.

Shared knobs (rendezvous file, token path, weight transport between sites) are resolved here,
once, and written as `run_dir/roles/<role>.yaml`; a role process reads only its own file.
Pure functions: no files written, no clusters asked.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from streamrl_cli.recipe.schema import ClusterConfig, Recipe

ROLES = ("rendezvous", "trainer", "generator")


@dataclass(kw_only=True)
class RoleSpec:
    """Everything one role's processes need; written to run_dir/roles/<role>.yaml."""

    run_name: str  # the run's name
    run_dir: str  # absolute path of the run directory (shared filesystem on clusters)
    role: str  # trainer | generator | rendezvous
    cluster: str  # recipe key of the cluster it runs on
    site: str  # the cluster's site
    world: int  # processes of this role (trainer ranks, generator instances)
    expected: dict[str, int]  # members per role the run expects (for waiting on peers)
    program: str  # `module:function` each process runs
    weight_transport: str  # how weights reach this role: broadcast (trainer's site) or relay (TCP)
    rendezvous_file: str  # JSON file where the rendezvous server publishes its URL
    secret_file: str  # the run's token (mode 0600)
    rendezvous_ca: str | None = None  # CA file to verify the server's TLS certificate (null: plain HTTP)
    settings: dict = field(default_factory=dict)  # the role's own recipe section
    model: dict = field(default_factory=dict)
    algorithm: dict = field(default_factory=dict)
    task: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)
    skewness: dict = field(default_factory=dict)
    generator_max_seqs: int = 64  # roles.generator.max_num_seqs: the trainer bounds its dispatch by it


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

    @property
    def processes(self) -> int:
        return (self.array or 1) * self.nodes * self.tasks_per_node

    @property
    def key(self) -> str:
        return f"{self.cluster}-{self.role}"


def role_specs(recipe: Recipe, run_dir: Path) -> dict[str, RoleSpec]:
    r = recipe
    t, g, z = r.roles.trainer, r.roles.generator, r.roles.rendezvous
    trainer_site = r.clusters[t.cluster].site
    expected = {"trainer": trainer_world(recipe), "generator": g.instances}
    common = dict(
        run_name=r.run.name,
        run_dir=str(run_dir),
        expected=expected,
        rendezvous_file=str(run_dir / "rendezvous.json"),
        secret_file=str(run_dir / "secret"),
        rendezvous_ca=z.tls_ca,
        model=dataclasses.asdict(r.model),
        algorithm=dataclasses.asdict(r.algorithm),
        task=dataclasses.asdict(r.task),
        train=dataclasses.asdict(r.train),
        skewness=dataclasses.asdict(r.skewness),
        generator_max_seqs=g.max_num_seqs,
    )
    specs = {
        "trainer": RoleSpec(
            role="trainer",
            cluster=t.cluster,
            site=trainer_site,
            world=expected["trainer"],
            program=t.program,
            weight_transport="source",
            settings=dataclasses.asdict(t),
            **common,
        ),
        "generator": RoleSpec(
            role="generator",
            cluster=g.cluster,
            site=r.clusters[g.cluster].site,
            world=g.instances,
            program=g.program,
            weight_transport="broadcast" if r.clusters[g.cluster].site == trainer_site else "relay",
            settings=dataclasses.asdict(g),
            **common,
        ),
    }
    z_cluster = z.cluster if z.placement == "job" and z.cluster else t.cluster
    specs["rendezvous"] = RoleSpec(
        role="rendezvous",
        cluster=z_cluster,
        site=r.clusters[z_cluster].site,
        world=1,
        program="streamrl_cli.roles.rendezvous:main",
        weight_transport="none",
        settings=dataclasses.asdict(z),
        **common,
    )
    return specs


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
        )
    )
    out.append(
        job_spec(
            r,
            "generator",
            g.cluster,
            g.partition,
            nodes=1,
            tasks=1,
            gpus=g.gpus_per_instance,
            cpus=g.cpus_per_task,
            mem=g.mem_gb,
            time_min=g.time_min,
            array=g.instances,
            max_running=g.max_running,
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
