"""The typed recipe: one dataclass tree, converted from OmegaConf once (in ``recipe.load``).

Every field says in a comment what it means. Fields with a fixed set of values carry it in
``metadata["choices"]``; the validator reports anything else with the valid choices. Cross-field
rules (GPUs per node vs. the partition, tensor-parallel sizes, ...) live in ``recipe.checks`` so
that every problem of a recipe is reported at once rather than the first ``__post_init__`` to fail.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

LAUNCHERS = ("slurm", "local")
RENDEZVOUS_PLACEMENTS = ("submit-host", "job")
# Algorithm presets (recipe.presets): each sets the defaults of the keys below marked "null: the
# algorithm's"; the trainer's registries (trainer.algo) hold the estimators and losses by name.
ALGORITHMS = (
    "ppo", "grpo", "dr-grpo", "dapo", "gspo", "cispo", "rloo", "reinforce++", "reinforce++-baseline",
)  # fmt: skip
ADVANTAGES = ("gae", "grpo", "rloo", "reinforce++", "reinforce++-baseline")
POLICY_LOSSES = ("clip", "gspo", "cispo")
OLD_POLICIES = ("trainer", "behaviour")
IS_LEVELS = ("token", "sequence", "geometric")
IS_MASKS = ("off", "token", "sequence", "geometric")
MODES = ("sync-stream", "async", "baseline")
DTYPES = ("float32", "bfloat16", "float16")
ENGINES = ("vllm",)
RELAY_SYNC = ("delta", "full")
LORA_SYNC = ("merged", "adapter")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_MODES = ("loss", "penalty", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")
IS_MODES = ("auto", "on", "off")
LOGGERS = ("tensorboard", "wandb")
MOE_BUILDERS = ("tiny-moe", "tiny-moe-warm")  # builders of the tiny mixture of experts
MODEL_BUILDERS = ("tiny", "tiny-warm", *MOE_BUILDERS)
TEACHER_BUILDERS = ("tiny-teacher",)
SKEW_DISPATCH = ("random", "skewness-aware")
SKEW_SCHEDULE = ("fifo", "lpt")
RANKERS = ("none", "learned", "history", "oracle")
ATTENTIONS = ("sdpa", "eager", "flash_attention_2")  # transformers' attn_implementation
# sbatch options the launcher owns (clusters.X.sbatch may not set them): a site's value would
# break placement, logs or the array.
RESERVED_SBATCH = frozenset(
    {"job-name", "output", "error", "open-mode", "array", "nodes", "ntasks", "ntasks-per-node",
     "gpus-per-node", "gpus", "gres", "cpus-per-task", "partition", "clusters", "signal", "time"}
)  # fmt: skip


def choices(*values: str, default: str | None) -> Any:
    """A string field restricted to ``values`` (checked by the validator)."""
    return field(default=default, metadata={"choices": values})


# Upper bounds of sizes and counts (checked by the schema walk before anything is converted, written
# or allocated): what a user could mean on the largest cluster there is, and no more. A value past
# one is refused with the bound and its key; tighter, situational bounds (a model's context, this
# machine's cores for local processes) are checked where they are known.
NODES = 16_384  # nodes of one job (a 100k-GPU cluster is ~12,500 8-GPU nodes)
GPUS_PER_NODE = 128  # GPUs of one node (8 today; rack-scale systems are split into nodes of 4-8)
CPUS_PER_NODE = 4_096  # CPU cores of one node
MEM_GB = 65_536  # memory of one node, GiB
INSTANCES = 100_000  # instances of one pool (SLURM array tasks)
TIME_MIN = 527_040  # a job's time limit, minutes (a year)
SECONDS = 7 * 86_400  # leases, timeouts and bounds in seconds (a week)
RESTARTS = 10_000  # restarts of a role, checkpoints kept
ITERATIONS = 10_000_000  # iterations (and every count measured in them)
STEPS = 10_000_000  # supervised warm-up steps of a built model
TOKENS = 1 << 24  # tokens of one prompt or output (16M: past every model's context)
VOCAB = 1 << 24  # tokens of a vocabulary (top_k)
PROMPTS = 100_000_000  # prompts of a dataset (the built-in task makes them in memory)
BATCH = 1 << 20  # prompts of an iteration, samples of a micro-batch
GROUP = 1 << 16  # samples of one prompt
SEQS = 1 << 16  # sequences one engine instance runs at once
WORKERS = 4_096  # environment processes of one generator or server
TURNS = 100_000  # model turns of one trajectory
LAYERS = 4_096  # transformer layers
HIDDEN = 1 << 20  # model width (and a LoRA rank, which is below it)
HEADS = 4_096  # attention heads
PARAMS_B = 1_000_000  # parameters, billions


def at_most(bound: float, default: Any) -> Any:
    """A number field of at most ``bound`` (checked by the validator)."""
    return field(default=default, metadata={"max": bound})


@dataclass(kw_only=True)
class PartitionConfig:
    """One SLURM partition: what a node in it offers."""

    gpus_per_node: int = at_most(GPUS_PER_NODE, 0)  # GPUs on each node (0: CPU-only partition)
    gpu_type: str = "none"  # hardware kind of those GPUs (h800, h20, h100, ...), used by tune-split
    cpus_per_node: int = at_most(CPUS_PER_NODE, 1)  # CPU cores on each node
    mem_gb_per_node: int = at_most(MEM_GB, 1)  # memory of each node, GiB
    max_nodes: int = at_most(NODES, 1)  # nodes a single job may take in this partition


@dataclass(kw_only=True)
class ClusterConfig:
    """Where jobs run: a SLURM cluster (possibly at another site) or this machine's processes."""

    launcher: str = choices(*LAUNCHERS, default="slurm")  # how roles on this cluster are started
    slurm_cluster: str | None = None  # name for sbatch/squeue/scancel -M; null: the host's own cluster
    site: str = "default"  # datacenter: roles at different sites exchange weights over TCP, not NCCL
    partitions: dict[str, PartitionConfig] = field(default_factory=dict)  # partitions roles may use
    local_gpus: int = at_most(GPUS_PER_NODE, 0)  # GPUs of this machine (launcher=local only)
    account: str | None = None  # sbatch --account
    qos: str | None = None  # sbatch --qos
    setup_template: str | None = None  # file in slurm_templates/ whose lines run before each role
    env: dict[str, str] = field(default_factory=dict)  # variables exported in every job (NCCL, proxies)
    # Site options. Extra `#SBATCH --key=value` lines for every job on this cluster (true: a bare
    # flag such as --exclusive; false/null: left out), e.g. {constraint: h800, reservation: rl}.
    sbatch: dict[str, Any] = field(default_factory=dict)
    srun_args: list[str] = field(
        default_factory=list
    )  # extra `srun` arguments (--mpi=pmix, --container-image=...)
    python: str | None = None  # interpreter on this cluster's nodes (null: this host's, same path)
    exclusive: bool = False  # jobs that take every GPU of their nodes ask --exclusive and all node memory
    # This cluster's own directory for runs, when its nodes do not see the submit host's filesystem
    # (another site). Its jobs carry what they read (their role spec, the run's secret, the
    # rendezvous address) inside the job script and unpack it under run_root/<run id>, where their
    # logs go too; it must exist there (SLURM writes each job's own log in it before the script
    # runs). null: the run directory itself (one shared filesystem). Generators only: the
    # trainer and a rendezvous job write the run's checkpoints and metrics, so they run where it is.
    run_root: str | None = None


