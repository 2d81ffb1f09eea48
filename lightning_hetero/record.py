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
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["StepRecord", "StepClock", "Recorder", "span"]


@dataclass
class StepRecord:
    """One rank's training step, in seconds."""

    step: int
    rank: int
    role: str
    samples: int = 0
    """Samples of the batch this rank worked on: a CPU worker's share; on a stage, the pipeline's
    (every stage computes all of it); on a device replica, its own part of the devices' share."""
    compute: float = 0.0
    """Forward and backward of this rank's share (on a stage: inside its layers only)."""
    communicate: float = 0.0
    """Pipeline sends and receives (with the pipeline's bubbles), and gradient sums."""
    sync: float = 0.0
    """The part of ``communicate`` spent summing gradients with the other workers."""
    optimizer: float = 0.0
    """Clipping and the optimizer step (fine mode: the buckets' steps, overlapped with the backward)."""
    wait: float = 0.0
    """Waiting for the other workers when the step's results are shared (the faster side waits), and
    for the output (or gradient) of a multimodal model's encoder placed on another process."""
    data: float = 0.0
    """Between the previous step and this one: loading the batch, and the training loop's own work."""
    total: float = 0.0
    """From this step's batch being ready to the next one's."""
    share: float = 0.0
    """Wall time of this rank's share of the batch, waiting excluded: a CPU worker's forward and
    backward; on a stage, the pipeline schedule (its layers, sends, receives and bubbles) and the
    last stage's replay of the step method. What the rebalancer balances."""
    cpu_fraction: float = 0.0
    """The CPU fraction this step ran with."""
    start: float = 0.0
    """When the step began (the previous one's end), in ``time.perf_counter`` seconds."""
    end: float = 0.0
    """When this rank was done with it."""
    spans: list = field(default_factory=list)
    """``(kind, start, end)`` of the timed work, in ``time.perf_counter`` seconds (host time; on
    CUDA, a span starts when its work was queued and lasts as long as the device took)."""
    side_spans: list = field(default_factory=list)
    """``(kind, start, end)`` of work beside the step's own timeline: fine mode's bucket steps
    (``"bucket <k> step"``), which run in a thread of their own during the backward."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class StepClock:
    """Accumulates time per kind within one step; ``device_time`` spans may be CUDA-timed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []
        self.side_spans: list[tuple[str, float, float]] = []
        """Spans of work beside the step's own timeline (``StepRecord.side_spans``)."""
        self._events: list[tuple[str, float, Any, Any]] = []

    def add(self, kind: str, seconds: float) -> None:
        """Time spent on ``kind`` outside this step's timeline (another thread's, say)."""
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

    def add_span(self, kind: str, start: float, end: float) -> None:
        """Time spent on ``kind`` from ``start`` to ``end`` (``time.perf_counter``)."""
        self.add(kind, end - start)
        self.spans.append((kind, start, end))

    def span(self, kind: str) -> "_Span":
        return _Span(self, kind)

    def device_span(self, kind: str) -> Any:
        """Time work queued on this rank's device (CUDA events), or wall time on the CPU."""
        if self.device.type != "cuda":
            return _Span(self, kind)
        return _CudaSpan(self, kind)

    def resolve(self) -> dict[str, float]:
        """The totals, once CUDA work has finished (called at the end of the step)."""
        for kind, queued, start, stop in self._events:
            stop.synchronize()
            self.add_span(kind, queued, queued + start.elapsed_time(stop) / 1e3)
        self._events.clear()
        return dict(self.seconds)


def span(clock: StepClock | None, kind: str) -> Any:
    """A context that times its work into ``clock`` as ``kind`` (nothing, without a clock)."""
    return clock.span(kind) if clock is not None else nullcontext()


class _Span:
    def __init__(self, clock: StepClock, kind: str) -> None:
        self.clock, self.kind = clock, kind

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.clock.add_span(self.kind, self.start, time.perf_counter())


class _CudaSpan(_Span):
    def __enter__(self) -> None:
        self.queued = time.perf_counter()
        self.begin = torch.cuda.Event(enable_timing=True)
        self.begin.record(torch.cuda.current_stream(self.clock.device))

    def __exit__(self, *exc: Any) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.clock.device))
        self.clock._events.append((self.kind, self.queued, self.begin, end))


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
            self.clock.add_span("data", self._last_end, now)
        self._started = self._last_end if self._last_end is not None else now
        return self.clock

    def leave_out_gap(self) -> None:
        """What ran since the last step was no part of training (a validation loop in the middle of a
        fit): the next step is timed from its own start, with no wait for data before it."""
        self._last_end = None

    def end(self, step: int, samples: int, cpu_fraction: float = 0.0) -> StepRecord | None:
        """This rank is done with the batch (its optimizer stepped, or it accumulates): close the record.

        A stage's schedule time (``"pipeline"``) that is not spent in its layers is communication:
        sends, receives, and the pipeline's bubbles."""
        if self.clock is None or self._started is None:
            return None
        seconds = self.clock.resolve()
        pipeline, stage = seconds.pop("pipeline", None), seconds.pop("stage", 0.0)
        # Waiting for a placed encoder's output or gradient (``multimodal.py``) is no work: on a stage
        # it is inside the schedule's time, elsewhere inside the share's compute.
        waited = seconds.get("encoder wait", 0.0)
        seconds["wait"] = seconds.get("wait", 0.0) + waited
        if pipeline is not None:
            pipeline = max(0.0, pipeline - waited)
        else:
            seconds["compute"] = seconds.get("compute", 0.0) - waited
        share = seconds.get("compute", 0.0) + (pipeline or 0.0)
        seconds["compute"] = seconds.get("compute", 0.0) + stage
        seconds["communicate"] = seconds.get("communicate", 0.0) + seconds.get("sync", 0.0)
        if pipeline is not None:
            seconds["communicate"] += max(0.0, pipeline - stage)
        now = time.perf_counter()
        record = StepRecord(
            step=step,
            rank=self.rank,
            role=self.role,
            samples=samples,
            total=now - self._started,
            share=share,
            cpu_fraction=cpu_fraction,
            start=self._started,
            end=now,
            spans=self.clock.spans,
            side_spans=self.clock.side_spans,
            **{kind: seconds.get(kind, 0.0) for kind in ("compute", "communicate", "sync", "optimizer", "wait", "data")},
        )
        self.records.append(record)
        while len(self.records) > self.keep:
            self.records.popleft()
        self.clock, self._last_end = None, now
        return record

    @property
    def last(self) -> StepRecord | None:
        return self.records[-1] if self.records else None
