"""Gradient synchronization between the CPU workers and the pipeline stages.

Each worker's backward leaves its share's *weighted* contribution in ``.grad`` (the loss was
scaled by the share's fraction of the batch), so summing the contributions gives every rank the
gradient of the whole batch, as in one process. For each stage, the stage rank and the CPU
workers sum the gradients of that stage's parameters in one flat buffer (gloo; CUDA gradients go
through a pinned CPU buffer). Where there are several nodes, each rank then averages with its
peers on the other nodes.

Both modes implement one interface, ``GradSync``, which the step engine calls at the same points
of every optimizer step (``engine.py``): ``begin`` before the backward of its last batch,
``after_backward`` once that backward is done, ``finish`` in Lightning's backward, ``clip_by_norm``
and ``clip_by_value`` from the precision plugin, ``before_update`` after them and ``after_update``
after the optimizer's step (a CPU worker's share of a split optimizer, ``sharding.py``), ``close`` at
teardown. Coarse mode (``CoarseSync``)
sums everything in ``finish``, after the backward. Fine mode (``FineSync``) sums and steps bucket by
bucket while the backward is still running, and has clipped and stepped everything by
``after_backward``.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from concurrent.futures import Future
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hetero.finite import finite_flag
from lightning_hetero.mesh import LocalMesh, sum_over
from lightning_hetero.offload import BucketStep, OffloadStep, param_index
from lightning_hetero.record import StepClock, span
from lightning_hetero.sharding import ShardedOptimizer, ShardedStep

__all__ = [
    "Arrivals",
    "SumOver",
    "GradSync",
    "CoarseSync",
    "FineSync",
    "OwnerSums",
    "GlobalNorm",
    "Clipping",
    "clip_to_norm",
    "Bucket",
    "make_buckets",
    "set_grads_aside",
    "restore_grads",
    "add_grads",
    "global_grad_norm",
]

log = logging.getLogger(__name__)

StepFactory = Callable[[Optimizer, Sequence[nn.Parameter], dict], BucketStep]
"""Makes a bucket's step from the user's optimizer, the bucket's parameters and ``param_index``."""

Clipping = tuple[Optional[float], Optional[float]]
"""(clip by value, clip by norm), as the Trainer is set."""


@dataclass(frozen=True)
class Arrivals:
    """Gradients each parameter receives in an optimizer step's last backward: ``each`` (one per
    backward pass of this rank's share), except the parameters in ``params`` (a placed encoder's:
    one per share its host computes it for, none on the workers it answers; ``multimodal.py``)."""

    each: int
    params: Mapping[nn.Parameter, int] = field(default_factory=dict)

    def of(self, param: nn.Parameter) -> int:
        return self.params.get(param, self.each)


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
    a buffer of the same size. CUDA gradients travel through a pinned buffer on a side stream.
    """

    def __init__(
        self, params: Sequence[nn.Parameter], group: dist.ProcessGroup, average: bool = False, mesh: Optional[LocalMesh] = None
    ) -> None:
        self.params = list(params)
        self.group = group
        self.mesh = mesh
        self.members = mesh.ranks_of(group) if mesh is not None else None
        """The group's ranks in ``mesh``, where it sums over the mesh's sockets (``None``: over gloo)."""
        self.divisor = dist.get_world_size(group) if average else 1
        self.sizes = [p.numel() for p in params]
        cuda = [p.device for p in params if p.device.type == "cuda"]
        self.stream = torch.cuda.Stream(cuda[0]) if cuda else None
        # Half-precision gradients are summed in float32, then rounded once (or not at all, where
        # they go on to float32 master weights).
        dtype = torch.float32 if params[0].dtype in (torch.float16, torch.bfloat16) else params[0].dtype
        self.buffer = torch.empty(sum(self.sizes) + len(params), dtype=dtype, pin_memory=bool(cuda))

    def pack(self, ready: Any = None) -> Tensor:
        """Copy the gradients in. ``ready`` is a CUDA event after which they are final (default:
        everything queued so far on the current stream)."""
        with self._on_side_stream(ready):
            offset = 0
            for p, n in zip(self.params, self.sizes):
                view = self.buffer[offset : offset + n]
                if p.grad is None:
                    view.zero_()
                elif p.grad.layout != torch.strided:
                    raise RuntimeError(
                        f"A parameter of shape {tuple(p.shape)} received a sparse gradient (`F.embedding(..., sparse=True)`"
                        " or another op that makes one), which the hetero strategy does not sum between its workers."
                        " Make it dense (`sparse=False`, and a dense optimizer such as Adam in place of `SparseAdam`)."
                    )
                else:
                    view.copy_(p.grad.reshape(-1), non_blocking=True)
                offset += n
        flags = [0.0 if p.grad is None else 1.0 for p in self.params]
        self.buffer[offset:].copy_(torch.tensor(flags, dtype=self.buffer.dtype))
        return self.buffer

    def start_sum(self, ready: Any = None) -> Any:
        """Copy the gradients in (``pack``) and sum them over the group: over the mesh, done when this
        returns (``None``), or over gloo, whose work is returned to wait for."""
        flat = self.pack(ready)
        if self.mesh is not None and self.members is not None:
            self.mesh.all_reduce_sum(flat, self.members)
            return None
        return dist.all_reduce(flat, group=self.group, async_op=True)

    def unpack(self, destination: Callable[[nn.Parameter], Tensor] | None = None) -> None:
        """Put the sums into ``destination(p).grad`` (default: ``p.grad``); where that is not ``p``
        itself (a CPU master weight), the summed value never goes back to the device, and the
        device's own gradient is dropped."""
        if self.divisor != 1:
            self.buffer[: sum(self.sizes)] /= self.divisor
        flags = self.buffer[sum(self.sizes) :].tolist()
        with self._on_side_stream(None):
            offset = 0
            for i, (p, n) in enumerate(zip(self.params, self.sizes)):
                target = destination(p) if destination is not None else p
                if flags[i] == 0:
                    target.grad = None
                else:
                    summed = self.buffer[offset : offset + n].view_as(target)
                    if target.grad is None:
                        target.grad = torch.empty_like(target)
                    target.grad.copy_(summed, non_blocking=True)
                if target is not p:
                    p.grad = None
                offset += n

    @contextmanager
    def _on_side_stream(self, ready: Any) -> Generator[None, None, None]:
        """Run device<->host copies on the side stream, after ``ready``, and wait for just them."""
        if self.stream is None:
            yield
            return
        if ready is not None:
            self.stream.wait_event(ready)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield
        self.stream.synchronize()


