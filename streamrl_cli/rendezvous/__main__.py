"""``python -m streamrl_cli.rendezvous``: the rendezvous server as its own process.

``streamrl run`` starts it on the submitting host (or as a small job of its own). The token
is read from ``RUN_DIR/secret``, never from argv or the environment, so it never shows in
``ps`` or in a job's recorded environment. Argument parsing is plain argparse: the server
process should start fast and need nothing beyond aiohttp and msgspec.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from streamrl_cli.errors import StreamRLError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m streamrl_cli.rendezvous", description="Run the rendezvous server of one StreamRL run."
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        required=True,
        help="the run directory (holds 'secret'; receives rendezvous.json, metrics, journal)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default)")
    p.add_argument(
        "--lease-s",
        type=float,
        default=10.0,
        help="a member silent for longer than this is marked lost (default 10)",
    )
    p.add_argument("--tls-cert", type=Path, help="PEM certificate (chain): serve HTTPS")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    from streamrl_cli.rendezvous.server import serve  # after parsing: `--help` stays instant

    try:
        serve(
            args.run_dir,
            host=args.host,
            port=args.port,
            lease_s=args.lease_s,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        )
    except StreamRLError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