@dataclass(kw_only=True)
class RoleJobConfig:
    """Placement and resources shared by every role that runs as a job."""

    cluster: str = "???"  # key of `clusters` this role runs on
    partition: str | None = None  # partition of that cluster (required for SLURM clusters)
    time_min: int = at_most(TIME_MIN, 60)  # wall-clock limit of the job, minutes
    cpus_per_task: int = at_most(CPUS_PER_NODE, 1)  # CPU cores per task
    # memory per node, GiB (null: the job's GPU share of the partition's node memory)
    mem_gb: int | None = at_most(MEM_GB, None)
    program: str = "streamrl_cli.roles.preflight:main"  # `module:function` the role's processes run
    # SLURM: USR2 comes this long before the time limit. The trainer finishes its iteration, saves a
    # checkpoint and requeues its job, which resumes from it (a run longer than the limit goes on in
    # the requeued job); a generator hands its work back and requeues its task. Give the trainer an
    # iteration plus a checkpoint's write.
    signal_lead_s: int = at_most(SECONDS, 120)


@dataclass(kw_only=True)
class TrainerConfig(RoleJobConfig):
    """The trainer job: one task per GPU (one per node on CPU), all nodes of one job."""

    nodes: int = at_most(NODES, 1)  # nodes of the trainer job
    gpus_per_node: int = at_most(GPUS_PER_NODE, 1)  # GPUs on each trainer node
    # Tensor parallelism (DeepSpeed's AutoTP): every attention and MLP layer of the actor and critic
    # is split over this many consecutive ranks, which run the same micro-batches (the data-parallel
    # width is ranks / tensor_parallel) and each hold that share of the weights, gradients and optimizer
    # states; it composes with every ZeRO stage, checkpoints, export and the weight sync, which gather
    # the whole tensors (docs/training.md). It must divide the trainer's ranks and the model's query and
    # KV heads; not with sequence_parallel, LoRA or a mixture-of-experts model. 1: off.
    tensor_parallel: int = at_most(GPUS_PER_NODE * NODES, 1)
    pipeline_parallel: int = 1  # PP degree: 1 only (the trainer runs no pipeline parallel layout)
    # Sequence parallelism (DeepSpeed's Ulysses): each packed row of a micro-batch is split across
    # this many ranks of the trainer job, which exchange attention heads for sequence (all-to-all) in
    # every attention layer; ZeRO shards over all ranks. Activations and logits per rank shrink by
    # this factor, so a sequence this many times longer fits (docs/long-context.md). It must divide
    # the trainer's ranks and the model's attention heads; sdpa or flash_attention_2 only. 1: off.
    sequence_parallel: int = at_most(GPUS_PER_NODE * NODES, 1)
    zero_stage: int = 1  # DeepSpeed ZeRO stage, 0-3
    cpu_offload: bool = False  # ZeRO-Offload: optimizer states in host memory (tune-split may pick it)
    # Recompute each transformer block's activations during backward instead of keeping them from the
    # forward pass (transformers' gradient checkpointing, non-reentrant), on the actor and the critic:
    # a micro-batch's activations cost about one block's instead of every block's, for about a third
    # more compute. For long sequences (docs/long-context.md); works with LoRA and every ZeRO stage.
    activation_checkpointing: bool = False
    # The attention kernel the trainer's models load with (transformers' attn_implementation): sdpa
    # (PyTorch's fused attention), eager (plain matmuls; slowest, the most memory), flash_attention_2
    # (CUDA GPUs with the flash-attn package only).
    attention: str = choices(*ATTENTIONS, default="sdpa")
    # Tokens per chunk of the LM head and log-softmax in the actor's and reference's log-probs: the
    # [tokens × vocabulary] logits are computed a chunk at a time and recomputed in backward, never
    # held whole (at 8k tokens and a 152k vocabulary: 5 GB of fp32 logits, 0.6 GB a chunk of 1024).
    # The results equal the unchunked ones to rounding. 0: unchunked (the whole logits at once).
    logits_chunk: int = at_most(TOKENS, 1024)
    program: str = "streamrl_cli.trainer.main:main"  # `module:function` the trainer's processes run
    # A trainer that dies (killed, crashed, its node lost) is started again, resuming from the run's
    # newest checkpoint, at most this many times per run: by `streamrl run` for a local trainer, by
    # the rendezvous role's job watcher (a new job) on SLURM. Generators wait for it up to
    # train.stall_after_s. 0: the run fails with its trainer.
    restarts: int = at_most(RESTARTS, 2)


