"""Pipeline stages and schedules, on top of ``torch.distributed.pipelining``.

The layers are cut into contiguous slices, the pipeline's *stages*. With a single-stage schedule
(GPipe, 1F1B) each stage process holds one; with a multi-stage one (Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) each holds ``stages_per_process`` of them: process
``r`` of ``p`` the stages ``r, r + p, r + 2p, ...`` (a loop), or, for the V-shaped schedules
(ZBVZeroBubble, DualPipeV), ``r`` and ``2p - 1 - r`` (so the first process holds the first and the
last stage). Each stage process wraps its slices in ``PipelineStage``s and runs the schedule over the
micro-batches of the pipeline's share of the batch.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
from functools import lru_cache
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    get_schedule_class,
)
from torch.utils._pytree import tree_flatten

from lightning_hetero.multimodal import WIRE_DTYPES, in_backward, micro_batch
from lightning_hetero.module import run_layers

__all__ = [
    "available_schedules",
    "partition_layers",
    "resolve_schedule",
    "schedule_name",
    "is_multi_stage",
    "schedule_class",
    "stages_of",
    "holders",
    "schedule_actions",
    "StageModule",
    "Pipeline",
]

MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""torch's schedules that run several stages per process, by name."""
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
"""Multi-stage schedules that hold two stages per process in a V: process ``r`` stages ``r`` and ``2p - 1 - r``."""
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Schedules that split the backward: the weights' gradients come in a pass of their own."""
INTRODUCED = {"InterleavedZeroBubble": "2.5", "ZBVZeroBubble": "2.6", "DualPipeV": "2.8"}
"""The torch release that brought each of the newer schedules."""

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
    """The name ``get_schedule_class`` knows a schedule by (a plan holds names): torch's own spelling
    of a name it knows in any case (``"dualpipev"`` is ``"DualPipeV"``), another name as given, or a
    schedule class's."""
    if isinstance(schedule, str):
        try:
            schedule = get_schedule_class(schedule)
        except ValueError:
            return schedule
    name = getattr(schedule, "__name__", "").removeprefix("Schedule")
    try:
        if get_schedule_class(name) is schedule:
            return name
    except ValueError:
        pass
    raise ValueError(f"Schedule {schedule!r} is not one of torch's pipeline schedules; pass a schedule's name (e.g. 'GPipe').")


def is_multi_stage(schedule: type) -> bool:
    """Whether ``schedule`` runs several stages per process."""
    return isinstance(schedule, type) and issubclass(schedule, PipelineScheduleMulti)


def schedule_class(schedule: ScheduleArg) -> type:
    """The class of a schedule torch knows by this name (a class as given); a clear error otherwise."""
    if not isinstance(schedule, str):
        return schedule
    try:
        return get_schedule_class(schedule)
    except ValueError:
        since = INTRODUCED.get(schedule)
        if since is not None:
            raise ValueError(
                f"Schedule {schedule!r} came with torch {since}; this torch ({torch.__version__}) lacks it. Upgrade torch,"
                " or pick another schedule."
            ) from None
        raise ValueError(
            f"Schedule {schedule!r} is not one of torch's pipeline schedules (single-stage: 'GPipe', '1F1B'; several stages"
            f" per process: {_names(MULTI_STAGE)})."
        ) from None


def resolve_schedule(schedule: ScheduleArg, num_stages: int, micro_batches: int, per_process: int = 1) -> type:
    """The schedule class for a name ``get_schedule_class`` knows, checked against the layout:
    ``num_stages`` stage processes, each holding ``per_process`` stages, and ``micro_batches``."""
    cls = schedule_class(schedule)
    multi = is_multi_stage(cls)
    if cls in (PipelineScheduleSingle, PipelineScheduleMulti):
        raise ValueError(f"{schedule!r} is torch's base class of pipeline schedules; pass a schedule's name (e.g. 'GPipe').")
    if not multi and not (isinstance(cls, type) and issubclass(cls, PipelineScheduleSingle)):
        raise ValueError(f"{schedule!r} is not a pipeline schedule; pass a schedule's name (e.g. 'GPipe').")
    name = schedule_name(cls)
    if not multi and per_process != 1:
        raise ValueError(
            f"Schedule {name} runs one stage per process; `stages_per_process={per_process}` needs a multi-stage"
            f" schedule ({_names(MULTI_STAGE)})."
        )
    if multi and per_process < 2:
        raise ValueError(f"Schedule {name} runs several stages per process: `stages_per_process` must be 2 or more.")
    if name in V_SHAPED and per_process != 2:
        raise ValueError(f"Schedule {name} places two stages per process in a V: `stages_per_process` must be 2.")
    if not takes(cls, num_stages, per_process, micro_batches):
        raise ValueError(
            f"Schedule {name} cannot run `micro_batches={micro_batches}` with {num_stages} stage process(es)"
            f" x {per_process} stage(s): {needs(cls, num_stages, per_process)}."
        )
    return cls


