"""A model directory's vocabulary as one hash: do two models read token ids the same way?

On-policy distillation sends the policy's token ids to a teacher model; the teacher's log-probs
mean something only if its tokenizer maps every id to the same token. The recipe is checked with
this before anything is queued, and each teacher checks again when it starts.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from streamrl_cli.errors import StreamRLError


def vocabulary_fingerprint(model_dir: str | Path) -> str:
    """SHA-256 of the tokenizer's (token, id) pairs, special tokens included."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(Path(model_dir).expanduser()))
    except (OSError, ValueError) as e:
        raise StreamRLError(f"cannot load the tokenizer of {model_dir}: {e}") from None
    pairs = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()
