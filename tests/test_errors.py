"""Bad input gets a clear error, raised before any process starts."""

from __future__ import annotations

import re
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.multiprocessing.spawn import ProcessRaisedException
from torch.utils.data import DataLoader, TensorDataset

from lightning_hetero import HeteroStrategy, PipelineModule
from tests.conftest import hetero, trainer
from tests.models import Net, regression_data


class NoContract(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(6, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NoLoss(PipelineModule, L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 3)])

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)


class Variant(Net):
    """`Net` with one thing broken, chosen by name."""

    def __init__(self, broken: str) -> None:
        super().__init__()
        self.broken = broken
        if broken == "orphan":
            self.extra = nn.Parameter(torch.zeros(3))
        if broken == "tied":
            self.layers[4].weight = nn.Parameter(torch.zeros(3, 16))
            self.layers[5] = nn.Linear(3, 16, bias=False)
            self.layers[5].weight = self.layers[4].weight
        if broken == "batchnorm":
            self.layers[1] = nn.BatchNorm1d(16)
        if broken == "manual":
            self.automatic_optimization = False

    def pipeline_layers(self) -> list[nn.Module]:
        if self.broken == "foreign":
            return [nn.Linear(6, 3)]
        return super().pipeline_layers()


def fit(model: L.LightningModule, strategy: Any = None, **kwargs: Any) -> None:
    trainer(strategy or hetero(), max_steps=1, **kwargs).fit(model, regression_data())


@pytest.mark.parametrize(
    "model,message",
    [
        (NoContract(), "does not follow the hetero model contract: it has no `pipeline_layers()`"),
        (NoLoss(), "it has no `pipeline_loss()`"),
        (Variant("foreign"), "is not a submodule of the model"),
        (Variant("orphan"), "trainable parameters outside `pipeline_layers()`: extra"),
        (Variant("tied"), "share a parameter (weight tying)"),
        (Variant("batchnorm"), "contains BatchNorm1d with running statistics"),
        (Variant("manual"), "uses manual optimization"),
    ],
    ids=["no-layers", "no-loss", "foreign-layer", "orphan-parameter", "tied", "batchnorm", "manual"],
)
def test_model_contract(no_processes: None, model: L.LightningModule, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        fit(model)


def test_more_stages_than_layers(no_processes: None) -> None:
    with pytest.raises(ValueError, match=re.escape("Cannot cut 6 layer(s) into 7 pipeline stages")):
        fit(Net(), hetero(stages=["cpu"] * 7))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"cpu_fraction": 1.5}, "`cpu_fraction=1.5` must be 'auto' or a number between 0 and 1"),
        ({"cpu_fraction": -0.1}, "`cpu_fraction=-0.1` must be 'auto' or a number between 0 and 1"),
        ({"cpu_fraction": "half"}, "`cpu_fraction='half'` must be 'auto' or a number between 0 and 1"),
        ({"cpu_fraction": 0.5, "cpu_workers": 0}, "`cpu_workers=0` starts no CPU worker"),
        ({"stages": ["cuda:0"]}, "is a GPU, but CUDA is not available on this machine"),
        ({"stages": ["cpu", "tpu"]}, "Stage device 'tpu' is not a device name"),
        ({"stages": ["mps"]}, "Stage device 'mps' is not supported"),
        ({"stages": 0}, "a hetero run needs at least one pipeline stage"),
        ({"stages": "many"}, "`stages='many'` is not understood"),
        ({"schedule": "Foo"}, "Unknown schedule name 'Foo'"),
        ({"schedule": "Interleaved1F1B"}, "runs several stages per rank"),
        ({"schedule": "1F1B", "stages": ["cpu"] * 3, "micro_batches": 2}, "needs at least as many micro-batches"),
        ({"micro_batches": 0}, "`micro_batches=0` must be an integer >= 1"),
        ({"cpu_workers": -1}, "`cpu_workers=-1` must be an integer >= 0"),
        ({"mode": "medium"}, "`mode='medium'` is not a hetero mode"),
    ],
)
def test_strategy_arguments(no_processes: None, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        HeteroStrategy(**kwargs)


def test_unsupported_precision(no_processes: None) -> None:
    with pytest.raises(ValueError, match="float16 mixed precision needs a loss scale agreed between all workers"):
        L.Trainer(strategy="hetero", precision="16-mixed", accelerator="hetero")


def test_batches_must_be_inputs_and_targets() -> None:
    loader = DataLoader(TensorDataset(torch.randn(12, 6), torch.randn(12, 3), torch.randn(12)), batch_size=4)
    with pytest.raises(ProcessRaisedException, match=re.escape("expects every batch to be a pair `(inputs, targets)`")):
        trainer(hetero(cpu_fraction=0.0), max_steps=1).fit(Net(), loader)


class ExtraLoss(Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        return self.pipeline_loss(out, y) + 0.1 * out.abs().mean()


class WithLBFGS(Net):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters())


@pytest.mark.parametrize(
    "model,message",
    [
        (ExtraLoss(), "`training_step` must return exactly that loss"),
        (WithLBFGS(), "LBFGS re-evaluates the loss inside `optimizer.step`"),
    ],
    ids=["loss-other-than-pipeline_loss", "lbfgs"],
)
def test_errors_inside_the_run_end_it_with_the_cause_and_the_rank(model: L.LightningModule, message: str) -> None:
    with pytest.raises(ProcessRaisedException, match=re.escape(message)) as error:
        fit(model, hetero(cpu_fraction=0.5))
    assert "[hetero] raised on global rank" in str(error.value)
    if isinstance(model, ExtraLoss):  # found by the last stage: global rank 2 of 1 CPU worker + 2 stages
        assert "raised on global rank 2 (stage1" in str(error.value)


def test_shuffled_evaluation_data_is_an_error() -> None:
    val = DataLoader(regression_data().dataset, batch_size=4, shuffle=True)
    with pytest.raises(ProcessRaisedException, match=re.escape("The val dataloader shuffles with the global random")):
        trainer(hetero(), max_steps=1).fit(Net(), regression_data(), val)
