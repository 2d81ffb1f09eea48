"""The module's own hooks under the strategy: those it follows train as one process does, and
those it cannot follow are refused clearly."""

from __future__ import annotations

import re
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint

from lightning_hetero.callbacks import AdaptiveRebalancer, UtilizationMonitor
from lightning_hetero.module import check_optimizers

from tests.conftest import hetero, max_param_diff, trainer
from tests.models import Net, TwoPass, regression_data

TOL = 1e-10


class ZeroesEveryOtherStep(Net):
    """Keeps the gradients of odd batches for the next optimizer step (accumulating by hand)."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        if batch_idx % 2 == 0:
            optimizer.zero_grad()


class ZeroesInPlace(Net):
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=False)


def test_an_optimizer_zero_grad_that_keeps_gradients_is_refused_where_it_does() -> None:
    """Every worker holds the summed gradients after a step: kept, they would be summed again."""
    with pytest.raises(Exception, match="left gradients in place at the start of optimizer step 1"):
        trainer(hetero(cpu_fraction=0.5), max_steps=4).fit(ZeroesEveryOtherStep(scheduler=False), regression_data())


@pytest.mark.parametrize("parallelism", ["pipeline", "replicas"])
def test_an_optimizer_zero_grad_that_zeroes_in_place_trains_as_one_process(parallelism: str) -> None:
    plain, model = ZeroesInPlace(), ZeroesInPlace()
    trainer(None, max_steps=6).fit(plain, regression_data())
    trainer(hetero(cpu_fraction=0.4, parallelism=parallelism), max_steps=6).fit(model, regression_data())
    assert max_param_diff(plain, model) < TOL


class StopsInItsStep(Net):
    """Asks the trainer to stop from `training_step`, which a pipeline's first stage never runs."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        if self.global_step >= 4:
            self.trainer.should_stop = True
        return loss


@pytest.mark.parametrize("cpu_fraction", [0.0, 0.5])
def test_should_stop_set_in_the_step_method_stops_every_rank_after_that_step(cpu_fraction: float) -> None:
    plain, model = StopsInItsStep(), StopsInItsStep()
    reference = trainer(None, max_epochs=4)
    reference.fit(plain, regression_data())
    run = trainer(hetero(cpu_fraction=cpu_fraction, timeout=20), max_epochs=4)
    run.fit(model, regression_data())
    assert reference.global_step == 5
    assert max_param_diff(plain, model) < TOL


class HooksOfTheWholeStep(Net):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.log("grads", float(sum(p.grad.abs().sum() for p in self.parameters() if p.grad is not None)))

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)


