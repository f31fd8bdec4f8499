"""On-policy distillation: does the student's held-out reward rise toward its teacher's, and at what cost?

    .venv/bin/python bench/distill.py [--iterations 16] [--warmup-steps 600]

The student is the embedded default's policy (the tiny model, 148K parameters, warmed up on noisy
references: a rough counter). The teacher is `roles.teacher.model.builder=tiny-teacher`: a tiny
Qwen2 twice as wide and deep (789K parameters, the student's tokenizer) trained on the task's exact
answers, built once before the runs. Every run is `streamrl run local` at bench/algorithms.py's
settings (the repeat task as a JSONL dataset, 8 prompts × 8 samples per step, completions ≤ 64
tokens, lr 1e-3, sync-stream, seed 0; one generator; with a teacher, one teacher instance):

- the student fixed (lr 0) and the teacher fixed (served as the policy, lr 0): where the student
  starts and where distillation leads, measured by the same evaluation;
- GRPO on the task reward alone (the baseline a user has without a teacher);
- distillation alone (`algorithm.distill_coef=1`, `distill_task_reward=false`);
- GRPO plus distillation (`distill_coef=1`).

Held-out reward: StreamRL's own evaluation after the last step (200 prompts of (word, count) pairs
no training prompt has, temperature 1, per-request seeds, the same for every run), with its
standard error. Also: samples/s of the training loop (the teacher's scoring is on the way of every
sample), the training reward over the first and last five steps, and the student's reverse KL from
the teacher per sampled token (first and last step). Reward curves: bench/plots/distill_rewards.png.
Target: distillation alone ends at least as close to the teacher as GRPO does.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algorithms import LR, run  # noqa: E402
from peer_trl import write_data  # noqa: E402
from rl_modes import console, plot_rewards  # noqa: E402

from streamrl_cli.metrics.read import read_iterations  # noqa: E402

TEACHER_ARCH = ("model.num_layers=4", "model.hidden_size=128", "model.num_attention_heads=4",
                "model.num_kv_heads=4", "model.params_b=0.00079")  # fmt: skip


def build_teacher(path: Path, steps: int) -> Path:
    from streamrl_cli.models.warmup import ensure_teacher
    from streamrl_cli.recipe.schema import TaskConfig, TeacherModelConfig

    with console.status(f"building the teacher ({steps} supervised steps on exact answers) ..."):
        return ensure_teacher(
            TeacherModelConfig(path=str(path), builder="tiny-teacher", warmup_steps=steps),
            TaskConfig(name="builtin", max_output_len=64),
        )


def reverse_kl(work: Path) -> tuple[float, float] | None:
    run_dir = next((p for p in work.iterdir() if p.is_dir()), None) if work.exists() else None
    recs = read_iterations(run_dir) if run_dir is not None else []
    kls = [r["distill/reverse_kl"] for r in recs if r.get("distill/reverse_kl") is not None]
    return (kls[0], kls[-1]) if kls else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=16)
    ap.add_argument("--warmup-steps", type=int, default=600, help="the teacher's supervised steps")
    args = ap.parse_args()
    it = args.iterations
    results: dict[str, dict] = {}
    kl: dict[str, tuple[float, float] | None] = {}
    with tempfile.TemporaryDirectory(prefix="bench-distill-") as tmp:
        tmp = Path(tmp)
        teacher = build_teacher(tmp / "teacher", args.warmup_steps)
        train, test = write_data(tmp, it * 8)
        with_teacher = (
            "roles.teacher.instances=1", "roles.teacher.gpus_per_instance=0",
            f"roles.teacher.model.path={teacher}",
        )  # fmt: skip
        results["student, fixed (lr 0)"] = run("grpo", 0.0, train, test, 1, tmp / "student")
        results["teacher, fixed (lr 0)"] = run(
            "grpo", 0.0, train, test, 1, tmp / "teacher-run",
            (f"model.path={teacher}", "model.builder=null", *TEACHER_ARCH),
        )  # fmt: skip
        results["GRPO (task reward)"] = run("grpo", LR, train, test, it, tmp / "grpo")
        runs = {
            "distillation alone": ("algorithm.distill_coef=1.0", "algorithm.distill_task_reward=false"),
            "GRPO + distillation": ("algorithm.distill_coef=1.0",),
        }
        for name, extra in runs.items():
            work = tmp / name.replace(" ", "-")
            results[name] = run("grpo", LR, train, test, it, work, (*with_teacher, *extra))
            kl[name] = reverse_kl(work)
    student, teacher_r = results["student, fixed (lr 0)"], results["teacher, fixed (lr 0)"]
    table = Table(title=f"on-policy distillation, repeat task: student 148K, teacher 789K parameters; "
                  f"{it} steps of 8 prompts × 8, lr {LR:g}, same data and seed")  # fmt: skip
    for col in ("run", "samples/s", "train reward first5→last5", "reverse KL first→last",
                "held-out reward ± se", "share of the gap closed"):  # fmt: skip
        table.add_column(col, justify="right")
    gap = teacher_r["held_out"] - student["held_out"]
    for name, r in results.items():
        k = kl.get(name)
        trained = name not in ("student, fixed (lr 0)", "teacher, fixed (lr 0)")
        table.add_row(
            name, f"{r['samples_per_s']:.1f}" if trained else "-",
            f"{r['first']:.3f}→{r['last']:.3f}" if trained else "-",
            f"{k[0]:.3f}→{k[1]:.3f}" if k else "-", f"{r['held_out']:.3f} ± {r['se']:.3f}",
            f"{(r['held_out'] - student['held_out']) / gap:+.0%}" if trained and gap > 0 else "-",
        )  # fmt: skip
    console.print(table)
    curves = {k: v for k, v in results.items() if "fixed" not in k}
    plot = Path(__file__).resolve().parent / "plots" / "distill_rewards.png"
    plot_rewards(curves, plot, "on-policy distillation vs GRPO, tiny student, repeat task (8×8 per step)")
    console.print(f"reward curves: {plot}")
    alone, grpo = results["distillation alone"], results["GRPO (task reward)"]
    print(json.dumps({
        "bench": "distill", "metric": "held_out_reward_distillation_alone",
        "value": round(alone["held_out"], 4), "baseline": round(grpo["held_out"], 4),
        "ratio": round(alone["held_out"] / grpo["held_out"], 3) if grpo["held_out"] else None,
        "target": 1.0,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
