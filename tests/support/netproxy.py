"""A TCP proxy on loopback that tests use to break connections and corrupt bytes in flight.

Each accepted connection is forwarded to the target by two threads (one per direction).
``tamper(conn, direction, offset, data)`` sees every block before it is forwarded: it returns
the bytes to forward (possibly altered) or None to cut that connection at that point.
``direction`` is "up" (client to server) or "down"; ``offset`` counts the bytes already
forwarded in that direction of that connection; ``conn`` numbers connections from 0.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

Tamper = Callable[[int, str, int, bytes], "bytes | None"]


class Proxy:
    def __init__(self, target: str, tamper: Tamper | None = None):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.tamper = tamper
        self.connections = 0
        self.cut = 0  # connections cut by `tamper` (not by cut_all)
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                n = self.connections
                self.connections += 1
                self._socks += [client, server]
            for src, dst, direction in ((client, server, "up"), (server, client, "down")):
                threading.Thread(target=self._pump, args=(n, direction, src, dst), daemon=True).start()

    def _pump(self, n: int, direction: str, src: socket.socket, dst: socket.socket) -> None:
        offset = 0
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if self.tamper is not None:
                    out = self.tamper(n, direction, offset, data)
                    if out is None:
                        with self._lock:
                            self.cut += 1
                        break
                    data = out
                offset += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            _hard_close(s)

    def cut_all(self) -> None:
        """Break every open connection now (as a network failure would)."""
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            _hard_close(s)

    def close(self) -> None:
        self._listener.close()
        self.cut_all()


def _hard_close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


def flip_byte_at(conn: int, direction: str, at: int) -> Tamper:
    """A tamper that flips one byte at stream offset `at` of one connection and direction, once."""
    done = threading.Event()

    def tamper(c: int, d: str, offset: int, data: bytes) -> bytes:
        if c == conn and d == direction and not done.is_set() and offset <= at < offset + len(data):
            done.set()
            i = at - offset
            return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
        return data

    return tamper


def cut_after(conn: int, direction: str, nbytes: int) -> Tamper:
    """A tamper that cuts one connection once `nbytes` went through in `direction`."""

    def tamper(c: int, d: str, offset: int, data: bytes) -> bytes | None:
        if c == conn and d == direction and offset + len(data) > nbytes:
            return None
        return data

    return tamper
