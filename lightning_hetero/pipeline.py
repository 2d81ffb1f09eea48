"""Pipeline stages and schedules, on top of ``torch.distributed.pipelining``.

The layers are cut into contiguous slices, one per stage rank. Each stage rank wraps its slice in
a ``PipelineStage`` and runs a single-stage-per-rank schedule (GPipe, 1F1B, ...) over the
micro-batches of the pipeline's share of the batch.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    get_schedule_class,
)
from torch.utils._pytree import tree_flatten

from lightning_hetero.multimodal import in_backward, micro_batch
from lightning_hetero.module import run_layers

__all__ = ["partition_layers", "resolve_schedule", "schedule_name", "StageModule", "Pipeline"]

ScheduleArg = Union[str, type]


def partition_layers(layers: Sequence[nn.Module], num_stages: int) -> list[tuple[int, int]]:
    """Cut ``layers`` into ``num_stages`` contiguous ``[start, stop)`` slices, none empty.

    Minimizes the largest slice's parameter count (a stand-in for its cost until a profile is
    available); each layer also counts one unit so parameter-free layers spread out too.
    """
    if num_stages > len(layers):
        raise ValueError(
            f"Cannot cut {len(layers)} layer(s) into {num_stages} pipeline stages: each stage needs at least one"
            " layer. Use fewer stages, or return finer-grained blocks from `pipeline_layers()`."
        )
    costs = [1 + sum(p.numel() for p in layer.parameters()) for layer in layers]
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    n = len(layers)
    # best[k][i]: the smallest possible largest-slice cost of cutting the first i layers into k slices.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds = []
    stop = n
    for k in range(num_stages, 0, -1):
        start = cut[k][stop]
        bounds.append((start, stop))
        stop = start
    return bounds[::-1]


def schedule_name(schedule: ScheduleArg) -> str:
    """The name ``get_schedule_class`` knows a schedule by (a plan holds names): a name as given, or
    a schedule class's."""
    if isinstance(schedule, str):
        return schedule
    name = getattr(schedule, "__name__", "").removeprefix("Schedule")
    try:
        if get_schedule_class(name) is schedule:
            return name
    except ValueError:
        pass
    raise ValueError(f"Schedule {schedule!r} is not one of torch's pipeline schedules; pass a schedule's name (e.g. 'GPipe').")


def resolve_schedule(schedule: ScheduleArg, num_stages: int, micro_batches: int) -> type[PipelineScheduleSingle]:
    """The schedule class for a name ``get_schedule_class`` knows, limited to one stage per rank."""
    cls = get_schedule_class(schedule) if isinstance(schedule, str) else schedule
    single = isinstance(cls, type) and issubclass(cls, PipelineScheduleSingle) and cls is not PipelineScheduleSingle
    if not single:
        raise ValueError(
            f"Schedule {schedule!r} runs several stages per rank (or is not a schedule); the hetero strategy runs"
            " one stage per rank. Use a single-stage schedule such as 'GPipe' or '1F1B'."
        )
    if micro_batches < min_micro_batches(cls, num_stages):
        raise ValueError(
            f"Schedule {cls.__name__} needs at least as many micro-batches as stages: `micro_batches={micro_batches}`"
            f" with {num_stages} stages. Raise `micro_batches` or use 'GPipe'."
        )
    return cls


def min_micro_batches(schedule: type[PipelineScheduleSingle], num_stages: int) -> int:
    """The fewest micro-batches ``schedule`` runs with (1F1B keeps every stage busy, so one per stage)."""
    return num_stages if issubclass(schedule, Schedule1F1B) else 1


