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
        GetManifest(version, base, server) ►   (base: the version the relay holds, -1: none)
                 ◄─────────── Manifest(version, tensors, total, chunk_bytes, checksum, server,
                                       base, delta, full_reason)
        GetChunks(version, [ids], base) ───►
                 ◄─────────── ChunkHeader(id, codec, raw_len, wire_len, digest, base) + wire_len bytes, ...

A relay that holds a version bit for bit (``base``, from the server instance ``server``) may be
answered with the delta against it (``relay_delta``): the manifest then says ``base`` and how to
rebuild each tensor (``delta``), and the chunks are those of the delta stream. Otherwise it is
the whole version, and ``full_reason`` says why when a delta was asked for.

The MACs prove both ends hold the run's token. Until they are checked, a frame may be at most
``PREAUTH_MAX_FRAME`` bytes: a stranger cannot make the server allocate anything large. From
Welcome on, every frame and every chunk payload is sealed with AES-128-GCM under keys derived
(HKDF-SHA256) from the token and both nonces, one key per direction, the nonce a per-direction
frame counter: the manifest, the chunk headers and the weights are encrypted and authenticated
(a proxy that shifts an offset or swaps two names is detected), and a frame replayed or
reordered fails its tag. A sealed frame is its 4-byte length (bound into the tag as associated
data) and ciphertext + 16-byte tag; a chunk payload is wire_len + 16 bytes after its header.
The per-chunk digest (of the raw bytes, before compression) still checks end to end what was
reassembled; a chunk whose tag fails is asked again like a corrupted one (the stream stays in
step: its length came in an authenticated header).
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
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from streamrl_cli import limits
from streamrl_cli.weights import WeightTransferError
from streamrl_cli.weights.plan import TensorSpec
from streamrl_cli.weights.relay_delta import TensorDelta

PROTOCOL = 3  # 2: sealed frames (AES-GCM) after the handshake; 3: delta versions (relay_delta)
MAX_FRAME = limits.RELAY_FRAME  # a manifest of a huge model is a few MB; anything larger is garbage
PREAUTH_MAX_FRAME = limits.RELAY_PREAUTH_FRAME  # Challenge, Hello, Welcome, Error are < 200 bytes
TAG = 16  # AES-GCM tag bytes
SEAL_SLICE = 1 << 20  # chunk payloads are sealed and opened this many bytes at a time


# Why a relay that asked for a delta got the whole version (Manifest.full_reason; the fetcher adds
# the ones it decides itself, and its stats["reason"] carries them all).
FULL_REASONS = {
    "no_base": "the relay holds no version yet (it just started, or just took over as relay)",
    "off": "deltas are off (roles.generator.relay_sync: full)",
    "new_server": "the relay's version came from an earlier trainer process",
    "base_gone": "the server has no delta from the relay's version (it keeps one: from the version before)",
    "not_smaller": "the delta was not smaller than the whole version",
    "checksum": "a tensor rebuilt from the delta failed its digest: fetched whole instead",
}


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
    base: int = -1  # the version the client holds bit for bit, to be sent a delta against (-1: none)
    server: bytes = b""  # the server instance `base` came from (Manifest.server)


class Manifest(msgspec.Struct, tag=True):
    version: int
    total: int  # bytes in the stream the chunks cut: the whole version, or its delta against `base`
    chunk_bytes: int
    checksum: str  # algorithm of ChunkHeader.digest
    tensors: list[TensorSpec]  # where each tensor lies in the whole version
    server: bytes = b""  # this server instance (a restarted trainer's is another)
    base: int = -1  # -1: the stream is the whole version; else its delta against this version
    delta: list[TensorDelta] = []  # with `base`: per tensor, how to rebuild it and its digest
    full_reason: str = ""  # a delta was asked for, and this is the whole version: why


class GetChunks(msgspec.Struct, tag=True):
    version: int
    ids: list[int]
    base: int = -1  # the stream: the whole version (-1), or the delta against this version


class ChunkHeader(msgspec.Struct, tag=True):
    version: int
    id: int
    codec: str  # "none" | "zlib" | "zstd": how the wire_len bytes that follow are encoded
    raw_len: int
    wire_len: int
    digest: bytes  # checksum of the raw (decoded) bytes
    base: int = -1  # GetChunks.base: which stream the chunk is of


class Error(msgspec.Struct, tag=True):
    code: str  # unauthorized | no_version | superseded | bad_request
    message: str
    current: int = -1  # the version the server serves now