@dataclass(kw_only=True)
class ElasticConfig:
    """The elastic rule (``elastic.policy``), run by the trainer after each iteration (`streamrl scale`
    works without it).

    Δ = T_gen − T_train; Δ′ = T_gen / (n + 1), the time one more of the n instances would save at
    their measured throughput. Adds one when Δ > Δ′, releases one when the generators idle.
    """

    enabled: bool = False  # the trainer asks for instances by this rule (off: the count stays as launched)
    min: int = at_most(INSTANCES, 1)  # never fewer instances (at least 1: the rule needs one to measure)
    max: int = at_most(INSTANCES, 1)  # never more instances
    # iterations in a row a condition must hold before an instance is added or released
    patience: int = at_most(ITERATIONS, 2)
    # iterations after a change with no other change (a new instance needs to start)
    cooldown: int = at_most(ITERATIONS, 2)
    idle_release: float = 0.5  # release one when generators idle more than this fraction of iterations


@dataclass(kw_only=True)
class GeneratorConfig(RoleJobConfig):
    """Generator instances: one SLURM array task per instance, so scaling is adding/cancelling tasks."""

    instances: int = at_most(INSTANCES, 1)  # generator instances (array tasks)
    gpus_per_instance: int = at_most(GPUS_PER_NODE, 1)  # GPUs per instance (on one node)
    # TP degree inside an instance; must divide gpus_per_instance
    tensor_parallel: int = at_most(GPUS_PER_NODE, 1)
    max_running: int | None = at_most(INSTANCES, None)  # array throttle (`%N`); null: all at once
    # Sequences one instance runs at once (vLLM's max_num_seqs): the bound of its admission queue for
    # every dispatch (random + FIFO runs exactly this many; Algorithm 2 picks batch sizes up to it).
    max_num_seqs: int = at_most(SEQS, 64)
    engine: str = choices(*ENGINES, default="vllm")  # inference engine
    # Generators at another site than the trainer: how their relay fetches each weight version
    # across sites. delta: only what changed since the version it holds (bit-exact, checked per
    # tensor; whole when it cannot be); full: every byte, every version, and the trainer computes
    # no deltas (for links fast enough that computing them costs more than it saves).
    relay_sync: str = choices(*RELAY_SYNC, default="delta")
    program: str = "streamrl_cli.generator.main:main"  # `module:function` each instance runs
    elastic: ElasticConfig = field(default_factory=ElasticConfig)  # grow/shrink instances while training


