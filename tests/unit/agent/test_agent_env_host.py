"""Environments in their worker processes: raising, hanging and dying cost one trajectory each.

Real child processes; the timeout is short so that the hang is cut, and everything asserted holds
whatever the timing (a hang of an hour is always past a 2 s timeout).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from streamrl_cli.agent.env_host import AgentError, EnvFailure, EnvHost, EnvSettings
from streamrl_cli.agent.trajectory import ENV_DIED, ENV_ERROR, ENV_TIMEOUT

ENVS = Path(__file__).with_name("envs.py")


def test_failures_end_their_session_and_the_host_recovers():
    async def scenario():
        host = EnvHost(EnvSettings(env=f"{ENVS}:Faulty", workers=1, timeout_s=2.0))
        await host.start()
        try:
            first = host.workers[0]
            reasons = []
            for fault in ("raise", "hang", None, "exit", None):
                s = await host.open()
                try:
                    out = await s.reset({"fault": fault})
                    assert out == [{"role": "user", "content": "go"}]
                    step = await s.step("anything")
                    assert (step.reward, step.done) == (0.5, True)
                    reasons.append("ok")
                except EnvFailure as e:
                    reasons.append(e.reason)
                finally:
                    await s.close()
            assert reasons == [ENV_ERROR, ENV_TIMEOUT, "ok", ENV_DIED, "ok"]
            assert dict(host.failures) == {ENV_ERROR: 1, ENV_TIMEOUT: 1, ENV_DIED: 1}
            # The hung process was retired and stopped; the dead one replaced: two restarts.
            assert host.restarts == 2
            assert not first.process.is_alive()
            assert all(w.process.is_alive() for w in host.workers if not w.dead)
        finally:
            await host.close()
        assert all(not w.process.is_alive() for w in [first])

    asyncio.run(scenario())


def test_an_environment_that_cannot_be_made_fails_at_start_saying_why(tmp_path):
    async def start(settings):
        host = EnvHost(settings)
        try:
            await host.start()
        finally:
            await host.close()

    with pytest.raises(AgentError, match="no attribute 'Nope'"):
        asyncio.run(start(EnvSettings(env=f"{ENVS}:Nope", workers=1)))
    with pytest.raises(AgentError, match="unexpected keyword argument 'colour'"):
        asyncio.run(start(EnvSettings(env=f"{ENVS}:Scripted", env_args={"colour": 1}, workers=1)))
    with pytest.raises(AgentError, match="at least 1"):
        EnvHost(EnvSettings(env=f"{ENVS}:Scripted", workers=0))
