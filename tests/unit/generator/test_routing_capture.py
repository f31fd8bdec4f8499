"""Routed-experts capture in the vLLM worker (routing replay, #44; streamrl_cli/generator/routing.py
and the worker extension's `streamrl_enable_routed_experts` / `streamrl_fetch_routed_experts`).

The fast tests check the capture's bookkeeping without an engine: the wire encoding, the step rows
→ (request, position) mapping, padding rows, growth, overwrites, the ids vLLM gives requests, and
the memory bound. The slow ones start one vLLM engine on the tiny Qwen3-MoE (in a subprocess, as
vLLM's engine forks its own), generate batched prompts of different lengths (one prefilled in
several chunks), fetch the routing and compare it with the experts transformers' routers choose
for the same prompt + output tokens."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from streamrl_cli.generator.routing import (
    NOT_COMPUTED,
    RoutedExperts,
    caller_id,
    decode,
    encode,
    step_rows,
)
from streamrl_cli.models.tiny import MOE_SPEC, TinySpec, build_tiny_model

# -- without an engine -----------------------------------------------------------------------


def test_the_encoding_is_the_arrays_bytes_with_its_shape_top_k_bytes_per_token_and_layer():
    a = np.random.default_rng(0).integers(0, 8, size=(7, 2, 2), dtype=np.uint8)
    e = encode(a, [0, 1], index=1)
    assert len(e["data"]) == 7 * 2 * 2  # top_k bytes per token per MoE layer
    assert e["shape"] == [7, 2, 2] and e["dtype"] == "uint8" and e["layers"] == [0, 1] and e["index"] == 1
    assert np.array_equal(decode(e), a)
    wide = np.array([[[300, 65535]]], dtype=np.uint16)  # > 255 experts: two bytes an id
    assert np.array_equal(decode(encode(wide, [3])), wide)


def test_a_steps_rows_are_its_requests_in_batch_order_from_their_computed_tokens():
    # A chunk of a long prompt, a decode, an empty slot and a request not scheduled this step.
    rows = step_rows(["a", "b", None, "c"], {"a": 64, "b": 1}, [128, 40, 0, 7])
    assert rows == [("a", 128, 64), ("b", 40, 1)]


def fake_step(capture: RoutedExperts, rows, per_layer: dict[int, np.ndarray], finished=()) -> None:
    capture.begin_step(lambda: rows, finished)
    for layer, ids in per_layer.items():
        capture.capture(layer, torch.from_numpy(ids))
    capture.end_step()


def test_steps_are_written_at_their_positions_padding_dropped_and_arrays_grown():
    cap = RoutedExperts([3, 1], top_k=2, num_experts=8)
    assert cap.layers == [1, 3]  # the layer axis follows decoder order
    prefill = np.arange(2 * 5 * 2).reshape(2, 5, 2) % 8  # two layers, 3 + 1 rows + 1 padding row
    fake_step(cap, [("x-0a1b2c3d", 0, 3), ("y-0a1b2c3d", 4, 1)], {1: prefill[0], 3: prefill[1]})
    got = decode(cap.fetch(["y"])["y"][0])
    assert got.shape == (5, 2, 2)  # positions 0..3 unknown (a prefix-cache hit), 4 captured
    assert (got[:4] == NOT_COMPUTED).all() and np.array_equal(got[4], prefill[:, 3])
    for step in range(40):  # decode steps past the first allocation
        fake_step(cap, [("x-0a1b2c3d", 3 + step, 1)], {1: np.full((1, 2), step % 8), 3: np.full((1, 2), 7)})
    x = decode(cap.fetch(["x"])["x"][0])
    assert x.shape == (43, 2, 2)
    assert np.array_equal(x[:3, 0], prefill[0, :3]) and np.array_equal(x[:3, 1], prefill[1, :3])
    assert [int(v) for v in x[3:, 0, 0]] == [s % 8 for s in range(40)] and (x[3:, 1] == 7).all()
    assert len(cap) == 0


def test_a_recomputed_position_is_overwritten_and_a_step_without_routers_or_outside_a_step_is_ignored():
    cap = RoutedExperts([0], top_k=1, num_experts=4)
    cap.capture(0, torch.tensor([[1]]))  # a warm-up forward: no step
    fake_step(cap, [("r-0a1b2c3d", 0, 2)], {0: np.array([[1], [2]])})
    fake_step(cap, [("r-0a1b2c3d", 0, 2)], {})  # (a step that ran no MoE layer)
    fake_step(cap, [("r-0a1b2c3d", 0, 2)], {0: np.array([[3], [0]])})  # preempted, recomputed
    assert decode(cap.fetch(["r"])["r"][0]).ravel().tolist() == [3, 0]


def test_ids_match_the_callers_with_vllms_suffix_and_n_children_and_fetching_forgets():
    assert caller_id("p#3-0a1b2c3d") == ("p#3", None, 0)
    assert caller_id("1_p#3-0a1b2c3d") == ("1_p#3", "p#3", 1)
    cap = RoutedExperts([0], top_k=1, num_experts=4)
    rows = [("1_p#3-0a1b2c3d", 0, 1), ("0_p#3-ffffffff", 0, 1), ("q-12345678", 0, 1)]
    fake_step(cap, rows, {0: np.array([[1], [0], [2]])})
    got = cap.fetch(["p#3", "unknown"])
    assert list(got) == ["p#3"] and [e["index"] for e in got["p#3"]] == [0, 1]
    assert [decode(e).item() for e in got["p#3"]] == [0, 1]
    assert cap.fetch(["p#3"]) == {} and len(cap) == 1  # forgotten; q is still there


def test_finished_entries_not_fetched_are_dropped_after_a_time_or_beyond_a_count():
    now = [0.0]
    cap = RoutedExperts(
        [0], top_k=1, num_experts=4, keep_finished_s=10.0, max_finished=2, clock=lambda: now[0]
    )
    ids = [f"r{i}-0a1b2c3d" for i in range(4)]
    fake_step(cap, [(r, 0, 1) for r in ids], {0: np.zeros((4, 1), dtype=np.uint8)})
    fake_step(cap, [], {}, finished=ids[:3])  # three finished (aborted alike): the oldest beyond two goes
    assert len(cap) == 3 and cap.fetch(["r0"]) == {}
    now[0] = 11.0
    cap.finished([])  # (each step's start prunes)
    assert len(cap) == 1 and list(cap.fetch(["r3"])) == ["r3"]  # the running one stays


def test_capture_refuses_a_model_without_moe_layers():
    with pytest.raises(ValueError, match="no MoE layers"):
        RoutedExperts([], top_k=2, num_experts=8)


# -- one vLLM engine on the tiny MoE model ---------------------------------------------------

ENGINE = r"""
import gc, json, os, random, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

