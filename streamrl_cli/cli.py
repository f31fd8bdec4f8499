"""The `streamrl` command: wires commands to the modules that do the work.

Heavy imports (torch, vllm, deepspeed, hydra, submitit) stay inside command bodies so that
`streamrl --help` and `streamrl status` answer at once.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from streamrl_cli import environ
from streamrl_cli.errors import StreamRLError, UsageError

app = typer.Typer(
    name="streamrl",
    help="Disaggregated stream-generation RL post-training of LLMs, on SLURM clusters or this machine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
console = Console()
err = Console(stderr=True)


def _print_version(value: bool) -> None:
    if value:
        from streamrl_cli import __version__

        console.print(f"streamrl {__version__}", markup=False, highlight=False)
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="print the version and exit"),
    ] = False,
) -> None:
    """Disaggregated stream-generation RL post-training of LLMs, on SLURM clusters or this machine."""


RecipeArg = Annotated[
    str,
    typer.Argument(
        metavar="RECIPE", help="recipe name (`local`, `paper/qwen2.5-7b-ppo`) or path to a YAML file"
    ),
]
OverridesArg = Annotated[
    list[str] | None,
    typer.Argument(
        help="overrides: key=value, +key=value (add), ++key=value, ~key (delete), group=option; "
        "@FILE reads one override per line from FILE (`#` comments)"
    ),
]


def _overrides(given: list[str] | None) -> list[str]:
    """The command line's overrides with every @FILE expanded in place."""
    from streamrl_cli.recipe.argfiles import expand

    return expand(given or [])


@app.command(short_help="Launch RECIPE: jobs per (cluster, role), rendezvous, stream.")
def run(
    recipe: Annotated[
        str | None,
        typer.Argument(
            metavar="RECIPE", help="recipe name (`local`, `paper/qwen2.5-7b-ppo`) or path to a YAML file"
        ),
    ] = None,
    overrides: OverridesArg = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="render and write everything, submit nothing")
    ] = False,
    root: Annotated[
        Path | None, typer.Option(help="directory of run directories (default: run.root)")
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option("--resume", metavar="RUN", help="continue RUN from its latest checkpoint (same recipe)"),
    ] = None,
) -> None:
    """Compose RECIPE, render one job per (cluster, role), start the rendezvous and launch the run."""
    from streamrl_cli.launch import run as launcher
    from streamrl_cli.recipe.load import load

    if resume is not None:
        if recipe is not None or overrides or dry_run:
            raise UsageError(
                "--resume RUN continues a run with its own recipe: give no RECIPE, overrides or --dry-run"
            )
        from streamrl_cli import rundir

        prepared = launcher.reopen(rundir.find(resume))
        console.print(f"resuming run {prepared.run.name}: {prepared.run.path}", markup=False, highlight=False)
        raise typer.Exit(launcher.launch(prepared, console))
    if recipe is None:
        raise UsageError("missing RECIPE (see `streamrl recipes`), or --resume RUN")
    from streamrl_cli.launch.presubmit import before_submit

    composed = before_submit(load(recipe, _overrides(overrides)))  # nothing is written if this fails
    prepared = launcher.prepare(composed, root=root, dry_run=dry_run)
    if dry_run:
        _print_plan(prepared)
        console.print(str(prepared.run.path), markup=False, highlight=False, soft_wrap=True)
        return
    console.print(
        f"run {prepared.run.name}: {prepared.run.path}", markup=False, highlight=False, soft_wrap=True
    )
    code = launcher.launch(prepared, console)
    raise typer.Exit(code)


def _print_plan(prepared) -> None:  # type: ignore[no-untyped-def]
    from rich.table import Table

    table = Table(title="would launch (dry run)", title_justify="left")
    for col in ("role", "cluster", "launcher", "partition", "nodes×tasks", "GPUs/node", "array", "script"):
        table.add_column(col)
    for job in prepared.jobs:
        table.add_row(
            job.role,
            job.slurm_cluster or job.cluster,
            job.launcher,
            job.partition or "-",
            f"{job.nodes}×{job.tasks_per_node}",
            str(job.gpus_per_node),
            str(job.array or "-"),
            str(prepared.scripts[job.key].relative_to(prepared.run.path)),
        )
    if all(j.role != "rendezvous" for j in prepared.jobs):
        table.add_row("rendezvous", "this host", "local", "-", "1×1", "0", "-", "(started by streamrl run)")
    console.print(table)