class GradSync:
    """How this rank's gradients are summed with the other workers' and stepped; the step engine
    calls these at the same points of every optimizer step. This base sums nothing (a run that only
    evaluates); ``CoarseSync`` and ``FineSync`` are the two modes."""

    overlaps = False
    """Whether buckets are summed and stepped during the backward (fine mode)."""
    needs_cpu_workers = False
    """Whether the CPU workers step for everyone (``sharding.py``), and so take part in every step."""
    on_first_gradient: Optional[Callable[[], None]] = None
    """Called once, as the next ``begin``'s backward gives its first gradient, before any bucket steps
    (fine mode): the forward's writes are done, and no step has written a parameter yet."""

    @property
    def bucket_steps(self) -> list[BucketStep]:
        """This rank's bucket steps (fine mode), which hold offloaded optimizer state."""
        return []

    def begin(self, arrivals: Arrivals, clipping: Clipping, detached: bool, takes_part: bool) -> bool:
        """Before the backward of an optimizer step's last batch, in which each used parameter
        receives ``arrivals.of(param)`` gradients. ``detached``: the CPU workers had no share of this optimizer
        step and keep out of its sum; ``takes_part``: whether this rank sums (a CPU worker kept out
        does not). Returns whether the backward's gradients go to the sync as they arrive, so the
        worker must leave them in ``.grad``."""
        return False

    def after_backward(self, finite: bool, clock: Optional[StepClock]) -> tuple[bool, bool]:
        """After that backward, in the training step; ``finite``: whether the rest of this rank's
        window (its losses, earlier batches) was finite. Returns whether this rank's own gradients
        were finite, and whether the optimizer step is skipped on every rank (where those are known here)."""
        return True, False

    def finish(self, clock: Optional[StepClock]) -> None:
        """In Lightning's backward, with the last batch's gradients back in ``.grad``."""

    def abort(self) -> None:
        """Stop after a failure in the step: nothing more starts."""

    def clip_by_norm(self, params: Sequence[Tensor], max_norm: float) -> None:
        """Clip to a global norm of ``max_norm`` (a collective: every rank calls it)."""

    def clip_by_value(self, params: Sequence[Tensor], value: float) -> None:
        """Clip every gradient to ``[-value, value]``."""

    def before_update(self, optimizer: Optimizer) -> None:
        """After the clipping, before the optimizer reads the gradients."""

    def after_update(self, optimizer: Optimizer) -> None:
        """After the optimizer's step (on every rank, a collective where the CPU workers split it)."""

    def sharded_state(self, optimizer: Optimizer) -> dict[nn.Parameter, Any]:
        """This rank's part of optimizer state split between the CPU workers (``sharding.py``)."""
        return {}

    def set_threads(self, threads: int) -> None:
        """The torch threads of the sync's own threads, where it has any."""

    def close(self) -> None:
        """Release hooks and threads (teardown)."""


