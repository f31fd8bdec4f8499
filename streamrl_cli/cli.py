"""The `streamrl` command: wires commands to the modules that do the work.

Heavy imports (torch, vllm, deepspeed, hydra, submitit) stay inside command bodies so that
`streamrl --help` and `streamrl status` answer at once.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from streamrl_cli.errors import StreamRLError

app = typer.Typer(
    name="streamrl",
    help="Disaggregated stream-generation RL post-training of LLMs, on SLURM clusters or this machine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err = Console(stderr=True)

RecipeArg = Annotated[
    str, typer.Argument(help="recipe name (`local`, `paper/qwen2.5-7b-ppo`) or path to a YAML file")
]
OverridesArg = Annotated[
    list[str] | None,
    typer.Argument(help="overrides: key=value, +key=value (add), ++key=value, ~key (delete), group=option"),
]


@app.command()
def run(
    recipe: Annotated[
        str | None,
        typer.Argument(help="recipe name (`local`, `paper/qwen2.5-7b-ppo`) or path to a YAML file"),
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
            raise StreamRLError(
                "--resume RUN continues a run with its own recipe: give no RECIPE, overrides or --dry-run"
            )
        from streamrl_cli import rundir

        prepared = launcher.reopen(rundir.find(resume))
        console.print(f"resuming run {prepared.run.name}: {prepared.run.path}", markup=False, highlight=False)
        raise typer.Exit(launcher.launch(prepared, console))
    if recipe is None:
        raise StreamRLError("missing RECIPE (see `streamrl recipes`), or --resume RUN")
    from streamrl_cli.launch.checks import before_submit

    composed = before_submit(load(recipe, overrides or []))  # nothing is written if this fails
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


@app.command()
def cancel(
    run_name: Annotated[str, typer.Argument(metavar="RUN", help="run id, prefix, name or directory")],
) -> None:
    """Cancel every job of RUN on every cluster (and stop its local processes)."""
    from streamrl_cli import rundir
    from streamrl_cli.launch import run as launcher

    r = rundir.find(run_name)
    done = launcher.cancel(r)
    for line in done or ["nothing was running"]:
        console.print(line, markup=False, highlight=False)
    console.print(f"run {r.name} cancelled")


@app.command()
def status(
    run_name: Annotated[
        str | None, typer.Argument(metavar="[RUN]", help="run id, prefix, name or directory")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="print one JSON document (docs/status-json.md)")
    ] = False,
    watch: Annotated[bool, typer.Option("--watch", help="refresh in place until Ctrl-C")] = False,
    interval: Annotated[float, typer.Option(help="seconds between refreshes with --watch")] = 2.0,
) -> None:
    """What every role of RUN is doing; without RUN, a table of runs."""
    import json

    from streamrl_cli import rundir
    from streamrl_cli import status as st
    from streamrl_cli import status_view as view

    run = rundir.find(run_name) if run_name else None

    def document() -> dict:
        return st.collect(run) if run else {"schema": st.SCHEMA_VERSION, "runs": st.runs_summary()}

    def render(doc: dict):  # type: ignore[no-untyped-def]
        return view.run_view(doc) if run else view.runs_table(doc["runs"])

    if as_json:
        print(json.dumps(document(), indent=2, sort_keys=True, default=str))
        return
    if not watch:
        console.print(render(document()))
        return
    import time

    from rich.live import Live

    with Live(render(document()), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(render(document()), refresh=True)
        except KeyboardInterrupt:
            pass


@app.command()
def plot(
    run_name: Annotated[str, typer.Argument(metavar="RUN", help="run id, prefix, name or directory")],
    out: Annotated[
        Path | None, typer.Option("--out", help="directory for the PNGs (default RUN/plots)")
    ] = None,
) -> None:
    """Draw RUN's metrics as PNGs: reward and KL, throughput and idle time, pipeline timeline, lengths."""
    from streamrl_cli import rundir
    from streamrl_cli.metrics.plots import plot_run

    r = rundir.find(run_name)
    files = plot_run(r.path, out or r.path / "plots")
    for path in files:
        console.print(f"wrote {path}", markup=False, highlight=False, soft_wrap=True)
    for name, why in files.skipped.items():
        console.print(f"skipped {name}.png: {why}", markup=False, highlight=False, soft_wrap=True)


@app.command()
def show(recipe: RecipeArg, overrides: OverridesArg = None) -> None:
    """Print the fully composed and validated RECIPE (after overrides) as YAML."""
    from omegaconf import OmegaConf

    from streamrl_cli.recipe.load import load

    composed = load(recipe, overrides or [])
    console.print(OmegaConf.to_yaml(OmegaConf.structured(composed.recipe)), markup=False, highlight=False)


@app.command()
def recipes() -> None:
    """List the shipped recipes."""
    from streamrl_cli.recipe.load import list_recipes

    for name in list_recipes():
        console.print(name, markup=False, highlight=False)


