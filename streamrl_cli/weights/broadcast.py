"""Weights inside one site: a bucketed broadcast over a torch.distributed group.

Why buckets: a model is hundreds to thousands of tensors, and one collective call per tensor
pays a round of latency each; a few calls on large flat buffers run at link speed. Tensors
are packed per dtype into buckets (``plan.plan_buckets``), one broadcast per bucket, while
the next bucket is packed (two buffers in turn). The metadata (names, dtypes, shapes, offsets)
goes once per transfer, right after a fixed-size header, so receivers need to know nothing in
advance. Buffers are broadcast as bytes: any dtype (bf16, bool) travels even where the backend
has no arithmetic for it.

Why our own group and not ``init_process_group``: the trainer already has its default group
(its data-parallel ranks) and vLLM workers have theirs. :func:`init_weight_group` builds a
separate group exactly as ``vllm.distributed.utils.stateless_init_torch_distributed_process_group``
does (rank 0 hosts a TCPStore, keys under the ``tcp://host:port`` prefix): the trainer (rank 0)
and vLLM workers (their extension) join with this module, and a member that joins with vLLM's
helper meets them in the same group. A member's connect to the store has a bound of its own
(:data:`JOIN_CONNECT_TIMEOUT_S`), shorter than the group timeout.
Backend by device: gloo for CPU tensors, NCCL for CUDA tensors; the same code path.

Wire, per transfer (all from rank `src`): header int64[4] = [MAGIC, version, metadata bytes,
buckets], then the msgpack :class:`~streamrl_cli.weights.plan.Plan`, then each bucket.
"""

from __future__ import annotations

import socket
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from streamrl_cli import limits
from streamrl_cli.weights import WeightTransferError
from streamrl_cli.weights.plan import Bucket, Plan, plan_buckets

MAGIC = 0x5354524C57  # "STRLW"
DEFAULT_BUCKET_BYTES = 256 << 20
SOURCE_POLL_S = 1.0  # a receiver checks this often that its source still is
SOURCE_GONE_PROBES = 3  # failed probes in a row before a source counts as gone
# A member's connect to its group's store, bounded apart from the group timeout: a TCPStore client
# retries a refused connect until its timeout, and a member's group timeout is the sync timeout
# (minutes: it covers the slowest member's drain), so a member told to join a group whose source
# dropped it (a failed try, a relay that died) would wait that long. Rank 0 hosts the store before
# it announces the group: a connect to a live source takes milliseconds. torch tries again (with a
# backoff) while under this timeout, each try up to the timeout itself: a store gone for good fails
# the join after about 1.5 to 2.5 times this (measured: 30-34 s for 20 s with the store gone before
# the connect; 71 s for 30 s with the store going during it), not after the sync timeout's 600 s
# (or up to 2.5 times that).
JOIN_CONNECT_TIMEOUT_S = 20.0
# Tensors this large are broadcast in place (no packing copy); a gloo call costs ~0.1 ms, i.e.
# ~0.3 MB of loopback time, so above a few MB the extra calls are cheaper than the copy.
DEFAULT_SOLO_BYTES = 8 << 20
# CPU receive buffers are kept per group and reused by the next transfer: fresh ones would be
# page-faulted and zeroed by the kernel every time (that alone halved throughput on loopback).
# GPU buffers are not kept: the CUDA caching allocator recycles them, and a model-sized idle
# buffer would take memory from the KV cache.
_POOLS: weakref.WeakKeyDictionary[Any, dict[int, torch.Tensor]] = weakref.WeakKeyDictionary()


def process_backend() -> str:
    """The collective backend this process can use: NCCL where it sees a CUDA device, gloo otherwise.

    Decided from what the process has, never from the GPUs a recipe asked for: a job may be given
    "GPUs" on a node whose torch has no CUDA (the test clusters' count-only GPUs, a CPU build of
    torch), and NCCL does not even exist in a CPU build of torch.
    """
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


@dataclass
class WeightGroup:
    """A broadcast group; rank 0 (the trainer, or the relay at a far site) hosts its store."""

    pg: Any  # torch ProcessGroup(-backend) with group-local ranks
    store: Any  # kept alive: on rank 0 it is the store server
    host: str
    port: int
    rank: int
    world_size: int
    backend: str

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        for op in ("shutdown", "abort"):
            fn = getattr(self.pg, op, None)
            if fn is not None:
                try:
                    fn()
                    return
                except RuntimeError:
                    continue