Message = Challenge | Hello | Welcome | GetManifest | Manifest | GetChunks | ChunkHeader | Error
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Message)


def _decode(body: bytes) -> Message:
    """A frame's message, or ProtocolError (an unknown field nested deeply makes msgspec recurse; a
    string that is not UTF-8 makes it raise UnicodeDecodeError)."""
    try:
        return _dec.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"undecodable frame: {e}") from None
    except RecursionError:
        raise ProtocolError(f"undecodable frame: nested deeper than {limits.MAX_DEPTH} levels") from None


class Conn:
    """A framed connection (blocking socket with a timeout: a silent peer counts as broken).

    Plain (and limited to ``PREAUTH_MAX_FRAME``) until :meth:`secure` is called after the
    handshake; sealed with AES-GCM from then on.
    """

    def __init__(self, sock: socket.socket, timeout: float):
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.bytes_in = 0
        self.max_frame = PREAUTH_MAX_FRAME
        self._tx: AESGCM | None = None
        self._tx_key = self._rx_key = b""
        self._tx_n = self._rx_n = 0
        self._scratch = bytearray()

    def secure(self, tx_key: bytes, rx_key: bytes) -> None:
        self._tx, self._tx_key, self._rx_key = AESGCM(tx_key), tx_key, rx_key
        self.max_frame = MAX_FRAME + TAG

    @property
    def sealed(self) -> bool:
        return self._tx is not None

    def _next_tx_nonce(self) -> bytes:
        self._tx_n += 1
        return self._tx_n.to_bytes(12, "big")

    def _next_rx_nonce(self) -> bytes:
        self._rx_n += 1
        return self._rx_n.to_bytes(12, "big")

    def _frame(self, body: bytes) -> bytes:
        if self._tx is None:
            return _plain(body)
        head = struct.pack(">I", len(body) + TAG)
        return head + self._tx.encrypt(self._next_tx_nonce(), body, head)

    def send(self, *msgs: Message) -> None:
        self.sock.sendall(b"".join(self._frame(b) for b in map(_enc.encode, msgs)))

    def send_raw(self, data: Any) -> None:
        """A chunk payload: sealed (ciphertext + tag, no length: the header gave it) once secured."""
        if self._tx is None:
            self.sock.sendall(data)
            return
        # In slices through one scratch buffer kept per connection: each slice is sealed while
        # it is in cache and on the wire before the next one is sealed, so the peer decrypts
        # slice k while we seal slice k+1 (a whole 8 MiB chunk sealed, then sent, ran the two
        # ends one after the other: bench/weight_relay.py).
        src = memoryview(data).cast("B")
        n = len(src)
        if len(self._scratch) < SEAL_SLICE + TAG:
            self._scratch = bytearray(SEAL_SLICE + TAG)
        out = memoryview(self._scratch)
        enc = Cipher(algorithms.AES(self._tx_key), modes.GCM(self._next_tx_nonce())).encryptor()
        for start in range(0, n, SEAL_SLICE):
            done = enc.update_into(src[start : start + SEAL_SLICE], out)
            self.sock.sendall(out[:done])
        enc.finalize()
        self.sock.sendall(enc.tag)

    def recv(self) -> Message:
        head = self.recv_exact(4)
        (n,) = struct.unpack(">I", head)
        if n > self.max_frame:
            raise ProtocolError(
                f"frame of {n} bytes announced (limit {self.max_frame}"
                f"{'' if self.sealed else ' before authentication'}); not our protocol or out of step"
            )
        body = self.recv_exact(n)
        if self._tx is not None:
            try:
                body = AESGCM(self._rx_key).decrypt(self._next_rx_nonce(), body, head)
            except (InvalidTag, ValueError):
                raise ProtocolError("a frame failed authentication (tampered or corrupted)") from None
        return _decode(body)

    def recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        self._recv_into(memoryview(buf))
        return bytes(buf)

    def recv_payload(self, n: int) -> bytes | None:
        """A chunk payload of `n` bytes; None when its tag fails (the stream stays in step)."""
        if self._tx is None:
            return self.recv_exact(n)
        buf = bytearray(n)
        return bytes(buf) if self.recv_payload_into(memoryview(buf)) else None

    def recv_payload_into(self, view: memoryview) -> bool:
        """Receive a chunk payload straight into `view`, decrypting it there; False if its tag fails.

        Sealed payloads are received and decrypted a slice at a time (while the slice is in
        cache, and while the sender seals the next one), in place: OpenSSL's GCM allows
        output == input. update_into wants room for a block more than it is given, so the last
        15 bytes go through a small scratch buffer.
        """
        if self._tx is None:
            self._recv_into(view)
            return True
        n = len(view)
        cut = max(0, n - 15)
        dec = Cipher(algorithms.AES(self._rx_key), modes.GCM(self._next_rx_nonce())).decryptor()
        pos = 0  # bytes decrypted so far (GCM returns what it is given: pos ends at cut)
        for start in range(0, n, SEAL_SLICE):
            end = min(n, start + SEAL_SLICE)
            self._recv_into(view[start:end])
            if start < cut:
                pos += dec.update_into(view[start : min(end, cut)], view[pos:])
        tail = bytearray(32)
        m = dec.update_into(view[cut:], tail) if n > cut else 0
        view[pos : pos + m] = tail[:m]
        try:  # the tag follows the payload; GCM checks it last
            dec.finalize_with_tag(self.recv_exact(TAG))
        except InvalidTag:
            return False
        return True

    def _recv_into(self, view: memoryview) -> None:
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


