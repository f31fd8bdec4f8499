"""The command line itself: --version, usage errors, @FILE overrides. Run as a user runs it."""

from __future__ import annotations

import pytest
from support.helpers import streamrl

from streamrl_cli import __version__
from streamrl_cli.errors import UsageError
from streamrl_cli.recipe.argfiles import expand, parse

# Every one of these is the user's mistake: exit 2, one message, never a traceback.
BAD = [
    (["--bogus"], "No such option: --bogus"),
    (["run", "--bogus"], "No such option: --bogus"),
    (["run", "local", "--dry-run=yes"], "does not take a value"),
    (["bogus"], "No such command 'bogus'"),
    (["statu"], "Did you mean 'status'"),
    (["cancel"], "Missing argument 'RUN'"),
    (["plot"], "Missing argument 'RUN'"),
    (["show"], "Missing argument 'RECIPE'"),
    (["status", "--interval", "abc"], "Invalid value for '--interval'"),
    (["status", "a", "b"], "unexpected extra argument"),
    (["recipes", "extra"], "unexpected extra argument"),
    (["run", "local", "--root"], "requires an argument"),
    (["rank", "local", "--limit", "0"], "Invalid value for '--limit'"),
    (["tune-split", "local", "--top", "many"], "Invalid value for '--top'"),
    (["run"], "missing RECIPE"),
    (["run", "local", "--resume", "some-run"], "--resume RUN continues a run with its own recipe"),
    (["run", "local", "@no-such.overrides"], "overrides file 'no-such.overrides' not found"),
    (["show", "no-such-recipe"], "no recipe file or shipped recipe named 'no-such-recipe'"),
    (["show", "local", "roles.generator.instance=4"], "unknown key 'roles.generator.instance'"),
    (["status", "no-such-run"], "no run matches 'no-such-run'"),
    (["cancel", "no-such-run"], "no run matches 'no-such-run'"),
    # numbers past what any cluster means: `tune-split --gpus 2**80` was an internal OverflowError
    (["tune-split", "local", "--gpus", str(2**80)], "Invalid value for '--gpus'"),
    (["tune-split", "local", "--sites", f"h800:{2**80}"], "more than the 2,097,152 of the largest clusters"),
    (["status", "x", "--watch", "--interval", "1e400"], "Invalid value for '--interval'"),
    (["export", "x", "--out", "y", "--iteration", "-1"], "Invalid value for '--iteration'"),
    (["scale", "x", "--generators", "3", "--wait", "1e400"], "Invalid value for '--wait'"),
]


