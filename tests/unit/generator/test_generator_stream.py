"""The generator role's pure parts: requests to engine requests, results to samples, the meter,
where the weights come from. No engine, no sockets, no clock."""

from __future__ import annotations

import msgspec
import pytest
import torch
from support.configs import sampling as make_sampling

from streamrl_cli.environ import CPU_SLOT as CPU_SLOT_ENV
from streamrl_cli.errors import StreamRLError
from streamrl_cli.generator.engine import Completion, GenerationResult, SamplingSpec
from streamrl_cli.generator.main import GeneratorRole, cpu_binding, engine_kwargs
from streamrl_cli.generator.stream import Meter, to_engine_request, to_samples
from streamrl_cli.generator.weights import (
    RelayPath,
    WeightPath,
    make_weight_path,
    weight_source,
)
from streamrl_cli.recipe.schema import GeneratorConfig, ModelConfig, TaskConfig, TrainConfig
from streamrl_cli.roles.entry import cpu_slot
from streamrl_cli.roles.spec import GeneratorSpec
from streamrl_cli.transport.wire import Request
from streamrl_cli.weights.broadcast import process_backend


def spec(**overrides) -> GeneratorSpec:
    base = dict(
        run_name="t", run_dir="/tmp/none", role="generator", cluster="local", site="local", world=3,
        expected={"trainer": 1, "generator": 3}, program="streamrl_cli.generator.main:main",
        weight_transport="broadcast", rendezvous_file="/tmp/none/rendezvous.json",
        secret_file="/tmp/none/secret",
        settings=GeneratorConfig(cluster="local", engine="vllm", tensor_parallel=2, gpus_per_instance=2),
        model=ModelConfig(name="m", path="~/models/m", dtype="bfloat16"),
        task=TaskConfig(name="builtin", max_prompt_len=100, max_output_len=300), train=TrainConfig(seed=5),
    )  # fmt: skip
    return GeneratorSpec(**{**base, **overrides})


def request(indices=(0, 1, 2, 3), **sampling) -> Request:
    return Request(prompt_id="it1/p7", prompt_token_ids=[1, 2, 3], sample_indices=list(indices),
                   group_id="it1/p7", priority=4, sampling=make_sampling(**sampling))  # fmt: skip


def test_a_request_becomes_one_engine_request_for_the_whole_group():
    r = to_engine_request(request(temperature=0.7, max_tokens=300, top_k=5, stop=["END"]), 12)
    assert r.request_id == "it1/p7#12" and r.prompt_token_ids == [1, 2, 3] and r.priority == 4
    s = r.sampling
    assert (s.n, s.temperature, s.max_tokens, s.top_k, s.stop) == (4, 0.7, 300, 5, ["END"])


def test_every_sampling_value_is_the_requests_and_a_scoring_role_uses_its_own():
    want = make_sampling(seed=11)
    got = to_engine_request(request(seed=11), 0).sampling
    assert {k: getattr(got, k) for k in msgspec.structs.asdict(want)} == msgspec.structs.asdict(want)
    scored = to_engine_request(request(), 0, SamplingSpec(max_tokens=1, prompt_logprobs=True)).sampling
    assert (scored.n, scored.max_tokens, scored.prompt_logprobs) == (4, 1, True)  # n follows the indices
    with pytest.raises(ValueError, match="no sampling"):
        to_engine_request(Request(prompt_id="p", prompt_token_ids=[1], sample_indices=[0]), 0)


def result(indices, finish="stop") -> GenerationResult:
    req = to_engine_request(request(indices), 0)
    completions = [
        Completion(index=i, token_ids=[10 + i, 11], logprobs=[-0.5, -1.5], finish_reason=finish)
        for i in range(len(indices))
    ]
    return GenerationResult(request_id=req.request_id, prompt_token_ids=[1, 2, 3], completions=completions,
                            weight_version=3, weight_version_end=3, priority=4, queued_at=1.0,
                            first_token_at=2.0, finished_at=3.0, meta=req.meta)  # fmt: skip


def test_completions_map_back_to_the_requested_sample_indices():
    # After a re-dispatch only the missing samples (1 and 3) are asked for.
    samples = to_samples(result([1, 3]), "generator-2")
    assert [(s.sample_index, s.token_ids) for s in samples] == [(1, [10, 11]), (3, [11, 11])]
    s = samples[0]
    assert (s.prompt_id, s.group_id, s.generator, s.weight_version) == ("it1/p7", "it1/p7", "generator-2", 3)
    assert (s.queued_at, s.first_token_at, s.finished_at, s.logprobs) == (1.0, 2.0, 3.0, [-0.5, -1.5])


def test_a_result_that_does_not_match_its_indices_is_refused():
    res = result([0, 1])
    res.completions.pop()
    with pytest.raises(ValueError, match="1 completions for sample indices"):
        to_samples(res, "generator-0")


def test_meter_rates_queue_depth_and_idle_ratio():
    m = Meter(now=100.0)
    m.submitted(102.0)  # idle 100..102
    m.submitted(103.0)
    m.finished(104.0, samples=4, tokens=400)
    m.finished(106.0, samples=4, tokens=200)  # idle again from 106
    rep = m.report(110.0)
    assert rep["tokens_per_s"] == 60.0 and rep["samples_per_s"] == 0.8
    assert rep["idle_ratio"] == 0.6 and rep["queue_depth"] == 0 and rep["window_s"] == 10.0
    m.submitted(111.0)
    rep = m.report(120.0)  # a new window: 1 s idle, one request still in the engine
    assert rep["tokens_per_s"] == 0.0 and rep["idle_ratio"] == 0.1 and rep["queue_depth"] == 1
    assert (rep["total_requests"], rep["total_samples"], rep["total_tokens"]) == (3, 8, 600)
    with pytest.raises(ValueError):
        Meter(0.0).finished(1.0, 1, 1)


