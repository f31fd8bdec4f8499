"""Environment servers on loopback: real server processes, real environment processes, real sockets.

The generator's side (`RemoteEnvHost`) finds the servers through a small fake of the rendezvous (the
members it lists; the role's own registration is run end to end in tests/e2e/test_agent_e2e.py).
What is asserted holds in every timing: a hang of an hour is always past a 2 s timeout, and a
server killed before or after a call reached it ends that call `env_died` either way.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from streamrl_cli.agent.env_host import AgentError, EnvFailure, EnvSettings
from streamrl_cli.agent.trajectory import ENV_DIED, ENV_ERROR, ENV_TIMEOUT
from streamrl_cli.envserver.client import RemoteEnvHost
from streamrl_cli.envserver.server import SERVICE, EnvServer, encode
from streamrl_cli.rendezvous import create_secret
from streamrl_cli.transport.zmq_common import CurveKeys, curve_keys, make_client_socket

ENVS = Path(__file__).parents[1] / "agent" / "envs.py"
SERVE = Path(__file__).with_name("serve.py")


class Directory:
    """The rendezvous as the client reads it: the `env_server` members, and a long-poll for changes."""

    def __init__(self) -> None:
        self.members: dict[str, dict] = {}
        self.seq = 0
        self.cond = threading.Condition()

    def put(self, member_id: str, port: int, incarnation: int = 1, state: str = "alive") -> None:
        with self.cond:
            self.members[member_id] = {
                "member_id": member_id, "state": state, "incarnation": incarnation,
                "addresses": {"env": f"127.0.0.1:{port}"},
            }  # fmt: skip
            self.seq += 1
            self.cond.notify_all()

    def members_doc(self, role: str) -> dict:
        with self.cond:
            return {"members": [dict(m) for m in self.members.values()], "event_seq": self.seq}

    def events(self, since: int, timeout: float, limit: int) -> dict:
        with self.cond:
            self.cond.wait_for(lambda: self.seq > since, min(timeout, 0.5))
            return {"events": [], "next_since": self.seq}


class Server:
    """An environment server process (tests/unit/envserver/serve.py)."""

    def __init__(self, settings: EnvSettings, token: str):
        args = [sys.executable, str(SERVE), json.dumps(settings.__dict__), token]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, start_new_session=True)
        line = self.proc.stdout.readline()  # its port, once it serves
        assert line.strip().isdigit(), f"the server did not start (exit {self.proc.wait()})"
        self.port = int(line)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its environment processes
        self.proc.wait()


@pytest.fixture
def token(tmp_path):
    return create_secret(tmp_path)


@pytest.fixture
def servers():
    started: list[Server] = []
    yield started
    for s in started:
        if s.proc.poll() is None:
            s.kill()


def host_of(tmp_path: Path, directory: Directory, timeout_s: float = 2.0, **kw) -> RemoteEnvHost:
    settings = EnvSettings(env=f"{ENVS}:Faulty", workers=1, timeout_s=timeout_s)
    return RemoteEnvHost(settings, run_dir=tmp_path, directory=directory, **kw)


def test_a_server_serves_reset_and_step_of_a_real_environment(tmp_path, token, servers):
    servers.append(Server(EnvSettings(env=f"{ENVS}:Scripted", workers=1), token))
    directory = Directory()
    directory.put("env_server-0", servers[0].port)

    async def scenario():
        host = RemoteEnvHost(EnvSettings(env=f"{ENVS}:Scripted"), run_dir=tmp_path, directory=directory)
        await host.start()
        try:
            s = await host.open()
            assert await s.reset({"prompt": "p"}) == []
            steps = [await s.step(f"turn {i}") for i in range(3)]
            await s.close()
            assert [(x.observation, x.reward, x.done) for x in steps] == [
                ([{"role": "user", "content": "obs1"}], 0.25, False),
                ([{"role": "user", "content": "obs2"}], 0.25, False),
                ([], 1.0, True),
            ]
            assert host.calls == {"env_server-0": 5}  # reset, 3 steps, close
            stats = host.stats()
            assert (
                stats["agent/env_calls"],
                stats["agent/env_servers"],
                stats["agent/env_servers_used"],
            ) == (5, 1, 1)
            assert not host.failures
        finally:
            await host.close()

    asyncio.run(scenario())


def test_raise_hang_and_exit_end_trajectories_as_beside_the_generator(tmp_path, token, servers):
    """The same faults, the same reasons as tests/unit/agent/test_agent_env_host.py: the server's host
    is the generator's, behind a socket."""
    servers.append(Server(EnvSettings(env=f"{ENVS}:Faulty", workers=1, timeout_s=2.0), token))
    directory = Directory()
    directory.put("env_server-0", servers[0].port)

    async def scenario():
        host = host_of(tmp_path, directory)
        await host.start()
        try:
            reasons = []
            for fault in ("raise", "hang", None, "exit", None):
                s = await host.open()
                try:
                    assert await s.reset({"fault": fault}) == [{"role": "user", "content": "go"}]
                    step = await s.step("anything")
                    assert (step.reward, step.done) == (0.5, True)
                    reasons.append("ok")
                except EnvFailure as e:
                    reasons.append(e.reason)
                    assert "on env_server-0" in e.detail
                finally:
                    await s.close()
            assert reasons == [ENV_ERROR, ENV_TIMEOUT, "ok", ENV_DIED, "ok"]
            assert dict(host.failures) == {ENV_ERROR: 1, ENV_TIMEOUT: 1, ENV_DIED: 1}
            assert host.lost == 0  # the server itself never failed: its environment processes did
        finally:
            await host.close()

    asyncio.run(scenario())


