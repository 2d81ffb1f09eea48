"""The one measurement source: what every rank did in every training step.

The strategy times its own work, per rank and per step: computing its share (forward and
backward), communicating (pipeline sends and receives, gradient sums), stepping the optimizer,
waiting for the other workers at the end of a step, and the time between steps (loading the
batch, and the training loop's own work). The workload
analyzer (predicted vs measured), the adaptive rebalancer (compute time per sample) and the
utilization monitor all read these records; none keeps timers of its own.

Where a stage runs on CUDA, its compute is measured with CUDA events and resolved at the end of
the step, so the timing never forces the device to synchronize mid-step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["StepRecord", "StepClock", "Recorder"]


@dataclass
class StepRecord:
    """One rank's training step, in seconds."""

    step: int
    rank: int
    role: str
    samples: int = 0
    """Samples of the batch this rank worked on: a CPU worker's share; on a stage, the pipeline's."""
    compute: float = 0.0
    """Forward and backward of this rank's share (on a stage: inside its layers only)."""
    communicate: float = 0.0
    """Pipeline sends and receives (with the pipeline's bubbles), and gradient sums."""
    optimizer: float = 0.0
    """Clipping and the optimizer step (fine mode: the buckets' steps, overlapped with the backward)."""
    wait: float = 0.0
    """Waiting for the other workers when the step's results are shared (the faster side waits)."""
    data: float = 0.0
    """Between the previous step and this one: loading the batch, and the training loop's own work."""
    total: float = 0.0
    """From this step's batch being ready to the next one's."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class StepClock:
    """Accumulates time per kind within one step; ``device_time`` spans may be CUDA-timed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        self._events: list[tuple[str, Any, Any]] = []

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

    def span(self, kind: str) -> "_Span":
        return _Span(self, kind)

    def device_span(self, kind: str) -> Any:
        """Time work queued on this rank's device (CUDA events), or wall time on the CPU."""
        if self.device.type != "cuda":
            return _Span(self, kind)
        return _CudaSpan(self, kind)

    def resolve(self) -> dict[str, float]:
        """The totals, once CUDA work has finished (called at the end of the step)."""
        for kind, start, stop in self._events:
            stop.synchronize()
            self.add(kind, start.elapsed_time(stop) / 1e3)
        self._events.clear()
        return dict(self.seconds)


class _Span:
    def __init__(self, clock: StepClock, kind: str) -> None:
        self.clock, self.kind = clock, kind

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.clock.add(self.kind, time.perf_counter() - self.start)


class _CudaSpan(_Span):
    def __enter__(self) -> None:
        self.begin = torch.cuda.Event(enable_timing=True)
        self.begin.record(torch.cuda.current_stream(self.clock.device))

    def __exit__(self, *exc: Any) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.clock.device))
        self.clock._events.append((self.kind, self.begin, end))


@dataclass
class Recorder:
    """This rank's recent steps (``keep`` of them), and the clock of the step in progress."""

    rank: int
    role: str
    device: torch.device
    keep: int = 1000
    records: deque = field(default_factory=deque)
    clock: StepClock | None = None
    _started: float | None = None
    _last_end: float | None = None

    def begin(self) -> StepClock:
        """A training batch is ready: start timing this step (the gap since the last is waiting)."""
        now = time.perf_counter()
        self.clock = StepClock(self.device)
        if self._last_end is not None:
            self.clock.add("data", now - self._last_end)
        self._started = self._last_end if self._last_end is not None else now
        return self.clock

    def end(self, step: int, samples: int) -> StepRecord | None:
        """This rank is done with the batch (its optimizer stepped, or it accumulates): close the record.

        A stage's schedule time (``"pipeline"``) that is not spent in its layers is communication:
        sends, receives, and the pipeline's bubbles."""
        if self.clock is None or self._started is None:
            return None
        seconds = self.clock.resolve()
        pipeline, stage = seconds.pop("pipeline", None), seconds.pop("stage", 0.0)
        seconds["compute"] = seconds.get("compute", 0.0) + stage
        if pipeline is not None:
            seconds["communicate"] = seconds.get("communicate", 0.0) + max(0.0, pipeline - stage)
        now = time.perf_counter()
        record = StepRecord(
            step=step,
            rank=self.rank,
            role=self.role,
            samples=samples,
            total=now - self._started,
            **{kind: seconds.get(kind, 0.0) for kind in ("compute", "communicate", "optimizer", "wait", "data")},
        )
        self.records.append(record)
        while len(self.records) > self.keep:
            self.records.popleft()
        self.clock, self._last_end = None, now
        return record

    @property
    def last(self) -> StepRecord | None:
        return self.records[-1] if self.records else None