def test_engine_settings_come_from_the_recipe():
    kw = engine_kwargs(spec())
    assert kw["model"].endswith("/models/m") and not kw["model"].startswith("~")
    assert (kw["dtype"], kw["max_model_len"], kw["tensor_parallel"], kw["seed"]) == ("bfloat16", 400, 2, 5)
    cpu = spec(
        settings=GeneratorConfig(cluster="local", engine="vllm", tensor_parallel=1, gpus_per_instance=0)
    )
    assert engine_kwargs(cpu)["dtype"] is None  # the engine picks float32 on CPUs
    assert kw["cpu_cores"] is None  # TP 2: no CPU binding (vLLM's CPU workers take theirs)


def test_cpu_instances_on_one_host_get_their_own_cores():
    # vLLM's auto binding would put every instance's worker on core 0 of a 2-core host
    # a local run on a 2-core host: one core each (round-robin past two instances)
    assert [cpu_binding(r, 2, [0, 1], 2) for r in range(2)] == ["0", "1"]
    assert [cpu_binding(r, 3, [0, 1], 2) for r in range(3)] == ["0", "1", "0"]
    # two share eight evenly; a lone instance is left to vLLM (it keeps a core for its scheduler)
    assert [cpu_binding(r, 2, list(range(8)), 8) for r in range(2)] == ["0,1,2,3", "4,5,6,7"]
    assert cpu_binding(0, 1, list(range(8)), 8) is None
    assert cpu_binding(1, 2, [3], 1) is None  # one core: nothing to spread, vLLM decides
    assert cpu_binding(1, 4, [4, 5], 16) is None  # confined by its scheduler (a SLURM task): vLLM decides


def test_an_instance_scale_added_takes_its_place_among_the_hosts_instances(monkeypatch):
    # A run launched with one instance, scaled to two: the newcomer (rank 1 of a launch world of 1)
    # must not get vLLM's choice, the lone first instance's core; it takes the second of two.
    monkeypatch.delenv(CPU_SLOT_ENV, raising=False)
    assert cpu_slot(1, 1) == (1, 1) and cpu_binding(*cpu_slot(1, 1), [0, 1], 2) is None
    monkeypatch.setenv(CPU_SLOT_ENV, "1/2")
    assert cpu_slot(1, 1) == (1, 2) and cpu_binding(*cpu_slot(1, 1), [0, 1], 2) == "1"
    monkeypatch.setenv(CPU_SLOT_ENV, "2/2")  # not a place among two: the launch's rank and world
    assert cpu_slot(5, 3) == (5, 3)
    # A scaled SLURM array of two tasks after two instances: its tasks take places 2 and 3 of 4.
    monkeypatch.setenv(CPU_SLOT_ENV, "2/4")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    assert cpu_slot(3, 2) == (3, 4)


def test_weight_source_follows_the_trainer_or_the_recipe_layout():
    trainer = {"member_id": "trainer-0", "addresses": {"weights": "node1:29501"}, "info": {}}
    src = weight_source(spec(), 2, trainer)  # 3 instances x TP 2: ranks 1..6, instance 2 takes 5 and 6
    # The backend follows what this process has (no CUDA here: gloo), not the recipe's GPU count.
    assert (src.host, src.port, src.world_size, src.first_rank) == ("node1", 29501, 7, 5)
    assert src.backend == process_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
    trainer["info"] = {"weight_group": {"world_size": 4, "backend": "gloo"}}
    src = weight_source(spec(), 0, trainer)
    assert (src.world_size, src.first_rank, src.backend) == (4, 1, "gloo")
    with pytest.raises(StreamRLError, match="addresses.weights"):
        weight_source(spec(), 0, {"member_id": "trainer-0", "addresses": {}})


def test_weight_path_by_site_and_the_far_sites_relay_election():
    # At the trainer's site everyone joins the trainer's group; at another site any generator may
    # be the relay: the lowest-ranked one past start-up, as every one of them computes it.
    assert type(make_weight_path(spec(), 0, None, None, "t")) is WeightPath
    far = [make_weight_path(spec(weight_transport="relay"), r, None, None, "t") for r in (0, 2)]
    assert all(type(p) is RelayPath and p.addresses() == {} for p in far)

    def gen(rank: int, state: str = "alive", reported: str = "generating") -> dict:
        return {"member_id": f"generator-{rank}", "role": "generator", "rank": rank, "state": state,
                "reported_state": reported, "incarnation": 1}  # fmt: skip

    assert far[1].relay_id([gen(2), gen(0)]) == "generator-0"
    assert far[1].relay_id([gen(0, state="lost"), gen(2), gen(1, reported="starting")]) == "generator-2"
    assert far[1].relay_id([gen(0, state="left")]) is None
    assert make_weight_path(spec(), 1, None, None, "t").addresses() == {}
    with pytest.raises(StreamRLError, match="unknown weight transport 'carrier-pigeon'"):
        GeneratorRole(spec(weight_transport="carrier-pigeon"), 0)