@dataclass(frozen=True)
class GlobalNorm:
    """The norm of all of the model's gradients from this rank's, identical on every rank (a
    collective over ``group``; see ``global_grad_norm``)."""

    slot: Optional[int]
    """The stage whose gradients this rank holds; ``None`` on a replica, whose gradients count for
    nothing (after the sum they equal the stages')."""
    num_stages: int
    num_nodes: int
    group: dist.ProcessGroup
    mesh: Optional[LocalMesh] = None
    """The run's sockets between the processes of one host, which then carry the sum (used by the
    thread that runs the steps, after fine mode's sums are done: ``LocalMesh``)."""

    def __call__(self, grads: Sequence[Tensor], finite: bool = True) -> Tensor:
        own = grads if self.slot is not None else None
        return global_grad_norm(
            own, self.slot or 0, self.num_stages, self.num_nodes, group=self.group, finite=finite, mesh=self.mesh
        )


@dataclass(frozen=True)
class SumOver:
    """Parameters this rank sums with others (``workers.Worker.sync_buckets``): over ``group``, or, in
    an optimizer step the CPU workers keep out of, over ``without_cpu`` (the other devices that hold
    them; ``None`` where no other does). Either is ``None`` where there is nobody to sum with."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup | None
    without_cpu: dist.ProcessGroup | None = None
    counted: bool = True
    """Whether this rank's gradients of ``params`` count in the global norm: tied parameters count on
    the first stage that holds them only."""


class OwnerSums:
    """A sharded bucket's gradients summed on their owners only (``sharding.py``, ZeRO stage 2): each
    owner's parameters packed apart and reduced to it over the bucket's ranks (``ShardedStep.sums_group``),
    then, where each node's CPU workers own the state, averaged between the owners of the nodes
    (``replica_group``), or, where every node's do, divided by the number of nodes. Every rank
    packs and sends; only an owner unpacks, into its masters."""

    def __init__(self, step: ShardedStep, replica_group: dist.ProcessGroup | None) -> None:
        self.step = step
        group = step.sums_group
        assert group is not None
        self.parts = [(w, _FlatBucket(params, group)) for w, params in enumerate(step.by_owner) if params]
        across = step.sharding.nodes > 1
        self.replica_group = replica_group if not across else None
        divisor = step.sharding.nodes if across else dist.get_world_size(replica_group) if replica_group else 1
        for _, flat in self.parts:
            flat.divisor = divisor

    def start(self, ready: Any) -> list[Any]:
        """Start every owner's reduce (``ready``: the CUDA event after which the gradients are final)."""
        ranks = self.step.sharding.cpu_ranks
        return [dist.reduce(flat.pack(ready), dst=ranks[w], group=flat.group, async_op=True) for w, flat in self.parts]

    def finish(self, works: list[Any]) -> None:
        """Wait for the reduces; on an owner, its sums (averaged over the nodes) into its masters."""
        for work in works:
            work.wait()
        for w, flat in self.parts:
            if w != self.step.sharding.me:
                continue
            if self.replica_group is not None:
                dist.all_reduce(flat.buffer, group=self.replica_group)
            flat.unpack(self.step.gradient_destination)


def _flat_buckets(buckets: Sequence[SumOver], detached: bool, mesh: Optional[LocalMesh] = None) -> list[_FlatBucket]:
    return [
        _FlatBucket(b.params, group, mesh=mesh)
        for b in buckets
        if (group := b.without_cpu if detached else b.group) is not None and b.params
    ]


class CoarseSync(GradSync):
    """Coarse mode: after the backward, sum each bucket's gradients over its group (``SumOver``),
    then average over nodes; clip with the global norm. ``shards``: on a CPU worker whose optimizer
    is split with the other CPU workers', its part (``sharding.ShardedOptimizer``). ``mesh``: the
    run's sockets between the processes of one host, which then carry the sums (``LocalMesh.all_reduce_sum``)
    in place of gloo."""

    def __init__(
        self,
        buckets: Sequence[SumOver],
        replica_group: dist.ProcessGroup | None,
        norm: Callable[[Sequence[Tensor]], Tensor],
        shards: Optional[ShardedOptimizer] = None,
        mesh: Optional[LocalMesh] = None,
    ) -> None:
        self._shards = shards
        self._buckets = _flat_buckets(buckets, detached=False, mesh=mesh)
        self._detached_buckets = _flat_buckets(buckets, detached=True, mesh=mesh)
        params = [p for b in buckets for p in b.params]
        self._nodes = _FlatBucket(params, replica_group, average=True) if replica_group and params else None
        self._norm = norm
        self._elsewhere = {p for b in buckets if not b.counted for p in b.params}
        self._detached, self._takes_part = False, True

    @override
    def begin(self, arrivals: Arrivals, clipping: Clipping, detached: bool, takes_part: bool) -> bool:
        self._detached, self._takes_part = detached, takes_part
        return False

    @override
    def finish(self, clock: Optional[StepClock]) -> None:
        if not self._takes_part:
            return
        with span(clock, "sync"):
            _all_reduce(self._detached_buckets if self._detached else self._buckets)
            if self._nodes is not None:
                _all_reduce([self._nodes])

    @override
    def clip_by_norm(self, params: Sequence[Tensor], max_norm: float) -> None:
        counted = [p.grad for p in params if p.grad is not None and p not in self._elsewhere]
        clip_to_norm(params, max_norm, self._norm(counted))

    @override
    def clip_by_value(self, params: Sequence[Tensor], value: float) -> None:
        with_grads = [p for p in params if p.grad is not None]
        if with_grads:
            torch.nn.utils.clip_grad_value_(with_grads, value)

    @override
    def before_update(self, optimizer: Optimizer) -> None:
        if self._shards is not None:
            self._shards.before_update(optimizer)

    @override
    def after_update(self, optimizer: Optimizer) -> None:
        # The CPU workers keep out of a step they had no share of together, and are refreshed later.
        if self._shards is not None and self._takes_part:
            self._shards.after_update(optimizer)

    @override
    def sharded_state(self, optimizer: Optimizer) -> dict[nn.Parameter, Any]:
        return self._shards.state(optimizer) if self._shards is not None else {}


