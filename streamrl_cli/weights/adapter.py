"""A LoRA weight version (``model.lora.sync: adapter``): the adapters alone, in PEFT's saved format.

With ``sync: adapter`` the trainer sends, for each weight version, every adapted layer's
``lora_A``/``lora_B`` and nothing else; the generators load the base weights once from
``model.path`` and serve each version as a vLLM LoRA adapter over them. Both sides meet here
(the trainer and the generator packages may not import each other).

Names: inside a ``PeftModel`` an adapter's parameters are
``base_model.model.<module>.lora_A.default.weight`` ("default": the adapter's name); PEFT's saved
files, and vLLM's LoRA loader, which parses ``<module>.lora_A.weight``, leave the adapter's name
out. The trainer sends the saved names (:func:`wire_name`), so a version is tensor for tensor what
``PeftModel.save_pretrained`` writes, and :func:`write_adapter` turns it into the directory vLLM
reads.

Why a directory: vLLM 0.32 takes an adapter only from a path (``LoRARequest.lora_path`` is
required; its workers read ``adapter_config.json`` and ``adapter_model.safetensors`` there, and
read them again if their LRU cache evicted the adapter while a request still uses it). So each
generator writes the versions it received under the run directory and removes each one once it
is superseded and no request uses it any more (``generator.vllm_engine``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl_cli.recipe.lora import VLLM_MAX_LORA_RANKS, vllm_max_lora_rank  # noqa: F401 - this module's API

if TYPE_CHECKING:
    import torch

    from streamrl_cli.recipe.schema import LoraConfig

PEFT_ADAPTER = "default"  # PEFT's name of the one adapter (in its parameter names, not in its files)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def is_adapter(name: str) -> bool:
    """Whether a PeftModel parameter name is an adapter's (trained), not the base model's."""
    return ".lora_" in name


def wire_name(name: str) -> str:
    """A PeftModel adapter parameter's name → its name in PEFT's saved adapter (and on the wire)."""
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.{PEFT_ADAPTER}.", f".{part}.")
    return name


def peft_config(lora: LoraConfig, base_model: str = "") -> dict[str, Any]:
    """The adapter's ``adapter_config.json``: what PEFT writes for ``trainer.role.lora.apply``'s adapters
    (the fields vLLM reads: rank, alpha, targets, no bias, no rsLoRA/DoRA)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(lora.rank),
        "lora_alpha": float(lora.alpha),
        "lora_dropout": float(lora.dropout),
        "target_modules": list(lora.target_modules),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
    }


def lora_slots(max_staleness: int) -> int:
    """Adapters one engine serves at once: the versions requests in flight may have started on
    (up to ``algorithm.max_staleness`` + 1 of them) and the one that just arrived, so that a new
    version never waits for the oldest one's requests to finish."""
    return max(0, int(max_staleness)) + 2


def write_adapter(directory: Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> int:
    """`tensors` (wire names) and `config` as a PEFT adapter directory, written beside it and renamed
    into place (a reader never sees half of one); returns the bytes of the tensors."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        save_file(cpu, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2))
        if directory.exists():  # the same version again (a retry): the new copy wins
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sum(t.numel() * t.element_size() for t in cpu.values())