def session_keys(token: str, nonce_s: bytes, nonce_c: bytes) -> tuple[bytes, bytes]:
    """(client-to-server, server-to-client) AES-128 keys for one connection."""
    okm = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=nonce_s + nonce_c, info=b"streamrl-relay/keys"
    ).derive(token.encode())
    return okm[:16], okm[16:]


def _mac(token: str, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(
        token.encode(), b"streamrl-relay/" + label + b"|" + b"|".join(parts), hashlib.sha256
    ).digest()


def _plain(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


class ServerHandshake:
    """The server's half of the handshake, without I/O: the relay server runs the handshakes of
    every connection not yet authenticated on one thread (``relay_gate``), so a stranger who
    connects and says nothing costs a socket, not a thread.

    ``challenge()`` is sent at once; the client's bytes go to ``feed()`` until it returns its
    first frame; ``answer()`` then gives the Welcome and the session keys, or None when the
    client did not prove it holds the token (answer ``refusal()``).
    """

    def __init__(self, token: str):
        self.token, self.nonce = token, os.urandom(16)
        self._buf = bytearray()

    def challenge(self) -> bytes:
        return _plain(_enc.encode(Challenge(PROTOCOL, self.nonce)))

    def feed(self, data: bytes) -> Message | None:
        """The client's first frame once it is whole; ProtocolError when the bytes are not our protocol."""
        self._buf += data
        if len(self._buf) < 4:
            return None
        (n,) = struct.unpack_from(">I", self._buf)
        if n > PREAUTH_MAX_FRAME:
            raise ProtocolError(f"frame of {n} bytes announced before authentication")
        if len(self._buf) > 4 + n:  # an honest client waits for the Welcome before saying more
            raise ProtocolError("bytes after the first frame, before the handshake ended")
        if len(self._buf) < 4 + n:
            return None
        return _decode(bytes(self._buf[4:]))

    def answer(self, msg: Message) -> tuple[bytes, bytes, bytes] | None:
        """(Welcome frame, server-to-client key, client-to-server key) if `msg` proves the token."""
        if not isinstance(msg, Hello) or not hmac.compare_digest(
            msg.mac, _mac(self.token, b"client", self.nonce, msg.nonce)
        ):
            return None
        c2s, s2c = session_keys(self.token, self.nonce, msg.nonce)
        welcome = _plain(_enc.encode(Welcome(_mac(self.token, b"server", msg.nonce, self.nonce))))
        return welcome, s2c, c2s

    @staticmethod
    def refusal() -> bytes:
        return _plain(_enc.encode(Error("unauthorized", "the relay client does not hold this run's token")))


def client_handshake(conn: Conn, token: str) -> None:
    msg = conn.recv()
    if isinstance(msg, Challenge) and msg.protocol != PROTOCOL:
        raise WeightTransferError(
            f"the relay server speaks protocol {msg.protocol}, this relay {PROTOCOL}: "
            "run the same StreamRL version at both sites"
        )
    if not isinstance(msg, Challenge):
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
    c2s, s2c = session_keys(token, msg.nonce, nonce_c)
    conn.secure(tx_key=c2s, rx_key=s2c)


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
