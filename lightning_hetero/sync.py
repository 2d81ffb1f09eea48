"""Gradient synchronization between the CPU workers and the pipeline stages.

Each worker's backward leaves its share's *weighted* contribution in ``.grad`` (the loss was
scaled by the share's fraction of the batch), so summing the contributions gives every rank the
gradient of the whole batch, as in one process. For each stage, the stage rank and the CPU
workers sum the gradients of that stage's parameters in one flat buffer (gloo; CUDA gradients go
through a pinned CPU buffer). Where there are several nodes, each rank then averages with its
peers on the other nodes.

Coarse mode (``GradientSync``) sums everything after the backward. Fine mode (``OverlappedSync``)
sums and steps bucket by bucket while the backward is still running.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "GradientSync",
    "OverlappedSync",
    "Bucket",
    "make_buckets",
    "set_grads_aside",
    "restore_grads",
    "add_grads",
    "global_grad_norm",
]


def set_grads_aside(params: Sequence[nn.Parameter]) -> list[Tensor | None]:
    """Take the gradients out of ``params`` (leaving ``None``) and return them."""
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return grads


def restore_grads(params: Sequence[nn.Parameter], grads: Sequence[Tensor | None]) -> None:
    for p, g in zip(params, grads):
        p.grad = g


def add_grads(params: Sequence[nn.Parameter], grads: Sequence[Tensor | None]) -> None:
    """Accumulate ``grads`` into ``params``, as a backward pass would."""
    for p, g in zip(params, grads):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)


class _FlatBucket:
    """Gradients of some parameters packed into one CPU buffer, followed by one flag per parameter.

    The flag is 1 where this rank has a gradient. After the all-reduce, a parameter whose summed
    flag is 0 was used by no rank and keeps ``grad=None``, so the optimizer skips it exactly as it
    would in one process; the layout never depends on which gradients exist, so every rank sends
    a buffer of the same size.
    """

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup, average: bool = False) -> None:
        self.params = list(params)
        self.group = group
        self.divisor = dist.get_world_size(group) if average else 1
        self.sizes = [p.numel() for p in params]
        pin = any(p.device.type == "cuda" for p in params) and torch.cuda.is_available()
        # Half-precision gradients are summed in float32, then rounded once.
        dtype = torch.float32 if params[0].dtype in (torch.float16, torch.bfloat16) else params[0].dtype
        self.buffer = torch.empty(sum(self.sizes) + len(params), dtype=dtype, pin_memory=pin)

    def pack(self) -> Tensor:
        offset = 0
        for p, n in zip(self.params, self.sizes):
            view = self.buffer[offset : offset + n]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1), non_blocking=True)
            offset += n
        flags = [0.0 if p.grad is None else 1.0 for p in self.params]
        self.buffer[offset:].copy_(torch.tensor(flags, dtype=self.buffer.dtype))
        if self.buffer.is_pinned():
            torch.cuda.synchronize()
        return self.buffer

    def unpack(self) -> None:
        if self.divisor != 1:
            self.buffer[: sum(self.sizes)] /= self.divisor
        flags = self.buffer[sum(self.sizes) :].tolist()
        offset = 0
        for i, (p, n) in enumerate(zip(self.params, self.sizes)):
            if flags[i] == 0:
                p.grad = None
            else:
                summed = self.buffer[offset : offset + n].view_as(p)
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(summed, non_blocking=True)
            offset += n


class GradientSync:
    """Sums each stage's gradients over its sync group, then averages over nodes.

    ``buckets`` holds, for each stage this rank takes part in, the parameters of that stage (on
    this rank) and the stage's sync group; ranks with nothing to sum with (no CPU worker) pass none.
    """

    def __init__(
        self,
        buckets: Sequence[tuple[Sequence[nn.Parameter], dist.ProcessGroup | None]],
        replica_group: dist.ProcessGroup | None = None,
    ) -> None:
        self._buckets = [_FlatBucket(params, group) for params, group in buckets if group is not None and params]
        params = [p for params, _ in buckets for p in params]
        self._nodes = _FlatBucket(params, replica_group, average=True) if replica_group and params else None

    def all_reduce(self) -> None:
        _all_reduce(self._buckets)
        if self._nodes is not None:
            _all_reduce([self._nodes])


def _all_reduce(buckets: Sequence[_FlatBucket]) -> None:
    works = [dist.all_reduce(b.pack(), group=b.group, async_op=True) for b in buckets]
    for work in works:
        work.wait()
    for bucket in buckets:
        bucket.unpack()


def global_grad_norm(
    stage_grads: Sequence[Tensor] | None,
    stage_index: int,
    num_stages: int,
    num_nodes: int = 1,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """The 2-norm of all gradients of the model, identical on every rank.

    Each stage rank contributes the squared norm of its own parameters' gradients (CPU workers
    pass ``None``: their replica's gradients equal the stages' after the sync). Summing the
    per-stage partials in a fixed order gives every rank the same value to the last bit, so all
    copies of a parameter stay identical after clipping.
    """
    partials = torch.zeros(num_stages, dtype=torch.float64)
    if stage_grads:
        partials[stage_index] = torch.nn.utils.get_total_norm(stage_grads, 2.0).double().cpu() ** 2
    dist.all_reduce(partials, group=group)
    return (partials / num_nodes).sum().sqrt()


@dataclass(frozen=True)
class Bucket:
    """Consecutive layers of one stage whose gradients are summed and stepped together (fine mode)."""

    index: int
    """Position in backward order: bucket 0 holds the last layers, which the backward finishes first."""
    stage: int
    layers: tuple[int, int]
    """``[start, stop)`` into ``pipeline_layers()``."""


def make_buckets(layers: Sequence[nn.Module], bounds: Sequence[tuple[int, int]], bucket_bytes: int) -> list[Bucket]:
    """Cut each stage's layers, from its last layer back, into buckets of at least ``bucket_bytes``
    of parameters (the stage's first bucket takes what remains); bucket 0 is the model's last."""
    buckets: list[Bucket] = []
    for stage in reversed(range(len(bounds))):
        start, stop = bounds[stage]
        top, size = stop, 0
        for i in range(stop - 1, start - 1, -1):
            size += sum(p.numel() * p.element_size() for p in layers[i].parameters())
            if size >= bucket_bytes and i > start:
                buckets.append(Bucket(len(buckets), stage, (i, top)))
                top, size = i, 0
        buckets.append(Bucket(len(buckets), stage, (start, top)))
    return buckets


class OverlappedSync:
    """Fine mode: each bucket is summed and stepped as soon as the backward is done with it.

    A hook on every parameter counts the gradients it receives during the final backward of an
    optimizer step (one per micro-batch on a stage, one on a CPU worker). When all of a bucket's
    parameters are complete, the bucket is handed to a worker thread, which sums it over the sync
    group (and averages over nodes), clips it by value if asked, and runs its step, while the
    backward goes on with earlier layers. Buckets are handed over strictly in bucket order, so
    every rank issues its collectives in the same order; a bucket that never completes (a
    parameter unused in this step) goes at the end of the backward.

    Clipping by norm needs every gradient before any step: then the thread only sums, and the
    steps run after the backward, once the global norm is known.
    """

    def __init__(
        self,
        entries: Sequence[tuple[Sequence[nn.Parameter], dist.ProcessGroup | None, Any]],
        replica_group: dist.ProcessGroup | None,
        norm: Callable[[], Tensor],
    ) -> None:
        """``entries`` are this rank's buckets in bucket order: (parameters, sync group, step)."""
        self._params = [list(params) for params, _, _ in entries]
        self._sums = [_FlatBucket(params, group) if group is not None and params else None for params, group, _ in entries]
        self._nodes = [_FlatBucket(p, replica_group, average=True) if replica_group and p else None for p in self._params]
        self._steps = [step for _, _, step in entries]
        self._norm = norm
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetero-buckets")
        self.handed_early = 0
        """Buckets handed over while the last backward was still running (the rest went after it)."""
        self._hooked: set[nn.Parameter] = set()
        self._armed = False

    def begin(self, arrivals: int, clip_value: float | None, clip_norm: float | None) -> None:
        """Arm the hooks for a backward in which each used parameter receives ``arrivals`` gradients."""
        for k, params in enumerate(self._params):
            for p in params:  # hooks need requires_grad: a layer unfrozen since last time gets one now
                if p.requires_grad and p not in self._hooked:
                    p.register_post_accumulate_grad_hook(partial(self._arrived, k))
                    self._hooked.add(p)
        self._arrivals, self._clip_value, self._clip_norm = arrivals, clip_value, clip_norm
        self._counts: dict[nn.Parameter, int] = {}
        self._missing = [sum(p.requires_grad for p in params) for params in self._params]
        self._next = 0
        self._futures: list[Future] = []
        self._armed = True
        self._hand_over()  # buckets with nothing to wait for (no trainable parameters)

    def finish(self) -> None:
        """Hand over the buckets still waiting, wait for all of them, and (when clipping by norm) step."""
        self._armed = False
        self.handed_early = self._next
        self._hand_over(everything=True)
        for future in self._futures:
            future.result()
        if self._clip_norm is not None:
            grads = [p for params in self._params for p in params if p.grad is not None]
            total = self._norm()
            if grads:
                torch.nn.utils.clip_grads_with_norm_(grads, self._clip_norm, total.to(grads[0].dtype))
            for step in self._steps:
                step.step()

    @property
    def steps(self) -> list[Any]:
        """The step of each of this rank's buckets, in bucket order."""
        return list(self._steps)

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def _arrived(self, k: int, param: nn.Parameter) -> None:
        if not self._armed:
            return
        count = self._counts.get(param, 0) + 1
        self._counts[param] = count
        if count == self._arrivals:
            self._missing[k] -= 1
            self._hand_over()

    def _hand_over(self, everything: bool = False) -> None:
        """Give the thread the next buckets in order, as long as they are complete (or all of them)."""
        while self._next < len(self._steps) and (everything or self._missing[self._next] == 0):
            self._futures.append(self._executor.submit(self._sync_and_step, self._next))
            self._next += 1

    def _sync_and_step(self, k: int) -> None:
        for flat in (self._sums[k], self._nodes[k]):
            if flat is not None:
                dist.all_reduce(flat.pack(), group=flat.group)
                flat.unpack()
        if self._clip_norm is not None:
            return
        grads = [p for p in self._params[k] if p.grad is not None]
        if self._clip_value is not None and grads:
            torch.nn.utils.clip_grad_value_(grads, self._clip_value)
        self._steps[k].step()