@app.command(short_help="Cancel every job and local process of RUN.")
def cancel(
    run_name: Annotated[str, typer.Argument(metavar="RUN", help="run id, prefix, name or directory")],
) -> None:
    """Cancel every job of RUN on every cluster (and stop its local processes).

    A run that has already ended is left as it is (its recorded state is kept); that is not an
    error, so the exit code is 0 either way.
    """
    from streamrl_cli import rundir
    from streamrl_cli import status as st
    from streamrl_cli.launch import launcher as launchers
    from streamrl_cli.launch import run as launcher

    r = rundir.find(run_name)
    reports = launchers.reports(r)  # what each launcher knows of the run: its jobs, its processes
    state = st.current_state(r, reports)
    # Live processes and unfinished jobs (jobs.json) of the run always get stopped, whatever its
    # (possibly damaged or missing) run.json says; without a readable state, so do jobs whose state
    # SLURM cannot tell.
    running = any(rep.live(unknown=state == "unknown") for rep in reports)
    if state not in st.ACTIVE_STATES and not running:
        how = {
            "dry-run": "was a dry run",
            "ended": "has already ended (its processes are gone)",
            "unknown": "has no readable record of its state, and no process or job of it runs",
        }.get(state, f"has already ended ({state})")
        console.print(f"run {r.name} {how}: nothing to cancel, left as it is", markup=False, highlight=False)
        return
    # Each line as it is known: what was stopped is said even when something could not be.
    done = launcher.cancel(r, say=lambda line: console.print(line, markup=False, highlight=False))
    if not done:
        console.print("nothing was running")
    console.print(f"run {r.name} cancelled")


@app.command(short_help="Grow or shrink RUN's generators while it trains.")
def scale(
    run_name: Annotated[str, typer.Argument(metavar="RUN", help="run id, prefix, name or directory")],
    generators: Annotated[
        str, typer.Option("--generators", help="instances wanted: N, or +N to add, -N to release")
    ],
    wait: Annotated[
        float, typer.Option(min=0, max=604_800, help="seconds to wait until the run applied it")
    ] = 120.0,
) -> None:
    """Grow or shrink RUN's generator instances while it trains (local processes or SLURM array jobs)."""
    from streamrl_cli import rundir
    from streamrl_cli.launch.scale.request import request

    r = rundir.find(run_name)
    ev = request(r, generators, wait_s=wait)
    if ev["event"] == "scale_superseded":
        console.print(f"superseded by a newer scale request ({ev['by']}); see `streamrl status {r.name}`")
        return
    what = [f"started {', '.join(f'generator-{k}' for k in ev['added'])}"] if ev["added"] else []
    what += [f"released {', '.join(f'generator-{k}' for k in ev['released'])}"] if ev["released"] else []
    what += [f"array job {j}" for j in ev["jobs"]]
    done = f" ({'; '.join(what)})" if what else ""
    console.print(
        f"run {r.name}: generators {ev['before']} -> {ev['after']}{done}", markup=False, highlight=False
    )


