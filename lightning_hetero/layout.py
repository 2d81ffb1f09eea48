"""A hetero run's layout, and what changes it while training.

The layout is one value, a ``HeteroPlan`` (``plan.py``): the strategy's arguments, a plan given or
replayed, or the workload analyzer's once it applies one before the model is cut. While training,
the rebalancer moves the CPU fraction (``set_cpu_fraction``), and with it the torch threads an
emulated stage takes from CPU workers that have no share, and the split of the cores between
loading and compute (``set_cpu_threads``, ``set_dataloader_workers``; ``loading.py``); a multimodal
model's encoders may be placed elsewhere at any batch (``set_encoder_placement``; ``multimodal.py``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.utils.data import DataLoader

from lightning_hetero.loading import LoaderPolicy, set_workers
from lightning_hetero.module import offers_blocks
from lightning_hetero.multimodal import EncoderPacing, check_placement, offers_modalities
from lightning_hetero.plan import HeteroPlan
from lightning_hetero.shares import Shares, no_single_samples, split_batch
from lightning_hetero.topology import ProcessGroups, Role, Topology, pin_to, threads_for, usable_cores
from lightning_hetero.workers import check_emulated_speed

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_hetero.engine import StepEngine
    from lightning_hetero.strategy import HeteroStrategy

__all__ = ["Planner", "RunLayout"]

log = logging.getLogger(__name__)

Planner = Callable[["pl.Trainer", "HeteroStrategy", list[nn.Module]], HeteroPlan]
"""What gives a run its plan when the strategy is about to cut the model (``plan_with``)."""


class RunLayout:
    """Mixin for the hetero strategy: its layout and the topology it gives. The strategy provides
    ``_plan``, ``_stage_devices``, ``_num_nodes``, ``_emulated_speed``, ``_planner``, ``_groups``
    (once connected), ``_engine`` (once set up), ``_tuned_loaders`` (the training DataLoaders whose
    workers it may change), ``_schedule_request`` (the schedule arguments, None with a plan given),
    ``_given`` (the ``cpu_fraction``, ``micro_batches``, ``offload`` and ``encoders`` given other
    than their defaults) and ``local_rank``."""

    _plan: HeteroPlan
    _stage_devices: list[torch.device]
    _num_nodes: int
    _emulated_speed: dict[str, float]
    _planner: Optional[Planner]
    _groups: Optional[ProcessGroups]
    _engine: Optional[StepEngine]
    _tuned_loaders: list[weakref.ref[DataLoader]]
    _loader_policy: LoaderPolicy
    _schedule_request: Optional[tuple[Any, Any]]
    _given: dict[str, Any]
    local_rank: int
    lightning_module: Optional[LightningModule]
    _encoder_pacing: Optional[EncoderPacing] = None

    @property
    def plan(self) -> HeteroPlan:
        """The run's layout: the plan given, the plan of the layout arguments, or the workload analyzer's
        once it has applied one. Its CPU fraction follows ``set_cpu_fraction``."""
        return self._plan

    @property
    def schedule_request(self) -> tuple[Any, Any]:
        """The schedule and stages per process as the arguments ask for them, each ``"auto"`` where they
        leave it to a planner (the workload analyzer); a plan given fixes both."""
        request = self._schedule_request
        return request if request is not None else (self._plan.schedule, self._plan.stages_per_process)

    def plan_with(self, planner: Planner) -> None:
        """Have ``planner(trainer, strategy, blocks)`` give this run's plan, on every rank, when the
        strategy is about to cut the model: in its ``setup``, once per process, after the module's
        ``setup`` and ``configure_model``, in the run's precision (``WorkloadAnalyzer`` registers
        itself from its own ``setup`` hook)."""
        self._planner = planner

    def apply_plan(self, plan: HeteroPlan) -> None:
        """Take a plan's layout before the model is cut. Its stages, CPU workers and mode must be the
        run's: the processes exist already."""
        if not plan.runs_on(self._plan):
            raise ValueError(f"A plan for {plan.stages} x {plan.cpu_workers} CPU worker(s) cannot lay out this run.")
        if self._engine is not None:
            raise RuntimeError("`apply_plan` must come before the strategy cuts the model (its `setup`).")
        self._plan = replace(plan, cpu_threads=self._plan.cpu_threads if plan.cpu_threads is None else plan.cpu_threads)
        log.info("hetero: applied a plan:\n%s", self._plan.table())
        changed = [f"{k}={v!r} with {getattr(plan, k)!r}" for k, v in self._given.items() if getattr(plan, k) != v]
        if changed:
            rank_zero_warn(
                f"The plan applied (the workload analyzer's) replaces {', '.join(changed)}: it plans them (a schedule"
                " you name stays). To train with the values given, leave the analyzer out, or replay a plan (`plan=`)."
            )
        self._set_threads()

    def layout(self) -> dict[str, Any]:
        """This run's layout, for logs."""
        return {**self._plan.as_dict(), "num_nodes": self._num_nodes}

    @property
    def mode(self) -> str:
        return self._plan.mode

    @property
    def micro_batches(self) -> int:
        """Micro-batches of the pipeline's share: 1 where the devices do not pipeline (replicas, one stage)."""
        return self._plan.micro_batches if not self.topology.replicas and len(self._stage_devices) > 1 else 1

    @property
    def cpu_fraction(self) -> float:
        """The share of each batch the CPU workers compute."""
        return self._plan.cpu_fraction

    def set_cpu_fraction(self, fraction: float) -> None:
        """Give the CPU workers ``fraction`` of the batches from the next one on (the plan checks it).
        Every rank must set the same value at the same step (decide on one rank and broadcast)."""
        self._plan = replace(self._plan, cpu_fraction=float(fraction))
        self._set_threads()

    def _set_threads(self) -> None:
        # An emulated stage takes the cores of CPU workers that have no share (`threads_for`).
        if self._groups is None:  # not in a worker process (yet)
            return
        plan = self._plan
        if plan.cpu_cores is not None and self.role.is_cpu_worker:
            pin_to(plan.cpu_cores[self.role.index])  # its NUMA node's cores, with its memory
        cpu_computes = plan.cpu_fraction > 0 or any(host.startswith("cpu") for host in plan.encoders.values())
        threads = threads_for(self.role, self.topology, usable_cores(), plan.cpu_threads, cpu_computes, plan.stage_threads)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
            if self._engine is not None:
                self._engine.sync.set_threads(threads)

    @property
    def whole_batch_norm(self) -> bool:
        """Whether BatchNorm takes the whole batch's statistics (``Trainer(sync_batchnorm=True)``, which
        gives the strategy its layer sync)."""
        return getattr(self, "_layer_sync", None) is not None

    @property
    def encoder_placement(self) -> dict[str, str]:
        """Where a multimodal model's placed encoders run, by modality (those left out are ``"split"``)."""
        return dict(self._plan.encoders)

    def placed_plan(self, placement: Mapping[str, str], module: Any) -> HeteroPlan:
        """This run's plan with a multimodal model's encoders placed so; a ``ValueError`` where this
        layout cannot run that placement (for ``module``, where given)."""
        plan = replace(self._plan, encoders=check_placement(placement))
        if module is not None:
            plan.place_blocks(module, whole_batch_norm=self.whole_batch_norm)  # checks the placement for the model
        return plan

    def set_encoder_placement(self, placement: Mapping[str, str]) -> None:
        """Place a multimodal model's encoders so from the next training batch on (``HeteroStrategy(encoders=...)``;
        modalities left out are ``"split"``). Every rank must set the same placement at the same step."""
        plan = self.placed_plan(placement, self.lightning_module)
        self._plan = plan
        if self._engine is not None and self._engine.worker.encoders is not None:
            self._engine.worker.encoders.set_placement(plan.encoders)
        self._set_threads()

    def shares(self, batch_size: int) -> Shares:
        """How a batch of ``batch_size`` samples is divided this step."""
        shares = split_batch(batch_size, self.cpu_fraction, self._plan.cpu_workers, self.micro_batches)
        norm = self._engine.worker.norm if self._engine is not None else None
        if norm is not None and not norm.whole:  # replicas with per-share BatchNorm statistics
            shares = no_single_samples(shares, norm.devices, self.micro_batches)
        return shares

    @property
    def emulated_speed(self) -> dict[str, float]:
        """TESTING ONLY: the samples per second workers are slowed down to (see the class doc)."""
        return dict(self._emulated_speed)

    def set_emulated_speed(self, speed: Optional[Mapping[str, float]]) -> None:
        """TESTING ONLY: emulate other worker speeds from the next batch on (``None``: real speed)."""
        self._emulated_speed = check_emulated_speed(speed)
        if self._engine is not None:
            self._engine.pace(self._emulated_speed)
        if self._encoder_pacing is not None:
            self._encoder_pacing.set(self._emulated_speed)

    def _pace_encoders(self, module: LightningModule) -> None:
        """TESTING ONLY: a multimodal model's encoders at their emulated speeds on this process
        (``emulated_speed``'s ``"<modality>@cpu"`` and ``"@device"``), before anything times them."""
        if offers_modalities(module) and any("@" in key for key in self._emulated_speed):
            self._encoder_pacing = EncoderPacing(module, "cpu" if self.role.is_cpu_worker else "device")
            self._encoder_pacing.set(self._emulated_speed)

    def check_model(self, model: LightningModule, cut_later: bool = False) -> list[nn.Module]:
        """The model's blocks, after checking the contract and that they fill the stages; decides
        ``parallelism="auto"`` for the model. ``cut_later``: a planner is to choose the cut
        (``plan_with``), and what depends on the cut is checked in the plan it gives."""
        self._plan = self._plan.for_model(model)
        named = [f"{k}={v!r}" for k, v in zip(("schedule", "stages_per_process"), self._schedule_request or ()) if v != "auto"]
        if named and not offers_blocks(model):  # replicas; a model with blocks may become a pipeline (the analyzer)
            rank_zero_warn(
                f"`{', '.join(named)}` orders a pipeline's stages, but `{type(model).__name__}` offers no blocks and trains"
                " as replicas (whole copies of the model), where it has no effect. Give the model blocks"
                " (`pipeline_layers()`) to train it as a pipeline, or leave it out."
            )
        return self._plan.place_blocks(model, cut_later, self.whole_batch_norm)[0]

    @property
    def topology(self) -> Topology:
        plan = self._plan
        cores = tuple(tuple(c) for c in plan.cpu_cores) if plan.cpu_cores is not None else None
        return Topology(
            cpu_workers=plan.cpu_workers, stage_devices=self._stage_devices, num_nodes=self._num_nodes,
            replicas=plan.parallelism == "replicas", cpu_cores=cores,
        )  # fmt: skip

    @property
    def role(self) -> Role:
        return self.topology.role(self.local_rank)

    # ----------------------------------------------------------- the cores

    @property
    def cpu_worker_threads(self) -> Optional[int]:
        """Torch threads of each CPU worker as the run stands (``None`` without CPU workers)."""
        topology = self.topology
        if not topology.cpu_workers:
            return None
        return threads_for(topology.role(0), topology, usable_cores(), self._plan.cpu_threads, True)

    def set_cpu_threads(self, threads: Optional[int]) -> None:
        """Give every CPU worker ``threads`` torch threads from now on (``None``: the cores the other
        processes leave). Every rank must set the same value at the same step."""
        self._plan = replace(self._plan, cpu_threads=threads)
        self._set_threads()

    def set_stage_threads(self, threads: Optional[int]) -> None:
        """Give every stage process ``threads`` torch threads from now on (``None``: as the topology
        shares the cores). Every rank must set the same value at the same step."""
        self._plan = replace(self._plan, stage_threads=threads)
        self._set_threads()

    @property
    def dataloader_workers(self) -> LoaderPolicy:
        """``dataloader_workers`` as given: which DataLoaders' worker processes the run may choose."""
        return self._loader_policy

    @property
    def tuned_loaders(self) -> list[DataLoader]:
        """The training DataLoaders whose worker processes this run may change (``dataloader_workers``):
        those still in use (a loader made again each epoch leaves the earlier ones to be freed)."""
        self._tuned_loaders[:] = [ref for ref in self._tuned_loaders if ref() is not None]
        return [loader for loader in (ref() for ref in self._tuned_loaders) if loader is not None]

    def set_dataloader_workers(self, workers: int) -> None:
        """Give the training DataLoaders this run tunes ``workers`` worker processes per rank from their
        next iterator on: call it between epochs (``on_train_epoch_start``), since an iterator's worker
        processes are fixed when it starts."""
        self._plan = replace(self._plan, dataloader_workers=workers)
        for loader in self.tuned_loaders:
            set_workers(loader, workers)
