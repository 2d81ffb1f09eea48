"""The step engine on its own, in one process: a fake worker, a fake gradient sync and a fake peer
stand in for the roles, the modes and the other ranks, so each test reads as one rule of a step
(DESIGN.md, "Step semantics") and checks it in milliseconds. The integration suite runs the same
engine with real processes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from lightning_hetero.engine import StepEngine
from lightning_hetero.record import Recorder
from lightning_hetero.results import LoggedValue, WorkerReport
from lightning_hetero.shares import Shares, split_batch
from lightning_hetero.sync import Arrivals, GradSync


class FakeWorker:
    """A role that computes ``samples`` of each batch with a fixed loss, leaving gradient 1 in ``param``."""

    speed_key = "cpu"
    encoders_on_cpu = False

    def __init__(self, calls: list, loss: float = 1.0, cpu_worker: bool = True, fail: bool = False) -> None:
        self.calls, self.loss, self.cpu_worker, self.fail = calls, loss, cpu_worker, fail
        self.param = nn.Parameter(torch.zeros(2))
        self.module = nn.Module()  # the worker's model: no buffers
        self.fresh_grads: Optional[list] = None
        self.pace = 0.0
        self.policies: list[str] = []

    def saw_batch(self, method: str, batch_size: int, loader: int = 0, loader_batch_size: Optional[int] = None) -> None:
        pass

    def arrivals(self, shares: Shares, batch: Any) -> Arrivals:
        return Arrivals(1)

    def keeps_out(self, detached: bool) -> bool:
        return detached and self.cpu_worker

    def train_step(self, batch: Any, batch_idx: int, shares: Shares, accumulate: int, grads: str, clock: Any) -> Any:
        self.calls.append("compute")
        self.policies.append(grads)
        if self.fail:
            raise RuntimeError("injected")
        self.fresh_grads = [torch.ones(2)] if grads != "accumulate" else None
        logs = [LoggedValue("train_loss", self.loss, 3.0, torch.float64, {"on_step": True})]
        return WorkerReport(samples=3, loss=self.loss, loss_dtype=torch.float64, logs=logs), {"loss": torch.tensor(self.loss)}

    def eval_step(self, method: str, batch: Any, rest: tuple, shares: Shares) -> Any:
        self.calls.append(method)
        return WorkerReport(samples=3, logs=[LoggedValue("val_loss", 2.0, 3.0, torch.float64, {})]), "output"

    def put_back_grads(self) -> None:
        self.calls.append("put back")
        if self.fresh_grads is not None:
            self.param.grad = self.fresh_grads[0] if self.param.grad is None else self.param.grad + self.fresh_grads[0]
            self.fresh_grads = None

    def recorded_samples(self, shares: Shares, report: WorkerReport) -> int:
        return report.samples

    def share_range(self, shares: Shares) -> tuple[int, int]:
        return 0, 3

    def refresh(self, optimizer: Any, steps: Any) -> None:
        self.calls.append("refresh")


class FakeSync(GradSync):
    """A mode that records when the engine calls it; ``verdict`` is what ``after_backward`` finds."""

    def __init__(self, calls: list, overlaps: bool = False, verdict: tuple[bool, bool] = (True, False)) -> None:
        self.calls, self.overlaps, self.verdict = calls, overlaps, verdict
        self.begun: list[tuple] = []

    def begin(self, arrivals: int, clipping: Any, detached: bool, takes_part: bool) -> bool:
        self.calls.append("begin")
        self.begun.append((detached, takes_part))
        self.takes_part = takes_part
        return self.overlaps and takes_part

    def after_backward(self, finite: bool, clock: Any) -> tuple[bool, bool]:
        self.calls.append("after backward")
        return self.verdict

    def finish(self, clock: Any) -> None:
        if self.takes_part:  # as CoarseSync: a rank kept out of the step sums nothing
            self.calls.append("sum")

    def abort(self) -> None:
        self.calls.append("abort")


def peer(samples: int = 1, loss: float = 5.0, nonfinite: tuple = ()) -> WorkerReport:
    """Another rank's report (the pipeline's last stage)."""
    logs = [LoggedValue("train_loss", loss, float(samples), torch.float64, {"on_step": True})]
    return WorkerReport(samples=samples, loss=loss, loss_dtype=torch.float64, logs=logs, nonfinite=nonfinite)


def make(calls: list, worker: FakeWorker, sync: Optional[GradSync] = None, others: Optional[list] = None, **kwargs: Any) -> tuple[StepEngine, list]:
    logged: list = []

    def exchange(report: WorkerReport, one_way: bool) -> list[WorkerReport]:
        calls.append("exchange, one way" if one_way else "exchange")
        return [report, *(others if others is not None else [peer()])]

    kwargs.setdefault("nonfinite", "error")
    engine = StepEngine(
        worker=worker,  # type: ignore[arg-type]
        exchange=exchange,
        log=logged.extend,
        names=["cpu0", "stage0"],
        cpu_workers=1,
        device=torch.device("cpu"),
        recorder=Recorder(0, "cpu0", torch.device("cpu")),
        **kwargs,
    )
    engine.sync = sync if sync is not None else FakeSync(calls)
    return engine, logged


def trainer(accumulate: int = 1, step: int = 0, clip: Optional[float] = None) -> Any:
    return SimpleNamespace(
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        gradient_clip_algorithm="norm",
        global_step=step,
        current_epoch=0,
        lightning_module=BoringModel(),
        strategy=SimpleNamespace(optimizers=[]),
    )


def one_step(engine: StepEngine, t: Any, batch_idx: int, shares: Shares, fraction: float = 0.5) -> Any:
    """What Lightning does for a batch that ends an optimizer step: the closure inside the step."""
    optimizer = torch.optim.SGD([engine.worker.param], lr=1.0)  # type: ignore[attr-defined]
    out: dict = {}

    def closure() -> None:
        out["loss"] = engine.training_step(t, None, batch_idx, shares, fraction)
        engine.backward()
        engine.finish_backward()

    def step(timed_closure: Any) -> None:
        timed_closure()
        engine.worker.calls.append("optimizer step")  # type: ignore[attr-defined]
        optimizer.step()

    engine.on_batch_start()
    engine.optimizer_step(closure, step, optimizer)
    return out["loss"]


HALF = split_batch(4, 0.5, cpu_workers=1, micro_batches=1)  # 2 samples each
PIPELINE_ONLY = split_batch(4, 0.0, cpu_workers=1, micro_batches=1)


def test_a_step_runs_split_compute_exchange_sum_step_in_that_order() -> None:
    calls: list = []
    engine, _ = make(calls, FakeWorker(calls))
    one_step(engine, trainer(), 0, HALF)
    assert calls == ["begin", "compute", "after backward", "exchange", "put back", "sum", "optimizer step"]


def test_the_loss_is_the_whole_batchs_weighted_by_samples() -> None:
    calls: list = []
    engine, logged = make(calls, FakeWorker(calls, loss=1.0), others=[peer(samples=1, loss=5.0)])
    loss = one_step(engine, trainer(), 0, HALF)
    assert loss.item() == pytest.approx((3 * 1.0 + 1 * 5.0) / 4) and loss.dtype == torch.float64
    (value,) = logged
    assert value.name == "train_loss" and value.value == pytest.approx(2.0) and value.weight == 4.0


def test_gradients_accumulate_and_sum_only_at_the_windows_last_batch() -> None:
    calls: list = []
    worker = FakeWorker(calls)
    engine, _ = make(calls, worker)
    t = trainer(accumulate=3)
    for batch_idx in (0, 1):
        engine.on_batch_start()
        with engine.accumulating():
            engine.training_step(t, None, batch_idx, HALF, 0.5)
            engine.backward()
            engine.finish_backward()
    one_step(engine, t, 2, HALF)
    assert calls.count("begin") == calls.count("sum") == 1 and calls.index("begin") > calls.index("exchange")
    assert worker.policies == ["drop", "keep", "keep"]  # Lightning zeroes .grad after the first batch's step
    assert [r.step for r in engine.recorder.records] == [0, 0, 0] and len(engine.recorder.records) == 3


def test_fine_mode_leaves_the_last_backward_to_the_sync() -> None:
    calls: list = []
    worker = FakeWorker(calls)
    engine, _ = make(calls, worker, FakeSync(calls, overlaps=True))
    one_step(engine, trainer(), 0, HALF)
    assert worker.policies == ["accumulate"]


def test_cpu_workers_without_a_share_keep_out_and_are_refreshed_before_they_compute_again() -> None:
    calls: list = []
    sync = FakeSync(calls)
    engine, _ = make(calls, FakeWorker(calls), sync)
    one_step(engine, trainer(), 0, PIPELINE_ONLY, fraction=0.0)
    assert sync.begun == [(True, False)] and "sum" not in calls  # detached, and this CPU worker sums nothing
    assert "exchange, one way" in calls  # and nobody waits to hear from it
    assert engine.stale and not engine.replica_is_current
    calls.clear()
    one_step(engine, trainer(), 1, HALF)
    assert calls[0] == "refresh" and sync.begun[-1] == (False, True) and engine.replica_is_current


def test_a_share_anywhere_in_the_window_keeps_the_cpu_workers_in_its_sum() -> None:
    calls: list = []
    sync = FakeSync(calls)
    engine, _ = make(calls, FakeWorker(calls), sync)
    t = trainer(accumulate=2)
    engine.on_batch_start()
    with engine.accumulating():
        engine.training_step(t, None, 0, HALF, 0.5)
        engine.backward()
        engine.finish_backward()
    one_step(engine, t, 1, PIPELINE_ONLY, fraction=0.0)
    assert sync.begun == [(False, True)] and not engine.stale


def test_nonfinite_values_on_any_rank_end_the_run_on_every_rank_by_default() -> None:
    calls: list = []
    engine, _ = make(calls, FakeWorker(calls), others=[peer(nonfinite=("loss",))])
    with pytest.raises(FloatingPointError, match=r"training step 0 \(epoch 0, batch 0\): loss on stage0 \(global rank 1\)"):
        one_step(engine, trainer(), 0, HALF)


def test_nonfinite_skip_steps_nothing_on_every_rank() -> None:
    calls: list = []
    worker = FakeWorker(calls)
    engine, logged = make(calls, worker, others=[peer(nonfinite=("gradients",))], nonfinite="skip")
    with pytest.warns(UserWarning, match="Skipped training step 0"):
        one_step(engine, trainer(), 0, HALF)
    assert "sum" not in calls and worker.param.grad is None and torch.equal(worker.param, torch.zeros(2))
    assert engine.skipped_steps == 1 and [v.name for v in logged] == ["train_loss", "hetero/skipped_steps"]


def test_fine_modes_verdict_travels_with_the_report() -> None:
    calls: list = []
    reports: list = []
    engine, _ = make(calls, FakeWorker(calls), FakeSync(calls, overlaps=True, verdict=(False, True)), nonfinite="skip")
    exchange = engine._exchange
    engine._exchange = lambda r, one_way: reports.append(r) or exchange(r, one_way)  # type: ignore[method-assign]
    with pytest.warns(UserWarning, match="NaN or Inf in gradients on cpu0"):
        one_step(engine, trainer(), 0, HALF)
    assert reports[0].nonfinite == ("gradients",) and engine.state.skip


def test_a_failed_compute_stops_the_sync() -> None:
    calls: list = []
    engine, _ = make(calls, FakeWorker(calls, fail=True))
    with pytest.raises(RuntimeError, match="injected"):
        one_step(engine, trainer(), 0, HALF)
    assert calls[-1] == "abort"


def test_every_step_is_recorded_with_its_samples_and_fraction() -> None:
    calls: list = []
    engine, _ = make(calls, FakeWorker(calls))
    one_step(engine, trainer(step=7), 0, HALF, fraction=0.5)
    (record,) = engine.recorder.records
    assert (record.step, record.samples, record.cpu_fraction) == (7, 3, 0.5)
    assert {kind for kind, _, _ in record.spans} >= {"wait", "optimizer"}


def test_evaluation_combines_logged_values_and_refreshes_stale_replicas() -> None:
    calls: list = []
    engine, logged = make(calls, FakeWorker(calls), others=[WorkerReport(samples=1, logs=[LoggedValue("val_loss", 6.0, 1.0, torch.float64, {})])])
    engine.stale = True
    assert engine.eval_step("validation_step", None, (0,), HALF, None) == "output"
    assert calls == ["refresh", "validation_step", "exchange"]
    assert [(v.name, v.value) for v in logged] == [("val_loss", pytest.approx(3.0))]