def available_schedules(names: Sequence[str] = MULTI_STAGE) -> list[str]:
    """The schedules of ``names`` this torch has (each came with a release of its own: ``INTRODUCED``)."""
    found = []
    for name in names:
        try:
            get_schedule_class(name)
        except ValueError:
            continue
        found.append(name)
    return found


def _names(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names)


def min_micro_batches(schedule: type, num_stages: int, per_process: int = 1) -> int:
    """The fewest micro-batches ``schedule`` runs with (1F1B keeps every stage busy, so one per stage)."""
    if is_multi_stage(schedule):
        return num_stages * per_process if schedule_name(schedule) == "DualPipeV" else 1
    return num_stages if issubclass(schedule, Schedule1F1B) else 1


def takes(schedule: type, num_stages: int, per_process: int, micro_batches: int) -> bool:
    """Whether ``schedule`` runs ``micro_batches``: the interleaved ones run them in rounds of at most
    one per stage process, so the rounds must divide them (torch's rule)."""
    if micro_batches < min_micro_batches(schedule, num_stages, per_process):
        return False
    if schedule_name(schedule) in ("Interleaved1F1B", "InterleavedZeroBubble"):
        return micro_batches % max(1, micro_batches // num_stages) == 0
    return True


def needs(schedule: type, num_stages: int, per_process: int) -> str:
    """What ``schedule`` asks of the micro-batch count, in words."""
    name = schedule_name(schedule)
    if name == "DualPipeV":
        return f"at least one micro-batch per stage, {num_stages * per_process}"
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        return (
            f"fewer than {2 * num_stages} micro-batches, or a number its rounds (micro_batches // {num_stages})"
            f" divide, e.g. {2 * num_stages} or {3 * num_stages}"
        )
    if issubclass(schedule, Schedule1F1B):
        return f"it needs at least as many micro-batches as stages ({num_stages}); raise `micro_batches`, or use 'GPipe'"
    return f"at least {min_micro_batches(schedule, num_stages, per_process)}"


def fallback(schedule: type, num_stages: int, per_process: int, micro_batches: int) -> type:
    """The schedule a share that splits into fewer micro-batches than ``schedule`` takes runs instead
    (the same stages in the same places, the same gradients in another order): GPipe for one stage per
    process, LoopedBFS for a loop, ZBVZeroBubble for a V."""
    if takes(schedule, num_stages, per_process, micro_batches):
        return schedule
    if not is_multi_stage(schedule):
        return ScheduleGPipe
    return get_schedule_class("ZBVZeroBubble" if schedule_name(schedule) in V_SHAPED else "LoopedBFS")


def stages_of(process: int, num_processes: int, per_process: int, v_shaped: bool) -> list[int]:
    """The stages stage process ``process`` holds, in order."""
    if v_shaped:
        return [process, 2 * num_processes - 1 - process]
    return [process + k * num_processes for k in range(per_process)]


def holders(num_processes: int, per_process: int, v_shaped: bool) -> list[int]:
    """The stage process that holds each stage."""
    owner = [0] * (num_processes * per_process)
    for process in range(num_processes):
        for stage in stages_of(process, num_processes, per_process, v_shaped):
            owner[stage] = process
    return owner


Action = tuple[str, int, int]
"""One step of a schedule on one stage process: its kind (``"F"`` forward, ``"B"`` whole backward,
``"I"`` the input's gradient, ``"W"`` the weights'), the stage, the micro-batch."""


def schedule_actions(schedule: ScheduleArg, num_processes: int, per_process: int, micro_batches: int) -> list[list[Action]]:
    """Each stage process's computations in the order ``schedule`` runs them. A multi-stage
    schedule's are torch's own (its ``pipeline_order``, read without processes: DualPipeV's
    overlapped forward and backward as the two, one after the other); GPipe runs every forward,
    then every backward; 1F1B warms up with ``num_processes - 1 - process`` forwards, then
    alternates."""
    cls = schedule_class(schedule)
    return [list(order) for order in _actions(cls, num_processes, per_process, micro_batches)]


@lru_cache(maxsize=512)
def _actions(cls: type, num_processes: int, per_process: int, micro_batches: int) -> tuple[tuple[Action, ...], ...]:
    if not is_multi_stage(cls):
        one_f_one_b = issubclass(cls, Schedule1F1B)
        return tuple(_single_stage(one_f_one_b, r, num_processes, micro_batches) for r in range(num_processes))
    v_shaped = schedule_name(cls) in V_SHAPED
    count = num_processes * per_process
    stages = [_OrderOnly(s, count, num_processes, 0) for s in stages_of(0, num_processes, per_process, v_shaped)]
    order = cls(stages, micro_batches, loss_fn=_no_loss).pipeline_order
    return tuple(tuple(_computations(order.get(r, []))) for r in range(num_processes))


def _single_stage(one_f_one_b: bool, process: int, num_processes: int, micro_batches: int) -> tuple[Action, ...]:
    if not one_f_one_b:
        return tuple([("F", process, k) for k in range(micro_batches)] + [("B", process, k) for k in range(micro_batches)])
    warmup = min(micro_batches, num_processes - process - 1)
    order = [("F", process, k) for k in range(warmup)]
    for k in range(micro_batches - warmup):
        order += [("F", process, warmup + k), ("B", process, k)]
    return tuple(order + [("B", process, k) for k in range(micro_batches - warmup, micro_batches)])


def _computations(actions: Sequence[Any]) -> list[Action]:
    found: list[Action] = []
    for action in actions:
        if action is None:
            continue
        if action.sub_actions:
            found += _computations(action.sub_actions)
        elif action.computation_type.value in ("F", "B", "I", "W"):
            found.append((action.computation_type.value, action.stage_index, action.microbatch_index))
    return found


def _no_loss(output: Any, target: Any) -> Tensor:
    raise AssertionError("a schedule built to read its order runs nothing")


class _OrderOnly(PipelineStage):
    """What a schedule reads of its stages to lay out its order, and nothing else: no module, no
    process group (``schedule_actions``)."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int) -> None:
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank = group_size, group_rank
        self.has_backward, self.group, self.submod = True, None, None
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.dw_builder, self.chunks = None, None


class StageModule(nn.Module):
    """One stage's slice of the layers, run in order exactly as ``PipelineModule.forward`` runs them.
    ``first``: the slice begins the model, and takes the model's inputs; ``last``: it ends the model,
    and its outputs go to the loss rather than to another stage."""

    def __init__(self, layers: Sequence[nn.Module], first: bool = True, last: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.first, self.last = first, last

    def forward(self, *args: Any, **inputs: Any) -> Any:
        # A dict of inputs travels as keyword arguments (torch's stages take only tensors as
        # positional ones); the first block takes it as one dict, as `PipelineModule.forward` gives it.
        # A multi-stage schedule hands those keyword arguments to every stage of the process that holds
        # the first: the others take the stage before's outputs only.
        if not self.first:
            inputs = {}
        outputs = run_layers(self.layers, inputs if inputs else args if len(args) > 1 else args[0])
        if not self.last and not _sendable(outputs):
            raise TypeError(
                f"A pipeline block ({type(self.layers[-1]).__name__}, the last of its stage) returned a"
                f" {type(outputs).__name__}, which a stage cannot send to the next: torch's pipelining sends a"
                " tensor, or a tuple of tensors. Return a tuple from the block (and take one in the next)."
            )
        if self.last and torch.is_grad_enabled() and not _sendable(outputs):
            raise TypeError(
                f"The model's last block ({type(self.layers[-1]).__name__}) returned a {type(outputs).__name__},"
                " which torch's pipelining cannot hand to `pipeline_loss`: it takes a tensor, or a tuple of"
                " tensors, from a stage. Return a tuple from the block (and take one in `pipeline_loss`)."
            )
        return _attached(outputs) if torch.is_grad_enabled() else outputs


def _sendable(outputs: Any) -> bool:
    # (A list would arrive as a tuple, unpacked into the next block's arguments.)
    if isinstance(outputs, tuple):
        return bool(outputs) and all(isinstance(o, Tensor) for o in outputs)
    return isinstance(outputs, Tensor)


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

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        # Zero-bubble schedules: the weights' gradients, in a pass of their own, which torch adds to
        # `.grad` by hand, so their post-accumulate hooks (fine mode's count of arrived gradients)
        # would not run: run them for every weight whose gradient the pass changed, as autograd would,
        # unless autograd did (where the pass is a whole backward: a first stage, whose inputs need none).
        weights = [p for p in self.submod.parameters() if p.requires_grad and p._post_accumulate_grad_hooks]
        before = [_grad_version(p) for p in weights]
        seen: set[nn.Parameter] = set()
        handles = [p.register_post_accumulate_grad_hook(seen.add) for p in weights]
        try:
            with self.clock.device_span("stage") if self.clock is not None else nullcontext(), in_backward():
                result = super().backward_weight_one_chunk(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        for p, version in zip(weights, before):
            if p not in seen and _grad_version(p) != version:
                for hook in list(p._post_accumulate_grad_hooks.values()):
                    hook(p)
        return result


def _grad_version(param: nn.Parameter) -> tuple[int, int] | None:
    """What changes when a gradient is set or added to."""
    grad = param.grad
    return None if grad is None else (id(grad), grad._version)


class _ScaledLoss:
    """The stage's loss function: the user's mean loss times this step's weight for the pipeline's share."""

    def __init__(self, loss_fn: Callable[[Any, Any], Tensor]) -> None:
        self.loss_fn = loss_fn
        self.scale = 1.0

    def __call__(self, output: Any, target: Any) -> Tensor:
        return self.loss_fn(output, target) * self.scale


class Pipeline:
    """This rank's pipeline stages (one, or several with a multi-stage schedule), with one schedule
    per batch layout.

    ``PipelineStage`` fixes its buffer shapes on the first step it runs, so new stages and a new
    schedule are built whenever the micro-batch shape or count changes (e.g. the last, smaller
    batch of an epoch, or a new CPU fraction). Every stage rank derives the same key from the
    batch, so all ranks build and evict in step.
    """

    _MAX_LAYOUTS = 4

    def __init__(
        self,
        *,
        modules: Sequence[StageModule],
        stage_indices: Sequence[int],
        holders: Sequence[int],
        device: torch.device,
        group: dist.ProcessGroup,
        schedule: type,
        loss_fn: Callable[[Any, Any], Tensor],
    ) -> None:
        self.modules = list(modules)
        self.stage_indices = list(stage_indices)
        self.holders = list(holders)
        """The stage process that holds each stage, every process's (``stages_of``)."""
        self.num_stages = len(self.holders)
        """Stages in all, every process's."""
        self.device = device
        self.group = group
        self.schedule_cls = schedule
        self._loss = _ScaledLoss(loss_fn)
        self._schedules: OrderedDict[tuple, Any] = OrderedDict()

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        """Whether this process holds the last stage, which computes the loss (the first process, in a V)."""
        return self.num_stages - 1 in self.stage_indices

    def train_step(
        self, inputs: Any, targets: Any, micro_batches: int, loss_scale: float, clock: Any = None
    ) -> tuple[Any, Tensor | float]:
        """Forward and backward over the share; on the last stage, return the merged outputs and the
        share's mean loss, a 0-dim tensor on the stage's device, not waited for (``None`` and ``nan``
        on the other stages).

        The loss of each micro-batch is multiplied by ``loss_scale`` before its backward; pass the
        share's weight in the global batch divided by ``micro_batches``, so the gradients left in
        the stage's parameters are exactly this share's contribution to the batch-mean gradient.
        """
        schedule = self._schedule(True, micro_batches, inputs)
        for stage in getattr(schedule, "_stages", None) or [schedule._stage]:
            stage.clock = clock
        self._loss.scale = loss_scale
        losses: list[Tensor] = []
        kwargs = {"target": move_data_to_device(targets, self.device), "losses": losses} if self.is_last else {}
        args, inputs_by_name = self._first_stage_args(inputs)
        outputs = schedule.step(*args, **inputs_by_name, **kwargs)
        if not losses:
            return outputs, float("nan")
        summed = torch.stack([loss.detach().to(torch.promote_types(loss.dtype, torch.float32)) for loss in losses]).sum()
        return outputs, summed / (loss_scale * micro_batches)

    def eval_step(self, inputs: Any, micro_batches: int) -> Any:
        """Forward only over the share; return the merged outputs on the last stage."""
        args, inputs_by_name = self._first_stage_args(inputs)
        if any(a == b for a, b in zip(self.holders, self.holders[1:])):
            # torch's runtime passes gradients between consecutive stages a process holds (a V's turn;
            # a loop on one process) even where there is no backward, and fails: the forward runs
            # here, every micro-batch in stage order.
            return self._forward_in_stage_order(args, inputs_by_name, micro_batches)
        schedule = self._schedule(False, micro_batches, inputs)
        return schedule.step(*args, **inputs_by_name)

    def _forward_in_stage_order(self, args: tuple, kwargs: dict[str, Any], micro_batches: int) -> Any:
        """Each micro-batch through every stage in order: this process runs its stages, receives a
        stage's inputs from the process of the stage before and sends its outputs on (over the
        pipeline's group, whose rank ``r`` is stage process ``r``); the last stage's outputs, merged."""
        me, owner = dist.get_rank(self.group), self.holders
        modules = dict(zip(self.stage_indices, self.modules))
        chunks = _chunks(args, kwargs, micro_batches) if self.is_first else [None] * micro_batches
        outputs = []
        for chunk in chunks:
            carried: Any = None
            for stage in range(self.num_stages):
                if owner[stage] != me:
                    continue
                if stage == 0:
                    chunk_args, chunk_kwargs = chunk
                    carried = modules[0](*chunk_args, **chunk_kwargs)
                else:
                    if owner[stage - 1] != me:
                        carried = _receive_tensors(owner[stage - 1], self.group, self.device)
                    carried = modules[stage](*carried) if isinstance(carried, tuple) else modules[stage](carried)
                if stage == self.num_stages - 1:
                    outputs.append(carried)
                elif owner[stage + 1] != me:
                    _send_tensors(carried, owner[stage + 1], self.group, self.device)
        if not outputs:
            return None
        if isinstance(outputs[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*outputs))
        return torch.cat(outputs)

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

    def _schedule(self, train: bool, micro_batches: int, inputs: Any) -> Any:
        key = (train, micro_batches, _layout(inputs))
        schedule = self._schedules.get(key)
        if schedule is None:
            stages = [
                _TimedStage(module, index, self.num_stages, self.device, group=self.group)
                for module, index in zip(self.modules, self.stage_indices)
            ]
            loss = self._loss if train else None
            processes = len(set(self.holders))
            # A batch that only splits into fewer micro-batches than the schedule takes (see `shares.py`)
            # runs GPipe's order on the same stages, which computes the same gradients in another order.
            cls = fallback(self.schedule_cls, processes, len(stages), micro_batches)
            # `loss_scale` already carries the 1/micro_batches factor; torch's own scaling
            # (scale_grads) would also divide the gradients accumulated over earlier steps.
            schedule = cls(stages if is_multi_stage(cls) else stages[0], micro_batches, loss_fn=loss, scale_grads=False)
            self._schedules[key] = schedule
            if len(self._schedules) > self._MAX_LAYOUTS:
                self._schedules.popitem(last=False)
        else:
            self._schedules.move_to_end(key)
        return schedule


def _chunks(args: tuple, kwargs: dict[str, Any], count: int) -> list[tuple[tuple, dict[str, Any]]]:
    """The first stage's inputs cut into ``count`` micro-batches along their first dimension."""
    def cut(value: Any) -> list[Any]:
        return list(torch.tensor_split(value, count)) if isinstance(value, Tensor) else [value] * count

    pieces = [cut(a) for a in args]
    named = {k: cut(v) for k, v in kwargs.items()}
    return [(tuple(p[k] for p in pieces), {n: v[k] for n, v in named.items()}) for k in range(count)]


def _send_tensors(value: Any, dst: int, group: dist.ProcessGroup, device: torch.device) -> None:
    """A stage's outputs (a tensor or a tuple of them) to group rank ``dst``: how many, each one's dtype
    and shape, then each."""
    tensors = value if isinstance(value, tuple) else (value,)
    header = [len(tensors), int(isinstance(value, tuple))]
    for t in tensors:
        header += [WIRE_DTYPES.index(t.dtype), t.dim(), *t.shape]
    size = torch.tensor([len(header)], dtype=torch.int64, device=device)
    dist.send(size, group_dst=dst, group=group)
    dist.send(torch.tensor(header, dtype=torch.int64, device=device), group_dst=dst, group=group)
    for t in tensors:
        dist.send(t.detach().contiguous(), group_dst=dst, group=group)


def _receive_tensors(src: int, group: dist.ProcessGroup, device: torch.device) -> Any:
    """What ``_send_tensors`` sent from group rank ``src``."""
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, group_src=src, group=group)
    header = torch.empty(int(size), dtype=torch.int64, device=device)
    dist.recv(header, group_src=src, group=group)
    fields, tensors = header.tolist(), []
    count, is_tuple, at = fields[0], fields[1], 2
    for _ in range(count):
        dtype, ndim = WIRE_DTYPES[fields[at]], fields[at + 1]
        shape = fields[at + 2 : at + 2 + ndim]
        at += 2 + ndim
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, group_src=src, group=group)
        tensors.append(tensor)
    return tuple(tensors) if is_tuple else tensors[0]


def _layout(inputs: Any) -> tuple:
    leaves, spec = tree_flatten(inputs)
    return str(spec), tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, Tensor))