def test_clients_without_the_run_token_are_refused(tmp_path, token):
    """A stranger (another token), and one who knows the server's public key but not the run's client
    key: the handshake fails, and no request of theirs reaches an environment."""

    async def scenario():
        server = EnvServer(EnvSettings(env=f"{ENVS}:Scripted", workers=1), token, bind_host="127.0.0.1")
        port = await server.start()
        serving = asyncio.create_task(server.serve())
        ctx = zmq.asyncio.Context()
        right = curve_keys(token, SERVICE)
        strangers = {
            "other token": curve_keys("another run's token, long enough", SERVICE),
            "public key only": CurveKeys(right.server_public, b"", *zmq.curve_keypair()),
            "the sample stream's keys": curve_keys(token, "samples"),
        }
        try:
            for name, keys in strangers.items():
                sock = make_client_socket(ctx, keys)
                monitor = sock.get_monitor_socket()
                sock.connect(f"tcp://127.0.0.1:{port}")
                await sock.send_multipart([encode([1, "reset", "s1", {}])])
                while True:  # the connection's events, until its handshake ends one way or the other
                    event = parse_monitor_message(await monitor.recv_multipart())["event"]
                    assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED, name
                    if event in (
                        zmq.EVENT_DISCONNECTED,  # dropped by the server before any handshake succeeded
                        zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                    ):
                        break
                sock.disable_monitor()
                monitor.close(linger=0)
                sock.close(linger=0)
            assert server.stats["rejected"] >= 1  # the ZAP handler refused the public-key-only client
            assert not server.calls and not server.sessions
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            await server.close()
            ctx.destroy(linger=0)  # with any socket a failed step left open: term() would hang

    asyncio.run(scenario())


def test_a_killed_server_ends_its_trajectories_env_died_and_others_take_the_next(tmp_path, token, servers):
    settings = EnvSettings(env=f"{ENVS}:Blocking", workers=1, timeout_s=600.0)
    servers += [Server(settings, token), Server(settings, token)]
    directory = Directory()
    directory.put("env_server-0", servers[0].port)
    directory.put("env_server-1", servers[1].port)

    async def scenario():
        host = RemoteEnvHost(settings, run_dir=tmp_path, directory=directory)
        await host.start()
        try:
            await _until(lambda: len(host.servers) == 2 and all(s.up for s in host.servers.values()))
            first, second = await host.open(), await host.open()
            assert {first.server.member_id, second.server.member_id} == {"env_server-0", "env_server-1"}
            victim = int(first.server.member_id[-1])
            marker = tmp_path / "reached"
            call = asyncio.create_task(first.reset({"marker": str(marker)}))
            await _until(marker.exists)  # the trajectory waits in its environment, on that server
            servers[victim].kill()
            with pytest.raises(EnvFailure) as e:
                await call
            assert e.value.reason == ENV_DIED and first.server.member_id in e.value.detail
            assert host.failures[ENV_DIED] == 1 and host.lost == 1
            await first.close()
            # The rendezvous still lists the dead one (its lease has not run out): never chosen again.
            for _ in range(3):
                s = await host.open()
                assert s.server.member_id == second.server.member_id
                await s.close()
            # It comes back (a new process, a new incarnation): used again.
            servers.append(Server(settings, token))
            directory.put(f"env_server-{victim}", servers[-1].port, incarnation=2)
            await _until(lambda: sum(s.up for s in host.servers.values()) == 2)
            again = await host.open()
            assert again.server.member_id == f"env_server-{victim}" and again.server.incarnation == 2
            await again.close()
            await second.close()
        finally:
            await host.close()

    asyncio.run(scenario())


