"""Validation, test and predict, logging, metrics and callbacks behave as in a single process."""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, EarlyStopping, ModelCheckpoint, TQDMProgressBar

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, Sampler
from torch.utils.data import SubsetRandomSampler, WeightedRandomSampler

from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.trainer.states import RunningStage
from lightning_hetero.data import same_batches_on_every_rank

from torchmetrics.aggregation import MaxMetric
from torchmetrics.classification import MulticlassAUROC, MulticlassF1Score

from tests.conftest import RecordCopies, assert_copies_identical, hetero, max_param_diff, trainer
from tests.models import (
    Classifier,
    LazyNet,
    Net,
    Predictor,
    classification_data,
    column,
    read_metrics,
    regression_data,
)

TOL = 1e-10


def test_validation_test_and_predict_match_plain(tmp_path: Path) -> None:
    results = {}
    for name, strategy in (("plain", None), ("hetero", hetero(stages=["cpu"] * 3, cpu_fraction=0.4))):
        model = Net()
        t = trainer(strategy, tmp_path / name, max_epochs=2)
        t.fit(model, regression_data(), regression_data(n=30, seed=5))
        # Read the fit's log now: like every process-launching strategy, later calls start a fresh logger.
        rows = read_metrics(tmp_path / name)
        validated = t.validate(model, regression_data(n=30, seed=6), verbose=False)
        tested = t.test(model, regression_data(n=26, seed=7), verbose=False)
        predicted = t.predict(model, regression_data(n=26, seed=8))
        results[name] = (model, rows, validated, tested, predicted)
    (plain, plain_rows, plain_val, plain_test, plain_pred), (het, het_rows, het_val, het_test, het_pred) = results.values()
    assert max_param_diff(plain, het) < TOL
    plain_epochs, het_epochs = column(plain_rows, "val_loss"), column(het_rows, "val_loss")
    assert len(plain_epochs) == 2 and [s for s, _ in plain_epochs] == [s for s, _ in het_epochs]
    assert max(abs(a - b) for (_, a), (_, b) in zip(plain_epochs, het_epochs)) < TOL
    assert abs(plain_val[0]["val_loss"] - het_val[0]["val_loss"]) < TOL
    assert abs(plain_test[0]["test_loss"] - het_test[0]["test_loss"]) < TOL
    assert len(het_pred) == len(plain_pred) == 3
    for a, b in zip(plain_pred, het_pred):
        assert a.shape == b.shape and torch.allclose(a, b, atol=TOL, rtol=0)


def test_torchmetrics_see_every_sample_once(tmp_path: Path) -> None:
    rows = {}
    for name, strategy in (("plain", None), ("hetero", hetero(cpu_fraction=0.3))):
        t = trainer(strategy, tmp_path / name, max_epochs=2)
        # Each epoch's last batch holds 8 samples, split unevenly, and logs `batch_size=12` as well.
        t.fit(Classifier(), classification_data(n=56), classification_data(n=36, seed=3))
        rows[name] = read_metrics(tmp_path / name)
    # A step's accuracy is a float32 metric value combined over the workers (one rounding in
    # float32); epoch accuracies come from the summed metric states and are exact.
    tolerance = {"train_acc_step": 1e-6}
    for key in ("train_acc_step", "train_acc_epoch", "val_acc", "val_loss", "train_loss", "train_loss_sized"):
        plain, het = column(rows["plain"], key), column(rows["hetero"], key)
        assert plain and [s for s, _ in plain] == [s for s, _ in het], key
        assert max(abs(a - b) for (_, a), (_, b) in zip(plain, het)) < tolerance.get(key, TOL), key
    assert [v for _, v in column(rows["hetero"], "seen")] == ([12.0] * 4 + [8.0]) * 2