@pytest.mark.parametrize(("args", "says"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_invocation_exits_2_with_one_clear_message(args, says, tmp_path):
    out = streamrl(*args, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "Traceback" not in text
    assert says in " ".join(out.stderr.split()), out.stderr
    assert out.stderr.startswith("error:"), out.stderr
    if not says.startswith(("unknown key", "no recipe")):  # recipe errors list every problem
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_profile_batch_past_any_engine_is_refused_before_anything_starts(tmp_path):
    out = streamrl("profile", "local", "--batches", f"1,{2**70}", cwd=tmp_path)
    assert out.returncode != 0 and "Traceback" not in out.stdout + out.stderr
    assert "batch sizes must be in 1..65,536" in out.stderr and not list(tmp_path.iterdir())


def test_usage_errors_point_at_the_commands_help(tmp_path):
    out = streamrl("run", "--bogus", cwd=tmp_path)
    assert "(see `streamrl run --help`)" in out.stderr


def test_version():
    out = streamrl("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"streamrl {__version__}"


def test_no_command_shows_the_help():
    out = streamrl()
    assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr
    assert "Usage: streamrl" in out.stdout and "status" in out.stdout


@pytest.mark.parametrize(
    "command",
    ["", "run", "cancel", "scale", "status", "plot", "export", "show", "recipes", "tune-split", "profile",
     "rank"],
)  # fmt: skip
def test_help_reads_cleanly_at_80_columns(command):
    """Typer's rich help wrote `<bool>` beside every flag (`--version <bool>`), `[[RECIPE]]`, and cut the
    command list's descriptions mid-sentence at 80 columns."""
    out = streamrl(*([command] if command else []), "--help", env={"COLUMNS": "80"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    assert "<bool>" not in out.stdout and "[[" not in out.stdout
    commands = out.stdout.partition("Commands:")[2]
    assert not any(line.endswith("...") for line in commands.splitlines())  # no description cut short


# --- @FILE -------------------------------------------------------------------------------------


def test_parse_skips_comments_and_blank_lines():
    text = "# written by tune-split\n\n  a.b=1  \n# c=2\n+d.e=x y\n"
    assert parse(text) == ["a.b=1", "+d.e=x y"]


def test_expand_in_place_relative_to_cwd(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "t.overrides").write_text("a=1\nb=2\n")
    assert expand(["x=0", "@sub/t.overrides", "b=3"], cwd=tmp_path) == ["x=0", "a=1", "b=2", "b=3"]
    with pytest.raises(UsageError, match="is a directory"):
        expand(["@sub"], cwd=tmp_path)
    (tmp_path / "latin1.overrides").write_bytes(b"a=\xe9\n")
    with pytest.raises(UsageError, match="not UTF-8"):
        expand(["@latin1.overrides"], cwd=tmp_path)
    with pytest.raises(UsageError, match="must be followed by a file"):
        expand(["@"], cwd=tmp_path)


def test_run_reads_the_overrides_file_tune_split_writes(tmp_path):
    out = streamrl("tune-split", "local", "--gpus", "3", "--write", "tuned.overrides", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    written = (tmp_path / "tuned.overrides").read_text()
    assert written.startswith("#") and "use: streamrl run local @tuned.overrides" in written
    lines = parse(written)
    assert any(line.startswith("roles.generator.instances=") for line in lines)
    # The file's values are what the composed recipe holds; a later override still wins.
    shown = streamrl("show", "local", "@tuned.overrides", "run.name=after-file", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    for line in lines:
        key, value = line.split("=", 1)
        assert f"{key.split('.')[-1]}: {value}" in shown.stdout, line
    assert "name: after-file" in shown.stdout
    dry = streamrl("run", "local", "@tuned.overrides", "--dry-run", "--root", "runs", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert (run_dir / "run.json").read_text().count("roles.generator.instances=") == 1


# --- hints that work when followed ---------------------------------------------------------------

# A mistyped override; the message suggests a command line, which must then be accepted.
TYPOS = [
    "roles.generator.instance=4",
    "+roles.generator.instance=4",
    "++roles.generator.instance=4",
    "roles.generatr.instancs=4",
    "+roles.generator.instances=4",  # exists: set it, don't add it
    "algorithm=grp",
    "train.itterations=3",
    "clusters.extra.launcher=local",  # a new entry of an open mapping is added with +
]


@pytest.mark.parametrize("typo", TYPOS)
def test_following_the_hint_works(typo, tmp_path):
    import re

    bad = streamrl("show", "local", typo, cwd=tmp_path)
    assert bad.returncode == 2, bad.stdout
    hints = re.findall(r"`([^`]+)`", bad.stderr)
    assert hints, bad.stderr
    assert not any(h.startswith("+") and "instances" in h for h in hints), bad.stderr
    fixed = streamrl("show", "local", hints[-1], cwd=tmp_path)
    assert fixed.returncode == 0, f"hint {hints[-1]!r} from {bad.stderr!r} failed:\n{fixed.stderr}"


def test_no_hint_to_add_a_key_the_schema_has_no_place_for(tmp_path):
    out = streamrl("show", "local", "roles.generator.zzzz=1", cwd=tmp_path)
    assert out.returncode == 2 and "+roles" not in out.stderr
    assert "valid keys of roles.generator:" in out.stderr and "instances" in out.stderr


# --- no traceback for failures that are not usage errors ----------------------------------------


def test_an_os_error_on_a_path_the_user_named_is_one_line(tmp_path):
    from support.metric_runs import make_run, simulate

    run_dir = make_run(tmp_path, simulate("async"))
    (tmp_path / "a-file").write_text("")
    out = streamrl("plot", str(run_dir), "--out", str(tmp_path / "a-file" / "plots"))
    assert out.returncode == 1 and "Traceback" not in out.stdout + out.stderr
    assert out.stderr.startswith("error: Not a directory: ") and "a-file" in out.stderr


BUG = """
import sys
from streamrl_cli import cli

@cli.app.command()
def boom() -> None:
    raise ValueError("a bug")

cli.main(sys.argv[1:])
"""


def test_a_bug_is_one_line_and_its_traceback_is_kept(tmp_path, streamrl_home):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", BUG, "boom"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("internal error: ValueError: a bug (a bug in streamrl; traceback in ")
    (saved,) = (streamrl_home / "errors").iterdir()
    assert "Traceback" in saved.read_text() and "ValueError: a bug" in saved.read_text()
    shown = subprocess.run(
        [sys.executable, "-c", BUG, "boom"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, "STREAMRL_TRACEBACK": "1"},
    )
    assert shown.returncode == 1 and "Traceback" in shown.stderr
