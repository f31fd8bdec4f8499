"""Messages of the sample stream, and how they are framed on a ZeroMQ connection.

msgspec structs with ``array_like=True``: a sample is encoded as a msgpack array (no field
names), so 1,000 token ids and log-probs cost ~13 KB and ~5 µs to encode — the sender's
budget at 1,000 samples/s is 10 µs per sample (bench/sample_stream.py).

A message is one ZeroMQ frame: a kind byte, then the msgpack body (the ROUTER side sees the
peer's routing id in a frame in front):

    generator -> trainer   b"H" Hello                              after every (re)connection
                           b"S" Batch(seqs, [Sample, ...])         a batch of samples
                           b"a" upto: int                          requests received up to seq
    trainer -> generator   b"W" Welcome                            answer to Hello
                           b"X" reason: str                        Hello refused (other protocol
                                                                   version, peer table full)
                           b"A" seqs: list[int]                    samples acknowledged
                           b"R" Batch(seqs, [Request, ...])        a batch of requests

One frame rather than a kind frame and a body frame: pyzmq releases the GIL around every frame it
sends or receives, and a thread that takes the GIL back from a busy engine thread waits up to the
interpreter's switch interval (5 ms) for it — per frame (bench/sample_stream.py).

A batch is one frame, ``[seqs, [item, ...]]``, whose items are spliced in already encoded
(``msgspec.Raw``): one frame costs one copy, where a frame per sample cost ~3 µs each.
"""

from __future__ import annotations

from typing import Any

import msgspec

from streamrl_cli import limits

HELLO, SAMPLES, REQUEST_ACK = b"H", b"S", b"a"
WELCOME, ACK, REQUESTS, REFUSED = b"W", b"A", b"R", b"X"

PROTOCOL = 3  # 2: one frame per message; 3: a request's sampling is a typed Sampling
# Largest message either end reads (ZeroMQ's ZMQ_MAXMSGSIZE: a longer one drops that peer's
# connection before anything is allocated); its size is in streamrl_cli.limits with every wire's.
MAX_MESSAGE = limits.SAMPLE_STREAM_FRAME


class Episode(msgspec.Struct, kw_only=True):
    """One trajectory's record (streamrl_cli.generator.multiturn.episode_record): metrics and status."""

    turns: int = 0  # model turns
    turns_cut: int = 0  # model turns cut at agent.max_turn_tokens
    tool_calls: int = 0
    tool_errors: int = 0  # calls that could not be parsed, named no tool, or raised
    env_reward: float = 0.0  # sum of the environment's step rewards
    env_s: float = 0.0  # seconds in the environment's reset and steps
    stop: str = ""  # why it ended: done, max_turns, max_tokens, env_error, env_timeout, env_died, abort
    error: str = ""  # the environment's failure, if any
    model_tokens: int = 0
    env_tokens: int = 0
    # Paused between turns (partial rollout): its generator keeps its environment and tokens, and
    # goes on with it from its next turn when asked to resume it (Request.resume).
    parked: bool = False
    resumed: bool = False  # went on after such a pause on the generator that kept it


UNROUTED = 255  # Sample.routed_experts: an expert id the generator did not compute


class Sample(msgspec.Struct, array_like=True, kw_only=True):
    """One finished completion, as the trainer needs it (PPO/GRPO with IS correction)."""

    prompt_id: str  # unique within the run (e.g. "it3/p17"): the dispatcher's key
    sample_index: int  # which of the prompt's n samples; (prompt_id, sample_index) is unique
    group_id: str = ""  # GRPO group (usually the prompt id); "" when unused
    token_ids: list[int]  # generated tokens only (the trainer holds the prompt)
    logprobs: list[float]  # behaviour log-probs of the sampled tokens, temperature applied
    finish_reason: str  # "stop" | "length" | "abort" (engine's words)
    weight_version: int  # policy version that produced it (staleness bound, IS correction)
    generator: str = ""  # member id of the generator (rendezvous "<role>-<rank>")
    queued_at: float = 0.0  # unix time the engine queued the request
    first_token_at: float = 0.0  # unix time of the first generated token
    finished_at: float = 0.0  # unix time it finished
    # Partial rollout (appended: older peers still decode): the weight version of each token when
    # they differ (a sample paused at an iteration's close and resumed under newer weights); empty:
    # every token is of `weight_version`. Then `weight_version` is the oldest token's.
    token_versions: list[int] = []
    # A multi-turn trajectory (appended likewise): 1 per token the model sampled, 0 per token the
    # environment added (observations, tool answers, the chat template's turn markers around them:
    # in the context, out of the loss, the KL and the importance ratios); empty: all the model's.
    loss_mask: list[int] = []
    episode: Episode | None = None  # what happened in it (turns, tool calls, why it ended)
    # On-policy distillation (appended likewise): the teacher's log-prob of each token, filled in by
    # the trainer from its teachers' answers; empty: not scored.
    teacher_logprobs: list[float] = []
    # Mixture-of-experts routing replay (appended likewise): the experts the generator's routers chose
    # at every position it computed, prompt and sample (len(prompt) + len(token_ids) - 1 positions, the
    # last token never being an input), as uint8 [positions, MoE layers, experts per token], 255 where
    # a position was not computed there (a prefix-cache hit); empty: not captured.
    routed_experts: bytes = b""

    @property
    def key(self) -> tuple[str, int]:
        return (self.prompt_id, self.sample_index)


