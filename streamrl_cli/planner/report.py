"""What `streamrl tune-split` prints and writes: a rich table, a JSON document, overrides.

Kept apart from the search so that the numbers (planner.search) and their presentation change
independently, and so that tests read the JSON document rather than parse a table.
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from streamrl_cli.planner.problem import Tuned
from streamrl_cli.planner.search import Option
from streamrl_cli.planner.training import (
    ZERO_STAGES,
    TrainPlan,
    activation_bytes,
    logits_bytes,
    memory_parts,
)
from streamrl_cli.planner.workload import Workload


def trainer_doc(wl: Workload) -> dict:
    """What the trainer holds and sends, as the planner costs it (planner.training)."""
    m = wl.model
    if not wl.reference:
        reference = "none (no KL term)"
    else:
        reference = "the actor's base, adapters off (no copy)" if wl.lora else "a frozen copy"
    return {
        "lora": {
            "rank": wl.lora_rank,
            "target_modules": list(wl.lora_targets),
            "trainable_params": wl.adapter_params,
            "trainable_fraction": round(wl.adapter_params / m.params, 6),
        }
        if wl.lora
        else None,
        "critic": wl.critic,
        "reference": reference,
        "weight_sync_bytes": round(wl.version_bytes),  # inside a site and across (Workload.version_bytes)
        "weight_sync": _sync_doc(wl),
        "moe": moe_doc(wl),
    }


def moe_doc(wl: Workload) -> dict | None:
    """A mixture of experts as the planner counts it (None for a dense model)."""
    m = wl.model
    if not m.moe:
        return None
    return {
        "experts": m.experts,
        "experts_per_token": m.experts_per_token,
        "expert_intermediate": m.expert_intermediate,
        "shared_intermediate": m.shared_intermediate,
        "moe_layers": m.moe_layers,
        "params_b": round(m.params / 1e9, 3),
        "active_params_b": round(m.active_params / 1e9, 3),
        "expert_params_b": round(m.expert_params / 1e9, 3),
    }


def parallel_note(wl: Workload, t: TrainPlan) -> str:
    """The recommended trainer's tensor and expert parallelism and the model's experts in words, for
    the table's caption ("" for a dense model's trainer without TP or EP)."""
    m, said = wl.model, []
    if m.moe:
        said.append(
            f"MoE: {m.params / 1e9:.3g}B parameters, {m.active_params / 1e9:.3g}B active per token "
            f"({m.experts} experts, {m.experts_per_token} per token): compute counts the active ones, "
            "memory the total; a decode step reads the distinct experts its batch is routed to"
        )
    if t.tp > 1:
        said.append(
            f"TP{t.tp}: every layer split over {t.tp} GPUs of a node (DeepSpeed AutoTP; ZeRO-{t.zero} "
            f"over the {t.dp} data-parallel ranks), its norms, residual stream and checkpointed inputs "
            "whole on each, 2 all-reduces per layer in each forward, recomputation and backward; "
            f"roles.trainer.tensor_parallel={t.tp}"
        )
    if t.ep > 1:
        said.append(
            f"EP{t.ep} assumes the routed experts split over groups of {t.ep} data-parallel ranks "
            f"({m.experts // t.ep} experts each), each token's hidden state sent to its experts and back "
            "by all-to-all (2 per MoE layer in each forward, recomputation and backward), ZeRO "
            f"partitioning the experts over the {t.dp * t.sp // t.ep} ranks holding the same ones: the "
            "trainer does not run expert parallelism (no recipe key), so --write refuses this layout"
        )
    return ("Layout: " + "; ".join(said) + ".") if said else ""


def _sync_doc(wl: Workload) -> str:
    if not wl.lora:
        return "whole model"
    if wl.lora_sync == "adapter":
        return "the adapters alone (model.lora.sync adapter), inside a site and across sites"
    return "merged weights (base + adapters), whole model"


def lora_note(wl: Workload) -> str:
    """One line on LoRA for the table's caption ("" without it)."""
    if not wl.lora:
        return ""
    m = wl.model
    if wl.lora_sync == "adapter":
        sends = (
            f"each weight version sends the adapters alone, inside a site and across "
            f"({wl.version_bytes / 1e6:.3g} MB; the merged model: {m.weight_bytes / 1e9:.3g} GB)"
        )
    else:
        sends = f"each weight version still sends the merged model ({m.weight_bytes / 1e9:.3g} GB)"
    return (
        f"LoRA r{wl.lora_rank} on {', '.join(wl.lora_targets)}: {wl.adapter_params / 1e6:.3g}M "
        f"trainable of {m.params / 1e9:.3g}B ({wl.adapter_params / m.params:.2%}); "
        f"{'no reference copy; ' if wl.reference else ''}{sends}. Memory per GPU: LoRA / full "
        "fine-tune, same layout."
    )


