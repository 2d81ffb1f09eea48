"""Ranks, roles and devices."""

from __future__ import annotations

import re
import torch

import pytest

from lightning_hetero.topology import Topology, resolve_stage_devices, threads_for

CPU = torch.device("cpu")


def test_auto_without_gpus_emulates_two_stages() -> None:
    assert resolve_stage_devices("auto") == (CPU, CPU)
    assert resolve_stage_devices(3) == (CPU, CPU, CPU)
    assert resolve_stage_devices(["cpu", torch.device("cpu")]) == (CPU, CPU)


def test_cpu_workers_come_first_so_rank_zero_holds_the_whole_model() -> None:
    topo = Topology(cpu_workers=2, stage_devices=(CPU, CPU, CPU), num_nodes=2)
    assert topo.procs_per_node == 5 and topo.world_size == 10
    assert [str(topo.role(r)) for r in range(5)] == ["cpu0", "cpu1", "stage0", "stage1", "stage2"]
    assert topo.role(2).is_first_stage and topo.role(4).is_last_stage and not topo.role(3).is_last_stage
    assert topo.cpu_ranks(1) == [5, 6] and topo.stage_ranks(1) == [7, 8, 9]
    assert topo.local_devices == [CPU] * 5


def test_pipeline_only_layout() -> None:
    topo = Topology(cpu_workers=0, stage_devices=(CPU, CPU))
    assert topo.role(0).is_first_stage and topo.cpu_ranks(0) == []


@pytest.mark.parametrize(
    "stages, cpu_workers, cpu_share, expected",
    [
        # Emulated stages share the 16 cores with the CPU workers, or take them all while those idle.
        (["cpu", "cpu"], 2, True, [4, 4, 4, 4]),
        (["cpu", "cpu"], 2, False, [4, 4, 8, 8]),
        (["cpu"], 1, False, [8, 16]),
        # A GPU stage keeps one core to drive its device, whatever the CPU workers do.
        (["cuda:0", "cuda:1"], 1, True, [14, 1, 1]),
        (["cuda:0", "cpu"], 1, False, [15, 1, 15]),
    ],
)
def test_threads_share_the_cores(stages: list[str], cpu_workers: int, cpu_share: bool, expected: list[int]) -> None:
    topology = Topology(cpu_workers=cpu_workers, stage_devices=tuple(torch.device(d) for d in stages))
    threads = [threads_for(topology.role(r), topology, 16, cpu_share=cpu_share) for r in range(topology.procs_per_node)]
    assert threads == expected


@pytest.mark.parametrize("cpu_workers, expected", [(0, [1]), (1, [15, 1])])
def test_a_gpu_replica_keeps_one_core_as_a_gpu_stage_does(cpu_workers: int, expected: list[int]) -> None:
    """`parallelism="replicas"` on a GPU: without a CPU worker the count was a division by zero (the
    run failed at setup), and beside one the replica took as many threads as the CPU worker."""
    topology = Topology(cpu_workers=cpu_workers, stage_devices=(torch.device("cuda", 0),), replicas=True)
    for cpu_share in (True, False):
        threads = [threads_for(topology.role(r), topology, 16, cpu_share=cpu_share) for r in range(topology.procs_per_node)]
        assert threads == expected


def test_a_wrong_number_of_processes_says_what_to_change() -> None:
    """Twice the processes per node's count: the Trainer's `num_nodes` was left out; otherwise the
    count per node is wrong."""
    topology = Topology(cpu_workers=1, stage_devices=(torch.device("cpu"), torch.device("cpu")))
    with pytest.raises(RuntimeError, match=re.escape("3 per node on 2 nodes: pass `Trainer(num_nodes=2)`")):
        topology.check_world_size(6)
    with pytest.raises(RuntimeError, match=re.escape("Start 3 processes per node (e.g. `torchrun --nproc-per-node=3`)")):
        topology.check_world_size(4)
