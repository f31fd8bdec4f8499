"""Environments of the agent end-to-end tests (loaded by file path on the generators)."""

from __future__ import annotations

import os
import time

from streamrl_cli.tasks.calc import CalcEnv


class FaultyCalc(CalcEnv):
    """The calc task's environment, failing on the prompts named (by "a+b"): raising at reset,
    hanging in its step, or killing its own process."""

    def __init__(self, raise_on: str = "", hang_on: str = "", exit_on: str = ""):
        self.faults = {raise_on: "raise", hang_on: "hang", exit_on: "exit"}
        self.faults.pop("", None)

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
        return super().step(turn)
