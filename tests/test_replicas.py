"""Replicas: a LightningModule as people write it, with no blocks, trains with the hetero strategy as
it is. Every device holds the whole model and runs its own `training_step` on its part of every
batch, beside the CPU workers; the model is the one a single process trains (float64, 1e-10).

"Devices" here are emulated on CPU processes (`stages=["cpu", "cpu"]`), as everywhere in the suite.
"""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path
from typing import Any, Callable

import lightning as L
import pytest
import torch
from torch import nn
from lightning.pytorch.callbacks import LearningRateMonitor

from lightning_hetero import HeteroStrategy
from tests.conftest import RecordCopies, assert_copies_identical, hetero, max_param_diff, trainer
from tests.models import (
    Captioned,
    SampleList,
    TinyGPT2,
    TwoPass,
    captioned_data,
    column,
    demo_data,
    demo_transformer,
    read_metrics,
    regression_data,
    sample_list_data,
    token_data,
)

TOL = 1e-10
STEPS = 8


def assert_same_run(
    tmp_path: Path,
    strategy: Any,
    model: Callable[[], L.LightningModule] = TwoPass,
    data: Callable[[], Any] = regression_data,
    key: str = "train_loss",
    loss_tol: float = TOL,
    callbacks: list | None = None,
    steps: int = STEPS,
    copies_tol: float = 0.0,
    **trainer_kwargs: Any,
) -> None:
    """Plain and hetero give the same parameters and losses, and every rank's copy of every
    parameter is identical after every step (within ``copies_tol`` where set)."""

    def fit(strategy: Any, log_dir: Path, more: list) -> tuple[L.LightningModule, list]:
        m = model()
        extra = [LearningRateMonitor("step"), *(callbacks or []), *more]
        t = trainer(strategy, log_dir, max_steps=steps, callbacks=extra, **trainer_kwargs)
        t.fit(m, data())
        return m, read_metrics(log_dir)

    ref, ref_rows = fit(None, tmp_path / "plain", [])
    copies = tmp_path / "copies"
    copies.mkdir()
    het, het_rows = fit(strategy, tmp_path / "hetero", [RecordCopies(copies)])
    drift = assert_copies_identical(copies, copies_tol)
    if copies_tol:
        print("largest difference between the copies after each step:", " ".join(f"{d:.2g}" for d in drift))
    assert max_param_diff(ref, het) < TOL
    ref_values, het_values = column(ref_rows, key), column(het_rows, key)
    assert ref_values and [s for s, _ in ref_values] == [s for s, _ in het_values]
    assert max(abs(a - b) for (_, a), (_, b) in zip(ref_values, het_values)) < loss_tol


