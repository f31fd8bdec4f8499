"""A checkpoint out as a Hugging Face model directory: what `streamrl export` and train.export_final write.

Checkpoints are DeepSpeed's own format (ZeRO shards of every rank, optimizer states), which only a
DeepSpeed engine of the same shape can load. Users want the model: a directory that
``AutoModelForCausalLM.from_pretrained`` and vLLM load, so::

    run_dir/checkpoints/iter-N/actor/ckpt/   ZeRO 1-3: fp32 master weights gathered from every rank's
         │                                   shards (DeepSpeed's zero_to_fp32); stage 0: the module
         ▼                                   states as saved
    state dict (HF names) ──► base model's config (model.path) ──► weights cast to model.dtype
         ──► OUT/{config.json, generation_config.json, model.safetensors, tokenizer files}

A tensor-parallel run's checkpoint (roles.trainer.tensor_parallel > 1) holds each TP rank's shards,
which zero_to_fp32 does not join; the trainer writes the actor's weights gathered whole beside them
(``actor/whole_model.safetensors``, in the weights' training dtype), and the export reads those.

A LoRA run's checkpoint (``actor/adapter_config.json``) holds the adapters only: the base weights
are the model directory's. Its export loads the base, puts the adapters on it with PEFT and writes
either the merged model (base + alpha/rank · B·A, a plain HF model, the default) or, with
``adapter=True``, PEFT's adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``,
for ``PeftModel.from_pretrained(base, OUT)``), with the tokenizer beside it in both cases.

The directory is written next to its target and renamed into place, so a crash never leaves a
half-written model where a finished one is expected.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from streamrl_cli.errors import StreamRLError


class ExportError(StreamRLError):
    """A checkpoint could not be exported."""


TAG = "ckpt"  # the tag trainer.role.checkpoint saves under


def fp32_state(actor_dir: Path) -> dict[str, Any]:
    """The policy's full weights by HF name from a DeepSpeed checkpoint of any ZeRO stage."""
    import torch

    tag_dir = actor_dir / TAG
    if not tag_dir.is_dir():
        raise ExportError(f"{actor_dir} holds no DeepSpeed checkpoint (no {TAG}/ directory)")
    from streamrl_cli.trainer.role.checkpoint import tp_degree
    from streamrl_cli.trainer.role.tensor_parallel import WHOLE

    if (actor_dir / WHOLE).is_file():  # tensor parallelism: the trainer gathered the shards
        from safetensors.torch import load_file

        return {k: v.float() for k, v in load_file(str(actor_dir / WHOLE)).items()}
    if tp_degree(actor_dir) > 1:
        raise ExportError(
            f"{actor_dir}: a tensor-parallel checkpoint (one file per TP rank) without its gathered "
            f"weights ({WHOLE}): it cannot be joined here"
        )
    if any(tag_dir.glob("*optim_states.pt")) and any(tag_dir.glob("zero_pp_rank_*")):
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(actor_dir), tag=TAG))
    states = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
    if not states:
        raise ExportError(f"{tag_dir}: neither ZeRO shards nor model states (an incomplete checkpoint?)")
    module = torch.load(states[0], map_location="cpu", weights_only=False)["module"]
    return {k: v.float() for k, v in module.items()}


def export_checkpoint(
    checkpoint: Path, base_model: str, out: Path, dtype: str = "float32", *, adapter: bool = False
) -> Path:
    """Write ``checkpoint``'s policy as a HF model directory at ``out`` (config and tokenizer of
    ``base_model``, weights in ``dtype``); ``adapter``: a LoRA run's adapters as PEFT writes them.
    ``out`` must not exist or be empty, unless it is a directory this function wrote before (an
    ``export_final`` of a resumed run replaces its own)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from streamrl_cli.models.tiny import library_output_to_stderr

    out = Path(out).expanduser().resolve()
    if out.exists() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise ExportError(f"{out} exists and is not empty; choose another --out (nothing was written)")
    base = os.path.expanduser(base_model)
    lora = (checkpoint / "actor" / LORA_CONFIG).is_file()
    if adapter and not lora:
        raise ExportError(
            f"{checkpoint} holds whole weights (the run trained without model.lora): there is no "
            "adapter to export; leave out --adapter for the model (nothing was written)"
        )
    model = _lora_model(checkpoint, base) if lora else _whole_model(checkpoint, base)
    if lora and not adapter:
        model = model.merge_and_unload()
    model = model.to(getattr(torch, dtype))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with library_output_to_stderr():
            model.save_pretrained(tmp, safe_serialization=True)
            AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
            try:
                if not adapter:  # an adapter directory is not a model: its base has the generation config
                    GenerationConfig.from_pretrained(base).save_pretrained(tmp)
            except OSError:  # the base has none: save_pretrained wrote the model's default already
                pass
        (tmp / MARKER).write_text(f"{checkpoint}\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


MARKER = "streamrl-export.txt"  # which checkpoint a directory was exported from
LORA_CONFIG = "adapter_config.json"  # trainer.role.lora.CONFIG_FILE: its presence marks a LoRA checkpoint


def _whole_model(checkpoint: Path, base: str) -> Any:
    """The checkpoint's whole weights in the base model's architecture (fp32)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    state = fp32_state(checkpoint / "actor")
    config = AutoConfig.from_pretrained(base)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ExportError(
            f"{checkpoint}: its weights do not fit {base}'s architecture "
            f"(missing: {sorted(set(missing) - tied)[:5]}, unexpected: {sorted(unexpected)[:5]})"
        )
    if tied:
        model.tie_weights()
    return model


def _lora_model(checkpoint: Path, base: str) -> Any:
    """The base model (fp32) with the checkpoint's adapters on it: a PeftModel."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    config = peft.LoraConfig.from_pretrained(str(checkpoint / "actor"))
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config)
    adapters = fp32_state(checkpoint / "actor")
    expected = {n for n, _ in model.named_parameters() if ".lora_" in n}
    missing, unexpected = sorted(expected - set(adapters)), sorted(set(adapters) - expected)
    if missing or unexpected:
        raise ExportError(
            f"{checkpoint}: its adapters do not fit {base} with its adapter_config.json "
            f"(missing: {missing[:5]}, unexpected: {unexpected[:5]})"
        )
    model.load_state_dict(adapters, strict=False)
    return model
