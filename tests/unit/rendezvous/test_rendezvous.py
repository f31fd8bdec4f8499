"""The rendezvous server and client, end to end: a real server process on loopback.

Each server is started the way ``streamrl run`` starts it (``python -m
streamrl_cli.rendezvous``), so these tests cover argument parsing, the token file,
rendezvous.json, signals and the journal as well as the HTTP API. Leases of 2 s keep the
failure-detection tests short, and long enough that a member's heartbeats (every third of a lease)
arrive in time on a machine busy with other tests: bounds are asserted in leases, with a lease of
slack, and a wake-up is told from a timeout by a factor of several, never by a wall-clock limit
close to what an idle machine takes. Malformed requests and authentication are in
``test_rendezvous_api.py``; the pure state machine in ``test_rendezvous_state.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from streamrl_cli.errors import RendezvousError
from streamrl_cli.rendezvous import RendezvousClient, create_secret
from streamrl_cli.rundir import RunDir

LEASE_S = 2.0


class Server:
    """A rendezvous server subprocess on a run directory."""

    def __init__(self, run_dir: Path, *args: str, lease_s: float = LEASE_S):
        self.run_dir = run_dir
        self.log = open(run_dir / "server.log", "ab")  # noqa: SIM115 - closed in stop()/kill()
        cmd = [sys.executable, "-m", "streamrl_cli.rendezvous", "--run-dir", str(run_dir)]
        self.proc = subprocess.Popen([*cmd, "--lease-s", str(lease_s), *args], stderr=self.log)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            info = _endpoint(run_dir)
            if info.get("pid") == self.proc.pid and "stopped" not in info:
                self.url = info["url"]
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}: {self.logs()}")
            time.sleep(0.02)
        self.kill()
        raise AssertionError(f"server did not start: {self.logs()}")

    def logs(self) -> str:
        return (self.run_dir / "server.log").read_text()

    def client(self, **kw: object) -> RendezvousClient:
        return RendezvousClient.from_run_dir(self.run_dir, **{"timeout": 5.0, "retry_s": 5.0, **kw})

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=10)
        self.log.close()
        return rc


def _endpoint(run_dir: Path) -> dict:
    try:
        return json.loads((RunDir(run_dir).endpoint).read_text())
    except (OSError, ValueError):
        return {}


@pytest.fixture
def server(tmp_path):
    create_secret(tmp_path)
    srv = Server(tmp_path)
    yield srv
    if srv.proc.poll() is None:
        srv.kill()


def wait_until(predicate, timeout: float, what: str, poll: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_register_discover_and_reregister(server):
    with server.client() as trainer, server.client() as gen0, server.client() as gen1:
        t = trainer.register("trainer", 0, cluster="h800", addresses={"samples": "node1:29500"})
        assert t["member_id"] == "trainer-0" and t["incarnation"] == 1 and t["peers"] == []
        g0 = gen0.register("generator", 0, cluster="h20", site="B", info={"engine": "vllm", "device": "H20"})
        assert [p["member_id"] for p in g0["peers"]] == ["trainer-0"]
        assert g0["peers"][0]["addresses"] == {"samples": "node1:29500"} and "info" not in g0["peers"][0]
        gen1.register("generator", 1)
        alive = trainer.wait_for("generator", 2, timeout=5)
        assert sorted(m["member_id"] for m in alive) == ["generator-0", "generator-1"]
        g = {m["member_id"]: m for m in trainer.members()}["generator-0"]
        assert (g["role"], g["rank"], g["cluster"], g["site"], g["state"]) == (
            "generator",
            0,
            "h20",
            "B",
            "alive",
        )
        assert g["info"] == {"engine": "vllm", "device": "H20"} and g["last_heartbeat_age_s"] < 5
        # A restarted member registers again: same id, next incarnation.
        again = gen0.register("generator", 0, cluster="h20")
        assert (again["member_id"], again["incarnation"]) == ("generator-0", 2)
        assert len(trainer.members(role="generator")) == 2
        with pytest.raises(RendezvousError, match="timed out after .* waiting for 3 alive"):
            trainer.wait_for("generator", 3, timeout=0.3)


def test_lease_expiry_is_detected_within_two_leases(server):
    lease = LEASE_S
    with server.client() as watcher, server.client() as quiet, server.client() as busy:
        busy.register("generator", 0)
        busy.start_heartbeat()
        reg = quiet.register("generator", 1)  # registers, then never heartbeats
        registered_at = time.monotonic()
        since, lost_at = reg["event_seq"], None
        while lost_at is None and time.monotonic() - registered_at < 4 * lease:
            doc = watcher.events(since, timeout=2)
            since = doc["next_since"]
            if any(e["type"] == "member_lost" for e in doc["events"]):
                lost_at = time.monotonic()
                assert [e["data"]["member_id"] for e in doc["events"] if e["type"] == "member_lost"] == [
                    "generator-1"
                ]
        assert lost_at is not None and lost_at - registered_at <= 2 * lease
        states = {m["member_id"]: m["state"] for m in watcher.members()}
        assert states == {"generator-0": "alive", "generator-1": "lost"}
        # A lost member that turns out to be alive comes back with its next heartbeat.
        quiet.heartbeat()
        assert {m["member_id"]: m["state"] for m in watcher.members()}["generator-1"] == "alive"
        busy.leave("done")
        assert {m["member_id"]: m["state"] for m in watcher.members()}["generator-0"] == "left"


def test_version_is_announced_only_when_every_required_member_confirmed(server):
    clients = [server.client() for _ in range(4)]
    trainer, gens = clients[0], clients[1:]
    trainer.register("trainer", 0)
    for i, g in enumerate(gens):
        g.register("generator", i)
        g.start_heartbeat()
    trainer.start_heartbeat()
    trainer.propose_version(1, ["generator"])
    waited: dict = {}
    waiter = threading.Thread(target=lambda: waited.update(trainer.wait_for_version(1, timeout=10)))
    waiter.start()
    gens[0].confirm_version(1)
    gens[1].confirm_version(1)
    time.sleep(0.2)
    v = trainer.versions()
    assert v["current"] is None and waiter.is_alive()
    assert sorted(v["pending"][0]["confirmed"]) == ["generator-0", "generator-1"]
    gens[2].confirm_version(1)
    waiter.join(timeout=5)
    assert waited["current"] == 1 and waited["pending"] == []
    events = trainer.events(0)["events"]
    current = [e for e in events if e["type"] == "version_current"]
    assert current[0]["data"]["confirmed_by"] == ["generator-0", "generator-1", "generator-2"]
    members = {m["member_id"]: m for m in trainer.members()}
    assert all(members[f"generator-{i}"]["weight_version"] == 1 for i in range(3))
    with pytest.raises(RendezvousError, match="stale_version"):
        trainer.propose_version(1, ["generator"])
    # A member that dies does not block the next version: it is lost, then not waited for.
    trainer.propose_version(2, ["generator"])
    gens[2].stop_heartbeat()
    gens[0].confirm_version(2)
    gens[1].confirm_version(2)
    t0 = time.monotonic()
    assert trainer.wait_for_version(2, timeout=5 * LEASE_S)["current"] == 2
    assert time.monotonic() - t0 < 3 * LEASE_S  # lost within two leases, and one of slack
    assert {m["member_id"]: m["state"] for m in trainer.members()}["generator-2"] == "lost"
    for c in clients:
        c.close()


def test_metrics_latest_per_member_and_jsonl(server):
    with server.client() as gen, server.client() as trainer:
        gen.register("generator", 3)
        trainer.register("trainer", 0)
        for step in range(3):
            gen.post_metrics({"step": step, "tokens_per_s": 1000.0 + step, "queue": {"waiting": step}})
        trainer.post_metrics({"step": 2, "idle_ratio": 0.1})
        progress = trainer.post_progress(2, samples=2048)
        assert progress["step"] == 2 and progress["samples"] == 2048
        status = trainer.status()
    assert status["metrics"]["generator-3"]["record"] == {
        "step": 2,
        "tokens_per_s": 1002.0,
        "queue": {"waiting": 2},
    }
    assert status["metrics"]["trainer-0"]["record"]["idle_ratio"] == 0.1
    assert status["progress"]["step"] == 2 and status["counts"]["generator"]["alive"] == 1
    assert status["server"]["uptime_s"] > 0 and status["event_seq"] >= 3
    lines = [json.loads(x) for x in (server.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 4
    assert lines[0] == {
        "step": 0,
        "tokens_per_s": 1000.0,
        "queue": {"waiting": 0},
        "time": lines[0]["time"],
        "member_id": "generator-3",
        "role": "generator",
        "rank": 3,
    }


def test_long_poll_returns_promptly_on_a_new_event(server):
    with server.client() as watcher, server.client() as joiner:
        seq = watcher.events(0)["next_since"]
        t0 = time.monotonic()
        empty = watcher.events(seq, timeout=0.3)
        assert empty["events"] == [] and 0.25 <= time.monotonic() - t0 < 10  # its timeout, not a hang
        got: dict = {}

        def poll() -> None:
            got.update(watcher.events(seq, timeout=20))
            got["at"] = time.monotonic()

        poller = threading.Thread(target=poll)
        poller.start()
        time.sleep(0.3)
        sent = time.monotonic()
        joiner.register("generator", 7)
        poller.join(timeout=5)
        assert [e["type"] for e in got["events"]] == ["member_registered"]
        assert got["at"] - sent < 5  # woken by the event: its timeout is 20 s


def _member_key(m: dict) -> tuple:
    return m["member_id"], m["incarnation"], m["cluster"], m["weight_version"], m["state"]


def test_restart_after_kill9_keeps_state_and_heartbeats_reconnect(tmp_path):
    create_secret(tmp_path)
    server = Server(tmp_path)
    trainer, gen, quiet = (server.client(retry_s=10) for _ in range(3))
    try:
        trainer.register("trainer", 0, cluster="h800")
        gen.register("generator", 0, cluster="h20", info={"engine": "torch"})
        quiet.register("generator", 1)
        trainer.start_heartbeat()
        gen.start_heartbeat()
        trainer.propose_version(1, ["generator"])
        gen.confirm_version(1)
        quiet.confirm_version(1)
        trainer.propose_version(2, ["generator"])
        gen.confirm_version(2)
        trainer.post_progress(5, samples=5120)
        gen.post_metrics({"step": 5, "tokens_per_s": 42.0})
        before = trainer.status()
        assert before["versions"]["current"] == 1

        server.kill()  # SIGKILL: no chance to flush anything or say goodbye
        sent_before = gen.heartbeat_stats["sent"]
        time.sleep(0.5)  # heartbeats fail meanwhile
        restarted = Server(tmp_path)
        assert restarted.url != server.url  # port 0: the clients must follow rendezvous.json
        server = restarted

        after = trainer.status()
        assert after["versions"]["current"] == 1
        assert [(p["version"], sorted(p["confirmed"])) for p in after["versions"]["pending"]] == [
            (2, ["generator-0"])
        ]
        assert after["progress"]["step"] == 5 and after["progress"]["samples"] == 5120
        assert after["metrics"]["generator-0"]["record"] == {"step": 5, "tokens_per_s": 42.0}
        assert sorted(map(_member_key, after["members"])) == sorted(map(_member_key, before["members"]))
        assert after["event_seq"] == before["event_seq"]
        # Heartbeating members reconnect within the grace lease; the silent one is then lost,
        # which unblocks version 2 (its other required member confirmed it).
        wait_until(
            lambda: gen.heartbeat_stats["sent"] > sent_before + 2, 5 * LEASE_S, "heartbeats after restart"
        )
        assert gen.heartbeat_stats["failed"] >= 1 and gen.heartbeat_stats["reregistered"] == 0
        assert trainer.wait_for_version(2, timeout=5 * LEASE_S)["current"] == 2
        states = {m["member_id"]: m["state"] for m in trainer.members()}
        assert states == {"trainer-0": "alive", "generator-0": "alive", "generator-1": "lost"}
        seqs = [e["seq"] for e in trainer.events(0)["events"]]
        assert seqs == list(range(1, len(seqs) + 1))
    finally:
        for c in (trainer, gen, quiet):
            c.close()
        server.kill()


def test_heartbeat_reregisters_when_the_server_forgot_the_member(server):
    with server.client(retry_s=10) as gen:
        gen.register("generator", 4, info={"device": "cpu"})
        gen.start_heartbeat(interval=0.1)
        server.kill()
        for path in (server.run_dir / "rendezvous").iterdir():
            path.unlink()  # the journal is gone: the new server knows nobody
        restarted = Server(server.run_dir)
        server.proc, server.log = restarted.proc, restarted.log
        wait_until(lambda: gen.heartbeat_stats["reregistered"] == 1, 5 * LEASE_S, "re-registration")
        (m,) = gen.members()
        assert (m["member_id"], m["state"], m["info"]) == ("generator-4", "alive", {"device": "cpu"})


def test_sigterm_shuts_down_cleanly(server):
    with server.client() as c:
        seq = c.register("trainer", 0)["event_seq"]
        polled: dict = {}
        poller = threading.Thread(target=lambda: polled.update(c.events(seq, timeout=30)))
        poller.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        assert server.stop() == 0
        poller.join(timeout=5)
        assert time.monotonic() - t0 < 5 and polled["events"] == []  # the long-poll was released
    assert "stopped" in _endpoint(server.run_dir)
    assert "shutting down" in server.logs()


def test_a_call_follows_a_requeued_server_that_comes_back_after_its_retries(server):
    """A server whose SLURM job requeued itself is away longer than a call retries (rendezvous.json
    says `requeued`, so calls wait); when it is back on a new port, the waiting call goes there, and
    does not fail for the budget the old address used up (a CI run's trainer did, and its restart
    was needed)."""
    endpoint = RunDir(server.run_dir).endpoint
    with server.client(retry_s=0.5) as c:
        c.register("trainer", 0)
        server.stop()
        doc = {**json.loads(endpoint.read_text()), "requeued": time.time()}
        doc.pop("stopped", None)
        endpoint.write_text(json.dumps(doc))
        answer: dict = {}
        waiter = threading.Thread(target=lambda: answer.update(c.status()))
        waiter.start()
        time.sleep(1.5)  # three times the call's budget
        assert waiter.is_alive() and not answer
        back = Server(server.run_dir)  # the requeued job: journal replayed, a new port
        server.proc, server.log = back.proc, back.log
        waiter.join(timeout=15)
        assert not waiter.is_alive() and "trainer-0" in {m["member_id"] for m in answer["members"]}
        assert c._url == back.url


def test_unreachable_server_raises_a_clear_error(tmp_path):
    with RendezvousClient("http://127.0.0.1:9", "x" * 32, retry_s=0.3) as c:
        t0 = time.monotonic()
        with pytest.raises(RendezvousError, match=r"unreachable for GET /v1/status after \d+ attempt"):
            c.status()
        assert time.monotonic() - t0 < 10  # gave up after its retries, did not hang


def test_server_refuses_a_secret_others_can_read(tmp_path):
    create_secret(tmp_path)
    os.chmod(tmp_path / "secret", 0o644)
    cmd = [sys.executable, "-m", "streamrl_cli.rendezvous", "--run-dir", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "chmod 600" in r.stderr


def _write_tls(tmp: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it (PEM files)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def cert(subject, issuer, pub, signer, ca: bool, san=None):
        now = datetime.datetime.now(datetime.UTC)
        b = x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(pub)
        b = b.serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
        b = b.not_valid_after(now + datetime.timedelta(days=1))
        b = b.add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        b = b.add_extension(x509.SubjectKeyIdentifier.from_public_key(pub), critical=False)
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "streamrl test CA")])
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    ca = cert(ca_name, ca_name, ca_key.public_key(), ca_key, ca=True)
    leaf = cert(name, ca_name, key.public_key(), ca_key, ca=False, san=san)
    paths = tmp / "ca.pem", tmp / "cert.pem", tmp / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return paths


def test_tls_round_trip(tmp_path):
    ca, cert, key = _write_tls(tmp_path)
    create_secret(tmp_path)
    srv = Server(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        assert srv.url.startswith("https://") and _endpoint(tmp_path)["tls"] is True
        with srv.client(tls_ca=ca) as c:
            assert c.register("trainer", 0)["member_id"] == "trainer-0"
            c.post_progress(1)
            assert c.status()["progress"]["step"] == 1
        with srv.client(retry_s=0) as untrusting:  # the system CAs do not know our test CA
            with pytest.raises(RendezvousError, match="CERTIFICATE_VERIFY_FAILED"):
                untrusting.status()
        with pytest.raises(httpx.HTTPError):
            httpx.get(srv.url.replace("https", "http") + "/healthz", timeout=2)
    finally:
        srv.kill()


def test_a_stalled_server_does_not_count_its_own_silence_against_members(tmp_path):
    # A server that did not run for a while (stopped, swapped out, starved of CPU) heard nobody
    # then: heartbeats waited in its sockets. That silence is the server's, not the members'.
    lease = LEASE_S
    create_secret(tmp_path)
    server = Server(tmp_path, lease_s=lease)
    with server.client() as watcher, server.client() as busy, server.client() as quiet:
        try:
            since = busy.register("generator", 0)["event_seq"]
            busy.start_heartbeat()
            quiet.register("generator", 1)  # then never heartbeats: it must still be found lost
            server.proc.send_signal(signal.SIGSTOP)
            time.sleep(4 * lease)
            server.proc.send_signal(signal.SIGCONT)
            stalled_until = time.monotonic()
            lost_at = None
            while lost_at is None and time.monotonic() - stalled_until < 4 * lease:
                doc = watcher.events(since, timeout=1)
                since = doc["next_since"]
                lost = [e["data"]["member_id"] for e in doc["events"] if e["type"] == "member_lost"]
                assert "generator-0" not in lost, server.logs()
                if "generator-1" in lost:
                    lost_at = time.monotonic()
            assert lost_at is not None and lost_at - stalled_until <= 2 * lease
            assert "stalled" in server.logs()
            time.sleep(2 * lease)  # and the heartbeating one stays alive past another lease
            states = {m["member_id"]: m["state"] for m in watcher.members()}
            assert states == {"generator-0": "alive", "generator-1": "lost"}
        finally:
            server.proc.send_signal(signal.SIGCONT)
            server.kill()
