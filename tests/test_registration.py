"""`Trainer(strategy="hetero")` works with no other change, and uses the HeteroAccelerator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import DeviceStatsMonitor

from lightning_hetero import HeteroAccelerator, HeteroStrategy
from lightning_hetero.sync import FineSync
from lightning_hetero.topology import usable_cores
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


def test_device_stats_monitor(tmp_path: Path) -> None:
    model = Net()
    t = trainer(HeteroStrategy(start_method="fork", timeout=60), tmp_path, max_steps=3, callbacks=[DeviceStatsMonitor()])
    t.fit(model, regression_data())
    rows = read_metrics(tmp_path)
    assert len(column(rows, "train_loss")) == 3
    assert any(key.startswith("DeviceStatsMonitor") and "cpu_percent" in key for row in rows for key in row)


class RecordLayout(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        record = {"role": str(strategy.role), "threads": torch.get_num_threads(), "device": str(strategy.root_device)}
        record["params"] = sorted(n for n, p in pl_module.named_parameters() if not p.is_meta)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def test_roles_devices_threads_and_layer_placement(tmp_path: Path) -> None:
    strategy = HeteroStrategy(stages=["cpu"] * 3, cpu_workers=2, cpu_threads=3, start_method="fork", timeout=60)
    trainer(strategy, max_steps=1, callbacks=[RecordLayout(tmp_path)]).fit(Net(), regression_data())
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(5)]
    assert [r["role"] for r in ranks] == ["cpu0", "cpu1", "stage0", "stage1", "stage2"]
    assert [r["threads"] for r in ranks] == [3, 3, 1, 1, 1]
    assert all(r["device"] == "cpu" for r in ranks)
    everything = sorted(n for n, _ in Net().named_parameters())
    assert ranks[0]["params"] == ranks[1]["params"] == everything  # CPU workers hold full replicas
    stage_params = [r["params"] for r in ranks[2:]]
    assert sorted(sum(stage_params, [])) == everything and all(stage_params)  # stages split the layers


class RecordThreads(L.Callback):
    """Each rank's torch threads at the first step, and after the CPU workers' share is taken away."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.threads: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.threads.append(torch.get_num_threads())
        sync = trainer.strategy.engine.sync
        if isinstance(sync, FineSync):  # fine mode's step thread follows too
            assert sync._overlap._stepper.submit(torch.get_num_threads).result() == self.threads[-1]
        if batch_idx == 0:
            trainer.strategy.set_cpu_fraction(0.0)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.threads))


@pytest.mark.parametrize("mode", ["coarse", "fine"])
def test_an_emulated_stage_takes_the_cores_of_an_idle_cpu_worker(tmp_path: Path, mode: str) -> None:
    strategy = HeteroStrategy(stages=["cpu"], cpu_workers=1, cpu_fraction=0.5, mode=mode, start_method="fork", timeout=60)
    trainer(strategy, max_steps=2, callbacks=[RecordThreads(tmp_path)]).fit(Net(), regression_data())
    threads = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    cores = usable_cores()
    assert threads == [[max(1, cores // 2)] * 2, [max(1, cores // 2), cores]]
