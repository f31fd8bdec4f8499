"""Scenario runs: one real run, faults injected one after another, many assertions over its records.

A scenario is started once per module (a module-scoped fixture) and drives its steps in order, each
after the previous one's recovery was seen. Each step records what its assertions need; each test
function of the module asserts over one step's record. A step that fails ends the scenario: its
test fails with the error, and every later step's test fails saying "not reached" (never skips), so
the report names the fault the run did not survive.

Each scenario has a deadline, checked at the start of every step: a scenario that runs long fails
at the step it reached instead of eating the per-test timeout.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable

import pytest


class Scenario:
    def __init__(self, name: str, deadline_s: float):
        self.name = name
        self.deadline = time.monotonic() + deadline_s
        self.deadline_s = deadline_s
        self.records: dict[str, dict] = {}
        self.failed: tuple[str, str] | None = None  # (step, error) of the step that ended it
        self.order: list[str] = []

    def run(self, name: str, step: Callable[[dict], None]) -> None:
        """Run one step: `step(record)` fills in its record. After a failed step nothing more runs; an
        exception inside a step ends the scenario (recorded, raised again in that step's test)."""
        self.order.append(name)
        if self.failed is not None:
            return
        rec: dict = {}
        try:
            if time.monotonic() > self.deadline:
                raise AssertionError(f"scenario {self.name!r} past its deadline ({self.deadline_s:.0f} s)")
            step(rec)
        except Exception as e:  # noqa: BLE001 - recorded, re-raised in the step's test
            self.failed = (name, "".join(traceback.format_exception(e))[-6000:])
        else:
            self.records[name] = rec

    def left_s(self) -> float:
        """Seconds left before the scenario's deadline (never below 1: a wait still gets to try)."""
        return max(1.0, self.deadline - time.monotonic())

    def record(self, name: str) -> dict:
        """The record of step `name`, or the test fails: with the step's error, or "not reached"."""
        if name in self.records:
            return self.records[name]
        if self.failed is not None and self.failed[0] == name:
            pytest.fail(f"step {name!r} of scenario {self.name!r} failed:\n{self.failed[1]}", pytrace=False)
        if self.failed is not None:
            pytest.fail(
                f"not reached: scenario {self.name!r} ended at step {self.failed[0]!r}:\n{self.failed[1]}",
                pytrace=False,
            )
        pytest.fail(f"not reached: scenario {self.name!r} has no step {name!r}", pytrace=False)
