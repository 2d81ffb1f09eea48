"""What each kind of process does with its share of a batch.

A ``CpuWorker`` runs the module's own step methods (``training_step``, ``validation_step``, ...)
on its share with the full replica. A ``StageWorker`` runs its slice of the layers in the
pipeline schedule; on the last stage it then *replays* the module's step method with ``forward``
returning the pipeline's outputs, so that the loss and everything the step logs are computed on
the pipeline's share by the user's own code.

Both do their forward and backward inside ``training_step`` (so every rank knows the step's loss
when ``training_step`` returns), and set the new gradients aside: Lightning zeroes gradients
*after* ``training_step``, and the strategy's ``backward`` adds them back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_hetero.module import split_inputs_targets
from lightning_hetero.pipeline import Pipeline, _to_device
from lightning_hetero.results import LogCapture, WorkerReport
from lightning_hetero.shares import Shares
from lightning_hetero.sync import restore_grads, set_grads_aside

__all__ = ["CpuWorker", "StageWorker", "slice_batch", "batch_size_of"]


def batch_size_of(batch: Any) -> int:
    """The number of samples in a batch: the first dimension of its first tensor."""
    if isinstance(batch, Tensor):
        return batch.shape[0]
    if isinstance(batch, Mapping):
        return batch_size_of(next(iter(batch.values())))
    if isinstance(batch, (tuple, list)) and batch:
        return batch_size_of(batch[0])
    raise TypeError(f"Cannot tell the batch size of a {type(batch).__name__}; batches must hold tensors.")


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples ``[start, stop)`` of every tensor in the batch."""
    if isinstance(batch, Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return type(batch)({k: slice_batch(v, start, stop) for k, v in batch.items()})
    if isinstance(batch, (tuple, list)):
        return type(batch)(slice_batch(v, start, stop) for v in batch)
    return batch


def loss_of(output: Any, method: str) -> Tensor | None:
    if isinstance(output, Mapping):
        return output.get("loss")
    if isinstance(output, Tensor) or output is None:
        return output
    raise TypeError(f"`{method}` must return a loss tensor or a dict with a 'loss' key, got {type(output).__name__}.")


class _Worker:
    """Shared by both roles: the parameters this rank trains, and the gradients set aside."""

    def __init__(self, module: LightningModule, params: Sequence[nn.Parameter]) -> None:
        self.module = module
        self.params = list(params)
        self.fresh_grads: list[Tensor | None] | None = None

    def _train(self, compute: Any, keep_old_grads: bool) -> Any:
        """Run ``compute()`` (forward and backward) with this step's gradients kept apart from older ones.

        The older gradients go back in place for Lightning to zero or accumulate into; where
        Lightning is about to zero them anyway (``keep_old_grads=False``) they are freed first.
        """
        old = set_grads_aside(self.params)
        if not keep_old_grads:
            old = None
        result = compute()
        self.fresh_grads = set_grads_aside(self.params)
        if old is not None:
            restore_grads(self.params, old)
        return result

    def _run_step(self, method: str, batch: Any, rest: tuple, samples: int) -> tuple[WorkerReport, Any]:
        with LogCapture(self.module, samples) as capture:
            output = getattr(self.module, method)(batch, *rest)
        report = WorkerReport(samples=samples, logs=capture.logs)
        loss = loss_of(output, method) if method == "training_step" else None
        if loss is not None:
            report.loss, report.loss_dtype = float(loss.detach().double()), loss.dtype
        return report, output


class CpuWorker(_Worker):
    """A full replica on the CPU, running the module's own step methods on its share."""

    def __init__(self, module: LightningModule, params: Sequence[nn.Parameter], index: int) -> None:
        super().__init__(module, params)
        self.index = index

    def train_step(
        self, batch: Any, batch_idx: int, shares: Shares, accumulate: int, keep_old_grads: bool
    ) -> tuple[WorkerReport, Any]:
        start, stop = shares.cpu[self.index]
        if start == stop:
            self._train(lambda: None, keep_old_grads)
            return WorkerReport(), None

        def compute() -> tuple[WorkerReport, Any]:
            report, output = self._run_step("training_step", slice_batch(batch, start, stop), (batch_idx,), stop - start)
            loss = loss_of(output, "training_step")
            if loss is None:
                raise RuntimeError("`training_step` returned None; the hetero strategy needs a loss on every step.")
            self.module.backward(loss * ((stop - start) / (shares.batch_size * accumulate)))
            return report, output

        return self._train(compute, keep_old_grads)

    def eval_step(self, method: str, batch: Any, rest: tuple, shares: Shares) -> tuple[WorkerReport, Any]:
        start, stop = shares.cpu[self.index]
        if start == stop:
            return WorkerReport(), None
        return self._run_step(method, slice_batch(batch, start, stop), rest, stop - start)


class StageWorker(_Worker):
    """One pipeline stage; the last one replays the module's step methods on the pipeline's outputs."""

    def __init__(self, module: LightningModule, params: Sequence[nn.Parameter], pipeline: Pipeline) -> None:
        super().__init__(module, params)
        self.pipeline = pipeline

    def train_step(
        self, batch: Any, batch_idx: int, shares: Shares, accumulate: int, keep_old_grads: bool
    ) -> tuple[WorkerReport, Any]:
        start, stop = shares.pipeline
        if start == stop:
            self._train(lambda: None, keep_old_grads)
            return WorkerReport(), None
        share = slice_batch(batch, start, stop)
        inputs, targets = split_inputs_targets(share)
        scale = (stop - start) / (shares.batch_size * accumulate * shares.micro_batches)
        outputs = self._train(
            lambda: self.pipeline.train_step(inputs, targets, shares.micro_batches, scale), keep_old_grads
        )
        if not self.pipeline.is_last:
            return WorkerReport(), None
        return self._replay("training_step", share, (batch_idx,), outputs.detach(), stop - start)

    def eval_step(self, method: str, batch: Any, rest: tuple, shares: Shares) -> tuple[WorkerReport, Any]:
        start, stop = shares.pipeline
        if start == stop:
            return WorkerReport(), None
        share = slice_batch(batch, start, stop)
        inputs = share[0] if isinstance(share, (tuple, list)) else share
        outputs = self.pipeline.eval_step(inputs, shares.micro_batches)
        if not self.pipeline.is_last:
            return WorkerReport(), None
        return self._replay(method, share, rest, outputs, stop - start)

    def _replay(self, method: str, share: Any, rest: tuple, outputs: Any, samples: int) -> tuple[WorkerReport, Any]:
        """Run the module's ``method`` on the share with ``forward`` answering with the pipeline's outputs."""
        calls = []

        def forward(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return outputs

        self.module.forward = forward  # type: ignore[method-assign]
        try:
            with torch.no_grad():
                report, output = self._run_step(method, _to_device(share, self.pipeline.device), rest, samples)
        finally:
            del self.module.forward
        if len(calls) != 1:
            raise RuntimeError(
                f"`{type(self.module).__name__}.{method}` called the model {len(calls)} time(s); the hetero strategy"
                " needs it to compute its outputs with exactly one `self(inputs)` call, which the pipeline answers"
                " on its stages."
            )
        return report, output