def main() -> None:
    """Console-script entry: user errors are printed once, without a traceback."""
    try:
        # Without standalone mode click returns the code of typer.Exit instead of exiting.
        code = app(standalone_mode=False)
    except StreamRLError as e:
        err.print(f"[bold red]error:[/bold red] {type(e).__name__}: ", end="")
        err.print(str(e), markup=False, highlight=False)
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except Exception as e:  # click's usage errors
        import click

        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(e.exit_code)
        raise
    sys.exit(code if isinstance(code, int) else 0)


# --- resource allocation: tune-split and profile (streamrl_cli/planner) -------------------------


@app.command("tune-split")
def tune_split(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    gpus: Annotated[
        int | None,
        typer.Option("--gpus", help="one pool of N GPUs (the trainer's partition) for both stages"),
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
    top: Annotated[int, typer.Option(help="options to show")] = 10,
) -> None:
    """How many GPUs of which kind go to generation and to training (Algorithm 1, two sites, cost)."""
    import json

    from streamrl_cli.planner import problem, report
    from streamrl_cli.recipe.load import load

    composed = load(recipe, overrides or [])
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
        checked = problem.check_overrides(recipe, overrides or [], lines)
        header = (
            f"written by `streamrl tune-split {recipe}`: {best.gen.gpus} generation GPUs "
            f"({best.gen.hardware}) + {best.train.gpus} training GPUs ({best.train.hardware}), "
            f"predicted {best.estimate.iteration_s:.1f} s per iteration ({tuned.workload.mode})"
        )
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


@app.command()
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
    from streamrl_cli.planner import ProfileError, profile_jobs
    from streamrl_cli.planner import profile as prof
    from streamrl_cli.recipe.load import load

    r = load(recipe, overrides or []).recipe
    if not local and profile_jobs.on_slurm(r):
        if kind is not None:
            raise ProfileError(
                "--kind names the profile of this machine (with --local); on SLURM each profile is "
                "of its partition's gpu_type"
            )
        base = prof.request_from_recipe(r, trainer=trainer, batches=batches, where="in the SLURM jobs")
        written = profile_jobs.profile_on_slurm(r, base, out or Path("profiles"), err)
    else:
        kind = kind or "cpu"
        base = prof.request_from_recipe(r, trainer=trainer, batches=batches, where="of this machine")
        default = Path(f"profile-{r.model.name}-{kind}.json")
        path = out / default if out is not None and out.is_dir() else out or default
        written = [(path, _profile_here(prof, replace(base, hardware=kind, out=str(path))))]
    for path, result in written:
        console.print(prof.summary(path, result), markup=False, highlight=False, soft_wrap=True)


@app.command()
def rank(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="the cache: FILE.json or FILE.jsonl (default rank-<task>-<ranker>.json)"),
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, help="score only the first N prompts")
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
    import dataclasses

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from streamrl_cli.ranker import cache as rc
    from streamrl_cli.ranker.base import RankerError, make_ranker
    from streamrl_cli.recipe.load import load
    from streamrl_cli.tasks import make_task

    r = load(recipe, overrides or []).recipe
    skew = {**dataclasses.asdict(r.skewness), "cache": None}  # scoring from a cache would only copy it
    kind = skew["ranker"]
    if kind == "none":
        raise RankerError(
            "skewness.ranker is none: name the ranker to score with, e.g. skewness.ranker=learned "
            "(or skewness.ranker=oracle with the built-in task)"
        )
    if fit is not None and kind not in ("learned", "history"):
        raise RankerError(f"--fit teaches a learned or history ranker, not skewness.ranker={kind}")
    task = make_task(dataclasses.asdict(r.task), r.train.seed)
    model = r.skewness.ranker_model or r.model.path
    if kind in ("learned", "history") and not r.skewness.ranker_model:
        from streamrl_cli.models.warmup import ensure_model

        with err.status(f"preparing {r.model.name} (once, cached)"):
            model = str(ensure_model(dataclasses.asdict(r.model), dataclasses.asdict(r.task)))
    prompts = list(task.prompts())[:limit]
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"))
    with make_ranker(skew, model_path=model, task=task, seed=r.train.seed, device=device) as ranker:
        if fit is not None:
            pairs = rc.read_lengths(fit, task)
            with err.status(f"fitting the {kind} ranker on {len(pairs[0])} lengths from {fit}"):
                ranker.fit(*pairs)
        with Progress(*columns, TimeElapsedColumn(), console=err, transient=True) as progress:
            bar = progress.add_task(f"scoring with the {kind} ranker", total=len(prompts))
            scores = rc.score(ranker, prompts, progress=lambda done, _: progress.update(bar, completed=done))
    out = out or Path(f"rank-{task.name}-{kind}.json")
    meta = {
        "ranker": kind,
        "model": model if kind in ("learned", "history") else None,
        "task": task.name,
        "seed": r.train.seed,
        "prompts": len(scores),
        "fit": str(fit) if fit else None,
    }
    rc.write_cache(out, scores, meta)
    console.print(
        f"wrote {out}: {len(scores)} scores ({kind} ranker); use it with skewness.cache={out}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


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
