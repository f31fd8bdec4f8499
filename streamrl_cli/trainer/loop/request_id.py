"""The trainer's request ids, as one type: what a sample's `prompt_id` says about where it belongs.

Every request the trainer sends names the group it feeds, and a sample comes back under the same
id; routing, retries, partial-rollout resumptions and the records all read it. The grammar::

    it<j>/<prompt id>[~<n>][~c...][#r<k> | #p<k>]

- ``it<j>``: the iteration (batch) it belongs to;
- ``<prompt id>``: the task's prompt id, as the dataset has it (it may hold "/", or anything: a
  record's own ``id``), so what follows it is read from the end;
- ``~<n>`` (n ≥ 2): the n-th draw of that prompt in the same batch (a batch that spans two epochs);
- ``~c``: a group paused in an earlier batch and resumed in this one under a key its own draws
  already hold (once per clash);
- ``#r<k>``: the k-th retry in the batch (a sample too stale, generated again);
- ``#p<k>``: the k-th resumption (a paused sample going on from its tokens so far).

The group key is the id without its ``#`` part; the draw key (the id less ``it<j>/``, of a group)
seeds reproducible sampling and keys ``lengths/by_prompt``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

_N = r"(0|[1-9]\d*)"  # a number as the trainer writes it: no leading zeros
_GRAMMAR = re.compile(rf"it{_N}/(.*?)(?:~([2-9]|[1-9]\d+))?((?:~c)*)(?:#([rp]){_N})?")


@dataclass(frozen=True)
class RequestId:
    iteration: int
    prompt_id: str  # the task's prompt id
    draw: int = 1  # the n-th draw of the prompt in its batch ("~n" when n > 1)
    carried: int = 0  # "~c" suffixes: resumed under a key its batch's own draws held already
    retry: int | None = None  # "#r<k>"
    resume: int | None = None  # "#p<k>"

    def __post_init__(self) -> None:
        if self.iteration < 0 or self.draw < 1 or self.carried < 0:
            raise ValueError(f"not a request id: {self!r}")
        if self.retry is not None and self.resume is not None:
            raise ValueError(f"a request id is a retry or a resumption, not both: {self!r}")

    @classmethod
    def parse(cls, text: str) -> RequestId:
        """The id of `text`; ValueError when it does not follow the grammar (or would not print back)."""
        m = _GRAMMAR.fullmatch(text)
        if m is None:
            raise ValueError(f"not a request id: {text!r}")
        it, pid, draw, carried, kind, k = m.groups()
        rid = cls(
            iteration=int(it), prompt_id=pid, draw=int(draw) if draw else 1, carried=len(carried) // 2,
            retry=int(k) if kind == "r" else None, resume=int(k) if kind == "p" else None,
        )  # fmt: skip
        if str(rid) != text:  # "~1", "#r01", ...: not what the trainer writes
            raise ValueError(f"not a request id: {text!r}")
        return rid

    @property
    def draw_key(self) -> str:
        """What the group drew, without its iteration: "<prompt id>[~n][~c...]"."""
        return self.prompt_id + (f"~{self.draw}" if self.draw > 1 else "") + "~c" * self.carried

    @property
    def group(self) -> RequestId:
        """The group it feeds: the id without its retry or resumption."""
        return replace(self, retry=None, resume=None)

    @property
    def is_group(self) -> bool:
        """A group's own id (not a retry's or a resumption's)."""
        return self.retry is None and self.resume is None

    def in_batch(self, iteration: int) -> RequestId:
        """The same draw as a group of batch `iteration` (a paused group resumed there)."""
        return replace(self, iteration=iteration, retry=None, resume=None)

    def carried_again(self) -> RequestId:
        """One "~c" more: the key its batch already holds is taken."""
        return replace(self, carried=self.carried + 1)

    def retried(self, k: int) -> RequestId:
        return replace(self, retry=k, resume=None)

    def resumed(self, k: int) -> RequestId:
        return replace(self, retry=None, resume=k)

    def __str__(self) -> str:
        tail = ""
        if self.retry is not None:
            tail = f"#r{self.retry}"
        elif self.resume is not None:
            tail = f"#p{self.resume}"
        return f"it{self.iteration}/{self.draw_key}{tail}"