@app.command(short_help="What every role of RUN is doing (no RUN: all runs).")
def status(
    run_name: Annotated[
        str | None, typer.Argument(metavar="RUN", help="run id, prefix, name or directory")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="print one JSON document (docs/status-json.md)")
    ] = False,
    watch: Annotated[
        bool,
        typer.Option(
            "--watch",
            help="refresh until the run ends (or Ctrl-C); in place on a terminal, else one snapshot "
            "after another",
        ),
    ] = False,
    interval: Annotated[
        float, typer.Option(min=0.1, max=3600, help="seconds between refreshes with --watch")
    ] = 2.0,
) -> None:
    """What every role of RUN is doing; without RUN, a table of runs."""
    import json

    from streamrl_cli import rundir
    from streamrl_cli import status as st
    from streamrl_cli.status import view

    run = rundir.find(run_name) if run_name else None

    def document() -> dict:
        return st.collect(run) if run else {"schema": st.SCHEMA_VERSION, "runs": st.runs_summary()}

    def render(doc: dict):  # type: ignore[no-untyped-def]
        return view.run_view(doc) if run else view.runs_table(doc["runs"], width=console.width)

    def active(doc: dict) -> bool:
        states = [doc["state"]] if run else [r["state"] for r in doc["runs"]]
        return any(s in st.ACTIVE_STATES for s in states)

    if as_json:
        print(json.dumps(document(), indent=2, sort_keys=True, default=str))
        return
    doc = document()
    if not watch:
        console.print(render(doc), soft_wrap=run is None)  # runs: never crop an id
        return
    import time

    try:
        if console.is_terminal:
            from rich.live import Live

            with Live(render(doc), console=console, auto_refresh=False) as live:
                while active(doc):
                    time.sleep(interval)
                    doc = document()
                    live.update(render(doc), refresh=True)
        else:  # a file or a pipe: no cursor to move, so each refresh is printed after the last
            while True:
                console.print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}", markup=False, highlight=False)
                console.print(render(doc), soft_wrap=run is None)  # runs: never crop an id
                if not active(doc):
                    break
                time.sleep(interval)
                doc = document()
    except KeyboardInterrupt:
        pass


@app.command(short_help="Draw RUN's metrics as PNG plots.")
def plot(
    run_name: Annotated[str, typer.Argument(metavar="RUN", help="run id, prefix, name or directory")],
    out: Annotated[
        Path | None, typer.Option("--out", help="directory for the PNGs (default RUN/plots)")
    ] = None,
) -> None:
    """Draw RUN's metrics as PNGs: reward (and eval reward), training health (KL, grad norm, clip
    fraction, entropy, value loss), throughput and idle time, pipeline timeline, lengths."""
    from streamrl_cli import rundir
    from streamrl_cli.metrics.plots import plot_run

    r = rundir.find(run_name)
    files = plot_run(r.path, out or r.plots)
    for path in files:
        console.print(f"wrote {path}", markup=False, highlight=False, soft_wrap=True)
    for name, why in files.skipped.items():
        console.print(f"skipped {name}.png: {why}", markup=False, highlight=False, soft_wrap=True)


@app.command(short_help="Write a checkpoint of RUN as a Hugging Face model.")
def export(
    run_name: Annotated[str, typer.Argument(metavar="RUN", help="run id, prefix, name or directory")],
    out: Annotated[Path, typer.Option("--out", help="directory to write (must not exist, or be empty)")],
    iteration: Annotated[
        int | None,
        typer.Option(
            "--iteration",
            min=0,
            max=10_000_000,
            help="the checkpoint of this iteration (default: the latest)",
        ),
    ] = None,
    adapter: Annotated[
        bool, typer.Option("--adapter", help="a LoRA run: its adapters as a PEFT directory, not merged")
    ] = False,
) -> None:
    """Write a checkpoint of RUN as a Hugging Face model directory (config, tokenizer, safetensors);
    a LoRA run's adapters are merged into the base model, or with --adapter written as PEFT's."""
    from streamrl_cli import rundir
    from streamrl_cli.launch import run_state
    from streamrl_cli.trainer.role import checkpoint as ckpt
    from streamrl_cli.trainer.role.export import ExportError, export_checkpoint

    r = rundir.find(run_name)
    done = sorted(p for p in r.checkpoints.glob("iter-*") if (p / ckpt.STATE).is_file())
    have = ", ".join(str(int(p.name.removeprefix("iter-"))) for p in done) or "none"
    if iteration is None:
        if not done:
            raise ExportError(f"run {r.name} has no complete checkpoint yet")
        path = done[-1]
    else:
        path = ckpt.checkpoint_dir(r.path, iteration)
        if path not in done:
            raise ExportError(
                f"run {r.name} has no complete checkpoint of iteration {iteration}; have: {have}"
            )
    model = run_state.role_spec(r, "trainer").model  # typed: the schema's ModelConfig
    with err.status(f"exporting {path.name} of {r.name}"):
        written = export_checkpoint(path, model.path, out, model.dtype, adapter=adapter)
    console.print(f"wrote {written}", markup=False, highlight=False, soft_wrap=True)


