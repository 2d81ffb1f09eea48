"""The step engine: one training step and one evaluation step of a hetero run, start to end.

[Note: one training step]
Lightning runs an optimizer step through three of the strategy's hooks; the engine does the work
of each, in this order:

1. ``training_step``: the batch is split into shares (``shares.py``); this rank's worker computes
   its share, forward and backward (``workers.py``), while fine mode sums and steps each bucket as
   the backward frees it (``sync.py``); every rank's report is exchanged and its logged values are
   logged on every rank (``results.py``); the non-finite policy judges what every rank found
   (``finite.py``). The share's gradients are set aside: Lightning zeroes ``.grad`` next.
2. ``backward``: the gradients are put back and, at the last batch of an optimizer step, summed
   over the workers (coarse mode).
3. ``optimizer_step``: Lightning clips (``HeteroPrecision`` asks the sync, which knows the global
   norm) and steps; where the step is skipped, every rank steps nothing. Where the CPU workers split
   their optimizer (coarse mode, ``sharding.py``), each steps its own parameters and then shares them
   (``GradSync.after_update``).

Where gradients accumulate, an optimizer step spans several batches (its *window*); only the last
one sums and steps. What the engine knows of the step in progress is one ``StepState``, new at the
first batch of each window. Every decision in it is taken alike on every rank, from what every
rank knows: the batch, the CPU fraction, and the exchanged reports.
"""

from __future__ import annotations

import functools
import logging
import operator
import time
import warnings
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities.core.apply_func import apply_to_collection
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_hetero.data import loader_batch_size
from lightning_hetero.devices import device_stats
from lightning_hetero.finite import NonfinitePolicy, describe_nonfinite, finite_flag, nonfinite_error, nonfinite_parts
from lightning_hetero.module import buffer_versions, parameter_versions
from lightning_hetero.record import Recorder, StepClock, span
from lightning_hetero.results import LoggedValue, WorkerReport, combine_logs, combine_loss, merge_outputs
from lightning_hetero.shares import Shares
from lightning_hetero.signals import StepSignals
from lightning_hetero.sync import Clipping, GradSync
from lightning_hetero.topology import gather_object_to
from lightning_hetero.workers import GradPolicy, Placement, Worker, check_same_loss

__all__ = ["StepEngine", "StepState"]

log = logging.getLogger(__name__)


@dataclass
class StepState:
    """The optimizer step in progress: its window of batches, and the batch being computed."""

    cpu_share: bool = False
    """A batch of this window gave the CPU workers a share."""
    nonfinite: bool = False
    """A batch of this window saw NaN or Inf on some rank."""
    syncs: bool = True
    """This batch ends the window: its gradients are summed and the optimizer steps after it."""
    detached: bool = False
    """The CPU workers had no share of this window, and keep out of its sum and step."""
    skip: bool = False
    """This window's optimizer step is skipped on every rank (``nonfinite="skip"``)."""
    samples: int = 0
    """Samples of this batch this rank's step record counts."""
    fraction: float = 0.0
    """The CPU fraction this batch ran with."""
    step: int = 0
    """The trainer's global step this batch belongs to."""
    zeroes: bool = False
    """This batch starts the window, and the module's own ``optimizer_zero_grad`` is to zero its gradients."""
    clock: Optional[StepClock] = field(default=None, repr=False)
    """This batch's timings, from ``on_train_batch_start`` to its end."""


