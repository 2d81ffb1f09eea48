"""The utilization monitor: per-device keys through a real offline WandbLogger (read back with wandb's
own tooling) and CSVLogger, Lightning's DeviceStatsMonitor on the hetero accelerator, and the
Chrome trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.callbacks import DeviceStatsMonitor
from lightning.pytorch.loggers import WandbLogger

from lightning_hetero.callbacks import AdaptiveRebalancer, UtilizationMonitor
from lightning_hetero.callbacks import monitor as monitor_module
from lightning_hetero.callbacks.monitor import _flatten, chrome_trace, device_fractions, utilization_image
from lightning_hetero.record import StepRecord
from tests.conftest import hetero, trainer
from tests.models import Net, read_metrics, regression_data

DEVICES = ("cpu0", "stage0", "stage1")
STEPS = 6


def check_device_keys(metrics: dict[str, Any]) -> None:
    """Every device's fractions are in [0, 1] and sum to 1; the throughputs are positive."""
    for device in DEVICES:
        parts = [metrics[f"util/{device}/{kind}"] for kind in ("busy", "comm", "idle")]
        assert all(0.0 <= p <= 1.0 for p in parts), (device, parts)
        assert sum(parts) == pytest.approx(1.0, abs=1e-6)
        parts = [metrics[f"util/{device}/{key}"] for key in ("bubble", "wait", "data", "other")]
        assert all(p >= 0.0 for p in parts) and sum(parts) == pytest.approx(metrics[f"util/{device}/idle"], abs=1e-6)
        assert metrics[f"util/{device}/cpu_util"] >= 0.0 and metrics[f"util/{device}/rss_gb"] > 0.0
        assert metrics[f"util/{device}/samples_per_s"] > 0.0
    assert metrics["util/stage1/busy"] > 0.0 and metrics["util/cpu0/busy"] > 0.0
    # Every sample counted once: the CPU worker's share and the pipeline's (not once per stage).
    expected = metrics["util/cpu0/samples_per_s"] + metrics["util/stage0/samples_per_s"]
    assert metrics["throughput/samples_per_s"] == pytest.approx(expected, rel=0.25)
    assert metrics["util/cpu_fraction"] == pytest.approx(0.5)


def test_wandb_offline_run_holds_every_device_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="hetero-test", save_dir=str(tmp_path), offline=True)
    monitor = UtilizationMonitor(every_n_steps=2, image_every_n_steps=2)
    trainer(hetero(cpu_fraction=0.5), logger=logger, max_steps=STEPS, callbacks=[monitor]).fit(Net(), regression_data())
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    summary = _inspect(run_dir)
    metrics = _find_metrics(summary)
    check_device_keys(metrics)
    assert "util/devices" in metrics  # the picture
    assert summary["config"]["hetero_layout"]["stages"] == ["cpu", "cpu"]  # the layout as run config


def _inspect(run_dir: Path) -> dict[str, Any]:
    """wandb's own reading of an offline run: state, latest metrics and config."""
    inspected = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json", str(run_dir)],
        capture_output=True, text=True, check=True, env={**os.environ, "WANDB_SILENT": "true"},
    )
    return json.loads(inspected.stdout)


def _find_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """The latest metric values in `wandb leet inspect --summary --json`'s object."""
    for key in ("summary", "metrics", "latest_metrics", "history"):
        if isinstance(summary.get(key), dict) and any(k.startswith("util/") for k in summary[key]):
            return summary[key]
    raise AssertionError(f"no metrics in {sorted(summary)}")


def test_csv_logger_holds_every_device_key(tmp_path: Path) -> None:
    monitor = UtilizationMonitor(every_n_steps=2)
    trainer(hetero(cpu_fraction=0.5), tmp_path, max_steps=STEPS, callbacks=[monitor]).fit(Net(), regression_data())
    rows = [row for row in read_metrics(tmp_path) if "util/cpu0/busy" in row]
    assert [int(row["step"]) for row in rows] == [2, 4, 6]
    for row in rows:
        check_device_keys(row)


def test_device_replicas_each_count_their_own_part(tmp_path: Path) -> None:
    """Replicas: each device computes its own part of the devices' share, so its samples and share
    are that part's, and the run's throughput counts every replica's (a pipeline counts its first
    stage's, as every stage computes the same samples)."""
    monitor = UtilizationMonitor(every_n_steps=2, compare_steps=0)
    strategy = hetero(cpu_fraction=0.5, parallelism="replicas")
    trainer(strategy, tmp_path, max_steps=4, callbacks=[monitor]).fit(Net(), regression_data(n=48))
    rows = read_metrics(tmp_path)
    (shares,) = [row for row in rows if "hetero/cpu0/share" in row]
    assert [shares[f"hetero/{d}/share"] for d in ("cpu0", "replica0", "replica1")] == [0.5, 0.25, 0.25]
    (last,) = [row for row in rows if "throughput/samples_per_s" in row and int(row["step"]) == 4]
    parts = sum(last[f"util/{d}/samples_per_s"] for d in ("cpu0", "replica0", "replica1"))
    assert last["throughput/samples_per_s"] == pytest.approx(parts, rel=0.25)


