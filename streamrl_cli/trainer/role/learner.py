"""One iteration's gradient, built micro-batch by micro-batch, and one optimizer step.

Why gradients are accumulated as *sums*: in stream mode the trainer starts backward passes
before it knows how many tokens the iteration will have, yet the result must equal the loss
averaged over the whole batch (token-mean needs the total token count). Each micro-batch
backpropagates the numerator of its aggregate (``losses.aggregate``); after the last one the
accumulated gradient is divided by the iteration's total units (tokens or sequences, summed over
data-parallel ranks) through DeepSpeed's own gradient API, then the optimizer steps. The same
path serves whole-batch (baseline) training, so the modes differ only in *when* micro-batches
run, never in the gradient (tested).

Actor and critic are DeepSpeed engines (ZeRO stage from the recipe; gloo on CPUs, NCCL on
GPUs; with ``roles.trainer.tensor_parallel`` their layers split over groups of ranks by DeepSpeed's
AutoTP, module ``trainer.role.tensor_parallel``). The reference model is a frozen copy on every
rank; with LoRA (the recipe's ``model.lora``, module ``trainer.role.lora``) the actor is the base
model with adapters, only they train, and the reference is the same network with its adapters
switched off.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from streamrl_cli.errors import StreamRLError
from streamrl_cli.recipe import presets
from streamrl_cli.trainer import algo as A
from streamrl_cli.trainer.algo import losses as L
from streamrl_cli.trainer.loop.batch import MicroBatch
from streamrl_cli.trainer.role import lora as lora_
from streamrl_cli.trainer.role.models import (
    Critic,
    checkpoint_activations,
    critic_forward,
    load_policy,
    load_reference,
    policy_forward,
)
from streamrl_cli.trainer.role.moe import Routers
from streamrl_cli.trainer.role.sequence_parallel import SequenceParallel
from streamrl_cli.trainer.role.tensor_parallel import TensorParallel

log = logging.getLogger("streamrl.trainer")

if TYPE_CHECKING:
    from streamrl_cli.recipe.schema import AlgorithmConfig, LoraConfig, TrainerConfig


@dataclass(kw_only=True)
class LossConfig:
    """The recipe's algorithm section as the loss runs it (each setting is the schema's,
    ``recipe.schema.AlgorithmConfig``), and what follows from it. Build it with :meth:`from_recipe`."""

    # As resolved by ``recipe.checks.resolve``: is_correction on or off, the preset's keys filled.
    algorithm: AlgorithmConfig
    max_len: int  # task.max_output_len (seq-mean-token-sum-norm's constant)

    def __post_init__(self) -> None:
        if self.algorithm.is_correction not in ("on", "off"):
            raise ValueError(
                f"algorithm.is_correction={self.algorithm.is_correction!r} not resolved (checks.resolve)"
            )
        presets.require_resolved(self.algorithm, "the trainer's loss")

    @classmethod
    def from_recipe(cls, algorithm: AlgorithmConfig, max_len: int) -> LossConfig:
        """The loss of a recipe's algorithm section, with outputs of at most ``max_len`` tokens."""
        return cls(algorithm=algorithm, max_len=max_len)

    @property
    def critic(self) -> bool:
        """Whether the advantages are GAE's, from a critic trained alongside the actor."""
        return A.estimator(self.algorithm.advantage).critic

    @property
    def kl(self) -> bool:
        """Whether the loss (or reward) has a KL term, which needs the reference's log-probs: not with
        kl_mode none, nor with a zero coefficient."""
        return self.algorithm.kl_mode != "none" and self.algorithm.kl_coef != 0

    @property
    def importance_sampling(self) -> bool:
        """Truncated IS with the behaviour log-probs (algorithm.is_correction, resolved)."""
        return self.algorithm.is_correction == "on"

    @property
    def sampling(self) -> L.SamplingTransform:
        """The generators' sampling distribution, which the actor's and reference's log-probs use."""
        a = self.algorithm
        return L.SamplingTransform(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p)


@dataclass(kw_only=True)
class OptimConfig:
    """The optimizer's settings, as the recipe's sections hold them (``recipe.schema``)."""

    algorithm: AlgorithmConfig  # lr, critic_lr, weight_decay, max_grad_norm
    trainer: TrainerConfig  # roles.trainer: zero_stage


def open_group_store(world: int, host: str) -> tuple[Any, str]:
    """Rank 0's store for the trainer group and its address. The store binds a port the OS picks
    as it listens: a port probed free and closed first can be taken by another process before
    the store binds it (seen in CI as EADDRINUSE)."""
    store = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False)
    return store, f"{host}:{store.port}"


