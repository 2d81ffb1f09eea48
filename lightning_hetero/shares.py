"""How one batch is divided between the CPU workers and the pipeline.

The rule, applied identically on every rank from the batch size and the current CPU fraction:

- the pipeline's share is ``(1 - cpu_fraction) * batch_size`` rounded to a multiple of the
  micro-batch count, so that every micro-batch has the same size (``PipelineStage`` sizes its
  receive buffers from the first micro-batch), and the CPU workers take the rest;
- where the pipeline must take the whole batch (fraction 0, or no CPU worker) and the batch does
  not divide into ``micro_batches``, that step uses the largest micro-batch count that divides it;
- the CPU share is spread evenly over the CPU workers; CPU workers come first in the batch.

A share of a batch is samples ``[start, stop)`` of every tensor in it (``slice_batch``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = ["Shares", "split_batch", "batch_size_of", "slice_batch", "largest_divisor_at_most"]


@dataclass(frozen=True)
class Shares:
    """The samples each worker computes in one step: ``[start, stop)`` ranges into the batch."""

    batch_size: int
    cpu: tuple[tuple[int, int], ...]
    """One range per CPU worker."""
    pipeline: tuple[int, int]
    micro_batches: int
    """Micro-batches the pipeline's share is cut into this step (0 when the share is empty)."""

    @property
    def pipeline_size(self) -> int:
        return self.pipeline[1] - self.pipeline[0]


def split_batch(batch_size: int, cpu_fraction: float, cpu_workers: int, micro_batches: int) -> Shares:
    """Divide ``batch_size`` samples between ``cpu_workers`` CPU workers and the pipeline (see module doc)."""
    if batch_size < 1:
        raise ValueError(f"Cannot split an empty batch (batch size {batch_size}).")
    if cpu_workers == 0 or cpu_fraction <= 0.0:
        pipeline = batch_size
    elif cpu_fraction >= 1.0:
        pipeline = 0
    else:
        groups = int((1.0 - cpu_fraction) * batch_size / micro_batches + 0.5)
        pipeline = min(groups, batch_size // micro_batches) * micro_batches
    steps = largest_divisor_at_most(pipeline, micro_batches) if pipeline else 0
    cpu_total = batch_size - pipeline
    ranges = []
    start = 0
    for index in range(cpu_workers):
        size = cpu_total // cpu_workers + (1 if index < cpu_total % cpu_workers else 0)
        ranges.append((start, start + size))
        start += size
    return Shares(batch_size, tuple(ranges), (cpu_total, batch_size), steps)


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` not above ``limit``: the micro-batches a share of ``n`` samples
    divides into evenly, when it cannot be ``limit``."""
    return next(d for d in range(min(n, limit), 0, -1) if n % d == 0)


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
