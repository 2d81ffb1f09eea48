"""The heart of the suite: hetero training gives the model one process gives (float64, dropout off).

Every case trains the same model on the same batches twice, once with a plain single-process
Trainer and once with the hetero strategy, then compares the parameters, the loss logged at every
step and the learning rate at every step. 44 samples in batches of 12 make the last batch of each
epoch smaller (8), so uneven batches are always covered.
"""

from __future__ import annotations

import json

from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.callbacks import LearningRateMonitor

from tests.conftest import RecordCopies, assert_copies_identical, hetero, max_param_diff, trainer
from tests.models import Net, column, read_metrics, regression_data

TOL = 1e-10
STEPS = 8


def fit(
    strategy: Any, log_dir: Path, model_kwargs: dict | None = None, callbacks: list | None = None, **trainer_kwargs: Any
) -> tuple[Net, list]:
    model = Net(**(model_kwargs or {}))
    callbacks = [LearningRateMonitor("step"), *(callbacks or [])]
    t = trainer(strategy, log_dir, max_steps=STEPS, callbacks=callbacks, **trainer_kwargs)
    t.fit(model, regression_data())
    return model, read_metrics(log_dir)


def assert_same_run(
    tmp_path: Path, strategy: Any, model_kwargs: dict | None = None, callbacks: list | None = None, **trainer_kwargs: Any
) -> None:
    """Plain and hetero give the same parameters, losses and learning rates, and every hetero rank's
    copy of a parameter is identical to every other's after every step."""
    ref, ref_rows = fit(None, tmp_path / "plain", model_kwargs, callbacks, **trainer_kwargs)
    copies = tmp_path / "copies"
    copies.mkdir()
    het, het_rows = fit(strategy, tmp_path / "hetero", model_kwargs, [*(callbacks or []), RecordCopies(copies)], **trainer_kwargs)
    assert_copies_identical(copies)
    assert max_param_diff(ref, het) < TOL
    for key in ("train_loss", next(k for k in ref_rows[0] if k.startswith("lr-"))):
        ref_values, het_values = column(ref_rows, key), column(het_rows, key)
        assert ref_values and [s for s, _ in ref_values] == [s for s, _ in het_values], key
        assert max(abs(a - b) for (_, a), (_, b) in zip(ref_values, het_values)) < TOL, key


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("cpu_fraction", [0.0, 0.5, 1.0])
def test_matches_single_process(tmp_path: Path, schedule: str, num_stages: int, cpu_fraction: float) -> None:
    micro_batches = max(2, num_stages)
    strategy = hetero(stages=["cpu"] * num_stages, schedule=schedule, cpu_fraction=cpu_fraction, micro_batches=micro_batches)
    assert_same_run(tmp_path, strategy)


@pytest.mark.parametrize(
    "trainer_kwargs",
    [
        {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"},
        {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
        {"accumulate_grad_batches": 2},
    ],
    ids=["clip-norm", "clip-value", "accumulate-2"],
)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_trainer_features_match(tmp_path: Path, trainer_kwargs: dict, optimizer: str) -> None:
    strategy = hetero(stages=["cpu"] * 3, schedule="1F1B", cpu_fraction=0.4, micro_batches=3)
    assert_same_run(tmp_path, strategy, {"optimizer": optimizer}, **trainer_kwargs)


def test_everything_at_once(tmp_path: Path) -> None:
    strategy = hetero(stages=["cpu", "cpu"], schedule="GPipe", cpu_fraction=0.3, micro_batches=3)
    kwargs = {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}
    assert_same_run(tmp_path, strategy, {"optimizer": "sgd"}, **kwargs)


@pytest.mark.parametrize("mode", ["coarse", "fine"])
def test_more_micro_batches_than_the_pipelines_share_has_samples(tmp_path: Path, mode: str) -> None:
    """The pipeline's shares of 9 and 6 samples (batches of 12, the last of 8) are cut into micro-batches
    of one sample, fewer than the 16 asked for, not left to the CPU worker (`test_shares.py`)."""
    strategy = hetero(stages=["cpu", "cpu"], cpu_fraction=0.25, micro_batches=16, mode=mode)
    assert_same_run(tmp_path, strategy, {"optimizer": "adamw"}, callbacks=[PipelineShares(tmp_path)])
    assert json.loads((tmp_path / "shares.json").read_text()) == [[6, 6], [9, 9]]


class PipelineShares(L.Callback):
    """Global rank 0 writes the pipeline's share and micro-batch count of every training batch."""

    def __init__(self, out: Path) -> None:
        self.out, self.seen = out, set()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.strategy.global_rank == 0 and hasattr(trainer.strategy, "shares"):
            shares = trainer.strategy.shares(len(batch[0]))
            self.seen.add((shares.pipeline_size, shares.micro_batches))
            (self.out / "shares.json").write_text(json.dumps(sorted(self.seen)))


def test_stages_without_parameters_with_clipping(tmp_path: Path) -> None:
    # Six stages of one block each: the Tanh and Identity stages hold no parameters at all.
    strategy = hetero(stages=["cpu"] * 6, schedule="GPipe", cpu_fraction=0.25)
    assert_same_run(tmp_path, strategy, {"optimizer": "sgd"}, gradient_clip_val=0.05)


class Unfreeze(L.Callback):
    """Freezes the first block at the start, unfreezes it after a few steps (as BackboneFinetuning does)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.layers[0].requires_grad_(False)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == 3:
            pl_module.layers[0].requires_grad_(True)


@pytest.mark.parametrize(
    "layout",
    [dict(stages=["cpu"] * 2), dict(stages=["cpu"] * 6), dict(stages=["cpu"], mode="fine", offload="all")],
    ids=["2-stages", "6-stages", "fine-offloaded"],  # with 6, the first stage is the frozen block alone
)
def test_frozen_then_unfrozen_layers(tmp_path: Path, layout: dict) -> None:
    """SGD with momentum: the unfrozen block's momentum starts when it first trains. Offloaded, one bucket
    (one stage's) holds it beside blocks with momentum already, which torch's fused CPU SGD cannot step
    together."""
    strategy = hetero(cpu_fraction=0.25, **layout)
    assert_same_run(tmp_path, strategy, {"optimizer": "sgd"}, [Unfreeze()], gradient_clip_val=0.05)


@pytest.mark.parametrize("cpu_workers,cpu_fraction", [(0, 0.0), (2, 0.5), (2, 1.0)])
def test_cpu_worker_counts(tmp_path: Path, cpu_workers: int, cpu_fraction: float) -> None:
    strategy = hetero(stages=["cpu", "cpu"], cpu_workers=cpu_workers, cpu_fraction=cpu_fraction)
    assert_same_run(tmp_path, strategy, {"optimizer": "sgd"}, gradient_clip_val=0.05)


def test_float32_matches_closely(tmp_path: Path) -> None:
    ref, _ = fit(None, tmp_path / "plain", precision="32-true")
    het, _ = fit(hetero(cpu_fraction=0.5), tmp_path / "hetero", precision="32-true")
    assert max_param_diff(ref, het) < 1e-5
