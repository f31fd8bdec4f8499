"""Environments and tools for the agent tests, loaded by file path in the environment processes."""

from __future__ import annotations

import os
import time


class Scripted:
    """Observations "obs1", "obs2", then done with reward 1.0 at the third turn; records what it saw."""

    def __init__(self, done_at: int = 3):
        self.done_at = done_at
        self.turns: list[str] = []

    def reset(self, row):
        self.row = row
        return None

    def step(self, turn):
        self.turns.append(turn)
        n = len(self.turns)
        if n >= self.done_at:
            return None, 1.0, True
        return f"obs{n}", 0.25, False


class Faulty:
    """reset(row) does what row["fault"] says: raise, hang, exit the process, or nothing."""

    def reset(self, row):
        fault = row.get("fault")
        if fault == "raise":
            raise RuntimeError("the environment broke")
        if fault == "hang":
            time.sleep(3600)
        if fault == "exit":
            os._exit(3)
        return "go"

    async def step(self, turn):
        return None, 0.5, True


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


class Blocking:
    """reset(row) writes row["marker"] (its trajectory reached the environment), then waits for ever."""

    def reset(self, row):
        with open(row["marker"], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)
