"""A far site's elastic relay group against generator processes without an engine (real rendezvous,
real trainer WeightPublisher and WeightServer, real loopback sockets and gloo; tests/support/relay_peer.py
runs the real generator role with only its engine faked): one copy crosses to the relay, a member
dying mid-transfer, a late joiner, the relay dying with a version pending, the next relay.

The tests run in file order on one set of processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.generator_harness import wait_until
from support.helpers import REPO
from support.weights_elastic import Run, digest, state

from streamrl_cli.recipe.schema import GeneratorConfig, ModelConfig, TaskConfig, TrainConfig
from streamrl_cli.roles.spec import GeneratorSpec, spec_yaml
from streamrl_cli.trainer.role.publish import WeightPublisher
from streamrl_cli.transport.routing import DispatchService
from streamrl_cli.transport.samples import StreamConfig

SYNC_TIMEOUT_S = 60.0  # the trainer's wait for a version: far above what any test may take


PEER = REPO / "tests" / "support" / "relay_peer.py"


class FarSite(Run):
    """Rendezvous server, a trainer (sample receiver, WeightPublisher in relay mode), far-site peers;
    Run's helpers, another trainer and other peers."""

    def __init__(self, root: Path):
        self.root = root
        self.start_rendezvous(root)
        self.svc = DispatchService(StreamConfig(bind="tcp://127.0.0.1:0", max_delay_s=0.001), self.token)
        self.publisher = WeightPublisher(
            self.rdv, self.token, transport="relay", generator_workers=3, backend="gloo",
            sync_timeout_s=SYNC_TIMEOUT_S,
        )  # fmt: skip
        addresses = {"samples": self.svc.address, **self.publisher.addresses()}
        self.rdv.register("trainer", 0, site="here", addresses=addresses)
        self.rdv.start_heartbeat()
        self.svc.watch(self.rdv)
        (root / "model").mkdir()
        spec = GeneratorSpec(
            run_name="relay-test", run_dir=str(self.run_dir), role="generator", cluster="far", site="far",
            world=3, expected={"trainer": 1, "generator": 3},
            program="streamrl_cli.generator.main:main", weight_transport="relay",
            rendezvous_file=str(self.run_dir / "rendezvous.json"), secret_file=str(self.run_dir / "secret"),
            settings=GeneratorConfig(cluster="local", engine="none", tensor_parallel=1, gpus_per_instance=0),
            model=ModelConfig(name="none", path=str(root / "model")),
            task=TaskConfig(name="builtin", max_prompt_len=8, max_output_len=8), train=TrainConfig(seed=0),
        )  # fmt: skip
        self.spec = root / "generator.yaml"
        self.spec.write_text(spec_yaml(spec))
        self.peers: dict[int, subprocess.Popen] = {}

    def start(self, rank: int, *extra: str) -> None:
        log = (self.root / f"peer-{rank}.log").open("w")
        self.peers[rank] = subprocess.Popen(
            [sys.executable, "-u", str(PEER), str(self.spec), str(rank), *extra],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip

    def kill(self, rank: int) -> None:
        os.kill(self.peers[rank].pid, signal.SIGKILL)
        self.peers[rank].wait()

    def states(self) -> dict[str, str]:
        return {m["member_id"]: m["state"] for m in self.rdv.members("generator")}

    def has(self, rank: int, version: int) -> bool:
        return f"GOT {version} {digest(state(version))}" in self.got(rank)

    def publish(self, version: int) -> dict:
        return self.publisher.publish(state(version), version).result(timeout=SYNC_TIMEOUT_S + 10)

    def close(self) -> None:
        super().close()
        self.svc.close()


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    s = FarSite(tmp_path_factory.mktemp("relay-elastic"))
    try:
        s.start(0, "--die-when-joining", "5")  # the relay, until it dies at version 5
        s.start(1)
        s.start(2, "--die-when-joining", "2")
        wait_until(lambda: len(s.eligible()) == 3, 60, "three far-site generators")
        yield s
    finally:
        s.close()


def test_one_copy_crosses_to_the_relay_which_sends_it_to_every_generator_of_its_site(site):
    before = site.publisher.server.stats["bytes"]
    stats = site.publish(1)
    assert site.rdv.versions()["current"] == 1
    assert site.publisher.server.stats["bytes"] - before == stats["bytes"]  # exactly one copy crossed
    for rank in range(3):
        assert wait_until(lambda r=rank: site.has(r, 1), 60, f"peer {rank} with version 1")


def test_a_member_dying_mid_transfer_is_left_out_and_the_others_still_get_the_version(site):
    # generator-2 says it is ready for version 2 and exits: the relay's group never forms (or its
    # broadcast fails); the relay plans again without it and sends once more. Before, the relay's
    # fixed group hung until the gloo timeout and the version was never confirmed.
    t0 = time.monotonic()
    site.publish(2)
    assert time.monotonic() - t0 < 20
    assert site.rdv.versions()["current"] == 2
    assert site.states()["generator-2"] == "lost"
    assert site.has(0, 2) and site.has(1, 2)


def test_a_member_killed_before_the_transfer_does_not_hold_the_version_up(site):
    site.kill(1)
    t0 = time.monotonic()
    site.publish(3)  # generator-1 may still count as alive: planned in, then out
    assert time.monotonic() - t0 < 20
    assert site.has(0, 3)


def test_late_joiners_get_the_next_version_from_the_relay(site):
    site.start(3)
    site.start(4)
    # exactly these three: a count of three is also met by generator-1 (killed in the last test)
    # before its lease runs out
    want = ["generator-0", "generator-3", "generator-4"]
    wait_until(lambda: sorted(site.eligible()) == want, 60, "the late joiners, generator-1 lost")
    site.publish(4)
    for rank in (0, 3, 4):
        assert wait_until(lambda r=rank: site.has(r, 4), 60, f"peer {rank} with version 4")
    assert not site.has(3, 3) and not site.has(4, 3)  # nothing before they joined


def test_when_the_relay_dies_with_a_version_pending_the_next_generator_takes_over(site):
    # generator-0 (the relay) fetches version 5, proposes its layout and dies as its own engine
    # joins: the version stays pending; generator-3, now the lowest-ranked, relays it.
    site.publish(5)
    assert site.rdv.versions()["current"] == 5
    assert site.states()["generator-0"] == "lost"
    for rank in (3, 4):
        assert wait_until(lambda r=rank: site.has(r, 5), 60, f"peer {rank} with version 5")
    events = site.rdv.events(0, limit=10_000)["events"]
    resent = [e["data"] for e in events if e["type"] == "version_proposed" and e["data"]["version"] == 5]
    sources = [d["transfer"]["source"] for d in resent if "transfer" in d]
    assert sources[0] == "generator-0" and sources[-1] == "generator-3"


def test_the_new_relay_serves_the_next_versions_and_so_does_the_one_after_it(site):
    site.publish(6)
    assert site.has(3, 6) and wait_until(lambda: site.has(4, 6), 60, "peer 4 with version 6")
    site.kill(3)  # between versions: generator-4 alone is left, and relays to itself
    wait_until(lambda: site.states()["generator-3"] == "lost", 60, "generator-3 lost")
    site.publish(7)
    assert site.rdv.versions()["current"] == 7
    assert wait_until(lambda: site.has(4, 7), 60, "peer 4 with version 7")