class StepEngine:
    """Runs this rank's part of every training and evaluation step (see the module's note).

    Args:
        worker: this rank's role (``workers.py``).
        exchange: every rank's report from this rank's (a collective; ``ReportExchange``; one way
            where the CPU workers have no share of the batch).
        log: logs combined values through Lightning on this rank (``results.relog``).
        names: each global rank's device name, for messages.
        cpu_workers: CPU workers per node.
        nonfinite: the non-finite policy.
        device: this rank's device.
        recorder: this rank's step records (``record.py``).
        outputs: where predictions are assembled: this node's group and the global rank of its
            first process.
    """

    def __init__(
        self,
        *,
        worker: Worker,
        exchange: Callable[[WorkerReport, bool], list[WorkerReport]],
        log: Callable[[list[LoggedValue]], None],
        names: list[str],
        cpu_workers: int,
        nonfinite: NonfinitePolicy,
        device: torch.device,
        recorder: Optional[Recorder] = None,
        outputs: tuple[Optional[dist.ProcessGroup], int] = (None, 0),
    ) -> None:
        self.worker = worker
        self._sync = self.state_sync = GradSync()
        self.state = StepState()
        self.stale = False
        """The CPU workers kept out of optimizer steps since they last computed, so their replicas
        are behind the stages' (on every rank alike); ``refresh_replicas`` brings them up to date."""
        self.skipped_steps = 0
        self.report_device_stats = False
        self._buffers_checked = False
        self._last_share: Optional[tuple[int, int]] = None  # the last training batch's size, and this rank's samples of it
        self.latest_device_stats: dict[str, dict[str, float]] = {}
        self.signals: Optional[StepSignals] = None
        """The trainer's signal handling, where several processes run (``signals.py``)."""
        self._exchange = exchange
        self._log = log
        self._names = names
        self._cpu_workers = cpu_workers
        self._policy = nonfinite
        self._device = device
        self.recorder = recorder
        self._outputs = outputs

    @property
    def sync(self) -> GradSync:
        """How gradients are summed and stepped; the strategy sets the run's when it fits."""
        return self._sync

    @sync.setter
    def sync(self, sync: GradSync) -> None:
        self._sync = self.state_sync = sync

    state_sync: GradSync
    """The sync of the latest fit, closed or not: its offloaded and split buckets hold optimizer state
    that a checkpoint written after the fit (``trainer.save_checkpoint``) still needs."""

    def close(self) -> None:
        """The end of a fit, validation, test or prediction in this process: the sync's threads and
        hooks go (its optimizer state stays readable, ``state_sync``)."""
        self._sync.close()
        self._sync = GradSync()

    def pace(self, speeds: Mapping[str, float]) -> None:
        """TESTING ONLY: emulate a worker of ``speeds[worker.speed_key]`` samples per second (none: real speed)."""
        speed = speeds.get(self.worker.speed_key)
        self.worker.pace = 1.0 / speed if speed else 0.0

    @property
    def replica_is_current(self) -> bool:
        """False on a CPU worker that kept out of optimizer steps since it last computed."""
        return not (self.stale and self.worker.keeps_out(detached=True))

    # ------------------------------------------------------------ training

    def on_batch_start(self) -> None:
        """A training batch is ready: start its step record."""
        if self.recorder is not None:
            self.state.clock = self.recorder.begin()

    @contextmanager
    def accumulating(self) -> Generator[None, None, None]:
        """The batches run inside only accumulate gradients; the window's last one syncs."""
        self.state.syncs = False
        try:
            yield
        finally:
            self.state.syncs = True

    def training_step(self, trainer: Any, batch: Any, batch_idx: int, shares: Shares, fraction: float) -> Any:
        """Step 1: this rank's share, forward and backward; every rank's results; the verdict on
        non-finite values. Returns what Lightning's ``training_step`` returns: the whole batch's loss
        (and the step method's other outputs, where this rank ran it)."""
        accumulate = trainer.accumulate_grad_batches
        first = batch_idx % accumulate == 0
        if first:
            self.state = StepState(clock=self.state.clock, syncs=self.state.syncs)
        state, worker = self.state, self.worker
        # A CPU worker that hosts an encoder, or steps a share of the offloaded buckets for everyone
        # (`sharding.py`), takes part in every step, whatever its share of the batch.
        cpu_share = shares.pipeline_size < shares.batch_size or worker.encoders_on_cpu or self.sync.needs_cpu_workers
        if cpu_share:
            self.refresh_replicas(_first_optimizer(trainer))
        state.cpu_share |= cpu_share
        state.skip, state.fraction, state.step = False, fraction, trainer.global_step
        state.detached = self._cpu_workers > 0 and state.syncs and not state.cpu_share
        buffers = buffer_versions(worker.module) if not self._buffers_checked else None
        params = parameter_versions(worker.module) if buffers is not None else None
        after: dict[str, tuple[int, int]] = {}
        if params is not None and self.sync.overlaps and state.syncs:
            # Fine mode steps its buckets during the backward, which writes the parameters in place:
            # the step's own writes are those made before its first gradient (the forward's).
            self.sync.on_first_gradient = lambda: after.update(parameter_versions(worker.module))
        consumes = state.syncs and self.sync.begin(
            worker.arrivals(shares, batch), _clipping(trainer), state.detached, not worker.keeps_out(state.detached)
        )
        own_zero_grad = is_overridden("optimizer_zero_grad", trainer.lightning_module)
        zero_grad, state.zeroes = first and not own_zero_grad, first and own_zero_grad
        grads: GradPolicy = "accumulate" if consumes else "drop" if zero_grad else "keep"
        mine = worker.share_range(shares)
        try:
            worker.saw_batch("training_step", shares.batch_size, 0, loader_batch_size(trainer, "training_step"))
            report, output = worker.train_step(batch, batch_idx, shares, accumulate, grads, state.clock)
            # The one wait for the device in a step: the loss, the logged values and whether the
            # gradients are finite, read on the host together.
            fresh = [g for g in worker.fresh_grads or () if g is not None]
            finite = report.to_host(*([finite_flag(fresh)] if fresh else []))
            check_same_loss(type(worker.module).__name__, report)
        except BaseException as error:
            self.sync.abort()
            self._note_moved_share(error, shares.batch_size, mine[1] - mine[0])
            raise
        self._last_share = (shares.batch_size, mine[1] - mine[0])
        if buffers is not None:
            self._buffers_checked = True
            _warn_of_changed_buffers(worker.module, buffers)
        if params is not None:
            # Without a gradient here (or with the sums left to another rank), no bucket has stepped yet.
            _warn_of_changed_parameters(worker.module, params, after or None)
        extras = {k: v for k, v in output.items() if k != "loss"} if isinstance(output, Mapping) else {}
        if extras and _gives_extras(shares, worker.placement, mine):
            report.extras = apply_to_collection(extras, Tensor, lambda t: t.detach().cpu())
        report.nonfinite = nonfinite_parts(report.loss, bool(finite[0]) if finite else None)
        skipped = False
        if state.syncs:
            grads_finite, skipped = self.sync.after_backward(not (report.nonfinite or state.nonfinite), state.clock)
            if not grads_finite and "gradients" not in report.nonfinite:
                report.nonfinite += ("gradients",)
        with span(state.clock, "wait"):
            # One way where the CPU workers computed nothing in this window: then nothing of theirs
            # (not even fine mode's check of a window's accumulated gradients) can be in a report.
            reports = self._share(report, one_way=not state.cpu_share)
        self._judge(reports, trainer, batch_idx, skipped)
        if state.syncs and state.detached and not state.skip:
            self.stale = True  # the stages step without the CPU workers
        state.samples = worker.recorded_samples(shares, report)
        value, dtype = combine_loss(reports) or (float("nan"), None)
        loss = torch.tensor(value, dtype=dtype, device=self._device)
        if not report.samples and worker.runs_step_methods:
            # No share of this batch: the outputs of the first worker that had one.
            extras = next((move_data_to_device(r.extras, self._device) for r in reports if r.extras), {})
        return {"loss": loss, **extras} if extras else loss

    def _note_moved_share(self, error: BaseException, batch_size: int, samples: int) -> None:
        """Where a step failed on a batch of the last one's size but another share of it for this rank
        (``samples``: the CPU's share moved), say what that breaks: state a model keeps per sample between batches."""
        if not isinstance(error, Exception) or self._last_share is None or self._last_share[0] != batch_size:
            return
        if self._last_share[1] != samples:
            error.add_note(
                f"[hetero] This rank's share of the batch changed at this step, from {self._last_share[1]} to"
                f" {samples} of {batch_size} samples (the CPU workers' share moved). If the model keeps"
                " state per sample from one batch to the next (a recurrent hidden state carried over), give it a"
                " fixed `cpu_fraction` (docs/limits.md)."
            )

    def backward(self, optimizer: Optional[Optimizer] = None) -> None:
        """Step 2 (Lightning has zeroed ``.grad`` where the window starts): put the share's gradients
        back, and at the window's last batch sum them over the workers."""
        if self.state.zeroes and optimizer is not None:
            _check_zeroed(optimizer, self.worker.params, self.state.step)
        self.worker.put_back_grads()
        if self.state.syncs and not self.state.skip:
            self.sync.finish(self.state.clock)

    def finish_backward(self) -> None:
        """After Lightning's backward hooks: a batch that only accumulates ends its record here
        (no optimizer step follows it)."""
        if not self.state.syncs:
            self._end_record()

    def optimizer_step(self, closure: Callable[[], Any], step: Callable[[Callable[[], Any]], Any], optimizer: Optimizer) -> Any:
        """Step 3: Lightning's optimizer step (``step``, around the ``closure`` that runs steps 1
        and 2), timed from the closure's end; a skipped step drops every gradient first, so the
        optimizer steps nothing (torch's optimizers skip ``grad=None``)."""
        after_closure = time.perf_counter()

        def timed_closure() -> Any:
            nonlocal after_closure
            try:
                result = closure()
            finally:
                after_closure = time.perf_counter()
            if self.state.skip:
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.grad = None
            return result

        result = step(timed_closure)
        self.sync.after_update(optimizer)
        if self.state.clock is not None:
            self.state.clock.add_span("optimizer", after_closure, time.perf_counter())
        self._end_record()
        return result

    def refresh_replicas(self, optimizer: Optional[Optimizer]) -> None:
        """Bring stale CPU-worker replicas up to date from the stages (a collective on every rank; a
        no-op unless the CPU workers kept out of optimizer steps since they last computed)."""
        if self.stale:
            log.debug("hetero: bringing the CPU workers' replicas up to date from the stages")
            self.worker.refresh(optimizer, self.state_sync.bucket_steps)
            self.stale = False

    def _share(self, report: WorkerReport, one_way: bool) -> list[WorkerReport]:
        """Every rank's report, and the combined logged values logged here, so every rank logs the
        same. ``one_way``: the CPU workers computed nothing, and the stages need not hear from them."""
        if self.report_device_stats:
            report.device = device_stats(self._device, meter="step")
        if self.signals is not None:
            report.signals = self.signals.noted()
        reports = self._exchange(report, one_way)
        if self.signals is not None:
            self.signals.agree(functools.reduce(operator.or_, (r.signals for r in reports), 0))
        if self.report_device_stats:
            self.latest_device_stats = {name: r.device or {} for name, r in zip(self._names, reports)}
        self._log(combine_logs(reports))
        return reports

    def _judge(self, reports: list[WorkerReport], trainer: Any, batch_idx: int, skipped: bool) -> None:
        """The non-finite policy, applied to what every rank found: every rank sees the same reports
        (and fine mode's ``skipped`` verdict), so every rank decides the same."""
        state = self.state
        found = {
            f"{name} (global rank {rank})": report.nonfinite
            for rank, (name, report) in enumerate(zip(self._names, reports))
            if report.nonfinite
        }
        if found and self._policy == "error":
            stepped = self.sync.overlaps and state.syncs
            raise nonfinite_error(found, trainer.global_step, trainer.current_epoch, batch_idx, stepped)
        state.nonfinite |= bool(found) or skipped
        state.skip = state.syncs and state.nonfinite
        if state.skip:
            self.skipped_steps += 1
            rank_zero_warn(
                f"Skipped training step {trainer.global_step} on every rank: NaN or Inf in"
                f" {describe_nonfinite(found) or 'the summed gradients'} ({self.skipped_steps} skipped so far)."
            )
            options = {"on_step": True, "on_epoch": False}
            self._log([LoggedValue("hetero/skipped_steps", float(self.skipped_steps), 1.0, None, options)])

    def _end_record(self) -> None:
        state = self.state
        if self.recorder is not None and state.clock is not None:
            self.recorder.end(state.step, state.samples, state.fraction)
            state.clock = None

    # ---------------------------------------------------------- evaluation

    def eval_step(
        self,
        method: str,
        batch: Any,
        rest: tuple,
        shares: Shares,
        optimizer: Optional[Optimizer],
        loader: tuple[int, Optional[int]] = (0, None),
    ) -> Any:
        """``validation_step``, ``test_step`` or ``predict_step`` on this rank's share. Logged values
        are combined as in training; predictions are assembled on the node's first rank from every
        worker's, in batch order (``None`` elsewhere). ``loader``: the batch's dataloader's index
        and ``batch_size`` (``Worker.saw_batch``)."""
        cpu_share = shares.pipeline_size < shares.batch_size
        if cpu_share:
            self.refresh_replicas(optimizer)
        self.worker.saw_batch(method, shares.batch_size, *loader)
        report, output = self.worker.eval_step(method, batch, rest, shares)
        if method != "predict_step":
            self._share(report, one_way=not cpu_share)
            return output
        mine = (report.samples, move_data_to_device(output, "cpu")) if report.samples else None
        group, first = self._outputs
        parts = gather_object_to(mine, first, group)
        return merge_outputs([p for p in parts if p is not None]) if parts is not None else None