class FineSync(GradSync):
    """Fine mode: each bucket is summed and stepped while the backward goes on (``_Overlap``).

    ``buckets`` are this rank's buckets in bucket order: their parameters and whom they are summed
    over (``SumOver``), and how their step is made: on the device, offloaded to the CPU
    (``offload.py``), or offloaded and split between the CPU workers (``sharding.py``). Each is stepped
    with the user's ``optimizer`` restricted to it; when the optimizer's parameters change
    (``add_param_group`` while fine-tuning), the steps are built again with the offloaded state
    carried over.
    """

    overlaps = True

    def __init__(
        self,
        buckets: Sequence[tuple[SumOver, StepFactory]],
        optimizer: Optimizer,
        replica_group: dist.ProcessGroup | None,
        norm: Callable[[Sequence[Tensor], bool], Tensor],
        skip_nonfinite: bool = False,
        needs_cpu_workers: bool = False,
        mesh: Optional[LocalMesh] = None,
    ) -> None:
        self._buckets = list(buckets)
        self._mesh = mesh
        self._optimizer = optimizer
        self._replica_group = replica_group
        self._norm = norm
        self._skip_nonfinite = skip_nonfinite
        self._threads: Optional[int] = None
        # The default dtype the optimizer steps under in one process: outside the step's precision
        # context (made before training, this is outside it).
        self._dtype = torch.get_default_dtype()
        self._overlap = self._build()
        self._takes_part = True
        self.needs_cpu_workers = needs_cpu_workers

    def _build(self) -> _Overlap:
        self._layout = param_index(self._optimizer)
        entries = []
        for bucket, make_step in self._buckets:
            entries.append((bucket, make_step(self._optimizer, bucket.params, self._layout)))
        overlap = _Overlap(entries, self._replica_group, self._norm, self._skip_nonfinite, self._dtype, self._mesh)
        if self._threads is not None:
            overlap.set_threads(self._threads)
        return overlap

    def _refresh(self) -> None:
        if param_index(self._optimizer) == self._layout:
            return
        log.debug("hetero: the optimizer's parameters changed; building the bucket steps again")
        old = self._overlap
        states = {p: s for step in old.steps if isinstance(step, OffloadStep) for p, s in step.state().items()}
        old.close()
        self._overlap = self._build()
        for step in self._overlap.steps:
            if isinstance(step, OffloadStep):
                step.load_state(states)

    @property
    @override
    def bucket_steps(self) -> list[BucketStep]:
        return self._overlap.steps

    @property
    def handed_early(self) -> int:
        """Buckets of the last optimizer step started while its backward was still running."""
        return self._overlap.handed_early

    @property
    def stepped_early(self) -> int:
        """Buckets of the last optimizer step whose step had finished before its backward returned."""
        return self._overlap.stepped_early

    @property
    def reduced_to_owners(self) -> int:
        """Buckets of the last optimizer step whose gradients were reduced to their owners only (``sharding.py``)."""
        return self._overlap.reduced_to_owners

    @override
    def begin(self, arrivals: Arrivals, clipping: Clipping, detached: bool, takes_part: bool) -> bool:
        self._refresh()
        self._clip_norm = clipping[1]
        self._takes_part = takes_part
        if takes_part:
            self._overlap.begin(arrivals, *clipping, detached=detached, on_first_gradient=self.on_first_gradient)
        self.on_first_gradient = None
        return takes_part

    @override
    def after_backward(self, finite: bool, clock: Optional[StepClock]) -> tuple[bool, bool]:
        if not self._takes_part:
            # A CPU worker kept out of the step; where the buckets wait for the global norm, it
            # joins that collective (with no gradients of its own) and learns the verdict.
            if not self._overlap.defers_steps(self._clip_norm):
                return True, False
            total = self._norm([], finite)
            return True, self._skip_nonfinite and not bool(torch.isfinite(total))
        with span(clock, "sync"):
            self._overlap.finish(finite)
        if clock is not None:
            clock.add("optimizer", self._overlap.step_seconds)
            clock.side_spans.extend(self._overlap.step_spans)
        return self._overlap.grads_finite, self._overlap.skipped

    @override
    def abort(self) -> None:
        self._overlap.abort()

    @override
    def sharded_state(self, optimizer: Optimizer) -> dict[nn.Parameter, Any]:
        return {p: s for step in self._overlap.steps if isinstance(step, ShardedStep) for p, s in step.state().items()}

    @override
    def set_threads(self, threads: int) -> None:
        self._threads = threads
        self._overlap.set_threads(threads)

    @override
    def close(self) -> None:
        self._overlap.close()