def long_context(wl: Workload, t: TrainPlan) -> dict:
    """How a training plan holds one micro-batch (planner.training): its tokens, their split over the
    SP ranks, the logits and activations as planned and as they would be otherwise, and what the
    plan changes in the recipe's roles.trainer keys."""
    tokens = wl.micro_tokens
    local = tokens / (t.tp * t.sp)
    parts = dict(t.memory_parts_gb)
    doc: dict = {
        "micro_batch_tokens": tokens,
        "tokens_per_gpu": round(local),
        "sequence_parallel": t.sp,
        "activation_checkpointing": t.checkpointing,
        "logits_chunk": wl.logits_chunk if t.logits_chunked else 0,
        "vocabulary": wl.model.vocab,
        "logits_gb": round(parts.get("logits", 0.0), 2),
        # Whole on each AutoTP rank (its LM head gathers the logits).
        "logits_gb_unchunked": round(logits_bytes(wl, tokens / t.sp, False) / 1e9, 2),
        "activations_gb": round(parts.get("activations", 0.0), 2),
        "activations_gb_other": round(
            activation_bytes(wl, tokens / t.sp, not t.checkpointing, t.tp) / 1e9, 2
        ),
        "proposes": {},
    }
    if t.tp != wl.tensor_parallel:
        doc["proposes"]["roles.trainer.tensor_parallel"] = t.tp
    if t.sp != wl.sequence_parallel:
        doc["proposes"]["roles.trainer.sequence_parallel"] = t.sp
    if t.checkpointing != wl.activation_checkpointing:
        doc["proposes"]["roles.trainer.activation_checkpointing"] = t.checkpointing
    if t.sp > 1 and t.tp == t.pp == 1:
        # The least memory any layout without SP needs on the same GPUs (ZeRO stage, offload,
        # checkpointing free): why SP was needed, when it is more than the GPU holds.
        doc["without_sp_gb"] = round(
            min(
                sum(memory_parts(wl, 1, 1, t.gpus, z, off, 1, ckpt).values())
                for z in ZERO_STAGES
                for off in (False, True)
                for ckpt in (False, True)
            )
            / 1e9,
            1,
        )
    return doc


def long_context_note(wl: Workload, t: TrainPlan) -> str:
    """The recommended trainer's micro-batch in words, for the table's caption ("" where it uses none
    of the long-context keys and the recipe set none)."""
    d = long_context(wl, t)
    if t.sp == 1 and not t.checkpointing and not d["proposes"]:
        return ""
    said = [f"micro-batch of {_tokens(d['micro_batch_tokens'])} tokens"]
    if t.sp > 1:
        said.append(f"SP{t.sp} splits it to {_tokens(d['tokens_per_gpu'])} per GPU")
        if "without_sp_gb" in d and d["without_sp_gb"] > t.usable_gb:
            said.append(
                f"without SP no layout of these {t.gpus} GPUs fits (at least {d['without_sp_gb']:.0f} GB "
                f"of {t.usable_gb:.0f} usable)"
            )
    if d["logits_chunk"]:
        said.append(
            f"logits chunked by {d['logits_chunk']}: {_gb(d['logits_gb'])} GB instead of "
            f"{_gb(d['logits_gb_unchunked'])} GB"
        )
    elif wl.model.vocab:
        said.append(f"logits unchunked (roles.trainer.logits_chunk 0): {_gb(d['logits_gb'])} GB")
    if t.checkpointing:
        said.append(
            f"activation checkpointing on: activations {_gb(d['activations_gb'])} GB instead of "
            f"{_gb(d['activations_gb_other'])} GB, one more forward per token"
        )
    else:
        said.append(
            f"activation checkpointing off: activations {_gb(d['activations_gb'])} GB "
            f"(on: {_gb(d['activations_gb_other'])} GB)"
        )
    text = "Trainer: " + "; ".join(said) + "."
    if d["proposes"]:
        recipe = {
            "roles.trainer.tensor_parallel": wl.tensor_parallel,
            "roles.trainer.sequence_parallel": wl.sequence_parallel,
            "roles.trainer.activation_checkpointing": wl.activation_checkpointing,
        }
        keys = ", ".join(
            f"{k}={str(v).lower()} (the recipe: {str(recipe[k]).lower()})" for k, v in d["proposes"].items()
        )
        text += f"\nProposes {keys}"
        text += "."
    return text


