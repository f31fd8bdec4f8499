"""The bucketed weight broadcast between real processes over gloo (loopback), bit for bit.

Rank 0 (the "trainer") and two receivers are spawned processes forming a real group through
init_weight_group. Each receiver sends back a SHA-256 of every tensor's bytes, so equality is
exact (NaN payloads, -0.0 and bf16 included) without shipping the tensors back. The pure
planning is tested in test_weights_plan.py.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from support.weights_broadcast import SPAWN, closed_port, digests, form_group, group_port

from streamrl_cli.weights import WeightTransferError


def model_state(seed: int) -> dict[str, torch.Tensor]:
    """A small model's state dict, plus the awkward cases: bf16, int64 buffer, bool, 0-d, empty,
    non-contiguous, NaN and -0.0."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 64), torch.nn.Linear(64, 50)
    )
    sd = {k: v.detach().clone() for k, v in net.state_dict().items()}
    sd["2.weight"][0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    sd["head.bf16"] = torch.randn(33, 7).to(torch.bfloat16)
    sd["step"] = torch.tensor(seed * 1000 + 7, dtype=torch.int64)
    sd["mask"] = torch.rand(5, 3) > 0.5
    sd["empty"] = torch.empty(0, 4)
    sd["transposed"] = torch.randn(6, 9).t()
    sd["big"] = torch.randn(40_000)  # alone in its bucket: sent in place, without a copy
    return sd


def _rank_main(rank: int, world: int, ports: mp.Queue, mode: str, out: mp.Queue) -> None:
    from streamrl_cli.weights.broadcast import (
        BroadcastSender,
        iter_received,
        receive_weights,
    )

    try:
        if mode == "vllm":  # a vLLM worker joins with vLLM's own helper, as the worker extension does
            from vllm.distributed.utils import stateless_init_torch_distributed_process_group

            port, _ = group_port(rank, world, ports)
            group = stateless_init_torch_distributed_process_group(
                "127.0.0.1", port, rank, world, backend="gloo"
            )
            mode = "dict"
        else:
            group = form_group(rank, world, ports)
        results = []
        for version in (1, 2):
            if rank == 0:
                # 64 KiB buckets: several per dtype, so packing, in-place and pipelining all run.
                BroadcastSender(group, bucket_bytes=64 << 10).send(model_state(version), version)
            elif mode == "dict":
                v, sd = receive_weights(group)
                results.append((v, digests(sd)))
            elif mode == "callback":
                got: dict[str, torch.Tensor] = {}
                buckets: list[int] = []

                def load(bucket, got=got, buckets=buckets):  # what an engine's loader would do
                    buckets.append(len(bucket))
                    got.update({n: t.clone() for n, t in bucket})

                v, kept = receive_weights(group, on_bucket=load)
                assert kept == {} and len(buckets) > 3
                results.append((v, digests(got)))
            else:  # "abandon" the first transfer after one tensor, then take the second whole
                info: dict = {}
                it = iter_received(group, info=info)
                next(it)
                it.close()
                results.append((info["version"], None))
                v, sd = receive_weights(group)
                results.append((v, digests(sd)))
                break
        out.put((rank, results))
        if hasattr(group, "close"):
            group.close()
    except Exception as e:  # report, don't hang the test
        out.put((rank, f"{type(e).__name__}: {e}"))


def run_group(modes: list[str]) -> dict[int, object]:
    world, ports, q = len(modes) + 1, SPAWN.Queue(), SPAWN.Queue()
    procs = [
        SPAWN.Process(target=_rank_main, args=(r, world, ports, (["src"] + modes)[r], q))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return results


def test_broadcast_to_two_receivers_equals_the_source_bit_for_bit():
    results = run_group(["dict", "callback"])
    expected = [(v, digests(model_state(v))) for v in (1, 2)]
    assert results[0] == []  # the source reported no error
    assert results[1] == expected, results[1]
    assert results[2] == expected, results[2]


def test_abandoned_receive_keeps_the_group_in_step():
    results = run_group(["abandon"])
    assert results[1] == [(1, None), (2, digests(model_state(2)))], results[1]


@pytest.mark.slow
def test_a_vllm_stateless_group_member_receives_from_our_group():
    pytest.importorskip("vllm")
    results = run_group(["vllm"])
    assert results[1] == [(v, digests(model_state(v))) for v in (1, 2)], results[1]


def _dying_source_main(rank: int, world: int, ports: mp.Queue, out: mp.Queue) -> None:
    import os
    import time

    from streamrl_cli.weights.broadcast import (
        MAGIC,
        _broadcast,
        receive_weights,
        store_probe,
    )

    group = form_group(rank, world, ports, timeout_s=300)
    if rank == 0:  # the header of a transfer announcing 16 MiB of plan, then death before sending it
        # (It used to start sending 16 MiB of zeros and die 10 ms later; on a loaded machine the
        # zeros sometimes all arrived first, and the receivers failed decoding them instead.)
        meta = 16 << 20
        _broadcast(group.pg, torch.tensor([MAGIC, 1, meta, 1], dtype=torch.int64), 0).wait()
        time.sleep(0.5)
        os._exit(1)
    started = time.monotonic()
    try:
        receive_weights(group, source_gone=store_probe("127.0.0.1", group.port))
        out.put((rank, "received", time.monotonic() - started))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(e).__name__}: {e}", time.monotonic() - started))


def test_receivers_fail_soon_when_the_source_dies_mid_transfer():
    # gloo leaves the receivers waiting until the group's timeout (here 300 s); the store probe
    # sees the source gone within a few polls.
    world, ports, q = 3, SPAWN.Queue(), SPAWN.Queue()
    procs = [SPAWN.Process(target=_dying_source_main, args=(r, world, ports, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = sorted(q.get(timeout=120) for _ in range(world - 1))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, outcome, seconds in results:
        assert outcome.startswith("SourceGone: the source of the weight group at 127.0.0.1:"), outcome
        assert seconds < 60, (rank, seconds)


def test_group_address_errors_are_clear():
    from streamrl_cli.weights.broadcast import init_weight_group

    with pytest.raises(WeightTransferError, match="must be host:port"):
        init_weight_group("localhost", 0, 2)
    with pytest.raises(WeightTransferError, match="backend must be gloo or nccl"):
        init_weight_group("127.0.0.1:0", 0, 1, backend="mpi")
    with pytest.raises(
        WeightTransferError, match=r"cannot form the weight group at 127.0.0.1:\d+ as rank 1/2"
    ):
        with closed_port() as port:
            init_weight_group(f"127.0.0.1:{port}", 1, 2, timeout_s=0.5)  # nobody hosts it
