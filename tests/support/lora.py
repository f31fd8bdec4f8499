"""What a run's LoRA adapter version and its whole model weigh, from the run's own role spec."""

from __future__ import annotations

from pathlib import Path


def adapter_and_model_bytes(run_dir: Path) -> tuple[int, int]:
    """(bytes of one adapter version, bytes of the whole model), from the model and LoRA settings
    of the run's generator role spec."""
    import torch
    from transformers import AutoModelForCausalLM

    from streamrl_cli.roles.spec import load_spec
    from streamrl_cli.trainer.role import lora as lora_

    spec_file = sorted(run_dir.glob("roles/*generator*.yaml"))[0]
    spec = load_spec(spec_file)
    model = AutoModelForCausalLM.from_pretrained(Path(spec.model.path).expanduser(), dtype=torch.float32)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    adapters = lora_.adapter_state(lora_.apply(model, spec.model.lora))
    return sum(t.numel() * t.element_size() for t in adapters.values()), whole
