"""BatchNorm across the replicas of a hetero run: what its statistics are, in two modes.

Every replica (CPU worker or device) normalizes its own share of each batch. Two choices for the
statistics, as with Lightning's DDP:

- **Per share** (the default, DDP's): each replica normalizes its share with the share's own
  batch statistics; after every training batch the running buffers are averaged over the
  replicas, each weighted by its samples (``average_running_stats``), so that every replica holds
  the same buffers. The running mean is then exactly one device's (its update is linear in the
  batch mean); the running variance averages the shares' variances, leaving out the variance
  between the shares' means, and the gradients are those of per-share normalization: close to
  one device, not equal.
- **Whole batch** (``Trainer(sync_batchnorm=True)``): each BatchNorm layer becomes a
  ``WholeBatchNorm``, which sums the per-channel counts, sums and sums of squares of every
  replica's share (a collective over the replicas that have a share this step, on every node) and
  normalizes with the statistics of the whole batch (the global batch with several nodes, as DDP's
  ``SyncBatchNorm`` takes them); its backward sums the two per-channel terms of the
  input's gradient the same way. Outputs, gradients and running buffers are then one device's,
  as torch's ``SyncBatchNorm`` does on GPUs (which refuses CPU tensors). After the run the layers
  are BatchNorm again (``revert``). In a multimodal model's encoder, the layers sum over the
  replicas whose share carries that encoder's modality (the others do not call it), on one node.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_hetero.shares import slice_batch

__all__ = [
    "StatsGroup",
    "WholeBatchNorm",
    "ReplicaNorm",
    "convert",
    "revert",
    "average_running_stats",
    "has_batch_norm",
]


def has_batch_norm(module: nn.Module) -> bool:
    """Whether ``module`` has a BatchNorm layer (of any dimension)."""
    return any(isinstance(m, _BatchNorm) for m in module.modules())


class StatsGroup:
    """Whom the ``WholeBatchNorm`` layers of this process sum their statistics with in the step
    running now: the process group of the replicas with a share, or ``None`` where this process
    is the only one (its share is the whole batch)."""

    def __init__(self) -> None:
        self.group: Optional[dist.ProcessGroup] = None


def _sum(tensor: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """``tensor`` summed over ``group`` (gloo, through a CPU copy), in float64 for the sums of squares."""
    if group is None:
        return tensor
    total = tensor.detach().to("cpu", torch.float64)
    dist.all_reduce(total, group=group)
    return total.to(tensor.device, tensor.dtype)


class _WholeBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, group: Optional[dist.ProcessGroup]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        dims = [d for d in range(x.dim()) if d != 1]
        acc = x.to(torch.promote_types(x.dtype, torch.float32))  # the sums of squares need the range
        count = torch.tensor([x.numel() // x.shape[1]], dtype=acc.dtype, device=x.device)
        total = _sum(torch.cat([count, acc.sum(dims), (acc * acc).sum(dims)]), group)
        n, channels = total[0], x.shape[1]
        mean = total[1 : 1 + channels] / n
        var = (total[1 + channels :] / n - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        shape = [1, channels] + [1] * (x.dim() - 2)
        xhat = ((acc - mean.view(shape)) * invstd.view(shape)).to(x.dtype)
        y = xhat * weight.view(shape) if weight is not None else xhat.clone()
        if bias is not None:
            y = y + bias.view(shape)
        invstd = invstd.to(x.dtype)
        ctx.save_for_backward(xhat, weight, invstd, n)
        ctx.group, ctx.dims, ctx.shape = group, dims, shape
        ctx.has_bias = bias is not None
        ctx.mark_non_differentiable(mean, var, n)
        return y, mean, var, n

    @staticmethod
    def backward(ctx: Any, dy: Tensor, *_: Any) -> tuple[Any, ...]:  # type: ignore[override]
        xhat, weight, invstd, n = ctx.saved_tensors
        dims, shape = ctx.dims, ctx.shape
        sum_dy, sum_dy_xhat = dy.sum(dims), (dy * xhat).sum(dims)
        grad_weight = sum_dy_xhat if weight is not None else None
        grad_bias = sum_dy if ctx.has_bias else None
        # The input's gradient needs both sums over the whole batch; the parameters' are this
        # share's part, which the gradient sync adds to the other replicas' parts.
        total = _sum(torch.cat([sum_dy, sum_dy_xhat]), ctx.group)
        channels = sum_dy.shape[0]
        mean_dy, mean_dy_xhat = (total[:channels] / n).to(dy.dtype), (total[channels:] / n).to(dy.dtype)
        scale = invstd * (weight if weight is not None else 1)
        dx = (dy - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape)
        return dx, grad_weight, grad_bias, None, None


class WholeBatchNorm(_BatchNorm):
    """A BatchNorm layer (any dimension) that normalizes with the statistics of the whole batch,
    summed over the replicas that share it (``StatsGroup``); its parameters and buffers are the
    layer's it replaces, under the same names, so checkpoints stay ordinary ones."""

    def __init__(self, layer: _BatchNorm, stats: StatsGroup) -> None:
        super().__init__(layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats)
        self.weight, self.bias = layer.weight, layer.bias
        self.running_mean, self.running_var = layer.running_mean, layer.running_var
        self.num_batches_tracked = layer.num_batches_tracked
        self.training = layer.training
        self.stats = stats
        self.original = type(layer)

    def _check_input_dim(self, input: Tensor) -> None:
        self.original._check_input_dim(self, input)  # type: ignore[arg-type]

    def forward(self, x: Tensor) -> Tensor:
        uses_batch_stats = self.training or not self.track_running_stats
        if self.stats.group is None or not uses_batch_stats:  # alone with the batch, or running statistics
            return super().forward(x)
        self._check_input_dim(x)
        y, mean, var, n = _WholeBatchNormFn.apply(x, self.weight, self.bias, self.eps, self.stats.group)
        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                unbiased = var * n / (n - 1).clamp_min(1)
                self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)
        return y


