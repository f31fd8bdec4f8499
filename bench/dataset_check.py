"""How long the check before submission takes to count every prompt of a 100,000-row dataset.

`streamrl run` (and `--dry-run`) renders every prompt of task.dataset as the trainer will and counts
its tokens with the model's tokenizer (`launch/presubmit.py`, `tasks.datasets.long_prompts`), so a
prompt over task.max_prompt_len is named by row before anything is queued. The count is batched
(the fast tokenizer encodes a batch in Rust on every core); the baseline, measured in the same run,
is the same check counting one prompt per tokenizer call, as the trainer does as it draws them.

The dataset: 100,000 JSONL rows (17 of them too long) written to a temporary directory, the
tokenizer the project's tiny model's (`models/tiny.py`, built in the same directory: nothing is
downloaded), the same one the tests use. A second dataset holds the same prompts as chats rendered
through a Jinja chat template, to measure what rendering costs. Also timed: reading the file alone,
today's checks without the count, and `streamrl run --dry-run` end to end (interpreter start and
the transformers import included). Each time is the best of a few runs. Target: the check on
100,000 rows in ≤ 10 s.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROWS = 100_000
TOO_LONG = 17
LIMIT = 128
TARGET_S = 10.0
REPEATS = 3  # each time is the best of this many runs
WORDS = (
    "the quick brown fox jumps over lazy dog solve if 3x + 5 = 20 then x check question answer what is "
    "12 times reinforcement learning policy reward model generation training weights samples"
).split()
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_datasets(folder: Path) -> tuple[Path, Path, list[int]]:
    """A text and a chat JSONL of the same ROWS prompts; the rows made too long."""
    rng = random.Random(0)
    long_rows = sorted(rng.sample(range(ROWS), TOO_LONG))
    longs = set(long_rows)
    text, chat = folder / "prompts.jsonl", folder / "chats.jsonl"
    with text.open("w") as t, chat.open("w") as c:
        for i in range(ROWS):
            n = rng.randint(100, 120) if i in longs else rng.randint(4, 24)
            prompt = " ".join(rng.choice(WORDS) for _ in range(n))
            t.write(json.dumps({"prompt": prompt, "answer": "4"}) + "\n")
            c.write(json.dumps({"prompt": [{"role": "user", "content": prompt}], "answer": "4"}) + "\n")
    return text, chat, long_rows


def timed(fn: Callable[[], Any], repeats: int = REPEATS) -> tuple[float, Any]:
    """The best of ``repeats`` runs (this 2-core machine is shared: the best is the least disturbed)."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def check(model: Path, data: Path, *over: str) -> list[str]:
    """The check before submission as `streamrl run` calls it: the problems it finds."""
    from streamrl_cli.errors import RecipeError
    from streamrl_cli.launch.presubmit import before_submit
    from streamrl_cli.recipe.load import load

    composed = load("slurm-local", [
        f"model.path={model}", f"task.dataset={data}", "task.name=bench", f"task.max_prompt_len={LIMIT}",
        "task.reward=streamrl_cli.tasks.rewards:exact_match", *over,
    ])  # fmt: skip
    try:
        before_submit(composed)
    except RecipeError as e:
        return list(e.problems)
    return []


def one_by_one(texts: Any, tokenizer: Any, limit: int, chunk: int = 0) -> list[tuple[int, int]]:
    """The baseline count: one tokenizer call per prompt, as the trainer tokenizes a prompt it draws."""
    from streamrl_cli.tasks.datasets import prompt_ids

    lengths = (len(prompt_ids(tokenizer, [t])[0]) for t in texts)
    return [(i, n) for i, n in enumerate(lengths) if n > limit]


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="streamrl-dataset-check-") as folder:
        run(Path(folder))


