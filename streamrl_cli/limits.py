"""What a peer's bytes may cost a server: the frame size and nesting limits of every wire, in one place.

Each server that decodes what a peer sent (the rendezvous server, the trainer's sample and teacher
streams, the weight relay, the environment server) reads its limits from here, so that one table
says what any of them accepts (``docs/security.md`` prints it):

* a **frame limit**: a longer frame is refused before its body is read or decoded (ZeroMQ's
  ``ZMQ_MAXMSGSIZE`` drops the sender's connection unread; the relay and the weight broadcast
  refuse the announced length; aiohttp answers 413);
* a **nesting limit**: free-form values (a dataset row, an environment's step, a member's metrics)
  may nest at most :data:`MAX_DEPTH` levels. msgpack and JSON decoders recurse once per level, so a
  1 KB frame nested 1,000 levels deep raises ``RecursionError`` inside the decoder; 900 levels
  decode, then break whatever walks the value next (pickling it to an environment process, encoding
  the answer). :func:`decode` catches the first and checks the second before the value goes on.

A frame over either limit is the sender's mistake: the server answers it with an error where the
frame names a call to answer, counts it, and serves the next frame.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

MAX_DEPTH = 32  # nesting of any decoded value (a dataset row of 32 levels is already unusual)

# Largest frame each wire reads, bytes.
FRAMES = {
    # A register body with engine info fits in a few KiB.
    "rendezvous": 256 * 1024,
    # A batch of 64 samples of 32K tokens is ~27 MB (ids, log-probs, masks, versions).
    "sample_stream": 64 << 20,
    # A relay's manifest of a huge model is a few MB; chunk payloads are streamed, not framed.
    "relay": 64 << 20,
    # Before the relay's handshake: Challenge, Hello, Welcome and Error are < 200 bytes.
    "relay_preauth": 1024,
    # A reset's row or a step's text (a model turn; an observation with a file's contents).
    "env_server": 16 << 20,
    # A weight broadcast's transfer plan (names, shapes, buckets: ~100 bytes a tensor).
    "weight_plan": 64 << 20,
}
SAMPLE_STREAM_FRAME = FRAMES["sample_stream"]
RELAY_FRAME = FRAMES["relay"]
RELAY_PREAUTH_FRAME = FRAMES["relay_preauth"]
RENDEZVOUS_BODY = FRAMES["rendezvous"]
ENV_SERVER_FRAME = FRAMES["env_server"]
WEIGHT_PLAN_FRAME = FRAMES["weight_plan"]


class FrameError(ValueError):
    """A frame over a limit, or one the decoder could not read: the sender's fault, never the server's."""


def depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of a decoded value (a scalar is 1), without recursion; stops counting past ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if d <= limit:
            if isinstance(v, dict):
                stack.extend((x, d + 1) for x in v.values())
            elif isinstance(v, list | tuple):
                stack.extend((x, d + 1) for x in v)
    return deepest


def check_depth(value: T, what: str, limit: int = MAX_DEPTH) -> T:
    """``value`` itself, or FrameError if it nests deeper than ``limit`` levels."""
    if depth(value, limit) > limit:
        raise FrameError(f"{what} nests deeper than {limit} levels")
    return value


def decode(decode_fn: Callable[[Any], T], data: bytes | memoryview, what: str, *,
           max_bytes: int, max_depth: int | None = MAX_DEPTH) -> T:  # fmt: skip
    """``decode_fn(data)`` within the limits: FrameError for a frame over ``max_bytes``, one nested too
    deeply for the decoder (its RecursionError) or, with ``max_depth``, a value deeper than that.
    Other decode errors (msgspec's DecodeError, ValidationError) pass through as they are."""
    if len(data) > max_bytes:
        raise FrameError(f"{what} of {len(data)} bytes is over the limit of {max_bytes}")
    try:
        value = decode_fn(data)
    except RecursionError:
        raise FrameError(f"{what} nests too deeply to decode (the limit is {MAX_DEPTH} levels)") from None
    return value if max_depth is None else check_depth(value, what, max_depth)