def _all_reduce(buckets: Sequence[_FlatBucket]) -> None:
    """Sum every bucket over its group: over the mesh's sockets one after another, in the same order
    on every rank, or over gloo all at once."""
    works = [b.start_sum() for b in buckets]
    for work in works:
        if work is not None:
            work.wait()
    for bucket in buckets:
        bucket.unpack()


def global_grad_norm(
    stage_grads: Sequence[Tensor] | None,
    stage_index: int,
    num_stages: int,
    num_nodes: int = 1,
    group: dist.ProcessGroup | None = None,
    finite: bool = True,
    mesh: Optional[LocalMesh] = None,
) -> Tensor:
    """The 2-norm of all gradients of the model, identical on every rank.

    Each stage rank contributes the squared norm of its own parameters' gradients (CPU workers
    pass ``None``: their replica's gradients equal the stages' after the sync). Summing the
    per-stage partials in a fixed order gives every rank the same value to the last bit, so all
    copies of a parameter stay identical after clipping. A rank that passes ``finite=False`` (it
    found NaN or Inf of its own) makes the norm NaN on every rank.
    """
    partials = torch.zeros(num_stages, dtype=torch.float64)
    if stage_grads:
        partials[stage_index] = torch.nn.utils.get_total_norm(stage_grads, 2.0).double().cpu() ** 2
    if not finite:
        partials.fill_(math.nan)
    sum_over(partials, group, mesh)  # one non-zero term a slot: the same sum over the mesh as over gloo
    return (partials / num_nodes).sum().sqrt()


@dataclass(frozen=True)
class Bucket:
    """Consecutive layers of one stage whose gradients are summed and stepped together (fine mode),
    or the parameters that the layers of several stages share (tied weights)."""

    index: int
    """Position in backward order: bucket 0 holds the last layers, which the backward finishes first."""
    stage: int
    layers: tuple[int, int]
    """``[start, stop)`` into ``pipeline_layers()`` (empty for tied parameters)."""
    tied: tuple[int, ...] = ()
    """The stages that share this bucket's parameters, where it holds tied ones (``module.tied_parameters``)."""

    @property
    def stages(self) -> tuple[int, ...]:
        """The stages that hold this bucket's parameters."""
        return self.tied or (self.stage,)


def make_buckets(
    layers: Sequence[Union[nn.Module, int]],
    bounds: Sequence[tuple[int, int]],
    bucket_bytes: int,
    tied: Sequence[tuple[int, ...]] = (),
) -> list[Bucket]:
    """Cut each stage's layers, from its last layer back, into buckets of at least ``bucket_bytes``
    of parameters counted as float32, whatever the run's precision (the stage's first bucket
    takes what remains); bucket 0 is the model's last. ``layers`` may give each layer's
    parameter count instead of the layer. The parameters shared by the stages of each of ``tied``
    come last, a bucket each: their gradient is complete only once every stage that holds them is
    done with them."""
    counts = [n if isinstance(n, int) else sum(p.numel() for p in n.parameters()) for n in layers]
    buckets: list[Bucket] = []
    for stage in reversed(range(len(bounds))):
        start, stop = bounds[stage]
        top, size = stop, 0
        for i in range(stop - 1, start - 1, -1):
            size += 4 * counts[i]
            if size >= bucket_bytes and i > start:
                buckets.append(Bucket(len(buckets), stage, (i, top)))
                top, size = i, 0
        buckets.append(Bucket(len(buckets), stage, (start, top)))
    return buckets + [Bucket(len(buckets) + k, stages[0], (0, 0), stages) for k, stages in enumerate(tied)]


