"""``AdaptiveRebalancer``: keep the CPU workers and the pipeline finishing every step together.

Every few steps, global rank 0 gathers every rank's step records (``record.py``), summarizes the
window (``summarize``): per sample, how long the CPU workers and the pipeline took for their
shares (waiting excluded), the gradient sum's cost and the step time. The ``Balancer`` turns that
into the next CPU fraction with a simple model of the step,

    T(f) = overhead + max(p_cpu * f * B, p_pipeline * (1 - f) * B) + (sync if f > 0),

evaluated on the fractions that keep the pipeline's micro-batches equal; the decision is
broadcast and every rank applies it from the next batch. Fraction 0 is always a candidate, and
the step time measured with the CPU idle (a *baseline* window, at the start and whenever in
doubt) guards the model: a CPU share that does not make the step faster is dropped, and probed
again later in case conditions changed.

The rebalancer belongs to the core, not to the optional callbacks: ``cpu_fraction="auto"`` (the
default) runs one (``earn_fraction``). ``lightning_hetero.callbacks`` exports it beside them.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal, Optional

import lightning as L
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_hetero.loading import LoadBalancer
from lightning_hetero.record import StepRecord
from lightning_hetero.shares import split_batch
from lightning_hetero.strategy import hetero_strategy
from lightning_hetero.topology import usable_cores

if TYPE_CHECKING:
    from lightning_hetero.strategy import HeteroStrategy

__all__ = ["AdaptiveRebalancer", "Balancer", "Decision", "Window", "summarize", "earn_fraction", "REASONS"]

State = Literal["baseline", "balance", "idle"]

REASONS = ("baseline", "probe", "balance", "hold", "cpu-would-slow", "cpu-did-not-help", "verify", "resume")
"""Why a decision was made; ``rebalancer/reason`` logs the index into this tuple:

- ``baseline``: measure the step with the CPU idle (at the start), to know what the CPU must beat;
- ``probe``: give the CPU a share again, to measure it (at the start, and after idling a while);
- ``balance``: move toward the fraction where the CPU workers and the pipeline finish together;
- ``hold``: the predicted gain of moving is within the dead band (or nothing new was measured);
- ``cpu-would-slow``: the model predicts the step is fastest without the CPU (its share's sync
  costs more than it saves, or it is that slow): fraction 0;
- ``cpu-did-not-help``: the step measured with the CPU is not faster than the baseline: fraction 0;
- ``verify``: the step got slower than the last baseline; measure the baseline again to tell a
  slower machine from a CPU share that no longer helps;
