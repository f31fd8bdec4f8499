"""`streamrl status` against real local runs: JSON, table, --watch in a terminal, TLS."""

from __future__ import annotations

import datetime
import json
import os
import pty
import select
import signal
import time

import pytest
from support.helpers import PREFLIGHT, REPO, STREAMRL, streamrl
from support.local_runs import TWO, members_ok, run_dir_of, start_held_run


@pytest.fixture
def held_run(runs_root):
    """A local run whose roles hold after preflight (heartbeating) until cancelled."""
    proc, run_dir = start_held_run(runs_root)
    yield run_dir
    streamrl("cancel", str(run_dir))
    proc.wait(timeout=60)


def test_status_json_of_a_live_local_run(held_run):
    doc = json.loads(streamrl("status", held_run.name, "--json").stdout)
    assert doc["run"] == held_run.name and doc["state"] == "running"
    assert doc["rendezvous"]["reachable"] and doc["rendezvous"]["url"].startswith("http://127.0.0.1:")
    roles = {r["role"]: r for r in doc["roles"]}
    assert [p["state"] for p in roles["generator"]["processes"]] == ["running", "running"]
    assert [(m["rank"], m["state"]) for m in roles["generator"]["members"]] == [(0, "alive"), (1, "alive")]
    assert roles["trainer"]["members"][0]["metrics"]["preflight"] == 1
    assert doc["rendezvous"]["counts"]["generator"]["alive"] == 2
    listing = json.loads(streamrl("status", "--json").stdout)
    assert [(r["run"], r["state"]) for r in listing["runs"]] == [(held_run.name, "running")]


def test_status_when_the_rendezvous_server_does_not_answer(held_run):
    """A hung server (stopped, so the run's watch loop does not restart it as it would a dead one):
    status gives up on it within its timeout and shows what it knows from disk."""
    procs = json.loads((held_run / "local.json").read_text())
    rdv = next(p for p in procs if p["role"] == "rendezvous")
    os.kill(rdv["pid"], signal.SIGSTOP)
    try:
        out = streamrl("status", held_run.name)
        assert out.returncode == 0
        text = " ".join(out.stdout.split())  # rich wraps the long reason at the terminal's width
        assert "unreachable" in text and "ReadTimeout" in text
        assert "showing what SLURM and the run directory know" in text
        doc = json.loads(streamrl("status", held_run.name, "--json").stdout)
    finally:
        os.kill(rdv["pid"], signal.SIGCONT)
    assert doc["rendezvous"]["reachable"] is False
    gens = next(r for r in doc["roles"] if r["role"] == "generator")
    assert [(m["rank"], m["state"]) for m in gens["members"]] == [(0, "unknown"), (1, "unknown")]  # from disk


def test_status_table_and_watch_in_a_terminal(held_run):
    out = streamrl("status", held_run.name)
    for word in ("rendezvous", "trainer", "generator", "alive", held_run.name):
        assert word in out.stdout
    pid, fd = pty.fork()
    if pid == 0:  # the child: streamrl status --watch on a real terminal
        os.chdir(REPO)
        os.execvpe(
            STREAMRL[0],
            [*STREAMRL, "status", held_run.name, "--watch", "--interval", "0.3"],
            {**os.environ, "COLUMNS": "120", "LINES": "60", "TERM": "xterm"},
        )
    screen = b""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and screen.count(b"generator (cluster") < 3:
        if select.select([fd], [], [], 0.5)[0]:
            try:
                screen += os.read(fd, 65536)
            except OSError:
                break
    os.kill(pid, signal.SIGINT)
    status = _drain_until_exit(pid, fd, timeout=30)
    assert screen.count(b"generator (cluster") >= 3, "--watch did not refresh"
    assert b"\x1b[" in screen  # redrawn in place with terminal control sequences
    assert os.waitstatus_to_exitcode(status) == 0


def _drain_until_exit(pid: int, fd: int, timeout: float) -> int:
    """Keep reading the terminal until the child exits: one blocked writing to a full terminal (it
    redraws on the way out) would never see its exit, and waitpid would wait for ever."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if select.select([fd], [], [], 0.2)[0]:
            try:
                os.read(fd, 65536)
            except OSError:  # EIO: the child closed its end; waitpid will see it
                pass
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"streamrl status --watch did not exit within {timeout}s of Ctrl-C")


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    import ipaddress

    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_file, key_file


def test_a_local_run_over_tls(runs_root, tmp_path):
    cert, key = _self_signed(tmp_path)
    out = streamrl(
        "run",
        "local",
        *PREFLIGHT,
        TWO,
        f"roles.rendezvous.tls_cert={cert}",
        f"roles.rendezvous.tls_key={key}",
        f"roles.rendezvous.tls_ca={cert}",
        "--root",
        str(runs_root),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = run_dir_of(runs_root)
    assert json.loads((run_dir / "rendezvous.json").read_text())["url"].startswith("https://")
    assert members_ok(run_dir) == 3