class MaxError(Net):
    """Validates with torchmetrics' `MaxMetric`: torchmetrics makes its state in float32, and a rank's
    float64 updates make it float64 there, but not on a rank that computes no outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.max_error = MaxMetric()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.max_error((self(x) - y).abs().amax(1))
        self.log("val_max_error", self.max_error)


@pytest.mark.parametrize("cpu_fraction", [0.0, 0.5, 1.0])
def test_a_metric_that_some_ranks_never_update_syncs_with_the_others(cpu_fraction: float) -> None:
    (plain,) = trainer(None).validate(MaxError(), regression_data(n=40, batch_size=8))
    (het,) = trainer(hetero(cpu_fraction=cpu_fraction)).validate(MaxError(), regression_data(n=40, batch_size=8))
    assert abs(plain["val_max_error"] - het["val_max_error"]) < TOL


class RanksClasses(Classifier):
    """Logs a metric whose states are lists of the batches' predictions, of shape (n, classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.val_auroc = MulticlassAUROC(num_classes=4, thresholds=None)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_auroc(self(x), y)
        self.log("val_auroc", self.val_auroc)


@pytest.mark.parametrize(
    "layout", [dict(cpu_fraction=0.0), dict(cpu_fraction=0.0, parallelism="replicas")], ids=["pipeline", "replicas"]
)
def test_a_list_state_metric_that_some_ranks_never_update_syncs_with_the_others(layout: dict) -> None:
    """The ranks that never update it (the stage before the last, a CPU worker without a share) hold
    its empty states of shape (0,), the others theirs of shape (n, 4)."""
    data = lambda: classification_data(n=36)  # noqa: E731
    (plain,) = trainer(None).validate(RanksClasses(), data())
    (het,) = trainer(hetero(**layout)).validate(RanksClasses(), data())
    assert abs(plain["val_auroc"] - het["val_auroc"]) < TOL


class LogsANameTwice(Net):
    """Logs one name twice in a step, as a step method that logs a part of its loss, then the whole."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.pipeline_loss(self(x), y)
        self.log("part", loss, on_step=True, on_epoch=True)
        self.log("part", 2 * loss, on_step=True, on_epoch=True)
        # The batch's sample count, summed over the shares.
        self.log("seen", float(len(y)), reduce_fx="sum", on_step=True, on_epoch=False)
        self.log("seen", 2.0 * len(y), reduce_fx="sum", on_step=True, on_epoch=False)
        return loss


@pytest.mark.parametrize("cpu_fraction", [0.0, 0.4, 1.0])
def test_a_name_logged_twice_in_a_step_is_its_last_call_and_both_count_toward_the_epoch(
    tmp_path: Path, cpu_fraction: float
) -> None:
    """As in one process: the step's value is the last call's, and the epoch's mean weighs every call."""
    keys = ["part_step", "part_epoch", "seen"]
    assert_logged_as_in_one_process(tmp_path, hetero(cpu_fraction=cpu_fraction), LogsANameTwice, regression_data, keys)


@pytest.mark.parametrize(
    "layout", [dict(cpu_fraction=0.4), dict(cpu_fraction=0.0, parallelism="replicas")], ids=["pipeline", "replicas"]
)
def test_a_metric_that_syncs_on_step_logs_the_whole_batchs_value(tmp_path: Path, layout: dict) -> None:
    """Its step value is the whole batch's, as `dist_sync_on_step` gives it under DDP (its sync in
    `forward`, a collective in the step method that a stage before the last never runs, waited out
    the timeout)."""
    syncs_on_step = functools.partial(MacroF1, dist_sync_on_step=True)
    keys = ["train_f1_step", "train_f1_epoch"]
    assert_logged_as_in_one_process(tmp_path, hetero(**layout), syncs_on_step, classification_data, keys)


def assert_logged_as_in_one_process(
    tmp_path: Path, strategy: Any, model: Callable[[], L.LightningModule], data: Callable[[], Any], keys: list[str]
) -> None:
    """Two epochs of ``model()`` on ``data()``, plain and under ``strategy``: each of ``keys`` is
    logged at the same steps with the same values."""
    rows = {}
    for name, used in (("plain", None), ("hetero", strategy)):
        trainer(used, tmp_path / name, max_epochs=2).fit(model(), data())
        rows[name] = read_metrics(tmp_path / name)
    for key in keys:
        plain, het = column(rows["plain"], key), column(rows["hetero"], key)
        assert plain and [s for s, _ in plain] == [s for s, _ in het], key
        assert max(abs(a - b) for (_, a), (_, b) in zip(plain, het)) < TOL, key


