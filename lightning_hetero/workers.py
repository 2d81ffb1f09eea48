"""The roles of a hetero run's processes, one class each: the CPU worker and the pipeline stage.

A role's class holds everything about a process that depends on what the process is: where its
part of the model lives (``place``), what it computes of every batch (``train_step``,
``eval_step``), which parameters it sums with whom (``sync_buckets``, ``owns``), how its gradients
count in the global norm (``norm_slot``), whether it keeps out of a step the CPU workers had no
share of (``keeps_out``), and what it
does when the CPU workers' replicas are brought up to date (``refresh``). The strategy and the
step engine never ask which role a process has.

A ``CpuWorker`` runs the module's own step methods (``training_step``, ``validation_step``, ...)
on its share with the full replica. A ``StageWorker`` runs its slice of the layers in the
pipeline schedule (its slices, with a multi-stage schedule: ``pipeline.py``); the process of the last
stage then *replays* the module's step method with ``forward`` returning the pipeline's outputs, so
that the loss and everything the step logs are computed on the pipeline's share by the user's own
code.

Both do their forward and backward inside ``training_step`` (so every rank knows the step's loss
when ``training_step`` returns). Lightning zeroes gradients *after* ``training_step``, so the new
gradients are set aside and put back in the strategy's ``backward`` (see ``Worker._train``).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Literal, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hetero.batchnorm import ReplicaNorm
from lightning_hetero.batchnorm import revert as revert_batch_norm
from lightning_hetero.mesh import LocalMesh
from lightning_hetero.module import pipeline_inputs_only, pipeline_pair
from lightning_hetero.multimodal import EncoderExchange, in_backward
from lightning_hetero.offload import BucketStep, DeviceStep, OffloadStep, choose_offloaded
from lightning_hetero.sharding import ShardedOptimizer, Sharding, ShardedStep
from lightning_hetero.pipeline import Pipeline, StageModule
from lightning_hetero.record import span
from lightning_hetero.results import LogCapture, WorkerReport
from lightning_hetero.shares import Shares, slice_batch
from lightning_hetero.state import drop_to_meta, fill_from_peers, refresh_replicas
from lightning_hetero.sync import (
    Arrivals,
    Bucket,
    CoarseSync,
    FineSync,
    GlobalNorm,
    GradSync,
    SumOver,
    add_grads,
    make_buckets,
    restore_grads,
    set_grads_aside,
)

__all__ = [
    "Placement",
    "Tied",
    "Worker",
    "CpuWorker",
    "StageWorker",
    "SoleStage",
    "DeviceReplica",
    "GradPolicy",
    "ROLES",
    "check_emulated_speed",
]

GradPolicy = Literal["keep", "drop", "accumulate"]


@dataclass(frozen=True)
class Tied:
    """Parameters that the blocks of several stages use (``module.tied_parameters``), and whom their
    gradients are summed over: each of those stages has its own uses' gradient, a CPU worker the whole."""

    stages: tuple[int, ...]
    params: list[nn.Parameter]
    group: Optional[dist.ProcessGroup]
    """The processes of those stages and the CPU workers, where this rank is a member."""
    without_cpu: Optional[dist.ProcessGroup]
    """The processes of those stages alone, where this rank is one (None where one process holds them all)."""


