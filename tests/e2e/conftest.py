"""One real vLLM engine for the modules that can share it (same tiny model, same limits): each
engine start costs the suite tens of seconds on two cores. The modules that need their own (other
weights, LoRA slots, other limits) keep module fixtures."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from streamrl_cli.generator.engine import make_engine
from streamrl_cli.models.tiny import TinySpec, build_tiny_model


@pytest.fixture(scope="session")
def engine_loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def tied_model_dir(tmp_path_factory) -> Path:
    """The tiny model with a tied LM head (the stale-head cases of weight loading need one)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("models") / "tiny-tied", TinySpec(tie_word_embeddings=True)
    )


@pytest.fixture(scope="session")
def shared_engine(engine_loop, tied_model_dir):
    """Started once for the session's worker; a module that uses it leaves it serving (not paused,
    no request in flight), whatever weights it loaded."""
    eng = make_engine("vllm", model=str(tied_model_dir), max_model_len=512, max_num_seqs=8)
    engine_loop.run_until_complete(eng.start())
    yield eng
    engine_loop.run_until_complete(eng.close())
