"""The rendezvous wire protocol: request schemas and their validation, error documents.

Kept apart from the handlers so that what a valid request is can be read in one place
(``docs/rendezvous-api.md`` follows it). Every way a request can be wrong ends in an
:class:`ApiError`, which the server turns into a 4xx JSON document naming what is wrong
and, for bodies, showing a valid example. Bodies are decoded with msgspec Structs that
forbid unknown fields, so a misspelt field is an error rather than silently ignored.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

import msgspec
from aiohttp import web

from streamrl_cli import limits

MAX_BODY = limits.RENDEZVOUS_BODY  # a register body with engine info fits in a few KiB
MAX_RECORD = 16 * 1024  # metrics and progress documents are meant to be small
MAX_TRANSFER = 128 * 1024  # a proposal's transfer document: a weight group layout, ~20 bytes per rank
MAX_KEYS = 64
MAX_DEPTH = 8  # free-form documents are journaled with the json module: keep them shallow
MAX_POLL_S = 60.0
MAX_BODY_DEPTH = limits.MAX_DEPTH  # any body, before the free-form documents' own MAX_DEPTH is checked
# HTTP status of each state-machine refusal (state.Rejected.code); anything else is 409.
REJECT_STATUS = {"unknown_member": 404, "unknown_version": 404, "member_left": 410}

Name = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")]
Label = Annotated[str, msgspec.Meta(max_length=255)]
MemberId = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
Version = Annotated[int, msgspec.Meta(ge=0)]
Incarnation = Annotated[int, msgspec.Meta(ge=1)]
# What /v1/register returned to this member's process: its later calls in its own name carry it.
Credential = Annotated[str, msgspec.Meta(max_length=128)]


class RegisterBody(msgspec.Struct, forbid_unknown_fields=True):
    role: Name
    rank: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]  # or the SLURM array index
    cluster: Label = ""
    host: Label = ""
    site: Label = ""
    addresses: dict[Name, Label] = msgspec.field(default_factory=dict)  # name -> "host:port"
    info: dict[str, Any] = msgspec.field(default_factory=dict)  # engine, device, ...


class HeartbeatBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    member_id: MemberId
    credential: Credential = ""
    incarnation: Annotated[int, msgspec.Meta(ge=1)] | None = None
    weight_version: Version | None = None
    state: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    # Why the member cannot do its job (shown by `streamrl status`); "" clears it.
    error: Annotated[str, msgspec.Meta(max_length=1000)] | None = None


class LeaveBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    member_id: MemberId
    credential: Credential = ""
    reason: Label = ""


class ProposeBody(msgspec.Struct, forbid_unknown_fields=True):
    version: Version
    required_roles: Annotated[list[Name], msgspec.Meta(min_length=1, max_length=MAX_KEYS)]
    # Who it is sent to (member_id -> incarnation): only they must confirm. Default: every alive member.
    members: Annotated[dict[MemberId, Incarnation], msgspec.Meta(min_length=1)] | None = None
    transfer: dict[str, Any] | None = None  # how they get it (e.g. the weight group layout), passed on


class ConfirmBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    member_id: MemberId
    credential: Credential = ""
    version: Version


class ScaleBody(msgspec.Struct, forbid_unknown_fields=True):
    role: Name  # the role to scale (only "generator" is elastic)
    instances: Annotated[int, msgspec.Meta(ge=0, le=100_000)]  # instances wanted
    source: Annotated[str, msgspec.Meta(pattern=r"^(user|policy)$")] = "user"
    reason: Label = ""


class MetricsBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    member_id: MemberId
    credential: Credential = ""
    record: Annotated[dict[str, Any], msgspec.Meta(max_length=MAX_KEYS)]


# What a valid body looks like, sent back with every validation error.
EXAMPLES: dict[str, dict[str, Any]] = {
    "/v1/register": {
        "role": "generator",
        "rank": 0,
        "cluster": "h20",
        "host": "node12",
        "site": "siteB",
        "addresses": {"samples": "node12:29500"},
        "info": {"engine": "vllm", "device": "H20"},
    },
    "/v1/heartbeat": {
        "member_id": "generator-0",
        "credential": "<from /v1/register>",
        "incarnation": 1,
        "weight_version": 3,
        "state": "generating",
        "error": "",
    },
    "/v1/leave": {"member_id": "generator-0", "credential": "<from /v1/register>", "reason": "done"},
    "/v1/versions/propose": {"version": 4, "required_roles": ["generator"]},
    "/v1/versions/confirm": {"member_id": "generator-0", "credential": "<from /v1/register>", "version": 4},
    "/v1/metrics": {
        "member_id": "generator-0",
        "credential": "<from /v1/register>",
        "record": {"step": 12, "tokens_per_s": 5300.0},
    },
    "/v1/progress": {"step": 12, "samples": 12288},
    "/v1/scale": {"role": "generator", "instances": 3, "source": "user", "reason": "more throughput"},
}
RESERVED_METRIC_KEYS = {"time", "member_id", "role", "rank"}  # metrics.jsonl adds these itself


class ApiError(Exception):
    """A request the server cannot accept: HTTP status, stable code, message, extra fields."""

    def __init__(self, status: int, code: str, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.code, self.extra = status, code, extra


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json")


def error_response(status: int, code: str, message: str, **extra: Any) -> web.Response:
    return json_response({"error": code, "message": message, **extra}, status)


def invalid(path: str, message: str) -> ApiError:
    return ApiError(422, "invalid_body", f"invalid body: {message}", expected=EXAMPLES[path])


async def decode_body(request: web.Request, typ: Any) -> Any:
    """The request's JSON body as `typ`, or an ApiError saying what is wrong with it."""
    example = {"expected": EXAMPLES[request.path]}
    if request.content_type != "application/json":
        got = request.headers.get("Content-Type", "none")
        raise ApiError(
            415, "unsupported_media_type", f"Content-Type must be application/json, got {got!r}", **example
        )
    raw = await request.read()  # raises 413 past the application's client_max_size
    try:
        return msgspec.convert(clean(msgspec.json.decode(raw)), type=typ)
    except msgspec.ValidationError as e:
        raise invalid(request.path, str(e)) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # msgspec lets bad UTF-8 in strings through
        raise ApiError(400, "invalid_json", f"the body is not a JSON document: {e}", **example) from None
    except RecursionError:
        raise ApiError(400, "invalid_json", "the body is nested too deeply", **example) from None