def test_fine_mode_names_the_hooks_it_does_not_follow() -> None:
    model = HooksOfTheWholeStep()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = "fine mode does not follow.*`optimizer_step` runs after the buckets.*`on_before_optimizer_step` runs after"
    with pytest.warns(UserWarning, match=expected):
        check_optimizers(model, [optimizer], "fine")
    with pytest.warns(UserWarning, match="callback `WarmUp` overrides.*`on_before_optimizer_step`.*learning rate set there"):
        check_optimizers(Net(), [optimizer], "fine", [WarmUp(), ModelCheckpoint()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_optimizers(model, [optimizer], "coarse", [WarmUp()])
        check_optimizers(Net(), [optimizer], "fine", [ModelCheckpoint(), LearningRateMonitor(), AdaptiveRebalancer(), UtilizationMonitor()])


class WarmUp(L.Callback):
    """A warm-up written as a callback: the learning rate of each step, set before it."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        for group in optimizer.param_groups:
            group["lr"] = 0.1 * min(1.0, (trainer.global_step + 1) / 4)


class TrainsAPartByHand(ZeroesInPlace):
    """Leaves its last layer out of the optimizer: that layer's gradients stay where no `zero_grad` clears them."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(list(self.layers[:4].parameters()), lr=0.1)


def test_gradients_the_optimizer_does_not_hold_may_stay() -> None:
    plain, model = TrainsAPartByHand(), TrainsAPartByHand()
    trainer(None, max_steps=4).fit(plain, regression_data())
    trainer(hetero(cpu_fraction=0.4), max_steps=4).fit(model, regression_data())
    assert max_param_diff(plain, model) < TOL


class WithExampleInput(Net):
    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.zeros(2, 6, dtype=torch.float64)


def test_the_model_summary_runs_the_example_input_on_every_rank_of_a_pipeline() -> None:
    """Lightning's summary (on by default) feeds `example_input_array` through the whole model on every
    rank: a stage, whose other stages' layers are on the meta device, lets it leave the input out.
    The model trains as one process's, and keeps its example input."""
    plain, model = WithExampleInput(), WithExampleInput()
    trainer(None, max_steps=3, enable_model_summary=True).fit(plain, regression_data())
    trainer(hetero(cpu_fraction=0.5), max_steps=3, enable_model_summary=True).fit(model, regression_data())
    assert max_param_diff(plain, model) < 1e-10
    assert model.example_input_array is not None


class ReinitializesOnTrainStart(Net):
    """Draws new weights when training starts: each process from its own random stream, and a
    pipeline stage only for the layers it holds."""

    def on_train_start(self) -> None:
        for layer in self.layers:
            if isinstance(layer, torch.nn.Linear):
                torch.nn.init.normal_(layer.weight, std=0.5)


class ReinitializesInSetup(ReinitializesOnTrainStart):
    """The same draws in `setup`, which every process runs alike on the whole model."""

    def setup(self, stage: str) -> None:
        self.on_train_start()

    def on_train_start(self) -> None:
        pass


@pytest.mark.parametrize("parallelism", ["pipeline", "replicas"])
def test_parameters_a_hook_changed_differently_on_the_processes_are_an_error(parallelism: str) -> None:
    """Copies that differ at the first batch would never meet again: named, on every rank, at once."""
    torch.manual_seed(7)
    strategy = hetero(cpu_fraction=0.5, parallelism=parallelism)
    model = ReinitializesOnTrainStart()
    if parallelism == "replicas":  # forked replicas draw alike: make one process's stream its own
        model.on_train_start = lambda: (torch.manual_seed(model.trainer.global_rank), ReinitializesOnTrainStart.on_train_start(model))  # type: ignore[method-assign]
    with pytest.raises(Exception) as error:
        trainer(strategy, max_steps=2).fit(model, regression_data())
    assert re.search(r"copies of the parameter\(s\) \['layers\.\d\.weight'.* differ at the first training batch", str(error.value))


def test_parameters_set_in_setup_stay_one_model() -> None:
    torch.manual_seed(7)
    plain = ReinitializesInSetup()
    trainer(None, max_steps=3).fit(plain, regression_data())
    torch.manual_seed(7)
    model = ReinitializesInSetup()
    trainer(hetero(cpu_fraction=0.5), max_steps=3).fit(model, regression_data())
    assert max_param_diff(plain, model) < 1e-10


class LogsTheMeanOfItsSteps(Net):
    """Lightning 2's way to log what the step methods returned at the epoch's end: the outputs each
    process's step methods collected (none on a stage before the last)."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.outputs.append(loss.detach())
        return loss

    def on_train_epoch_end(self) -> None:
        if self.outputs:
            self.log("epoch_mean", torch.stack(self.outputs).mean())
        self.outputs.clear()


@pytest.mark.parametrize("kind", ["ModelCheckpoint", "EarlyStopping"])
def test_a_callback_monitoring_a_value_only_some_processes_logged_stops_at_once(tmp_path: Path, kind: str) -> None:
    """The processes without the value would skip the save, or the early-stopping decision, the others
    wait on (until the timeout; `strict=False` early stopping skips it quietly): every process stops
    at the epoch's end, saying which lack it and why."""
    if kind == "ModelCheckpoint":
        callback: Any = ModelCheckpoint(dirpath=tmp_path, monitor="epoch_mean")
    else:
        callback = EarlyStopping(monitor="epoch_mean", strict=False, check_on_train_epoch_end=True)
    strategy = hetero(cpu_fraction=0.5, timeout=120)
    started = time.monotonic()
    with pytest.raises(Exception) as error:
        trainer(strategy, max_epochs=2, enable_checkpointing=True, callbacks=[callback]).fit(LogsTheMeanOfItsSteps(), regression_data())
    assert time.monotonic() - started < 60
    said = rf"`{kind}\(monitor='epoch_mean'\)`: 'epoch_mean' was logged on 2 of 3 processes, not on global rank 1 \(stage0"
    assert re.search(said, str(error.value))


class BuildsInSetup(TwoPass):
    """A layer built in `setup`, which runs in the strategy's processes only (a model without blocks,
    trained as replicas, so that a parameter outside them is allowed)."""

    def setup(self, stage: str) -> None:
        self.extra = torch.nn.Linear(3, 3)


def test_layers_built_in_setup_are_named_where_their_weights_cannot_be_handed_back() -> None:
    """Forked ranks hand their weights back to this process's model, which has no `extra`: Lightning
    loads them leniently, and the loss is said, with what to do."""
    model = BuildsInSetup()
    with pytest.warns(UserWarning, match=r"`BuildsInSetup` in this process has no \['extra.weight', 'extra.bias'\]"):
        trainer(hetero(cpu_fraction=0.5), max_steps=1).fit(model, regression_data())
    assert not hasattr(model, "extra")


def test_weights_reparametrized_in_the_processes_are_named_where_they_cannot_be_handed_back() -> None:
    """`ModelPruning` that keeps its reparametrization renames each pruned weight in the processes
    (`weight_orig`, `weight_mask`): this process's `weight` gets nothing back, and that is said too."""
    from lightning.pytorch.callbacks import ModelPruning

    model = Net()
    pruning = ModelPruning("l1_unstructured", amount=0.2, make_pruning_permanent=False, verbose=0)
    expected = r"`Net` in this process has no \['layers.0.weight_orig', .*got no trained value for \['layers.0.weight',"
    with pytest.warns(UserWarning, match=expected):
        trainer(hetero(cpu_fraction=0.5, parallelism="replicas", stages=["cpu"]), max_steps=2, precision="32-true",
                callbacks=[pruning]).fit(model, regression_data())


class LazyMadeInConfigureModel(Net):
    """A lazy layer given its shape by a batch run through the model in `configure_model`."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[4] = torch.nn.LazyLinear(3)

    def configure_model(self) -> None:
        if isinstance(self.layers[4].weight, torch.nn.parameter.UninitializedParameter):
            torch.manual_seed(1)
            with torch.no_grad():
                self(torch.zeros(1, 6, dtype=self.layers[0].weight.dtype))


def test_lazy_layers_given_their_shapes_in_configure_model_train_as_one_process() -> None:
    plain, model = LazyMadeInConfigureModel(), LazyMadeInConfigureModel()
    trainer(None, max_steps=3).fit(plain, regression_data())
    trainer(hetero(cpu_fraction=0.5), max_steps=3).fit(model, regression_data())
    assert max_param_diff(plain, model) < 1e-10