def _gives_extras(shares: Shares, placement: Placement, mine: tuple[int, int]) -> bool:
    """Whether this rank, whose share is ``mine``, sends the keys its step returned besides the loss:
    where a rank that runs the step methods (a CPU worker, a device replica, a pipeline's last stage)
    has no sample of the batch ``shares`` divide, the first one that has (the same on every rank)."""
    parts = shares.parts(len(placement.stage_ranks) if len(placement.bounds) == 1 else 1)
    computing = [part for part in parts if part[1] > part[0]]
    return len(computing) < len(parts) and tuple(mine) == tuple(computing[0])


def _written(before: Mapping[str, tuple[int, int]], after: Mapping[str, tuple[int, int]]) -> str:
    """The tensors whose identity or version changed between ``before`` and ``after`` (``""``: none),
    the first five named, as a message says them."""
    changed = [name for name, version in before.items() if after.get(name, version) != version]
    return f"{changed[:5]}{' ...' if len(changed) > 5 else ''}" if changed else ""


def _warn_of_changed_buffers(module: Any, before: Mapping[str, tuple[int, int]]) -> None:
    """Once, after this process's first training step: buffers the step wrote (running means, counters)
    hold what this worker saw of the batch, not the whole batch as in one process."""
    changed = _written(before, buffer_versions(module))
    if changed:
        warnings.warn(
            f"`{type(module).__name__}`'s training step changed its buffer(s) {changed}. Each worker computes its own share of every batch (a pipeline stage"
            " one micro-batch at a time), so such buffers follow that share, not the whole batch, and differ from"
            " one process's and between workers; the strategy keeps only BatchNorm's statistics equal. Update them"
            " outside the training step (e.g. in `on_train_batch_end`, from values logged or returned), or keep"
            " them out of training.",
            stacklevel=2,
        )


