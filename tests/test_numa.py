"""NUMA nodes and the cores of each CPU worker: read from fake ``/sys`` trees (one node, two, a node
with no cores, an affinity smaller than the machine), given as core sets, checked before any process
starts; a run of pinned CPU workers keeps each on its cores, with one thread per core, and trains
the model one process trains."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_hetero import HeteroPlan, HeteroStrategy
from lightning_hetero import numa
from lightning_hetero.numa import cpu_worker_cores, numa_nodes, parse_cpulist
from tests.conftest import hetero
from tests.models import TwoPass, regression_data
from tests.test_replicas import assert_same_run


def fake_sys(root: Path, nodes: dict[int, str], extra: tuple[str, ...] = ()) -> Path:
    """A ``/sys/devices/system/node`` with these nodes' ``cpulist`` files (and other entries Linux has)."""
    for index, cpulist in nodes.items():
        (root / f"node{index}").mkdir(parents=True)
        (root / f"node{index}" / "cpulist").write_text(cpulist + "\n")
    for name in extra:
        (root / name).write_text("0-1\n")
    return root


def test_cpu_lists() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == set() and parse_cpulist("5") == {5}
    with pytest.raises(ValueError, match="not a CPU list"):
        parse_cpulist("0-a")


def test_one_node_changes_nothing(tmp_path: Path) -> None:
    root = fake_sys(tmp_path, {0: "0-7"}, extra=("online", "possible"))
    assert numa_nodes(root, affinity=set(range(8))) == [numa.NumaNode(0, tuple(range(8)))]
    assert cpu_worker_cores(root, affinity=set(range(8))) is None


def test_two_nodes_one_worker_each(tmp_path: Path) -> None:
    root = fake_sys(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"})
    assert cpu_worker_cores(root, affinity=set(range(16))) == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]


def test_a_node_with_no_cores_holds_no_worker(tmp_path: Path) -> None:
    """A memory-only node (CXL memory, say) lists no cores."""
    root = fake_sys(tmp_path, {0: "0-3", 1: "", 2: "4-7"})
    assert [n.index for n in numa_nodes(root, affinity=set(range(8)))] == [0, 2]
    assert cpu_worker_cores(root, affinity=set(range(8))) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_an_affinity_smaller_than_the_machine(tmp_path: Path) -> None:
    """A container or `taskset` gives this process some cores: each node keeps those; a node left with
    none holds no worker, and with one node left, nothing is pinned."""
    root = fake_sys(tmp_path, {0: "0-3", 1: "4-7", 2: "8-11"})
    assert cpu_worker_cores(root, affinity={1, 2, 5}) == [[1, 2], [5]]
    assert cpu_worker_cores(root, affinity={8, 9}) is None


def test_no_node_listing_is_one_node(tmp_path: Path) -> None:
    assert numa_nodes(tmp_path / "missing", affinity={0, 1}) == [numa.NumaNode(0, (0, 1))]


def test_auto_is_one_pinned_worker_per_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numa, "NODES", fake_sys(tmp_path / "two", {0: "0", 1: "1"}))
    monkeypatch.setattr(numa, "usable_cpus", lambda: {0, 1})
    strategy = HeteroStrategy(stages=["cpu"], cpu_workers="auto")
    assert strategy.plan.cpu_workers == 2 and strategy.plan.cpu_cores == [[0], [1]]
    assert "2 CPU worker(s) on cores 0 | 1" in strategy.topology.describe()
    assert strategy.cpu_worker_threads == 1
    monkeypatch.setattr(numa, "NODES", fake_sys(tmp_path / "one", {0: "0-1"}))
    one = HeteroStrategy(stages=["cpu"], cpu_workers="auto")
    assert one.plan.cpu_workers == 1 and one.plan.cpu_cores is None