def init_distributed(rank: int, world: int, master: str, backend: str, store: Any = None) -> None:
    """The trainer ranks' default group (DeepSpeed's), before any engine is made. Rank 0 passes the
    store it opened with `open_group_store`; the other ranks connect to it at `master`."""
    host, _, port = master.rpartition(":")
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"),
        MASTER_ADDR=host, MASTER_PORT=port,
    )  # fmt: skip
    if backend == "gloo":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    if not dist.is_initialized():
        if store is None:
            store = dist.TCPStore(host, int(port), world, is_master=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def leave_group() -> None:
    """Every rank, once its last collective is done: destroy the default group and its subgroups
    while the interpreter is whole, not in its teardown (where gloo's threads have aborted ranks)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _engine(
    model: torch.nn.Module, lr: float, opt: OptimConfig, mpu: Any = None, tp: TensorParallel | None = None
) -> Any:
    """A DeepSpeed engine of `model`; `mpu`: the sequence-parallel layout (ZeRO then shards over all
    ranks and reduces over the data-parallel groups); `tp`: AutoTP splits its layers over groups of
    ranks as the engine is made (trainer.role.tensor_parallel)."""
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=opt.algorithm.weight_decay)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": opt.algorithm.max_grad_norm,
        "zero_optimization": {"stage": opt.trainer.zero_stage},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        **(tp.ds_config() if tp is not None else {}),
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    return engine


class Learner:
    """Actor, critic (PPO), reference; micro-batch backward passes and the iteration's step."""

    def __init__(
        self,
        path: str,
        loss: LossConfig,
        opt: OptimConfig,
        device: torch.device,
        dtype: torch.dtype,
        lora: LoraConfig | None = None,
    ):
        self.loss, self.opt, self.device = loss, opt, device
        self.lora = lora if lora_.enabled(lora) else None  # rank 0: off
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        t = opt.trainer
        if t.attention == "flash_attention_2" and device.type != "cuda":
            raise StreamRLError(
                f"roles.trainer.attention=flash_attention_2 runs on CUDA GPUs only, and this trainer "
                f"runs on {device}: use sdpa or eager"
            )
        # Tokens per chunk of the LM head in the actor's and reference's log-probs (0: unchunked).
        self.chunk = t.logits_chunk
        # Sequence parallelism: the ranks of a group split each packed row (trainer.role.sequence_parallel).
        self.sp = SequenceParallel.setup(t.sequence_parallel) if t.sequence_parallel > 1 else None
        self._policy_forward = self.sp.policy_forward if self.sp else policy_forward
        self._critic_forward = self.sp.critic_forward if self.sp else critic_forward
        mpu = self.sp.mpu if self.sp else None
        # Tensor parallelism: the ranks of a group split each layer (trainer.role.tensor_parallel).
        self.tp = TensorParallel(t.tensor_parallel, self.world) if t.tensor_parallel > 1 else None
        if self.tp is not None:
            log.info(
                "tensor parallel: each layer split over %d ranks (%d groups)",
                self.tp.degree, self.tp.dp_world,
            )  # fmt: skip
        if self.sp is not None:
            log.info(
                "sequence parallel: rank %d of %d in its group splits each packed row (%d groups)",
                self.sp.rank, self.sp.degree, self.sp.dp_world,
            )  # fmt: skip
        policy = self._split(load_policy(path, dtype, t.attention))
        if t.activation_checkpointing:
            # Before LoRA: PEFT then makes the embeddings' output require grad, as checkpointing wants.
            checkpoint_activations(policy)
        if self.lora is not None:
            # The same initial adapters on every rank (the trainer seeds each rank differently).
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                policy = lora_.apply(policy, self.lora)
        self.actor = _engine(policy, opt.algorithm.lr, opt, mpu, self.tp)
        # A mixture of experts: its routers' choices and load-balancing loss (trainer.role.moe).
        self.routers = Routers(self.actor.module)
        if opt.algorithm.router_aux_loss_coef and not self.routers:
            raise StreamRLError(
                f"algorithm.router_aux_loss_coef={opt.algorithm.router_aux_loss_coef}: the model at {path} "
                "has no mixture-of-experts router (a dense model); set it to 0"
            )
        # PPO's critic trains in full with LoRA too (its own network; docs/lora.md).
        self.critic = (
            _engine(self._critic(path, dtype, t), opt.algorithm.critic_lr, opt, mpu, self.tp)
            if loss.critic
            else None
        )
        # With LoRA the reference is the actor with its adapters off: no second copy.
        self.ref = (
            self._split(load_reference(path, dtype, device, t.attention))
            if self.kl and self.lora is None
            else None
        )
        self._begin()

    def _split(self, model: Any) -> Any:
        """`model` with its attention split over the sequence-parallel group (as it is without one)."""
        return self.sp.install(model) if self.sp is not None else model

    @property
    def sp_degree(self) -> int:
        """Ranks that share each micro-batch (1: no sequence parallelism)."""
        return self.sp.degree if self.sp is not None else 1

    @property
    def shared_by(self) -> int:
        """Ranks that run each micro-batch together: a sequence-parallel group (each its slice of the
        rows) or a tensor-parallel group (each its slice of the layers); 1 without either."""
        return self.sp_degree * (self.tp.degree if self.tp is not None else 1)

    @property
    def kl(self) -> bool:
        """Whether the loss (or reward) has a KL term, which needs the reference's log-probs."""
        return self.loss.kl

    def _critic(self, path: str, dtype: torch.dtype, t: TrainerConfig) -> Critic:
        critic = Critic(path, dtype, t.attention)
        self._split(critic.backbone)
        if t.activation_checkpointing:
            checkpoint_activations(critic.backbone)
            # from_pretrained leaves the backbone in eval mode, where transformers checkpoints nothing.
            critic.train()
        return critic

    def _begin(self) -> None:
        self.units = 0.0
        self.sums: dict[str, float] = {}

    def _add(self, key: str, value: torch.Tensor | float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(value)

    def micro_step(self, mb: MicroBatch, *, last: bool) -> None:
        """Forward and backward of one micro-batch (every rank calls it equally often; `last` ends the
        accumulation: the gradient reduction happens in that backward)."""
        c, a = self.loss, self.loss.algorithm
        self.actor.train()
        logp, ent = self._policy_forward(
            self.actor, mb, c.sampling, entropy=True, chunk=self.chunk, routers=self.routers or None
        )
        aux = self.routers.aux_loss() if self.routers else None
        # The trainer's log-probs before this step, and the response tokens. Off-policy masking takes
        # tokens out of the actor's loss (and its denominator), never out of the critic's.
        trainer_logp, valid = logp.detach(), mb.mask
        mask = valid
        if a.is_mask != "off":
            mask = A.keep_mask(
                trainer_logp, mb.behaviour_logp, valid, a.is_mask, a.is_mask_low, a.is_mask_high
            )
            self._add("offpolicy/masked", (valid - mask).sum())
            self._add("offpolicy/tokens", valid.sum())
        if a.old_policy == "behaviour":
            # Bounded below so that a behaviour log-prob far under the trainer's (-inf at worst)
            # gives a large finite ratio, not an infinite one.
            old_logp = torch.maximum(mb.behaviour_logp, trainer_logp - A.LOG_RATIO_BOUND)
        else:
            old_logp = trainer_logp
        kl = None
        if self.kl:
            kl = A.kl_estimate(logp, self.reference_logp(mb), a.kl_estimator)
        if c.critic:
            values = self._critic_forward(self.critic, mb)
            score_kl = kl.detach() if (kl is not None and a.kl_mode == "penalty") else None
            tok_r = L.token_rewards(mb.rewards, score_kl, a.kl_coef, valid)
            adv, ret = L.gae(tok_r, values.detach(), valid, a.gamma, a.lam)
        else:
            adv = mb.advantages[:, None].expand_as(valid) * valid
        if a.distill_coef:
            adv = self._distilled(adv, mb, valid)
        is_w = (
            A.is_weights(trainer_logp, mb.behaviour_logp, mask, a.is_cap, a.is_level)
            if c.importance_sampling
            else None
        )
        loss_fn = A.policy_loss(a.policy_loss)
        pg, stats = loss_fn(logp, old_logp, adv, mask, a.clip_ratio, a.clip_ratio_high, is_w)
        per_token = pg
        if kl is not None and a.kl_mode == "loss":
            per_token = per_token + a.kl_coef * kl
        if a.entropy_coef:
            per_token = per_token - a.entropy_coef * ent
        num, units = L.aggregate(per_token, mask, a.loss_agg, c.max_len)
        units = units if mb.size else 0.0  # a rank's filler batch (nothing left for it) counts nothing
        if aux is not None:
            # Weighted by the micro-batch's units: the step's term is the units-weighted mean.
            if a.router_aux_loss_coef:
                num = num + a.router_aux_loss_coef * aux * units
            self._add("moe/aux_loss", aux.detach() * units)
            for layer, value in self.routers.imbalance().items():
                self._add(f"moe/imbalance/layer{layer}", value * units)
            if mb.routed is not None:  # routing replay: how often the routers disagreed
                differ, replayed = self.routers.replay_differ()
                self._add("replay/differ", differ)
                self._add("replay/tokens", replayed)
        self.actor.set_gradient_accumulation_boundary(last)
        self.actor.backward(num, scale_wrt_gas=False)
        self.units += units
        for key, t in (
            ("policy", pg),
            ("entropy", ent.detach()),
            ("kl", kl.detach() if kl is not None else None),
        ):
            if t is not None:
                self._add(f"loss/{key}", L.aggregate(t.detach(), mask, a.loss_agg, c.max_len)[0])
        for key, v in stats.items():
            self._add(f"pg/{key}", v)
        if is_w is not None:
            self._add("pg/is_weight", (is_w * mask).sum())
        for key, v in L.rollout_mismatch(trainer_logp, mb.behaviour_logp, valid).items():
            self._add(f"rollout/{key}", v)
        if c.critic:
            vl = L.value_loss(values, values.detach(), ret, valid, a.value_clip)
            vnum, _ = L.aggregate(vl, valid, a.loss_agg, c.max_len)
            self.critic.set_gradient_accumulation_boundary(last)
            self.critic.backward(vnum, scale_wrt_gas=False)
            self._add("loss/value", vnum.detach())

    def _distilled(self, adv: torch.Tensor, mb: MicroBatch, valid: torch.Tensor) -> torch.Tensor:
        """On-policy distillation (trainer.loop.distill): each token's advantage gains distill_coef ×
        (log p_teacher − log p_behaviour), added to the task's or (distill_task_reward false) alone."""
        a = self.loss.algorithm
        teacher = mb.teacher_logp if mb.teacher_logp is not None else mb.behaviour_logp
        self._add("distill/reverse_kl", ((mb.behaviour_logp - teacher) * valid).sum())
        self._add("distill/tokens", valid.sum())
        scored = mb.teacher_mask if mb.teacher_mask is not None else torch.zeros_like(valid)
        self._add("distill/unscored", ((1 - scored) * valid).sum())
        return A.distilled_advantages(
            adv, teacher, mb.behaviour_logp, valid, a.distill_coef, task=a.distill_task_reward
        )

    def reference_logp(self, mb: MicroBatch) -> torch.Tensor:
        """The reference policy's log-probs of `mb`: the frozen copy's, or (LoRA) the actor's own base
        weights with the adapters switched off (in eval mode, as the copy runs)."""
        with torch.no_grad():
            if self.ref is not None:
                return self._policy_forward(self.ref, mb, self.loss.sampling, chunk=self.chunk)[0]
            module = self.actor.module
            was_training = module.training
            module.eval()
            try:
                with module.disable_adapter():
                    return self._policy_forward(module, mb, self.loss.sampling, chunk=self.chunk)[0]
            finally:
                module.train(was_training)

    def step(self) -> dict[str, float]:
        """Divide the accumulated gradients by the iteration's units, step, and return the stats."""
        out = self.finish_gradients()
        # Without ZeRO, DeepSpeed leaves the norm unset (its clipping does not report it): taken here,
        # from the whole gradient, before clipping, as DeepSpeed's ZeRO optimizers report theirs.
        own = self._grad_norm() if self.opt.trainer.zero_stage == 0 else None
        for engine in filter(None, (self.actor, self.critic)):
            engine.step()
        norm = self.actor.get_global_grad_norm()
        norm = own if norm is None else norm
        out["grad_norm"] = float(norm) if norm is not None else float("nan")
        self._begin()
        return out

    def _grad_norm(self) -> float:
        if self.tp is not None:  # shards: the TP group's together (a collective)
            return self.tp.grad_norm(list(self.actor.module.parameters()))
        grads = [p.grad for p in self.actor.module.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def finish_gradients(self) -> dict[str, float]:
        """After the last micro-batch: gradients become those of the whole batch's mean loss."""
        from deepspeed.utils import safe_update_full_grad_vectorized

        totals = torch.tensor([self.units, *self.sums.values()], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(totals)
        # The ranks of a sequence- or tensor-parallel group all counted their group's micro-batch.
        totals /= self.shared_by
        units = max(float(totals[0]), 1e-12)
        sums = dict(zip(self.sums, (float(x) for x in totals[1:]), strict=True))
        # DeepSpeed averaged over the data-parallel ranks (with sequence parallelism: what its ZeRO
        # stage divides by; with tensor parallelism: the groups); the loss is a sum over all of them.
        if self.sp is not None:
            averaged = self.sp.averaged_over(self.opt.trainer.zero_stage)
        elif self.tp is not None:
            averaged = self.tp.dp_world
        else:
            averaged = self.world
        factor = averaged / units
        for engine in filter(None, (self.actor, self.critic)):
            params = [p for p in engine.module.parameters() if p.requires_grad]
            safe_update_full_grad_vectorized(params, lambda g, _p: g * factor)
        tokens = max(sums.get("pg/tokens", 0.0), 1.0)
        out = {
            f"loss/{k}": sums[f"loss/{k}"] / units
            for k in ("policy", "kl", "entropy", "value")
            if f"loss/{k}" in sums
        }
        out["clip_frac"] = sums.get("pg/clip_frac", 0.0) / tokens
        out["approx_kl"] = sums.get("pg/approx_kl", 0.0) / tokens
        if "pg/is_weight" in sums:
            out["is_weight/mean"] = sums["pg/is_weight"] / tokens
        if "distill/tokens" in sums:  # the policy's reverse KL from the teacher, per sampled token
            out["distill/reverse_kl"] = sums["distill/reverse_kl"] / max(sums["distill/tokens"], 1.0)
            out["distill/unscored_tokens"] = sums["distill/unscored"]
        if "replay/tokens" in sums:  # the replayed token-layers whose router would have chosen others
            out["moe/replay_differ"] = sums["replay/differ"] / max(sums["replay/tokens"], 1.0)
            out["moe/replay_tokens"] = sums["replay/tokens"]
        for key in sums:  # MoE: the load-balancing loss and each layer's load imbalance (trainer.role.moe)
            if key.startswith("moe/"):
                out[key] = sums[key] / units
        if "offpolicy/tokens" in sums:  # is_mask: the share of response tokens taken out of the loss
            out["offpolicy/masked_frac"] = sums["offpolicy/masked"] / max(sums["offpolicy/tokens"], 1.0)
        # How far the generators' log-probs are from the trainer's for the same tokens, before this
        # step's update (sync modes: the same weights, so only the engines differ; async: plus one step).
        for key in ("logp_abs_diff", "kl"):
            if f"rollout/{key}" in sums:
                out[f"rollout/{key}"] = sums[f"rollout/{key}"] / tokens
        return out

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The policy's full accumulated gradient by name, of the trained parameters (with LoRA: the
        adapters'; collective under ZeRO: every rank calls it). Not under tensor parallelism, whose
        parameters are shards."""
        from deepspeed.utils import safe_get_full_grad

        if self.tp is not None:
            raise StreamRLError("full gradients are not gathered from tensor-parallel shards")

        return {
            n: safe_get_full_grad(p).detach().clone()
            for n, p in self.actor.module.named_parameters()
            if p.requires_grad
        }

    def full_state(self) -> dict[str, torch.Tensor]:
        """The policy's weights as the generators get them (ZeRO-3: gathered; every rank must call
        it): every weight by HF name. With LoRA, model.lora.sync says which: `merged`, the merged
        weights, base + (alpha / rank) · B·A, under the base model's names, so the generators load
        them as any other version (trainer.role.lora.merged_state); `adapter`, the adapters alone under
        PEFT's saved names (trainer.role.lora.adapter_state), served by vLLM's LoRA support. Tensor
        parallelism: every layer's shards gathered to its whole weight, on rank 0 (the others get {})."""
        module = self.actor.module
        if self.tp is not None:  # the layers' shards gathered (with ZeRO-3: its partitions too); rank 0's
            return self.tp.gathered(self.actor)
        if self.lora is not None and self.lora.sync == "adapter":
            if self.opt.trainer.zero_stage == 3:  # gathered: the adapters only, not the frozen base
                import deepspeed

                adapters = [p for n, p in module.named_parameters() if lora_.is_adapter(n)]
                with deepspeed.zero.GatheredParameters(adapters):
                    return lora_.adapter_state(module, clone=True)
            return lora_.adapter_state(module)
        if self.opt.trainer.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                if self.lora is not None:
                    return lora_.merged_state(module, clone=True)
                return {n: p.detach().clone() for n, p in module.named_parameters()}
        if self.lora is not None:
            return lora_.merged_state(module)
        return {n: p.detach() for n, p in module.named_parameters()}