@app.command(short_help="Print RECIPE composed and validated, as YAML.")
def show(recipe: RecipeArg, overrides: OverridesArg = None) -> None:
    """Print the fully composed and validated RECIPE (after overrides) as YAML."""
    from omegaconf import OmegaConf

    from streamrl_cli.recipe.load import load

    composed = load(recipe, _overrides(overrides))
    console.print(OmegaConf.to_yaml(OmegaConf.structured(composed.recipe)), markup=False, highlight=False)


@app.command(short_help="List the shipped recipes.")
def recipes() -> None:
    """List the shipped recipes."""
    from streamrl_cli.recipe.load import list_recipes

    for name in list_recipes():
        console.print(name, markup=False, highlight=False)


def _click_exceptions() -> tuple[type[Exception], type[Exception]]:
    """(ClickException, NoArgsIsHelpError) of the click that typer uses.

    Recent typer vendors its own copy of click (``typer._click``), whose exceptions are not
    ``click``'s; older typer uses ``click`` itself. Both are caught, whichever is installed.
    """
    try:
        from typer._click.exceptions import ClickException, NoArgsIsHelpError
    except ImportError:  # typer < 0.29: the real click
        from click.exceptions import ClickException, NoArgsIsHelpError
    return ClickException, NoArgsIsHelpError


def _usage_line(e: Exception) -> str:
    """One line: what was wrong, and where the valid forms are listed."""
    message = " ".join(e.format_message().split()).rstrip(".")  # type: ignore[attr-defined]
    ctx = getattr(e, "ctx", None)
    if ctx is None:
        return message
    return f"{message} (see `{ctx.command_path} --help`)"


def _save_traceback() -> Path:
    import time
    import traceback

    from streamrl_cli.rundir import streamrl_home

    path = streamrl_home() / "errors" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(" ".join(sys.argv) + "\n\n" + traceback.format_exc())
    except OSError:
        return Path("(could not be saved)")
    return path


