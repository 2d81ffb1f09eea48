"""Checkpoints are ordinary Lightning checkpoints: written by hetero, read by a plain Trainer, and back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

from tests.conftest import hetero, max_param_diff, trainer
from tests.models import Net, column, read_metrics, regression_data

TOL = 1e-10


def fit(
    strategy: Any, steps: int, ckpt_dir: Path | None = None, ckpt_path: Path | None = None, log_dir: Path | None = None
) -> Net:
    callbacks: list = [LearningRateMonitor("step")] if log_dir else []
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=1, save_top_k=-1))
    # Created in float64: Lightning loads a checkpoint into the model before the precision plugin
    # converts it, so a float32 model would round the checkpoint's float64 weights on resume.
    model = Net(optimizer="adamw").double()
    t = trainer(strategy, log_dir, max_steps=steps, callbacks=callbacks, enable_checkpointing=ckpt_dir is not None)
    t.fit(model, regression_data(), ckpt_path=ckpt_path)
    return model


@pytest.fixture(scope="module")
def reference() -> Net:
    return fit(None, steps=8)


@pytest.mark.parametrize("writer", ["hetero", "plain", "hetero-no-cpu-worker"])
@pytest.mark.parametrize("at_step", [3, 4])  # mid-epoch, and the end of the first epoch
def test_resume_matches_uninterrupted(tmp_path: Path, reference: Net, writer: str, at_step: int) -> None:
    strategies = {"hetero": hetero(cpu_fraction=0.5), "plain": None, "hetero-no-cpu-worker": hetero(cpu_workers=0)}
    fit(strategies[writer], steps=at_step, ckpt_dir=tmp_path)
    ckpt = tmp_path / f"step={at_step}.ckpt"
    resumed_plain = fit(None, steps=8, ckpt_path=ckpt, log_dir=tmp_path / "plain")
    strategy = hetero(stages=["cpu"] * 3, schedule="1F1B", micro_batches=3, cpu_fraction=0.3)
    resumed_hetero = fit(strategy, 8, ckpt_path=ckpt, log_dir=tmp_path / "hetero")
    assert max_param_diff(resumed_plain, resumed_hetero) < TOL
    for key in ("train_loss", "lr-AdamW"):
        plain, het = column(read_metrics(tmp_path / "plain"), key), column(read_metrics(tmp_path / "hetero"), key)
        assert plain and [s for s, _ in plain] == [s for s, _ in het], key
        assert max(abs(a - b) for (_, a), (_, b) in zip(plain, het)) < TOL, key
    if at_step == 4:
        assert max_param_diff(reference, resumed_hetero) < TOL


@pytest.mark.parametrize("cpu_workers", [1, 0])
def test_hetero_checkpoint_is_an_ordinary_checkpoint(tmp_path: Path, cpu_workers: int) -> None:
    fit(None, steps=4, ckpt_dir=tmp_path / "plain")
    fit(hetero(cpu_workers=cpu_workers, cpu_fraction=0.5 if cpu_workers else 0.0), steps=4, ckpt_dir=tmp_path / "het")
    plain = torch.load(tmp_path / "plain" / "step=4.ckpt", weights_only=False)
    het = torch.load(tmp_path / "het" / "step=4.ckpt", weights_only=False)
    assert set(het) == set(plain)
    assert list(het["state_dict"]) == list(plain["state_dict"])
    assert max_param_diff(plain["state_dict"], het["state_dict"]) < TOL
    (plain_opt,), (het_opt,) = plain["optimizer_states"], het["optimizer_states"]
    assert het_opt["param_groups"] == plain_opt["param_groups"]
    assert plain_opt["state"].keys() == het_opt["state"].keys()
    for index, state in plain_opt["state"].items():
        for key, value in state.items():
            assert torch.allclose(value, het_opt["state"][index][key], atol=TOL, rtol=0), (index, key)
    assert het["lr_schedulers"] == plain["lr_schedulers"]
    assert het["global_step"] == plain["global_step"] == 4


def test_load_from_checkpoint(tmp_path: Path) -> None:
    trained = fit(hetero(cpu_fraction=0.5), steps=4, ckpt_dir=tmp_path)
    loaded = Net.load_from_checkpoint(tmp_path / "step=4.ckpt")
    # `Net()` builds float32 parameters, into which the float64 checkpoint loads rounded.
    assert max_param_diff(trained.float(), loaded) == 0


class ElsewhereIO(TorchCheckpointIO):
    """A checkpoint IO of one's own: every file under another name."""

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, f"{path}.elsewhere", storage_options)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict:
        return super().load_checkpoint(f"{path}.elsewhere", map_location, weights_only=False)

    def remove_checkpoint(self, path: Any) -> None:
        super().remove_checkpoint(f"{path}.elsewhere")


def test_a_checkpoint_io_of_ones_own_writes_and_hands_back_the_weights(tmp_path: Path, reference: Net) -> None:
    """The weights the forked ranks hand back go through the run's checkpoint IO, as its checkpoints
    do, and resuming reads one through it."""
    model = Net(optimizer="adamw").double()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=4)
    t = trainer(hetero(cpu_fraction=0.5), max_steps=4, callbacks=[checkpoint], enable_checkpointing=True, plugins=[ElsewhereIO()])
    t.fit(model, regression_data())
    assert [p.name for p in tmp_path.iterdir()] == ["step=4.ckpt.elsewhere"]
    resumed = Net(optimizer="adamw").double()
    t = trainer(hetero(cpu_fraction=0.5), max_steps=8, plugins=[ElsewhereIO()])
    t.fit(resumed, regression_data(), ckpt_path=tmp_path / "step=4.ckpt")
    assert max_param_diff(reference, resumed) < TOL