def host_weight_store(host: str, world_size: int, *, timeout_s: float = 300.0) -> Any:
    """Rank 0's store on a free port, listening at once, without waiting for the others.

    For a group announced before it is formed (``weights.layout``): members can connect while
    rank 0 waits for them to be ready. If rank 0 gives up, dropping the store fails the joins of
    members already connected at once; a member that connects only after the drop is refused, and
    its join fails on its connect timeout (:data:`JOIN_CONNECT_TIMEOUT_S`), not its group
    timeout. Pass it to :func:`init_weight_group`.
    """
    try:
        return dist.TCPStore(
            host, 0, world_size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
    except (RuntimeError, ValueError) as e:
        raise WeightTransferError(f"cannot host a weight group store on {host}: {e}") from None


def init_weight_group(
    address: str,
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    store: Any = None,
    connect_timeout_s: float = JOIN_CONNECT_TIMEOUT_S,
) -> WeightGroup:
    """Join (rank > 0) or host (rank 0; port 0 picks a free one) the group at ``host:port``.

    `host` must be the name the others use (the store prefix includes it). Blocks until every
    rank joined or `timeout_s` passed. Publish ``group.address`` through the rendezvous. Rank 0
    may pass the store it already hosts (:func:`host_weight_store`). A member connects to rank 0's
    store on a timeout of `connect_timeout_s` (or `timeout_s`, if shorter; torch's retries make it
    up to ~2.5 times that, :data:`JOIN_CONNECT_TIMEOUT_S`) or fails: nobody listening there means
    its source dropped the group or is gone, and waiting longer brings nothing.
    """
    host, _, port_s = address.rpartition(":")
    if not host or not port_s.isdigit():
        raise WeightTransferError(f"weight group address must be host:port, got {address!r}")
    if backend not in ("gloo", "nccl"):
        raise WeightTransferError(f"weight group backend must be gloo or nccl, got {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    if store is None and rank > 0:
        store = _connect(host, int(port_s), rank, world_size, backend, min(connect_timeout_s, timeout_s))
        store.set_timeout(timeout)  # from now on: waiting for the others, then every collective
    joining = "form" if rank == 0 else "join"
    try:
        if store is None:
            store = dist.TCPStore(host, int(port_s), world_size, True, timeout=timeout, multi_tenant=True)
        port = store.port
        prefix = dist.PrefixStore(f"tcp://{host}:{port}", store)
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
    except (RuntimeError, ValueError) as e:  # DistStoreError is a RuntimeError
        raise WeightTransferError(
            f"cannot {joining} the weight group at {address} as rank {rank}/{world_size} ({backend}) "
            f"within {timeout_s:g}s: {e}"
        ) from None
    return WeightGroup(pg, store, host, port, rank, world_size, backend)


def _connect(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    """A member's client of rank 0's store, on a connect timeout of `timeout_s` (torch retries a
    refused connect under it, see :data:`JOIN_CONNECT_TIMEOUT_S`)."""
    start = time.monotonic()
    try:
        return dist.TCPStore(host, port, world_size, False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as e:  # DistNetworkError is a RuntimeError
        raise WeightTransferError(
            f"cannot join the weight group at {host}:{port} as rank {rank}/{world_size} ({backend}): its "
            f"store accepted no connection (connect timeout {timeout_s:g}s, tried for "
            f"{time.monotonic() - start:.0f}s: {e}); its source (rank 0) dropped that group or is "
            "gone: join the group of a later proposal"
        ) from None


def _broadcast(pg: Any, tensor: torch.Tensor, src: int) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    return pg.broadcast([tensor], opts)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise WeightTransferError(f"unknown dtype {name!r} in weight metadata")
    return dt


def _views(buf: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    dt = _dtype(bucket.dtype)
    return [(t.name, buf[t.offset : t.offset + t.nbytes].view(dt).view(t.shape)) for t in bucket.tensors]


class BroadcastSender:
    """The source of a group (rank `src`): sends whole state dicts, bucketed."""

    def __init__(
        self,
        group: WeightGroup | Any,
        *,
        src: int = 0,
        device: str | torch.device | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        solo_bytes: int = DEFAULT_SOLO_BYTES,
    ):
        self.pg = group.pg if isinstance(group, WeightGroup) else group
        backend = group.backend if isinstance(group, WeightGroup) else "gloo"
        self.device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
        self.src, self.bucket_bytes, self.solo_bytes = src, bucket_bytes, solo_bytes
        self._slots: list[torch.Tensor | None] = [None, None]

    def send(self, tensors: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Broadcast every tensor; returns when the last bucket left (stats: bytes, buckets, seconds)."""
        start = time.perf_counter()
        entries = [
            (n, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())
            for n, t in tensors.items()
        ]
        plan = plan_buckets(entries, self.bucket_bytes, version, self.solo_bytes)
        meta = msgspec.msgpack.encode(plan)
        header = torch.tensor([MAGIC, version, len(meta), len(plan.buckets)], dtype=torch.int64)
        _broadcast(self.pg, header.to(self.device), self.src).wait()
        meta_t = torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.device)
        _broadcast(self.pg, meta_t, self.src).wait()
        pending: list[Any] = [None, None]
        for k, bucket in enumerate(plan.buckets):
            slot = k % 2
            if pending[slot] is not None:
                pending[slot].wait()  # that buffer is free again
            pending[slot] = _broadcast(self.pg, self._pack(slot, bucket, tensors), self.src)
        for work in pending:
            if work is not None:
                work.wait()
        return {"bytes": plan.nbytes, "buckets": len(plan.buckets), "seconds": time.perf_counter() - start}

    def _pack(self, slot: int, bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if len(bucket.tensors) == 1:  # a big tensor alone: broadcast it in place, no copy
            t = tensors[bucket.tensors[0].name].detach()
            if t.is_contiguous() and t.device == self.device and t.dim() > 0:
                return t.view(-1).view(torch.uint8)
        buf = self._slots[slot]
        if buf is None or buf.numel() < bucket.nbytes:
            buf = self._slots[slot] = torch.empty(
                max(bucket.nbytes, 1), dtype=torch.uint8, device=self.device
            )
        out = buf[: bucket.nbytes]
        for (_, view), spec in zip(_views(out, bucket), bucket.tensors, strict=True):
            view.copy_(tensors[spec.name].detach())
        return out


class SourceGone(WeightTransferError):
    """The source of a transfer died while we received: the group is broken for good."""


def store_probe(host: str, port: int) -> Callable[[], str | None]:
    """A check that the source hosting a group's store at host:port still runs: None while it does,
    else why not (once SOURCE_GONE_PROBES connections in a row failed, so a slow accept is not a
    death). The store lives in the source's process for as long as the group does."""
    failures = 0

    def check() -> str | None:
        nonlocal failures
        try:
            socket.create_connection((host, port), timeout=SOURCE_POLL_S).close()
            failures = 0
            return None
        except OSError as e:
            failures += 1
            if failures < SOURCE_GONE_PROBES:
                return None
            return f"the source of the weight group at {host}:{port} is gone mid-transfer ({e})"

    return check


def _wait(work: Any, source_gone: Callable[[], str | None] | None) -> None:
    """Wait for a receive. A source that dies mid-broadcast leaves its receivers waiting until the
    group's timeout (gloo does not tell them, measured: minutes on a real group); with
    `source_gone`, the wait checks it every SOURCE_POLL_S and fails with SourceGone instead."""
    if source_gone is None:
        work.wait()
        return
    while True:
        try:
            work.wait(timedelta(seconds=SOURCE_POLL_S))
            return
        except RuntimeError as e:
            if "Operation timed out" not in str(e):  # the group's own error (a peer closed, its timeout)
                # A peer that closed may be the source itself: then say so (SourceGone: the caller
                # joins a new group), else the group's error as it is.
                why = _gone_for_sure(source_gone)
                if why is not None:
                    raise SourceGone(why) from e
                raise
        why = source_gone()
        if why is not None:
            raise SourceGone(why)


def _gone_for_sure(source_gone: Callable[[], str | None]) -> str | None:
    """Why the source is gone, asked as many times as the probe needs to be sure; None if it runs.

    The probes are spread over a second: a source that is exiting closes its group's connections
    and its store's listener one after the other, so a probe right after gloo saw a peer close can
    still find the listener open (seen on a loaded machine) and would take a dying source for a live
    one."""
    for attempt in range(2 * SOURCE_GONE_PROBES):
        why = source_gone()
        if why is not None:
            return why
        if attempt + 1 < 2 * SOURCE_GONE_PROBES:
            time.sleep(SOURCE_POLL_S / (2 * SOURCE_GONE_PROBES))
    return None


def iter_buckets(
    group: WeightGroup | Any,
    src: int = 0,
    device: str | torch.device = "cpu",
    *,
    info: dict | None = None,
    source_gone: Callable[[], str | None] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Receive one transfer; yield each bucket's [(name, tensor), ...] as soon as it arrived.

    Each bucket has its own buffer, and the next bucket is already being received while the
    current one is consumed. On CPU the buffers are reused by the next transfer on the same
    group: the tensors stay valid until then (copy what must outlive it; an engine loading
    them into its parameters does). `info`, if given, receives the version and the plan.
    Abandoning the iterator receives and drops the rest, so the group stays in step.
    `source_gone` (see :func:`store_probe`): fail with SourceGone once the source died, instead of
    waiting for the group's timeout; the group is then broken: join a new one.
    """
    pg = group.pg if isinstance(group, WeightGroup) else group
    device = torch.device(device)
    header = torch.zeros(4, dtype=torch.int64, device=device)
    _wait(_broadcast(pg, header, src), source_gone)
    magic, version, meta_len, n_buckets = (int(x) for x in header.cpu())
    if magic != MAGIC:
        raise WeightTransferError(
            f"weight broadcast out of step: header {header.tolist()} lacks the magic number"
        )
    if not 0 < meta_len <= limits.WEIGHT_PLAN_FRAME:
        raise WeightTransferError(
            f"weight broadcast out of step: a transfer plan of {meta_len} bytes announced "
            f"(limit {limits.WEIGHT_PLAN_FRAME})"
        )
    meta = torch.empty(meta_len, dtype=torch.uint8, device=device)
    _wait(_broadcast(pg, meta, src), source_gone)
    try:
        plan = msgspec.msgpack.decode(meta.cpu().numpy().tobytes(), type=Plan)
    except (msgspec.DecodeError, RecursionError) as e:
        raise WeightTransferError(f"weight metadata of version {version} is not a transfer plan: {e}") from e
    if len(plan.buckets) != n_buckets:
        raise WeightTransferError(
            f"weight metadata lists {len(plan.buckets)} buckets, header says {n_buckets}"
        )
    if info is not None:
        info.update(version=version, plan=plan)

    pool = _POOLS.setdefault(pg, {}) if device.type == "cpu" else {}

    def post(k: int) -> tuple[torch.Tensor, Any]:
        n = plan.buckets[k].nbytes
        buf = pool.get(k)
        if buf is None or buf.numel() < n or buf.device != device:
            buf = torch.empty(max(n, 1), dtype=torch.uint8, device=device)
            if device.type == "cpu":
                pool[k] = buf
        return buf[:n], _broadcast(pg, buf[:n], src)

    nxt = post(0) if plan.buckets else None
    k = 0
    try:
        while nxt is not None:
            buf, work = nxt
            try:
                _wait(work, source_gone)
            except SourceGone:
                nxt = None  # nothing more comes: no staying in step on a broken group
                raise
            nxt = post(k + 1) if k + 1 < len(plan.buckets) else None
            yield _views(buf, plan.buckets[k])
            k += 1
    finally:
        if nxt is not None:  # abandoned midway: stay in step with the sender
            nxt[1].wait()
            for j in range(k + 2, len(plan.buckets)):
                post(j)[1].wait()


def iter_received(
    group: WeightGroup | Any,
    src: int = 0,
    device: str | torch.device = "cpu",
    *,
    info: dict | None = None,
    source_gone: Callable[[], str | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of one transfer, bucket after bucket (what an engine's loader eats)."""
    for bucket in iter_buckets(group, src, device, info=info, source_gone=source_gone):
        yield from bucket


def receive_weights(
    group: WeightGroup | Any,
    src: int = 0,
    device: str | torch.device = "cpu",
    on_bucket: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None,
    source_gone: Callable[[], str | None] | None = None,
) -> tuple[int, dict[str, torch.Tensor]]:
    """Receive one transfer: (version, name -> tensor); or hand each bucket to `on_bucket`, keep nothing."""
    info: dict = {}
    out: dict[str, torch.Tensor] = {}
    for bucket in iter_buckets(group, src, device, info=info, source_gone=source_gone):
        if on_bucket is not None:
            on_bucket(bucket)
        else:
            out.update(bucket)
    return info["version"], out
