"""serve_until_stopped: a role's duties run until it is told to stop or one of them ends."""

from __future__ import annotations

import asyncio

import pytest

from streamrl_cli.roles.serving import serve_until_stopped


async def forever(cancelled: list[str], name: str) -> None:
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        cancelled.append(name)
        raise


def test_stop_cancels_every_duty():
    async def main() -> list[str]:
        cancelled: list[str] = []
        stop = asyncio.Event()
        asyncio.get_running_loop().call_soon(stop.set)
        await serve_until_stopped({"a": forever(cancelled, "a"), "b": forever(cancelled, "b")}, stop)
        return cancelled

    assert sorted(asyncio.run(main())) == ["a", "b"]


def test_a_duty_that_raises_fails_the_role_and_the_others_are_cancelled():
    async def broken() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("engine died")

    async def main(cancelled: list[str]) -> None:
        await serve_until_stopped({"ok": forever(cancelled, "ok"), "health": broken()}, asyncio.Event())

    cancelled: list[str] = []
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(main(cancelled))
    assert cancelled == ["ok"]


def test_a_duty_that_returns_ends_the_serving_without_error():
    async def done() -> None:
        return None

    async def main() -> list[str]:
        cancelled: list[str] = []
        await serve_until_stopped({"ok": forever(cancelled, "ok"), "trainer": done()}, asyncio.Event())
        return cancelled

    assert asyncio.run(main()) == ["ok"]