@dataclass(kw_only=True)
class TeacherModelConfig:
    """The distillation teacher's model: it must share the policy's tokenizer (the teacher scores the
    policy's tokens by id)."""

    name: str = "teacher"  # display name
    path: str | None = None  # local directory for from_pretrained (required with instances > 0)
    # How to make it when `path` does not exist yet (null: it must exist): "tiny-teacher" builds a
    # tiny Qwen2 twice as wide and deep as the tiny policy and trains it on the built-in task's
    # exact answers (warmup_steps supervised steps), a teacher that knows the task.
    builder: str | None = field(default=None, metadata={"choices": TEACHER_BUILDERS})
    warmup_steps: int = at_most(STEPS, 600)  # builder tiny-teacher: supervised steps


@dataclass(kw_only=True)
class TeacherConfig(RoleJobConfig):
    """On-policy distillation's teacher pool (algorithm.distill_coef): instances serving a fixed model
    that score the policy's sampled tokens (their log-probs under the teacher), streamed to the
    trainer like samples; an instance lost has its work re-dispatched to the others."""

    instances: int = at_most(INSTANCES, 0)  # teacher instances (array tasks); 0: no teacher
    cluster: str | None = None  # type: ignore[assignment]  # key of `clusters` (null: the generators')
    # partition of that cluster (null: the generators' when the cluster is theirs)
    partition: str | None = None
    gpus_per_instance: int = at_most(GPUS_PER_NODE, 1)  # GPUs per instance (on one node)
    # TP degree inside an instance; must divide gpus_per_instance
    tensor_parallel: int = at_most(GPUS_PER_NODE, 1)
    max_num_seqs: int = at_most(SEQS, 64)  # sequences an instance scores at once
    max_running: int | None = at_most(INSTANCES, None)  # array throttle (`%N`); null: all at once
    program: str = "streamrl_cli.generator.teacher:main"  # `module:function` each instance runs
    model: TeacherModelConfig = field(default_factory=TeacherModelConfig)


@dataclass(kw_only=True)
class EnvServerConfig(RoleJobConfig):
    """Environment servers (docs/agents.md): processes of their own, on any cluster (a CPU partition
    will do), that host multi-turn environments for every generator, found through the rendezvous;
    heavy environments then take no CPU or memory beside an engine. Off (instances 0): each
    generator hosts its environments itself (agent.env_workers processes)."""

    # environment servers (array tasks); 0: environments beside each generator
    instances: int = at_most(INSTANCES, 0)
    cluster: str | None = None  # type: ignore[assignment]  # key of `clusters` (null: the generators')
    # partition of that cluster (null: the generators' when the cluster is theirs); no GPU is asked
    partition: str | None = None
    # environment processes each server hosts (null: agent.env_workers)
    workers: int | None = at_most(WORKERS, None)
    program: str = "streamrl_cli.envserver.role:main"  # `module:function` each server runs


@dataclass(kw_only=True)
class RendezvousConfig:
    """The run's control-plane server (see streamrl_cli.rendezvous)."""

    placement: str = choices(*RENDEZVOUS_PLACEMENTS, default="submit-host")  # where the server runs
    cluster: str | None = None  # with placement=job: the cluster of its job
    partition: str | None = None  # with placement=job: the partition of its job
    bind_host: str = "127.0.0.1"  # address the server listens on (0.0.0.0 for other hosts)
    port: int = 0  # port (0: any free port)
    lease_s: float = at_most(SECONDS, 10.0)  # a member silent for this long is marked lost
    tls_cert: str | None = None  # PEM certificate: serve HTTPS (cross-site links)
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_ca: str | None = None  # CA bundle to verify the server (self-signed: tls_cert); null: system CAs
    time_min: int = at_most(TIME_MIN, 60)  # with placement=job: its wall-clock limit, minutes


@dataclass(kw_only=True)
class RolesConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # the trainer job
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)  # the generator job array
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)  # the control plane
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # on-policy distillation's teachers
    env_server: EnvServerConfig = field(default_factory=EnvServerConfig)  # multi-turn environments' hosts