def convert(module: nn.Module, stats: StatsGroup) -> nn.Module:
    """``module`` with every BatchNorm layer a ``WholeBatchNorm`` (in place where it is a child)."""
    if isinstance(module, _BatchNorm) and not isinstance(module, WholeBatchNorm):
        return WholeBatchNorm(module, stats)
    for name, child in module.named_children():
        converted = convert(child, stats)
        if converted is not child:
            setattr(module, name, converted)
    return module


def revert(module: nn.Module) -> nn.Module:
    """``module`` with every ``WholeBatchNorm`` the BatchNorm layer it was (same tensors)."""
    if isinstance(module, WholeBatchNorm):
        layer = module.original(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
        layer.weight, layer.bias = module.weight, module.bias
        layer.running_mean, layer.running_var = module.running_mean, module.running_var
        layer.num_batches_tracked = module.num_batches_tracked
        layer.train(module.training)
        return layer
    for name, child in module.named_children():
        reverted = revert(child)
        if reverted is not child:
            setattr(module, name, reverted)
    return module


def average_running_stats(
    module: nn.Module, weight: float, group: dist.ProcessGroup, layer_weights: Optional[Mapping[nn.Module, Optional[float]]] = None
) -> None:
    """Per-share mode, after a training batch: every BatchNorm layer's running mean and variance
    become the average of the replicas', each weighted by ``weight`` (its share of the batch; 0
    where it had none), and ``num_batches_tracked`` the largest (a collective over ``group``).
    ``layer_weights``: a layer's own weight where it is not ``weight`` (its share of the rows the
    layer normalized), ``None`` for a layer no replica ran, which keeps its statistics (the same on
    every rank, as every rank's weights say)."""
    weights = {m: weight for m in module.modules() if isinstance(m, _BatchNorm) and m.track_running_stats}
    weights.update({m: w for m, w in (layer_weights or {}).items() if m in weights})
    layers = [m for m, w in weights.items() if w is not None]
    if not layers:
        return
    stats: Sequence[Tensor] = [t for m in layers for t in (m.running_mean, m.running_var)]
    flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) * float(weights[m]) for m in layers for t in (m.running_mean, m.running_var)])
    dist.all_reduce(flat, group=group)
    tracked = torch.stack([m.num_batches_tracked.detach().cpu() for m in layers])
    dist.all_reduce(tracked, op=dist.ReduceOp.MAX, group=group)
    offset = 0
    with torch.no_grad():
        for t in stats:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        for m, count in zip(layers, tracked):
            m.num_batches_tracked.copy_(count)


