"""The end of a run: what each device did over the whole of it, and what the CPU bought.

Every rank adds each of its training steps' records (``record.py``) to its ``DeviceTotals``;
at the end of ``fit`` global rank 0 gathers them and the wall time of every batch, and builds a
``RunSummary``: one row per device (busy / communicating / idle shares of its time, the samples
per second of its own share, its share of the batch) and what the CPU bought: the run's
throughput with the CPU's share against the throughput of the batches the CPU had no share of
(the rebalancer's baseline windows at fraction 0, or the utilization monitor's own short
comparison), each the median over its batches, with the middle half of the batches as the
spread (``cpu_gain``). A picture of the same (``summary_image``) goes beside the trace.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from lightning_hetero.files import atomic_write
from lightning_hetero.record import StepRecord

__all__ = ["DeviceTotals", "Throughput", "CpuGain", "RunSummary", "cpu_gain", "settled_rates", "summary_image", "write_png"]

BUSY = ("compute", "stage", "optimizer")
"""Span kinds in which a rank computes (its share, its layers, its optimizer step)."""


@dataclass
class DeviceTotals:
    """One rank's time over a run's training steps, in seconds, and its samples. Work beside the
    step's own timeline (fine mode's bucket steps, in their own thread) is left out: it took no
    time of the step."""

    busy: float = 0.0
    comm: float = 0.0
    bubble: float = 0.0
    wait: float = 0.0
    data: float = 0.0
    total: float = 0.0
    samples: int = 0
    walls: list[float] = field(default_factory=list)
    """Each batch's wall time on this rank (the latest ``keep``)."""
    fractions: list[float] = field(default_factory=list)
    """The CPU fraction each of those batches ran with."""
    sizes: list[int] = field(default_factory=list)
    """Each of those batches' samples (the whole batch, every worker's share)."""
    keep: int = 100_000

    def add(self, record: StepRecord, batch_size: int = 0) -> None:
        def timed(*kinds: str) -> float:
            return sum(b - a for kind, a, b in record.spans if kind in kinds)

        self.busy += timed(*BUSY)
        self.comm += timed("sync")
        self.bubble += record.communicate - record.sync
        self.wait += record.wait
        self.data += record.data
        self.total += record.total
        self.samples += record.samples
        self.walls.append(record.total)
        self.fractions.append(record.cpu_fraction)
        self.sizes.append(batch_size)
        if len(self.walls) > self.keep:
            del self.walls[0], self.fractions[0], self.sizes[0]

    def shares(self) -> dict[str, float]:
        """Busy / comm / idle fractions of the time (they sum to 1), the parts of idle (``bubble``:
        the pipeline's sends, receives and bubbles; ``wait``: for the other workers; ``data``: for
        the next batch and the loop; ``other``), and the samples per second of this rank's share."""
        if self.total <= 0:
            return {}
        busy = min(1.0, self.busy / self.total)
        comm = min(1.0 - busy, self.comm / self.total)
        idle = 1.0 - busy - comm
        parts = {key: min(getattr(self, key) / self.total, idle) for key in ("bubble", "wait", "data")}
        other = max(0.0, idle - sum(parts.values()))
        return {"busy": busy, "comm": comm, "idle": idle, **parts, "other": other, "samples_per_s": self.samples / self.total}

    @classmethod
    def of(cls, records: Sequence[StepRecord]) -> DeviceTotals:
        totals = cls()
        for record in records:
            totals.add(record)
        return totals


@dataclass(frozen=True)
class Throughput:
    """Samples per second over a set of batches: the median batch's, and the middle half's range."""

    median: float
    low: float
    high: float
    batches: int

    @classmethod
    def of(cls, rates: Sequence[float]) -> Optional[Throughput]:
        if not rates:
            return None
        if len(rates) < 4:
            return cls(statistics.median(rates), min(rates), max(rates), len(rates))
        low, _, high = statistics.quantiles(rates, n=4)
        return cls(statistics.median(rates), low, high, len(rates))


@dataclass(frozen=True)
class CpuGain:
    """The run's throughput with the CPU's share against without (the batches at fraction 0)."""

    fraction: float
    with_cpu: Throughput
    without: Throughput

    @property
    def gain(self) -> float:
        """Relative: 0.25 is 25% more samples per second with the CPU."""
        return self.with_cpu.median / self.without.median - 1.0

    @property
    def spread(self) -> tuple[float, float]:
        """The gain between the middle halves' far ends: a gain inside it may be noise."""
        return self.with_cpu.low / self.without.high - 1.0, self.with_cpu.high / self.without.low - 1.0