class LogsItsLoadersBatchSize(Net):
    """Logs with a fixed `batch_size`, each validation loader's own, as one process would pass for every batch."""

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        self.log("val_loss", self.pipeline_loss(self(x), y), batch_size=[12, 8][dataloader_idx])


@pytest.mark.parametrize("cpu_fraction", [0.4, 0.5])
def test_a_fixed_batch_size_is_each_loaders_own(cpu_fraction: float) -> None:
    """The first loader's one batch is smaller than its `batch_size`, the second's last batch too:
    each value weighs the shares by their samples, and the batch by the loader's batch size."""
    loaders = lambda: [regression_data(n=6, batch_size=12), regression_data(n=20, batch_size=8, seed=3)]  # noqa: E731
    plain = trainer(None).validate(LogsItsLoadersBatchSize(), loaders())
    het = trainer(hetero(cpu_fraction=cpu_fraction)).validate(LogsItsLoadersBatchSize(), loaders())
    for p, h in zip(plain, het):
        assert p.keys() == h.keys() and all(abs(p[k] - h[k]) < TOL for k in p), (p, h)


def test_early_stopping_and_checkpointing_decide_as_in_one_process(tmp_path: Path) -> None:
    outcome = {}
    for name, strategy in (("plain", None), ("hetero", hetero(cpu_fraction=0.5))):
        checkpoint = ModelCheckpoint(dirpath=tmp_path / name / "ckpt", monitor="val_loss", save_top_k=1)
        stopping = EarlyStopping(monitor="val_acc", mode="max", patience=1, min_delta=0.2)
        t = trainer(strategy, tmp_path / name, max_epochs=10, callbacks=[checkpoint, stopping], enable_checkpointing=True)
        t.fit(Classifier(), classification_data(), classification_data(n=36, seed=3))
        epochs = {int(r["epoch"]) for r in read_metrics(tmp_path / name)}
        outcome[name] = (Path(t.checkpoint_callback.best_model_path).name, max(epochs), t.callback_metrics["val_loss"])
    assert outcome["hetero"][:2] == outcome["plain"][:2]
    assert outcome["hetero"][1] < 9  # early stopping really stopped the run
    assert abs(outcome["hetero"][2] - outcome["plain"][2]) < TOL