@pytest.mark.parametrize("cpu_fraction", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("mode", ["coarse", "fine"])
def test_a_module_without_blocks_trains_as_replicas(tmp_path: Path, cpu_fraction: float, devices: int, mode: str) -> None:
    strategy = hetero(stages=["cpu"] * devices, cpu_fraction=cpu_fraction, mode=mode)
    assert_same_run(tmp_path, strategy)


@pytest.mark.parametrize(
    "layout",
    [
        dict(cpu_workers=0, stages=["cpu", "cpu"]),
        dict(cpu_workers=2, stages=["cpu"], cpu_fraction=0.5),
        dict(mode="fine", offload="all", bucket_size_mb=0.0002, cpu_fraction=0.5),
    ],
    ids=["devices-only", "two-cpu-workers", "fine-offloaded-buckets"],
)
def test_replica_layouts(tmp_path: Path, layout: dict) -> None:
    assert_same_run(tmp_path, hetero(**layout))


@pytest.mark.parametrize("mode", ["coarse", "fine"])
def test_replicas_accumulate_and_clip_as_one_process(tmp_path: Path, mode: str) -> None:
    strategy = hetero(cpu_fraction=0.5, mode=mode)
    assert_same_run(tmp_path, strategy, accumulate_grad_batches=3, gradient_clip_val=0.05)


def test_a_batch_with_a_caption_per_sample(tmp_path: Path) -> None:
    """Dict batches holding a list of strings with one per sample, and a per-batch number."""
    assert_same_run(tmp_path, hetero(cpu_fraction=0.5), Captioned, captioned_data)


def test_a_batch_that_is_a_list_of_samples(tmp_path: Path) -> None:
    """`collate_fn=list`: the list is divided between the workers, not each sample's tensors."""
    assert_same_run(tmp_path, hetero(cpu_fraction=0.5), SampleList, sample_list_data)


def test_a_hugging_face_causal_lm_through_its_own_loss(tmp_path: Path) -> None:
    """GPT-2 from a config, dict batches, `model(**batch).loss`, input and output embeddings tied.
    (Its loss function computes in float32 whatever the model's precision, so the loss it logs is
    the same to float32's precision; the parameters to float64's.)"""
    assert_same_run(tmp_path, hetero(cpu_fraction=0.5), TinyGPT2, token_data, loss_tol=1e-6)


@pytest.mark.parametrize("cpu_fraction, batch_size", [(0.0, 1), (1.0, 1), (0.5, 4)])
def test_lightnings_demo_transformer_as_it_ships(tmp_path: Path, cpu_fraction: float, batch_size: int) -> None:
    """Batches of one sequence (its loader's), which a worker takes whole: the device's replica, or the
    CPU worker's; and batches of several, split between them (its transformer is batch-first). Split,
    the sums differ from one process's by rounding (1e-17 after one step), which its training grows
    about a hundredfold a step: 4 steps stay well within the tolerance."""
    data = partial(demo_data, batch_size=batch_size)
    steps = STEPS if batch_size == 1 else 4
    assert_same_run(tmp_path, hetero(cpu_fraction=cpu_fraction), demo_transformer, data, key="lr-SGD", steps=steps)


def test_a_model_with_blocks_can_be_trained_as_replicas(tmp_path: Path) -> None:
    from tests.models import Net

    strategy = hetero(cpu_fraction=0.5, parallelism="replicas")
    assert_same_run(tmp_path, strategy, Net)


def test_the_layout_says_what_the_devices_hold() -> None:
    strategy = HeteroStrategy(stages=["cpu", "cpu"])
    strategy.check_model(TwoPass())
    assert strategy.plan.parallelism == "replicas" and strategy.device_names == ["cpu0", "replica0", "replica1"]
    assert strategy.topology.describe() == "1 CPU worker(s) + 2 replica(s) [cpu, cpu] x 1 node(s)"
    assert strategy.micro_batches == 1  # nothing to pipeline


def test_validation_and_predictions_from_every_replica(tmp_path: Path) -> None:
    model = TwoPass()
    t = trainer(hetero(cpu_fraction=0.5), tmp_path, max_steps=4, limit_val_batches=2, val_check_interval=2)
    t.fit(model, regression_data(), regression_data(n=24, seed=5))
    assert "val_loss" in t.callback_metrics
    predicted = t.predict(model, regression_data(n=25, batch_size=6, seed=4))
    assert sum(len(p) for p in predicted) == 25
    reference = torch.cat([model(x.double()) for x, _ in regression_data(n=25, batch_size=6, seed=4)])
    assert torch.allclose(torch.cat(predicted), reference.detach(), atol=1e-6)


class Toggle(L.Callback):
    """Moves the CPU fraction every step, alike on every rank: the CPU workers keep out of some steps
    and are brought up to date from the first device's replica before they compute again."""

    FRACTIONS = (0.0, 0.0, 0.5, 1.0, 0.0, 0.3)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if isinstance(trainer.strategy, HeteroStrategy):
            trainer.strategy.set_cpu_fraction(self.FRACTIONS[trainer.global_step % len(self.FRACTIONS)])


@pytest.mark.parametrize("mode", ["coarse", "fine"])
@pytest.mark.parametrize("devices", [1, 2])
def test_replicas_follow_a_moving_cpu_fraction(tmp_path: Path, mode: str, devices: int) -> None:
    strategy = hetero(stages=["cpu"] * devices, cpu_fraction=0.5, mode=mode)
    assert_same_run(tmp_path, strategy, callbacks=[Toggle()], accumulate_grad_batches=2)


class RunningMean(nn.Module):
    """Keeps a running mean of its inputs in a buffer, updated in the training forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.mean.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return x - self.mean


class RecordWarnings(L.Callback):
    """Each rank writes the warnings raised while it trained to ``warnings<rank>.txt`` (a forked
    process's warnings go to its own copy of pytest's record otherwise)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._catching = warnings.catch_warnings(record=True)
        self._caught = self._catching.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._catching.__exit__(None, None, None)
        lines = [str(w.message) for w in self._caught]
        (self.out_dir / f"warnings{trainer.global_rank}.txt").write_text("\n".join(lines))


def test_a_buffer_the_training_step_writes_is_named_in_a_warning(tmp_path: Path) -> None:
    """Each worker updates such a buffer from its own share: the run cannot be one process's, and says so."""

    class WithRunningMean(TwoPass):
        def __init__(self) -> None:
            super().__init__()
            self.net.insert(1, RunningMean(16))

    def warned(model: L.LightningModule, out: Path) -> list[str]:
        out.mkdir()
        trainer(hetero(cpu_fraction=0.5), max_steps=2, callbacks=[RecordWarnings(out)]).fit(model, regression_data())
        return [path.read_text() for path in sorted(out.glob("warnings*.txt"))]

    written = warned(WithRunningMean(), tmp_path / "buffer")
    assert len(written) == 3 and all("training step changed its buffer(s) ['net.1.mean']" in w for w in written)
    assert not any("changed its buffer" in w for w in warned(TwoPass(), tmp_path / "none"))


class RenormsItsWeight(nn.Module):
    """Scales its input by a weight it renormalizes in place from the batch it sees, as
    `nn.Embedding(max_norm=...)` does to the rows it looks up."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.weight.div_(1 + x.detach().abs().mean())
        return x * self.weight.clone()  # the step may run the module again, writing the weight once more


@pytest.mark.parametrize(
    "layout",
    [{}, {"mode": "fine"}, {"mode": "fine", "offload": "all"}, {"mode": "fine", "accumulate": 2}],
    ids=["coarse", "fine", "fine-offloaded", "fine-accumulating"],
)
def test_a_parameter_the_training_step_writes_in_place_is_named_in_a_warning(tmp_path: Path, layout: dict) -> None:
    """Each worker writes it from its own share, so the copies part ways: said once, on every rank;
    not where the optimizer's own steps write the parameters during the backward (fine mode)."""
    layout = dict(layout)
    accumulate = layout.pop("accumulate", 1)

    class WithRenorm(TwoPass):
        def __init__(self) -> None:
            super().__init__()
            self.net.insert(1, RenormsItsWeight(16))

    def warned(model: L.LightningModule, out: Path, **kwargs: Any) -> list[str]:
        out.mkdir()
        strategy = hetero(cpu_fraction=0.5, **layout, **kwargs)
        callbacks = [RecordWarnings(out)]
        trainer(strategy, max_steps=2, callbacks=callbacks, accumulate_grad_batches=accumulate).fit(model, regression_data())
        return [path.read_text() for path in sorted(out.glob("warnings*.txt"))]

    written = warned(WithRenorm(), tmp_path / "renorm")
    assert len(written) == 3 and all("training step wrote its parameter(s) ['net.1.weight'] in place" in w for w in written)
    assert not any("wrote its parameter" in w for w in warned(TwoPass(), tmp_path / "none"))


class TwoLoaders(TwoPass):
    """Trains on a batch of each of two training dataloaders every step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (xa, ya), (xb, yb) = batch["a"], batch["b"]
        loss = nn.functional.mse_loss(self(xa), ya) + 0.5 * nn.functional.mse_loss(self(xb), yb)
        self.log("train_loss", loss)
        return loss


def test_several_training_dataloaders_of_one_batch_size(tmp_path: Path) -> None:
    """A dict of loaders, the shorter cycled (Lightning's default): each step's batches split alike."""
    data = lambda: {"a": regression_data(n=48, batch_size=12), "b": regression_data(n=24, batch_size=12, seed=2)}  # noqa: E731
    assert_same_run(tmp_path, hetero(cpu_fraction=0.5), TwoLoaders, data)
