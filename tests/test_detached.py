"""A CPU worker with no share of a batch keeps out of that step (never slower than leaving the CPU
idle), and is brought up to date from the stages before it is used again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.conftest import RecordCopies, assert_copies_identical, hetero, max_param_diff, trainer
from tests.models import Net, regression_data

TOL = 1e-10


class SwitchFraction(L.Callback):
    """From the given steps on, a new CPU fraction (the same on every rank, as a rebalancer's is)."""

    def __init__(self, fractions: dict[int, float]) -> None:
        self.fractions = fractions

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step in self.fractions:
            trainer.strategy.set_cpu_fraction(self.fractions[trainer.global_step])


class RecordSums(L.Callback):
    """Rank 0 (the CPU worker) writes how long each step spent summing gradients."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == 0:
            self.out.write_text(" ".join(f"{r.communicate:.6f}" for r in trainer.strategy.step_records))


@pytest.mark.parametrize("mode,offload", [("coarse", "auto"), ("fine", "none"), ("fine", [0, 2])])
def test_idle_cpu_worker_keeps_out_and_catches_up(tmp_path: Path, mode: str, offload: Any) -> None:
    plain = Net(optimizer="adamw")
    trainer(None, max_steps=12).fit(plain, regression_data())
    model = Net(optimizer="adamw")
    switch = SwitchFraction({0: 0.0, 4: 0.5, 8: 0.0})  # idle, then working, then idle again
    strategy = hetero(mode=mode, offload=offload, bucket_size_mb=1e-5, stages=["cpu"] * 2, cpu_fraction=0.0)
    trainer(strategy, max_steps=12, callbacks=[switch, RecordCopies(tmp_path), RecordSums(tmp_path / "sums")]).fit(
        model, regression_data()
    )
    assert_copies_identical(tmp_path)  # the copies that take part in a step are identical
    assert max_param_diff(plain, model) < TOL  # rank 0 was brought up to date for the end of training
    sums = [float(t) for t in (tmp_path / "sums").read_text().split()]
    assert sums[4:8] and all(t > 0 for t in sums[4:8])  # it summed while it had a share
    if mode == "coarse":
        assert sums[:4] == [0.0] * 4 and sums[8:] == [0.0] * 4  # and took no part while idle


class SpectralNet(Net):
    """`Net` with spectral norm on a layer: each training forward takes a power-iteration step in the
    layer's buffers, the same on every worker that runs one, whatever its share."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        torch.nn.utils.parametrizations.spectral_norm(self.layers[2])


@pytest.mark.parametrize("mode", ["coarse", "fine"])
def test_an_idle_cpu_worker_catches_up_with_the_buffers_too(tmp_path: Path, mode: str) -> None:
    """The stages' buffers travel with their parameters: a CPU worker that kept out of steps (as
    `cpu_fraction="auto"` has it do at first) computes with, and returns, the buffers one process has."""
    plain = SpectralNet()
    trainer(None, max_steps=12).fit(plain, regression_data())
    model = SpectralNet()
    switch = SwitchFraction({0: 0.0, 4: 0.5, 8: 0.0})
    strategy = hetero(mode=mode, parallelism="replicas", stages=["cpu"], cpu_fraction=0.0)
    trainer(strategy, max_steps=12, callbacks=[switch]).fit(model, regression_data())
    assert max_param_diff(plain, model) < TOL  # the buffers are in the state dict


def test_checkpoint_written_while_idle_is_whole(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    trainer(hetero(cpu_fraction=0.0), max_steps=4, callbacks=[checkpoint], enable_checkpointing=True).fit(
        Net(), regression_data()
    )
    plain_checkpoint = ModelCheckpoint(dirpath=tmp_path / "plain", filename="{step}", every_n_train_steps=4)
    trainer(None, max_steps=4, callbacks=[plain_checkpoint], enable_checkpointing=True).fit(Net(), regression_data())
    het = torch.load(tmp_path / "step=4.ckpt", weights_only=False)
    ref = torch.load(tmp_path / "plain" / "step=4.ckpt", weights_only=False)
    assert max_param_diff(ref["state_dict"], het["state_dict"]) < TOL
    for index, state in ref["optimizer_states"][0]["state"].items():
        for key, value in state.items():
            assert torch.allclose(value, het["optimizer_states"][0]["state"][index][key], atol=TOL, rtol=0)
