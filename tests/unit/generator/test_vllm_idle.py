"""The vLLM plugin that bounds how long vLLM's shared-memory readers spin when idle
(streamrl_cli/generator/vllm_idle.py). Each case runs in a fresh interpreter: the plugin patches
vLLM's reader class for the process it is loaded in, as vLLM loads it in each of its own. That vLLM
loads it in its engine core and worker processes is asserted on the local default run's generator
log (tests/e2e/test_trainer_e2e.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

from streamrl_cli.generator import vllm_idle

# A real reader (as a worker makes one for the engine core's broadcast), waited on twice: once
# within its spin (it yields), once after it (it polls its socket for 10 ms and returns).
PROBE = """
import json, logging, time, zmq
logging.basicConfig(level=logging.INFO)  # as vLLM's processes have it
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from streamrl_cli.generator.vllm_idle import register
ctx = zmq.Context()
early = SpinCondition(is_reader=True, context=ctx, notify_address="inproc://streamrl-probe-a")
register(); register()
late = SpinCondition(is_reader=True, context=ctx, notify_address="inproc://streamrl-probe-b")
before = early.busy_loop_s
for r in (early, late):
    r.wait(timeout_ms=10)
    time.sleep(0.06)
    r.wait(timeout_ms=10)
print(json.dumps({"before": before, "early": early.busy_loop_s, "late": late.busy_loop_s}))
"""


def probe(value: str | None) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != vllm_idle.ENV}
    if value is not None:
        env[vllm_idle.ENV] = value
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_the_plugin_is_registered_where_vllm_looks_for_it():
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "streamrl_idle_spin"]
    assert ep.load() is vllm_idle.register


def test_a_reader_spins_for_the_set_time_then_sleeps_and_without_the_variable_vllm_is_left_alone():
    # Set: readers made before the plugin ran (a worker's first queue) and after are both bound.
    seen, err = probe("0.05")
    assert seen == {"before": 1, "early": 0.05, "late": 0.05}, seen
    assert err.count("a waiting reader sleeps after 0.05s") == 1, err  # said once per process
    # Unset (another program's vLLM in the same environment): vLLM's own second.
    seen, err = probe(None)
    assert seen == {"before": 1, "early": 1, "late": 1}, seen
    assert "waiting reader" not in err


def test_a_value_that_is_not_seconds_is_said_and_vllms_own_kept():
    # (In a fresh interpreter: a process that started an engine in-process has the plugin loaded.)
    script = (
        "import sys; from streamrl_cli.generator.vllm_idle import register; register(); "
        "print('vllm.distributed.device_communicators.shm_broadcast' in sys.modules)"
    )
    for bad in ("soon", "-1", "nan"):
        env = {**os.environ, vllm_idle.ENV: bad}
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
        )
        said = out.stdout + out.stderr
        assert out.returncode == 0 and out.stdout.strip() == "False", (
            said
        )  # vLLM not imported: nothing patched
        assert f"{vllm_idle.ENV}={bad!r} is not a number of seconds >= 0" in out.stderr, out.stderr


def test_the_value_read_from_the_environment():
    assert vllm_idle.idle_spin_s({}) is None
    assert vllm_idle.idle_spin_s({vllm_idle.ENV: " 0 "}) == 0.0
    assert vllm_idle.idle_spin_s({vllm_idle.ENV: "1"}) == 1.0
    assert vllm_idle.idle_spin_s({vllm_idle.ENV: "inf"}) == float("inf")
    assert vllm_idle.idle_spin_s({vllm_idle.ENV: "-0.5"}) is None
