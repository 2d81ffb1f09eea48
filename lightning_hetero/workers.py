"""What each kind of process does with its share of a batch.

A ``CpuWorker`` runs the module's own step methods (``training_step``, ``validation_step``, ...)
on its share with the full replica. A ``StageWorker`` runs its slice of the layers in the
pipeline schedule; on the last stage it then *replays* the module's step method with ``forward``
returning the pipeline's outputs, so that the loss and everything the step logs are computed on
the pipeline's share by the user's own code.

Both do their forward and backward inside ``training_step`` (so every rank knows the step's loss
when ``training_step`` returns). Lightning zeroes gradients *after* ``training_step``, so the new
gradients are set aside and the strategy's ``backward`` adds them back (see ``_Worker._train``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any, Callable, Literal

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_hetero.module import inputs_of, split_inputs_targets
from lightning_hetero.pipeline import Pipeline
from lightning_hetero.results import LogCapture, WorkerReport
from lightning_hetero.shares import Shares
from lightning_hetero.sync import restore_grads, set_grads_aside

__all__ = ["CpuWorker", "StageWorker", "GradPolicy", "slice_batch", "batch_size_of"]

GradPolicy = Literal["keep", "drop", "accumulate"]


def batch_size_of(batch: Any) -> int:
    """The number of samples in a batch: the first dimension of its tensors, which must agree, since
    every tensor of a batch is divided between the workers along it (``slice_batch``)."""
    tensors = _tensors(batch)
    if not tensors:
        raise TypeError(f"Cannot tell the batch size of a {type(batch).__name__}; batches must hold tensors.")
    if any(t.dim() == 0 for t in tensors) or len({t.shape[0] for t in tensors}) > 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise ValueError(
            "The hetero strategy divides every batch between its workers by samples, along the first dimension of"
            f" each of its tensors, so every tensor needs one row per sample; this batch holds tensors of shapes"
            f" {shapes}. Give every tensor the batch's size first (pass per-batch values as Python numbers)."
        )
    return tensors[0].shape[0]


def _tensors(batch: Any) -> list[Tensor]:
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for value in batch.values() for t in _tensors(value)]
    if isinstance(batch, (tuple, list)):
        return [t for value in batch for t in _tensors(value)]
    return []


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples ``[start, stop)`` of every tensor in the batch."""
    if isinstance(batch, Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return type(batch)({k: slice_batch(v, start, stop) for k, v in batch.items()})
    if isinstance(batch, (tuple, list)):
        return type(batch)(slice_batch(v, start, stop) for v in batch)
    return batch


def _loss_of(output: Any, method: str) -> Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise TypeError(
            f"`{method}` must return the loss, as a tensor or a dict with a 'loss' key, on every step; got"
            f" {type(output).__name__}. The hetero strategy cannot skip a step on one worker only."
        )
    return loss


class _Worker:
    """Shared by both roles: the parameters this rank trains, and the gradients set aside."""

    def __init__(self, module: LightningModule, params: Sequence[nn.Parameter]) -> None:
        self.module = module
        self.params = list(params)
        self.fresh_grads: list[Tensor | None] | None = None
        self.pace = 0.0
        """TESTING ONLY: seconds per sample this worker's training share takes at least (the
        strategy's ``emulated_speed``); 0 runs at the real speed."""

    def _pad(self, samples: int, started: float, clock: Any = None, kind: str = "") -> None:
        """Sleep out the rest of ``samples * pace`` seconds since ``started`` (timed as ``kind``)."""
        now = time.perf_counter()
        rest = samples * self.pace - (now - started)
        if rest <= 0:
            return
        time.sleep(rest)
        if clock is not None and kind:
            clock.add_span(kind, now, time.perf_counter())

    def _train(self, compute: Callable[[], Any], grads: GradPolicy) -> Any:
        """Run ``compute()`` (forward and backward) under a policy for the gradients already there:

        - ``"keep"``: this step's gradients are set aside and the older ones put back, for Lightning
          to accumulate into (the strategy's ``backward`` adds the new ones after its ``zero_grad``);
        - ``"drop"``: the same, but the older ones are freed first, as Lightning is about to zero them;
        - ``"accumulate"``: the backward adds straight onto them (fine mode's last micro-batch of an
          optimizer step, whose gradients the overlapped sync consumes while the backward runs).
        """
        if grads == "accumulate":
            self.fresh_grads = None
            return compute()
        old = set_grads_aside(self.params)
        if grads == "drop":
            old = None
        result = compute()
        self.fresh_grads = set_grads_aside(self.params)
        if old is not None:
            restore_grads(self.params, old)
        return result

    def _run_step(self, method: str, batch: Any, rest: tuple, samples: int, batch_size: int) -> tuple[WorkerReport, Any]:
        with LogCapture(self.module, samples, batch_size) as capture:
            output = getattr(self.module, method)(batch, *rest)
        report = WorkerReport(samples=samples, logs=capture.logs)
        if method == "training_step":
            loss = _loss_of(output, method)
            report.loss, report.loss_dtype = float(loss.detach().double()), loss.dtype
        return report, output


class CpuWorker(_Worker):
    """A full replica on the CPU, running the module's own step methods on its share."""

    def __init__(self, module: LightningModule, params: Sequence[nn.Parameter], index: int) -> None:
        super().__init__(module, params)
        self.index = index

    def expected_grads(self, shares: Shares) -> int:
        """Gradients each parameter receives in this step's backward (one per backward pass)."""
        start, stop = shares.cpu[self.index]
        return 1 if stop > start else 0

    def train_step(
        self, batch: Any, batch_idx: int, shares: Shares, accumulate: int, grads: GradPolicy, clock: Any
    ) -> tuple[WorkerReport, Any]:
        start, stop = shares.cpu[self.index]
        if start == stop:
            self._train(lambda: None, grads)
            return WorkerReport(), None

        @_timed(clock, "compute")
        def compute() -> tuple[WorkerReport, Any]:
            started = time.perf_counter()
            share = slice_batch(batch, start, stop)
            report, output = self._run_step("training_step", share, (batch_idx,), stop - start, shares.batch_size)
            weight = (stop - start) / (shares.batch_size * accumulate)
            self.module.backward(_loss_of(output, "training_step") * weight)
            self._pad(stop - start, started)
            return report, output

        return self._train(compute, grads)

    def eval_step(self, method: str, batch: Any, rest: tuple, shares: Shares) -> tuple[WorkerReport, Any]:
        start, stop = shares.cpu[self.index]
        if start == stop:
            return WorkerReport(), None
        return self._run_step(method, slice_batch(batch, start, stop), rest, stop - start, shares.batch_size)


class StageWorker(_Worker):
    """One pipeline stage; the last one replays the module's step methods on the pipeline's outputs."""

    def __init__(self, module: LightningModule, params: Sequence[nn.Parameter], pipeline: Pipeline) -> None:
        super().__init__(module, params)
        self.pipeline = pipeline

    def expected_grads(self, shares: Shares) -> int:
        """Gradients each parameter receives in this step's backward: one per micro-batch."""
        return shares.micro_batches if shares.pipeline_size else 0

    def train_step(
        self, batch: Any, batch_idx: int, shares: Shares, accumulate: int, grads: GradPolicy, clock: Any
    ) -> tuple[WorkerReport, Any]:
        start, stop = shares.pipeline
        if start == stop:
            self._train(lambda: None, grads)
            return WorkerReport(), None
        share = slice_batch(batch, start, stop)
        inputs, targets = split_inputs_targets(share)
        scale = (stop - start) / (shares.batch_size * accumulate * shares.micro_batches)

        @_timed(clock, "pipeline")
        def compute() -> tuple[Any, float]:
            started = time.perf_counter()
            result = self.pipeline.train_step(inputs, targets, shares.micro_batches, scale, clock)
            self._pad(stop - start, started, clock, "stage")  # emulated work counts as this stage's compute
            return result

        outputs, pipeline_loss = self._train(compute, grads)
        if not self.pipeline.is_last:
            return WorkerReport(), None
        with clock.span("compute") if clock is not None else nullcontext():
            report, output = self._replay("training_step", share, (batch_idx,), outputs.detach(), shares)
        _check_same_loss(type(self.module).__name__, report, pipeline_loss)
        return report, output

    def eval_step(self, method: str, batch: Any, rest: tuple, shares: Shares) -> tuple[WorkerReport, Any]:
        start, stop = shares.pipeline
        if start == stop:
            return WorkerReport(), None
        share = slice_batch(batch, start, stop)
        outputs = self.pipeline.eval_step(inputs_of(share), shares.micro_batches)
        if not self.pipeline.is_last:
            return WorkerReport(), None
        return self._replay(method, share, rest, outputs, shares)

    def _replay(self, method: str, share: Any, rest: tuple, outputs: Any, shares: Shares) -> tuple[WorkerReport, Any]:
        """Run the module's ``method`` on the share with ``forward`` answering with the pipeline's outputs."""
        calls = []

        def forward(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return outputs

        self.module.forward = forward  # type: ignore[method-assign]
        try:
            with torch.no_grad():
                share = move_data_to_device(share, self.pipeline.device)
                report, output = self._run_step(method, share, rest, shares.pipeline_size, shares.batch_size)
        finally:
            del self.module.forward
        if len(calls) != 1:
            raise RuntimeError(
                f"`{type(self.module).__name__}.{method}` called the model {len(calls)} time(s); the hetero strategy"
                " needs it to compute its outputs with exactly one `self(inputs)` call, which the pipeline answers"
                " on its stages."
            )
        return report, output


def _timed(clock: Any, kind: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    """Decorate a step's work so it is timed into ``clock`` as ``kind`` (not at all without one)."""

    def wrap(work: Callable[[], Any]) -> Callable[[], Any]:
        def timed() -> Any:
            if clock is None:
                return work()
            with clock.span(kind):
                return work()

        return timed

    return wrap


def _check_same_loss(model: str, report: WorkerReport, pipeline_loss: float) -> None:
    """The stages train on ``pipeline_loss``; a ``training_step`` that returns another loss would
    train the CPU worker's share on something else, so say so instead of training a wrong model.
    (The two are computed in different orders: micro-batch by micro-batch, and over the share.)"""
    step_loss = report.loss
    if step_loss is None or not (math.isfinite(step_loss) and math.isfinite(pipeline_loss)):
        return  # the strategy's non-finite policy decides what a NaN or Inf loss does
    tolerance = 1e-4 if report.loss_dtype in (torch.float32, torch.float64) else 5e-2
    if not math.isclose(step_loss, pipeline_loss, rel_tol=tolerance, abs_tol=1e-6):
        raise ValueError(
            f"`{model}.training_step` returned a loss of {step_loss:.6g} where `pipeline_loss` gives"
            f" {pipeline_loss:.6g} on the same samples. The pipeline stages train on `pipeline_loss(output,"
            " target)`, so `training_step` must return exactly that loss (no extra terms); put regularizers"
            " into `pipeline_loss` or into the layers."
        )