if __name__ == "__main__":
    import numpy as np
    from vllm import LLM, SamplingParams
    from streamrl_cli.generator.routing import decode

    model, out, dense = sys.argv[1], sys.argv[2], sys.argv[3]
    ext = "streamrl_cli.generator.worker_ext.WeightSyncExtension"
    common = dict(dtype="float32", max_model_len=512, enforce_eager=True, max_num_seqs=16, seed=0,
                  worker_extension_cls=ext)
    # 64 tokens a step: the 150-token prompt is prefilled in three chunks, beside the others' decodes
    llm = LLM(model=model, max_num_batched_tokens=64, enable_prefix_caching=True, **common)
    result = {"layers": llm.collective_rpc("streamrl_enable_routed_experts")}
    result["again"] = llm.collective_rpc("streamrl_enable_routed_experts")
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in (3, 17, 45, 150)]
    # (no per-request seed: vLLM-cpu 0.32 fails a seeded request whose prefill is chunked, "CPU
    # Generator does not use offset"; the engine's seed makes the run repeatable)
    params = [SamplingParams(max_tokens=m, temperature=1.0, ignore_eos=True) for m in (24, 9, 30, 20)]
    params[1] = SamplingParams(n=2, max_tokens=9, temperature=1.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ids = [o.request_id for o in outs]
    fetched = llm.collective_rpc("streamrl_fetch_routed_experts", args=(ids,))[0]
    arrays, requests = {}, []
    for o in outs:
        for c in o.outputs:
            key = f"{o.request_id}/{c.index}"
            requests.append({"key": key, "prompt": list(o.prompt_token_ids), "output": list(c.token_ids)})
        for e in fetched.get(o.request_id, []):
            arrays[f"{o.request_id}/{e['index']}"] = decode(e)
            result["entry_bytes"] = len(e["data"]); result["entry_shape"] = e["shape"]
            result["entry_layers"] = e["layers"]
    result["fetched_again"] = llm.collective_rpc("streamrl_fetch_routed_experts", args=(ids + ["nope"],))[0]
    # The long prompt again: its first whole blocks come from the prefix cache, not computed here.
    again = llm.generate([{"prompt_token_ids": prompts[3]}], SamplingParams(max_tokens=4, temperature=0),
                         use_tqdm=False)[0]
    got = llm.collective_rpc("streamrl_fetch_routed_experts", args=([again.request_id],))[0]
    arrays["cached/0"] = decode(got[again.request_id][0])
    requests.append({"key": "cached/0", "prompt": prompts[3], "output": list(again.outputs[0].token_ids)})
    # A weight update (the same weights, through the extension's reload) keeps the capture bound.
    import io, torch
    from safetensors.torch import load_file
    buf = io.BytesIO()
    torch.save(load_file(os.path.join(model, "model.safetensors")), buf)
    llm.collective_rpc("streamrl_load_weights", args=(1, buf.getvalue()))
    llm.reset_prefix_cache()
    after = llm.generate([{"prompt_token_ids": prompts[2]}], SamplingParams(max_tokens=12, temperature=1.0),
                         use_tqdm=False)[0]
    got = llm.collective_rpc("streamrl_fetch_routed_experts", args=([after.request_id],))[0]
    arrays["reloaded/0"] = decode(got[after.request_id][0])
    requests.append({"key": "reloaded/0", "prompt": prompts[2], "output": list(after.outputs[0].token_ids)})
    result["requests"] = requests
    config = llm.llm_engine.vllm_config
    result["block_size"] = config.cache_config.block_size
    scheduler = config.scheduler_config
    result["chunked"] = [scheduler.enable_chunked_prefill, scheduler.max_num_batched_tokens]
    np.savez(out, **{k.replace("/", "__"): v for k, v in arrays.items()})
    del llm
    gc.collect()
    print("RESULT " + json.dumps(result), flush=True)
    if dense != "-":
        llm = LLM(model=dense, **common)
        try:
            llm.collective_rpc("streamrl_enable_routed_experts")
            print("DENSE " + json.dumps({"refused": ""}), flush=True)
        except Exception as e:
            print("DENSE " + json.dumps({"refused": f"{type(e).__name__}: {e}"}), flush=True)
        del llm  # (shut down here: an engine left to the interpreter's exit may outlive it)
        gc.collect()
"""


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("routing")
    moe = build_tiny_model(root / "moe", TinySpec(**MOE_SPEC))
    dense = build_tiny_model(root / "dense")
    script, out = root / "engine.py", root / "routing.npz"
    script.write_text(ENGINE)
    # Output to files, not pipes: an engine process outliving the script must not hold up the test;
    # its own session, so that whatever it left behind is ended with it.
    with (root / "stdout").open("w") as stdout, (root / "stderr").open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(moe), str(out), str(dense)],
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=800)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    text = (root / "stdout").read_text()
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in text.splitlines() if " " in line}
    assert "RESULT" in lines, (code, (root / "stderr").read_text()[-4000:], text[-4000:])
    result = json.loads(lines["RESULT"])
    result["dense"] = json.loads(lines["DENSE"]) if "DENSE" in lines else {"refused": text[-3000:]}
    with np.load(out) as z:
        arrays = {k.replace("__", "/"): z[k] for k in z.files}
    return moe, result, arrays


def hf_routing(model, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' top-k expert ids [positions, layers, top_k] and router logits for `tokens`."""
    ids, logits = {}, {}

    def hook(layer):
        def save(module, args, output):
            router_logits, _, indices = output
            ids[layer], logits[layer] = indices.detach(), router_logits.detach()

        return save

    gates = [layer.mlp.gate for layer in model.model.layers]
    handles = [g.register_forward_hook(hook(i)) for i, g in enumerate(gates)]
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]))
    finally:
        for h in handles:
            h.remove()
    n = len(gates)
    return np.stack([ids[i].numpy() for i in range(n)], 1), np.stack([logits[i].numpy() for i in range(n)], 1)


