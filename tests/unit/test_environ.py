"""streamrl_cli.environ: durations from the environment, read when asked, refused when malformed."""

from __future__ import annotations

import pytest

from streamrl_cli import environ
from streamrl_cli.errors import StreamRLError


def test_unset_or_empty_gives_the_callers_default_and_a_value_is_read_at_call_time(monkeypatch):
    monkeypatch.delenv(environ.JOB_POLL, raising=False)
    assert environ.job_poll_s(5.0) == 5.0 and environ.job_poll_s(15.0) == 15.0
    monkeypatch.setenv(environ.JOB_POLL, "")
    assert environ.job_poll_s(5.0) == 5.0
    monkeypatch.setenv(environ.JOB_POLL, " 1.5 ")
    assert environ.job_poll_s(5.0) == 1.5
    monkeypatch.setenv(environ.REQUEUE_WAIT, "0")
    assert environ.requeue_wait_s() == 0.0


@pytest.mark.parametrize("raw", ["soon", "-1", "nan", "inf", "1e999"])
def test_a_malformed_duration_is_refused_naming_the_variable_and_what_is_valid(monkeypatch, raw):
    monkeypatch.setenv(environ.JOB_POLL, raw)
    with pytest.raises(StreamRLError) as e:
        environ.job_poll_s(5.0)
    assert "STREAMRL_JOB_POLL_S" in str(e.value) and "≥ 0" in str(e.value) and repr(raw) in str(e.value)


def test_ranks_from_a_local_launch(monkeypatch):
    monkeypatch.delenv(environ.RANK, raising=False)
    monkeypatch.delenv(environ.RANK_BASE, raising=False)
    assert environ.rank() == 0 and environ.rank_base() == 0
    monkeypatch.setenv(environ.RANK, "3")
    monkeypatch.setenv(environ.RANK_BASE, "4")
    assert environ.rank() == 3 and environ.rank_base() == 4
