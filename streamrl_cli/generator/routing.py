"""Routed-experts capture inside a vLLM worker: which experts each token went to (routing replay, #44).

Runs in the worker process (`worker_ext.WeightSyncExtension.streamrl_enable_routed_experts` binds
it). vLLM calls :meth:`RoutedExperts.capture` from every MoE router's forward with that layer's
``topk_ids`` (``[rows, top_k]``, one row per token the step computed, maybe followed by padding
rows); the worker's wrapped ``execute_model`` says where each step starts and ends, and which rows
belong to which request: the step's requests in ``input_batch.req_ids`` order, each with
``num_scheduled_tokens[req_id]`` consecutive rows, the first at position
``input_batch.num_computed_tokens_cpu[index]`` (:func:`step_rows`). Rows past those are padding
and are dropped.

What is kept, per engine request: an array ``[positions, layers, top_k]`` of expert ids (uint8;
uint16 for models with more than 255 experts), position ``p`` being the token at ``p`` in
prompt + output, layer ``l`` the ``l``-th MoE layer (``layers`` says which decoder layer each one
is), and each row the router's top-k choice in its own order (the highest weight first for
vLLM's default top-k; compare sets, not order). It grows as steps arrive; a position computed
again (a preempted request recomputed) is overwritten.

What it cannot know, marked ``NOT_COMPUTED`` (255, or 65535 for uint16): a position this engine
did not compute: a prompt prefix served from the prefix cache (its routing was computed for
another request, maybe on other weights), and a step whose router output had fewer rows than
the step's tokens (sequence-parallel sharding; never on a single worker). The array ends at the
last token whose forward ran: the last sampled token is never fed back, so its position is not
there (its routing cannot change any log-prob of the sample: attention is causal). With
speculative decoding a rejected draft's routing may stay at positions past the final length.

Memory is bounded: an entry is dropped when fetched (:meth:`RoutedExperts.fetch`), and once its
request is finished or aborted (``scheduler_output.finished_req_ids``) it is kept at most
``keep_finished_s`` seconds and among at most ``max_finished`` such entries (the oldest go first).
What is held at once is at most the running requests' arrays (``max_num_seqs`` ×
``max_model_len`` × layers × top_k bytes) plus those finished ones.

On the wire (:func:`encode` / :func:`decode`): the array's bytes, C order, with its shape, dtype
and layer list; ``top_k`` bytes per token per MoE layer.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from streamrl_cli.transport.wire import UNROUTED

NOT_COMPUTED = UNROUTED  # uint8's marker (the wire's); a uint16 array uses 65535 (`np.iinfo(dtype).max`)

# vLLM's engine-core request ids: the caller's id, `-` and 8 random characters
# (vllm/v1/engine/input_processor.py, assign_request_id); a parallel-sampling child (n > 1) is
# "<index>_<caller's id>" before that suffix (vllm/v1/engine/parallel_sampling.py, get_child_info).
_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
_CHILD = re.compile(r"^(\d+)_(.*)$", re.DOTALL)

Rows = list[tuple[str, int, int]]  # (engine request id, first position, number of rows), in row order


def step_rows(
    req_ids: Sequence[str | None], num_scheduled_tokens: Mapping[str, int], num_computed_tokens: Sequence[int]
) -> Rows:
    """A step's token rows as (request, first position, count), in the order the model runner lays
    them out: its persistent batch's requests in order, each with its scheduled tokens, starting at
    the tokens it had computed before this step (gpu_model_runner.py `_prepare_inputs`)."""
    rows: Rows = []
    for index, req_id in enumerate(req_ids):
        if req_id is None:  # an empty slot (only while the batch is being updated)
            continue
        count = int(num_scheduled_tokens.get(req_id, 0))
        if count > 0:
            rows.append((req_id, int(num_computed_tokens[index]), count))
    return rows


def caller_id(engine_id: str) -> tuple[str, str | None, int]:
    """An engine request id as (its external id, the caller's id if it is a child of n > 1, the
    child's index): ``"p#3-0a1b2c3d"`` -> ``("p#3", None, 0)``;
    ``"1_p#3-0a1b2c3d"`` -> ``("1_p#3", "p#3", 1)``."""
    external = _SUFFIX.sub("", engine_id)
    child = _CHILD.match(external)
    if child is None:
        return external, None, 0
    return external, child.group(2), int(child.group(1))


def encode(array: np.ndarray, layers: Sequence[int], index: int = 0) -> dict[str, Any]:
    """One request's routing for the wire: its bytes with shape, dtype and MoE layer ids."""
    return {
        "index": int(index),  # which completion of the caller's request (n > 1)
        "shape": [int(d) for d in array.shape],
        "dtype": str(array.dtype),
        "layers": [int(x) for x in layers],
        "data": np.ascontiguousarray(array).tobytes(),
    }


def decode(entry: Mapping[str, Any]) -> np.ndarray:
    """The array :func:`encode` sent (read-only when it comes from bytes)."""
    return np.frombuffer(entry["data"], dtype=np.dtype(entry["dtype"])).reshape(entry["shape"])


class _Entry:
    __slots__ = ("array", "finished_at", "length")

    def __init__(self, array: np.ndarray) -> None:
        self.array, self.length, self.finished_at = array, 0, None


class RoutedExperts:
    """Per-request routed experts of the steps a worker runs (see the module's docstring).

    `layer_ids`: the decoder-layer index of each MoE layer (as vLLM's routers report it); the
    array's layer axis follows this order. Not thread-safe: vLLM's worker runs steps and RPCs on
    one thread."""

    def __init__(
        self,
        layer_ids: Iterable[int],
        top_k: int,
        num_experts: int,
        *,
        keep_finished_s: float = 600.0,
        max_finished: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.layers = sorted(set(int(x) for x in layer_ids))
        if not self.layers:
            raise ValueError("no MoE layers to capture")
        self._slot = {layer: i for i, layer in enumerate(self.layers)}
        self.top_k = int(top_k)
        self.dtype = np.dtype(np.uint8 if num_experts <= 255 else np.uint16)
        self.missing = int(np.iinfo(self.dtype).max)
        self.keep_finished_s, self.max_finished, self._clock = keep_finished_s, max_finished, clock
        self._entries: dict[str, _Entry] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()  # finished, not fetched: oldest first
        self._rows: Callable[[], Rows] | Rows | None = None  # the current step's (lazily read)
        self._step: list[Any] = []  # per layer slot: that layer's top-k ids this step
        self.short_steps = 0  # steps whose router output had fewer rows than tokens (left unknown)

    # -- a step ----------------------------------------------------------------------------
    def begin_step(self, rows: Callable[[], Rows] | Rows, finished: Iterable[str] = ()) -> None:
        """A step starts: `rows` (or a function giving them, called at the first capture: the runner
        updates its batch inside `execute_model`) maps its rows; `finished` are the requests that
        ended (finished or aborted) since the last step."""
        self.finished(finished)
        self._rows, self._step = rows, [None] * len(self.layers)

    def capture(self, layer_id: int, topk_ids: Any) -> None:
        """The routers' hook: this step's top-k expert ids of MoE layer `layer_id`."""
        slot = self._slot.get(int(layer_id))
        if slot is None or self._rows is None:  # not a step we run (a warm-up, a dummy run)
            return
        if callable(self._rows):  # read during the forward, when the runner's batch is this step's
            self._rows = self._rows()
        # A copy in the narrow dtype, still on the device: one transfer per step, in end_step.
        self._step[slot] = topk_ids.to(_torch_dtype(self.dtype))

    def end_step(self) -> None:
        """The step's forward is done: write its rows into each request's array."""
        rows, step = self._rows, self._step
        self._rows, self._step = None, []
        if rows is None or callable(rows) or all(t is None for t in step):
            return  # (rows still a function: no router ran)
        total = sum(count for _, _, count in rows)
        if any(t is not None and t.shape[0] < total for t in step):
            self.short_steps += 1
            return
        out = np.full((total, len(self.layers), self.top_k), self.missing, dtype=self.dtype)
        for slot, ids in enumerate(step):
            if ids is not None:
                out[:, slot, :] = ids[:total].cpu().numpy()  # padding rows (past `total`) dropped
        at = 0
        for req_id, start, count in rows:
            self._write(req_id, start, out[at : at + count])
            at += count

    def cancel_step(self) -> None:
        """The step failed: nothing of it is kept."""
        self._rows, self._step = None, []

    def _write(self, req_id: str, start: int, rows: np.ndarray) -> None:
        entry = self._entries.get(req_id)
        end = start + len(rows)
        if entry is None:
            entry = self._entries[req_id] = _Entry(self._blank(max(end, 16)))
        elif end > len(entry.array):  # grow by doubling: decode appends a row a step
            grown = self._blank(max(end, 2 * len(entry.array)))
            grown[: entry.length] = entry.array[: entry.length]
            entry.array = grown
        entry.array[start:end] = rows
        entry.length = max(entry.length, end)

    def _blank(self, positions: int) -> np.ndarray:
        return np.full((positions, len(self.layers), self.top_k), self.missing, dtype=self.dtype)

    # -- lifetime --------------------------------------------------------------------------
    def finished(self, req_ids: Iterable[str]) -> None:
        """These requests ended: their entries wait a bounded time to be fetched."""
        now = self._clock()
        for req_id in req_ids:
            entry = self._entries.get(req_id)
            if entry is not None and entry.finished_at is None:
                entry.finished_at = now
                self._finished[req_id] = None
        self.prune()

    def prune(self) -> None:
        """Drop finished entries past `keep_finished_s`, and the oldest beyond `max_finished`."""
        now = self._clock()
        while self._finished:
            req_id = next(iter(self._finished))
            entry = self._entries.get(req_id)
            if entry is not None and len(self._finished) <= self.max_finished:
                if now - entry.finished_at <= self.keep_finished_s:
                    break
            del self._finished[req_id]
            self._entries.pop(req_id, None)

    def fetch(self, caller_ids: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
        """Pop the routing of the callers' requests: caller id -> one encoded entry per completion
        this engine ran (`index`: the completion's, for n > 1), sorted by index. Ids with nothing
        captured (unknown, already fetched, dropped) are absent. An engine id that is both a
        caller's own (n = 1) and another caller's child is taken as the caller's own."""
        wanted = set(caller_ids)
        found: dict[str, list[dict[str, Any]]] = {}
        for engine_id in list(self._entries):
            external, parent, index = caller_id(engine_id)
            if external in wanted:
                owner, index = external, 0
            elif parent is not None and parent in wanted:
                owner = parent
            else:
                continue
            entry = self._entries.pop(engine_id)
            self._finished.pop(engine_id, None)
            found.setdefault(owner, []).append(encode(entry.array[: entry.length], self.layers, index))
        for entries in found.values():
            entries.sort(key=lambda e: e["index"])
        self.prune()
        return found

    def __len__(self) -> int:
        return len(self._entries)


def _torch_dtype(dtype: np.dtype) -> Any:
    import torch

    return torch.uint8 if dtype == np.uint8 else torch.int32  # (torch has no uint16 .numpy() before 2.3)
