"""The bucketed weight broadcast between real processes over gloo (loopback), bit for bit.

Rank 0 (the "trainer") and two receivers are spawned processes forming a real group through
init_weight_group. Each receiver sends back a SHA-256 of every tensor's bytes, so equality is
exact (NaN payloads, -0.0 and bf16 included) without shipping the tensors back. The pure
planning is tested in test_weights_plan.py.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import socket
import threading
from typing import Any

import pytest
import torch
from support.generator_harness import wait_until
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
        if mode == "vllm":  # a member joining with vLLM's own helper meets our group
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
        WeightTransferError,
        match=r"cannot join the weight group at 127.0.0.1:\d+ as rank 1/2 \(gloo\): its store accepted no "
        r"connection \(connect timeout 0.5s",
    ):
        with closed_port() as port:
            init_weight_group(f"127.0.0.1:{port}", 1, 2, timeout_s=0.5)  # nobody hosts it


# ---- a member joining a group its source gave up (a failed try, a relay that died) ----
#
# A member learns a group's address from a version proposal and joins later: after it drained and
# said it is ready, when its engine gets to it. Meanwhile the source may have dropped the group. In
# a run a member's group timeout is the sync timeout (600 s): here 3600 s, so a join that waited for
# it would be caught by the test's own timeout.


def _dropped(hosted: dict[str, Any]) -> int:
    """Drop a hosted store (``hosted["store"]``, its last reference) as a source does; returns its port,
    now refusing connections."""
    store = hosted.pop("store")
    port = store.port
    del store
    gc.collect()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    return port


def test_a_member_told_to_join_a_store_already_dropped_fails_within_its_connect_bound():
    # A TCPStore client retries a refused connect until its timeout: before the connect had a bound
    # of its own, this join waited the whole group timeout.
    from streamrl_cli.weights.broadcast import host_weight_store, init_weight_group

    port = _dropped({"store": host_weight_store("127.0.0.1", 2, timeout_s=60)})
    with pytest.raises(
        WeightTransferError,
        match=rf"cannot join the weight group at 127.0.0.1:{port} as rank 1/2 \(gloo\): its store accepted "
        r"no connection \(connect timeout 1s, tried for \d+s: .*\); its source \(rank 0\) dropped that "
        r"group or is gone",
    ):
        init_weight_group(f"127.0.0.1:{port}", 1, 2, timeout_s=3600, connect_timeout_s=1)


def test_a_member_connected_before_its_store_is_dropped_fails_at_once():
    from streamrl_cli.weights.broadcast import host_weight_store, init_weight_group

    hosted = {"store": host_weight_store("127.0.0.1", 2, timeout_s=60)}
    address, failed = f"127.0.0.1:{hosted['store'].port}", []

    def join() -> None:  # waits in the group's formation for rank 0, which never comes
        try:
            init_weight_group(address, 1, 2, timeout_s=3600, connect_timeout_s=60)
        except WeightTransferError as e:
            failed.append(str(e))

    member = threading.Thread(target=join)
    member.start()
    # The member counts itself in once connected (its reply may still be on its way: either message).
    wait_until(lambda: hosted["store"].num_keys() > 0, 60, "the member to connect")
    _dropped(hosted)
    member.join()
    assert len(failed) == 1 and failed[0].startswith(
        f"cannot join the weight group at {address} as rank 1/2 (gloo)"
    ), failed
