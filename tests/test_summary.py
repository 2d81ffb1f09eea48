"""The end-of-fit summary: what each device did and what the CPU bought, from the step records.

The comparison is checked on emulated speeds, where the right answer is known by construction;
the summary's keys are read back from an offline wandb run with wandb's own reader."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
from lightning.pytorch.loggers import WandbLogger
from PIL import Image

from lightning_hetero.callbacks import AdaptiveRebalancer, UtilizationMonitor
from lightning_hetero.callbacks.summary import GAP, LABEL, TOP, DeviceTotals, RunSummary, Throughput, cpu_gain, settled_rates
from lightning_hetero.callbacks.summary import summary_image, write_png
from lightning_hetero.record import StepRecord
from tests.conftest import hetero, trainer
from tests.models import Net, read_metrics, regression_data
from tests.test_monitor import _inspect


def record(rank: int, total: float, spans: list, samples: int = 4, fraction: float = 0.5, **kw: float) -> StepRecord:
    return StepRecord(step=0, rank=rank, role="x", samples=samples, total=total, cpu_fraction=fraction, spans=spans, **kw)


def test_totals_add_up_the_run() -> None:
    totals = DeviceTotals()
    totals.add(record(0, 1.0, [("compute", 0.0, 0.5), ("sync", 0.5, 0.75)], wait=0.25), batch_size=8)
    totals.add(record(0, 1.0, [("compute", 1.0, 1.25)], data=0.5), batch_size=8)
    shares = totals.shares()
    assert shares["busy"] == pytest.approx(0.375) and shares["comm"] == pytest.approx(0.125)
    assert shares["idle"] == pytest.approx(0.5) and shares["wait"] == pytest.approx(0.125)
    assert shares["data"] == pytest.approx(0.25) and shares["other"] == pytest.approx(0.125)
    assert shares["samples_per_s"] == pytest.approx(4.0)
    assert totals.walls == [1.0, 1.0] and totals.sizes == [8, 8] and totals.fractions == [0.5, 0.5]


def test_gain_compares_the_batches_with_and_without_the_cpu() -> None:
    # 1 batch at 0.5 (the run's first: left out), 6 at 0 (the first 2 after the change left out), 6 at 0.5.
    fractions = [0.5] + [0.0] * 6 + [0.5] * 6
    walls = [9.0] + [2.0, 2.0, 1.0, 1.0, 1.0, 1.0] + [2.0, 2.0, 0.5, 0.5, 0.5, 0.5]
    gain = cpu_gain(fractions, walls, [10] * len(walls), settle=2)
    assert gain is not None and gain.fraction == 0.5
    assert gain.without == Throughput(10.0, 10.0, 10.0, 4) and gain.with_cpu == Throughput(20.0, 20.0, 20.0, 4)
    assert gain.gain == pytest.approx(1.0) and gain.spread == pytest.approx((1.0, 1.0))
    assert cpu_gain([0.5] * 5, [1.0] * 5, [10] * 5) is None  # never without the CPU
    assert cpu_gain([0.0] * 5, [1.0] * 5, [10] * 5) is None  # never with it


def test_gain_spread_is_the_middle_half() -> None:
    rates_without, rates_with = [8.0, 9.0, 10.0, 11.0, 12.0], [15.0, 18.0, 20.0, 22.0, 25.0]
    walls = [1.0] + [10 / r for r in rates_without] + [10 / r for r in rates_with]
    gain = cpu_gain([0.0] + [0.0] * 5 + [0.25] * 5, walls, [10] * 11, settle=0)
    assert gain is not None and gain.gain == pytest.approx(1.0)
    low, high = gain.spread
    assert low < gain.gain < high and low == pytest.approx(gain.with_cpu.low / gain.without.high - 1)


def test_table_and_keys() -> None:
    devices = {"cpu0": {"busy": 0.5, "comm": 0.1, "idle": 0.4, "samples_per_s": 100.0, "share": 0.3}}
    gain = cpu_gain([0.0] * 4 + [0.3] * 4, [1.0] * 4 + [0.8] * 4, [100] * 8, settle=1)
    summary = RunSummary(devices, samples_per_s=125.0, fraction=0.3, gain=gain)
    text = summary.table()
    assert "cpu0" in text and "50%" in text and "30%" in text
    assert "The CPU bought +25% throughput: 125 samples/s with 0.30 of each batch on the CPU, 100 samples/s without it" in text
    metrics = summary.metrics()
    assert metrics["hetero/cpu_gain"] == pytest.approx(0.25) and metrics["hetero/samples_per_s_without_cpu"] == 100.0
    assert metrics["hetero/cpu0/share"] == 0.3 and metrics["hetero/cpu_fraction"] == 0.3
    assert "no batches ran without the CPU" in RunSummary(devices, 125.0, 0.3).table()
    # Batches at fraction 0 were counted, but none with a share settled at one fraction (moved each window).
    moved = RunSummary(devices, 125.0, 0.8, settled_without=True).table()
    assert "no batches with the CPU's share ran long enough at one fraction" in moved and "without the CPU's share to" not in moved
    rates = settled_rates([0.0, 0.0, 0.0, 0.5, 0.5, 0.7, 0.7, 1.0], [1.0] * 8, [10] * 8, settle=2)
    assert [fraction for fraction, _ in rates] == [0.0]
    assert "in runs of at least 3 x (compare_steps + 2) optimizer steps" in RunSummary(devices, 125.0, 0.3).table()
    assert "with no CPU worker" in RunSummary(devices, 125.0, 0.0, cpu_workers=0).table()
    assert "had no share of any batch" in RunSummary(devices, 125.0, 0.0, cpu_shared=False).table()
    idle = RunSummary(devices, 100.0, 0.0, gain).table()
    assert "The CPU took no share at the end" in idle


def test_picture_has_the_run_and_one_step(tmp_path: Path) -> None:
    devices = {"cpu0": {"busy": 1.0}, "stage0": {"busy": 0.5, "comm": 0.5}}
    step = [record(0, 1.0, [("compute", 0.0, 1.0)], start=0.0, end=1.0), record(1, 1.0, [("sync", 0.5, 1.0)], start=0.0, end=1.0)]
    image = summary_image(devices, step, width=400)
    assert image.shape[1] == 400 and image.dtype == np.uint8
    bar = (400 - LABEL - GAP) // 2
    right = LABEL + bar + GAP  # the step's timeline starts here
    middle = [TOP + 24 * i + 12 for i in range(2)]  # each device's row
    assert tuple(image[middle[0], LABEL + 10]) == (46, 160, 67)  # cpu0's run: busy
    assert tuple(image[middle[1], LABEL + bar - 5]) == (31, 119, 180)  # stage0's run ends communicating
    assert tuple(image[middle[1], right + 5]) == (220, 220, 220)  # stage0's step: idle, then the sum
    assert tuple(image[middle[1], right + bar - 5]) == (31, 119, 180)
    assert tuple(image[middle[0], right + bar // 2]) == (46, 160, 67)  # cpu0 computed throughout
    path = write_png(image, tmp_path / "devices.png")
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(path.read_bytes())).convert("RGB")), image)


@contextmanager
def printed_by_lightning(path: Path) -> Iterator[Path]:
    """What Lightning prints (its loggers' INFO records) in every process of the run, also in ``path``."""
    handler, logger = logging.FileHandler(path), logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    try:
        yield path
    finally:
        logger.removeHandler(handler)
        handler.close()


PIPELINE_SPEED = 100.0
"""Samples per second of the emulated pipeline: a batch of 12 takes 120 ms without the CPU."""


def test_summary_measures_what_the_cpu_bought(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The CPU is as fast as the pipeline and takes half of every batch, so without it a batch takes
    # 120 ms and with it 60 ms, plus the step's fixed work on both: the ideal gain is +100%.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="hetero-test", save_dir=str(tmp_path), offline=True)
    monitor = UtilizationMonitor(every_n_steps=5, compare_steps=4, save_dir=str(tmp_path))
    speed = {"cpu": PIPELINE_SPEED, "pipeline": PIPELINE_SPEED}
    strategy = hetero(cpu_fraction=0.5, emulated_speed=speed)
    with printed_by_lightning(tmp_path / "printed.txt") as printed_to:
        trainer(strategy, logger=logger, max_steps=24, callbacks=[monitor]).fit(Net(), regression_data(n=48))
    printed = printed_to.read_text()
    # Batches 7-12 ran at fraction 0, the rest at 0.5; the first two of each stretch are left out.
    assert "(median of 14 and 4 batches;" in printed, printed
    assert "The CPU bought +" in printed and "with 0.50 of each batch on the CPU" in printed
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    logged = _inspect(run_dir)["summary"]
    for key in ("hetero/samples_per_s", "hetero/cpu_gain", "hetero/cpu_gain_low", "hetero/cpu_gain_high",
                "hetero/samples_per_s_without_cpu", "hetero/cpu_fraction", "hetero/cpu0/busy", "hetero/stage1/share"):
        assert key in logged, sorted(logged)
    gain, low, high = (logged[f"hetero/cpu_gain{end}"] for end in ("", "_low", "_high"))
    assert 0.6 <= gain <= 1.05, printed  # +100% less the fixed work of a step (10-25 ms of 60-120)
    assert low <= gain <= high
    assert logged["hetero/samples_per_s_without_cpu"] == pytest.approx(PIPELINE_SPEED, rel=0.3)
    assert logged["hetero/cpu_fraction"] == 0.5  # back where it was after the comparison
    # The CPU worker had half of 18 batches of 12: 108 of 288 samples; each stage the rest.
    assert logged["hetero/cpu0/share"] == pytest.approx(108 / 288)
    assert logged["hetero/stage0/share"] == pytest.approx(180 / 288)
    for device in ("cpu0", "stage0", "stage1"):
        assert sum(logged[f"hetero/{device}/{kind}"] for kind in ("busy", "comm", "idle")) == pytest.approx(1.0)
    assert "util/summary" in logged  # the picture, as wandb holds it
    Image.open(tmp_path / "devices.png").verify()


def test_no_comparison_beside_a_rebalancer_or_when_switched_off(tmp_path: Path) -> None:
    for callbacks in ([UtilizationMonitor(compare_steps=0)], [UtilizationMonitor(), AdaptiveRebalancer(verbose=False)]):
        trainer(hetero(cpu_fraction=0.5), tmp_path, max_steps=40, callbacks=callbacks).fit(Net(), regression_data(n=48))
        rows = read_metrics(tmp_path)
        fractions = [row["hetero/cpu_fraction"] for row in rows if "hetero/cpu_fraction" in row]
        assert len(fractions) == 1  # logged once, at the end (the rebalancer may have moved it to 0)
        if len(callbacks) == 1:  # fixed at 0.5 throughout: nothing to compare with
            assert fractions == [0.5] and not any("hetero/cpu_gain" in row for row in rows)


def test_summary_switched_off(tmp_path: Path) -> None:
    monitor = UtilizationMonitor(summary=False)
    trainer(hetero(cpu_fraction=0.5), tmp_path, max_steps=30, callbacks=[monitor]).fit(Net(), regression_data(n=48))
    assert not (tmp_path / "devices.png").exists() and (tmp_path / "trace.json").exists()
    assert not any("hetero/samples_per_s" in row for row in read_metrics(tmp_path))


def test_summary_is_quiet_where_lightning_is_silenced(tmp_path: Path) -> None:
    lightning_logger = logging.getLogger("lightning.pytorch")
    level = lightning_logger.level
    lightning_logger.setLevel(logging.WARNING)  # as a user silences Lightning's own messages
    try:
        with printed_by_lightning(tmp_path / "printed.txt") as printed_to:
            trainer(hetero(cpu_fraction=0.5), tmp_path, max_steps=3, callbacks=[UtilizationMonitor()]).fit(
                Net(), regression_data()
            )
    finally:
        lightning_logger.setLevel(level)
    assert "what each device did" not in printed_to.read_text()
    assert any("hetero/samples_per_s" in row for row in read_metrics(tmp_path))  # still logged


def test_pictures_go_to_tensorboard_too() -> None:
    from types import SimpleNamespace

    from lightning.pytorch.loggers import TensorBoardLogger

    class Board(TensorBoardLogger):  # the logger's image call, without the tensorboard package
        def __init__(self) -> None:
            self.images: list = []

        @property
        def experiment(self) -> Board:  # type: ignore[override]
            return self

        def add_image(self, key: str, image: np.ndarray, step: int, dataformats: str) -> None:
            self.images.append((key, image.shape, step, dataformats))

    board, image = Board(), summary_image({"cpu0": {"busy": 1.0}})
    UtilizationMonitor()._log_image(SimpleNamespace(loggers=[board], global_step=7), image, "util/summary", "")
    assert board.images == [("util/summary", image.shape, 7, "HWC")]


class StopsInsideTheComparison(L.Callback):
    """Stops the run a step into the monitor's own stretch at fraction 0 (as early stopping might)."""

    def __init__(self, monitor: UtilizationMonitor) -> None:
        self.monitor = monitor

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        compare = self.monitor._compare
        if compare is not None and trainer.global_step == compare[0] + 1:
            trainer.should_stop = True


def test_a_run_stopped_inside_the_comparison_reports_its_own_fraction(tmp_path: Path) -> None:
    monitor = UtilizationMonitor(compare_steps=2)
    callbacks = [monitor, StopsInsideTheComparison(monitor)]
    trainer(hetero(cpu_fraction=0.5), tmp_path, max_steps=40, callbacks=callbacks).fit(Net(), regression_data(n=48))
    rows = read_metrics(tmp_path)
    assert [row["hetero/cpu_fraction"] for row in rows if "hetero/cpu_fraction" in row] == [0.5]
    assert max(int(row["step"]) for row in rows) < 20  # it did stop early