class ReplicaNorm:
    """What a replica does about its model's BatchNorm layers in every step.

    Whole-batch mode (``whole``): before the step, point the layers at the group of the replicas
    that have a share of this batch (one of ``groups``, keyed by which CPU workers and which
    devices have one, ``make_group`` making one for a key not there yet; ``None`` where this
    replica is alone). Either mode, after a training batch:
    average the running statistics over every rank, weighted by their shares
    (``average_running_stats``): in per-share mode this is what makes them one; in whole-batch
    mode it brings a replica that had no share up to date, and joins the nodes' statistics."""

    def __init__(
        self,
        module: nn.Module,
        whole: bool,
        groups: dict[tuple[tuple[bool, ...], tuple[bool, ...]], Optional[dist.ProcessGroup]],
        devices: int,
        everyone: dist.ProcessGroup,
        num_nodes: int,
        make_group: Callable[[tuple[tuple[bool, ...], tuple[bool, ...]]], dist.ProcessGroup],
        encoders: Optional[Mapping[str, nn.Module]] = None,
        rows_of: Optional[Callable[[Any], dict[str, int]]] = None,
    ) -> None:
        self.module, self.whole, self.groups = module, whole, groups
        self.devices, self.everyone, self.num_nodes = devices, everyone, num_nodes
        self.make_group = make_group
        self.stats = StatsGroup()
        self.encoders = {m: e for m, e in sorted((encoders or {}).items()) if has_batch_norm(e)} if num_nodes == 1 else {}
        """A multimodal model's encoders with BatchNorm layers, by modality (on one node): the replicas
        whose share of a batch carries the modality call them, on its rows (``rows_of`` a share)."""
        self.rows_of = rows_of
        self.encoder_stats: dict[str, StatsGroup] = {}
        self._parts: list[tuple[int, int]] = []
        self._rows: list[dict[str, int]] = []
        """Each replica's share of the latest batch, and the rows of each modality in it."""

    def apply(self) -> None:
        """Convert the layers for this trainer call (whole-batch mode)."""
        if self.whole:
            self.encoder_stats = {m: StatsGroup() for m in self.encoders}
            for modality, encoder in self.encoders.items():
                convert(encoder, self.encoder_stats[modality])
            convert(self.module, self.stats)

    def before(self, shares: Any, training: bool = True, batch: Any = None) -> None:
        """Whole-batch mode: the group this step's statistics are summed over (``batch``: the whole
        batch, whose shares' modalities say who calls each encoder). An evaluation step normalizes
        with the running statistics, and needs none (unless a layer keeps none)."""
        parts = shares.parts(self.devices)
        running = not training and all(m.track_running_stats for m in self.module.modules() if isinstance(m, _BatchNorm))
        if self.encoders and (training or (self.whole and not running)):
            self._parts = parts
            self._rows = [
                self.rows_of(slice_batch(batch, start, stop, shares.batch_size)) if stop > start else {}  # type: ignore[misc]
                for start, stop in parts
            ]
        if not self.whole:
            return
        if running:
            self.stats.group = None
            for stats in self.encoder_stats.values():
                stats.group = None
            return
        has_share = tuple(stop > start for start, stop in parts)
        self.stats.group = self._group(has_share, len(shares.cpu))
        for modality, stats in self.encoder_stats.items():
            stats.group = self._group(tuple(modality in rows for rows in self._rows), len(shares.cpu))

    def _group(self, has_share: tuple[bool, ...], cpu_workers: int) -> Optional[dist.ProcessGroup]:
        cpus, devices = has_share[:cpu_workers], has_share[cpu_workers:]
        if sum(cpus) + sum(devices) <= 1 and self.num_nodes == 1:
            return None
        key = (cpus, devices)
        if key not in self.groups:
            # A batch too small for every replica (an epoch's last), or whose modality only some shares
            # carry: the group of those with a share, made once. Every rank comes here with the same
            # shares and the same batch, those without a share included.
            self.groups[key] = self.make_group(key)
        return self.groups[key]

    def after_training_batch(self, start: int, stop: int, batch_size: int) -> None:
        """After a training batch of which this replica computed samples ``[start, stop)``: the
        running statistics averaged over every rank."""
        weight = (stop - start) / (batch_size * self.num_nodes) if batch_size else 0.0
        layer_weights: dict[nn.Module, Optional[float]] = {}
        if self.encoders:
            mine = next((rows for part, rows in zip(self._parts, self._rows) if part == (start, stop)), {}) if stop > start else {}
            for modality, encoder in self.encoders.items():
                # An encoder's layers normalize the rows of its modality: each replica weighs by its part of them.
                total = sum(rows.get(modality, 0) for rows in self._rows)
                share = mine.get(modality, 0) / total if total else None
                layer_weights.update({m: share for m in encoder.modules() if isinstance(m, _BatchNorm)})
        average_running_stats(self.module, weight, self.everyone, layer_weights)
