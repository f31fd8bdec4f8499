"""The cross-site weight protocol: framing, messages, the token handshake, checksums, codecs.

Why a protocol of our own on plain TCP: the relay must survive the things a long inter-site
link does — a connection reset halfway through 140 GB, a bit flipped by a middlebox — without
starting over, and run several streams at once to fill a long fat pipe. Each control message is
a 4-byte big-endian length and a msgpack body; a chunk's bytes follow its header raw, so they
can be received straight into the destination buffer.

    relay (client)                          trainer (server)
        connect ───────────────────────────►
                 ◄─────────── Challenge(nonce_s)
        Hello(nonce_c, HMAC(token, "client"|nonce_s|nonce_c)) ─►   (wrong MAC: Error, close)
                 ◄─────────── Welcome(HMAC(token, "server"|nonce_c|nonce_s))
        GetManifest(version) ──────────────►
                 ◄─────────── Manifest(version, tensors, total, chunk_bytes, checksum)
        GetChunks(version, [ids]) ─────────►
                 ◄─────────── ChunkHeader(id, codec, raw_len, wire_len, digest) + wire_len bytes, ...

The MACs prove both ends hold the run's token; the per-chunk digest (of the raw bytes, before
compression) detects corruption end to end. The link is not encrypted: weights of an open
model are not secret, and a private model's run should use a tunnel between its sites.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import zlib
from collections.abc import Callable
from typing import Any

import msgspec

from streamrl_cli.weights import WeightTransferError
from streamrl_cli.weights.plan import TensorSpec

PROTOCOL = 1
MAX_FRAME = 64 << 20  # a manifest of a huge model is a few MB; anything larger is garbage


class ProtocolError(WeightTransferError):
    """The peer sent something that is not the protocol: drop the connection and reconnect."""


class Challenge(msgspec.Struct, tag=True):
    protocol: int
    nonce: bytes


class Hello(msgspec.Struct, tag=True):
    nonce: bytes
    mac: bytes


class Welcome(msgspec.Struct, tag=True):
    mac: bytes


class GetManifest(msgspec.Struct, tag=True):
    version: int = -1  # -1: the latest published


class Manifest(msgspec.Struct, tag=True):
    version: int
    total: int  # bytes in the stream
    chunk_bytes: int
    checksum: str  # algorithm of ChunkHeader.digest
    tensors: list[TensorSpec]


class GetChunks(msgspec.Struct, tag=True):
    version: int
    ids: list[int]


class ChunkHeader(msgspec.Struct, tag=True):
    version: int
    id: int
    codec: str  # "none" | "zlib" | "zstd": how the wire_len bytes that follow are encoded
    raw_len: int
    wire_len: int
    digest: bytes  # checksum of the raw (decoded) bytes


class Error(msgspec.Struct, tag=True):
    code: str  # unauthorized | no_version | superseded | bad_request
    message: str
    current: int = -1  # the version the server serves now


Message = Challenge | Hello | Welcome | GetManifest | Manifest | GetChunks | ChunkHeader | Error
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Message)


class Conn:
    """A framed connection (blocking socket with a timeout: a silent peer counts as broken)."""

    def __init__(self, sock: socket.socket, timeout: float):
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.bytes_in = 0

    def send(self, *msgs: Message) -> None:
        self.sock.sendall(b"".join(struct.pack(">I", len(b)) + b for b in map(_enc.encode, msgs)))

    def send_raw(self, data: Any) -> None:
        self.sock.sendall(data)

    def recv(self) -> Message:
        (n,) = struct.unpack(">I", self.recv_exact(4))
        if n > MAX_FRAME:
            raise ProtocolError(f"frame of {n} bytes announced; not our protocol or out of step")
        try:
            return _dec.decode(self.recv_exact(n))
        except msgspec.DecodeError as e:
            raise ProtocolError(f"undecodable frame: {e}") from None

    def recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        self.recv_into(memoryview(buf))
        return bytes(buf)

    def recv_into(self, view: memoryview) -> None:
        pos, n = 0, len(view)
        while pos < n:
            got = self.sock.recv_into(view[pos:], n - pos)
            if not got:
                raise ConnectionError("peer closed the connection")
            pos += got
        self.bytes_in += n

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _mac(token: str, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(
        token.encode(), b"streamrl-relay/" + label + b"|" + b"|".join(parts), hashlib.sha256
    ).digest()


def server_handshake(conn: Conn, token: str) -> bool:
    """Challenge the client; True if it proved it holds the token (we then prove it back).

    On False the caller answers ``Error("unauthorized", ...)``, after counting the refusal.
    """
    nonce_s = os.urandom(16)
    conn.send(Challenge(PROTOCOL, nonce_s))
    msg = conn.recv()
    if not isinstance(msg, Hello) or not hmac.compare_digest(
        msg.mac, _mac(token, b"client", nonce_s, msg.nonce)
    ):
        return False
    conn.send(Welcome(_mac(token, b"server", msg.nonce, nonce_s)))
    return True


def client_handshake(conn: Conn, token: str) -> None:
    msg = conn.recv()
    if not isinstance(msg, Challenge) or msg.protocol != PROTOCOL:
        raise ProtocolError(f"expected a protocol {PROTOCOL} challenge, got {type(msg).__name__}")
    nonce_c = os.urandom(16)
    conn.send(Hello(nonce_c, _mac(token, b"client", msg.nonce, nonce_c)))
    answer = conn.recv()
    if isinstance(answer, Error):
        raise WeightTransferError(f"relay server refused us: {answer.code}: {answer.message}")
    if not isinstance(answer, Welcome) or not hmac.compare_digest(
        answer.mac, _mac(token, b"server", nonce_c, msg.nonce)
    ):
        raise WeightTransferError("the relay server could not prove it holds this run's token")


# ---- checksums: name -> function(bytes-like) -> digest ----


def _crc32(data: Any) -> bytes:
    return zlib.crc32(data).to_bytes(4, "big")


def _blake2b(data: Any) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


CHECKSUMS: dict[str, Callable[[Any], bytes]] = {"crc32": _crc32, "blake2b": _blake2b}
try:  # xxhash is a dependency (setup.cfg); crc32 stays as the fallback where it is missing
    import xxhash

    CHECKSUMS["xxh3_64"] = lambda data: xxhash.xxh3_64_digest(data)
except ImportError:
    pass


def default_checksum() -> str:
    """xxh3_64 (~26 GiB/s here) if installed, else crc32 (~5.6 GiB/s): bench/weight_relay.py."""
    return "xxh3_64" if "xxh3_64" in CHECKSUMS else "crc32"


def checksum_fn(name: str) -> Callable[[Any], bytes]:
    try:
        return CHECKSUMS[name]
    except KeyError:
        raise WeightTransferError(
            f"checksum {name!r} is not available here; have {sorted(CHECKSUMS)}"
        ) from None


# ---- codecs ----


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise WeightTransferError(
            "compression 'zstd' needs the zstandard package (pip install zstandard)"
        ) from None
    return zstandard


def compress(codec: str, data: Any) -> bytes:
    if codec == "zlib":
        return zlib.compress(data, 1)
    if codec == "zstd":
        return _zstd().ZstdCompressor(level=1).compress(data)
    raise WeightTransferError(f"unknown compression {codec!r}; valid: none, zlib, zstd")


def decompress(codec: str, data: bytes, raw_len: int) -> bytes:
    if codec == "zlib":
        return zlib.decompress(data, bufsize=raw_len)
    if codec == "zstd":
        return _zstd().ZstdDecompressor().decompress(data, max_output_size=raw_len)
    raise ProtocolError(f"chunk encoded with unknown codec {codec!r}")