class StageModule(nn.Module):
    """One stage's slice of the layers, run in order exactly as ``PipelineModule.forward`` runs them."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, *args: Any, **inputs: Any) -> Any:
        # A dict of inputs travels as keyword arguments (torch's stages take only tensors as
        # positional ones); the first block takes it as one dict, as `PipelineModule.forward` gives it.
        outputs = run_layers(self.layers, inputs if inputs else args if len(args) > 1 else args[0])
        return _attached(outputs) if torch.is_grad_enabled() else outputs


def _attached(outputs: Any) -> Any:
    """Outputs that take part in autograd even when nothing before them needs a gradient.

    A stage whose layers are all frozen and whose inputs are data (a frozen first stage, e.g. a
    frozen embedding) produces outputs without a graph, and the schedule's backward of them
    fails. Adding a zero that requires grad changes no value and lets the backward run through.
    """
    if isinstance(outputs, tuple):
        return tuple(_attached(o) for o in outputs)
    if isinstance(outputs, Tensor) and outputs.is_floating_point() and not outputs.requires_grad:
        return outputs + torch.zeros((), dtype=outputs.dtype, device=outputs.device, requires_grad=True)
    return outputs


class _TimedStage(PipelineStage):
    """A ``PipelineStage`` that times its layers' forward and backward into the step's clock
    (the schedule's sends and receives between them are not included)."""

    clock: Any = None

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self.clock.device_span("stage") if self.clock is not None else nullcontext(), micro_batch():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self.clock.device_span("stage") if self.clock is not None else nullcontext(), in_backward():
            return super().backward_one_chunk(*args, **kwargs)


class _ScaledLoss:
    """The stage's loss function: the user's mean loss times this step's weight for the pipeline's share."""

    def __init__(self, loss_fn: Callable[[Any, Any], Tensor]) -> None:
        self.loss_fn = loss_fn
        self.scale = 1.0

    def __call__(self, output: Any, target: Any) -> Tensor:
        return self.loss_fn(output, target) * self.scale


class Pipeline:
    """This rank's pipeline stage, with one schedule per batch layout.

    ``PipelineStage`` fixes its buffer shapes on the first step it runs, so a new stage and
    schedule are built whenever the micro-batch shape or count changes (e.g. the last, smaller
    batch of an epoch, or a new CPU fraction). Every stage rank derives the same key from the
    batch, so all ranks build and evict in step.
    """

    _MAX_LAYOUTS = 4

    def __init__(
        self,
        *,
        module: StageModule,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        group: dist.ProcessGroup,
        schedule: type[PipelineScheduleSingle],
        loss_fn: Callable[[Any, Any], Tensor],
    ) -> None:
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = device
        self.group = group
        self.schedule_cls = schedule
        self._loss = _ScaledLoss(loss_fn)
        self._schedules: OrderedDict[tuple, PipelineScheduleSingle] = OrderedDict()

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def train_step(
        self, inputs: Any, targets: Any, micro_batches: int, loss_scale: float, clock: Any = None
    ) -> tuple[Any, float]:
        """Forward and backward over the share; on the last stage, return the merged outputs and the
        share's mean loss (``None`` and ``nan`` on the other stages).

        The loss of each micro-batch is multiplied by ``loss_scale`` before its backward; pass the
        share's weight in the global batch divided by ``micro_batches``, so the gradients left in
        the stage's parameters are exactly this share's contribution to the batch-mean gradient.
        """
        schedule = self._schedule(True, micro_batches, inputs)
        schedule._stage.clock = clock
        self._loss.scale = loss_scale
        losses: list[Tensor] = []
        kwargs = {"target": move_data_to_device(targets, self.device), "losses": losses} if self.is_last else {}
        args, inputs_by_name = self._first_stage_args(inputs)
        outputs = schedule.step(*args, **inputs_by_name, **kwargs)
        mean = sum(float(loss.detach()) for loss in losses) / (loss_scale * micro_batches) if losses else float("nan")
        return outputs, mean

    def eval_step(self, inputs: Any, micro_batches: int) -> Any:
        """Forward only over the share; return the merged outputs on the last stage."""
        schedule = self._schedule(False, micro_batches, inputs)
        args, inputs_by_name = self._first_stage_args(inputs)
        return schedule.step(*args, **inputs_by_name)

    def _first_stage_args(self, inputs: Any) -> tuple[tuple, dict[str, Any]]:
        """The first stage's inputs as the schedule's positional arguments, or, for a dict, keyword ones."""
        if not self.is_first:
            return (), {}
        inputs = move_data_to_device(inputs, self.device)
        if isinstance(inputs, Mapping):
            if {"target", "losses"} & set(inputs):
                raise ValueError("A dict of inputs to the first block cannot have the keys 'target' or 'losses'.")
            return (), dict(inputs)
        return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), {}

    def _schedule(self, train: bool, micro_batches: int, inputs: Any) -> PipelineScheduleSingle:
        key = (train, micro_batches, _layout(inputs))
        schedule = self._schedules.get(key)
        if schedule is None:
            stage = _TimedStage(self.module, self.stage_index, self.num_stages, self.device, group=self.group)
            loss = self._loss if train else None
            cls = self.schedule_cls
            if micro_batches < min_micro_batches(cls, self.num_stages):
                # A batch that only splits into fewer micro-batches (see `shares.py`) runs GPipe,
                # which computes the same gradients in a different order.
                cls = ScheduleGPipe
            # `loss_scale` already carries the 1/micro_batches factor; torch's own scaling
            # (scale_grads) would also divide the gradients accumulated over earlier steps.
            schedule = cls(stage, micro_batches, loss_fn=loss, scale_grads=False)
            self._schedules[key] = schedule
            if len(self._schedules) > self._MAX_LAYOUTS:
                self._schedules.popitem(last=False)
        else:
            self._schedules.move_to_end(key)
        return schedule


def _layout(inputs: Any) -> tuple:
    leaves, spec = tree_flatten(inputs)
    return str(spec), tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, Tensor))