class RecordCallbackMetrics(L.Callback):
    """Writes what every rank sees in `trainer.callback_metrics` after each batch."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.seen: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.seen.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def on_validation_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.seen.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def on_fit_end(self, trainer: L.Trainer, *args: Any) -> None:
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.seen))


@pytest.mark.parametrize("cpu_fraction", [0.0, 0.5, 1.0])
def test_every_rank_sees_the_same_callback_metrics(tmp_path: Path, cpu_fraction: float) -> None:
    t = trainer(hetero(stages=["cpu"] * 3, cpu_fraction=cpu_fraction), max_epochs=2, callbacks=[RecordCallbackMetrics(tmp_path)])
    t.fit(Classifier(), classification_data(), classification_data(n=36, seed=3))
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert seen[0] and all(s == seen[0] for s in seen[1:])
    assert {"train_loss", "train_acc_step", "val_acc", "val_loss"} <= set(seen[0][-1])


def test_progress_bar_and_max_epochs(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    # Lightning draws a Rich bar where rich is installed: ask for its tqdm bar, whose text is asserted.
    t = trainer(hetero(), tmp_path, max_epochs=2, enable_progress_bar=True, callbacks=[TQDMProgressBar()])
    t.fit(Net(), regression_data())
    assert max(int(r["epoch"]) for r in read_metrics(tmp_path)) == 1
    assert max(int(r["step"]) for r in read_metrics(tmp_path)) == 7
    bar = capfd.readouterr().out  # rank 0 draws the bar (Lightning writes it to stdout)
    assert "Epoch 1: 100%" in bar and "train_loss=" in bar


def test_predictions_keep_their_structure_and_order() -> None:
    outputs = {}
    for name, strategy in (("plain", None), ("hetero", hetero(stages=["cpu"] * 3, cpu_fraction=0.4))):
        outputs[name] = trainer(strategy).predict(Predictor(), regression_data(n=26, seed=8))
    assert [len(b["labels"]) for b in outputs["hetero"]] == [12, 12, 2]
    for plain, het in zip(outputs["plain"], outputs["hetero"]):
        assert het["labels"] == plain["labels"] and torch.allclose(het["out"], plain["out"], atol=TOL, rtol=0)


class FilesWriter(BasePredictionWriter):
    """Lightning's example writer: each batch's predictions to ``<batch_idx>.pt``, and the epoch's to
    ``predictions_<global rank>.pt``, as under DDP, where each rank writes its own part."""

    def __init__(self, directory: Path) -> None:
        super().__init__("batch_and_epoch")
        self.directory = directory

    def write_on_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, prediction: Any, *args: Any) -> None:
        torch.save(prediction, self.directory / f"{args[2]}.pt")

    def write_on_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, predictions: Any, batch_indices: Any) -> None:
        torch.save(predictions, self.directory / f"predictions_{trainer.global_rank}.pt")


@pytest.mark.parametrize("layout", [{"cpu_fraction": 0.4}, {"cpu_workers": 0}], ids=["cpu-worker", "pipeline-only"])
def test_a_prediction_writer_writes_every_prediction_once(tmp_path: Path, layout: dict) -> None:
    """Predictions are assembled on global rank 0 (one node): the writer writes there, and the ranks
    whose predictions are `None` write nothing over its files."""
    plain = trainer(None).predict(Predictor(), regression_data(n=26, seed=8))
    t = trainer(hetero(stages=["cpu"] * 2, **layout), callbacks=[FilesWriter(tmp_path)])
    t.predict(Predictor(), regression_data(n=26, seed=8), return_predictions=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.pt", "1.pt", "2.pt", "predictions_0.pt"]
    epoch = torch.load(tmp_path / "predictions_0.pt", weights_only=False)
    for i, expected in enumerate(plain):
        for written in (torch.load(tmp_path / f"{i}.pt", weights_only=False), epoch[i]):
            assert written["labels"] == expected["labels"]
            assert torch.allclose(written["out"], expected["out"], atol=TOL, rtol=0)


@pytest.mark.parametrize("sampling", ["shuffle", "batch-sampler", "subset", "weighted"])
def test_shuffled_training_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sampling: str) -> None:
    """A loader whose sampler draws from the global random generator (none of its own): every rank
    must still see the same batches, in the order the shared seed gives (each rank consumes its
    global generator differently: dropout on one, none on another)."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    dataset = regression_data().dataset
    if sampling in ("shuffle", "batch-sampler"):
        shuffled = (
            DataLoader(dataset, batch_size=12, shuffle=True)
            if sampling == "shuffle"
            else DataLoader(dataset, batch_sampler=BatchSampler(RandomSampler(dataset), 12, drop_last=False))
        )
        # The same order for the single process: the seeded sampler the strategy puts in its place.
        ordered = DataLoader(dataset, batch_size=12, sampler=DistributedSampler(dataset, 1, 0, shuffle=True))
    else:

        def sampler(generator: torch.Generator | None) -> Sampler:
            if sampling == "subset":
                return SubsetRandomSampler(range(40), generator=generator)
            return WeightedRandomSampler([1.0 + i % 3 for i in range(44)], 40, generator=generator)

        shuffled = DataLoader(dataset, batch_size=12, sampler=sampler(None))
        ordered = DataLoader(dataset, batch_size=12, sampler=sampler(torch.Generator().manual_seed(0)))
    plain, het = Net(), Net()
    trainer(None, max_epochs=2).fit(plain, ordered)
    trainer(hetero(cpu_fraction=0.5), max_epochs=2, callbacks=[RecordCopies(tmp_path)]).fit(het, shuffled)
    assert_copies_identical(tmp_path)
    assert max_param_diff(plain, het) < TOL


