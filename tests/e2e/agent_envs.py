"""Environments of the agent end-to-end tests (loaded by file path on the generators)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from streamrl_cli.tasks.calc import CalcEnv


class FaultyCalc(CalcEnv):
    """The calc task's environment, failing on the prompts named (by "a+b"): raising at reset,
    hanging in its step, or killing its own process. On `block_on`'s prompt the step waits (writing
    `<block_dir>/blocked-<pid>` with its generator's pid) until `<block_dir>/released` exists: the
    test kills that generator while its trajectories are certainly mid-way."""

    def __init__(
        self,
        raise_on: str = "",
        hang_on: str = "",
        exit_on: str = "",
        block_on: str = "",
        block_dir: str = "",
    ):
        self.faults = {raise_on: "raise", hang_on: "hang", exit_on: "exit", block_on: "block"}
        self.faults.pop("", None)
        self.block_dir = Path(block_dir) if block_dir else None

    def reset(self, row):
        self.fault = self.faults.get(f"{row['a']}+{row['b']}")
        if self.fault == "raise":
            raise RuntimeError("the environment broke")
        return super().reset(row)

    def step(self, turn):
        if self.fault == "hang":
            time.sleep(3600)
        if self.fault == "exit":
            os._exit(9)
        if self.fault == "block" and self.block_dir is not None:
            released = self.block_dir / "released"
            if not released.exists():
                (self.block_dir / f"blocked-{os.getpid()}").write_text(str(os.getppid()))
                while not released.exists():
                    time.sleep(0.05)
        return super().step(turn)
