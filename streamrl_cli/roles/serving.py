"""How a long-running role process serves: its concurrent duties (receive, deliver, follow the
run's events, report metrics, ...) run side by side until it is told to stop or one of them ends.
A duty that raised fails the role with its error; the others are cancelled either way."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


async def serve_until_stopped(duties: dict[str, Coroutine[Any, Any, Any]], stop: asyncio.Event) -> None:
    """Run ``duties`` (name -> coroutine) until ``stop`` is set or the first of them ends; cancel
    the rest, and raise the error of a duty that failed."""
    tasks = [asyncio.create_task(coro, name=name) for name, coro in duties.items()]
    stopped = asyncio.create_task(stop.wait(), name="stop")
    done, _ = await asyncio.wait([*tasks, stopped], return_when=asyncio.FIRST_COMPLETED)
    for t in [*tasks, stopped]:
        t.cancel()
    await asyncio.gather(*tasks, stopped, return_exceptions=True)
    for t in done:
        if t is not stopped and not t.cancelled() and (error := t.exception()) is not None:
            raise error
