"""`@FILE` arguments: overrides kept in a file, one per line (what `tune-split --write` writes).

    streamrl run local @tuned.overrides roles.generator.instances=2

Each line is one override exactly as it would be typed (no shell quoting); blank lines and lines
starting with ``#`` are skipped. A path is relative to the current directory. Files are expanded
where they stand, so a later override on the command line still wins over the file's.
"""

from __future__ import annotations

from pathlib import Path

from streamrl_cli.errors import UsageError


def parse(text: str) -> list[str]:
    """The overrides of one file's text."""
    return [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]


def expand(args: list[str], cwd: Path | None = None) -> list[str]:
    """``args`` with every ``@FILE`` replaced by the overrides in FILE."""
    out: list[str] = []
    for arg in args:
        if not arg.startswith("@"):
            out.append(arg)
            continue
        name = arg[1:]
        if not name:
            raise UsageError("`@` must be followed by a file of overrides, e.g. @tuned.overrides")
        path = Path(cwd or Path.cwd()) / Path(name).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(
                f"overrides file {name!r} not found (looked for {path}); `@FILE` names a file with "
                "one override per line, relative to the current directory"
            ) from None
        except IsADirectoryError:
            raise UsageError(f"overrides file {name!r} is a directory ({path})") from None
        except UnicodeDecodeError as e:
            raise UsageError(
                f"overrides file {path} is not UTF-8 text ({e.reason} at byte {e.start})"
            ) from None
        except OSError as e:
            raise UsageError(f"cannot read overrides file {path}: {e.strerror}") from None
        out += parse(text)
    return out
