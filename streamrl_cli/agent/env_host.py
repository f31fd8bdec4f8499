"""Environments in worker processes: a step that raises, hangs or kills its process costs one trajectory.

A generator runs its trajectories' environments in ``agent.env_workers`` child processes (spawned,
never forked from a process holding an inference engine), each hosting many environment instances
on its own event loop, synchronous ``reset``/``step`` calls in threads so that one slow
environment does not hold up the others. The generator talks to them over a pipe:

* a call that **raises** is answered with the error: that trajectory ends ``env_error``;
* a call that does not answer within ``agent.step_timeout_s`` ends its trajectory ``env_timeout``;
  its process may hold a thread that never returns, so it is **retired**: it takes no new
  trajectories, finishes the ones it has, and is then stopped;
* a process that **exits** (killed, crashed, out of memory) ends each of its trajectories
  ``env_died``; the next trajectory starts a new process in its place.

Each failure is counted (``failures``) and the generator carries on: the trainer decides, by
``agent.on_failure``, whether such a trajectory is scored as it stands or dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import signal
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from streamrl_cli.agent.environment import Message, StepResult, ToolEnvironment
from streamrl_cli.agent.trajectory import ENV_DIED, ENV_ERROR, ENV_TIMEOUT
from streamrl_cli.errors import StreamRLError

log = logging.getLogger("streamrl.agent")

START_S = 120.0  # for a worker to import the environment and say it is ready
STOP_S = 5.0  # for a stopped worker to exit before it is killed


class AgentError(StreamRLError):
    """The environment or tools cannot be loaded, or the chat template cannot carry a conversation."""

    exit_code = 2


class EnvFailure(Exception):
    """An environment call failed: `reason` is the trajectory's stop reason (env_error, ...)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(kw_only=True)
class EnvSettings:
    """What a worker process needs to make an environment (picklable: it crosses the spawn)."""

    env: str | None = None  # module:Class / file.py:Class; None: tools only
    env_args: dict[str, Any] = field(default_factory=dict)
    tools: list[str] = field(default_factory=list)  # module:function / file.py:function
    tool_format: str | None = None  # the tool-call syntax (agent.tool_format; None: the chat template's)
    workers: int = 2
    timeout_s: float = 30.0


def make_environment(s: EnvSettings) -> Any:
    """A fresh environment for one trajectory (the tools around the recipe's environment, if any)."""
    from streamrl_cli.tasks.rewards import load_object

    tools = []
    for spec in s.tools:
        from streamrl_cli.agent.tools import Tool

        fn = load_object(spec, "agent.tools", kind="function", example="my_tools.py:calculator")
        if not callable(fn):
            raise AgentError(f"agent.tools: {spec!r} is a {type(fn).__name__}, not a function")
        tools.append(Tool(name=fn.__name__, fn=fn, schema={}))
    env = None
    if s.env:
        cls = load_object(s.env, "agent.env", kind="Class", example="my_env.py:GuessNumber")
        try:
            env = cls(**s.env_args)
        except TypeError as e:
            raise AgentError(f"agent.env: {s.env}({', '.join(s.env_args)}): {e} (agent.env_args)") from None
    return ToolEnvironment(tools, env, tool_format=s.tool_format)


# ---- the worker process ----