def main(argv: list[str] | None = None) -> None:
    """Console-script entry: every error is printed once, as a message, never as a traceback.

    Exit codes: 0 success, 1 a failure (cluster, run), 2 a usage error (unknown command or
    option, missing or bad argument, invalid recipe), 130 interrupted.
    """
    click_exception, no_args_help = _click_exceptions()
    try:
        # Without standalone mode click returns the code of typer.Exit instead of exiting, and
        # raises its usage errors here instead of printing them its own way.
        code = app(args=argv, prog_name="streamrl", standalone_mode=False)
    except StreamRLError as e:
        err.print(f"[bold red]error:[/bold red] {type(e).__name__}: ", end="")
        err.print(str(e), markup=False, highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except no_args_help as e:  # `streamrl` or `streamrl GROUP` alone: the help is the answer
        console.print(e.format_message(), markup=False, highlight=False, soft_wrap=True)  # type: ignore[attr-defined]
        sys.exit(2)
    except click_exception as e:
        err.print("[bold red]error:[/bold red] ", end="")
        err.print(_usage_line(e), markup=False, highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)  # type: ignore[attr-defined]
    except OSError as e:  # a file or directory the user named: permissions, a full disk, ...
        where = f": {e.filename}" if e.filename else ""
        err.print("[bold red]error:[/bold red] ", end="")
        err.print(f"{e.strerror or e}{where}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(1)
    except Exception as e:  # a bug: one line here, the traceback in a file for the report
        if os.environ.get(environ.TRACEBACK):
            raise
        path = _save_traceback()
        err.print("[bold red]internal error:[/bold red] ", end="")
        err.print(
            f"{type(e).__name__}: {e} (a bug in streamrl; traceback in {path}, or set STREAMRL_TRACEBACK=1)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


# --- resource allocation: tune-split and profile (streamrl_cli/planner) -------------------------


@app.command("tune-split", short_help="Split GPUs between generation and training.")
def tune_split(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    gpus: Annotated[
        int | None,
        typer.Option(
            "--gpus",
            min=1,
            max=2_097_152,
            help="one pool of N GPUs (the trainer's partition) for both stages",
        ),
    ] = None,
    sites: Annotated[
        str | None,
        typer.Option(
            "--sites",
            help="pools: CLUSTER[.PARTITION]=N,... (recipe clusters) or KIND:N@SITE,... (@SITE optional)",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON document")] = False,
    write: Annotated[
        Path | None,
        typer.Option(
            "--write", help="write the recommendation: FILE.yaml a recipe, else key=value overrides"
        ),
    ] = None,
    profile: Annotated[
        list[Path] | None, typer.Option("--profile", help="a `streamrl profile` file (repeatable)")
    ] = None,
    hardware: Annotated[
        list[Path] | None, typer.Option("--hardware", help="YAML of extra GPU specs (repeatable)")
    ] = None,
    mode: Annotated[
        str | None,
        typer.Option(help="plan for this mode instead of algorithm.mode: baseline|sync-stream|async"),
    ] = None,
    objective: Annotated[
        str, typer.Option(help="rank by `throughput` (samples/s) or `cost` (samples per unit cost)")
    ] = "throughput",
    top: Annotated[int, typer.Option(min=1, max=10_000, help="options to show")] = 10,
) -> None:
    """How many GPUs of which kind go to generation and to training (Algorithm 1, two sites, cost)."""
    import json

    from streamrl_cli.planner import problem, report
    from streamrl_cli.recipe.load import load

    overrides = _overrides(overrides)
    composed = load(recipe, overrides)
    tuned = problem.tune(
        composed.recipe,
        gpus=gpus,
        sites=sites,
        mode=mode,
        objective=objective,
        hardware_files=[str(p) for p in hardware or []],
        profile_files=[str(p) for p in profile or []],
    )
    best = tuned.result.recommended
    lines: list[str] = []
    if write is not None:
        from omegaconf import OmegaConf

        lines = problem.overrides(best, composed.recipe)
        checked = problem.check_overrides(recipe, overrides, lines)
        header = (
            f"written by `streamrl tune-split {recipe}`: {best.gen.gpus} generation GPUs "
            f"({best.gen.hardware}) + {best.train.gpus} training GPUs ({best.train.hardware}), "
            f"predicted {best.estimate.iteration_s:.1f} s per iteration ({tuned.workload.mode})"
        )
        if write.suffix not in (".yaml", ".yml"):
            import shlex

            header += "\nuse: " + shlex.join(["streamrl", "run", recipe, *overrides, f"@{write}"])
        yaml_text = OmegaConf.to_yaml(OmegaConf.structured(checked))
        report.write(write, lines, yaml_text, header)
    if as_json:
        print(json.dumps(report.document(tuned, top), indent=2))
        return
    console.print(report.table(tuned, top))
    e = best.estimate
    console.print(
        f"recommended: generation {best.gen.gpus}× {best.gen.hardware} ({best.gen.instances} instances × "
        f"TP{best.gen.tp}), training {best.train.gpus}× {best.train.hardware} ({best.train.layout}): "
        f"{e.iteration_s:.1f} s/iteration, {e.samples_per_s:.3f} samples/s",
        markup=False,
        highlight=False,
    )
    if write is not None:
        console.print(f"wrote {write}: " + " ".join(lines), markup=False, highlight=False, soft_wrap=True)


@app.command(short_help="Measure the engines for tune-split.")
def profile(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="this machine: the profile file (default profile-<model>-<kind>.json); SLURM: the directory "
            "for one profile-<model>-<kind>.json per hardware kind and the jobs' logs, on the shared "
            "filesystem (default ./profiles)",
        ),
    ] = None,
    trainer: Annotated[str, typer.Option(help="trainer to time: torch or deepspeed (ZeRO)")] = "torch",
    batches: Annotated[str, typer.Option(help="decode batch sizes to measure")] = "1,2,4,8,16,32",
    kind: Annotated[
        str | None, typer.Option(help="hardware kind the profile of this machine describes (default cpu)")
    ] = None,
    local: Annotated[
        bool, typer.Option("--local", help="measure this machine even if the recipe's roles run on SLURM")
    ] = False,
) -> None:
    """Measure the engines (vLLM decode vs batch size, trainer step vs tokens) for tune-split.

    Roles on SLURM clusters: one job per hardware kind, on the roles' partitions. Otherwise (or
    with --local): this machine's engines.
    """
    from streamrl_cli.planner import ProfileError
    from streamrl_cli.planner import profile as fmt
    from streamrl_cli.profiling import jobs as profile_jobs
    from streamrl_cli.profiling import local as prof
    from streamrl_cli.recipe.load import load

    r = load(recipe, _overrides(overrides)).recipe
    if not local and profile_jobs.on_slurm(r):
        if kind is not None:
            raise ProfileError(
                "--kind names the profile of this machine (with --local); on SLURM each profile is "
                "of its partition's gpu_type"
            )
        out = profile_jobs.out_dir(out or Path("profiles"))  # before the model is built (minutes, maybe)
        base = prof.request_from_recipe(r, trainer=trainer, batches=batches, where="in the SLURM jobs")
        written = profile_jobs.profile_on_slurm(r, base, out, err)
    else:
        kind = kind or "cpu"
        default = Path(f"profile-{r.model.name}-{kind}.json")
        path = out / default if out is not None and out.is_dir() else out or default
        _writable_file(path, "--out")  # before the model is built and the engines measured
        base = prof.request_from_recipe(r, trainer=trainer, batches=batches, where="of this machine")
        written = [(path, _profile_here(prof, replace(base, hardware=kind, out=str(path))))]
    for path, result in written:
        console.print(fmt.summary(path, result), markup=False, highlight=False, soft_wrap=True)


@app.command(short_help="Score RECIPE's prompts with the length ranker.")
def rank(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="the cache: FILE.json or FILE.jsonl (default rank-<task>-<ranker>.json)"),
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, max=100_000_000, help="score only the first N prompts")
    ] = None,
    fit: Annotated[
        Path | None,
        typer.Option(
            "--fit", help='first teach the ranker: JSONL of {"prompt_id" or "prompt": ..., "length": N}'
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="where the learned ranker runs: cpu, cuda, cuda:1")] = "cpu",
) -> None:
    """Score RECIPE's prompts once with skewness.ranker; point skewness.cache at the file written."""
    from streamrl_cli.ranker.command import rank_recipe
    from streamrl_cli.recipe.load import load

    r = load(recipe, _overrides(overrides)).recipe
    out, count, kind = rank_recipe(r, out=out, limit=limit, fit=fit, device=device, console=err)
    console.print(
        f"wrote {out}: {count} scores ({kind} ranker); use it with skewness.cache={out}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


def _writable_file(path: Path, option: str) -> None:
    """Refuse, naming `option`, a file path that could not be written: its folder missing or not
    writable, or the path itself something other than a file."""
    folder = path.parent if str(path.parent) else Path(".")
    if path.exists() and not path.is_file():
        raise UsageError(f"{option} {path}: exists and is not a file (give a file, or an existing folder)")
    if not folder.is_dir():
        raise UsageError(f"{option} {path}: the folder {folder} does not exist (create it, or give another)")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{option} {path}: the folder {folder} is not writable")


def _profile_here(prof, req):  # type: ignore[no-untyped-def]
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"))
    with Progress(*columns, TimeElapsedColumn(), console=err) as progress:
        task = progress.add_task("profiling", total=None)

        def on_event(event: dict) -> None:
            if event.get("event") == "step":
                progress.update(
                    task, completed=event["done"], total=event["total"], description=event["text"]
                )

        return prof.run_profile(req, on_event)


if __name__ == "__main__":
    main()