def _warn_of_changed_parameters(
    module: Any, before: Mapping[str, tuple[int, int]], after: Optional[Mapping[str, tuple[int, int]]] = None
) -> None:
    """Once, after this process's first training step: parameters the forward or backward wrote in
    place (``nn.Embedding(max_norm=...)`` renormalizes the rows it looks up) hold what this worker
    saw of the batch, so the workers' copies of them part ways, and from one process's. ``after``:
    the versions to compare with, where not the parameters' now."""
    changed = _written(before, after if after is not None else parameter_versions(module))
    if changed:
        warnings.warn(
            f"`{type(module).__name__}`'s training step wrote its parameter(s) {changed} in place (as `nn.Embedding(max_norm=...)` renormalizes the rows"
            " a batch looks up). Each worker computes its own share of every batch, so a write that depends on the"
            " samples differs between the workers, whose copies of the parameter then part ways for the rest of the"
            " run (only the optimizer's steps keep them equal). Leave the write out (`max_norm=None`), or make it"
            " outside the training step, the same on every worker (e.g. in `on_train_batch_end`).",
            stacklevel=2,
        )


def _check_zeroed(optimizer: Optimizer, params: list[torch.nn.Parameter], step: int) -> None:
    """After a module's own ``optimizer_zero_grad``, at the start of an optimizer step: no gradient of
    the optimizer's (of this rank's ``params``) may be left from the step before, which every worker
    holds summed and would add in again."""
    held = {id(p) for p in params}
    left = [p.grad.any() for group in optimizer.param_groups for p in group["params"] if id(p) in held and p.grad is not None]
    if left and bool(torch.stack(left).any()):
        raise RuntimeError(
            f"Your `optimizer_zero_grad` left gradients in place at the start of optimizer step {step}. The"
            " hetero strategy sums every worker's gradients for each optimizer step, so gradients kept from"
            " an earlier step would be counted once per worker. Accumulate over batches with"
            " `Trainer(accumulate_grad_batches=N)` instead, or zero them in your override"
            " (`optimizer.zero_grad()`)."
        )


def _clipping(trainer: Any) -> Clipping:
    """(clip by value, clip by norm) as the Trainer is configured."""
    value = trainer.gradient_clip_val
    if not value:
        return None, None
    if trainer.gradient_clip_algorithm == "value":
        return float(value), None
    return None, float(value)


def _first_optimizer(trainer: Any) -> Optional[Optimizer]:
    optimizers = trainer.strategy.optimizers
    return optimizers[0] if optimizers else None
