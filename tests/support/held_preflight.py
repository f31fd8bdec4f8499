"""A role program for tests that look at a live run: the preflight check, then the member stays
registered and heartbeating for $HELD_PREFLIGHT_S seconds before it leaves (a signal ends it as it
would end any role program).

Named in a recipe as `roles.<role>.program=support.held_preflight:main`; the role processes find
it through `clusters.<name>.env.PYTHONPATH` (`HELD` gives the overrides)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from streamrl_cli.roles import preflight

TESTS = Path(__file__).resolve().parents[1]


def held(seconds: int, clusters: tuple[str, ...] = ("local",)) -> tuple[str, ...]:
    """Overrides that run this program for trainer and generators, held `seconds`, on `clusters`."""
    out = [
        "roles.trainer.program=support.held_preflight:main",
        "roles.generator.program=support.held_preflight:main",
    ]
    for c in clusters:
        path = os.pathsep.join(filter(None, (str(TESTS), os.environ.get("PYTHONPATH"))))
        out += [f"+clusters.{c}.env.PYTHONPATH={path}", f"+clusters.{c}.env.HELD_PREFLIGHT_S={seconds}"]
    return tuple(out)


def main(spec, rank: int) -> int:  # type: ignore[no-untyped-def]
    client = preflight.check(spec, rank)
    try:
        time.sleep(float(os.environ.get("HELD_PREFLIGHT_S", "0")))
        client.leave()
    finally:
        client.close()
    return 0
