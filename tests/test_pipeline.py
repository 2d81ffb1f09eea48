"""Cutting the layers into stages, and choosing schedules."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

from lightning_hetero.pipeline import StageModule, partition_layers, resolve_schedule
from tests.conftest import hetero, max_param_diff, trainer
from tests.models import DictNet, Net, dict_data, regression_data
from tests.test_replicas import assert_same_run


def layers(*widths: int) -> list[nn.Module]:
    return [nn.Linear(w, 1, bias=False) if w else nn.Tanh() for w in widths]


def brute_force_best(costs: list[int], k: int) -> int:
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), k - 1):
        bounds = [0, *cuts, len(costs)]
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("widths", [(5, 1, 1, 1, 5), (10, 0, 3, 0, 3, 4, 0, 9), (1, 2, 3, 4, 5, 6), (7,) * 5])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_partition_is_contiguous_and_minimizes_the_largest_stage(widths: tuple, k: int) -> None:
    mods = layers(*widths)
    bounds = partition_layers(mods, k)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(mods) and len(bounds) == k
    assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
    costs = [1 + w for w in widths]
    assert max(sum(costs[a:b]) for a, b in bounds) == brute_force_best(costs, k)


def test_one_layer_per_stage() -> None:
    assert partition_layers(layers(1, 2, 3), 3) == [(0, 1), (1, 2), (2, 3)]


def test_too_many_stages() -> None:
    with pytest.raises(ValueError, match="Cannot cut 2 layer"):
        partition_layers(layers(1, 1), 3)


def test_schedules_by_name() -> None:
    assert resolve_schedule("gpipe", 2, 1) is ScheduleGPipe
    assert resolve_schedule("1F1B", 2, 2) is Schedule1F1B
    assert resolve_schedule(ScheduleGPipe, 4, 1) is ScheduleGPipe


def test_stage_module_runs_its_layers_in_order() -> None:
    import torch

    first, second = nn.Linear(2, 3), nn.Linear(3, 1)
    x = torch.randn(4, 2)
    assert torch.equal(StageModule([first, second])(x), second(first(x)))


@pytest.mark.parametrize("keyed", [False, True], ids=["tensor-input", "dict-input"])
@pytest.mark.parametrize("cpu_fraction", [0.0, 0.4])
def test_a_pipeline_fed_through_its_pipeline_inputs_hook(tmp_path: Path, keyed: bool, cpu_fraction: float) -> None:
    """Dict batches with a string per sample: `pipeline_inputs` says what feeds the first block (a
    tensor, or a dict the first block takes) and what the target is; it trains as one process."""
    strategy = hetero(stages=["cpu", "cpu"], cpu_fraction=cpu_fraction, micro_batches=2)
    assert_same_run(tmp_path, strategy, lambda: DictNet(keyed), dict_data)


class AuxHead(nn.Module):
    """The model's last block returns its output and an auxiliary one, which `pipeline_loss` takes."""

    def __init__(self) -> None:
        super().__init__()
        self.out, self.aux = nn.Linear(3, 3), nn.Linear(3, 1)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.out(h), self.aux(h)


class TupleOutput(Net):
    def __init__(self) -> None:
        super().__init__()
        self.layers[5] = AuxHead()

    def pipeline_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        out, aux = output
        return nn.functional.mse_loss(out, target) + 0.1 * aux.pow(2).mean()


def test_a_model_whose_last_block_returns_a_tuple() -> None:
    plain, model = TupleOutput(), TupleOutput()
    trainer(None, max_steps=4).fit(plain, regression_data())
    trainer(hetero(cpu_fraction=0.5), max_steps=4).fit(model, regression_data())
    assert max_param_diff(plain, model) < 1e-10
