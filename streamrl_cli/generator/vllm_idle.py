"""How long a waiting vLLM process keeps its core: a vLLM general plugin, loaded in every process vLLM
starts (its engine core and workers as well as ours), registered as the ``vllm.general_plugins``
entry point ``streamrl_idle_spin``.

vLLM's processes pass each step through shared-memory queues whose readers spin (``sched_yield``)
for a second after every message before they sleep on a socket until woken. Between the bursts of an
RL loop (a batch generated, then weights awaited while the trainer trains) the engine is idle most
of each second, and its worker and engine core spin through it: on a host whose cores the engine
shares (CPU instances, a colocated trainer, other engines) that takes a core from the work that
would end the wait. A reader of ours spins for :data:`DEFAULT_IDLE_SPIN_S` after its last message
instead; while the engine decodes, messages come every few milliseconds and it never sleeps, so a
step waits no longer than with vLLM's second. Woken from its sleep, a reader has its message within
the socket's latency (tens of microseconds).

The engine (``generator.vllm_engine``) sets ``STREAMRL_VLLM_IDLE_SPIN_S`` before vLLM spawns its
processes; a value in the environment already wins (``1`` gives vLLM's own behaviour back). Without
the variable the plugin changes nothing, so other programs using vLLM in the same environment are
left as they are. Nothing here imports vLLM until vLLM itself calls :func:`register`.
"""

from __future__ import annotations

import logging
import os

from streamrl_cli.environ import VLLM_IDLE_SPIN as ENV
from streamrl_cli.environ import nonnegative

DEFAULT_IDLE_SPIN_S = 0.05  # a decode step on these engines takes milliseconds; vLLM's own: 1 s

# A child of vLLM's logger: vLLM's processes print it with their own prefix ("(Worker pid=…)").
log = logging.getLogger("vllm.streamrl_idle_spin")


def idle_spin_s(environ: dict[str, str] | os._Environ[str] = os.environ) -> float | None:
    """The seconds a reader spins after its last message, or None to leave vLLM's (unset or invalid)."""
    raw = environ.get(ENV, "").strip()
    if not raw:
        return None
    value = nonnegative(raw)
    if value is None:
        log.warning("%s=%r is not a number of seconds >= 0; vLLM's own idle spin is kept", ENV, raw)
        return None
    return value


def register() -> None:
    """vLLM's plugin hook: bound every shared-memory reader's spin in this process. Readers created
    before the hook ran (a worker's first queue) are bound at their next wait. Runs once per process;
    another call changes nothing."""
    spin = idle_spin_s()
    if spin is None:
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # a vLLM without spinning readers: nothing to bound
        return
    if getattr(SpinCondition, "_streamrl_idle_spin_s", None) is not None:
        return
    original = SpinCondition.wait

    def wait(self, timeout_ms: int | None = None) -> None:  # type: ignore[no-untyped-def]
        if self.busy_loop_s > spin:
            self.busy_loop_s = spin
        return original(self, timeout_ms)

    SpinCondition.wait = wait  # type: ignore[method-assign]
    SpinCondition._streamrl_idle_spin_s = spin  # type: ignore[attr-defined]
    log.info("streamrl: a waiting reader sleeps after %gs without a message (vLLM's own: 1s)", spin)
