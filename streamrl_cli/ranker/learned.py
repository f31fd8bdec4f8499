"""The learned output-length ranker: a small LM with a regression head, refreshed online in the background.

The paper fine-tunes a small LLM on (prompt, output length) pairs produced by the policy and
refreshes it as the policy's lengths drift. Here:

- the backbone is ``AutoModel`` of any causal LM directory (the policy's own model by default, or
  ``skewness.ranker_model``), its tokenizer from the same place; the head is one linear layer on
  the hidden state of the prompt's last token (the causal model has read the whole prompt there);
- it regresses the standardised ``log(1 + length)``: the log because lengths are long-tailed (a
  squared error on raw tokens would be all about the tail), standardised so one learning rate suits
  both 5-token and 20K-token tasks. Plain MSE, because it also keeps the scores in tokens, which the
  history ranker and the cache mix with observed lengths, and because it ranked as well as the
  alternatives. Measured on the repeat task (tiny model, 12 refreshes of 4 steps, 1000 held-out
  prompts, mean of 3 seeds, recall@20/10/5, Spearman): last token + MSE 0.94/0.90/0.64, 0.97;
  last token + pairwise (RankNet) 0.95/0.88/0.50, 0.98; MSE + pairwise 0.92/0.87/0.61, 0.98; mean
  pooling + MSE 0.79/0.24/0.11, 0.80 (averaging dilutes the one or two digit tokens that matter);
- ``update`` only appends to a bounded replay buffer (recent pairs win as the policy drifts) and
  wakes a background thread. That thread trains its own copy of the model for a few steps, then
  swaps a snapshot in under a lock. ``rank`` takes the current snapshot under the same lock and
  scores without it: it never waits for training, and the RL loop never waits for the ranker.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

from streamrl_cli.ranker.base import Ranker, RankerError
from streamrl_cli.tasks import Prompt

log = logging.getLogger(__name__)

SMALL_MODEL = 10_000_000  # parameters below which the backbone is a toy trained from scratch


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' load report and progress bar silenced, then restored."""
    from transformers.utils import logging as hf_logging

    level, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bar:
            hf_logging.enable_progress_bar()


def _scorer(backbone, pooling: str, seed: int):  # type: ignore[no-untyped-def]
    import torch

    class Scorer(torch.nn.Module):
        """Backbone + linear head on the last (or mean) hidden state: one score per prompt."""

        def __init__(self) -> None:
            super().__init__()
            self.backbone = backbone
            self.head = torch.nn.Linear(backbone.config.hidden_size, 1)

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            h = self.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
            if pooling == "mean":
                m = mask.unsqueeze(-1).to(h.dtype)
                pooled = (h * m).sum(1) / m.sum(1).clamp(min=1)
            else:  # right padding: the last real token is at mask.sum - 1
                pooled = h[torch.arange(h.shape[0], device=h.device), mask.sum(1) - 1]
            return self.head(pooled.float()).squeeze(-1)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Scorer()