# PEFT's names for the linear layers of Llama-family blocks (Llama, Qwen2/2.5/3, Mistral): LoRA's
# default targets, and what `model.lora.target_modules` is checked against when the model's own
# weights cannot be read (a hub id, a model built at run time).
LORA_LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA adapters on the policy (PEFT): the base weights stay frozen and only the adapters train.
    What each weight version sends the generators is `sync`'s choice."""

    rank: int = at_most(HIDDEN, 0)  # adapter rank r (0: off, every weight trains)
    alpha: float = 16.0  # scaling numerator: the adapter's update is (alpha / rank) · B·A
    dropout: float = 0.0  # dropout on the adapters' input while training, in [0, 1)
    # Modules that get an adapter, by the last part of their name (PEFT's target_modules): linear
    # layers of the model's blocks. Default: every attention and MLP projection of Llama/Qwen blocks.
    target_modules: list[str] = field(default_factory=lambda: list(LORA_LINEAR_NAMES))
    # What each weight version sends the generators. merged: the whole model, base + (alpha / rank)
    # · B·A under the base model's names (loaded in place, as without LoRA); adapter: the adapters
    # alone, served by vLLM's LoRA support over the base the generators loaded once from model.path
    # (a version is a few MB instead of the model, on the broadcast and through the cross-site relay).
    sync: str = choices(*LORA_SYNC, default="merged")


@dataclass(kw_only=True)
class ModelConfig:
    """The policy model: architecture numbers are used for checks and cost models."""

    name: str = "???"  # display name
    path: str = "???"  # local directory (or hub id on clusters with a cache) for from_pretrained
    params_b: float = at_most(PARAMS_B, 0.0)  # parameters, billions
    num_layers: int = at_most(LAYERS, 1)  # transformer layers
    hidden_size: int = at_most(HIDDEN, 64)  # model width
    num_attention_heads: int = at_most(HEADS, 2)  # query heads (tensor-parallel sizes must divide it)
    num_kv_heads: int = at_most(HEADS, 2)  # key/value heads
    dtype: str = choices(*DTYPES, default="bfloat16")  # weights and compute dtype
    # How to make the model when `path` does not exist yet (null: it must exist): "tiny" builds the
    # tiny Qwen2 of streamrl_cli.models.tiny, "tiny-warm" also warms it up on the built-in task (SFT);
    # "tiny-moe" and "tiny-moe-warm" the same for a tiny Qwen3-MoE (8 experts, 2 per token).
    builder: str | None = field(default=None, metadata={"choices": MODEL_BUILDERS})
    # builder tiny-warm or tiny-moe-warm: supervised steps on the built-in task before RL
    warmup_steps: int = at_most(STEPS, 0)
    # The positions (max_position_embeddings) of the model a builder makes: the longest prompt plus
    # output it holds. null: the builder's 4,096. Only with a builder (a model's own positions are
    # in its config.json).
    builder_positions: int | None = at_most(TOKENS, None)
    lora: LoraConfig = field(default_factory=LoraConfig)  # train LoRA adapters instead of every weight


