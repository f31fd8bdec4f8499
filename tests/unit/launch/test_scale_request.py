"""`streamrl scale` input and rank bookkeeping (no processes): counts, ranks never reused, errors."""

from __future__ import annotations

import json
import re

import pytest
from support.helpers import streamrl

from streamrl_cli.launch.scale.executor import next_rank
from streamrl_cli.launch.scale.request import ScaleUsageError, target_count
from streamrl_cli.rundir import RunDir, write_json


@pytest.mark.parametrize(
    ("spec", "current", "want"), [("3", 1, 3), ("+1", 2, 3), ("-1", 2, 1), ("0", 2, 0), (" +2 ", 0, 2)]
)
def test_target_count(spec: str, current: int, want: int) -> None:
    assert target_count(spec, current) == want


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("two", "expected a count N, +N"),
        ("1.5", "expected"),
        ("-3", "below 0"),
        ("", "expected"),
        (str(2**80), "past the bound of 100,000"),
        ("+100000", "past the bound"),
    ],  # fmt: skip
)
def test_bad_counts_say_what_is_valid(spec: str, needle: str) -> None:
    with pytest.raises(ScaleUsageError, match=re.escape(needle)):
        target_count(spec, 2)


def test_next_rank_is_past_every_rank_the_run_ever_had(tmp_path) -> None:
    run = RunDir(tmp_path)
    assert next_rank(run) == 0
    procs = [
        {"role": "generator", "rank": 0, "pid": 1, "created": 0.0, "log": ""},
        {"role": "trainer", "rank": 5, "pid": 2, "created": 0.0, "log": ""},
    ]
    write_json(tmp_path / "local.json", procs)
    assert next_rank(run) == 1
    jobs = [
        {"role": "generator", "job_id": "7", "array": 2},
        {"role": "generator", "job_id": "9", "array": 3, "rank_base": 4},
    ]
    write_json(tmp_path / "jobs.json", jobs)
    assert next_rank(run) == 7  # ranks 4, 5, 6 of the second array
    (tmp_path / "members").mkdir()
    (tmp_path / "members" / "generator-11.json").write_text(json.dumps({}))  # one that has left
    assert next_rank(run) == 12


def test_scale_refuses_a_run_that_is_not_running(tmp_path) -> None:
    run_dir = tmp_path / "done-20250101-000000"
    run_dir.mkdir()
    write_json(run_dir / "run.json", {"name": "done", "state": "finished"})
    out = streamrl("scale", str(run_dir), "--generators", "+1")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "is finished: only a running run can be scaled" in out.stdout + out.stderr