def test_no_server_reachable_fails_loudly_within_its_bound(tmp_path, token):
    directory = Directory()
    directory.put("env_server-0", _free_port())  # listed alive, nothing listens there

    async def scenario():
        host = host_of(tmp_path, directory, no_server_s=1.0)
        try:
            await host.start()
        finally:
            await host.close()

    with pytest.raises(AgentError, match=r"no environment server reachable for 1 s .*env_server-0 at 127"):
        asyncio.run(scenario())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _until(predicate, timeout: float = 60.0) -> None:
    """Until `predicate()` holds (a condition the code under test reaches on its own), at most `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


def test_a_silent_clients_sessions_are_closed_and_a_pinging_ones_kept(tmp_path, token, monkeypatch):
    """A generator that died mid-trajectory never closes its sessions: the server closes them once it
    has heard nothing from it for client_silent_s; a live client's pings keep its own open."""
    from streamrl_cli.envserver import client

    monkeypatch.setattr(client, "PING_S", 0.1)

    async def scenario():
        server = EnvServer(
            EnvSettings(env=f"{ENVS}:Scripted", workers=1), token, bind_host="127.0.0.1", client_silent_s=1.0
        )
        port = await server.start()
        serving = asyncio.create_task(server.serve())
        directory = Directory()
        directory.put("env_server-0", port)
        live = RemoteEnvHost(EnvSettings(env=f"{ENVS}:Scripted"), run_dir=tmp_path, directory=directory)
        await live.start()
        ctx = zmq.asyncio.Context()
        dead = make_client_socket(ctx, curve_keys(token, SERVICE))
        try:
            kept = await live.open()
            await kept.reset({})
            dead.connect(f"tcp://127.0.0.1:{port}")
            await dead.send_multipart([encode([1, "reset", "deadbeef-1", {}])])
            assert await dead.recv_multipart()  # its session is open; then it says nothing more
            dead.close(linger=0)
            assert len(server.sessions) == 2
            await _until(lambda: server.swept == 1)
            assert list(server.sessions) == [kept.sid]
            step = await kept.step("a turn")  # the live one goes on
            assert step.observation == [{"role": "user", "content": "obs1"}]
            await kept.close()
            assert not server.sessions and server.metrics()["env_server/swept"] == 1
        finally:
            await live.close()
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            await server.close()
            ctx.destroy(linger=0)  # with any socket a failed step left open: term() would hang

    asyncio.run(scenario())


