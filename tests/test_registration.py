"""`Trainer(strategy="hetero")` works with no other change, and uses the HeteroAccelerator."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import DeviceStatsMonitor

from lightning_hetero import HeteroAccelerator, HeteroStrategy
from tests.conftest import trainer
from tests.models import Net, column, read_metrics, regression_data


def test_string_strategy_gets_the_hetero_accelerator() -> None:
    t = L.Trainer(strategy="hetero", logger=False)
    assert isinstance(t.strategy, HeteroStrategy) and isinstance(t.accelerator, HeteroAccelerator)
    assert t.world_size == 3 and t.strategy.parallel_devices == [torch.device("cpu")] * 3


@pytest.mark.parametrize("accelerator", ["hetero", "cpu", "auto"])
def test_accelerator_flag(accelerator: str) -> None:
    t = L.Trainer(strategy="hetero", accelerator=accelerator, logger=False)
    assert isinstance(t.accelerator, HeteroAccelerator)


def test_hetero_accelerator_needs_the_hetero_strategy() -> None:
    t = L.Trainer(accelerator="hetero", devices=1, logger=False, max_steps=1, enable_progress_bar=False)
    with pytest.raises(ValueError, match="only works with the hetero strategy"):
        t.fit(Net(), regression_data())


def test_plain_string_strategy_trains(tmp_path: Path) -> None:
    model = Net()
    t = trainer("hetero", tmp_path, max_steps=3, callbacks=[DeviceStatsMonitor()])
    t.fit(model, regression_data())
    rows = read_metrics(tmp_path)
    assert len(column(rows, "train_loss")) == 3
    assert any(key.startswith("DeviceStatsMonitor") and "cpu_percent" in key for row in rows for key in row)
