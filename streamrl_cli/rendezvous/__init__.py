"""The run's control plane: one small HTTP rendezvous server per run, and its client.

Every role of a run (trainer, generators, relays) registers here, heartbeats, reports
metrics and learns about the others; the trainer announces weight versions through it and
``streamrl status`` reads it. It is HTTP so that it crosses sites and firewalls and can be
inspected with curl, every call carries the run's secret token, and its state survives a
restart of the server (see ``state.py``).

Files it owns inside a run directory (their paths come from ``streamrl_cli.rundir.RunDir``):
the token (``secret``, mode 0600, written by the launcher through :func:`create_secret`), where
the server listens (``endpoint``, written atomically when ready), one line per metrics record
posted by any member (``metrics``), and its journal and snapshot (``rendezvous_state``).

The modules import lazily so that ``import streamrl_cli.rendezvous`` stays cheap: the
server does not need httpx, and the client does not need aiohttp.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl_cli.errors import RendezvousError
from streamrl_cli.rundir import RunDir

if TYPE_CHECKING:
    from streamrl_cli.rendezvous.client import RendezvousClient, RendezvousRequestError
    from streamrl_cli.rendezvous.server import serve

# Shorter tokens are refused: the token is the only thing between the internet and the run.
MIN_TOKEN_CHARS = 16

__all__ = [
    "RendezvousClient",
    "RendezvousRequestError",
    "create_secret",
    "read_secret",
    "serve",
]


def create_secret(run_dir: Path) -> str:
    """Create ``run_dir/secret`` with a fresh random token (mode 0600) and return the token.

    The file is created with O_EXCL so that an existing run's token is never overwritten.
    """
    path = RunDir(Path(run_dir)).secret
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def read_secret(run_dir: Path) -> str:
    """Read the run's token from ``run_dir/secret``, refusing a file others can read."""
    path = RunDir(Path(run_dir)).secret
    try:
        mode = path.stat().st_mode
        token = path.read_text().strip()
    except FileNotFoundError:
        raise RendezvousError(
            f"{path} does not exist; the launcher creates it (streamrl_cli.rendezvous.create_secret)"
        ) from None
    except OSError as e:
        raise RendezvousError(f"cannot read the run token {path}: {e}") from None
    if stat.S_IMODE(mode) & 0o077:
        raise RendezvousError(
            f"{path} has mode {stat.S_IMODE(mode):04o}, readable by other users; run `chmod 600 {path}`"
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise RendezvousError(f"{path} holds a token of {len(token)} characters; need >= {MIN_TOKEN_CHARS}")
    return token


def __getattr__(name: str) -> Any:
    # Lazy re-exports: importing the package must not pull in aiohttp or httpx.
    if name in ("RendezvousClient", "RendezvousRequestError"):
        from streamrl_cli.rendezvous import client

        return getattr(client, name)
    if name == "serve":
        from streamrl_cli.rendezvous import server

        return server.serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