def option_doc(o: Option, recommended: bool = False) -> dict:
    e, g, t = o.estimate, o.gen, o.train
    return {
        "label": o.label,
        "recommended": recommended,
        "mode": e.mode,
        "generation": {
            "gpus": g.gpus,
            "hardware": g.hardware,
            "pool": o.gen_pool.name,
            "site": o.gen_pool.site,
            "cluster": o.gen_pool.cluster,
            "partition": o.gen_pool.partition,
            "tensor_parallel": g.tp,
            "instances": g.instances,
            "max_batch": g.max_batch,
            "samples_per_instance": g.per_instance,
            "ptl_tail_ms": round(g.ptl_tail_s * 1e3, 2),
        },
        "training": {
            "gpus": t.gpus,
            "hardware": t.hardware,
            "pool": o.train_pool.name,
            "site": o.train_pool.site,
            "cluster": o.train_pool.cluster,
            "partition": o.train_pool.partition,
            "tensor_parallel": t.tp,
            "pipeline_parallel": t.pp,
            "data_parallel": t.dp,
            "zero_stage": t.zero,
            "cpu_offload": t.offload,
            "sequence_parallel": t.sp,
            "expert_parallel": t.ep,
            "activation_checkpointing": t.checkpointing,
            "logits_chunked": t.logits_chunked,
            "memory_gb_per_gpu": round(t.memory_gb, 1),
            "memory_gb_by_part": {k: round(v, 2) for k, v in t.memory_parts_gb},
            # The same layout training every weight (LoRA off): what LoRA saves per GPU.
            "memory_gb_per_gpu_full_finetune": round(t.full_memory_gb, 1),
        },
        "iteration_s": round(e.iteration_s, 3),
        "generation_s": round(e.generation_s, 3),
        "training_s": round(e.training_s, 3),
        "optimizer_s": round(e.optimizer_s, 3),
        "weight_sync_s": round(e.weight_sync_s, 3),
        "samples_per_s": round(e.samples_per_s, 4),
        "cost_per_hour": round(o.cost_per_hour, 3),
        "samples_per_cost": round(o.samples_per_cost, 3),
        "bubble_fraction": round(e.bubble, 4),
        "released_gpus": {name: n for name, n in o.released if n},
    }


def document(tuned: Tuned, top: int = 10) -> dict:
    """The --json document: the recommendation, the ranked options, and what was planned."""
    wl, res = tuned.workload, tuned.result
    return {
        "recommended": option_doc(res.recommended, True),
        "options": [option_doc(o, i == 0) for i, o in enumerate(res.options[:top])],
        "objective": res.objective,
        "cost_model": tuned.cost_model,
        "profiles": list(tuned.profiles),
        "workload": {
            "model": wl.model.name,
            "params_b": round(wl.model.params / 1e9, 3),
            "active_params_b": round(wl.model.active_params / 1e9, 3),
            "algorithm": wl.algorithm,
            "mode": wl.mode,
            "samples_per_iteration": wl.samples,
            "prompt_len_mean": wl.prompt_len,
            "output_len_mean": round(wl.lengths.mean, 1),
            "output_len_max": wl.lengths.max_len,
        },
        "trainer": trainer_doc(wl),
        "long_context": long_context(wl, res.recommended.train),
        "pools": [{"name": p.name, "hardware": p.kind, "gpus": p.gpus, "site": p.site} for p in tuned.pools],
    }


def _num(x: float) -> str:
    """Seconds and rates from tiny CPU runs to 72B clusters: 3 significant digits below 100."""
    return f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"


def _gb(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def _tokens(n: float) -> str:
    return f"{n / 1e3:.1f}K" if n >= 1000 else f"{n:.0f}"


def table(tuned: Tuned, top: int = 10) -> Table:
    wl, res = tuned.workload, tuned.result
    m = wl.model
    title = (
        f"tune-split: {m.name} {wl.training_label}, {wl.mode}, {wl.samples} samples/iteration, "
        f"output mean {_tokens(wl.lengths.mean)} max {_tokens(wl.lengths.max_len)} — "
        f"{tuned.cost_model} cost model"
    )
    caption = "★ recommended (by " + res.objective + ")"
    if wl.lora:
        caption += "\n" + lora_note(wl)
    for note in (parallel_note(wl, res.recommended.train), long_context_note(wl, res.recommended.train)):
        if note:
            caption += "\n" + note
    tab = Table(title=title, title_justify="left", caption=caption)
    for col, right in (
        ("", False),
        ("option", False),
        ("generation", False),
        ("training", False),
        ("gen s", True),
        ("train s", True),
        ("iter s", True),
        ("samples/s", True),
        ("samples/cost", True),
        ("bubble", True),
        ("released", False),
    ):
        tab.add_column(col, justify="right" if right else "left", no_wrap=col in ("gen s", "iter s"))
    for i, o in enumerate(res.options[:top]):
        e, g, t = o.estimate, o.gen, o.train
        released = ", ".join(f"{n} {name}" for name, n in o.released if n) or "-"
        memory = f"{_gb(t.memory_gb)} GB/GPU" + (f" (full FT {_gb(t.full_memory_gb)})" if wl.lora else "")
        tab.add_row(
            "★" if i == 0 else "",
            o.label,
            f"{g.gpus}× {g.hardware} @{o.gen_pool.site}: {g.instances} inst × TP{g.tp}, batch ≤{g.max_batch}",
            f"{t.gpus}× {t.hardware} @{o.train_pool.site}: {t.layout}, {memory}",
            _num(e.generation_s),
            _num(e.training_s + e.optimizer_s),
            _num(e.iteration_s),
            _num(e.samples_per_s),
            _num(o.samples_per_cost),
            f"{e.bubble:.0%}",
            released,
            style="bold" if i == 0 else None,
        )
    return tab


def write(path: Path, lines: list[str], recipe_yaml: str | None, header: str) -> Path:
    """Overrides as `key=value` lines, or (for .yaml/.yml) a whole recipe `streamrl run` takes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    if path.suffix in (".yaml", ".yml"):
        assert recipe_yaml is not None
        path.write_text(comment + recipe_yaml)
    else:
        path.write_text(comment + "\n".join(lines) + "\n")
    return path