def settled_rates(
    fractions: Sequence[float], walls: Sequence[float], batch_sizes: Sequence[int], settle: int = 2
) -> list[tuple[float, float]]:
    """(CPU fraction, samples/s) of the batches ``cpu_gain`` compares: all but the first, and the
    ``settle`` batches after each change of fraction."""
    kept: list[tuple[float, float]] = []
    since_change = 0
    for index, (fraction, wall, size) in enumerate(zip(fractions, walls, batch_sizes)):
        since_change = since_change + 1 if index and fraction == fractions[index - 1] else 0
        if index and since_change >= settle and wall > 0:
            kept.append((fraction, size / wall))
    return kept


def cpu_gain(fractions: Sequence[float], walls: Sequence[float], batch_sizes: Sequence[int], settle: int = 2) -> Optional[CpuGain]:
    """What the CPU bought, from every batch's CPU fraction, wall time (the slowest rank's) and
    size, in order. The first batch and the ``settle`` batches after each change of fraction are
    left out (one-time costs, a CPU worker catching up). The batches at the last fraction the CPU
    had a share at are compared with those at fraction 0; ``None`` where either is missing."""
    kept = settled_rates(fractions, walls, batch_sizes, settle)
    shared = [fraction for fraction, _ in kept if fraction > 0]
    if not shared:
        return None
    with_cpu = Throughput.of([rate for fraction, rate in kept if fraction == shared[-1]])
    without = Throughput.of([rate for fraction, rate in kept if fraction == 0])
    if with_cpu is None or without is None:
        return None
    return CpuGain(shared[-1], with_cpu, without)


@dataclass
class RunSummary:
    """What a run's devices did and what the CPU bought (built on global rank 0)."""

    devices: dict[str, dict[str, float]]
    """Per device name: its ``DeviceTotals.shares()`` and ``share``, its share of the batch."""
    samples_per_s: float
    """The run's throughput: every batch's samples over its wall time."""
    fraction: float
    """The CPU fraction the run's last batch trained at."""
    gain: Optional[CpuGain] = None
    cpu_workers: int = 1
    """CPU workers per node."""
    cpu_shared: bool = True
    """Some batch of the run gave the CPU workers a share."""
    settled_without: bool = False
    """Some batch the comparison counts ran at fraction 0 (``settled_rates``)."""

    def table(self) -> str:
        """The devices as a text table, then a line on what the CPU bought."""
        header = f"{'device':<12}{'busy':>7}{'comm':>7}{'idle':>7}{'samples/s':>12}{'share':>8}"
        lines = [header, "-" * len(header)]
        for name, row in self.devices.items():
            lines.append(
                f"{name:<12}{row.get('busy', 0):>7.0%}{row.get('comm', 0):>7.0%}{row.get('idle', 0):>7.0%}"
                f"{row.get('samples_per_s', 0):>12,.0f}{row.get('share', 0):>8.0%}"
            )
        return "\n".join(lines + [self.verdict()])

    def verdict(self) -> str:
        gain = self.gain
        if gain is None and not self.cpu_workers:
            return f"The run trained {self.samples_per_s:,.0f} samples/s, with no CPU worker."
        if gain is None and not self.cpu_shared:
            return f"The run trained {self.samples_per_s:,.0f} samples/s; the CPU workers had no share of any batch."
        if gain is None and self.settled_without:
            return (
                f"The run trained {self.samples_per_s:,.0f} samples/s, its last batches at CPU fraction"
                f" {self.fraction:.2f}; no batches with the CPU's share ran long enough at one fraction to compare with"
                " those without it (the first batches after each change of fraction are left out)."
            )
        if gain is None:
            return (
                f"The run trained {self.samples_per_s:,.0f} samples/s at CPU fraction {self.fraction:.2f}; no batches"
                " ran without the CPU's share to compare with (the monitor compares in runs of at least"
                " 3 x (compare_steps + 2) optimizer steps: `UtilizationMonitor(compare_steps=...)`)."
            )
        low, high = gain.spread
        alone = f"{gain.without.median:,.0f} samples/s without it"
        measured = f"median of {gain.with_cpu.batches} and {gain.without.batches} batches; middle half: {low:+.0%} to {high:+.0%}"
        if self.fraction == 0:
            return (
                f"The CPU took no share at the end: with {gain.fraction:.2f} of each batch it trained"
                f" {gain.with_cpu.median:,.0f} samples/s against {alone} ({gain.gain:+.0%}; {measured})."
            )
        return (
            f"The CPU bought {gain.gain:+.0%} throughput: {gain.with_cpu.median:,.0f} samples/s with"
            f" {gain.fraction:.2f} of each batch on the CPU, {alone} ({measured})."
        )

    def metrics(self) -> dict[str, float]:
        """The summary under stable keys (docs/monitoring.md)."""
        metrics = {"hetero/samples_per_s": self.samples_per_s, "hetero/cpu_fraction": self.fraction}
        if self.gain is not None:
            low, high = self.gain.spread
            metrics.update(
                {
                    "hetero/cpu_gain": self.gain.gain,
                    "hetero/cpu_gain_low": low,
                    "hetero/cpu_gain_high": high,
                    "hetero/samples_per_s_without_cpu": self.gain.without.median,
                }
            )
        for name, row in self.devices.items():
            for key in ("busy", "comm", "idle", "samples_per_s", "share"):
                metrics[f"hetero/{name}/{key}"] = row.get(key, 0.0)
        return metrics


