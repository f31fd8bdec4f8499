"""Which GPUs a role process takes, for the environments SLURM gives (measured on the test clusters)."""

from __future__ import annotations

import pytest

from streamrl_cli.errors import ClusterError
from streamrl_cli.recipe.schema import GeneratorConfig, RendezvousConfig, TrainerConfig
from streamrl_cli.roles.placement import apply, gpus_per_process, placement


def test_trainer_ranks_sharing_the_nodes_gpus_take_their_local_index():
    # `srun` under `--gpus-per-node=4 --ntasks-per-node=4`: every task sees 0,1,2,3, no LOCAL_RANK.
    got = [placement({"SLURM_LOCALID": str(i), "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 1) for i in range(4)]
    assert [p.devices for p in got] == [("0",), ("1",), ("2",), ("3",)]
    assert [p.cuda_index for p in got] == [0, 1, 2, 3]
    assert all(p.visible is None for p in got)  # peers stay visible for NCCL's peer-to-peer


def test_gpus_bound_per_task_by_slurm_are_used_from_index_zero():
    # `--gpus-per-task=1` / `--gpu-bind=single:1`: task i sees only GPU i.
    got = [placement({"SLURM_LOCALID": str(i), "CUDA_VISIBLE_DEVICES": str(i)}, 1) for i in range(4)]
    assert [p.devices for p in got] == [("0",), ("1",), ("2",), ("3",)]
    assert {p.cuda_index for p in got} == {0}


def test_a_generator_array_task_uses_all_its_gpus():
    p = placement({"SLURM_LOCALID": "0", "CUDA_VISIBLE_DEVICES": "2,3"}, 2, narrow=True)
    assert (p.devices, p.cuda_index, p.visible) == (("2", "3"), 0, None)


def test_narrowing_when_a_process_sees_more_than_its_share():
    p = placement({"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 2, narrow=True)
    assert (p.devices, p.cuda_index, p.visible) == (("6", "7"), 0, "6,7")
    env: dict = {}
    apply(p, env)
    assert env == {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "6,7"}


def test_too_few_visible_gpus_is_a_clear_error():
    with pytest.raises(ClusterError, match=r"process 2 on this node needs 1 GPU\(s\) but only GPUs 0,1"):
        placement({"SLURM_LOCALID": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, 1)


def test_cpu_processes_and_the_local_launcher():
    assert placement({"SLURM_LOCALID": "3"}, 0).devices == ()
    p = placement({"LOCAL_RANK": "1"}, 1)  # no SLURM, no CUDA_VISIBLE_DEVICES: the machine's numbering
    assert (p.devices, p.cuda_index, p.visible) == (("1",), 1, None)
    assert placement({"SLURM_LOCALID": "1", "SLURM_STEP_GPUS": "0,1"}, 1).devices == ("1",)


def test_gpus_per_process():
    assert gpus_per_process("trainer", TrainerConfig(gpus_per_node=8)) == 1
    assert gpus_per_process("trainer", TrainerConfig(gpus_per_node=0)) == 0
    assert gpus_per_process("generator", GeneratorConfig(gpus_per_instance=4)) == 4
    assert gpus_per_process("rendezvous", RendezvousConfig()) == 0