- ``resume``: the fraction restored from a checkpoint.
"""


@dataclass(frozen=True)
class Window:
    """What a window of steps at one CPU fraction measured: medians over its optimizer steps, per
    batch (with gradient accumulation, a step's times are shared out over its batches)."""

    fraction: float
    batch_size: int
    steps: int
    step_time: float
    """Wall time per batch: the slowest rank's, from one batch being ready to the next."""
    cpu_per_sample: Optional[float]
    """Seconds a CPU worker took per sample of its share (the slowest worker), or ``None`` with no share."""
    pipeline_per_sample: Optional[float]
    """Seconds the pipeline took per sample of its share (its slowest stage, bubbles included)."""
    sync: float
    """Seconds per batch spent summing gradients that no rank could hide."""
    overhead: float
    """The rest of the time per batch: the optimizer, loading the batch, the training loop."""
    data: float = 0.0
    """Seconds per batch the slowest rank spent between steps: waiting for its batch, and the
    training loop's own work."""


_SUMMED = ("samples", "share", "sync", "total", "data")


def summarize(records: Sequence[Sequence[StepRecord]], fraction: float) -> Optional[Window]:
    """Summarize the step records gathered from every rank (one list per rank) over the optimizer
    steps that every rank recorded at ``fraction``; ``None`` if there are none."""
    per_rank = []
    for rank_records in records:
        steps: dict[int, dict[str, float]] = {}
        for r in rank_records:
            if r.cpu_fraction != fraction:
                continue
            step = steps.setdefault(r.step, dict.fromkeys(_SUMMED, 0.0) | {"batches": 0.0, "role": r.role})
            for key in _SUMMED:
                step[key] += getattr(r, key)
            step["batches"] += 1
        per_rank.append(steps)
    common = set.intersection(*(set(steps) for steps in per_rank)) if per_rank else set()
    cpu, pipe, sync, totals, sizes, overhead, data = [], [], [], [], [], [], []
    for key in sorted(common):
        step = [steps[key] for steps in per_rank]
        batches = max(s["batches"] for s in step)
        cpus = [s for s in step if s["role"].startswith("cpu")]
        stages = [s for s in step if not s["role"].startswith("cpu")]
        nodes = max(1, sum(s["role"] in ("stage0", "replica0") for s in stages))  # one hetero group per node
        # The devices' share of a node's batch: every stage computes all of it; replicas a part each.
        replicas = [s["samples"] for s in stages if s["role"].startswith("replica")]
        pipeline = sum(replicas) / nodes if replicas else max((s["samples"] for s in stages), default=0.0)
        sizes.append(round((sum(s["samples"] for s in cpus) / nodes + pipeline) / batches))
        cpu_time = max((s["share"] for s in cpus), default=0.0)
        pipe_time = max((s["share"] for s in stages), default=0.0)
        if any(s["samples"] for s in cpus):
            cpu.append(max(s["share"] / s["samples"] for s in cpus if s["samples"]))
        if pipeline:
            pipe.append(pipe_time / pipeline)
        total, hidden = max(s["total"] for s in step), min(s["sync"] for s in step)
        totals.append(total / batches)
        data.append(max(s["data"] for s in step) / batches)
        sync.append(hidden / batches)
        overhead.append(max(0.0, total - max(cpu_time, pipe_time) - hidden) / batches)
    if not totals:
        return None
    return Window(
        fraction=fraction,
        batch_size=Counter(sizes).most_common(1)[0][0],
        steps=len(totals),
        step_time=statistics.median(totals),
        cpu_per_sample=statistics.median(cpu) if cpu else None,
        pipeline_per_sample=statistics.median(pipe) if pipe else None,
        sync=statistics.median(sync),
        overhead=statistics.median(overhead),
        data=statistics.median(data),
    )


@dataclass(frozen=True)
class Decision:
    """The fraction to run from the next batch on, and why."""

    fraction: float
    reason: str
    target: Optional[float] = None
    """The fraction where both sides would finish together (before the grid and the step bound)."""
    predicted_step_time: Optional[float] = None
    dataloader_workers: Optional[int] = None
    """DataLoader workers per rank from the next epoch (``balance_loading``)."""
    cpu_threads: Optional[int] = None
    """Torch threads per CPU worker from now on (``balance_loading``)."""
    loading: Optional[str] = None
    """Why the split between loading and compute is what it is (``loading.LoadBalancer``)."""


@dataclass
class Balancer:
    """Decides the next CPU fraction from measured windows (no I/O: unit-testable on its own).

    Args:
        micro_batches: the pipeline's micro-batch count; its share stays a multiple of it.
        cpu_workers: CPU workers per node; the CPU share is spread evenly over them.
        max_step: the most the fraction moves in one decision (except to 0, always allowed).
        deadband: move only when the model predicts a step at least this much (relative) faster;
            next to the balance point (within a grid step), at least 10% faster.
        margin: a probe must make the measured step at least this much faster than the baseline
            to stay; a settled share is dropped once the step is this much slower than it.
        probe_after: windows at fraction 0 before the CPU is tried again; doubled after every probe
            that did not help, up to ``max_probe_after``.
        smoothing: each window's per-sample times blend into the estimates as ``old + smoothing *
            (new - old)``; a window that differs by more than ``reset`` (relative) replaces them
            (conditions changed).
    """

    micro_batches: int
    cpu_workers: int = 1
    max_step: float = 0.25
    deadband: float = 0.02
    margin: float = 0.01
    probe_after: int = 10
    max_probe_after: int = 80
    smoothing: float = 0.3
    reset: float = 0.3
    # The state (saved in checkpoints; the settings above come from the callback's arguments).
    state: State = "baseline"
    fraction: float = 0.0
    baseline: Optional[float] = None
    """Step time measured at fraction 0 (smoothed over consecutive windows)."""
    baseline_age: int = 0
    """Windows since the baseline was measured."""
    last_good: Optional[float] = None
    """The last fraction that beat the baseline (or the one to verify, or to start from)."""
    last_good_time: Optional[float] = None
    """Its step time; ``None`` while a probe has not beaten the baseline yet."""
    cpu_per_sample: Optional[float] = None
    pipeline_per_sample: Optional[float] = None
    step_time: Optional[float] = None
    """The step time at ``measured_at`` (smoothed over windows at that fraction)."""
    measured_at: Optional[float] = None
    idle_windows: int = 0
    probe_interval: int = 0

    @property
    def probing(self) -> bool:
        """A CPU share is being tried that has not yet beaten the baseline."""
        return self.state == "balance" and self.last_good_time is None

    def start(self, fraction: float) -> Decision:
        """The first decision of a run: measure the baseline (fraction 0) before anything else."""
        self.probe_interval = self.probe_interval or self.probe_after
        self.last_good = fraction if fraction > 0 else None
        return self._go("baseline", 0.0, "baseline")

    def adopt(self, fraction: float) -> None:
        """Something else set the fraction: take it as a probe, measured against the baseline."""
        if fraction > 0:
            self.state, self.fraction, self.last_good, self.last_good_time = "balance", fraction, fraction, None
        else:
            self.state, self.fraction, self.idle_windows = "idle", 0.0, 0

    def decide(self, window: Window) -> Decision:
        """The next fraction, given what the window at the current fraction measured."""
        self.baseline_age += 1
        same = window.fraction == self.measured_at
        self.measured_at = window.fraction
        self.pipeline_per_sample = self._smooth(self.pipeline_per_sample, window.pipeline_per_sample)
        self.cpu_per_sample = self._smooth(self.cpu_per_sample, window.cpu_per_sample)
        self.step_time = self._smooth(self.step_time if same else None, window.step_time)
        if window.fraction == 0.0:
            self.baseline = self._smooth(self.baseline if self.baseline_age == 1 else None, window.step_time)
            self.baseline_age = 0
        if self.state == "baseline":
            return self._after_baseline(window)
        if self.state == "idle":
            self.idle_windows += 1
            if self.idle_windows < self.probe_interval:
                return Decision(0.0, "hold")
            return self._probe(window)
        return self._balance(window)

    # ---------------------------------------------------------------- states

    def _after_baseline(self, window: Window) -> Decision:
        if self.last_good is None:
            return self._probe(window)
        if self.last_good_time is None:  # the start: try the fraction the run began with
            return self._go("balance", self._on_grid(self.last_good, window.batch_size), "probe")
        assert self.baseline is not None
        if self.last_good_time < self.baseline * (1 - self.margin):
            return self._go("balance", self.last_good, "balance")
        return self._idle("cpu-did-not-help", failed_probe=False)

    def _probe(self, window: Window) -> Decision:
        """Give the CPU a share again: where the last estimates say both sides finish together, or
        the smallest share when the CPU was never measured."""
        target = self._target()
        grid = self._grid(window.batch_size)
        fraction = self._on_grid(target, window.batch_size) if target is not None else grid[1]
        self.last_good, self.last_good_time = fraction, None
        return self._go("balance", fraction, "probe")

    def _balance(self, window: Window) -> Decision:
        if window.pipeline_per_sample is None and window.fraction > 0:
            # Everything on the CPU: now and then, give the pipeline a share again to measure it.
            self.idle_windows += 1
            if self.idle_windows >= self.probe_interval:
                self.idle_windows = 0
                return self._go("balance", self._grid(window.batch_size)[-2], "probe")
        probing = self.last_good_time is None
        assert self.step_time is not None
        # A probe must beat the baseline by the margin; a settled share is dropped only once the
        # step is measurably slower than the baseline (noise alone does not make it jump).
        bar = self.baseline * (1 - self.margin if probing else 1 + self.margin) if self.baseline else None
        slower = bar is not None and self.step_time >= bar
        move: Optional[float] = None
        now = None
        if self.cpu_per_sample is not None and self.pipeline_per_sample is not None:
            grid = self._grid(window.batch_size)
            predict = lambda f: self._predict(window, f)  # noqa: E731
            best = min(grid, key=predict)
            if best == 0.0:
                return self._idle("cpu-would-slow", probing, predict(0.0))
            reachable = [f for f in grid if f > 0 and abs(f - window.fraction) <= self.max_step + 1e-9]
            step = min(reachable, key=predict)
            now = predict(window.fraction)
            # Hysteresis: a move must win `deadband` of the step; and where the balance point lies
            # within a grid step of the current fraction (two near-equal neighbours, which noise
            # would flip between), 10%.
            gain, target = now - predict(step), self._target()
            inside = target is not None and abs(target - window.fraction) <= self.micro_batches / window.batch_size
            enough = gain > self.deadband * now and (not inside or gain > 0.1 * now)
            if step != window.fraction and enough:
                move = step
            if slower and predict(best) >= predict(0.0) * (1 - self.margin):
                # Not even the best fraction would beat the idle CPU. (Predicted against predicted:
                # the window's own overhead counts on both sides, whatever noise it caught.)
                move = None
        if slower and move is None:
            if probing or self.baseline_age <= 1:
                return self._idle("cpu-did-not-help", probing)
            # Slower than a baseline measured a while ago: the CPU, or the whole machine, got slower?
            self.last_good, self.last_good_time = window.fraction, self.step_time
            return self._go("baseline", 0.0, "verify")
        if not slower:
            self.last_good, self.last_good_time = window.fraction, self.step_time
            self.probe_interval = self.probe_after
        if move is not None:
            return self._go("balance", move, "balance", self._predict(window, move))
        return Decision(window.fraction, "hold", self._target(), now)

    # --------------------------------------------------------------- helpers

    def _smooth(self, old: Optional[float], new: Optional[float]) -> Optional[float]:
        if new is None:
            return old
        if not old or abs(new / old - 1) > self.reset:
            return new
        return old + self.smoothing * (new - old)

    def _predict(self, window: Window, fraction: float) -> float:
        """The time per batch the estimates predict at ``fraction``."""
        assert self.cpu_per_sample is not None and self.pipeline_per_sample is not None
        batch = window.batch_size
        pipeline = self._pipeline_samples(fraction, batch)
        cpu_time = self.cpu_per_sample * math.ceil((batch - pipeline) / self.cpu_workers)
        pipe_time = self.pipeline_per_sample * pipeline
        return window.overhead + max(cpu_time, pipe_time) + (window.sync if pipeline < batch else 0.0)

    def _target(self) -> Optional[float]:
        """The fraction where both sides would finish together (off the grid)."""
        if self.cpu_per_sample is None or self.pipeline_per_sample is None:
            return None
        cpu = self.cpu_per_sample / self.cpu_workers
        return self.pipeline_per_sample / (cpu + self.pipeline_per_sample)

    def _pipeline_samples(self, fraction: float, batch: int) -> int:
        return split_batch(batch, fraction, self.cpu_workers, self.micro_batches).pipeline_size

    def _grid(self, batch: int) -> list[float]:
        """0, then the fractions that keep the pipeline's micro-batches equal, up to 1 (ascending)."""
        groups = batch // self.micro_batches
        return [0.0] + [1.0 - k * self.micro_batches / batch for k in range(groups, -1, -1) if k * self.micro_batches < batch]

    def _on_grid(self, fraction: float, batch: int) -> float:
        return min(self._grid(batch)[1:], key=lambda f: abs(f - fraction))

    def _go(self, state: State, fraction: float, reason: str, predicted: Optional[float] = None) -> Decision:
        self.state, self.fraction = state, fraction
        return Decision(fraction, reason, self._target(), predicted)

    def _idle(self, reason: str, failed_probe: bool = False, predicted: Optional[float] = None) -> Decision:
        if failed_probe:
            self.probe_interval = min(self.max_probe_after, 2 * self.probe_interval)
        self.idle_windows = 0
        return self._go("idle", 0.0, reason, predicted)

    def state_dict(self) -> dict[str, Any]:
        """The decision state (not the settings)."""
        return {key: getattr(self, key) for key in _state_fields()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in _state_fields():
            if key in state:
                setattr(self, key, state[key])


def _state_fields() -> list[str]:
    """The ``Balancer`` fields from ``state`` on: its decision state (those before are settings)."""
    names = [f.name for f in fields(Balancer)]
    return names[names.index("state") :]


@dataclass
class _Pending:
    """Batches measured since the last decision."""

    batches: int = 0
    steps: int = 0
    changed: bool = True


class AdaptiveRebalancer(L.Callback):
    """Move the CPU fraction, while training, to where the CPU workers and the pipeline finish
    each step together, and to 0 when the CPU's share would not make the step faster; and the
    cores between loading and compute as the wait for data changes (``balance_loading``; in a run
    without CPU workers, only that).

    Every ``every_n_steps`` optimizer steps, global rank 0 gathers every rank's step records,
    decides (see ``Balancer``) and broadcasts the fraction; every rank applies it from the next
    batch. The first ``warmup_steps`` after a change are not measured. A run starts with one
    window at fraction 0 (the baseline the CPU's share must beat), then the fraction the
    strategy (or the workload analyzer's plan) began with. Every decision is logged under
    ``rebalancer/*`` (fraction, the measured seconds per sample of each side, the step time,
    the baseline, and the reason as an index into ``REASONS``) and kept in ``decisions``; the
    state is saved in checkpoints and restored on resume.

    Args:
        every_n_steps: optimizer steps per decision.
        warmup_steps: steps after a change of fraction left out of the measurement.
        max_step: the most the fraction moves in one decision (a move to 0 is never bounded).
        deadband: move only when the model predicts a step at least this much (relative) faster;
            next to the balance point (within a grid step of it), at least 10% faster.
        margin: how much faster than the baseline the step must be for the CPU to keep a share.
        probe_after: decisions at fraction 0 before the CPU is tried again (doubling, up to 8x,
            while tries keep failing).
        balance_loading: also split the cores between loading and compute as the wait for data
            changes (``loading.LoadBalancer``): more DataLoader workers per rank (from the next epoch;
            only DataLoaders the strategy's ``dataloader_workers`` lets the run tune) and fewer
            CPU-worker threads while the step waits for its batches, and back once it no longer does.
        max_dataloader_workers: the most DataLoader workers per rank it gives (``None``: one per core).
        loading_jitter_s: a wait for data shorter than this (seconds per batch, above the training loop's
            own work) is the loop's jitter, never a stall, and a move of the cores that made the step
            slower by less than this is not undone; raise it on a machine whose steps vary more.
        verbose: print every decision that changes the fraction or the split.
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        warmup_steps: int = 2,
        max_step: float = 0.25,
        deadband: float = 0.02,
        margin: float = 0.01,
        probe_after: int = 10,
        balance_loading: bool = True,
        max_dataloader_workers: Optional[int] = None,
        loading_jitter_s: float = 0.005,
        verbose: bool = True,
    ) -> None:
        if every_n_steps < 1 or not 0 <= warmup_steps < every_n_steps:
            raise ValueError(
                f"`every_n_steps={every_n_steps}` must be at least 1 and `warmup_steps={warmup_steps}` between 0"
                " and every_n_steps - 1, so every decision measures at least one step."
            )
        if not 0 < max_step <= 1 or not 0 <= deadband < 1 or not 0 <= margin < 1 or probe_after < 1:
            raise ValueError(
                "`max_step` must be in (0, 1], `deadband` and `margin` in [0, 1), and `probe_after` at least 1."
            )
        self.every_n_steps = every_n_steps
        self.warmup_steps = warmup_steps
        self.verbose = verbose
        self.balance_loading = balance_loading
        self.max_dataloader_workers = max_dataloader_workers
        if not loading_jitter_s >= 0:
            raise ValueError(f"`loading_jitter_s={loading_jitter_s}` must be a number of seconds, 0 or more.")
        self.loading_jitter_s = float(loading_jitter_s)
        self.loading: Optional[LoadBalancer] = None
        self._workers_in_effect = True
        self._moves_fraction = True
        self._settings = dict(
            max_step=max_step, deadband=deadband, margin=margin, probe_after=probe_after, max_probe_after=8 * probe_after
        )
        self.balancer: Optional[Balancer] = None
        self.decisions: list[dict[str, Any]] = []
        self._pending = _Pending()
        self._last_step = -1
        self._restored: Optional[dict[str, Any]] = None
        self._enabled = True

    # ------------------------------------------------------------ callback hooks

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = hetero_strategy(trainer)
        self._moves_fraction = strategy is not None and strategy.topology.cpu_workers > 0
        loading_only = strategy is not None and self.balance_loading and bool(strategy.tuned_loaders)
        self._enabled = self._moves_fraction or loading_only
        if strategy is None or not self._enabled:
            rank_zero_warn(
                "AdaptiveRebalancer does nothing here: it balances the CPU workers of `strategy='hetero'` against the"
                " pipeline, and the cores between them and loading, and this run has no CPU worker and no DataLoader"
                " whose workers it may change (`dataloader_workers`)."
            )
            return
        self.balancer = Balancer(strategy.micro_batches, strategy.topology.cpu_workers, **self._settings)
        self.loading = _load_balancer(strategy, self.max_dataloader_workers, self.loading_jitter_s) if self.balance_loading else None
        self._pending, self._last_step = _Pending(), trainer.global_step
        restored, self._restored = self._restored, None
        # A checkpoint's balancer resumes where it ran with CPU workers and this run has them too: a run
        # without them saved one that never started (no share to move), and this one may have none.
        resumes = restored is not None and self._moves_fraction and restored["balancer"].get("probe_interval", 0) > 0
        if restored is not None:
            if resumes:
                self.balancer.load_state_dict(restored["balancer"])
            if self.loading is not None and restored.get("loading"):
                self.loading.load_state_dict(restored["loading"])
            self.decisions = list(restored["decisions"])
        if resumes:
            decision = Decision(self.balancer.fraction, "resume")
        elif self._moves_fraction:
            decision = self.balancer.start(strategy.cpu_fraction)
        else:  # no CPU workers: only the cores between loading and the stages move
            decision = Decision(strategy.cpu_fraction, "hold")
        if restored is not None and self.loading is not None:
            split = {"dataloader_workers": self.loading.workers, "cpu_threads": self.loading.threads}
            decision = replace(decision, **split, loading="resume")
        if trainer.is_global_zero:
            self._log_decision(trainer, decision, None)
        # Rank 0's word, whatever each rank restored.
        self._apply(trainer, strategy, strategy.broadcast((decision, *self._states()), src=0))

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Resuming: the split of the cores the checkpoint holds, before the first epoch's iterator
        # starts its loader workers (Lightning sets the training data up after this hook).
        strategy = hetero_strategy(trainer)
        restored = (self._restored or {}).get("loading")
        if strategy is None or not self.balance_loading or not restored:
            return
        strategy.set_dataloader_workers(restored["workers"])
        strategy.set_cpu_threads(restored["threads"])

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        strategy = hetero_strategy(trainer)
        if strategy is None or not self._enabled or self.balancer is None:
            return
        self._pending.batches += 1
        if trainer.global_step == self._last_step:
            return  # accumulating: decide after optimizer steps only
        self._last_step = trainer.global_step
        self._pending.steps += 1
        if strategy.cpu_fraction != self.balancer.fraction:  # set by someone else, on every rank alike
            rank_zero_warn(
                f"AdaptiveRebalancer: the CPU fraction was set to {strategy.cpu_fraction} from outside; measuring it"
                " against the baseline from here."
            )
            self.balancer.adopt(strategy.cpu_fraction)
            self._pending = _Pending()
            return
        # A probe is measured over a short window: it may be much slower than the baseline.
        needed = min(self.every_n_steps, self.warmup_steps + 2) if self.balancer.probing else self.every_n_steps
        if self._pending.steps < needed:
            return
        per_step = max(1, self._pending.batches // self._pending.steps)
        skip = self.warmup_steps * per_step if self._pending.changed else 0
        records = strategy.gather_step_records(self._pending.batches - skip, dst=0)
        outcome: Any = None
        failure: Optional[Exception] = None
        if trainer.is_global_zero:
            try:
                window = summarize(records, self.balancer.fraction)
                moves = window is not None and self._moves_fraction
                decision = self.balancer.decide(window) if moves else Decision(self.balancer.fraction, "hold")
                if self.loading is not None and window is not None:
                    self._adopt_split(strategy)
                    workers, threads, why = self.loading.decide(window.step_time, window.data, self._workers_in_effect)
                    decision = replace(decision, dataloader_workers=workers, cpu_threads=threads, loading=why)
                self._log_decision(trainer, decision, window)
                outcome = (decision, *self._states())
            except Exception as error:  # every rank must hear of it, or they wait in the broadcast
                failure = error
                outcome = RuntimeError(f"AdaptiveRebalancer failed on global rank 0: {error!r}")
        outcome = strategy.broadcast(outcome, src=0)
        if isinstance(outcome, Exception):
            raise failure or outcome
        self._apply(trainer, strategy, outcome)

    def _adopt_split(self, strategy: "HeteroStrategy") -> None:
        """Take a split of the cores made elsewhere (the workload analyzer's, after its warm-up) as
        the one to start from, once it is in effect and no move of the balancer's waits."""
        assert self.loading is not None
        loaders = strategy.tuned_loaders
        workers = loaders[0].num_workers if loaders else self.loading.workers
        threads = strategy.cpu_worker_threads
        if self._workers_in_effect and self.loading.last_move is None and (workers, threads) != (
            self.loading.workers,
            self.loading.threads,
        ):
            self.loading.adopt(workers, threads)

    def _states(self) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
        assert self.balancer is not None
        return self.balancer.state_dict(), self.loading.state_dict() if self.loading is not None else None

    def _apply(self, trainer: L.Trainer, strategy: "HeteroStrategy", broadcast: tuple[Any, ...]) -> None:
        """Take rank 0's decision and its balancers' state, and run with the decided fraction and
        threads (a new number of loader workers waits for the next epoch: ``on_train_epoch_start``)."""
        decision, state, loading = broadcast
        assert self.balancer is not None
        self.balancer.load_state_dict(state)
        if self.loading is not None and loading is not None:
            self.loading.load_state_dict(loading)
        changed = decision.fraction != strategy.cpu_fraction
        strategy.set_cpu_fraction(decision.fraction)
        moved = decision.loading in ("stall", "recovered", "undo", "resume")
        threads = moved and decision.cpu_threads != strategy.cpu_worker_threads
        loaders = strategy.tuned_loaders
        workers = moved and bool(loaders) and decision.dataloader_workers != loaders[0].num_workers
        if threads:
            strategy.set_cpu_threads(decision.cpu_threads)
        if workers:
            self._workers_in_effect = False  # from the next epoch (`on_train_epoch_start`)
        self._pending = _Pending(changed=changed or threads or decision.reason in ("resume", "baseline"))
        if changed and self.verbose:
            rank_zero_info(
                f"AdaptiveRebalancer: step {trainer.global_step}: CPU fraction -> {decision.fraction:.4f}"
                f" ({decision.reason})"
            )
        if (threads or workers) and self.verbose:
            rank_zero_info(
                f"AdaptiveRebalancer: step {trainer.global_step}: {decision.dataloader_workers} DataLoader worker(s)"
                f" per rank (from the next epoch), {decision.cpu_threads} thread(s) per CPU worker ({decision.loading})"
            )

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Before the epoch's iterator starts: a new number of loader workers takes effect here.
        strategy = hetero_strategy(trainer)
        if strategy is None or self.loading is None or self._workers_in_effect:
            return
        strategy.set_dataloader_workers(self.loading.workers)
        self._workers_in_effect = True
        self._pending = _Pending()  # the next decision measures the new split only

    def _log_decision(self, trainer: L.Trainer, decision: Decision, window: Optional[Window]) -> None:
        assert self.balancer is not None
        entry: dict[str, Any] = {"step": trainer.global_step, "fraction": decision.fraction, "reason": decision.reason}
        if decision.loading is not None:
            entry["loading"] = decision.loading
        metrics = {"rebalancer/cpu_fraction": decision.fraction, "rebalancer/reason": REASONS.index(decision.reason)}
        values = {
            "target": decision.target,
            "predicted_step_s": decision.predicted_step_time,
            "step_s": window.step_time if window is not None else None,
            "baseline_step_s": self.balancer.baseline,
            "cpu_s_per_sample": window.cpu_per_sample if window is not None else None,
            "pipeline_s_per_sample": window.pipeline_per_sample if window is not None else None,
            "sync_s": window.sync if window is not None else None,
            "data_s": window.data if window is not None else None,
            "dataloader_workers": decision.dataloader_workers,
            "cpu_threads": decision.cpu_threads,
        }
        for key, value in values.items():
            if value is not None:
                metrics[f"rebalancer/{key}"] = value
                entry[key] = value
        self.decisions.append(entry)
        del self.decisions[:-1000]
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    # ------------------------------------------------------------- checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.balancer is None:
            return {}
        loading = self.loading.state_dict() if self.loading is not None else None
        return {"balancer": self.balancer.state_dict(), "loading": loading, "decisions": list(self.decisions)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict) if state_dict else None



def _load_balancer(strategy: "HeteroStrategy", most: Optional[int], jitter_s: float = 0.005) -> LoadBalancer:
    """The split between loading and compute the run starts from: its tuned DataLoaders' workers (or
    0 where it tunes none), and its CPU workers' threads; at most ``most`` workers per rank (``None``:
    one per core)."""
    loaders = strategy.tuned_loaders
    workers = loaders[0].num_workers if loaders else 0
    most = usable_cores() if most is None else most
    return LoadBalancer(workers, strategy.cpu_worker_threads, max(workers, most), movable_workers=bool(loaders), least=jitter_s)


def earn_fraction(trainer: L.Trainer) -> None:
    """``cpu_fraction="auto"``: the CPU takes the share it earns in training, measured from the
    first steps: an ``AdaptiveRebalancer`` with its defaults, before the checkpoint callbacks so
    they save its latest decision, unless the run has a rebalancer of its own."""
    callbacks = trainer.callbacks
    if any(isinstance(callback, AdaptiveRebalancer) for callback in callbacks):
        return
    at = next((i for i, callback in enumerate(callbacks) if isinstance(callback, Checkpoint)), len(callbacks))
    callbacks.insert(at, AdaptiveRebalancer(verbose=False))
    rank_zero_info("hetero: `cpu_fraction='auto'`: an AdaptiveRebalancer gives the CPU the share it earns.")
