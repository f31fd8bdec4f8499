"""`python -m streamrl_cli.roles SPEC.yaml [--rank N]`: how the local launcher starts a role."""

from __future__ import annotations

import argparse

from streamrl_cli.roles.entry import run_role


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m streamrl_cli.roles")
    parser.add_argument("spec", help="run_dir/roles/<role>.yaml")
    parser.add_argument("--rank", type=int, default=None, help="rank (default: from SLURM's environment)")
    args = parser.parse_args()
    run_role(args.spec, args.rank)


if __name__ == "__main__":
    main()
