"""The TRL side of `bench/peer_trl.py`, run by the Python of TRL's own environment (never by StreamRL's).

    python bench/trl_grpo.py train SETTINGS.json   # GRPOTrainer on a JSONL dataset; writes a result JSON
    python bench/trl_grpo.py eval SETTINGS.json    # sampled held-out reward of a model directory

Both sides score with the same function, `streamrl_cli.tasks.rewards:repeat_verifier`, imported from this
checkout (it needs nothing beyond the standard library), so the reward is the same code, not a copy.
Evaluation is done here for both tools' final models, so held-out rewards are measured the same way.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _settings() -> dict:
    return json.loads(Path(sys.argv[2]).read_text())


def train(s: dict) -> dict:
    import torch

    torch.set_num_threads(s["threads"])
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from streamrl_cli.tasks.rewards import repeat_verifier

    counted = {"samples": 0, "tokens": 0, "reward": []}

    def repeat(prompts, completions, completion_ids, word, count, **_):
        counted["samples"] += len(completions)
        counted["tokens"] += sum(len(ids) for ids in completion_ids)
        scores = repeat_verifier(prompts, completions, word, count)
        counted["reward"].append(sum(scores) / len(scores))
        return scores

    tok = AutoTokenizer.from_pretrained(s["model"])
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    completions_per_step = s["prompts_per_step"] * s["group_size"]
    config = GRPOConfig(
        output_dir=s["out"],
        per_device_train_batch_size=completions_per_step,  # one optimizer step per batch, as StreamRL's
        gradient_accumulation_steps=1,
        num_generations=s["group_size"],
        max_completion_length=s["max_completion"],
        max_steps=s["steps"],
        learning_rate=s["lr"],
        lr_scheduler_type="constant",  # StreamRL's learning rate is constant
        beta=0.0,  # no KL term (StreamRL: algorithm.kl_mode=none)
        epsilon=s["clip"],
        temperature=1.0,
        top_p=1.0,
        scale_rewards="group",  # group std normalisation (StreamRL: algorithm.grpo_std_norm=true)
        max_grad_norm=1.0,
        seed=s["seed"],
        use_cpu=True,
        bf16=False,
        logging_steps=1,  # every step: the per-step entropy beside the reward
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    data = load_dataset("json", data_files=s["train"], split="train")
    trainer = GRPOTrainer(
        model=s["model"], reward_funcs=repeat, args=config, train_dataset=data, processing_class=tok
    )
    started = time.monotonic()
    trainer.train()
    loop_s = time.monotonic() - started
    trainer.save_model(s["out"] + "/model")
    tok.save_pretrained(s["out"] + "/model")
    rewards = counted["reward"]
    return {
        "loop_s": loop_s,
        "samples": counted["samples"],
        "tokens": counted["tokens"],
        "reward_first": rewards[0] if rewards else None,
        "reward_last": sum(rewards[-4:]) / len(rewards[-4:]) if rewards else None,
        "rewards": rewards,
        "entropy": [h["entropy"] for h in trainer.state.log_history if "entropy" in h],
    }


def evaluate(s: dict) -> dict:
    """`s["samples"]` sampled completions (temperature 1, no truncation: the distribution trained on)
    of each held-out prompt under `s["model"]`, scored by the shared verifier. Sampled, not greedy: a
    policy warmed up on noisy counts rarely makes EOS its single most likely token, so greedy decoding
    runs to the length limit and scores nearly 0 for every policy alike."""
    import torch

    torch.set_num_threads(s.get("threads", 2))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamrl_cli.tasks.rewards import repeat_verifier

    tok = AutoTokenizer.from_pretrained(s["model"])
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32).eval()
    prompts = [json.loads(line) for line in Path(s["data"]).read_text().splitlines() if line.strip()]
    rows = [r for r in prompts for _ in range(s["samples"])]
    torch.manual_seed(s["seed"])
    scores, lengths = [], []
    for i in range(0, len(rows), 64):
        batch = rows[i : i + 64]
        enc = tok([r["prompt"] for r in batch], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(
                **enc, max_new_tokens=s["max_completion"], do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, pad_token_id=tok.pad_token_id,
            )  # fmt: skip
        new = out[:, enc["input_ids"].shape[1] :]
        texts = tok.batch_decode(new, skip_special_tokens=True)
        lengths += [int((ids != tok.pad_token_id).sum()) for ids in new]
        scores += repeat_verifier(
            [r["prompt"] for r in batch], texts, [r["word"] for r in batch], [r["count"] for r in batch]
        )
    n = len(scores)
    # Standard error over prompts (a prompt's samples are not independent of each other).
    k = s["samples"]
    per_prompt = [sum(scores[i : i + k]) / k for i in range(0, n, k)]
    mean = sum(per_prompt) / len(per_prompt)
    var = sum((x - mean) ** 2 for x in per_prompt) / max(len(per_prompt) - 1, 1)
    return {
        "reward": sum(scores) / n, "se": (var / len(per_prompt)) ** 0.5, "length": sum(lengths) / n,
        "prompts": len(prompts),
    }  # fmt: skip


if __name__ == "__main__":
    what = sys.argv[1]
    settings = _settings()
    result = train(settings) if what == "train" else evaluate(settings)
    Path(settings["result"]).write_text(json.dumps(result))