class _Overlap:
    """Each bucket summed and stepped as soon as the backward is done with it (``FineSync``).

    A hook on every parameter counts the gradients it receives during the final backward of an
    optimizer step (one per micro-batch on a stage, one on a CPU worker). As soon as all of a
    bucket's parameters are complete, one thread copies the bucket out and sums it over the sync
    group: on one host over the mesh, one bucket after another (``LocalMesh.all_reduce_sum``; the
    mesh is lent to that thread from the first bucket it starts, with the backward's first
    gradient, until ``finish`` has waited for every sum), over gloo asynchronously (several in
    flight) where the group spans hosts. A second thread, as
    each sum arrives, averages it over nodes, clips it by value if asked, and steps the bucket,
    all while the backward goes on with earlier layers. Buckets are started strictly in bucket
    order, so every rank issues its collectives in the same order; a bucket that does not
    complete (a parameter unused in this step) starts when the backward ends, and holds back the
    buckets after it until then.

    Clipping by norm needs every gradient before any step, and so does skipping a step whose
    gradients are not finite (``skip_nonfinite``; see ``finite.py``): then the buckets are only
    summed during the backward, and stepped (or dropped, on every rank alike) after it, once the
    global norm is known. Either way each rank checks its own gradients of every bucket before
    they are summed (``grads_finite``).
    """

    def __init__(
        self,
        entries: Sequence[tuple[SumOver, Any]],
        replica_group: dist.ProcessGroup | None,
        norm: Callable[[list[Tensor], bool], Tensor],
        skip_nonfinite: bool = False,
        dtype: Optional[torch.dtype] = None,
        mesh: Optional[LocalMesh] = None,
    ) -> None:
        """``entries`` are this rank's buckets in bucket order: (whom they are summed over, step);
        ``norm(grads, finite)`` gives the global gradient norm from this rank's gradients (a
        collective), NaN everywhere where any rank passes ``finite=False``. ``dtype``: the default
        dtype outside the step's precision context, which the optimizer's new state follows."""
        self._dtype = dtype
        self._params = [list(bucket.params) for bucket, _ in entries]
        self._counted = [bucket.counted for bucket, _ in entries]
        self._sums = {
            detached: [
                _FlatBucket(b.params, group, mesh=mesh)
                if (group := b.without_cpu if detached else b.group) is not None and b.params
                else None
                for b, _ in entries
            ]
            for detached in (False, True)
        }
        self._nodes = [_FlatBucket(p, replica_group, average=True) if replica_group and p else None for p in self._params]
        self._mesh = mesh
        self._steps = [step for _, step in entries]
        self._owners = [OwnerSums(s, replica_group) if isinstance(s, ShardedStep) else None for s in self._steps]
        self._norm = norm
        self._skip_nonfinite = skip_nonfinite
        devices = {p.device for params in self._params for p in params if p.device.type == "cuda"}
        self._device = next(iter(devices), None)
        # Threads do not inherit the current CUDA device: give them the stage's.
        init = partial(torch.cuda.set_device, self._device) if self._device else None
        self._starter = _DaemonThread("hetero-sums", init)
        self._stepper = _DaemonThread("hetero-steps", init)
        self._hooks: dict[nn.Parameter, Any] = {}
        self._armed = False
        self._stepped = False
        self.handed_early = 0
        """Buckets started while the last backward was still running (the rest went after it)."""
        self.stepped_early = 0
        """Buckets whose step had finished before the last backward returned."""
        self.step_seconds = 0.0
        """Time the bucket steps of the last optimizer step took (in the step thread, overlapped)."""
        self.step_spans: list[tuple[str, float, float]] = []
        """``("bucket <k> step", start, end)`` of each bucket step of the last optimizer step."""
        self.grads_finite = True
        """Whether this rank's own gradients were finite in the last optimizer step's backward."""
        self.reduced_to_owners = 0
        """Buckets of the last optimizer step whose gradients went to their owners only (``OwnerSums``)."""
        self.skipped = False
        """Whether the last optimizer step was skipped on every rank (``skip_nonfinite``)."""

    @property
    def steps(self) -> list[Any]:
        """The step of each of this rank's buckets, in bucket order."""
        return list(self._steps)

    def defers_steps(self, clip_norm: float | None) -> bool:
        """Whether the buckets step only after the backward, once every rank knows the global norm."""
        return clip_norm is not None or self._skip_nonfinite

    def _makes_state_late(self) -> set[int]:
        """The buckets that step after the backward, on this rank alone, because their step makes
        optimizer state and the backward runs under another default dtype than the optimizer
        steps under in one process (``64-true``: torch's optimizers would make their step counts in
        float64, and NAdam computes in them). A sharded bucket's step is a collective: it keeps its
        place: one that lacks state after the first step (its parameters unfrozen since) makes it under
        the backward's dtype (a limit: fine-mode.md)."""
        if self._dtype is None or torch.get_default_dtype() == self._dtype:
            return set()
        return {k for k, step in enumerate(self._steps) if not isinstance(step, ShardedStep) and step.lacks_state()}

    def begin(
        self,
        arrivals: Arrivals,
        clip_value: float | None,
        clip_norm: float | None,
        detached: bool = False,
        on_first_gradient: Optional[Callable[[], None]] = None,
    ) -> None:
        """Arm the hooks for a backward in which each used parameter receives ``arrivals.of(p)`` gradients;
        ``detached``: the CPU workers had no share of this optimizer step and do not sum;
        ``on_first_gradient``: called as the first gradient arrives (``GradSync.on_first_gradient``)."""
        self._on_first_gradient = on_first_gradient
        for k, params in enumerate(self._params):
            for p in params:  # hooks need requires_grad: a layer unfrozen since last time gets one now
                if p.requires_grad and p not in self._hooks:
                    self._hooks[p] = p.register_post_accumulate_grad_hook(partial(self._arrived, k))
        self._arrivals, self._clip_value, self._clip_norm = arrivals, clip_value, clip_norm
        # The first optimizer step makes the optimizer's state; where the backward runs under another default
        # dtype than one process steps under (`64-true`), every bucket of it steps after the backward, sharded
        # ones too (their steps are collectives: on every rank alike, each one's first step).
        first = not self._stepped and self._dtype is not None and torch.get_default_dtype() != self._dtype
        self._stepped = True
        self._deferred = self.defers_steps(clip_norm) or first
        self._late = set() if self._deferred else self._makes_state_late()
        self._detached = detached
        self._counts: dict[nn.Parameter, int] = {}
        # A parameter that receives nothing here (an encoder computed elsewhere) does not hold its bucket back.
        self._missing = [sum(p.requires_grad and arrivals.of(p) > 0 for p in params) for params in self._params]
        self._next = 0
        self._started: list[Future] = []
        self._done: list[Future] = []
        self._backward_over = False
        self._stepped_in_backward = 0
        self._finite: list[Tensor] = []
        self.step_seconds = 0.0
        self.step_spans = []
        self.skipped = False
        self.reduced_to_owners = 0
        self._armed = True
        # Buckets with nothing to wait for (no trainable parameters) start with the first gradient
        # (or at `finish`): not before the forward, whose step method may still use the mesh.

    def finish(self, finite: bool = True) -> None:
        """Start the buckets still waiting and wait for all of them. Where the steps wait for the
        global norm (``defers_steps``), learn it with every rank, then step every bucket, or drop
        their gradients where it is not finite and ``skip_nonfinite``. ``finite``: whether the rest
        of this rank's step (its loss) was finite."""
        self._armed = False
        self._backward_over = True
        self.handed_early = self._next
        self._start_complete(everything=True)
        for done in self._done:
            done.result()
        if self._mesh is not None:
            self._mesh.lend(None)  # every sum is done: back to the steps' thread
        self.stepped_early = self._stepped_in_backward
        self.grads_finite = bool(torch.stack(self._finite).all()) if self._finite else True
        if self._deferred:
            start = time.perf_counter()
            if self.defers_steps(self._clip_norm):  # a collective that the ranks kept out of the step join too
                held = [[h for h in step.grad_holders() if h.grad is not None] for step in self._steps]
                holders = [h for step_holders in held for h in step_holders]
                counted = [h.grad for step_holders, c in zip(held, self._counted) if c for h in step_holders]
                total = self._norm(counted, finite and self.grads_finite)
                self.skipped = self._skip_nonfinite and not bool(torch.isfinite(total))
                if self._clip_norm is not None and not self.skipped:
                    clip_to_norm(holders, self._clip_norm, total)
            with _default_dtype(self._dtype):
                for k, step in enumerate(self._steps):
                    if self.skipped:
                        step.skip()
                    else:
                        self._clip_by_value_and_step(k, step)
            self.step_seconds += time.perf_counter() - start
        with _default_dtype(self._dtype):
            for k in sorted(self._late):
                self._clip_by_value_and_step(k, self._steps[k])
        for step in self._steps:
            step.after_all_steps()

    def abort(self) -> None:
        """Stop after a failure in this step: nothing more starts; the sums and steps queued are
        dropped (a sum already running ends with its peers, or when they end; the mesh stays lent
        to it)."""
        self._armed = False
        for future in [*getattr(self, "_started", []), *getattr(self, "_done", [])]:
            future.cancel()

    def set_threads(self, threads: int) -> None:
        """Give the sum and step threads ``threads`` torch threads from their next call on (a
        thread keeps the count it first computed with; the strategy changes it with the CPU fraction)."""
        self._starter.submit(torch.set_num_threads, threads)
        self._stepper.submit(torch.set_num_threads, threads)

    def close(self) -> None:
        """Remove the hooks and stop the threads (the strategy's teardown)."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self._starter.shutdown()
        self._stepper.shutdown()

    def _arrived(self, k: int, param: nn.Parameter) -> None:
        if not self._armed:
            return
        if self._on_first_gradient is not None:
            first, self._on_first_gradient = self._on_first_gradient, None
            first()
        count = self._counts.get(param, 0) + 1
        self._counts[param] = count
        expected = self._arrivals.of(param)
        if count > expected:
            raise RuntimeError(
                f"A parameter of bucket {k} received {count} gradients in a backward that fine mode expected to give it"
                f" {expected}: it is used outside its own layer (or twice per micro-batch through a path the layer does"
                " not own), or a reentrant activation checkpoint (`torch.utils.checkpoint(..., use_reentrant=True)`,"
                " or a model's `gradient_checkpointing_enable()` with it) runs a second backward through it, or (a"
                " multimodal model) `modality_inputs` computes a placed encoder's input with it, on its host for every"
                " share. Fine mode sums each bucket when its gradients are complete, so it cannot follow these: use"
                " `use_reentrant=False`, leave that encoder 'split', or use `mode='coarse'`."
            )
        if count == expected:
            self._missing[k] -= 1
            self._start_complete()

    def _start_complete(self, everything: bool = False) -> None:
        """Start the next buckets in order, as long as they are complete (or all of them)."""
        while self._next < len(self._steps) and (everything or self._missing[self._next] == 0):
            k, ready = self._next, None
            if self._device is not None:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self._device))
            if self._mesh is not None and self._next == 0:
                self._mesh.lend(self._starter.thread)  # the sums' until `finish` has waited for every one
            started = self._starter.submit(self._start_sum, k, ready)
            self._started.append(started)
            self._done.append(self._stepper.submit(self._sum_and_step, k, started))
            self._next += 1

    def _start_sum(self, k: int, ready: Any) -> Any:
        self._check_finite(k, ready)
        owners = self._owners[k]
        if owners is not None and not self._deferred:
            # A sharded bucket steps on its owners only: its sums go to them alone. Where the steps
            # wait for the global norm, it is summed everywhere, as the norm is the stages'.
            return owners.start(ready)
        flat = self._sums[self._detached][k]
        return flat.start_sum(ready) if flat is not None else None

    def _sum_and_step(self, k: int, started: Future) -> None:
        work = started.result()
        step = self._steps[k]
        owners = self._owners[k]
        if owners is not None and not self._deferred:
            owners.finish(work)
            self.reduced_to_owners += 1
        elif (flat := self._sums[self._detached][k]) is not None:
            if work is not None:
                work.wait()
            flat.unpack(step.gradient_destination)
        if self._nodes[k] is not None and (owners is None or self._deferred):
            nodes = self._nodes[k]
            dist.all_reduce(nodes.pack(), group=nodes.group)
            nodes.unpack(step.gradient_destination)
        if self._deferred or k in self._late:
            return
        start = time.perf_counter()
        self._clip_by_value_and_step(k, step)
        self.step_seconds += time.perf_counter() - start
        if not self._backward_over:
            self._stepped_in_backward += 1

    def _check_finite(self, k: int, ready: Any) -> None:
        """Note whether this rank's own gradients of bucket ``k`` are finite, before anyone's are
        added (``ready``: the CUDA event after which they are final)."""
        grads = [p.grad for p in self._params[k] if p.grad is not None]
        if not grads:
            return
        if ready is not None:
            torch.cuda.current_stream(self._device).wait_event(ready)
        self._finite.append(finite_flag(grads))

    def _clip_by_value_and_step(self, k: int, step: Any) -> None:
        start = time.perf_counter()
        if self._clip_value is not None:
            holders = [h for h in step.grad_holders() if h.grad is not None]
            if holders:
                torch.nn.utils.clip_grad_value_(holders, self._clip_value)
        step.step()
        self.step_spans.append((f"bucket {k} step", start, time.perf_counter()))


@contextmanager
def _default_dtype(dtype: Optional[torch.dtype]) -> Iterator[None]:
    """Steps on the training thread, after the backward (every bucket's sum and step thread idle),
    under ``dtype`` as torch's default (a process-wide setting)."""
    before = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class _DaemonThread:
    """One thread that runs the calls given to ``submit`` in order, like a ``ThreadPoolExecutor``
    of one worker, except that the thread is a daemon: its calls wait in collectives for other
    ranks, and an executor's threads are joined when the process exits, so a rank that failed
    while a sum was in flight would stay alive until a peer answered or the timeout ran out."""

    def __init__(self, name: str, initializer: Optional[Callable[[], Any]] = None) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, args=(initializer,), name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Cancel the calls not started yet and end the thread after the running one."""
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                call[0].cancel()
        self._calls.put(None)

    def _run(self, initializer: Optional[Callable[[], Any]]) -> None:
        if initializer is not None:
            initializer()
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as error:
                future.set_exception(error)


def clip_to_norm(params: Sequence[Tensor], max_norm: float, total: Tensor) -> None:
    """Scale the gradients of ``params`` so their global norm (``total``, computed over every
    stage) is at most ``max_norm``, exactly as ``clip_grad_norm_`` would in one process."""
    with_grads = [p for p in params if p.grad is not None]
    if with_grads:
        torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, total.to(with_grads[0].grad.dtype))