def test_the_summary_says_where_the_cpu_had_no_share_of_any_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of one sample go whole to the pipeline at any CPU fraction: the summary says the CPU
    workers had none, not that there were no batches without their share to compare with."""
    said = tmp_path / "said.txt"
    monkeypatch.setattr(monitor_module, "rank_zero_info", lambda text: said.write_text(text))  # the forked ranks' too
    monitor = UtilizationMonitor(every_n_steps=2)
    strategy = hetero(cpu_fraction=0.3, micro_batches=1)
    trainer(strategy, tmp_path, max_steps=4, callbacks=[monitor]).fit(Net(), regression_data(n=8, batch_size=1))
    assert said.read_text().endswith("the CPU workers had no share of any batch.")


def test_device_stats_monitor_shows_every_device(tmp_path: Path) -> None:
    trainer(hetero(cpu_fraction=0.5), tmp_path, max_steps=3, callbacks=[DeviceStatsMonitor()]).fit(
        Net(), regression_data()
    )
    keys = {key for row in read_metrics(tmp_path) for key in row}
    for device in DEVICES:
        assert any(key.endswith(f"{device}/cpu_util") for key in keys), sorted(keys)
        assert any(key.endswith(f"{device}/rss_gb") for key in keys)


def test_trace_is_chrome_json_with_a_track_per_rank(tmp_path: Path) -> None:
    monitor = UtilizationMonitor(every_n_steps=3, trace_steps=4, save_dir=str(tmp_path))
    trainer(hetero(cpu_fraction=0.5), max_steps=STEPS, callbacks=[monitor]).fit(Net(), regression_data())
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert min(e["ts"] for e in spans) == pytest.approx(0.0, abs=1e-3) and trace["otherData"]["origin_unix_s"] > 1.7e9  # wall clock
    assert names == {"rank 0 (cpu0)", "rank 1 (stage0)", "rank 2 (stage1)"}
    for rank in range(3):
        track = sorted((e for e in spans if e["pid"] == rank), key=lambda e: e["ts"])
        assert len({e["args"]["step"] for e in track}) == 4
        assert all(e["dur"] >= 0 for e in track)
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(track, track[1:]))  # no overlap
    kinds = {e["name"] for e in spans}
    assert {"compute", "all-reduce", "optimizer step"} <= kinds
    assert any(e["name"] == "send/recv (and bubbles)" for e in spans if e["pid"] == 2)


def test_flatten_labels_each_moment_by_its_innermost_span() -> None:
    spans = [("pipeline", 1.0, 5.0), ("compute", 2.0, 3.0), ("optimizer", 6.0, 7.0)]
    assert _flatten(spans, 0.0, 8.0) == [
        ("idle", 0.0, 1.0),
        ("pipeline", 1.0, 2.0),
        ("compute", 2.0, 3.0),
        ("pipeline", 3.0, 5.0),
        ("idle", 5.0, 6.0),
        ("optimizer", 6.0, 7.0),
        ("idle", 7.0, 8.0),
    ]


def test_work_beside_the_step_takes_none_of_its_time() -> None:
    # Fine mode: the bucket steps run in their own thread beside the backward (no span), so they
    # do not push the all-reduce's time out of the fractions.
    record = StepRecord(step=0, rank=0, role="cpu0", samples=8, compute=0.8, optimizer=0.4, sync=0.1,
                        communicate=0.1, total=1.0, start=0.0, end=1.0,
                        spans=[("compute", 0.0, 0.8), ("sync", 0.8, 0.9)])
    values = device_fractions([record])
    assert values["busy"] == pytest.approx(0.8) and values["comm"] == pytest.approx(0.1)
    assert values["idle"] == pytest.approx(0.1) and values["other"] == pytest.approx(0.1)
    assert values["samples_per_s"] == 8.0


def test_monitors_and_rebalancer_together_with_accumulation(tmp_path: Path) -> None:
    # Three callbacks that talk to every rank in the same hooks, gradient accumulation, and
    # DeviceStatsMonitor(cpu_stats=False), which skips CPU ranks: nothing may wait on another.
    callbacks = [
        AdaptiveRebalancer(every_n_steps=2, warmup_steps=0),
        UtilizationMonitor(every_n_steps=1, save_dir=str(tmp_path)),
        DeviceStatsMonitor(),
        DeviceStatsMonitor(cpu_stats=False),
    ]
    trainer(hetero(cpu_fraction=0.5), tmp_path, max_steps=4, accumulate_grad_batches=2, callbacks=callbacks).fit(
        Net(), regression_data(n=96, batch_size=12)
    )
    rows = [row for row in read_metrics(tmp_path) if "util/cpu0/busy" in row]
    assert [int(row["step"]) for row in rows] == [1, 2, 3, 4]
    assert (tmp_path / "trace.json").exists()


def test_a_run_the_main_process_started_stays_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(mode="offline", dir=str(tmp_path), project="hetero-test")
    try:
        trainer(hetero(cpu_fraction=0.5), max_steps=2).fit(Net(), regression_data())  # forked ranks inherit `run`
        run.log({"after_fit": 7.0})  # still the parent's, still open
    finally:
        run.finish()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    summary = _inspect(run_dir)
    assert summary["summary"]["after_fit"] == 7.0


class SlowValidation(L.Callback):
    """Validation that takes ``seconds`` of work on every rank; each rank writes its step records' waits for data."""

    def __init__(self, out: Path, seconds: float) -> None:
        self.out, self.seconds = out, seconds

    def on_validation_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        started = time.perf_counter()
        while time.perf_counter() - started < self.seconds:  # busy, as evaluating is
            pass

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        records = trainer.strategy.step_records
        (self.out / f"data{trainer.global_rank}.json").write_text(json.dumps([[r.data, r.total] for r in records]))