@dataclass(frozen=True)
class Placement:
    """Where a run's model lives on one node: its blocks, each stage's slice of them, the groups
    each stage sums its gradients over with the CPU workers, and the stages' global ranks."""

    layers: list[nn.Module]
    bounds: list[tuple[int, int]]
    """Each stage's ``[start, stop)`` blocks."""
    sync_groups: list[Optional[dist.ProcessGroup]]
    """Stage ``s``'s sync group, where this rank is a member (``ProcessGroups.sync``)."""
    stage_ranks: list[int]
    tied: list[Tied] = field(default_factory=list)
    """The parameters several stages hold, by the stages that hold them."""
    holders: Optional[list[int]] = None
    """With several stages per process, the stage process that holds each stage (``pipeline.holders``);
    ``None``: stage ``s`` is process ``s``'s."""

    @property
    def num_processes(self) -> int:
        """The processes the stages are on (one for replicas, whose blocks are one stage)."""
        return len(set(self.holders)) if self.holders is not None else len(self.bounds)

    def holder(self, stage: int) -> int:
        """The stage process that holds ``stage``."""
        return self.holders[stage] if self.holders is not None else stage

    def stages_of(self, process: int) -> list[int]:
        """The stages stage process ``process`` holds."""
        return [s for s in range(len(self.bounds)) if self.holder(s) == process]

    def stage_params(self, stage: int) -> list[nn.Parameter]:
        """The parameters of ``stage``'s blocks, frozen ones included (they may be unfrozen later),
        each once, tied ones too."""
        return _unique(self._params_of(*self.bounds[stage]))

    def stage_buffers(self, stage: int, module: nn.Module) -> list[Tensor]:
        """The buffers ``stage`` keeps, each once: its blocks', or all of ``module``'s where one stage
        holds it whole (a replica's blocks hold only parameters)."""
        if len(self.bounds) == 1:
            return list(module.buffers())
        start, stop = self.bounds[stage]
        return _unique(b for layer in self.layers[start:stop] for b in layer.buffers())

    def stage_params_all(self) -> list[list[nn.Parameter]]:
        return [self.stage_params(s) for s in range(len(self.bounds))]

    def all_params(self) -> list[nn.Parameter]:
        """Every parameter of the blocks, each once."""
        return _unique(p for params in self.stage_params_all() for p in params)

    def untied(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` without the tied ones, which are summed on their own (``tied``)."""
        tied = {p for t in self.tied for p in t.params}
        return [p for p in params if p not in tied]

    def buckets(self, bucket_bytes: int) -> list[tuple[Bucket, list[nn.Parameter]]]:
        """Fine mode's buckets and their parameters, each parameter in one: the stages' layers, then each
        set of tied parameters. A parameter that layers of two buckets of one stage use (a tied weight
        within a stage: GPT-2's embedding and head on a pipeline's one stage) is in the later bucket, its earliest
        use's, whose backward completes its gradient."""
        buckets = make_buckets(self.layers, self.bounds, bucket_bytes, [t.stages for t in self.tied])
        tied = self.tied_by_stages()
        params = [tied[b.tied].params if b.tied else self.untied(_unique(self._params_of(*b.layers))) for b in buckets]
        last = {p: k for k, bucket in enumerate(params) for p in bucket}
        return [(b, [p for p in bucket if last[p] == k]) for k, (b, bucket) in enumerate(zip(buckets, params))]

    def tied_by_stages(self) -> dict[tuple[int, ...], Tied]:
        return {t.stages: t for t in self.tied}

    def _params_of(self, start: int, stop: int) -> Any:
        return (p for layer in self.layers[start:stop] for p in layer.parameters())


def _unique(params: Any) -> list[nn.Parameter]:
    return list(dict.fromkeys(params))


def _loss_of(output: Any, method: str) -> Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if isinstance(output, Mapping) and not isinstance(loss, Tensor):
        raise TypeError(
            f"`{method}` returned a dict with {'no' if loss is None else 'a non-tensor'} 'loss' key (keys:"
            f" {sorted(map(str, output))}): return the loss as a tensor, or a dict holding it under 'loss'."
        )
    if not isinstance(loss, Tensor):
        raise TypeError(
            f"`{method}` must return the loss, as a tensor or a dict with a 'loss' key, on every step; got"
            f" {type(output).__name__}. The hetero strategy cannot skip a step on one worker only."
        )
    return loss


class Worker:
    """What every role has: the module, the parameters this rank trains, the gradients set aside."""

    speed_key = ""
    """Which of the strategy's ``emulated_speed`` keys paces this role (testing only)."""
    receives_refresh = False
    """A CPU worker's replica, which ``refresh`` brings up to date from the stages'."""
    device = torch.device("cpu")
    """Where this rank computes."""
    norm_slot: Optional[int] = None
    """The stage whose gradients this rank's count as in the global norm (``sync.GlobalNorm``);
    ``None`` where they count for nothing (a replica's equal the stages' after the sum)."""

    def __init__(self, module: LightningModule, params: Sequence[nn.Parameter], placement: Placement) -> None:
        self.module = module
        self.params = list(params)
        self.placement = placement
        self.nominal: dict[tuple[str, int], int] = {}
        """Per step method and dataloader, the largest batch the method has run on (``saw_batch``):
        what a fixed ``self.log(batch_size=...)`` names (``results.LogCapture``) where the loader
        names no batch size of its own."""
        self._nominal_now: Optional[int] = None
        self.fresh_grads: list[Tensor | None] | None = None
        self.norm: Optional[ReplicaNorm] = None
        self.buffer_versions: dict[int, int] = {}
        """Each buffer's version (by ``id``) when the trainer call began (``on_setup``)."""
        """What this replica does about the model's BatchNorm layers (``batchnorm.py``), where it has any."""
        self.pace = 0.0
        """TESTING ONLY: seconds per sample this worker's training share takes at least (the
        strategy's ``emulated_speed``); 0 runs at the real speed."""
        self.encoders: Optional[EncoderExchange] = None
        """This rank's part in a multimodal model's placed encoders (``multimodal.py``), where it has any."""
        self.sharding: Optional[Sharding] = None
        """How this rank takes part in the optimizer state split between the CPU workers (``sharding.py``)."""

    def expected_grads(self, shares: Shares) -> int:
        """Gradients each used parameter receives in this step's backward."""
        raise NotImplementedError

    @property
    def encoders_on_cpu(self) -> bool:
        """Whether an encoder is placed on a CPU worker, which then computes in every step."""
        return self.encoders is not None and self.encoders.on_cpu_worker

    def arrivals(self, shares: Shares, batch: Any) -> Arrivals:
        """Gradients each parameter receives in this step's backward (fine mode counts them)."""
        each = self.expected_grads(shares)
        return Arrivals(each, self.encoders.extra_arrivals(batch, shares, each) if self.encoders else {})

    def train_step(
        self, batch: Any, batch_idx: int, shares: Shares, accumulate: int, grads: GradPolicy, clock: Any
    ) -> tuple[WorkerReport, Any]:
        """Forward and backward of this rank's share: its report, and the step method's output."""
        raise NotImplementedError

    def eval_step(self, method: str, batch: Any, rest: tuple, shares: Shares) -> tuple[WorkerReport, Any]:
        raise NotImplementedError

    def put_back_grads(self) -> None:
        """Add the gradients ``train_step`` set aside back into ``.grad``, as a backward would."""
        if self.fresh_grads is not None:
            add_grads(self.params, self.fresh_grads)
            self.fresh_grads = None

    def recorded_samples(self, shares: Shares, report: WorkerReport) -> int:
        """The samples this rank's step record counts (``StepRecord.samples``)."""
        return report.samples

    def keeps_out(self, detached: bool) -> bool:
        """Whether this rank keeps out of an optimizer step's sum and step, ``detached`` saying the
        CPU workers had no share of its batches."""
        return False

    def held_stages(self) -> list[int]:
        """The stages whose parameters this rank holds (a replica's every parameter is stage 0's)."""
        raise NotImplementedError

    @property
    def runs_step_methods(self) -> bool:
        """Whether the module's step methods run here (not on a stage before the last)."""
        return True

    def share_range(self, shares: Shares) -> tuple[int, int]:
        """The samples ``[start, stop)`` of a batch this rank computes (a stage: the pipeline's)."""
        return shares.pipeline

    def sum_over(self, params: list[nn.Parameter], stage: int) -> SumOver:
        """Whom this rank sums ``params`` (of ``stage``) with: that stage's sync group."""
        return SumOver(params, self.placement.sync_groups[stage])

    def sum_tied(self, tied: Tied) -> SumOver:
        """Whom this rank sums tied parameters with: the stages that hold them and the CPU workers;
        their gradients count in the global norm on the process of the first of those stages."""
        return SumOver(tied.params, tied.group, tied.without_cpu, counted=self.norm_slot == self.placement.holder(tied.stages[0]))

    def sync_buckets(self) -> list[SumOver]:
        """The parameters this rank sums with others, per stage it holds, then the tied ones it holds,
        and whom with."""
        place, held = self.placement, self.held_stages()
        own = [self.sum_over(place.untied(place.stage_params(s)), s) for s in held]
        return own + [self.sum_tied(t) for t in place.tied if set(t.stages) & set(held)]

    def owns(self, bucket: Bucket) -> bool:
        """Whether this rank sums and steps ``bucket`` (fine mode)."""
        return bool(set(bucket.stages) & set(self.held_stages()))

    def refresh(self, optimizer: Optional[Optimizer], steps: Sequence[BucketStep]) -> None:
        """Bring the CPU workers' stale replicas up to date from the stages (a collective: the stages
        send, the CPU workers receive)."""
        refresh_replicas(self.receives_refresh, self.placement, self.module, self.buffer_versions, optimizer, steps)

    def build_sync(
        self,
        mode: str,
        *,
        norm: GlobalNorm,
        replica_group: Optional[dist.ProcessGroup],
        optimizer: Optimizer,
        bucket_bytes: int,
        offload: Any,
        control: dist.ProcessGroup,
        skip_nonfinite: bool,
        sharding: Optional[Sharding] = None,
        mesh: Optional[LocalMesh] = None,
    ) -> GradSync:
        """The mode's gradient sync for what this rank sums (``sync_buckets``) or steps (``owns``);
        which fine-mode buckets are offloaded is decided alike on every rank (``choose_offloaded``,
        a collective over ``control``). With ``sharding`` (several CPU workers), the CPU workers split
        their optimizer state and step (``sharding.py``): in coarse mode their replicas' (they keep out
        of a step they have no share of, as ever); in fine mode the offloaded buckets' (tied parameters'
        buckets excepted), and then they take part in every step. ``mesh``: where every rank runs on this host, the
        sums go over its sockets."""
        if mode == "coarse":
            shards = None
            if sharding is not None and sharding.me is not None:
                shards = ShardedOptimizer(list(self.module.parameters()), sharding)
            return CoarseSync(self.sync_buckets(), replica_group, norm, shards, mesh)
        place = self.placement
        buckets, params = zip(*place.buckets(bucket_bytes))
        own = [b for b in buckets if self.owns(b)]
        offloaded = choose_offloaded(offload, buckets, own, params, self.device, control)
        tied = place.tied_by_stages()

        def step_of(b: Bucket) -> Any:
            if b.index not in offloaded:
                return DeviceStep
            if sharding is None or b.tied:
                return OffloadStep
            return partial(ShardedStep, sharding=sharding, stage=place.holder(b.stage))  # its sharding groups' index

        entries = [(self.sum_tied(tied[b.tied]) if b.tied else self.sum_over(params[b.index], b.stage), step_of(b)) for b in own]
        shares = sharding is not None and bool(offloaded)
        return FineSync(entries, optimizer, replica_group, norm, skip_nonfinite=skip_nonfinite, needs_cpu_workers=shares, mesh=mesh)

    def on_setup(self) -> None:
        """At the start of every trainer call, after the placement (made by the first, kept by the others)."""
        if self.norm is not None:
            self.norm.apply()
        # Every rank holds the same model here: what a stage's buffers change from now on, it sends to a stale CPU worker.
        self.buffer_versions = {id(b): b._version for b in self.module.buffers()}

    def on_teardown(self, group: dist.ProcessGroup, finished: bool) -> None:
        """At the end of every trainer call; ``finished``: it ended without a failure, and code after it
        reads the whole model on every rank, as under DDP (``share_model``)."""
        if finished:
            self.share_model(group)
        revert_batch_norm(self.module)

    def share_model(self, group: dist.ProcessGroup) -> None:
        """After a trainer call, make this rank's module the whole model, as every rank's is under DDP
        (a collective over the node's ranks, where the model is cut into stages): the stages share
        their slices, and every rank fills in what it lacks (on the CPU)."""
        if len(self.placement.bounds) > 1:
            fill_from_peers(self.module, send=isinstance(self, StageWorker), group=group)

    def note(self) -> str:
        """What an error message should know about a failure on this rank."""
        return ""

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

    def saw_batch(self, method: str, batch_size: int, loader: int = 0, loader_batch_size: Optional[int] = None) -> None:
        """Every step, on every rank: ``method`` is to run on a batch of ``batch_size`` from its
        ``loader``-th dataloader, which names ``loader_batch_size`` (``nominal``)."""
        key = (method, loader)
        seen = max(self.nominal.get(key, 0), batch_size)
        self.nominal[key] = seen
        # The loader's own batch size, where it names one (an `on_after_batch_transfer` may make its batches larger).
        self._nominal_now = loader_batch_size or seen

    def _run_step(self, method: str, batch: Any, rest: tuple, samples: int, batch_size: int) -> tuple[WorkerReport, Any]:
        with LogCapture(self.module, samples, batch_size, self._nominal_now) as capture:
            output = getattr(self.module, method)(batch, *rest)
        report = WorkerReport(samples=samples, logs=capture.logs)
        if method == "training_step":
            loss = _loss_of(output, method)
            if loss.is_meta:
                raise ValueError(
                    f"`{type(self.module).__name__}.training_step` returned a loss computed from layers this pipeline"
                    " stage does not hold (they exist only on the meta device here), such as a penalty over"
                    " `self.parameters()`. The stages train on `pipeline_loss(output, target)`, so `training_step`"
                    " must return exactly that loss: use the optimizer's `weight_decay` for an L2 penalty, or train"
                    " the model as replicas (`parallelism='replicas'`)."
                )
            report.loss, report.loss_dtype = loss.detach().reshape(()), loss.dtype  # read with the step's results
        return report, output


class _WholeModel(Worker):
    """A whole model on this rank's device, running the module's own step methods on its share of
    each batch (``_range``), forward and backward, as a single process would on that share."""

    @override
    def share_range(self, shares: Shares) -> tuple[int, int]:
        return self._range(shares)

    def _range(self, shares: Shares) -> tuple[int, int]:
        raise NotImplementedError

    @override
    def expected_grads(self, shares: Shares) -> int:
        """Gradients each parameter receives in this step's backward (one per backward pass)."""
        start, stop = self._range(shares)
        return 1 if stop > start else 0

    @override
    def train_step(
        self, batch: Any, batch_idx: int, shares: Shares, accumulate: int, grads: GradPolicy, clock: Any
    ) -> tuple[WorkerReport, Any]:
        start, stop = self._range(shares)
        if self.norm is not None:
            self.norm.before(shares, batch=batch)

        encoders = self.encoders if self.encoders is not None and self.encoders.placement else None

        def own_share() -> tuple[WorkerReport, Any]:
            share = self._on_device(slice_batch(batch, start, stop, shares.batch_size))
            with encoders.receiving(share) if encoders is not None else nullcontext():
                report, output = self._run_step("training_step", share, (batch_idx,), stop - start, shares.batch_size)
                weight = (stop - start) / (shares.batch_size * accumulate)
                with in_backward():
                    self.module.backward(_loss_of(output, "training_step") * weight)
            if encoders is not None:
                encoders.send_gradients()
            return report, output

        def compute() -> tuple[WorkerReport, Any]:
            if start == stop and encoders is None:
                return WorkerReport(), None
            # On a GPU, the device's own time (CUDA events): the host only queues the work.
            with clock.device_span("compute") if clock is not None else nullcontext():
                started = time.perf_counter()
                if encoders is not None:  # placed encoders: this rank's part for the others first
                    encoders.forward_for_others(batch, shares, clock)
                report, output = own_share() if start < stop else (WorkerReport(), None)
                if encoders is not None:
                    encoders.backward_for_others()
                    encoders.finish()
                self._pad(stop - start, started)
                return report, output

        try:
            result = self._train(compute, grads)
        except BaseException:
            if encoders is not None:
                encoders.abort()
            raise
        if self.norm is not None:
            self.norm.after_training_batch(start, stop, shares.batch_size)
        return result

    @override
    def eval_step(self, method: str, batch: Any, rest: tuple, shares: Shares) -> tuple[WorkerReport, Any]:
        start, stop = self._range(shares)
        if self.norm is not None:
            self.norm.before(shares, training=False, batch=batch)
        if start == stop:
            return WorkerReport(), None
        return self._run_step(method, self._on_device(slice_batch(batch, start, stop, shares.batch_size)), rest, stop - start, shares.batch_size)

    def _on_device(self, share: Any) -> Any:
        return share if self.device.type == "cpu" else move_data_to_device(share, self.device)


class CpuWorker(_WholeModel):
    """A full replica on the CPU, running the module's own step methods on its share."""

    speed_key = "cpu"
    receives_refresh = True

    def __init__(self, module: LightningModule, placement: Placement, index: int) -> None:
        super().__init__(module, placement.all_params(), placement)
        self.index = index

    @classmethod
    def place(cls, module: LightningModule, placement: Placement, index: int, **devices: Any) -> CpuWorker:
        """CPU worker ``index``: the whole replica stays as it is."""
        return cls(module, placement, index)

    @override
    def _range(self, shares: Shares) -> tuple[int, int]:
        return shares.cpu[self.index]

    @override
    def keeps_out(self, detached: bool) -> bool:
        return detached

    @override
    def held_stages(self) -> list[int]:
        return list(range(len(self.placement.bounds)))


class SoleStage(_WholeModel):
    """A pipeline of one stage: the whole model on the stage's device. With nothing to pipeline, it
    runs the module's own step methods on the pipeline's share directly, as a CPU worker does on its
    own share: no schedule, no micro-batches, no replay (and so no check that ``training_step``
    returns ``pipeline_loss``: what it returns is what this stage trains on)."""

    speed_key = "pipeline"
    norm_slot = 0

    def __init__(self, module: LightningModule, placement: Placement, device: torch.device) -> None:
        super().__init__(module, placement.stage_params(0), placement)
        self.device = device

    @override
    def _range(self, shares: Shares) -> tuple[int, int]:
        return shares.pipeline

    @override
    def recorded_samples(self, shares: Shares, report: WorkerReport) -> int:
        return shares.pipeline_size

    @override
    def held_stages(self) -> list[int]:
        return [0]


class DeviceReplica(SoleStage):
    """The whole model on one of the layout's devices (``parallelism="replicas"``), running the
    module's own step methods on its part of the devices' share of each batch (``Shares.device_part``):
    data parallelism across unequal devices, beside the CPU workers' replicas. Every replica sums its
    gradients with every other; in an optimizer step the CPU workers have no share of, the devices
    sum among themselves (``devices``)."""

    def __init__(
        self,
        module: LightningModule,
        placement: Placement,
        device: torch.device,
        index: int,
        count: int,
        devices: Optional[dist.ProcessGroup],
    ) -> None:
        super().__init__(module, placement, device)
        self.index, self.count, self.devices = index, count, devices if count > 1 else None
        # After the sum every replica holds the whole gradient: the first device's counts for all.
        self.norm_slot = 0 if index == 0 else None

    @classmethod
    def place(
        cls, module: LightningModule, placement: Placement, index: int, *, device: torch.device, group: Any, **rest: Any
    ) -> DeviceReplica:
        """Device replica ``index``: the whole model stays, on its device (``group``: the device replicas)."""
        return cls(module, placement, device, index, len(placement.stage_ranks), group)

    @override
    def _range(self, shares: Shares) -> tuple[int, int]:
        return shares.device_part(self.index, self.count)

    @override
    def recorded_samples(self, shares: Shares, report: WorkerReport) -> int:
        start, stop = self._range(shares)
        return stop - start

    @override
    def sum_over(self, params: list[nn.Parameter], stage: int) -> SumOver:
        return SumOver(params, self.placement.sync_groups[stage], self.devices)


class StageWorker(Worker):
    """One pipeline stage process, with its stage (or, with a multi-stage schedule, its stages); the
    process that holds the last stage replays the module's step methods on the pipeline's outputs."""

    speed_key = "pipeline"

    def __init__(self, module: LightningModule, placement: Placement, pipeline: Pipeline, index: int) -> None:
        params = _unique(p for stage in pipeline.stage_indices for p in placement.stage_params(stage))
        super().__init__(module, params, placement)
        self.pipeline = pipeline
        self.norm_slot = index
        self.device = pipeline.device
        self._example_input: Any = None

    @classmethod
    def place(
        cls,
        module: LightningModule,
        placement: Placement,
        index: int,
        *,
        device: torch.device,
        group: dist.ProcessGroup,
        schedule: type,
    ) -> Worker:
        """Stage process ``index``: its stages' blocks stay (they go to its device with the module), the
        others go to the meta device (``on_setup``). A pipeline of one stage is a ``SoleStage``."""
        if len(placement.bounds) == 1:
            return SoleStage(module, placement, device)
        stages = placement.stages_of(index)
        pipeline = Pipeline(
            modules=[
                StageModule(placement.layers[slice(*placement.bounds[s])], first=s == 0, last=s == len(placement.bounds) - 1)
                for s in stages
            ],
            stage_indices=stages,
            holders=[placement.holder(s) for s in range(len(placement.bounds))],
            device=device,
            group=group,
            schedule=schedule,
            loss_fn=module.pipeline_loss,
        )
        return cls(module, placement, pipeline, index)

    @override
    def on_setup(self) -> None:
        # The other stages' layers go to the meta device (shapes only), so nothing can use their
        # values here, which would go stale as the stages train (`share_model` filled them in).
        super().on_setup()
        held = {i for s in self.pipeline.stage_indices for i in range(*self.placement.bounds[s])}
        others = [layer for i, layer in enumerate(self.placement.layers) if i not in held]
        drop_to_meta(others, keep=self.params)
        # Lightning's model summary runs `example_input_array` through the whole model on every rank,
        # which the meta layers here cannot compute: hidden until the model is whole again (rank 0,
        # which prints the summary, holds the whole model).
        if getattr(self.module, "_example_input_array", None) is not None:
            self._example_input, self.module._example_input_array = self.module._example_input_array, None

    @override
    def on_teardown(self, group: dist.ProcessGroup, finished: bool) -> None:
        super().on_teardown(group, finished)
        if self._example_input is not None:
            self.module._example_input_array, self._example_input = self._example_input, None

    @override
    def expected_grads(self, shares: Shares) -> int:
        """Gradients each parameter receives in this step's backward: one per micro-batch."""
        return shares.micro_batches if shares.pipeline_size else 0

    @override
    def arrivals(self, shares: Shares, batch: Any) -> Arrivals:
        """As every worker's, but a tied parameter used by several stages this process holds receives
        one gradient per micro-batch from each of them."""
        found = super().arrivals(shares, batch)
        held = set(self.held_stages())
        uses = {p: len(held & set(t.stages)) for t in self.placement.tied for p in t.params}
        more = {p: found.of(p) * n for p, n in uses.items() if n > 1}
        return Arrivals(found.each, {**found.params, **more}) if more else found

    @override
    def train_step(
        self, batch: Any, batch_idx: int, shares: Shares, accumulate: int, grads: GradPolicy, clock: Any
    ) -> tuple[WorkerReport, Any]:
        start, stop = shares.pipeline
        if start == stop:
            self._train(lambda: None, grads)
            return WorkerReport(), None
        share = slice_batch(batch, start, stop)
        inputs, targets = pipeline_pair(self.module, share)
        scale = (stop - start) / (shares.batch_size * accumulate * shares.micro_batches)
        encoders = self.encoders if self.encoders is not None and self.encoders.placement else None

        def compute() -> tuple[Any, float]:
            with span(clock, "pipeline"):
                started = time.perf_counter()
                # A placed encoder in this stage's blocks answers each micro-batch with its rows of the
                # output its host computed for the pipeline's share (`multimodal.py`).
                with encoders.receiving(share, clock, pipelined=True) if encoders is not None else nullcontext():
                    result = self.pipeline.train_step(inputs, targets, shares.micro_batches, scale, clock)
                if encoders is not None:
                    encoders.send_gradients()
                    encoders.finish()
                self._pad(stop - start, started, clock, "stage")  # emulated work counts as this stage's compute
                return result

        try:
            outputs, pipeline_loss = self._train(compute, grads)
        except BaseException as error:
            if encoders is not None:
                encoders.abort()
            self._note_inputs(error, inputs)
            raise
        if not self.pipeline.is_last:
            return WorkerReport(), None
        with span(clock, "compute"):
            detached = apply_to_collection(outputs, Tensor, lambda t: t.detach())  # a tensor, or a tuple of them
            report, output = self._replay("training_step", share, (batch_idx,), detached, shares)
        report.pipeline_loss = pipeline_loss  # checked once on the host (`check_same_loss`)
        return report, output

    @override
    def recorded_samples(self, shares: Shares, report: WorkerReport) -> int:
        return shares.pipeline_size

    @override
    def held_stages(self) -> list[int]:
        return list(self.pipeline.stage_indices)

    @property
    @override
    def runs_step_methods(self) -> bool:
        return self.pipeline.is_last

    def _note_inputs(self, error: BaseException, inputs: Any) -> None:
        """Where the first stage failed on inputs of another floating dtype than the model's weights,
        say that the stages take the batch as the loader gives it: a cast in the step never reaches them."""
        if 0 not in self.pipeline.stage_indices or not isinstance(error, RuntimeError):
            return
        if not re.search(r"dtype|scalar type|[Ii]nput type", str(error)):  # torch's words for mismatched dtypes
            return
        given: set[torch.dtype] = set()
        apply_to_collection(inputs, Tensor, lambda t: given.add(t.dtype) if t.is_floating_point() else None)
        weights = {p.dtype for p in self.module.parameters() if p.is_floating_point() and not p.is_meta}
        if given and weights and not given <= weights:
            error.add_note(
                f"[hetero] The pipeline's first stage took `pipeline_inputs(batch)` as {sorted(map(str, given))}, and"
                f" the model's weights are {sorted(map(str, weights))}: the stages compute the blocks on the batch as"
                " the loader gives it, outside `training_step`, so a cast (or any change) the step makes to the"
                " batch does not reach them. Make it in `pipeline_inputs(batch)`, or give the data in the model's dtype."
            )

    @override
    def note(self) -> str:
        note = " The layers of the other stages exist only on the meta device on this rank."
        if not self.pipeline.is_last:
            note += (
                " A stage before the last never sees the model's outputs, so your step methods do not run"
                " here: outputs they collect stay empty, and hooks such as `on_validation_epoch_end` must"
                " handle none."
            )
        return note

    @override
    def eval_step(self, method: str, batch: Any, rest: tuple, shares: Shares) -> tuple[WorkerReport, Any]:
        start, stop = shares.pipeline
        if start == stop:
            return WorkerReport(), None
        share = slice_batch(batch, start, stop)
        inputs = pipeline_inputs_only(self.module, share)
        try:
            outputs = self.pipeline.eval_step(inputs, shares.micro_batches)
        except Exception as error:
            self._note_inputs(error, inputs)
            raise
        if not self.pipeline.is_last:
            return WorkerReport(), None
        return self._replay(method, share, rest, outputs, shares)

    def _replay(self, method: str, share: Any, rest: tuple, outputs: Any, shares: Shares) -> tuple[WorkerReport, Any]:
        """Run the module's ``method`` on the share with ``forward`` answering with the pipeline's outputs."""
        calls = []
        kinds = sorted({"cpu", self.pipeline.device.type})
        stages = _autocast_state(kinds)  # what the stages computed under: the strategy's precision

        def forward(*args: Any, **kwargs: Any) -> Any:
            calls.append(_autocast_state(kinds))
            return outputs

        self.module.forward = forward  # type: ignore[method-assign]
        try:
            with torch.no_grad():
                share = move_data_to_device(share, self.pipeline.device)
                report, output = self._run_step(method, share, rest, shares.pipeline_size, shares.batch_size)
        except Exception as error:
            if calls and isinstance(error, RuntimeError) and "does not require grad" in str(error):
                error.add_note(
                    f"[hetero] `{type(self.module).__name__}.{method}` ran on the pipeline's last stage, where"
                    " `self(inputs)` gives the pipeline's output, computed on the stages: it carries no graph back"
                    " to the inputs or the layers, so a gradient taken inside the step method (`torch.autograd.grad`"
                    " for a saliency map or a gradient penalty) has nothing to follow. Train such a model as replicas"
                    " (`parallelism='replicas'`), where every worker runs the step as written."
                )
            if not calls and isinstance(error, (RuntimeError, NotImplementedError)) and re.search(r"\bmeta\b", str(error)):
                error.add_note(
                    f"[hetero] `{type(self.module).__name__}.{method}` ran on the pipeline's last stage, where"
                    " `self(inputs)` gives the pipeline's output, and computed with layers this stage does not hold"
                    " (on the meta device here) without calling `self(...)`: the step methods must compute the"
                    " model's output with one `self(inputs)` call, not call its layers themselves."
                )
            raise
        finally:
            del self.module.forward
        if len(calls) != 1:
            raise RuntimeError(
                f"`{type(self.module).__name__}.{method}` called the model {len(calls)} time(s); the hetero strategy"
                " needs it to compute its outputs with exactly one `self(inputs)` call, which the pipeline answers"
                " on its stages."
            )
        if calls[0] != stages:
            raise ValueError(
                f"`{type(self.module).__name__}.{method}` calls the model under `torch.autocast` of its own"
                f" ({_describe_autocast(kinds, calls[0])}, where the Trainer's precision computes"
                f" {_describe_autocast(kinds, stages)}), but a pipeline's stages compute its blocks outside the step"
                " method, under the Trainer's precision: their share of every batch would be computed at another"
                " precision than the step asks for. Use `Trainer(precision='bf16-mixed')`, which autocasts every"
                " stage, or train the model as replicas (`parallelism='replicas'`)."
            )
        return report, output


def _autocast_state(kinds: Sequence[str]) -> tuple:
    """Whether autocast is on for each device type of ``kinds``, and to which dtype (where it is on)."""
    return tuple((torch.get_autocast_dtype(k) if torch.is_autocast_enabled(k) else None) for k in kinds)


def _describe_autocast(kinds: Sequence[str], state: tuple) -> str:
    on = [f"{str(dtype).removeprefix('torch.')} on {kind}" for kind, dtype in zip(kinds, state) if dtype is not None]
    return ", ".join(on) if on else "no autocast"


def check_same_loss(model: str, report: WorkerReport) -> None:
    """The stages train on ``pipeline_loss``; a ``training_step`` that returns another loss would
    train the CPU worker's share on something else, so say so instead of training a wrong model.
    (The two are computed in different orders: micro-batch by micro-batch, and over the share.)
    Called with the report on the host (``WorkerReport.to_host``), on a last stage."""
    step_loss, pipeline_loss = report.loss, report.pipeline_loss
    if pipeline_loss is None:
        return
    assert not isinstance(step_loss, Tensor) and not isinstance(pipeline_loss, Tensor), "read on the host first"
    if step_loss is None or not (math.isfinite(step_loss) and math.isfinite(pipeline_loss)):
        return  # the strategy's non-finite policy decides what a NaN or Inf loss does
    # Only the order of the sums differs: to float64's rounding, float32's, or a half precision's.
    tolerance, floor = {torch.float64: (1e-9, 1e-12), torch.float32: (1e-4, 1e-6)}.get(report.loss_dtype, (5e-2, 1e-6))
    if not math.isclose(step_loss, pipeline_loss, rel_tol=tolerance, abs_tol=floor):
        raise ValueError(
            f"`{model}.training_step` returned a loss of {step_loss:.6g} where `pipeline_loss` gives"
            f" {pipeline_loss:.6g} on the same samples, over its micro-batches. The pipeline stages train on"
            " `pipeline_loss(output, target)`, so `training_step` must return exactly that loss (no extra terms;"
            " put regularizers into `pipeline_loss` or into the layers), and `pipeline_loss` must be a mean over"
            " the samples (not a sum, nor a mean over the tokens an `ignore_index` leaves): the micro-batches'"
            " losses are weighed by their samples."
        )


_ENCODER_SPEED = re.compile(r"^.+@(cpu|device)$")

ROLES: dict[str, Any] = {"cpu": CpuWorker, "stage": StageWorker, "replica": DeviceReplica}
"""Each ``topology.Role.kind``'s class."""


def check_emulated_speed(speed: Optional[Mapping[str, float]]) -> dict[str, float]:
    """``HeteroStrategy(emulated_speed=...)``, checked: samples per second by ``Worker.speed_key``, and
    by ``"<modality>@cpu"`` / ``"<modality>@device"`` for a multimodal model's encoder on a CPU worker or
    a device's process (its forward, per sample carrying the modality)."""
    if speed is None:
        return {}
    keys = {role.speed_key for role in ROLES.values()}
    if not isinstance(speed, Mapping) or not all(k in keys or _ENCODER_SPEED.match(str(k)) for k in speed):
        raise ValueError(
            f"`emulated_speed={speed!r}` must map 'cpu', 'pipeline', '<modality>@cpu' or '<modality>@device' to"
            " samples per second (testing only)."
        )
    for key, value in speed.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"`emulated_speed[{key!r}]={value!r}` must be a positive number of samples per second.")
    return {key: float(value) for key, value in speed.items()}