def test_a_frozen_server_is_unreachable_its_trajectory_ends_env_died(tmp_path, token, servers, monkeypatch):
    """A server that stops answering (SIGSTOP: its socket stays open, nothing reads it) is found out by
    the connection's heartbeats, not waited on for ever."""
    from streamrl_cli.envserver import client

    monkeypatch.setattr(client, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(client, "HEARTBEAT_TIMEOUT_S", 1.0)
    settings = EnvSettings(env=f"{ENVS}:Blocking", workers=1, timeout_s=600.0)
    servers.append(Server(settings, token))
    directory = Directory()
    directory.put("env_server-0", servers[0].port)

    async def scenario():
        host = RemoteEnvHost(settings, run_dir=tmp_path, directory=directory, no_server_s=1.0)
        await host.start()
        try:
            s = await host.open()
            marker = tmp_path / "reached"
            call = asyncio.create_task(s.reset({"marker": str(marker)}))
            await _until(marker.exists)
            os.killpg(servers[0].proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(EnvFailure) as e:
                    await asyncio.wait_for(call, 60)  # the bound of this test, far past the heartbeats'
                assert e.value.reason == ENV_DIED and "dropped" in e.value.detail
                await s.close()
                with pytest.raises(AgentError, match="no environment server reachable"):
                    await host.open()  # still listed alive, never serving: a bounded wait, then loudly
            finally:
                os.killpg(servers[0].proc.pid, signal.SIGCONT)
        finally:
            await host.close()

    asyncio.run(scenario())


def test_deep_huge_and_malformed_frames_of_a_token_holder_leave_the_server_serving(tmp_path, token, servers):
    """One token holder's hostile frames (issue: a 1 KB reset nested 1,000 levels deep killed the server,
    900 levels left the call unanswered, a 256 MiB frame took and kept ~500 MB): each bad frame is
    answered with an error or drops only its own connection, the server's memory stays where it was,
    and a valid reset and step on a new connection succeed afterwards."""
    import psutil

    from streamrl_cli import limits
    from streamrl_cli.envserver.server import decode

    servers.append(Server(EnvSettings(env=f"{ENVS}:Scripted", workers=1), token))
    server = servers[0]
    proc = psutil.Process(server.proc.pid)
    keys = curve_keys(token, SERVICE)

    def deep(levels: int) -> bytes:  # [cid, "reset", sid, [[[...null...]]]] as raw msgpack, no recursion
        return b"\x94\x01\xa5reset\xa3g-9" + b"\x91" * levels + b"\xc0"

    async def call(sock, frame: bytes, timeout: float = 10.0):
        await sock.send_multipart([frame])
        return decode((await asyncio.wait_for(sock.recv_multipart(), timeout))[-1])

    async def scenario():
        ctx = zmq.asyncio.Context()
        try:
            sock = make_client_socket(ctx, keys)
            sock.connect(f"tcp://127.0.0.1:{server.port}")
            rss0 = proc.memory_info().rss
            # Too deep for the decoder: no call id to answer by, so call 0 (a ping's, no client waits on
            # it); decodable but over the limit: call 1 fails.
            for levels, answered in ((1000, 0), (100_000, 0), (900, 1), (limits.MAX_DEPTH + 1, 1)):
                cid, kind, (reason, detail) = await call(sock, deep(levels))
                assert (cid, kind, reason) == (answered, "fail", ENV_ERROR) and "nest" in detail, (
                    levels,
                    detail,
                )
            junks = [b"\xc1", b"not msgpack at all", encode({"a": 1}), encode([1, "reset"])]
            junks += [encode(["x", "reset", "g-1", {}]), encode([2, "format_disk", "g-1", {}])]
            for junk in junks:
                cid, kind, (reason, detail) = await call(sock, junk)
                assert kind == "fail" and reason == ENV_ERROR and "malformed" in detail, junk
            assert cid == 2  # the call a frame names is answered as that call
            # Over the frame limit: ZeroMQ drops this connection unread (nothing to answer on).
            big = encode([3, "reset", "g-2", {"prompt": "x" * (limits.ENV_SERVER_FRAME + 1024)}])
            await sock.send_multipart([big])
            await asyncio.sleep(1.0)
            del big
            sock.close(linger=0)
            assert server.proc.poll() is None, "the server died"
            assert proc.memory_info().rss - rss0 < 32 << 20, "the oversized frame was read into memory"
            good = make_client_socket(ctx, keys)
            good.connect(f"tcp://127.0.0.1:{server.port}")
            assert await call(good, encode([7, "reset", "g-3", {"prompt": "p"}])) == [7, "ok", []]
            cid, kind, step = await call(good, encode([8, "step", "g-3", "turn"]))
            assert (cid, kind, step["reward"], step["done"]) == (8, "ok", 0.25, False)
            good.close(linger=0)
            # Our own client refuses such a row itself: its trajectory fails env_error at once, and
            # the server is not taken for lost (a timeout would have dropped it for every trajectory).
            directory = Directory()
            directory.put("env_server-0", server.port)
            host = RemoteEnvHost(EnvSettings(env=f"{ENVS}:Scripted"), run_dir=tmp_path, directory=directory)
            await host.start()
            try:
                row: list = []
                for _ in range(200):
                    row = [row]
                with pytest.raises(EnvFailure) as failed:
                    await (await host.open()).reset({"prompt": "p", "deep": row})
                assert failed.value.reason == ENV_ERROR and "nests deeper" in failed.value.detail
                s = await host.open()
                assert await s.reset({"prompt": "p"}) == [] and host.lost == 0
                await s.close()
            finally:
                await host.close()
        finally:
            ctx.destroy(linger=0)

    asyncio.run(scenario())
    assert server.proc.poll() is None