@dataclass(kw_only=True)
class AlgorithmConfig:
    """The RL algorithm. `name` picks a preset (recipe.presets, docs/algorithms.md) that fills every key
    marked "null: the algorithm's" which the recipe, its config groups and the command line left unset;
    a key set anywhere wins over the preset."""

    name: str = choices(*ALGORITHMS, default="grpo")  # RL algorithm (a preset of the keys below)
    mode: str = choices(*MODES, default="sync-stream")  # pipelining between generation and training
    group_size: int | None = at_most(GROUP, None)  # samples per prompt; null: the algorithm's
    # async, partial rollout: max versions a sample (its oldest token) may lag
    max_staleness: int = at_most(ITERATIONS, 1)
    # Advantage estimator: gae (critic), grpo, rloo, reinforce++, reinforce++-baseline; null: the algorithm's.
    advantage: str | None = choices(*ADVANTAGES, default=None)
    # Policy loss: clip (PPO/GRPO/DAPO), gspo, cispo; null: the algorithm's.
    policy_loss: str | None = choices(*POLICY_LOSSES, default=None)
    # The policy of the loss's ratio π/π_old: the trainer's own log-probs before the step (value 1 in
    # one step: behaviour lag is corrected by is_correction/is_mask), or the generators' (behaviour).
    old_policy: str = choices(*OLD_POLICIES, default="trainer")
    kl_coef: float | None = None  # KL penalty against the reference model; null: the algorithm's
    # Ratio clipping, both sides unless clip_ratio_high is set (DAPO's clip-higher); null: the
    # algorithm's (clip_ratio_high: else clip_ratio).
    clip_ratio: float | None = None
    clip_ratio_high: float | None = None
    lr: float = 1e-6  # actor learning rate (0: the policy stays fixed, for generation benchmarks)
    critic_lr: float = 1e-5  # PPO: critic learning rate
    weight_decay: float = 0.0  # AdamW weight decay of actor and critic
    max_grad_norm: float = 1.0  # gradient clipping (0: off)
    # How per-token losses become one number; null: the algorithm's.
    loss_agg: str | None = choices(*LOSS_AGGS, default=None)
    entropy_coef: float = 0.0  # entropy bonus (subtracted from the loss)
    # Mixture-of-experts models: the weight of the routers' auxiliary load-balancing loss (Switch
    # Transformer's E · Σ f_e · P_e, averaged over layers; 1 at an even load) added to the loss.
    # 0: off (the router learns from the policy loss alone). Only for a model with routers.
    router_aux_loss_coef: float = 0.0
    # Mixture-of-experts models: the generators capture the experts their routers chose for every
    # token, the samples carry them (k bytes per token per MoE layer), and the trainer's forward uses
    # them instead of its own routers' choice (R3): the same experts compute each token in both
    # engines. Logged: moe/replay_differ, how often the trainer's routers would have chosen others.
    routing_replay: bool = False
    # KL to the reference: a loss term, a per-token reward penalty (GAE only), off; null: the algorithm's.
    kl_mode: str | None = choices(*KL_MODES, default=None)
    kl_estimator: str | None = choices(*KL_ESTIMATORS, default=None)  # k1, k2, k3; null: the algorithm's
    gamma: float = 1.0  # PPO: GAE discount
    lam: float = 0.95  # PPO: GAE lambda
    value_clip: float = 0.2  # PPO: critic value clipping around the old values (0: off)
    grpo_std_norm: bool | None = None  # advantage=grpo: divide by the group's std; null: the algorithm's
    # DAPO's soft overlong punishment: the last overlong_buffer tokens before task.max_output_len cost a
    # reward penalty rising linearly to overlong_penalty (0: off); null: the algorithm's.
    overlong_buffer: int | None = at_most(TOKENS, None)
    overlong_penalty: float = 1.0  # the penalty at task.max_output_len tokens
    # DAPO's dynamic sampling: a group whose rewards are all equal does not count toward the batch;
    # the iteration draws more groups instead; null: the algorithm's.
    dynamic_sampling: bool | None = None
    # Dynamic sampling: groups an iteration may draw to replace dropped ones, as a fraction of
    # train.global_batch; past it the iteration trains fewer groups (with a warning and a metric).
    max_refill: float = 1.0
    # Importance-sampling correction with the behaviour log-probs (auto: on in async mode and with
    # partial rollout, when old_policy is trainer), weights truncated at is_cap (truncated IS).
    is_correction: str = choices(*IS_MODES, default="auto")
    is_cap: float = 2.0  # truncation of the importance weights
    # The weight's level: per token, per sequence (product of the token ratios) or the sequence's
    # geometric mean (length-normalised); null: the algorithm's.
    is_level: str | None = choices(*IS_LEVELS, default=None)
    # Masking: tokens (or whole sequences, by product or geometric mean) whose trainer/behaviour ratio
    # lies outside [is_mask_low, is_mask_high] leave the loss (off, token, sequence, geometric).
    is_mask: str = choices(*IS_MASKS, default="off")
    is_mask_low: float = 0.5  # lower bound of the kept ratios
    is_mask_high: float = 2.0  # upper bound of the kept ratios
    # On-policy distillation (roles.teacher): each sampled token's advantage gains
    # distill_coef × (log p_teacher − log p_behaviour), the negative of the per-token reverse KL
    # from the teacher; 0: off.
    distill_coef: float = 0.0
    # With distill_coef: the task reward's advantage is kept and the teacher's term added to it;
    # false: the teacher's term alone (rewards are still computed and recorded).
    distill_task_reward: bool = True
    temperature: float = 1.0  # sampling temperature (the trainer's log-probs use the same)
    # Truncated sampling, passed to vLLM; the trainer's and the reference's log-probs apply the same
    # truncation (vLLM's order: temperature, min_p, top_k, top_p), so they are of the distribution
    # sampled from. The sampling seed is train.seed (and train.reproducible_sampling).
    top_p: float = 1.0  # nucleus: keep the most likely tokens up to this probability mass (1: off)
    top_k: int = at_most(VOCAB, 0)  # keep the k most likely tokens (0: off)
    min_p: float = 0.0  # drop tokens below min_p × the most likely token's probability (0: off)
    stop: list[str] = field(default_factory=list)  # strings that end a completion, besides EOS