def test_validation_between_training_steps_is_no_wait_for_data(tmp_path: Path) -> None:
    """A validation loop in the middle of a fit runs between two training steps: the step after it
    is timed from its own start (the rebalancer once read it as a stalled loader, and a slow step)."""
    slow = 0.3
    trainer(hetero(cpu_fraction=0.5), max_steps=8, val_check_interval=2, callbacks=[SlowValidation(tmp_path, slow)]).fit(
        Net(), regression_data(n=96), regression_data(n=12)
    )
    for rank in range(3):
        records = json.loads((tmp_path / f"data{rank}.json").read_text())
        assert len(records) == 8 and all(data < slow / 2 and total < slow for data, total in records), records


def test_image_has_a_bar_per_device() -> None:
    image = utilization_image({"cpu0": {"busy": 0.5, "comm": 0.25, "idle": 0.25}, "stage0": {"busy": 1.0}}, width=100)
    assert image.shape == (48, 100, 3)
    assert tuple(image[12, 10]) == (46, 160, 67) and tuple(image[12, 60]) == (31, 119, 180)
    assert tuple(image[36, 99]) == (46, 160, 67)


def test_chrome_trace_of_no_records_is_empty() -> None:
    assert chrome_trace([[], []])["traceEvents"] == []


@pytest.mark.parametrize("kwargs", [{"every_n_steps": 0}, {"trace_steps": 0}, {"image_every_n_steps": -1}])
def test_bad_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be an integer"):
        UtilizationMonitor(**kwargs)


@pytest.mark.parametrize("offload", ["none", "all"])
def test_fine_mode_bucket_steps_have_a_track_of_their_own(tmp_path: Path, offload: str) -> None:
    monitor = UtilizationMonitor(every_n_steps=3, trace_steps=3, save_dir=str(tmp_path), summary=False)
    strategy = hetero(mode="fine", cpu_fraction=0.5, offload=offload, bucket_size_mb=1e-4)
    trainer(strategy, max_steps=4, callbacks=[monitor]).fit(Net(), regression_data())
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    threads = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {(0, "bucket steps"), (1, "bucket steps"), (2, "bucket steps")}
    for rank in range(3):
        for tid in (0, 1):
            track = sorted((e for e in spans if e["pid"] == rank and e["tid"] == tid), key=lambda e: e["ts"])
            assert track and all(e["dur"] >= 0 for e in track)
            assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(track, track[1:]))  # no overlap
        steps = [e for e in spans if e["pid"] == rank and e["tid"] == 1]
        assert all(e["name"].startswith("bucket ") and e["name"].endswith(" step") for e in steps)
        # Each of the 3 traced optimizer steps stepped every bucket once: the CPU worker holds all of
        # them, each stage its own (the blocks' buckets, at least one per stage).
        per_step = {s: sorted(e["name"] for e in steps if e["args"]["step"] == s) for s in {e["args"]["step"] for e in steps}}
        assert len(per_step) == 3 and len({tuple(names) for names in per_step.values()}) == 1
        assert len(set(next(iter(per_step.values())))) == len(next(iter(per_step.values())))


def test_processes_keep_freed_memory_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    from lightning_hetero.devices import keep_freed_memory

    calls: list[tuple[int, int]] = []

    class Libc:
        def mallopt(self, parameter: int, value: int) -> int:
            calls.append((parameter, value))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc())
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LIGHTNING_HETERO_KEEP_FREED_MEMORY"):
        monkeypatch.delenv(name, raising=False)
    assert keep_freed_memory() and calls == [(-3, 32 * 2**20), (-1, 2**30)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    for name, value in (("LIGHTNING_HETERO_KEEP_FREED_MEMORY", "0"), ("MALLOC_TRIM_THRESHOLD_", "131072")):
        calls.clear()
        with monkeypatch.context() as patch:
            patch.setenv(name, value)
            assert not keep_freed_memory() and calls == []  # the user's own choice stands
