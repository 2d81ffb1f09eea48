"""Gradient synchronization between the CPU workers and the pipeline stages.

Each worker's backward leaves its share's *weighted* contribution in ``.grad`` (the loss was
scaled by the share's fraction of the batch), so summing the contributions gives every rank the
gradient of the whole batch, as in one process. For each stage, the stage rank and the CPU
workers sum the gradients of that stage's parameters in one flat buffer (gloo; CUDA gradients go
through a pinned CPU buffer). Where there are several nodes, each rank then averages with its
peers on the other nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["GradientSync", "set_grads_aside", "restore_grads", "add_grads", "global_grad_norm"]


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
        self.buffer = torch.empty(sum(self.sizes) + len(params), dtype=params[0].dtype, pin_memory=pin)

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
