"""On-policy distillation's teacher stage: each sample is scored by a teacher before the loop sees it.

With ``algorithm.distill_coef`` the loss gives every sampled token the advantage
``distill_coef × (log p_teacher(token) − log p_behaviour(token))`` (added to the task's, or alone):
the negative of the per-token reverse KL from the teacher, estimated on the policy's own samples
(Agarwal et al. 2024, "On-Policy Distillation of Language Models", arXiv:2306.13649; the per-token
form as in Lu & Thinking Machines 2025, "On-Policy Distillation"). The teacher's log-probs come
from the teacher pool (``roles.teacher``, generator.teacher).

:class:`TeacherScoring` sits between the sample stream and the trainer's loop with the data plane's
own interface (submit, cancel, get, generators). It remembers each request's prompt tokens; a
sample that arrives is sent at once, as prompt + sampled tokens, to the teachers' dispatch service
(a second sample stream, with its own ledger: a teacher lost has its requests dispatched again to
the others, each answer is taken once), and comes out of :meth:`get` with ``teacher_logprobs`` once
its answer is in. So teachers score while the generators go on, as samples stream.

Not scored: evaluation samples (their reward is the task's alone) and samples with no tokens (a
paused request that never started). A paused sample's tokens so far are scored in their own
request's context, and its resumption's in theirs, so the two joined are the whole sample's scores.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from streamrl_cli.errors import StreamRLError
from streamrl_cli.trainer.loop.evaluation import Evaluator
from streamrl_cli.transport.wire import Request, Sample

log = logging.getLogger("streamrl.trainer")

WAIT_SLICE_S = 0.01  # while answers are due: how long one wait on either stream may take


class TeacherScoring:
    """The data plane (``svc``) with the teachers' scores attached to each training sample."""

    def __init__(
        self,
        svc: Any,
        teachers: Any,
        *,
        no_teacher_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.svc, self.teachers = svc, teachers
        self.no_teacher_s, self.clock = no_teacher_s, clock
        self._prompts: dict[str, tuple[list[int], int]] = {}  # request id -> (prompt tokens, samples due)
        self._held: dict[str, Sample] = {}  # teacher request id -> the sample it scores
        self._ready: collections.deque[Sample] = collections.deque()
        self._serial = 0
        self._no_teacher_since: float | None = None
        # Counts kept for inspection (the unit tests read them; the iteration record does not yet).
        self.scored = 0  # samples scored
        self.rescored = 0  # teacher answers dropped as repeats (a lost teacher's, answered again)

    # ---- the data plane's interface ----

    def submit(self, requests: Iterable[Request]) -> None:
        reqs = list(requests)
        for r in reqs:
            if not r.cancel and not Evaluator.owns(r.prompt_id):
                self._prompts[r.prompt_id] = (list(r.prompt_token_ids), len(r.sample_indices))
        self.svc.submit(reqs)

    def cancel(self, prompt_ids: Iterable[str], *, keep: bool = False) -> None:
        ids = list(prompt_ids)
        if not keep:  # no more samples of these will be trained: their prompts are not needed
            for pid in ids:
                self._prompts.pop(pid, None)
        self.svc.cancel(ids, keep=keep)

    def generators(self) -> list[str]:
        return self.svc.generators()

    def get(self, timeout: float | None = None) -> Sample | None:
        """The next sample with its teacher's scores (or one that needs none), or None after `timeout`."""
        deadline = self.clock() + (timeout or 0.0)
        while True:
            self._take_samples()
            self._take_answers(0.0)
            if self._ready:
                return self._ready.popleft()
            self._check_teachers()
            left = deadline - self.clock()
            if left <= 0:
                return None
            if not self._held:  # nothing due from the teachers: wait on the samples alone
                sample = self.svc.get(timeout=left)
                if sample is not None:
                    self._arrived(sample)
                continue
            self._take_answers(min(left, WAIT_SLICE_S))

    @property
    def pending(self) -> int:
        """Samples waiting for their teacher's answer."""
        return len(self._held)

    # ---- inside ----

    def _take_samples(self) -> None:
        while (sample := self.svc.get(timeout=0)) is not None:
            self._arrived(sample)

    def _arrived(self, sample: Sample) -> None:
        prompt = self._prompt_of(sample.prompt_id)
        if prompt is None or not sample.token_ids:
            self._ready.append(sample)  # evaluation, a dropped prompt's late copy, or nothing to score
            return
        self._serial += 1
        key = f"{sample.prompt_id}@{sample.sample_index}#t{self._serial}"
        self._held[key] = sample
        self.teachers.submit(
            [Request(prompt_id=key, prompt_token_ids=prompt + list(sample.token_ids), sample_indices=[0])]
        )

    def _prompt_of(self, request_id: str) -> list[int] | None:
        entry = self._prompts.get(request_id)
        if entry is None:
            return None
        tokens, due = entry
        if due <= 1:
            del self._prompts[request_id]
        else:
            self._prompts[request_id] = (tokens, due - 1)
        return tokens

    def _take_answers(self, timeout: float) -> None:
        answer = self.teachers.get(timeout=timeout)
        while answer is not None:
            self._answered(answer)
            answer = self.teachers.get(timeout=0)

    def _answered(self, answer: Sample) -> None:
        sample = self._held.pop(answer.prompt_id, None)
        if sample is None:
            self.rescored += 1
            return
        if answer.finish_reason == "error":
            raise StreamRLError(
                f"teacher {answer.generator or '?'} could not score sample {sample.sample_index} of "
                f"{sample.prompt_id} ({len(sample.token_ids)} tokens after its prompt): its engine refused "
                "the sequence; see the teacher's log (is roles.teacher's model context shorter than "
                "task.max_prompt_len + task.max_output_len?)"
            )
        n = len(sample.token_ids)
        if len(answer.logprobs) < n:
            raise StreamRLError(
                f"teacher {answer.generator or '?'} answered {len(answer.logprobs)} log-probs for a "
                f"sequence ending in {n} sampled tokens ({sample.prompt_id})"
            )
        self.scored += 1
        self._ready.append(msgspec.structs.replace(sample, teacher_logprobs=list(answer.logprobs[-n:])))

    def _check_teachers(self) -> None:
        """Fail loudly, rather than wait for ever, once no teacher has been connected for
        `no_teacher_s` while samples wait for one."""
        if not self._held or self.teachers.generators():
            self._no_teacher_since = None
            return
        now = self.clock()
        if self._no_teacher_since is None:
            self._no_teacher_since = now
            log.warning("no teacher is connected: every one failed or left; waiting for one to come back")
        elif now - self._no_teacher_since > self.no_teacher_s:
            raise StreamRLError(
                f"no teacher left: none has been connected for {self.no_teacher_s:.0f}s "
                f"(train.stall_after_s) while {len(self._held)} sample(s) waited for their scores; every "
                "teacher failed or left, see `streamrl status` for their last errors"
            )