@dataclass(kw_only=True)
class TaskConfig:
    name: str = "???"  # task name
    # Prompts: a JSONL or Parquet file, or a directory written by datasets' save_to_disk (null: the
    # built-in task). A relative path is taken from the directory streamrl is started in.
    dataset: str | None = None
    prompt_key: str = "prompt"  # dataset: field holding the prompt (text, or a list of chat messages)
    # Each epoch in a fresh order drawn from train.seed; false: the dataset's own order, epoch after
    # epoch (a curriculum: the dataset is sorted the way it should be trained, easy to hard, ...).
    shuffle: bool = True
    # Reward, called TRL-style as fn(prompts, completions, **columns) (streamrl_cli.tasks.rewards):
    # `module:function` or `path/to/file.py:function`; null: the built-in task's own verifier.
    reward: str | None = None
    # Chat template (streamrl_cli.tasks.datasets.ChatFormat): null: text prompts as they are, chat
    # prompts through the tokenizer's template; "tokenizer": every prompt through the tokenizer's
    # template; else a Jinja template (inline, or a .jinja file) used instead of the tokenizer's.
    chat_template: str | None = None
    system_prompt: str | None = None  # system message put first in every chat without one
    # Held-out evaluation on the generators (streamrl_cli.trainer.loop.evaluation): a dataset like `dataset`
    # (same prompt_key, chat template and reward), evaluated at the end of the run and every
    # `eval_every` iterations; records eval/reward_mean, eval/reward_std, eval/length_mean, ...
    eval_dataset: str | None = None
    eval_every: int = at_most(ITERATIONS, 0)  # iterations between evaluations (0: only the final one)
    # eval prompts per evaluation, the first ones (null: all)
    eval_samples: int | None = at_most(PROMPTS, None)
    eval_temperature: float = 0.0  # sampling temperature of evaluation (0: greedy)
    num_prompts: int = at_most(PROMPTS, 4096)  # built-in task: prompts in its dataset
    # Built-in repeat task: this many random words (one token each) before each instruction, so that a
    # prompt is a long context with its question last, as an agent's observations or a retrieved
    # document are (docs/long-context.md). They count toward max_prompt_len. 0: the short prompts.
    filler_words: int = at_most(TOKENS, 0)
    max_prompt_len: int = at_most(TOKENS, 512)  # prompt tokens
    max_output_len: int = at_most(TOKENS, 1024)  # output tokens
    # Output-length distribution for tune-split's cost model and simulator (planner.lengths):
    # a log-normal body around a mode plus a flat tail up to max_output_len.
    # typical prompt tokens (null: half of max_prompt_len)
    prompt_len_mean: int | None = at_most(TOKENS, None)
    # most common output length (null: max_output_len / 10, 2K for 20K)
    output_len_mode: int | None = at_most(TOKENS, None)
    output_len_tail: float = 0.2  # fraction of outputs in the flat tail between the mode and the max
    output_len_spread: float = 0.4  # log-σ of the body around the mode


@dataclass(kw_only=True)
class TrainConfig:
    global_batch: int = at_most(BATCH, 16)  # prompts per iteration
    micro_batch: int = at_most(BATCH, 4)  # samples per forward/backward
    # Tokens per forward/backward (prompt + response of each sample), beside micro_batch's count: a
    # micro-batch is cut where either would be passed, in the batch's order; a sample longer than
    # this is a micro-batch of its own. For long, uneven outputs (docs/long-context.md). 0: no bound.
    micro_batch_tokens: int = at_most(TOKENS, 0)
    iterations: int = at_most(ITERATIONS, 10)  # RL iterations
    seed: int = 0  # seed of data order and sampling
    # Seed every request from `seed`, the prompt id and the sample index (the same prompt gives the
    # same outputs under the same weights whatever the batching), and train each batch's groups in
    # the batch's order, not as they finish: in sync modes the same recipe and seed then give the
    # same tokens, rewards and weights run after run (benchmarks, debugging, an exact oracle).
    reproducible_sampling: bool = True
    checkpoint_every: int = at_most(ITERATIONS, 5)  # iterations between checkpoints (0: only the last one)
    keep_checkpoints: int = at_most(RESTARTS, 2)  # checkpoints kept (older ones are deleted)
    # At the end of the run, write the last iteration's policy as a Hugging Face model directory
    # (config, tokenizer, safetensors) to <run dir>/model (`streamrl export` does it for any checkpoint).
    export_final: bool = True
    loggers: list[str] = field(default_factory=list)  # extra metric sinks: tensorboard, wandb
    wandb_project: str = "streamrl"  # W&B project (loggers=[wandb])
    # Bound on a run without progress, seconds: past it `streamrl status` shows the run `stalled`
    # (with each member's last error), and the trainer ends the run, saying why, when no generator
    # has been alive for this long or no sample came for this long.
    stall_after_s: float = at_most(SECONDS, 900.0)


# run.name: the run directory is <root>/<name>-<timestamp>, and the name is in SLURM job names, logs
# and terminals: letters, digits, '.', '_' and '-', starting with a letter or digit, at most 64.
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(kw_only=True)
class RunConfig:
    name: str = "run"  # run name (RUN_NAME): the run directory is <root>/<name>-<timestamp>
    root: str = "runs"  # directory of run directories (relative to where streamrl runs)


@dataclass(kw_only=True)
class PlannerConfig:
    """Inputs of `streamrl tune-split` beyond the workload itself."""

    hardware_file: str | None = None  # YAML of extra or corrected GPU specs (shape: planner/hardware.yaml)
    profile_file: str | None = None  # a `streamrl profile` result to use instead of the analytic model