class Sampling(msgspec.Struct, array_like=True, kw_only=True):
    """A request's sampling parameters, built once by the trainer from the recipe's ``algorithm``
    section (``streamrl_cli.trainer.loop.seeds.request_sampling``). No recipe value has a default here:
    each has one, the schema's."""

    temperature: float  # algorithm.temperature (evaluation: task.eval_temperature); 0: greedy
    top_p: float  # algorithm.top_p (1: off)
    top_k: int  # algorithm.top_k (0: off)
    min_p: float  # algorithm.min_p (0: off)
    max_tokens: int  # output tokens per sample: task.max_output_len, less a resumed sample's tokens
    stop: list[str]  # algorithm.stop: strings that end a completion, besides EOS
    seed: int | None = None  # per-request seed (train.reproducible_sampling, evaluation); None: unseeded
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks)


class Request(msgspec.Struct, array_like=True, kw_only=True):
    """Work for a generator: some (or all) samples of one prompt."""

    prompt_id: str
    prompt_token_ids: list[int]
    sample_indices: list[int]  # the samples to produce; after a re-dispatch, only the missing ones
    group_id: str = ""
    priority: int = 0  # lower is admitted first (vLLM's `priority` convention)
    # How to sample; None: a distillation teacher's scoring request (the teacher scores the prompt
    # with its own fixed settings, streamrl_cli.generator.teacher).
    sampling: Sampling | None = None
    # Appended fields (array_like: new ones go last, with defaults, so older peers still decode).
    batch_limit: int = 0  # sequences its generator runs at once (Algorithm 2's batch size); 0: no limit
    target: str = ""  # generator member id to send it to while that one is alive; "": the policy chooses
    # A cancellation, not work: drop whatever of `prompt_id` the generator still has (queued or
    # running); no sample of it is wanted any more (over-sampling's aborted groups). It travels in
    # the same acknowledged, ordered stream as the requests, so it never overtakes its request.
    cancel: bool = False
    # With `cancel`: send back what was generated so far (each sample's tokens, finish_reason
    # "abort") instead of dropping it: partial rollout pauses the group to resume it later.
    keep: bool = False
    # A multi-turn task: the row its environment starts from (the prompt's dataset columns and
    # "prompt", its text), for the environment's reset on the generator; {} for single-turn tasks.
    env: dict[str, Any] = {}
    # A multi-turn trajectory paused between turns ("<prompt id>/<sample index>" of its paused
    # sample): its generator goes on with it from its next turn if it still holds it, else (another
    # generator, or its state given up) runs it from the start. Sent whole either way.
    resume: str = ""


class Hello(msgspec.Struct, array_like=True):
    protocol: int
    generator: str  # member id; the trainer addresses requests by it
    session: str  # random per sender process: a new one means the old process is gone


class Welcome(msgspec.Struct, array_like=True):
    protocol: int
    session: str  # random per receiver process: a new one restarts the request sequence


def batch(seqs: list[int], items: list[bytes]) -> tuple[list[int], list[msgspec.Raw]]:
    """A batch body: already encoded items under their sequence numbers (spliced in, not re-encoded)."""
    return (seqs, [msgspec.Raw(d) for d in items])


def message(kind: bytes, body: Any) -> bytearray:
    """One message frame: the kind byte, then `body` encoded after it in the same allocation (no
    concatenation, so no second copy of a large body)."""
    frame = bytearray(kind)
    _enc.encode_into(body, frame, 1)
    return frame


def split(frame: bytes) -> tuple[bytes, memoryview]:
    """(kind, body) of a message frame; the body is a view, not a copy."""
    return frame[:1], memoryview(frame)[1:]


def encode_into(obj: Any, buffer: bytearray) -> None:
    """Encode `obj` into `buffer` (resized to fit), sparing the encoder's buffer growth per sample
    (~1 µs of a 1K-token sample's send() in bench/sample_stream.py)."""
    _enc.encode_into(obj, buffer)


_enc = msgspec.msgpack.Encoder()
_batch_dec = msgspec.msgpack.Decoder(tuple[list[int], list[msgspec.Raw]])


def decode_batch(data: bytes | memoryview) -> tuple[list[int], list[msgspec.Raw]]:
    """(seqs, items still encoded): items are decoded one by one, so one bad item spoils only itself.
    An item nested too deeply to skip is a FrameError (msgspec recurses to skip a Raw value)."""
    seqs, items = limits.decode(_batch_dec.decode, data, "a batch", max_bytes=MAX_MESSAGE, max_depth=None)
    if len(seqs) != len(items):
        raise ValueError(f"batch of {len(items)} items carries {len(seqs)} sequence numbers")
    return seqs, items


encode = _enc.encode
_sample_dec = msgspec.msgpack.Decoder(Sample)
_request_dec = msgspec.msgpack.Decoder(Request)
_seqs_dec = msgspec.msgpack.Decoder(list[int])
_int_dec = msgspec.msgpack.Decoder(int)
_hello_dec = msgspec.msgpack.Decoder(Hello)
_welcome_dec = msgspec.msgpack.Decoder(Welcome)


def decode_sample(data: bytes | memoryview) -> Sample:
    return _sample_dec.decode(data)


def decode_request(data: bytes | memoryview) -> Request:
    """A request; its free-form part (``env``) nests at most ``limits.MAX_DEPTH`` levels."""
    req = limits.decode(_request_dec.decode, data, "a request", max_bytes=MAX_MESSAGE, max_depth=None)
    limits.check_depth(req.env, "a request's environment row")
    return req


def decode_seqs(data: bytes | memoryview) -> list[int]:
    return _seqs_dec.decode(data)


def decode_int(data: bytes | memoryview) -> int:
    return _int_dec.decode(data)


def decode_hello(data: bytes | memoryview) -> Hello:
    return _hello_dec.decode(data)


def decode_welcome(data: bytes | memoryview) -> Welcome:
    return _welcome_dec.decode(data)


_str_dec = msgspec.msgpack.Decoder(str)


def decode_str(data: bytes | memoryview) -> str:
    return _str_dec.decode(data)