def test_a_sampler_kept_by_use_distributed_sampler_false_is_still_made_the_same_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`use_distributed_sampler=False` keeps each DDP rank's own sampler; one drawing from the global
    generator cannot be kept here, which a warning says, and every rank still sees the same batches."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    dataset = regression_data().dataset
    with pytest.warns(UserWarning, match=r"use_distributed_sampler=False.*RandomSampler draws from the global random"):
        same_batches_on_every_rank(DataLoader(dataset, batch_size=12, shuffle=True), RunningStage.TRAINING, 0, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        seeded = torch.Generator().manual_seed(3)
        same_batches_on_every_rank(DataLoader(dataset, batch_size=12, shuffle=True, generator=seeded), RunningStage.TRAINING, 0, True)
        same_batches_on_every_rank(DataLoader(dataset, batch_size=12, shuffle=True), RunningStage.TRAINING, 0, False)
    ordered = DataLoader(dataset, batch_size=12, sampler=DistributedSampler(dataset, 1, 0, shuffle=True))
    plain, het = Net(), Net()
    trainer(None, max_epochs=2).fit(plain, ordered)
    run = trainer(hetero(cpu_fraction=0.5), max_epochs=2, callbacks=[RecordCopies(tmp_path)], use_distributed_sampler=False)
    run.fit(het, DataLoader(dataset, batch_size=12, shuffle=True))
    assert_copies_identical(tmp_path)
    assert max_param_diff(plain, het) < TOL


def test_a_sampler_without_a_generator_gets_one_of_the_seed_and_the_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Also inside the wrapper Lightning puts around it with several nodes; a loader made again at a
    later epoch (`reload_dataloaders_every_n_epochs`, a resumed fit) draws that epoch's order."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    dataset = regression_data().dataset

    def order(loader: DataLoader, epoch: int) -> list[int]:
        processed = same_batches_on_every_rank(loader, RunningStage.TRAINING, epoch)
        return list(processed.sampler)

    def subset() -> DataLoader:
        return DataLoader(dataset, batch_size=12, sampler=SubsetRandomSampler(range(40)))

    assert order(subset(), 0) == order(subset(), 0) != order(subset(), 1)
    wrapped = DataLoader(dataset, batch_size=12, sampler=DistributedSamplerWrapper(SubsetRandomSampler(range(40)), 2, 0))
    processed = same_batches_on_every_rank(wrapped, RunningStage.TRAINING, 0)
    assert processed.sampler.dataset._sampler.generator is not None


def test_layers_built_in_configure_model() -> None:
    plain, het = LazyNet(), LazyNet()
    trainer(None, max_steps=8).fit(plain, regression_data())
    trainer(hetero(stages=["cpu"] * 3, cpu_fraction=0.5), max_steps=8).fit(het, regression_data())
    assert max_param_diff(plain, het) < TOL


class DoublesItsBatches(Net):
    """Grows each training batch in `on_after_batch_transfer` (mixup-style), and logs with the
    loader's batch size, as configured."""

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        return (torch.cat([x, 0.5 * x]), torch.cat([y, y])) if self.trainer.training else batch

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = self.pipeline_loss(self(x), y)
        self.log("loss_sized", loss, batch_size=12, on_step=True, on_epoch=True)
        return loss


def test_a_fixed_batch_size_is_the_loaders_where_a_hook_grows_the_batch(tmp_path: Path) -> None:
    rows = {}
    for name, strategy in (("plain", None), ("hetero", hetero(cpu_fraction=0.4))):
        trainer(strategy, tmp_path / name, max_epochs=1).fit(DoublesItsBatches(), regression_data())
        rows[name] = read_metrics(tmp_path / name)
    for key in ("loss_sized_step", "loss_sized_epoch"):
        plain, het = column(rows["plain"], key), column(rows["hetero"], key)
        assert plain and max(abs(a - b) for (_, a), (_, b) in zip(plain, het)) < TOL, key


class RecordShownWarnings(L.Callback):
    """Rank 0 writes the warnings shown while it trained (the filters in force, not "always")."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._catching = warnings.catch_warnings(record=True)
        self._caught = self._catching.__enter__()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._catching.__exit__(None, None, None)
        if trainer.global_rank == 0:
            self.out.write_text("\n".join(str(w.message) for w in self._caught))


def test_a_rank_without_a_share_does_not_warn_of_a_metric_it_did_not_update(tmp_path: Path) -> None:
    """torchmetrics warns, on rank 0, of a metric computed before any update: the CPU worker at
    `cpu_fraction=0` (where "auto" may settle) updated none of its own, and computes over every rank's."""
    t = trainer(hetero(cpu_fraction=0.0), max_epochs=1, callbacks=[RecordShownWarnings(tmp_path / "shown.txt")])
    t.fit(Classifier(), classification_data(), classification_data(seed=3))
    assert "before the ``update`` method" not in (tmp_path / "shown.txt").read_text()


class MacroF1(Classifier):
    """Logs a metric that is not an average over samples (macro F1) at every step; with
    ``dist_sync_on_step``, one made to sync at every step, as under DDP."""

    def __init__(self, dist_sync_on_step: bool = False) -> None:
        super().__init__()
        self.train_f1 = MulticlassF1Score(num_classes=4, average="macro", dist_sync_on_step=dist_sync_on_step)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        self.train_f1(out, y)
        self.log("train_f1", self.train_f1, on_step=True, on_epoch=True)
        return self.pipeline_loss(out, y)


@pytest.mark.parametrize("parallelism", ["pipeline", "replicas"])
def test_a_metric_logged_at_every_step_is_the_whole_batchs(tmp_path: Path, parallelism: str) -> None:
    """A metric's step value is its `forward` on the batch: here computed from the union of the
    shares' batch states (a macro F1 of the whole batch is not the shares' F1s averaged)."""
    logged = {}
    for name, strategy in (("plain", None), ("hetero", hetero(cpu_fraction=0.5, parallelism=parallelism))):
        trainer(strategy, tmp_path / name, max_epochs=2).fit(MacroF1(), classification_data())
        rows = read_metrics(tmp_path / name)
        logged[name] = (column(rows, "train_f1_step"), column(rows, "train_f1_epoch"))
    for (_, plain), (_, het) in zip(logged["plain"][0], logged["hetero"][0], strict=True):
        assert abs(plain - het) < 1e-12
    assert [v for _, v in logged["plain"][1]] == pytest.approx([v for _, v in logged["hetero"][1]], abs=1e-12)


def test_a_metric_logged_at_every_step_under_lightnings_profiler(tmp_path: Path) -> None:
    """The profiler puts hooks on every module, metrics too, holding what cannot be copied: the
    metric's copy that computes the batch's value is made without them."""
    from lightning.pytorch.profilers import PyTorchProfiler

    profiler = PyTorchProfiler(dirpath=str(tmp_path / "profile"), filename="fit", schedule=torch.profiler.schedule(
        wait=1, warmup=1, active=2, repeat=1))  # fmt: skip
    t = trainer(hetero(cpu_fraction=0.5), tmp_path, max_steps=5, profiler=profiler)
    t.fit(MacroF1(), classification_data())
    assert len(column(read_metrics(tmp_path), "train_f1_step")) == 5



_HOST_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__"}


class _HostReads(torch.overrides.TorchFunctionMode):
    """Notes each call, until the step's results are exchanged (``exchanged``), that reads a
    tensor's value on the host (on a GPU: a wait for the work queued before it), by the package's
    function that made it."""

    exchanged = False

    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in _HOST_READS and not _HostReads.exchanged:
            import traceback

            callers = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            if callers and "/lightning_hetero/" in callers[-1].filename:
                self.calls.append(f"{Path(callers[-1].filename).name}:{callers[-1].name}:{func.__name__}")
        return func(*args, **(kwargs or {}))


class CountHostReads(L.Callback):
    """Each rank writes, per training step from the third on, the host reads the package made in
    it before the step's results were exchanged."""

    def __init__(self, out: Path) -> None:
        self.out, self.steps, self._mode = out, [], None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step >= 2:
            self.steps.append([])
            _HostReads.exchanged = False
            self._mode = _HostReads(self.steps[-1])
            self._mode.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (self.out / f"reads{trainer.global_rank}.json").write_text(json.dumps(self.steps))


@pytest.mark.parametrize("cpu_fraction", [0.0, 0.5])
@pytest.mark.parametrize("parallelism", ["pipeline", "replicas"])
def test_a_training_step_reads_its_results_on_the_host_once(
    tmp_path: Path, parallelism: str, cpu_fraction: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loss, every logged value (a metric's batch state too) and whether the gradients are
    finite are read on the host together, once, where the step's results are exchanged: on a GPU
    each read waits for the work queued before it, and one at `self.log` in the forward would hold
    the backward back. (The ranks are forked: they inherit the patch marking the exchange.)"""
    from lightning_hetero.results import ReportExchange

    exchange = ReportExchange.__call__

    def marked(self: Any, report: Any, *args: Any, **kwargs: Any) -> Any:
        getattr(report, "to_host", lambda: None)()  # still before the mark: its reads are the step's
        _HostReads.exchanged = True
        return exchange(self, report, *args, **kwargs)

    monkeypatch.setattr(ReportExchange, "__call__", marked)
    strategy = hetero(cpu_fraction=cpu_fraction, parallelism=parallelism, stages=["cpu"], start_method="fork")
    trainer(strategy, tmp_path, max_steps=5, callbacks=[CountHostReads(tmp_path)]).fit(MacroF1(), classification_data())
    computed = {"reads1.json"} | ({"reads0.json"} if cpu_fraction else set())  # the ranks with a share
    for path in sorted(tmp_path.glob("reads*.json")):
        steps = json.loads(path.read_text())
        assert len(steps) == 3
        once = ["results.py:_read:cpu", "results.py:_read:tolist"]
        assert all(calls == (once if path.name in computed else []) for calls in steps), (path.name, steps)


class _BatchIdentity(Net):
    """Writes, per rank, whether each step method got the very batch the hooks around it see."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out, self.same, self._batch = out, [], None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._batch = batch
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._batch is not None:
            self.same.append(batch is self._batch)

    def on_train_end(self) -> None:
        (self.out / f"same{self.global_rank}.json").write_text(json.dumps(self.same))


@pytest.mark.parametrize("cpu_workers", [0, 1])
def test_a_worker_whose_share_is_the_whole_batch_steps_on_the_batch_itself(tmp_path: Path, cpu_workers: int) -> None:
    """As in one process, `training_step` gets the batch that `on_train_batch_end` sees (a share of
    all of it is not rebuilt: its containers would be new ones, and cost a walk of the batch a step)."""
    strategy = hetero(stages=["cpu"], cpu_workers=cpu_workers, cpu_fraction=0.0)
    trainer(strategy, max_steps=3).fit(_BatchIdentity(tmp_path), regression_data())
    stage = json.loads((tmp_path / f"same{cpu_workers}.json").read_text())
    assert stage == [True, True, True]


class ReturnsExtras(Net):
    """`training_step` returns a dict with a key besides the loss, which `on_train_batch_end` reads."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out, self.seen = out, []

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {"loss": super().training_step(batch, batch_idx), "rows": torch.tensor(len(batch[0]))}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(int(outputs["rows"]) if "rows" in outputs else None)

    def on_train_end(self) -> None:
        (self.out / f"rows{self.global_rank}.json").write_text(json.dumps(self.seen))


@pytest.mark.parametrize(
    "layout,last_stage",
    [
        ({"parallelism": "replicas", "cpu_fraction": 0.4}, None),
        ({"parallelism": "replicas", "cpu_fraction": 0.0, "stages": ["cpu"] * 3, "cpu_workers": 2}, None),
        ({"cpu_fraction": 0.5}, 2),
    ],
    ids=["replicas", "replicas-and-idle-cpu-workers", "pipeline"],
)
def test_a_rank_without_a_share_of_a_batch_gets_the_keys_its_step_returned(
    tmp_path: Path, layout: dict, last_stage: int | None
) -> None:
    """A last batch of one sample leaves some ranks no share: `outputs` there holds another worker's
    keys, as every rank that computed has its own; a stage before the last gets the loss alone."""
    strategy = hetero(**layout)
    trainer(strategy, max_epochs=1).fit(ReturnsExtras(tmp_path), regression_data(n=37))  # 12, 12, 12, 1
    ranks = sorted(tmp_path.glob("rows*.json"))
    assert len(ranks) == strategy.num_processes
    for path in ranks:
        seen = json.loads(path.read_text())
        if last_stage is not None and path.name not in ("rows0.json", f"rows{last_stage}.json"):
            assert seen == [None] * 4  # a stage before the last
        else:
            assert len(seen) == 4 and all(rows is not None and rows > 0 for rows in seen), (path.name, seen)
            assert seen[-1] == 1


@pytest.mark.parametrize("layout", [dict(), dict(parallelism="replicas", stages=["cpu"])], ids=["pipeline", "replicas"])
def test_the_throughput_monitor_counts_the_runs_batches_once(tmp_path: Path, layout: dict) -> None:
    """Every rank goes through the whole batches, so the run's rate is each rank's, as one process's
    is: no rate multiplied by the processes, and the same keys as a plain run logs."""
    from lightning.pytorch.callbacks import ThroughputMonitor

    keys, samples = {}, {}
    for name, strategy in (("plain", None), ("hetero", hetero(cpu_fraction=0.5, **layout))):
        monitor = ThroughputMonitor(batch_size_fn=lambda batch: len(batch[0]), window_size=2)
        trainer(strategy, tmp_path / name, max_steps=6, callbacks=[monitor]).fit(Net(), regression_data())
        rows = read_metrics(tmp_path / name)
        keys[name] = {k for row in rows for k in row if k.startswith("train")}
        samples[name] = column(rows, "train/samples")
    assert keys["hetero"] == keys["plain"] and "train/device/samples_per_sec" in keys["plain"]
    assert samples["hetero"] == samples["plain"]


class ClockAhead(L.Callback):
    """The training loop's clock on global rank 0 runs an hour ahead: it would validate after every
    batch, the other ranks when their own time is up (not in this run)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.validated: list[int] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        import time

        from lightning.pytorch.loops import training_epoch_loop

        if trainer.global_rank == 0:
            training_epoch_loop.time = type("Ahead", (), {"monotonic": staticmethod(lambda: time.monotonic() + 3600)})

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.validated.append(trainer.global_step)
        (self.out / f"validated{trainer.global_rank}.json").write_text(json.dumps(self.validated))


@pytest.mark.parametrize("layout", [dict(), dict(parallelism="replicas", stages=["cpu"])], ids=["pipeline", "replicas"])
def test_validation_by_time_follows_rank_zeros_clock(tmp_path: Path, layout: dict) -> None:
    """`val_check_interval` as a time is decided on each rank's clock in Lightning's loop; here the
    ranks' clocks disagree, and every rank validates where global rank 0 does."""
    strategy = hetero(cpu_fraction=0.5, timeout=30, **layout)
    trainer(strategy, max_steps=6, val_check_interval={"hours": 1}, callbacks=[ClockAhead(tmp_path)]).fit(
        Net(), regression_data(), regression_data(n=12)
    )
    validated = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("validated*.json"))]
    assert len(validated) == len(layout.get("stages", "xx")) + 1 and validated[0] == [1, 2, 3, 4, 5, 6]
    assert all(v == validated[0] for v in validated), validated