def test_core_sets_are_checked_before_any_process_starts(no_processes: None) -> None:
    cores = sorted(os.sched_getaffinity(0))
    assert HeteroStrategy(stages=["cpu"], cpu_workers=[[cores[0]], f"{cores[-1]}"]).plan.cpu_cores == [[cores[0]], [cores[-1]]]
    with pytest.raises(ValueError, match="share a core"):
        HeteroStrategy(cpu_workers=[[cores[0]], [cores[0]]])
    with pytest.raises(ValueError, match="may not run on"):
        HeteroStrategy(cpu_workers=[[10_000]])
    with pytest.raises(ValueError, match="non-empty list of core numbers"):
        HeteroStrategy(cpu_workers=[[]])
    with pytest.raises(ValueError, match="'auto' \\(one per NUMA node"):
        HeteroStrategy(cpu_workers="all")
    with pytest.raises(ValueError, match="core set\\(s\\) for 3 CPU worker"):
        HeteroPlan(cpu_workers=3, cpu_cores=[[0], [1]])
    plan = HeteroPlan(cpu_workers=1, cpu_cores=[[10_000]])  # a plan for another machine...
    with pytest.raises(ValueError, match="cannot run on this machine.*may not run on"):
        HeteroStrategy(plan=plan)  # ...that this one cannot follow


class Pinned(L.Callback):
    """Every rank writes its cores and torch threads once training runs."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if isinstance(trainer.strategy, HeteroStrategy):
            from lightning_hetero.topology import usable_cores

            found = {"cores": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(), "usable": usable_cores()}
            torch.save(found, self.out / f"rank{trainer.global_rank}.pt")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pinned_cpu_workers_run_on_their_cores_and_train_the_one_process_model(tmp_path: Path) -> None:
    first, second = sorted(os.sched_getaffinity(0))[:2]
    strategy = hetero(stages=["cpu"], cpu_workers=[[first], [second]], cpu_fraction=0.5)
    assert_same_run(tmp_path, strategy, TwoPass, regression_data, callbacks=[Pinned(tmp_path)])
    ranks: list[Any] = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    # Every rank counts the cores the run may use alike (what the analyzer and the rebalancer split).
    everyone = len(os.sched_getaffinity(0))
    assert ranks[0] == {"cores": [first], "threads": 1, "usable": everyone}
    assert ranks[1] == {"cores": [second], "threads": 1, "usable": everyone}
    assert len(ranks[2]["cores"]) == everyone  # the device's process is not pinned


def test_the_plans_explanation_says_what_the_cpu_workers_make_of_the_nodes() -> None:
    """`explain.txt`'s CPU line: the nodes the analyzer found, the CPU workers and their cores, and
    what `cpu_workers="auto"` would do where the workers are not pinned to the nodes."""
    from lightning_hetero.planner import cpu_workers_line

    nodes = [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    line = cpu_workers_line(nodes, HeteroPlan(cpu_workers=1))
    assert line == (
        "CPU: 2 NUMA node(s) (cores 0-3,8-11 | 4-7,12-15); 1 CPU worker(s), not pinned"
        " (cpu_workers='auto' runs one per node, pinned to its cores and memory)"
    )
    pinned = cpu_workers_line(nodes, HeteroPlan(cpu_workers=2, cpu_cores=nodes))
    assert pinned.endswith("2 CPU worker(s), pinned to cores 0-3,8-11 | 4-7,12-15; the optimizer state they hold: split between them")
    fine = cpu_workers_line(nodes, HeteroPlan(cpu_workers=1, mode="fine", offload=[0], shard_across_nodes=True))
    assert fine.endswith("offloaded buckets split between every node's CPU workers (shard_across_nodes), the others a whole copy in each")
    assert cpu_workers_line(nodes, HeteroPlan(cpu_workers=2, mode="fine", offload="none")).endswith("and none is offloaded)")
    whole = cpu_workers_line([[0, 1]], HeteroPlan(cpu_workers=2, shard_cpu_optimizer=False))
    assert whole == "CPU: 1 NUMA node(s) (cores 0-1); 2 CPU worker(s), not pinned; the optimizer state they hold: a whole copy in each (shard_cpu_optimizer=False)"