@dataclass(kw_only=True)
class SkewnessConfig:
    """Skewness-aware generation (docs/architecture.md): length ranker, dispatch, order inside an instance."""

    dispatch: str = choices(*SKEW_DISPATCH, default="random")  # prompts to instances: random or Algorithm 2
    schedule: str = choices(*SKEW_SCHEDULE, default="fifo")  # order inside an instance: FIFO or longest first
    # Output-length ranker: learned (a small LM fine-tuned online), history (per-prompt statistics,
    # learned for unseen prompts), oracle (the task's ideal lengths, for evaluation; with a `cache` of
    # the lengths a fixed policy realised, reproducible_sampling on, the true oracle), none.
    ranker: str = choices(*RANKERS, default="none")
    ranker_model: str | None = None  # base model of the learned ranker (null: the policy's model.path)
    long_tail: float = 0.2  # α: share of prompts (by predicted length) treated as the long tail
    # iterations between background refreshes of the learned ranker
    refresh_every: int = at_most(ITERATIONS, 1)
    cache: str | None = None  # scores from `streamrl rank` to start from


@dataclass(kw_only=True)
class RolloutConfig:
    """How an iteration's samples are gathered beyond dispatching its batch (docs/long-tail.md)."""

    # Over-sampling: dispatch this fraction more prompts (whole GRPO groups) than train.global_batch;
    # the iteration trains on the first global_batch groups to finish, the rest are aborted on their
    # generators and their prompts drawn again first. Cuts the long tail; not reproducible.
    oversample: float = 0.0
    # Partial rollout: the over-sampled groups still running when an iteration closes are paused
    # with the tokens they have and resumed under the next weights in the next iteration, instead of
    # aborted; each token keeps the version that produced it, a sample older than
    # algorithm.max_staleness versions starts over. Sync modes are then no longer strictly on-policy.
    partial: bool = False


AGENT_REWARDS = ("env", "task", "sum")
AGENT_ON_FAILURE = ("score", "drop")
# Tool-call syntaxes StreamRL reads (streamrl_cli.agent.tools says what each looks like).
AGENT_TOOL_FORMATS = ("hermes", "llama3_json", "mistral", "qwen3_coder")


@dataclass(kw_only=True)
class AgentConfig:
    """Multi-turn rollouts (docs/agents.md): each sample is a trajectory of model turns and the
    answers of an environment and/or tools, built token by token on the generators. Off while
    neither `env` nor `tools` is set."""

    # The environment: a class (`module:Class` or `path/to/file.py:Class`) with reset(row) and
    # step(turn), made with `env_args` once per trajectory (null: tools only).
    env: str | None = None
    env_args: dict[str, Any] = field(default_factory=dict)
    # Tools the model may call (`module:function` or `path/to/file.py:function`): functions with
    # type hints and a docstring, called in the tool-call syntax of the model's chat template.
    tools: list[str] = field(default_factory=list)
    # The tool-call syntax the model writes and its tools' answers are read in; null: the one the
    # chat template defines (set it for a template whose syntax is not recognised, or to override).
    tool_format: str | None = choices(*AGENT_TOOL_FORMATS, default=None)
    max_turns: int = at_most(TURNS, 4)  # model turns per trajectory
    # tokens of one model turn (null: task.max_output_len)
    max_turn_tokens: int | None = at_most(TOKENS, None)
    # A trajectory's tokens (model and environment, after the prompt) are bounded by task.max_output_len.
    # for one reset or step of the environment; past it the trajectory ends
    step_timeout_s: float = at_most(SECONDS, 30.0)
    # Processes that host the environments: per generator, or per server with roles.env_server.
    env_workers: int = at_most(WORKERS, 2)
    # The reward a trajectory is trained on: the environment's (the sum of its step rewards), the
    # task's reward function on the whole conversation after the prompt, or their sum.
    reward: str = choices(*AGENT_REWARDS, default="env")
    # A trajectory whose environment failed (raised, timed out, its process died): scored as it
    # stands, or dropped (not learnt from, like an unscored sample; counted either way).
    on_failure: str = choices(*AGENT_ON_FAILURE, default="score")

    @property
    def enabled(self) -> bool:
        return bool(self.env or self.tools)


@dataclass(kw_only=True)
class Recipe:
    """The whole run, as composed from a recipe file, its defaults and command-line overrides."""

    run: RunConfig = field(default_factory=RunConfig)
    clusters: dict[str, ClusterConfig] = field(default_factory=dict)  # name -> cluster
    roles: RolesConfig = field(default_factory=RolesConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)  # tune-split's hardware and profiles
    skewness: SkewnessConfig = field(default_factory=SkewnessConfig)  # ranker, dispatch, LPT
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # over-sampling
    agent: AgentConfig = field(default_factory=AgentConfig)  # multi-turn: environment, tools