_COLORS = {"busy": (46, 160, 67), "comm": (31, 119, 180), "pipe": (158, 202, 225), "idle": (220, 220, 220)}
_KIND_COLOR = {"compute": "busy", "stage": "busy", "optimizer": "busy", "sync": "comm", "pipeline": "pipe"}
_LEGEND = (("busy", "computing, optimizer"), ("comm", "summing gradients"), ("pipe", "pipeline sends, receives, bubbles"), ("idle", "idle, waiting"))
LABEL, GAP, TOP = 90, 16, 18
"""The picture's layout: the devices' names' width, the gap between the two panels, the title row."""


def summary_image(
    devices: dict[str, dict[str, float]],
    step: Optional[Sequence[Optional[StepRecord]]] = None,
    width: int = 720,
    row: int = 24,
) -> np.ndarray:
    """An RGB picture: per device, a stacked bar of its run (busy green, comm blue, idle grey), and
    beside it, where ``step`` gives every rank's record of one step, that step's timeline (the same
    colors, the pipeline's sends, receives and bubbles light blue), on one time axis; a legend below."""
    from PIL import Image, ImageDraw

    names = list(devices)
    bar = (width - LABEL - GAP) // 2 if step else width - LABEL
    height = TOP + max(1, len(names)) * row
    image = Image.new("RGB", (width, height + 22), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    records = [r for r in step or () if r is not None and r.end > r.start]
    origin = min((r.start for r in records), default=0.0)
    span = max((r.end for r in records), default=1.0) - origin or 1.0
    draw.text((LABEL, 3), "the whole run (shares of each device's time)", fill=(0, 0, 0))
    if records:
        draw.text((LABEL + bar + GAP, 3), f"one step ({span * 1e3:.1f} ms)", fill=(0, 0, 0))
    for i, name in enumerate(names):
        y0, y1 = TOP + i * row + 3, TOP + (i + 1) * row - 3
        draw.text((4, y0 + 3), name, fill=(0, 0, 0))
        x = LABEL
        for kind in ("busy", "comm", "idle"):
            stop = min(LABEL + bar, x + round(devices[name].get(kind, 0.0) * bar))
            draw.rectangle((x, y0, max(x, stop - 1), y1), fill=_COLORS[kind])
            x = stop
        record = step[i] if step and i < len(step) else None
        if record is None or record.end <= record.start:
            continue

        def at(t: float) -> int:
            return LABEL + bar + GAP + round((t - origin) / span * bar)

        draw.rectangle((at(record.start), y0, at(record.end), y1), fill=_COLORS["idle"])
        for kind, a, b in sorted(record.spans, key=lambda s: s[1] - s[2]):  # longest first, innermost on top
            draw.rectangle((at(a), y0, max(at(a), at(b) - 1), y1), fill=_COLORS[_KIND_COLOR.get(kind, "idle")])
    x = LABEL
    for kind, text in _LEGEND:
        draw.rectangle((x, height + 6, x + 10, height + 16), fill=_COLORS[kind])
        draw.text((x + 14, height + 5), text, fill=(0, 0, 0))
        x += 24 + round(draw.textlength(text))
    return np.asarray(image)


def write_png(image: np.ndarray, path: Path) -> Path:
    """Write ``image`` (RGB) as a PNG, whole or not at all."""
    from PIL import Image

    with atomic_write(path, "wb") as f:
        Image.fromarray(image).save(f, format="PNG")
    return path
