"""``UtilizationMonitor``: what every CPU worker and stage did, per step, in the logger and on a timeline.

Every ``every_n_steps`` optimizer steps, global rank 0 gathers the step records of every rank
(``record.py``: the strategy's own timers, CUDA events on GPU stages) with each process's CPU
utilization and, on GPU stages, NVML utilization and memory, and logs per device:

- ``util/<device>/busy``: computing its share and stepping the optimizer;
- ``util/<device>/comm``: summing gradients with the other workers;
- ``util/<device>/idle``: the rest of the step: on a stage, the pipeline's sends, receives and
  bubbles; waiting for the slower side; waiting for the next batch and the loop; anything else
  (also logged on their own as ``util/<device>/bubble``, ``/wait``, ``/data`` and ``/other``);

as fractions of the step that sum to 1, ``util/<device>/samples_per_s``, ``util/<device>/cpu_util``
(the process's CPU time over its threads' capacity), GPU utilization and memory where there is
CUDA, and ``throughput/samples_per_s`` and ``util/cpu_fraction`` for the run. ``<device>`` is the
rank's role: ``cpu0``, ``stage0``, ``stage1``... (``node1.stage0`` on further nodes).

Fine mode's bucket steps, which run in a thread of their own during the backward, are on a
track of their own in the trace ("bucket steps").

Every ``image_every_n_steps`` a picture of the same (one stacked bar per device) goes to the
loggers that take images (wandb), and at the end of training (and every ``trace_every_n_steps``)
a Chrome trace of the last ``trace_steps`` steps of every rank is written (``trace.json`` in the
log directory; open it in Perfetto or chrome://tracing).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import lightning as L
import numpy as np
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_hetero.callbacks.summary import DeviceTotals, RunSummary, cpu_gain, settled_rates, summary_image, write_png
from lightning_hetero.devices import device_stats
from lightning_hetero.files import atomic_write
from lightning_hetero.record import StepRecord
from lightning_hetero.shares import batch_size_of
from lightning_hetero.strategy import hetero_strategy

if TYPE_CHECKING:
    from lightning_hetero.strategy import HeteroStrategy

__all__ = ["UtilizationMonitor", "device_fractions", "encoder_shares", "chrome_trace", "utilization_image"]

_COLORS = {"busy": (46, 160, 67), "comm": (31, 119, 180), "idle": (200, 200, 200)}


def device_fractions(records: Sequence[StepRecord]) -> dict[str, float]:
    """One rank's busy / comm / idle fractions of the wall time of ``records`` (they sum to 1),
    the parts of idle, and its samples per second (``DeviceTotals.shares``)."""
    return DeviceTotals.of(records).shares()


def encoder_shares(records: Sequence[StepRecord]) -> dict[str, float]:
    """One rank's share of the wall time of ``records`` spent on a multimodal model's placed encoders
    (``encoder_<modality>``: computing one for the other workers) and waiting for one placed elsewhere
    (``encoder_wait``); empty where there are none."""
    wall = sum(r.total for r in records)
    shares: dict[str, float] = {}
    for record in records:
        for kind, start, end in record.spans:
            if kind.startswith("encoder") and wall > 0:
                key = kind.replace(" ", "_")
                shares[key] = shares.get(key, 0.0) + (end - start) / wall
    return shares


def utilization_image(fractions: dict[str, dict[str, float]], width: int = 400, row: int = 24) -> np.ndarray:
    """One horizontal stacked bar per device (busy green, comm blue, idle grey), as an RGB array."""
    names = list(fractions)
    image = np.full((max(1, len(names)) * row, width, 3), 255, dtype=np.uint8)
    for i, name in enumerate(names):
        start = 0
        for kind in ("busy", "comm", "idle"):
            stop = min(width, start + round(fractions[name].get(kind, 0.0) * width))
            image[i * row + 2 : (i + 1) * row - 2, start:stop] = _COLORS[kind]
            start = stop
    return image


_TRACE_NAMES = {
    "compute": "compute",
    "stage": "compute",
    "pipeline": "send/recv (and bubbles)",
    "sync": "all-reduce",
    "optimizer": "optimizer step",
    "wait": "wait for the other workers",
    "data": "data and loop",
    "encoder wait": "wait for an encoder placed elsewhere",
}


def _flatten(spans: Sequence[tuple[str, float, float]], start: float, stop: float) -> list[tuple[str, float, float]]:
    """Disjoint segments covering ``[start, stop)``: each labelled by the innermost span over it
    ("idle" where none is)."""
    bounds = sorted({start, stop, *(t for _, a, b in spans for t in (a, b) if start <= t <= stop)})
    segments: list[tuple[str, float, float]] = []
    for a, b in zip(bounds, bounds[1:]):
        middle = (a + b) / 2
        covering = [(e - s, kind) for kind, s, e in spans if s <= middle < e]
        kind = min(covering)[1] if covering else "idle"
        if segments and segments[-1][0] == kind and segments[-1][2] == a:
            segments[-1] = (kind, segments[-1][1], b)
        else:
            segments.append((kind, a, b))
    return segments


def chrome_trace(
    records: Sequence[Sequence[StepRecord]],
    names: Optional[Sequence[str]] = None,
    offsets: Optional[Sequence[float]] = None,
) -> dict[str, Any]:
    """A Chrome trace (Perfetto, chrome://tracing) of the given steps: one track per rank, each
    step's time split into what the rank was doing. ``offsets[rank]`` turns that rank's
    ``perf_counter`` times into wall-clock times (so that tracks of several machines line up)."""
    events: list[dict[str, Any]] = []
    # Each rank's times in the first rank's perf_counter frame (the offsets' differences are small,
    # so no precision is lost to the wall clock's large numbers), counted from the first step shown.
    base = offsets[0] if offsets else 0.0
    shifts = [o - base for o in offsets] if offsets is not None else [0.0] * len(records)
    starts = [r.start + shift for rank_records, shift in zip(records, shifts) for r in rank_records]
    origin = min(starts, default=0.0)
    for index, rank_records in enumerate(records):
        if not rank_records:
            continue
        rank = rank_records[0].rank
        name = names[index] if names is not None else rank_records[0].role
        shift = shifts[index] - origin
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank} ({name})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        if any(record.side_spans for record in rank_records):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 1, "args": {"name": "bucket steps"}})
        for record in rank_records:
            if record.end <= record.start:
                continue
            spans = [(_TRACE_NAMES.get(kind, kind), a, b) for kind, a, b in record.spans]
            # The step's own timeline on thread 0; fine mode's bucket steps on their own, thread 1.
            timelines = ((0, _flatten(spans, record.start, record.end)), (1, record.side_spans))
            for tid, segments in timelines:
                for kind, a, b in segments:
                    event = {"name": kind, "cat": "step", "ph": "X", "ts": (a + shift) * 1e6, "dur": (b - a) * 1e6}
                    events.append({**event, "pid": rank, "tid": tid, "args": {"step": record.step}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"origin_unix_s": origin + base if offsets else None}}


class UtilizationMonitor(L.Callback):
    """Log what every CPU worker and stage did in each step (see the module doc for the keys).

    Args:
        every_n_steps: optimizer steps per logged window (default: the trainer's
            ``log_every_n_steps``; 0 there turns the logging off); the values are averages over
            the window.
        image_every_n_steps: steps between pictures for loggers that take images (0: none).
        trace_steps: the training batches of every rank the Chrome trace shows (the latest ones).
        trace_every_n_steps: also write the trace every this many steps (0: at the end of training only).
        save_dir: where ``trace.json`` and ``devices.png`` go (default: the trainer's log directory).
        summary: at the end of ``fit``, print what each device did and what the CPU bought, log it
            under ``hetero/*`` (docs/monitoring.md) and draw it (``devices.png``).
        compare_steps: where nothing else measures the step without the CPU (a fixed CPU fraction,
            no ``AdaptiveRebalancer``), run this many optimizer steps and 2 more (which settle) at
            fraction 0 early in the run, after as many at the run's fraction, to measure what the CPU
            buys, in runs of at least 3 x (``compare_steps`` + 2) optimizer steps (0: do not).
    """

    def __init__(
        self,
        every_n_steps: Optional[int] = None,
        image_every_n_steps: int = 500,
        trace_steps: int = 20,
        trace_every_n_steps: int = 0,
        save_dir: Optional[str] = None,
        summary: bool = True,
        compare_steps: int = 10,
    ) -> None:
        for name, value, minimum in (
            ("every_n_steps", 1 if every_n_steps is None else every_n_steps, 1),
            ("image_every_n_steps", image_every_n_steps, 0),
            ("trace_steps", trace_steps, 1),
            ("trace_every_n_steps", trace_every_n_steps, 0),
            ("compare_steps", compare_steps, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"`UtilizationMonitor({name}={value!r})` must be an integer of at least {minimum}.")
        self.every_n_steps = every_n_steps
        self.image_every_n_steps = image_every_n_steps
        self.trace_steps = trace_steps
        self.trace_every_n_steps = trace_every_n_steps
        self.save_dir = save_dir
        self.summarize = summary
        self.compare_steps = compare_steps
        self.summary: Optional[RunSummary] = None
        """What the devices did and what the CPU bought, once ``fit`` ended (global rank 0)."""
        self.image_path: Optional[Path] = None
        self._totals = DeviceTotals()
        self._seen: Optional[StepRecord] = None
        self._compare: Optional[tuple[int, int, float]] = None
        self._ended_inside_comparison = False
        self.last: dict[str, float] = {}
        """The metrics of the latest window (global rank 0)."""
        self._batches = 0
        self._last_step = -1
        self._last_image = 0
        self._enabled = True

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = hetero_strategy(trainer)
        self._enabled = strategy is not None
        if strategy is None:
            rank_zero_warn("UtilizationMonitor reports the devices of `strategy='hetero'`; this run does not use it.")
            return
        device_stats(strategy.root_device, meter="monitor")  # start the CPU-time meter
        self._batches, self._last_step, self._last_image, self.last = 0, trainer.global_step, trainer.global_step, {}
        self._totals, self._seen, self._compare = DeviceTotals(), None, self._comparison(trainer, strategy)
        self._ended_inside_comparison = False
        if trainer.is_global_zero:
            with _warn_on_error("log the layout"):
                for logger in trainer.loggers:  # the run's config
                    logger.log_hyperparams({"hetero_layout": strategy.layout()})

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        strategy = hetero_strategy(trainer)
        if strategy is None or not self._enabled:
            return
        self._batches += 1
        records = strategy.step_records
        if records and records[-1] is not self._seen:
            self._seen = records[-1]
            self._totals.add(records[-1], batch_size_of(args[1]) if len(args) > 1 else records[-1].samples)
        if trainer.global_step == self._last_step:
            return  # accumulating
        self._last_step = trainer.global_step
        self._follow_comparison(trainer, strategy)
        every = self.every_n_steps or trainer.log_every_n_steps
        if every and trainer.global_step % every == 0:
            self._log(trainer, strategy)
        if self.trace_every_n_steps and trainer.global_step % self.trace_every_n_steps == 0:
            self._write_trace(trainer, strategy)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = hetero_strategy(trainer)
        if strategy is not None and self._enabled:
            ended_inside = self._compare is not None and trainer.global_step > self._compare[0]
            if ended_inside:
                strategy.set_cpu_fraction(self._compare[2])  # the run ended inside the comparison
            self._ended_inside_comparison = ended_inside
            self._write_trace(trainer, strategy, summarize=self.summarize)

    # --------------------------------------------------------------- comparison

    def _comparison(self, trainer: L.Trainer, strategy: "HeteroStrategy") -> Optional[tuple[int, int, float]]:
        """The optimizer steps after which the CPU fraction goes to 0 and comes back, where the run
        needs its own measurement of the step without the CPU and has the steps for it."""
        from lightning_hetero.rebalancer import AdaptiveRebalancer

        if not self.summarize or not self.compare_steps or not strategy.topology.cpu_workers:
            return None
        if strategy.cpu_fraction <= 0 or any(isinstance(c, AdaptiveRebalancer) for c in trainer.callbacks):
            return None
        length = self.compare_steps + _SETTLE
        start = trainer.global_step + length
        if trainer.estimated_stepping_batches < start + 2 * length:
            return None  # too short a run to spend steps on it
        return start, start + length, strategy.cpu_fraction

    def _follow_comparison(self, trainer: L.Trainer, strategy: "HeteroStrategy") -> None:
        # Every rank runs this after the same optimizer step, so all change the fraction together.
        if self._compare is None:
            return
        start, stop, fraction = self._compare
        if trainer.global_step == start:
            strategy.set_cpu_fraction(0.0)
        elif trainer.global_step == stop:
            strategy.set_cpu_fraction(fraction)
            self._compare = None

    # ------------------------------------------------------------------ logging

    def _log(self, trainer: L.Trainer, strategy: "HeteroStrategy") -> None:
        count, self._batches = self._batches, 0
        records = strategy.step_records[-count:]
        # Each rank summarizes its own steps; only the numbers travel.
        samples = sum(r.samples for r in records)
        fractions = {**device_fractions(records), **encoder_shares(records)}
        mine = (fractions, device_stats(strategy.root_device, meter="monitor"), samples)
        gathered = strategy.gather(mine, dst=0)
        if trainer.is_global_zero:
            with _warn_on_error("log utilization"):
                self._log_on_rank_zero(trainer, strategy, records, gathered)

    def _log_on_rank_zero(
        self, trainer: L.Trainer, strategy: "HeteroStrategy", records: Sequence[StepRecord], gathered: list[Any]
    ) -> None:
        names = strategy.device_names
        fraction = sum(r.cpu_fraction for r in records) / len(records) if records else strategy.cpu_fraction
        metrics: dict[str, float] = {"util/cpu_fraction": fraction}
        fractions: dict[str, dict[str, float]] = {}
        for rank, (values, stats, _) in enumerate(gathered):
            fractions[names[rank]] = values
            for key, value in {**values, **stats}.items():
                metrics[f"util/{names[rank]}/{key}"] = value
        seconds = sum(r.total for r in records)
        if seconds > 0:  # each sample once: the CPU workers' and replicas' shares, and the first stage's
            topology = strategy.topology
            roles = [topology.role(rank % topology.procs_per_node) for rank in range(len(gathered))]
            counted = [samples for role, (_, _, samples) in zip(roles, gathered) if role.counts_own_samples]
            metrics["throughput/samples_per_s"] = sum(counted) / seconds
        self.last = metrics
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        if self.image_every_n_steps and trainer.global_step - self._last_image >= self.image_every_n_steps:
            self._last_image = trainer.global_step
            caption = "busy (green), comm (blue), idle (grey): " + ", ".join(fractions)
            self._log_image(trainer, utilization_image(fractions), "util/devices", caption)

    def _log_image(self, trainer: L.Trainer, image: np.ndarray, key: str, caption: str) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(key=key, images=[image], step=trainer.global_step, caption=[caption])
            elif isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image(key, image, trainer.global_step, dataformats="HWC")

    # -------------------------------------------------------------------- trace

    def _write_trace(self, trainer: L.Trainer, strategy: "HeteroStrategy", summarize: bool = False) -> None:
        mine = (strategy.step_records[-self.trace_steps :], time.time() - time.perf_counter())
        gathered = strategy.gather((*mine, self._totals if summarize else None), dst=0)
        directory = Path(self.save_dir or trainer.log_dir or trainer.default_root_dir)  # a collective: every rank
        if not trainer.is_global_zero:
            return
        records, offsets = [r for r, _, _ in gathered], [o for _, o, _ in gathered]
        with _warn_on_error("write the trace"):
            path = directory / "trace.json"
            trace = chrome_trace(records, strategy.device_names, offsets)
            with atomic_write(path, "w") as f:  # never a half-written trace
                f.write(json.dumps(trace))
            self.trace_path = path
        if summarize:
            with _warn_on_error("summarize the run"):
                self._summarize(trainer, strategy, [t for _, _, t in gathered], _aligned(records, offsets), directory)

    def _summarize(
        self,
        trainer: L.Trainer,
        strategy: "HeteroStrategy",
        totals: list[DeviceTotals],
        step: list[Optional[StepRecord]],
        directory: Path,
    ) -> None:
        topology, names = strategy.topology, strategy.device_names
        roles = [topology.role(rank % topology.procs_per_node) for rank in range(len(totals))]
        counted = sum(t.samples for role, t in zip(roles, totals) if role.counts_own_samples)
        devices = {
            name: {**t.shares(), "share": t.samples * topology.num_nodes / counted if counted else 0.0}
            for name, t in zip(names, totals)
        }
        # Every rank worked on every batch: a batch took as long as its slowest rank.
        walls = [max(batch) for batch in zip(*(t.walls for t in totals))]
        sizes = [size * topology.num_nodes for size in totals[0].sizes[-len(walls) :]] if walls else []
        fractions = totals[0].fractions[-len(walls) :] if walls else []
        self.summary = RunSummary(
            devices=devices,
            samples_per_s=sum(sizes) / sum(walls) if walls and sum(walls) > 0 else 0.0,
            # The last batch's (a decision after the last step changes no batch), but the run's own where
            # its last batches were the monitor's comparison without the CPU.
            fraction=fractions[-1] if fractions and not self._ended_inside_comparison else strategy.cpu_fraction,
            gain=cpu_gain(fractions, walls, sizes, settle=_SETTLE),
            settled_without=any(fraction == 0 for fraction, _ in settled_rates(fractions, walls, sizes, settle=_SETTLE)),
            cpu_workers=topology.cpu_workers,
            # Batches too small to split leave the CPU workers none at any fraction.
            cpu_shared=any(t.samples for role, t in zip(roles, totals) if role.is_cpu_worker),
        )
        rank_zero_info("hetero: what each device did in this run\n" + self.summary.table())
        image = summary_image(devices, step)
        self.image_path = write_png(image, directory / "devices.png")
        for logger in trainer.loggers:
            logger.log_metrics(self.summary.metrics(), step=trainer.global_step)
        self._log_image(trainer, image, "util/summary", "the run (left) and one step (right): busy green, comm blue, idle grey")


_SETTLE = 2
"""Steps after a change of the CPU fraction left out of the comparison (a CPU worker catching up)."""


def _aligned(records: Sequence[Sequence[StepRecord]], offsets: Sequence[float]) -> list[Optional[StepRecord]]:
    """Every rank's record of one representative step (the median one by its slowest rank's time,
    among the latest that every rank recorded), on the first rank's clock."""
    count = min((len(r) for r in records), default=0)
    if count == 0:
        return []
    walls = [max(r[i - count].total for r in records) for i in range(count)]
    index = sorted(range(count), key=walls.__getitem__)[count // 2] - count
    step = []
    for rank_records, offset in zip(records, offsets):
        shift = offset - offsets[0]
        record = rank_records[index]
        spans = [(kind, a + shift, b + shift) for kind, a, b in record.spans]
        step.append(replace(record, start=record.start + shift, end=record.end + shift, spans=spans))
    return step


@contextmanager
def _warn_on_error(what: str) -> Iterator[None]:
    """Rank 0's own reporting must not end the run (the other ranks would wait for it): warn instead."""
    try:
        yield
    except Exception as error:
        rank_zero_warn(f"UtilizationMonitor could not {what}: {error!r}")