@pytest.mark.slow
def test_the_engines_routing_is_the_routing_transformers_computes_for_the_same_tokens(engine_run):
    from transformers import AutoModelForCausalLM

    moe, result, arrays = engine_run
    assert result["layers"] == [2] and result["again"] == [2]  # both layers bound; idempotent
    # The 150-token prompt took three steps or more to prefill, beside the other requests' decodes.
    assert result["chunked"] == [True, 64] and max(len(r["prompt"]) for r in result["requests"]) == 150
    model = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32).eval()
    total = agree = 0
    flips = []
    for r in result["requests"]:
        got = arrays[r["key"]]
        tokens = r["prompt"] + r["output"]
        # Every token whose forward ran: the prompt and each output token fed back (not the last).
        assert got.shape == (len(tokens) - 1, 2, 2), (r["key"], got.shape, len(tokens))
        want, logits = hf_routing(model, tokens)
        cached = 0
        if r["key"] == "cached/0":  # whole blocks served from the prefix cache: not computed here
            cached = (len(r["prompt"]) - 1) // result["block_size"] * result["block_size"]
            assert cached > 0 and (got[:cached] == NOT_COMPUTED).all(), r["key"]
        assert (got[cached:] != NOT_COMPUTED).all(), r["key"]
        for p in range(cached, got.shape[0]):
            for layer in range(2):
                total += 1
                if set(got[p, layer].tolist()) == set(want[p, layer].tolist()):
                    agree += 1
                else:
                    top = np.sort(logits[p, layer])[::-1]
                    flips.append((r["key"], p, layer, float(top[1] - top[2])))
    print(
        f"routing agreement with transformers: {agree}/{total}; flips (key, pos, layer, logit gap): {flips}"
    )
    assert total > 500
    # Only near-ties may flip (float32 vs. vLLM's kernels): a handful at most, each a tiny gap.
    assert total - agree <= max(2, total // 200), flips
    assert all(gap < 1e-3 for *_, gap in flips), flips


@pytest.mark.slow
def test_the_wire_carries_top_k_bytes_a_token_and_layer_and_a_fetch_forgets(engine_run):
    _, result, arrays = engine_run
    positions, layers, top_k = result["entry_shape"]
    assert (
        result["entry_bytes"] == positions * layers * top_k
        and top_k == 2
        and result["entry_layers"] == [0, 1]
    )
    assert result["fetched_again"] == {}  # fetched ids are forgotten; an unknown id gives nothing
    keys = {r["key"] for r in result["requests"]}
    assert set(arrays) == keys and sum(k.startswith("1/") for k in keys) == 2  # n = 2: both completions


@pytest.mark.slow
def test_a_dense_model_refuses_capture_and_says_why(engine_run):
    refused = engine_run[1]["dense"]["refused"]
    assert "needs a mixture-of-experts model" in refused and "no MoE layer" in refused, refused