def run(folder: Path) -> None:
    import streamrl_cli.tasks.datasets as datasets
    from streamrl_cli.launch import presubmit
    from streamrl_cli.models.tiny import build_tiny_model, library_output_to_stderr

    with library_output_to_stderr():
        model = build_tiny_model(folder / "tiny")
    text, chat, long_rows = write_datasets(folder)
    from transformers import AutoTokenizer  # imported once here: the check below times its own work

    tok = AutoTokenizer.from_pretrained(model)
    texts = [json.loads(line)["prompt"] for line in text.open()]
    rows: list[tuple[str, float, str]] = []

    read_s, _ = timed(lambda: [json.loads(line) for line in text.open()])
    rows.append(("read and parse the JSONL only (floor)", read_s, ""))

    count_s, found = timed(lambda: datasets.long_prompts(texts, tok, LIMIT))
    assert [i for i, _ in found] == long_rows, found
    rows.append(("count tokens: batched (long_prompts)", count_s, f"{len(found)} too long"))
    loop_s, slow = timed(lambda: one_by_one(texts, tok, LIMIT))
    assert slow == found
    rows.append(("count tokens: one call per prompt", loop_s, ""))

    real_count = presubmit._prompt_lengths
    presubmit._prompt_lengths = lambda *a, **k: None  # type: ignore[assignment]
    without_s, problems = timed(lambda: check(model, text))
    presubmit._prompt_lengths = real_count  # type: ignore[assignment]
    assert problems == [], problems
    rows.append(("check before submission, without the count (before)", without_s, ""))

    value, problems = timed(lambda: check(model, text))
    assert len(problems) == 1 and f"{TOO_LONG} of {ROWS:,} prompts" in problems[0], problems
    assert f"row {long_rows[0]}: " in problems[0], problems
    rows.append(("check before submission, batched count (now)", value, ""))

    real_long = datasets.long_prompts
    datasets.long_prompts = one_by_one  # type: ignore[assignment]
    baseline, same = timed(lambda: check(model, text))
    datasets.long_prompts = real_long  # type: ignore[assignment]
    assert same == problems
    rows.append(("check before submission, one call per prompt (baseline)", baseline, ""))

    (folder / "chat.jinja").write_text(TEMPLATE)
    chat_s, chat_problems = timed(lambda: check(model, chat, f"task.chat_template={folder / 'chat.jinja'}"))
    assert len(chat_problems) == 1 and f"{TOO_LONG} of {ROWS:,} prompts" in chat_problems[0], chat_problems
    from streamrl_cli.tasks.datasets import ChatFormat, DatasetTask

    rendered = ChatFormat(template=TEMPLATE, tokenizer=tok)
    render_s, _ = timed(lambda: DatasetTask(chat, reward=lambda *a, **k: [], chat=rendered))
    rows.append(("chat rows: rendering every chat (make_task's part)", render_s, ""))
    rows.append(("chat rows: check before submission, batched count", chat_s, ""))

    env = {**os.environ, "STREAMRL_HOME": str(folder / "home"), "COLUMNS": "200"}
    cli = [
        sys.executable, "-m", "streamrl_cli.cli", "run", "slurm-local", "--dry-run", f"model.path={model}",
        f"task.dataset={text}", "task.name=bench", "task.reward=streamrl_cli.tasks.rewards:exact_match",
        f"task.max_prompt_len={LIMIT}", "--root", str(folder / "runs"),
    ]  # fmt: skip
    cli_s, out = timed(lambda: subprocess.run(cli, capture_output=True, text=True, env=env), repeats=2)
    assert out.returncode == 2 and f"{TOO_LONG} of {ROWS:,} prompts" in out.stderr, out.stderr
    rows.append(("`streamrl run --dry-run` end to end (exit 2)", cli_s, "process start, imports"))

    title = f"Pre-submit prompt-length check: {ROWS:,} JSONL rows, tiny model's tokenizer"
    table = Table(title=f"{title}, best of {REPEATS}")
    for col in ("step", "seconds", "rows/s", "note"):
        table.add_column(col, justify="left" if col in ("step", "note") else "right")
    for name, s, note in rows:
        table.add_row(name, f"{s:.2f}", f"{ROWS / s:,.0f}", note)
    console = Console()
    console.print(table)
    console.print(problems[0], soft_wrap=True, markup=False)
    print(
        json.dumps(
            {
                "bench": "dataset_check",
                "metric": "presubmit_check_s_100k_rows",
                "value": round(value, 2),
                "baseline": round(baseline, 2),
                "ratio": round(value / baseline, 2),
                "target": TARGET_S,
            }
        )  # fmt: skip
    )


if __name__ == "__main__":
    main()
