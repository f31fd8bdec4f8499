"""The typed contract between `streamrl run` and the role processes: one spec per role.

A spec is built once from the typed recipe when a run is prepared (``launch.plan.role_specs``),
written to ``run_dir/roles/<role>.yaml`` as :func:`spec_yaml` renders it, read back by :func:`load_spec`
through ``OmegaConf.structured`` + ``to_object``: a role gets the schema's own section dataclasses
(``ModelConfig``, ``AlgorithmConfig``, ...), never a dict of recipe keys, so a key added to the
schema reaches the roles with no code here, and its default lives in the schema only.

Whatever a role must know about another role is in its own spec (the trainer's ``generator``), so
no role reads another's file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from streamrl_cli.errors import StreamRLError
from streamrl_cli.recipe.schema import (
    AgentConfig,
    AlgorithmConfig,
    EnvServerConfig,
    GeneratorConfig,
    ModelConfig,
    PlannerConfig,
    RendezvousConfig,
    RolloutConfig,
    SkewnessConfig,
    TaskConfig,
    TeacherConfig,
    TrainConfig,
    TrainerConfig,
)


@dataclass(kw_only=True)
class RoleSpec:
    """What every role's processes need: where the run is, who they are, how to reach the server."""

    run_name: str  # the run's name
    run_dir: str  # absolute path of the run directory (shared filesystem on clusters)
    role: str  # trainer | generator | teacher | env_server | rendezvous
    cluster: str  # recipe key of the cluster it runs on
    site: str  # the cluster's site
    world: int  # processes of this role (trainer ranks, generator instances)
    expected: dict[str, int]  # members per role the run expects (for waiting on peers)
    program: str  # `module:function` each process runs
    weight_transport: str  # how weights reach this role: source (the trainer), broadcast, relay, none
    rendezvous_file: str  # JSON file where the rendezvous server publishes its URL
    secret_file: str  # the run's token (mode 0600)
    rendezvous_ca: str | None = None  # CA file to verify the server's TLS certificate (null: plain HTTP)


@dataclass(kw_only=True)
class TrainerSpec(RoleSpec):
    """The trainer: its job's settings, the recipe sections it trains by, and the generators it feeds."""

    settings: TrainerConfig = field(default_factory=TrainerConfig)  # roles.trainer
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    skewness: SkewnessConfig = field(default_factory=SkewnessConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)  # profile_file: Algorithm 2's PTL curve
    agent: AgentConfig = field(default_factory=AgentConfig)  # multi-turn: the reward it trains on
    # The generators it dispatches to and sends weights to: instances, TP (weight group size),
    # max_num_seqs (the bound of Algorithm 2's batch sizes), and how weights reach them.
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    generator_transport: str = "broadcast"  # the generators' weight_transport: broadcast or relay
    teacher: TeacherConfig = field(
        default_factory=TeacherConfig
    )  # distillation's teachers (instances 0: none)


@dataclass(kw_only=True)
class GeneratorSpec(RoleSpec):
    """One generator instance: its engine settings, the model, prompt/output bounds, the seed."""

    settings: GeneratorConfig = field(default_factory=GeneratorConfig)  # roles.generator
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)  # multi-turn: environment, tools, budgets
    # Environment servers the trainer's run has (instances 0: the generator hosts its environments).
    env_servers: int = 0
    # algorithm.max_staleness: how many versions requests in flight may lag the newest one (with
    # model.lora.sync adapter, the engine serves that many adapters at once, plus the newest).
    max_staleness: int = 1
    # algorithm.routing_replay: capture each sample's routed experts (a MoE model) and send them with it.
    routing_replay: bool = False


@dataclass(kw_only=True)
class TeacherSpec(RoleSpec):
    """One distillation teacher instance: its engine settings and model, and the policy's model (whose
    tokenizer it must share), prompt/output bounds and seed."""

    settings: TeacherConfig = field(default_factory=TeacherConfig)  # roles.teacher (its model inside)
    model: ModelConfig = field(default_factory=ModelConfig)  # the policy's
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


@dataclass(kw_only=True)
class EnvServerSpec(RoleSpec):
    """One environment server: how many environment processes it hosts, and the environment they make."""

    settings: EnvServerConfig = field(default_factory=EnvServerConfig)  # roles.env_server (workers filled)
    agent: AgentConfig = field(default_factory=AgentConfig)  # the environment, its tools, step timeout
    train: TrainConfig = field(default_factory=TrainConfig)  # stall_after_s: the wait for a lost trainer


@dataclass(kw_only=True)
class RendezvousSpec(RoleSpec):
    """The control-plane server."""

    settings: RendezvousConfig = field(default_factory=RendezvousConfig)  # roles.rendezvous


SPECS: dict[str, type[RoleSpec]] = {
    "trainer": TrainerSpec,
    "generator": GeneratorSpec,
    "teacher": TeacherSpec,
    "env_server": EnvServerSpec,
    "rendezvous": RendezvousSpec,
}


def spec_yaml(spec: RoleSpec) -> str:
    """The text of ``roles/<role>.yaml`` (field order as declared, so goldens read top-down)."""
    return yaml.safe_dump(dataclasses.asdict(spec), sort_keys=False)


def load_spec(path: str | Path) -> RoleSpec:
    """A role's spec from its file, typed and checked against the dataclasses above."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise StreamRLError(f"cannot read role spec {path}: {e}") from None
    role = raw.get("role") if isinstance(raw, dict) else None
    cls = SPECS.get(str(role))
    if cls is None:
        raise StreamRLError(f"role spec {path}: unknown role {role!r} (valid: {', '.join(SPECS)})")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), raw))  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        where = f"{e.full_key}: " if getattr(e, "full_key", None) else ""
        raise StreamRLError(
            f"role spec {path} does not match this version of streamrl: {where}{getattr(e, 'msg', e)}"
        ) from None
