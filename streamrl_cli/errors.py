"""One small error hierarchy.

User mistakes raise a subclass of :class:`StreamRLError` carrying everything a person needs to fix
them; the CLI catches it once, prints it with rich and exits non-zero without a traceback.
``assert`` is kept for internal invariants only.
"""

from __future__ import annotations


class StreamRLError(Exception):
    """Base of every error meant for the user (printed without a traceback)."""

    exit_code = 1


class RecipeError(StreamRLError):
    """A recipe (or its overrides) is invalid; carries every problem found, not just the first."""

    exit_code = 2

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"{len(self.problems)} problem(s){where}:"] + [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


class ClusterError(StreamRLError):
    """SLURM (or the local launcher) refused or failed an operation."""


class RunNotFoundError(StreamRLError):
    """A run name or prefix matched no run (or several)."""

    exit_code = 2


class RendezvousError(StreamRLError):
    """The rendezvous server could not be reached or answered with an error."""


class ResumeError(StreamRLError):
    """`--resume RUN` asked of a run that cannot be resumed (no checkpoint, damaged config)."""

    exit_code = 2


class UsageError(StreamRLError):
    """The command line itself is wrong (a missing or conflicting argument, an unreadable @file)."""

    exit_code = 2