class LearnedRanker(Ranker):
    """Scores prompts with a fine-tuned small LM; learns from ``update`` in a background thread.

    ``lr`` None: 1e-3 for a toy backbone (under 10M parameters, e.g. the tiny test model), 2e-5 for
    a real pretrained one; the head always learns at ``head_lr``. ``refresh_every``: ``update``
    calls (iterations) between refreshes, each ``steps_per_update`` steps of ``batch_size`` pairs.
    """

    kind = "learned"

    def __init__(
        self,
        base_model_path: str | Path,
        *,
        device: str = "cpu",
        seed: int = 0,
        max_prompt_tokens: int = 64,
        lr: float | None = None,
        head_lr: float = 3e-3,
        steps_per_update: int = 16,
        batch_size: int = 32,
        buffer_size: int = 4096,
        refresh_every: int = 1,
        pooling: str = "last",
        loss: str = "mse",
        train_threads: int = 1,
    ):
        import torch
        from transformers import AutoModel, AutoTokenizer

        if pooling not in ("last", "mean") or loss not in ("mse", "pairwise", "mse+pairwise"):
            raise ValueError(f"pooling {pooling!r} / loss {loss!r}")
        self.path = Path(base_model_path).expanduser()
        try:
            self._tok = AutoTokenizer.from_pretrained(self.path)
            with _quiet():  # the causal LM's lm_head is "unexpected" in a bare backbone: by design
                backbone = AutoModel.from_pretrained(self.path, dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise RankerError(f"cannot load the ranker's base model from {self.path}: {e}") from e
        self.device = device
        self.max_prompt_tokens = max_prompt_tokens
        self.steps_per_update, self.batch_size = steps_per_update, batch_size
        self.refresh_every, self.loss, self.train_threads = max(1, refresh_every), loss, train_threads
        params = sum(p.numel() for p in backbone.parameters())
        self.lr = lr if lr is not None else (1e-3 if params < SMALL_MODEL else 2e-5)
        self.head_lr = head_lr
        self._pad = (
            self._tok.pad_token_id if self._tok.pad_token_id is not None else self._tok.eos_token_id or 0
        )
        self._rng = random.Random(f"ranker-{seed}")

        # Serving snapshot and its target scale (mean, std of log(1 + length)); replaced, never mutated.
        self._serving = _scorer(backbone, pooling, seed).to(device).eval()
        self._scale = (math.log1p(100.0), 1.0)
        self._train_model = None  # the background's own copy, created on the first refresh
        self._opt = None
        self._buffer: deque[tuple[tuple[int, ...], float]] = deque(maxlen=buffer_size)

        self._cv = threading.Condition()  # guards _serving, _scale, _buffer and the flags below
        self._tok_lock = threading.Lock()
        self._train_lock = threading.Lock()  # one training pass at a time (background or fit)
        self._pending = self._busy = self._closed = False
        self._updates = 0
        self._thread: threading.Thread | None = None
        self.refreshes = 0  # snapshots swapped in so far
        self.last_refresh_s = 0.0
        self.last_loss = float("nan")
        self.last_error: str | None = None

    # --- scoring ------------------------------------------------------------------------------

    def rank(self, prompts: Sequence[Prompt]) -> list[float]:
        import torch

        with self._cv:
            model, (mu, sigma) = self._serving, self._scale
        out: list[float] = []
        ids = self._encode([p.text for p in prompts])
        for start in range(0, len(ids), 256):
            batch, mask = self._pad_batch(ids[start : start + 256])
            with torch.inference_mode():
                z = model(batch, mask)
            out += [math.expm1(min(mu + sigma * float(v), 50.0)) for v in z]
        return out

    def _encode(self, texts: Sequence[str]) -> list[tuple[int, ...]]:
        """Token ids, keeping the prompt's end (where the question is) when it is too long."""
        with self._tok_lock:  # a fast tokenizer must not be entered by two threads at once
            rows = self._tok([t or " " for t in texts], add_special_tokens=False).input_ids
        return [tuple(r[-self.max_prompt_tokens :] or [self._pad]) for r in rows]

    def _pad_batch(self, rows: Sequence[tuple[int, ...]]):  # type: ignore[no-untyped-def]
        import torch

        width = max(len(r) for r in rows)
        ids = torch.tensor([list(r) + [self._pad] * (width - len(r)) for r in rows], device=self.device)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=self.device)
        return ids, mask

    # --- learning -----------------------------------------------------------------------------

    def update(self, prompts: Sequence[Prompt], lengths: Sequence[float]) -> None:
        pairs = self._pairs(prompts, lengths)
        with self._cv:
            if self._closed or not pairs:
                return
            self._buffer.extend(pairs)
            self._updates += 1
            if self._updates % self.refresh_every == 0:
                self._pending = True
                self._cv.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ranker-refresh", daemon=True)
                self._thread.start()

    def fit(self, prompts: Sequence[Prompt], lengths: Sequence[float], epochs: int = 8) -> None:
        """Train on the buffer plus these pairs in this thread (``epochs`` passes over the buffer)."""
        pairs = self._pairs(prompts, lengths)
        with self._cv:
            self._buffer.extend(pairs)
            data = list(self._buffer)
        if not data:
            return
        steps = max(self.steps_per_update, epochs * math.ceil(len(data) / self.batch_size))
        with self._train_lock:
            self._publish(*self._train(data, steps))

    def _pairs(
        self, prompts: Sequence[Prompt], lengths: Sequence[float]
    ) -> list[tuple[tuple[int, ...], float]]:
        if len(prompts) != len(lengths):
            raise ValueError(f"{len(prompts)} prompts but {len(lengths)} lengths")
        ids = self._encode([p.text for p in prompts])
        return [(r, math.log1p(max(0.0, float(n)))) for r, n in zip(ids, lengths, strict=True)]

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._closed or not (self._pending or self._busy), timeout)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=30)

    def _loop(self) -> None:
        import torch

        torch.set_num_threads(self.train_threads)  # per thread (OpenMP): the caller's threads are kept
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending or self._closed)
                if self._closed:
                    return
                self._pending, self._busy = False, True
                data = list(self._buffer)
            try:
                with self._train_lock:
                    self._publish(*self._train(data, self.steps_per_update))
            except Exception as e:  # keep serving the last good snapshot; say why once per failure
                self.last_error = f"{type(e).__name__}: {e}"
                log.warning("length ranker refresh failed: %s", self.last_error, exc_info=True)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _train(self, data: list[tuple[tuple[int, ...], float]], steps: int):  # type: ignore[no-untyped-def]
        import torch

        t0 = time.monotonic()
        if self._train_model is None:
            with self._cv:
                self._train_model = copy.deepcopy(self._serving).train()
            m = self._train_model
            self._opt = torch.optim.AdamW(
                [
                    {"params": m.backbone.parameters(), "lr": self.lr},
                    {"params": m.head.parameters(), "lr": self.head_lr},
                ],
                weight_decay=0.0,
            )
        model, opt = self._train_model, self._opt
        ys = [y for _, y in data]
        mu = sum(ys) / len(ys)
        sigma = max(0.05, math.sqrt(sum((y - mu) ** 2 for y in ys) / len(ys)))
        for _ in range(steps):
            if self._closed:
                break
            batch = self._rng.sample(data, min(self.batch_size, len(data)))
            ids, mask = self._pad_batch([r for r, _ in batch])
            target = torch.tensor([(y - mu) / sigma for _, y in batch], device=self.device)
            loss = self._loss(model(ids, mask), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            self.last_loss = float(loss.detach())
        snapshot = copy.deepcopy(model).eval()
        self.last_refresh_s = time.monotonic() - t0
        return snapshot, (mu, sigma)

    def _loss(self, z, target):  # type: ignore[no-untyped-def]
        import torch

        total = torch.zeros((), device=z.device)
        if "mse" in self.loss:
            total = total + torch.nn.functional.mse_loss(z, target)
        if "pairwise" in self.loss:
            # RankNet: every pair whose targets differ, logistic loss on the score difference.
            diff = z.unsqueeze(1) - z.unsqueeze(0)
            sign = torch.sign(target.unsqueeze(1) - target.unsqueeze(0))
            valid = sign != 0
            if valid.any():
                total = total + torch.nn.functional.softplus(-sign * diff)[valid].mean()
        return total

    def _publish(self, snapshot, scale: tuple[float, float]) -> None:  # type: ignore[no-untyped-def]
        with self._cv:
            self._serving, self._scale = snapshot, scale
            self.refreshes += 1