def _worker_main(conn: Any, settings: dict[str, Any]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the generator's to handle
    s = EnvSettings(**settings)
    try:
        make_environment(s)  # fail now, once, with the reason: not at every trajectory
    except Exception as e:  # noqa: BLE001 - reported to the generator, which fails loudly
        conn.send(("fatal", 0, f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", 0, None))
    asyncio.run(_serve(conn, s))


async def _serve(conn: Any, s: EnvSettings) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[tuple | None] = asyncio.Queue()
    envs: dict[int, Any] = {}
    tasks: set[asyncio.Task] = set()

    def readable() -> None:
        try:
            while conn.poll():
                inbox.put_nowait(conn.recv())
        except (EOFError, OSError):  # the generator is gone: so are we
            loop.remove_reader(conn.fileno())
            inbox.put_nowait(None)

    async def handle(op: str, cid: int, sid: int, payload: Any) -> None:
        try:
            if op == "reset":
                env = envs[sid] = make_environment(s)
                out: Any = await env.reset(payload)
            elif op == "step":
                out = await envs[sid].step(payload)
            else:  # close
                env = envs.pop(sid, None)
                out = await env.close() if env is not None else None
            conn.send(("ok", cid, out))
        except Exception as e:  # noqa: BLE001 - the trajectory's failure, not the worker's
            with contextlib.suppress(Exception):
                conn.send(("err", cid, f"{type(e).__name__}: {e}"))

    loop.add_reader(conn.fileno(), readable)
    while (msg := await inbox.get()) is not None:
        task = asyncio.create_task(handle(*msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


# ---- the generator's side ----


class _Worker:
    def __init__(self, index: int, settings: EnvSettings):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_worker_main, args=(child, asdict(settings)), name=f"streamrl-env-{index}", daemon=True
        )
        self.process.start()
        child.close()
        self.index = index
        self.pending: dict[int, asyncio.Future] = {}
        self.sessions: set[int] = set()
        self.retired = False  # a call timed out: no new trajectories; stopped once it has none
        self.dead = False
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().add_reader(self.conn.fileno(), self._readable)

    @property
    def usable(self) -> bool:
        return not (self.dead or self.retired)

    def _readable(self) -> None:
        try:
            while self.conn.poll():
                kind, cid, payload = self.conn.recv()
                if kind == "ready":
                    self.ready.set_result(None)
                elif kind == "fatal":
                    self.ready.set_exception(AgentError(f"the environment cannot be made: {payload}"))
                else:
                    fut = self.pending.pop(cid, None)
                    if fut is not None and not fut.done():
                        fut.set_result((kind, payload))
        except (EOFError, OSError):
            self._died()

    def _died(self) -> None:
        if self.dead:
            return
        self.dead = True
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
        self.process.join(0.5)
        detail = f"environment process {self.process.pid} exited (code {self.process.exitcode})"
        if not self.ready.done():
            self.ready.set_exception(AgentError(detail))
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(EnvFailure(ENV_DIED, detail))
        self.pending.clear()

    def send(self, cid: int, op: str, sid: int, payload: Any) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        if self.dead:
            fut.set_exception(EnvFailure(ENV_DIED, f"environment process {self.process.pid} is gone"))
            return fut
        self.pending[cid] = fut
        try:
            self.conn.send((op, cid, sid, payload))
        except (OSError, ValueError):
            self._died()
        return fut

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
        self.dead = True
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(STOP_S)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(STOP_S)
        self.conn.close()


class EnvHost:
    """The environment processes of one generator, and the sessions (one per trajectory) on them."""

    def __init__(self, settings: EnvSettings):
        if settings.workers < 1:
            raise AgentError(f"agent.env_workers must be at least 1, got {settings.workers}")
        self.settings = settings
        self.workers: list[_Worker] = []
        self._ids = itertools.count(1)
        self._spawned = itertools.count()
        self.failures: Counter[str] = Counter()  # stop reason -> count
        self.restarts = 0  # processes started in place of one that died or was retired

    async def start(self) -> None:
        """Start the processes and wait until each made an environment (its error raised here)."""
        while len(self.workers) < self.settings.workers:
            await self._spawn()

    async def _spawn(self) -> _Worker:
        w = _Worker(next(self._spawned), self.settings)
        self.workers.append(w)
        try:
            await asyncio.wait_for(asyncio.shield(w.ready), START_S)
        except BaseException:
            self.workers.remove(w)
            w.stop()
            raise
        return w

    async def open(self) -> Session:
        """A session for one trajectory, on the least busy usable process (a new one if too few)."""
        for w in [w for w in self.workers if w.dead or (w.retired and not w.sessions)]:
            self.workers.remove(w)
            w.stop()
        usable = [w for w in self.workers if w.usable]
        if len(usable) < self.settings.workers:  # start() made them: this one replaces one lost
            self.restarts += 1
            usable.append(await self._spawn())
        w = min(usable, key=lambda x: len(x.sessions))
        sid = next(self._ids)
        w.sessions.add(sid)
        return Session(self, w, sid)

    async def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers.clear()

    def stats(self) -> dict[str, Any]:
        """For the generator's metrics: processes started in place of others, alive, failures."""
        return {
            "agent/env_restarts": self.restarts,
            "agent/env_processes": sum(not w.dead for w in self.workers),
            **{f"agent/env_failures/{k}": v for k, v in sorted(self.failures.items())},
        }

    async def _call(self, w: _Worker, op: str, sid: int, payload: Any) -> Any:
        fut = w.send(next(self._ids), op, sid, payload)
        try:
            kind, out = await asyncio.wait_for(asyncio.shield(fut), self.settings.timeout_s)
        except TimeoutError:
            fut.cancel()
            w.retired = True
            raise EnvFailure(ENV_TIMEOUT, f"{op} took longer than {self.settings.timeout_s:g} s") from None
        if kind == "err":
            raise EnvFailure(ENV_ERROR, str(out))
        return out

    async def _release(self, w: _Worker, sid: int) -> None:
        if sid not in w.sessions:
            return
        if w.usable:
            with contextlib.suppress(EnvFailure):
                await self._call(w, "close", sid, None)
        w.sessions.discard(sid)
        if w.retired and not w.sessions and not w.dead:
            log.info("stopping environment process %d (retired after a timeout)", w.process.pid)
            w.stop()


class Session:
    """One trajectory's environment: reset, steps, close (always called, also after a failure)."""

    def __init__(self, host: EnvHost, worker: _Worker, sid: int):
        self.host, self.worker, self.sid = host, worker, sid

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        return await self._call("reset", row)

    async def step(self, turn: str) -> StepResult:
        return await self._call("step", turn)

    async def _call(self, op: str, payload: Any) -> Any:
        try:
            return await self.host._call(self.worker, op, self.sid, payload)
        except EnvFailure as e:
            self.host.failures[e.reason] += 1
            raise

    async def close(self) -> None:
        await self.host._release(self.worker, self.sid)
