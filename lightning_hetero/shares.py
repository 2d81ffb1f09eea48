"""How one batch is divided between the CPU workers and the pipeline.

The rule, applied identically on every rank from the batch size and the current CPU fraction:

- the pipeline's share is ``(1 - cpu_fraction) * batch_size`` rounded to a multiple of the
  micro-batch count, so that every micro-batch has the same size (``PipelineStage`` sizes its
  receive buffers from the first micro-batch), and the CPU workers take the rest; a share of fewer
  samples than the micro-batch count is cut into micro-batches of one sample;
- where the pipeline must take the whole batch (fraction 0, or no CPU worker) and the batch does
  not divide into ``micro_batches``, that step uses the largest micro-batch count that divides it;
- the CPU share is spread evenly over the CPU workers; CPU workers come first in the batch.

A share of a batch is samples ``[start, stop)`` of every tensor in it (``slice_batch``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import Tensor

__all__ = ["Shares", "split_batch", "no_single_samples", "batch_size_of", "slice_batch", "largest_divisor_at_most"]


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

    def device_part(self, index: int, count: int) -> tuple[int, int]:
        """Device replica ``index`` of ``count``'s samples: the devices' share (``pipeline``) spread
        evenly, the first ones taking one more where it does not divide."""
        start, stop = self.pipeline
        base, extra = divmod(stop - start, count)
        first = start + index * base + min(index, extra)
        return first, first + base + (1 if index < extra else 0)

    def parts(self, devices: int) -> list[tuple[int, int]]:
        """Every worker's samples: each CPU worker's, then each of ``devices`` device processes'
        (``device_part``; one, the pipeline's share, for a pipeline)."""
        return [*self.cpu, *(self.device_part(i, devices) for i in range(devices))]


def split_batch(batch_size: int, cpu_fraction: float, cpu_workers: int, micro_batches: int) -> Shares:
    """Divide ``batch_size`` samples between ``cpu_workers`` CPU workers and the pipeline (see module doc)."""
    if batch_size < 1:
        raise ValueError(f"Cannot split an empty batch (batch size {batch_size}).")
    if cpu_workers == 0 or cpu_fraction <= 0.0:
        pipeline = batch_size
    elif cpu_fraction >= 1.0:
        pipeline = 0
    else:
        target = (1.0 - cpu_fraction) * batch_size
        # A share of fewer samples than `micro_batches` is cut into fewer micro-batches, not left to the CPU.
        micro = max(1, min(micro_batches, int(target + 0.5)))
        pipeline = min(int(target / micro + 0.5), batch_size // micro) * micro
    return _shares(batch_size, batch_size - pipeline, cpu_workers, micro_batches)


def _shares(batch_size: int, cpu_total: int, cpu_workers: int, micro_batches: int) -> Shares:
    """``cpu_total`` samples spread evenly over the CPU workers (the first ones taking one more where
    it does not divide), the rest to the pipeline in as many of ``micro_batches`` as divide it."""
    ranges = []
    start = 0
    for index in range(cpu_workers):
        size = cpu_total // cpu_workers + (1 if index < cpu_total % cpu_workers else 0)
        ranges.append((start, start + size))
        start += size
    pipeline = batch_size - cpu_total
    steps = largest_divisor_at_most(pipeline, micro_batches) if pipeline else 0
    return Shares(batch_size, tuple(ranges), (cpu_total, batch_size), steps)


def no_single_samples(shares: Shares, devices: int, micro_batches: int = 1) -> Shares:
    """``shares`` of replicas moved to the nearest split (the fewest samples moved between the CPU
    workers and the ``devices``) in which no replica's share is a single sample, which per-share
    BatchNorm cannot normalize (``batchnorm.py``; one process normalizes the whole batch, so a
    small last batch must not fail for being split). Unchanged where no share is one sample, or
    where every split leaves one (a batch of one sample, as in one process)."""
    cpus, size = len(shares.cpu), shares.batch_size

    def fits(cpu_total: int) -> bool:
        devices_total = size - cpu_total
        return (cpu_total == 0 or cpu_total // cpus >= 2) and (devices_total == 0 or devices_total // devices >= 2)

    now = shares.pipeline[0]
    if fits(now):
        return shares
    candidates = sorted(range(size + 1 if cpus else 1), key=lambda total: (abs(total - now), total))
    best = next((total for total in candidates if fits(total)), None)
    return shares if best is None else _shares(size, best, cpus, micro_batches)


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` not above ``limit``: the micro-batches a share of ``n`` samples
    divides into evenly, when it cannot be ``limit``."""
    return next(d for d in range(min(n, limit), 0, -1) if n % d == 0)


def batch_size_of(batch: Any) -> int:
    """The number of samples in a batch: the first dimension of its tensors, which must agree, since
    every tensor of a batch is divided between the workers along it (``slice_batch``). A batch
    without tensors counts the items of its lists of plain values (per-sample strings, ids) or of
    its lists of samples (``_samples``: a DataLoader with ``collate_fn=list``)."""
    tensors = [t for t in _leaves(batch, Tensor) if t.dim() > 0]
    if tensors:
        if len({t.shape[0] for t in tensors}) > 1:
            shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
            raise ValueError(
                "The hetero strategy divides every batch between its workers by samples, along the first dimension of"
                f" each of its tensors, so every tensor needs one row per sample; this batch holds tensors of shapes"
                f" {shapes}. Give every tensor the batch's size first (pass per-batch values as Python numbers); for"
                " samples packed into one tensor (tokens with offsets, a graph batch), let the DataLoader give the"
                " samples as a list (`collate_fn=list`) and pack them in your step; with several training"
                " dataloaders, give them one `batch_size` (and `drop_last=True` where a dataset's length does not"
                " divide by it)."
            )
        return tensors[0].shape[0]
    lengths = {len(values) for values in _leaves(batch, list) if values}
    if len(lengths) == 1:
        return lengths.pop()
    raise TypeError(
        f"Cannot tell the batch size of a {type(batch).__name__}: the hetero strategy divides a batch between its"
        " workers by samples, so it needs tensors with one row per sample, or lists with one value or one sample"
        " per sample. For a batch class of your own (a graph batch), let the DataLoader give the samples as a list"
        " (`collate_fn=list`) and make the batch in your step."
    )


def slice_batch(batch: Any, start: int, stop: int, size: int | None = None) -> Any:
    """Samples ``[start, stop)`` of a batch of any structure Lightning takes (dicts, lists, tuples,
    named tuples, dataclasses, mappings such as a tokenizer's ``BatchEncoding``): every tensor with
    one row per sample is sliced, and so is every list of plain values with one per sample (strings,
    ids) and every list of samples (``_samples``); what is not per sample (a 0-dim tensor, a number,
    a list of another length) goes to every worker whole. Given the batch's ``size``, a share of all
    of it is the batch itself, as one process's step gets it."""
    if size is not None and (start, stop) == (0, size):
        return batch
    return _slice(batch, start, stop, batch_size_of(batch))


def _slice(batch: Any, start: int, stop: int, size: int) -> Any:
    if isinstance(batch, Tensor):
        return batch[start:stop] if batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        items = {k: _slice(v, start, stop, size) for k, v in batch.items()}
        return type(batch)(batch.default_factory, items) if isinstance(batch, defaultdict) else type(batch)(items)
    if _is_namedtuple(batch):
        return type(batch)(*(_slice(v, start, stop, size) for v in batch))
    if isinstance(batch, (tuple, list)):
        if (_plain_values(batch) or _samples(batch)) and len(batch) == size:
            return batch[start:stop]
        return type(batch)(_slice(v, start, stop, size) for v in batch)
    if isinstance(batch, np.ndarray):  # a custom collate's array: its rows, where it has one per sample
        return batch[start:stop] if batch.ndim > 0 and len(batch) == size else batch
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        sliced = copy.copy(batch)
        for f in dataclasses.fields(batch):
            object.__setattr__(sliced, f.name, _slice(getattr(batch, f.name), start, stop, size))
        return sliced
    return batch


def _leaves(batch: Any, kind: type) -> list[Any]:
    """The tensors (``kind=Tensor``) or lists of plain values (``kind=list``) anywhere in the batch."""
    if isinstance(batch, Tensor):
        return [batch] if kind is Tensor else []
    if isinstance(batch, Mapping):
        return [leaf for value in batch.values() for leaf in _leaves(value, kind)]
    if isinstance(batch, (tuple, list)):
        if not _is_namedtuple(batch) and batch and (_plain_values(batch) or _samples(batch)):
            return [batch] if kind is list else []
        return [leaf for value in batch for leaf in _leaves(value, kind)]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [leaf for f in dataclasses.fields(batch) for leaf in _leaves(getattr(batch, f.name), kind)]
    return []


def _samples(values: Sequence[Any]) -> bool:
    """Whether a list holds samples, each as the dataset gave it (a DataLoader with
    ``collate_fn=list``, for inputs of different sizes; or each sample's own list of plain values,
    such as its token ids), rather than the fields of a collated batch
    (``default_collate`` turns a sample ``((a, b), (c, d))`` into ``[[A, B], [C, D]]``, and a sample
    of two dicts into a list of two dicts of rows). It is a ``list`` (a custom collate's tuple of
    fields is not) of records of one kind: tuples, dicts, named tuples or dataclasses of the same
    fields. They are samples where they are plain tuples (collating makes lists of them), or where
    what they hold could not be a collated batch's rows: a number, a string or a 0-dim tensor, or
    tensors whose first dimensions differ."""
    if isinstance(values, list) and values and all(type(v) is list and _plain_values(v) for v in values):
        # Each sample's own list of values (token ids): `default_collate` makes tensors of numbers, so
        # lists of them come from the user's collate; of strings, only where their lengths differ
        # (collating a sample's list of strings makes lists of one length, the batch's).
        numbers = all(not isinstance(x, (str, bytes)) for v in values for x in v)
        return numbers or len({len(v) for v in values}) > 1
    if not isinstance(values, list) or not values or not all(_is_record(v) for v in values):
        return False
    kind = _fields(values[0])
    if any(_fields(v) != kind for v in values[1:]):
        return False
    if all(type(v) is tuple for v in values):
        return True
    leaves = [leaf for v in values for leaf in _record_leaves(v)]
    if any(not isinstance(leaf, (Tensor, list)) or (isinstance(leaf, Tensor) and leaf.dim() == 0) for leaf in leaves):
        return True
    return len({leaf.shape[0] if isinstance(leaf, Tensor) else len(leaf) for leaf in leaves}) > 1


def _is_record(value: Any) -> bool:
    return isinstance(value, (tuple, Mapping)) or (dataclasses.is_dataclass(value) and not isinstance(value, type))


def _fields(record: Any) -> tuple[Any, ...]:
    if isinstance(record, Mapping):
        return (type(record), *record.keys())
    if dataclasses.is_dataclass(record):
        return (type(record), *(f.name for f in dataclasses.fields(record)))
    return (type(record), len(record))


def _record_leaves(value: Any) -> list[Any]:
    """What a record holds, through its dicts, tuples and dataclasses: tensors, lists (a collated
    batch's per-sample values) and plain values."""
    if isinstance(value, Mapping):
        return [leaf for v in value.values() for leaf in _record_leaves(v)]
    if isinstance(value, tuple):
        return [leaf for v in value for leaf in _record_leaves(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [leaf for f in dataclasses.fields(value) for leaf in _record_leaves(getattr(value, f.name))]
    return [value]


def _plain_values(values: Sequence[Any]) -> bool:
    return all(isinstance(v, (str, bytes, int, float, bool)) or v is None for v in values)


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")
