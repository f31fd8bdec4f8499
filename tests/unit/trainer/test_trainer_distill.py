"""The trainer's teacher stage (trainer.loop.distill.TeacherScoring) between the sample stream and the loop.

The two dispatch services are in-memory stand-ins with the data plane's interface (submit, cancel,
get, generators), as the pipeline's unit tests use; the teachers' real stream and engines run in
tests/e2e/test_distill_e2e.py. What must hold: a training sample leaves only with its teacher's
log-probs for exactly its tokens, scored in its own request's context; evaluation and empty samples
pass unscored; a repeated answer is dropped; a teacher's refusal and a run with no teacher left
fail loudly instead of waiting.
"""

from __future__ import annotations

import collections

import pytest

from streamrl_cli.errors import StreamRLError
from streamrl_cli.trainer.loop.distill import TeacherScoring
from streamrl_cli.trainer.loop.samples import join as _join
from streamrl_cli.transport.wire import Request, Sample


class Plane:
    """A dispatch service in memory: what was submitted, and a queue get() reads."""

    def __init__(self, alive=("x-0",)):
        self.submitted: list[Request] = []
        self.cancelled: list[tuple[list[str], bool]] = []
        self.queue: collections.deque[Sample] = collections.deque()
        self.alive = list(alive)

    def submit(self, requests):
        self.submitted += list(requests)

    def cancel(self, ids, *, keep=False):
        self.cancelled.append((list(ids), keep))

    def get(self, timeout=None):
        return self.queue.popleft() if self.queue else None

    def generators(self):
        return list(self.alive)

    def close(self):
        pass


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 0.5  # every look at the clock is half a second later
        return self.t


def sample(pid: str, i: int, tokens: list[int], reason: str = "stop") -> Sample:
    return Sample(prompt_id=pid, sample_index=i, token_ids=tokens, logprobs=[-1.0] * len(tokens),
                  finish_reason=reason, weight_version=1)  # fmt: skip


def answer(req: Request, logprobs: list[float], reason: str = "stop") -> Sample:
    return Sample(prompt_id=req.prompt_id, sample_index=0, token_ids=[], logprobs=logprobs,
                  finish_reason=reason, weight_version=0, generator="teacher-0")  # fmt: skip


def stage(**kw):
    data, teachers = Plane(), Plane(alive=("teacher-0",))
    return (
        TeacherScoring(data, teachers, no_teacher_s=kw.pop("no_teacher_s", 60.0), clock=Clock(), **kw),
        data,
        teachers,
    )


def test_a_sample_waits_for_its_teacher_and_leaves_with_the_scores_of_its_own_tokens():
    s, data, teachers = stage()
    s.submit([Request(prompt_id="it0/p", prompt_token_ids=[5, 6], sample_indices=[0, 1])])
    assert [r.prompt_id for r in data.submitted] == ["it0/p"]  # passed on unchanged
    data.queue.append(sample("it0/p", 1, [7, 8, 9]))
    assert s.get(timeout=0.1) is None and s.pending == 1  # held until the teacher answers
    (req,) = teachers.submitted
    assert req.prompt_token_ids == [5, 6, 7, 8, 9] and req.sample_indices == [0]
    teachers.queue.append(answer(req, [0.0, -0.1, -0.2, -0.3, -0.4]))
    got = s.get(timeout=0.1)
    assert got.key == ("it0/p", 1) and got.teacher_logprobs == [-0.2, -0.3, -0.4]
    assert got.logprobs == [-1.0] * 3 and s.pending == 0 and s.scored == 1
    teachers.queue.append(answer(req, [0.0] * 5))  # a lost teacher's request, answered twice
    assert s.get(timeout=0.1) is None and s.rescored == 1


def test_evaluation_empty_and_unknown_samples_pass_unscored():
    s, data, teachers = stage()
    s.submit([Request(prompt_id="eval3/q", prompt_token_ids=[1], sample_indices=[0]),
              Request(prompt_id="it0/p", prompt_token_ids=[1], sample_indices=[0])])  # fmt: skip
    data.queue.extend(
        [sample("eval3/q", 0, [4]), sample("it0/p", 0, [], "abort"), sample("it9/gone", 0, [4])]
    )
    out = [s.get(timeout=0.1) for _ in range(3)]
    assert [(x.prompt_id, x.teacher_logprobs) for x in out] == [
        ("eval3/q", []),
        ("it0/p", []),
        ("it9/gone", []),
    ]
    assert teachers.submitted == []


def test_a_cancelled_prompts_late_samples_are_not_scored_but_a_paused_ones_are():
    s, data, teachers = stage()
    s.submit([Request(prompt_id=p, prompt_token_ids=[1], sample_indices=[0]) for p in ("it0/a", "it0/b")])
    s.cancel(["it0/a"])
    s.cancel(["it0/b"], keep=True)
    assert data.cancelled == [(["it0/a"], False), (["it0/b"], True)]
    data.queue.extend([sample("it0/a", 0, [4]), sample("it0/b", 0, [4], "abort")])
    assert s.get(timeout=0.1).prompt_id == "it0/a"  # dropped by the loop; nothing to score it for
    assert [r.prompt_token_ids for r in teachers.submitted] == [[1, 4]]  # the paused piece is scored


def test_a_paused_sample_and_its_resumption_join_with_their_scores():
    start = sample("it0/p", 0, [7, 8], "abort")
    start.teacher_logprobs = [-0.1, -0.2]
    rest = sample("it1/p#p1", 0, [9])
    rest.teacher_logprobs = [-0.3]
    joined = _join(start, rest)
    assert joined.token_ids == [7, 8, 9] and joined.teacher_logprobs == [-0.1, -0.2, -0.3]
    rest.teacher_logprobs = []  # a part not scored: the whole sample counts as unscored
    assert _join(start, rest).teacher_logprobs == []


def test_a_teacher_that_cannot_score_a_sequence_fails_the_run_with_the_reason():
    s, data, teachers = stage()
    s.submit([Request(prompt_id="it0/p", prompt_token_ids=[1], sample_indices=[0])])
    data.queue.append(sample("it0/p", 0, [4, 5]))
    assert s.get(timeout=0.1) is None
    teachers.queue.append(answer(teachers.submitted[0], [], "error"))
    with pytest.raises(StreamRLError, match="teacher teacher-0 could not score sample 0 of it0/p"):
        s.get(timeout=0.1)


def test_with_no_teacher_connected_the_wait_ends_with_the_reason():
    s, data, teachers = stage(no_teacher_s=5.0)
    teachers.alive = []
    s.submit([Request(prompt_id="it0/p", prompt_token_ids=[1], sample_indices=[0])])
    data.queue.append(sample("it0/p", 0, [4]))
    with pytest.raises(StreamRLError, match="no teacher left: none has been connected for 5s"):
        for _ in range(100):
            s.get(timeout=0.1)
    # One coming back in time resets the wait.
    s2, data2, teachers2 = stage(no_teacher_s=5.0)
    teachers2.alive = []
    s2.submit([Request(prompt_id="it0/p", prompt_token_ids=[1], sample_indices=[0])])
    data2.queue.append(sample("it0/p", 0, [4]))
    s2.get(timeout=0.1)
    teachers2.alive = ["teacher-1"]
    for _ in range(100):
        s2.get(timeout=0.1)
    assert s2.pending == 1