# What members' strings must not carry into metrics.jsonl, the journal, logs or a terminal: C0/C1
# control characters (ANSI escapes start with ESC), DEL, the line and paragraph separators (a
# JSON line reader may split on them), bidirectional overrides (text that reads other than it
# is) and lone surrogates (not encodable as UTF-8). Each is replaced by its visible \uXXXX form.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def clean_text(s: str) -> str:
    return _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", s)


def clean(obj: Any, depth: int = 0) -> Any:
    """`obj` (decoded JSON) with every string, keys included, made safe by :func:`clean_text`."""
    if depth > MAX_BODY_DEPTH:
        raise ApiError(400, "invalid_json", f"the body nests deeper than {MAX_BODY_DEPTH} levels")
    if isinstance(obj, str):
        return clean_text(obj)
    if isinstance(obj, dict):
        return {clean_text(k): clean(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clean(v, depth + 1) for v in obj]
    return obj


def check_addresses(path: str, addresses: dict[str, str]) -> None:
    for name, addr in addresses.items():
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise invalid(path, f"addresses.{name} = {addr!r} is not 'host:port' with a port in 1..65535")


def check_document(
    doc: dict[str, Any], what: str, path: str, reserved: set[str], max_bytes: int = MAX_RECORD
) -> None:
    """A free-form document (info, metrics, progress): small, flat-ish, no keys the server sets."""
    bad = sorted(reserved & set(doc))
    size = len(msgspec.json.encode(doc))
    if bad:
        why = f"uses reserved key(s) {bad}"
    elif size > max_bytes or len(doc) > MAX_KEYS:
        why = f"is too large ({size} bytes, {len(doc)} keys)"
    elif limits.depth(doc, MAX_DEPTH) > MAX_DEPTH:
        why = f"nests deeper than {MAX_DEPTH} levels"
    else:
        return
    bounds = f"{max_bytes} bytes, {MAX_KEYS} keys and {MAX_DEPTH} levels"
    raise invalid(path, f"{what} {why}; keep it under {bounds}, without {sorted(reserved)}")


def check_progress(path: str, doc: dict[str, Any]) -> None:
    step = doc.get("step")
    if type(step) is not int or not 0 <= step < 2**63:  # type(): a JSON true must not pass as 1
        raise invalid(path, f"'step' must be an integer in 0..2**63-1, got {step!r}")
    check_document(doc, "body", path, reserved={"updated"})


def parse_query(request: web.Request, allowed: set[str]) -> dict[str, str]:
    unknown = sorted(set(request.query) - allowed)
    if unknown:
        raise ApiError(
            400,
            "invalid_query",
            f"unknown query parameter(s) {unknown} for {request.path}; valid: {sorted(allowed)}",
        )
    return dict(request.query)


def query_number(q: dict[str, str], key: str, typ: type, default: Any, lo: float, hi: float | None) -> Any:
    """Query parameter `key` as `typ` within [lo, hi], or an ApiError naming the valid range."""
    if key not in q:
        return default
    try:
        value = typ(q[key])
        ok = math.isfinite(value) and value >= lo and (hi is None or value <= hi)
    except ValueError:
        ok = False
    if not ok:
        bound = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ApiError(
            400, "invalid_query", f"query parameter {key}={q[key]!r} must be {typ.__name__} {bound}"
        )
    return value
