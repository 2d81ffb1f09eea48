"""``HeteroStrategy``: the Lightning integration of a hetero run.

The strategy holds the run's configuration (its layout is one ``HeteroPlan``), sets up the
processes and the model, and hands each step to the step engine (``engine.py``), which runs it
in the order it happens: split the batch, compute every share, exchange the results, judge
non-finite values, sum the gradients, step. What differs by role lives in the role's class
(``workers.py``), what differs by mode behind the gradient sync (``sync.py``). The result is the
model a single process trains on the same batches.
"""

from __future__ import annotations

import inspect
import logging
import os
import warnings
import weakref
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from enum import Enum
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import BasePredictionWriter, DeviceStatsMonitor, ThroughputMonitor
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.utils import _sync_module_states
from torch.nn.parameter import is_lazy
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

import lightning.pytorch as pl
from lightning_hetero.accelerator import HeteroAccelerator
from lightning_hetero.checkpoints import StageCheckpoints
from lightning_hetero.collectives import ControlCollectives
from lightning_hetero.data import loader_batch_size, same_batches_on_every_rank, with_workers
from lightning_hetero.devices import keep_freed_memory, leave_cuda_rng_alone
from lightning_hetero.engine import StepEngine
from lightning_hetero.finite import NonfinitePolicy, check_policy
from lightning_hetero.launcher import HeteroLauncher, resolve_start_method, started_other_ranks
from lightning_hetero.layout import Planner, RunLayout
from lightning_hetero.loading import LoaderPolicy, check_loader_policy, tunable
from lightning_hetero.mesh import LocalMesh
from lightning_hetero.module import check_copies_agree, check_optimizers
from lightning_hetero.monitored import guard_monitored_values
from lightning_hetero.offload import BucketStep
from lightning_hetero.pipeline import ScheduleArg
from lightning_hetero.placing import build_sync, place_rank
from lightning_hetero.plan import LAYOUT_ARGUMENTS, HeteroPlan, layout_plan
from lightning_hetero.precision import HeteroPrecision
from lightning_hetero.record import StepRecord
from lightning_hetero.results import sync_metrics_over
from lightning_hetero.shares import batch_size_of
from lightning_hetero.signals import StepSignals
from lightning_hetero.state import move_materialized
from lightning_hetero.topology import ProcessGroups, StagesArg, check_every_rank_agrees, connect, record_failure, resolve_stage_devices
from lightning_hetero.workers import check_emulated_speed

__all__ = ["HeteroStrategy", "hetero_strategy"]

log = logging.getLogger(__name__)

class HeteroStrategy(RunLayout, StageCheckpoints, ControlCollectives, ParallelStrategy):
    """Train one model on CPU workers and a pipeline of stages at the same time (docs/how-it-works.md).

    Args:
        mode: ``"coarse"`` (gradients summed after the backward) or ``"fine"`` (bucket by bucket during it).
        stages: ``"auto"`` (one stage per GPU; two emulated CPU stages without a GPU), a number of stages,
            or a list of devices such as ``["cuda:0", "cuda:1"]`` or ``["cpu", "cpu"]``.
        cpu_workers: CPU-worker processes, each with a full replica of the model (0: pipeline only); ``"auto"``: one
            per NUMA node, pinned to its cores; or each one's cores, ``[[0, 1], [2, 3]]`` (``docs/cpu-workers.md``).
        cpu_threads: torch threads per CPU worker; ``None``: its pinned cores, or the machine's shared out.
        micro_batches: micro-batches the pipeline's share is cut into (a ``WorkloadAnalyzer`` among the callbacks
            plans them, as it plans the cut, ``cpu_fraction`` and ``offload``, saying what it changed).
        schedule: a schedule known to ``get_schedule_class``: one stage per process ("GPipe", "1F1B"), or several
            ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"; ``docs/schedules.md``);
            ``"auto"``: the workload analyzer's choice (GPipe without one).
        stages_per_process: the stages each stage process holds with a multi-stage schedule: ``"auto"`` is 2 for
            those (a V for ZBVZeroBubble and DualPipeV), 1 for the others, or the workload analyzer's choice; the
            blocks are cut into that many stages per process.
        cpu_fraction: the share of every batch the CPU workers compute, in ``[0, 1]``, kept as given (unless a
            ``WorkloadAnalyzer`` plans the run); ``"auto"``: the share the CPU earns in training (``docs/rebalancing.md``).
        start_method: ``"popen"`` (run the script again per rank, as DDP), ``"fork"``, ``"spawn"``,
            ``"forkserver"``; ``"auto"``: fork in a notebook, popen elsewhere. Unused under torchrun or SLURM.
        timeout: how long a collective may wait before the run fails (a ``timedelta`` or seconds).
        offload: fine mode: the buckets whose optimizer step runs on the CPU (fp32 master weights and
            state in CPU memory): ``"none"``, ``"all"``, bucket indices (0 is the last layers'), or
            ``"auto"`` (on GPU stages, until the state left on the GPU fits in a quarter of it).
        bucket_size_mb: fine mode: the parameter size that closes a bucket (whole layers of one stage).
        plan: a ``HeteroPlan`` or its YAML file, replayed exactly (leave the arguments above as they are).
        dataloader_workers: the DataLoaders' worker processes per rank: ``"auto"`` plans them (with the
            workload analyzer) and re-splits them with the cores while training (with the rebalancer) for
            training DataLoaders left at ``num_workers=0``, keeping a count you set; ``"tune"`` also for
            those; ``"keep"`` never changes one; an int sets every DataLoader's (``docs/planning.md``).
        parallelism: what the devices hold: ``"pipeline"``, a stage each, cut from the model's blocks;
            ``"replicas"``, the whole model each (any LightningModule); ``"auto"``: a pipeline where the model offers blocks.
        encoders: a multimodal model's encoders by modality, placed: ``"cpuN"`` (CPU worker N) or ``"deviceN"``
            (the process of device N) computes that encoder for every worker's share of each batch, while the
            others compute theirs; ``"split"`` (the default for any left out): every worker its own share's
            (``docs/multimodal.md``).
        shard_cpu_optimizer: with two or more CPU workers, split the optimizer state they hold (fine mode's
            offloaded buckets, coarse mode's replicas') and its step between them, ZeRO-style
            (``docs/cpu-workers.md``); ``False``: each CPU worker steps all of it.
        shard_across_nodes: with several nodes, split it between the CPU workers of every node instead.
        nonfinite: NaN or Inf in any worker's loss or gradients: ``"error"`` ends the run naming the step
            and the workers; ``"skip"`` skips that optimizer step on every rank (``docs/reliability.md``).
        emulated_speed: TESTING ONLY: ``{"cpu": r, "pipeline": q, "image@device": s}`` makes each side's share
            of a training batch (an encoder's forward there) take at least ``samples / speed`` seconds.
    """

    strategy_name = "hetero"

    def __init__(
        self,
        mode: Literal["coarse", "fine"] = "coarse",
        stages: StagesArg = "auto",
        cpu_workers: Union[int, Literal["auto"], Sequence[Sequence[int]]] = 1,
        cpu_threads: Optional[int] = None,
        micro_batches: int = 4,
        schedule: Union[ScheduleArg, Literal["auto"]] = "auto",
        stages_per_process: Union[int, Literal["auto"]] = "auto",
        cpu_fraction: Union[float, Literal["auto"]] = "auto",
        start_method: Literal["auto", "popen", "fork", "spawn", "forkserver"] = "auto",
        timeout: Union[timedelta, float] = timedelta(minutes=5),
        offload: Union[Literal["auto", "none", "all"], Sequence[int]] = "auto",
        bucket_size_mb: float = 25.0,
        plan: Union[HeteroPlan, str, Path, None] = None,
        nonfinite: NonfinitePolicy = "error",
        emulated_speed: Optional[Mapping[str, float]] = None,
        parallelism: Literal["auto", "pipeline", "replicas"] = "auto",
        dataloader_workers: LoaderPolicy = "auto",
        encoders: Optional[Mapping[str, str]] = None,
        shard_cpu_optimizer: bool = True,
        shard_across_nodes: bool = False,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        arguments = {name: value for name, value in locals().items() if name in LAYOUT_ARGUMENTS}
        self._plan = layout_plan(plan, arguments, _LAYOUT_DEFAULTS)
        self._earned_fraction = plan is None and cpu_fraction == "auto"
        self._schedule_request = (schedule, stages_per_process) if plan is None else None
        planned = ("cpu_fraction", "micro_batches", "offload", "encoders")  # what the analyzer plans, where given
        self._given = {k: arguments[k] for k in planned if arguments[k] != _LAYOUT_DEFAULTS[k]}
        self._loader_policy = check_loader_policy(dataloader_workers)
        if isinstance(self._loader_policy, int):
            self._plan = replace(self._plan, dataloader_workers=self._loader_policy)
        self._tuned_loaders: list[weakref.ref[DataLoader]] = []  # this process's, from `process_dataloader` (not pickled by then)
        self._stage_devices = resolve_stage_devices(self._plan.stages)
        self._start_method = resolve_start_method(start_method)
        self._timeout = _check_timeout(timeout)
        self._nonfinite = check_policy(nonfinite)
        self._emulated_speed = check_emulated_speed(emulated_speed)
        self._num_nodes = 1
        self._groups: Optional[ProcessGroups] = None
        self._engine: Optional[StepEngine] = None
        self._copies_checked = True
        self._unguard: Callable[[], None] = _nothing
        self._cuda_rng_back: Callable[[], None] = _nothing
        self._planner: Optional[Planner] = None

    @property
    def device_names(self) -> list[str]:
        return self.topology.device_names()

    @property
    def process_groups(self) -> Optional[ProcessGroups]:
        return self._groups

    @property
    def is_distributed(self) -> bool:
        # Lightning then splits the data between nodes (`distributed_sampler_kwargs`); within a node
        # every rank sees the same batches (`process_dataloader`).
        return self._num_nodes > 1

    @property
    @override
    def root_device(self) -> torch.device:
        return self.topology.local_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return self.topology.procs_per_node

    @property
    @override
    def parallel_devices(self) -> Optional[list[torch.device]]:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: Optional[list[torch.device]]) -> None:
        # The devices follow from `stages` and `cpu_workers`, whatever the Trainer's `devices` flag chose.
        self._parallel_devices = None if devices is None else self.topology.local_devices

    @property
    @override
    def accelerator(self) -> Optional["pl.accelerators.Accelerator"]:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Optional["pl.accelerators.Accelerator"]) -> None:
        # Lightning hands a string strategy the accelerator it picked for the machine; a hetero run's
        # processes sit on different devices, which only HeteroAccelerator serves.
        keep = accelerator is None or isinstance(accelerator, HeteroAccelerator)
        self._accelerator = accelerator if keep else HeteroAccelerator()

    @property
    @override
    def precision_plugin(self) -> HeteroPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = HeteroPrecision()
        return self._precision_plugin  # type: ignore[return-value]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # Whatever Lightning chose, as the hetero plugin of its kind (which refuses float16 mixed precision).
        self._precision_plugin = HeteroPrecision.of(plugin) if plugin is not None else None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self._num_nodes, "rank": self.node_rank}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        stage = trainer.state.stage
        keep = not trainer._accelerator_connector.use_distributed_sampler
        dataloader = same_batches_on_every_rank(dataloader, stage, trainer.current_epoch, keep)
        workers, policy = self._plan.dataloader_workers, self._loader_policy
        if not (isinstance(policy, int) or tunable(dataloader, policy)):
            return dataloader
        dataloader = with_workers(dataloader, workers) if workers is not None else dataloader
        if stage == RunningStage.TRAINING and not isinstance(policy, int):
            self._tuned_loaders.append(weakref.ref(dataloader))  # type: ignore[arg-type]
        return dataloader

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return False  # weights load into the whole model before `setup` cuts it into stages

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = HeteroLauncher(self, start_method=self._start_method)
            return
        if started_other_ranks():  # by popen, for an earlier Trainer: this one's calls run in them too, watched
            self._launcher = HeteroLauncher(self, start_method="popen")
            return
        # Started from outside (`LOCAL_RANK` is set): a launcher's `WORLD_SIZE` must fit the layout,
        # else this process would wait for processes that never come.
        started = os.environ.get("WORLD_SIZE", "")
        if started.isdigit():
            try:
                self.topology.check_world_size(int(started))
            except RuntimeError as error:
                error.add_note(
                    "[hetero] `LOCAL_RANK` and `WORLD_SIZE` in this process's environment say a launcher started it. If"
                    " none did, an earlier run in this process left them there (Lightning's DeepSpeedStrategy sets"
                    " `RANK`, `LOCAL_RANK` and `WORLD_SIZE`): remove them from `os.environ` before this fit."
                )
                raise

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------- setup

    @override
    def ranks_gone(self) -> Optional[str]:
        return self.launcher.ranks_gone_between_calls() if isinstance(self.launcher, HeteroLauncher) else None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        keep_freed_memory()  # every step frees and allocates its gradients again (`devices.py`)
        reset_seed()
        self.set_world_ranks()
        self._plan = self._plan.for_model(self.lightning_module)  # the groups differ by parallelism
        self.topology.check_world_size(self.world_size)
        name = self.rank_name(self.local_rank)
        gone = self.launcher.ranks_gone if isinstance(self.launcher, HeteroLauncher) else None
        # A later trainer call in the same processes (popen, torchrun) keeps the sockets of the first.
        mesh = self._groups.mesh if self._groups is not None else None
        self._groups = connect(self.cluster_environment, self.topology, self.global_rank, self._timeout, name, gone, mesh)
        log.debug("hetero: %s joined its process groups", name)
        if self._builds_its_own_run:
            # Each process made its own strategy (popen, torchrun, SLURM; every node): from the same arguments?
            agreed = {key: getattr(self._plan, key) for key in _AGREED}
            check_every_rank_agrees(
                agreed, self._groups.control, self._rank_name_of, "`HeteroStrategy` arguments",
                "Start every node and process with the same command and configuration.",
            )
            check_every_rank_agrees(
                _trainer_settings(self.lightning_module.trainer), self._groups.control, self._rank_name_of,
                "Trainer settings", "Start every node and process with the same command and configuration.",
            )
        if self.root_device.type == "cpu":
            self._cuda_rng_back = leave_cuda_rng_alone()
        self._set_threads()
        self.precision_plugin.use_device(self.root_device)
        trainer = self.lightning_module.trainer
        if self._earned_fraction and trainer.state.fn == TrainerFn.FITTING and self.topology.cpu_workers:
            from lightning_hetero.rebalancer import earn_fraction  # it imports this module

            earn_fraction(trainer)
        if self._emulated_speed:
            rank_zero_warn(f"`emulated_speed={self._emulated_speed}` slows this run down on purpose: tests only.")
        for message in _QUIETED:
            warnings.filterwarnings("ignore", message=message)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.lightning_module is not None and self._groups is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not self._holds(module):
            # A later call of this process (popen, torchrun) with another model object (one loaded from
            # a checkpoint to predict with) places that one: the engine holds the model it placed. The old
            # engine goes first (a plan is applied only before any model is placed: `apply_plan`).
            self._engine = None
            self._engine = self._place(module)
        self._engine.worker.on_setup()
        pids: list[Any] = [None] * dist.get_world_size(self._groups.node)
        dist.all_gather_object(pids, os.getpid(), group=self._groups.node)
        self._engine.signals = StepSignals.install(trainer, [pid for pid in pids if pid != os.getpid()])
        # Every call: a previous `teardown` in this process (popen, torchrun) moved the model to the CPU.
        move_materialized(module, self.root_device)
        _update_properties(module, device=self.root_device)
        sync_metrics_over(module, self._groups.control)
        _count_throughput_once(trainer)
        self._copies_checked = False
        if trainer.state.fn == TrainerFn.PREDICTING and self.local_rank != 0:
            self._unguard = _without_prediction_writers(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._unguard = guard_monitored_values(trainer.callbacks, self.gather, self._rank_name_of)
            _validate_on_rank_zeros_clock(trainer)
            try:
                self.setup_optimizers(trainer)
            except RuntimeError as error:
                if "multiple optimizers" in str(error):  # Lightning's advice is manual optimization, which this strategy refuses
                    error.add_note(
                        "[hetero] The hetero strategy trains with automatic optimization, one optimizer: give each"
                        " part of the model a parameter group of its own in one optimizer instead"
                        " (`torch.optim.AdamW([{'params': ..., 'lr': ...}, {'params': ..., 'lr': ...}])`)."
                    )
                raise
            check_optimizers(module, self.optimizers, self.mode, trainer.callbacks)
            skip = self._nonfinite == "skip"
            sync = build_sync(self._engine, self._plan, self.topology, self._groups, self.optimizers[0], skip)
            self.precision_plugin.sync = self._engine.sync = sync
            _optimizers_to_device(self.optimizers, self.root_device)
        self.setup_precision_plugin()
        # DeviceStatsMonitor logs from rank 0: every rank's stats travel with the step's results.
        self._engine.report_device_stats = any(isinstance(cb, DeviceStatsMonitor) for cb in trainer.callbacks)

    def _holds(self, module: Optional[LightningModule]) -> bool:
        """Whether this process has placed ``module`` (the model of an earlier call of the process)."""
        return self._engine is not None and self._engine.worker.module is module

    def _place(self, module: LightningModule) -> StepEngine:
        """Cut the model and place this rank's part of it (once per process); its step engine."""
        assert self._groups is not None
        planned = self._planner is not None and module.trainer.state.fn == TrainerFn.FITTING
        layers = self.check_model(module, cut_later=planned)
        if self._builds_its_own_run:
            # Each process built its own model (popen, torchrun, SLURM, every node): start all from rank 0's, the same model.
            named = [*module.named_parameters(), *module.named_buffers()]
            shapes = {name: ("lazy",) if is_lazy(t) else (tuple(t.shape), str(t.dtype)) for name, t in named}
            check_every_rank_agrees(
                shapes, self._groups.control, self._rank_name_of, "models",
                "Every process must build the same model (the same sizes and layers): start them with the same"
                " command and configuration.",
            )
            lazy = {name for name, t in named if is_lazy(t)}  # no values yet: each process makes them alike
            _sync_module_states(module, self._groups.control, 250 * 2**20, src=0, params_and_buffers_to_ignore=lazy)
        self.model = self.precision_plugin.convert_module(module)
        self._pace_encoders(module)
        if planned:
            assert self._planner is not None
            self.apply_plan(self._planner(module.trainer, self, layers))
        engine = place_rank(
            module,
            self._plan,
            self.topology,
            self._groups,
            node_rank=self.node_rank,
            local_rank=self.local_rank,
            device=self.root_device,
            timeout=self._timeout,
            nonfinite=self._nonfinite,
            whole_batch_norm=self.whole_batch_norm,
        )
        log.debug("hetero: %s holds blocks %s", self.rank_name(self.local_rank), engine.worker.placement.bounds)
        engine.pace(self._emulated_speed)
        return engine

    @property
    def bucket_steps(self) -> list[BucketStep]:
        """This rank's bucket steps in fine mode (none in coarse mode)."""
        return self._engine.state_sync.bucket_steps if self._engine is not None else []

    @override
    def model_to_device(self) -> None:
        pass  # `setup` places each part of the model on its rank's device

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        # Batches stay on the CPU: each rank moves only its own share to its device.
        return super().batch_to_device(batch, torch.device("cpu"), dataloader_idx)

    # ------------------------------------------------------------------- steps

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if not self._copies_checked:  # after the hooks that run before training's first batch
            assert self._groups is not None and self.lightning_module is not None
            check_copies_agree(self.lightning_module, self._groups.control)
            self._copies_checked = True
        self._running.on_batch_start()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        values = list(args) + list(kwargs.values())  # (batch, batch_idx): the model contract requires both
        shares, trainer = self.shares(batch_size_of(values[0])), self.lightning_module.trainer
        with self.precision_plugin.train_step_context():
            return self._running.training_step(trainer, values[0], values[1], shares, self.cpu_fraction)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        # The forward and backward ran in `training_step`; the engine puts the gradients back and sums them.
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._running.backward(optimizer)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self._running.finish_backward()
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        step = partial(super().optimizer_step, optimizer, model=model, **kwargs)
        return self._running.optimizer_step(closure, step, optimizer)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        with self._running.accumulating():  # the window's last batch syncs
            yield

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._eval_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._eval_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._eval_step("predict_step", args, kwargs)

    def _eval_step(self, method: str, args: tuple, kwargs: dict) -> Any:
        batch, rest = args[0], tuple(args[1:]) + tuple(kwargs.values())
        index = rest[1] if len(rest) > 1 and isinstance(rest[1], int) else 0  # (batch_idx, dataloader_idx)
        loader = (index, loader_batch_size(self.lightning_module.trainer, method, index))
        return self._running.eval_step(method, batch, rest, self.shares(batch_size_of(batch)), self._optimizer(), loader)

    @property
    def engine(self) -> Optional[StepEngine]:
        """This rank's step engine once the strategy is set up (``engine.py``): its gradient sync
        (``engine.sync``), steps skipped for NaN/Inf (``engine.skipped_steps``), every device's latest
        stats, whether a CPU worker's replica is current (``engine.replica_is_current``)."""
        return self._engine

    @property
    def _running(self) -> StepEngine:
        assert self._engine is not None, "the strategy has not been set up"
        return self._engine

    def _optimizer(self) -> Optional[Optimizer]:
        return self.optimizers[0] if self.optimizers else None

    def refresh_replicas(self) -> None:
        """Bring a CPU worker that kept out of recent optimizer steps up to date (every rank: a collective)."""
        if self._engine is not None:
            self._engine.refresh_replicas(self._optimizer())

    @property
    def step_records(self) -> list[StepRecord]:
        """This rank's recent training steps: what it computed, communicated, stepped and waited for."""
        return list(self._engine.recorder.records) if self._engine and self._engine.recorder else []

    def gather_step_records(self, count: int = 1, dst: Optional[int] = None) -> list[list[StepRecord]]:
        """Every rank's latest ``count`` step records, by global rank (see ``gather``)."""
        return self.gather(self.step_records[-count:] if count > 0 else [], dst)

    @property
    def control_group(self) -> Optional[dist.ProcessGroup]:
        """The gloo group of every rank, which Lightning's collectives run over (``collectives.py``)."""
        return self._groups.control if self._groups is not None else None

    @property
    def local_mesh(self) -> Optional[LocalMesh]:
        return self._groups.mesh if self._groups is not None else None

    # -------------------------------------------------------------- checkpoints

    @property
    def whole_model_on_rank_zero(self) -> bool:
        """Global rank 0 holds the whole model: a CPU worker or a replica (otherwise stage 0's slice)."""
        return self._plan.cpu_workers > 0 or self.topology.replicas or self._engine is None

    @override
    def on_train_end(self) -> None:
        self.refresh_replicas()  # a CPU worker that kept out of the last steps is brought up to date

    @override
    def on_validation_end(self) -> None:
        # Validation in the middle of a fit ran between two training steps: neither a wait for the next
        # batch nor part of a step, for the rebalancer, the analyzer and the monitor.
        if self._engine is not None and self._engine.recorder is not None:
            self._engine.recorder.leave_out_gap()

    # ----------------------------------------------------------------- failures

    @override
    def on_exception(self, exception: BaseException) -> None:
        # In the main process of a fork/spawn run (no process group) the error is a worker's, described there.
        if _distributed_is_initialized():
            exception.add_note(self.describe_rank())
            if self.global_rank != 0:  # global rank 0 tells which rank failed first (`launcher._Script`)
                record_failure(exception, self.rank_name(self.local_rank))

    @property
    def _builds_its_own_run(self) -> bool:
        """Whether each process made its own strategy and model (popen, torchrun, SLURM; every node of
        a run over several), rather than copying the main process's (fork, spawn on one node)."""
        copies = isinstance(self.launcher, HeteroLauncher) and self.launcher.copies_main_process
        return not copies or self.num_nodes > 1

    def _rank_name_of(self, global_rank: int) -> str:
        return self.topology.rank_name(*divmod(global_rank, self.topology.procs_per_node))

    def rank_name(self, local_rank: int) -> str:
        """A process of this node, for messages: ``global rank 2 (stage1 of <the layout>)``."""
        return self.topology.rank_name(self.node_rank, local_rank)

    def describe_rank(self) -> str:
        """Which process this is, for error messages."""
        note = self._engine.worker.note() if self._engine is not None else ""
        return f"[hetero] raised on {self.rank_name(self.local_rank)}.{note}"

    @override
    def teardown(self) -> None:
        self._unguard()
        self._unguard = _nothing
        self._cuda_rng_back()
        self._cuda_rng_back = _nothing
        if self._engine is not None:
            self._engine.close()
            finished = self.lightning_module.trainer.state.status == TrainerStatus.RUNNING  # not `_interrupt`ed
            self._engine.worker.on_teardown(self._groups.node, finished)
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        self._tuned_loaders.clear()
        if self.lightning_module is not None:
            move_materialized(self.lightning_module, torch.device("cpu"))
            _update_properties(self.lightning_module, device=torch.device("cpu"))
        assert self.accelerator is not None and self.cluster_environment is not None
        # Under popen and torchrun this is the user's own process, which goes on after the call.
        warnings.filters[:] = [f for f in warnings.filters if not (f[0] == "ignore" and f[1] and f[1].pattern in _QUIETED)]
        warnings._filters_mutated()  # type: ignore[attr-defined]
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        self.cluster_environment.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="CPU workers and pipelined stages train every batch together", mode="coarse"
        )
        strategy_registry.register(
            f"{cls.strategy_name}_fine", cls, description="hetero, syncing and stepping during the backward", mode="fine"
        )


def _without_prediction_writers(trainer: "pl.Trainer") -> Callable[[], None]:
    """Takes the prediction writers out of a rank that is not its node's first, and returns what puts
    them back. Each node's predictions are assembled on its first rank, and every other rank's are
    ``None``: a writer there would write nothing, or overwrite the first rank's files with it."""
    before = list(trainer.callbacks)
    if not any(isinstance(c, BasePredictionWriter) for c in before):
        return _nothing
    trainer.callbacks = [c for c in before if not isinstance(c, BasePredictionWriter)]

    def put_back() -> None:
        trainer.callbacks = before + [c for c in trainer.callbacks if c not in before]

    return put_back


_AGREED = (
    "parallelism", "mode", "stages", "boundaries", "schedule", "stages_per_process", "micro_batches", "cpu_workers",
    "cpu_fraction", "offload", "bucket_size_mb", "shard_cpu_optimizer", "shard_across_nodes", "encoders",
)  # fmt: skip
"""The plan's settings every process of a run must have alike (each node's cores and threads its own)."""

_TRAINER_AGREED = (
    "max_epochs", "min_epochs", "max_steps", "min_steps", "accumulate_grad_batches", "precision", "gradient_clip_val",
    "gradient_clip_algorithm", "limit_train_batches", "limit_val_batches", "limit_test_batches",
    "limit_predict_batches", "val_check_interval", "check_val_every_n_epoch", "num_sanity_val_steps",
    "reload_dataloaders_every_n_epochs",
)  # fmt: skip


def _trainer_settings(trainer: "pl.Trainer") -> dict[str, Any]:
    """The trainer call and the loop settings that decide how many batches, steps and collectives each
    process runs: alike on every process, or they part ways (at the end of an epoch, at a clip)."""
    settings = {"the trainer call": trainer.state.fn, **{f"`{name}`": getattr(trainer, name) for name in _TRAINER_AGREED}}
    return {name: value.value if isinstance(value, Enum) else value for name, value in settings.items()}


def _nothing() -> None:
    pass


def _validate_on_rank_zeros_clock(trainer: "pl.Trainer") -> None:
    """``val_check_interval`` given as a time: Lightning asks each rank's own clock whether to validate
    after a batch, and ranks whose clocks part (a logger that takes longer on rank 0) would validate at
    different batches. Rank 0's decision is every rank's, as ``Timer`` decides ``max_time``."""
    loop = trainer.fit_loop.epoch_loop
    own = partial(type(loop)._should_check_val_fx, loop)

    def agreed(data_fetcher: Any) -> bool:
        should = own(data_fetcher)
        if getattr(trainer, "_val_check_time_interval", None) is None:
            return should
        return bool(trainer.strategy.broadcast(should))

    loop._should_check_val_fx = agreed  # type: ignore[method-assign]


def _count_throughput_once(trainer: "pl.Trainer") -> None:
    """``ThroughputMonitor`` counts every rank's batches as data-parallel ranks' (its global rates are a
    rank's times the world size), where every rank of this run goes through the same whole batches:
    each rank's rate is the run's, as one process's is (made in the callback's ``setup``, before this)."""
    for callback in trainer.callbacks:
        if isinstance(callback, ThroughputMonitor):
            for throughput in getattr(callback, "_throughputs", {}).values():
                throughput.world_size = 1


_LAYOUT_DEFAULTS = {n: p.default for n, p in inspect.signature(HeteroStrategy.__init__).parameters.items() if n in LAYOUT_ARGUMENTS}


_QUIETED = (
    # Logged values are combined over the workers before Lightning sees them (`results.py`).
    ".*when logging on epoch level in distributed setting.*",
    # A torchmetrics metric computes over every rank's state (`sync_metrics_over`): a rank without a
    # share of the epoch (a stage before the last, a CPU worker at `cpu_fraction=0`) updated none of its own.
    ".*was called before the ``update`` method.*",
)
"""Warnings the strategy's processes do not show while a trainer call runs."""


def hetero_strategy(trainer: "pl.Trainer") -> Optional[HeteroStrategy]:
    """The trainer's strategy if it is a hetero one (for callbacks that only act on hetero runs)."""
    return trainer.strategy if isinstance(trainer.strategy, HeteroStrategy) else None


def _check_timeout(timeout: Union[timedelta, float]) -> timedelta:
    """``timeout``, as a ``timedelta``; a clear error for a wait no collective could meet."""
    try:
        if isinstance(timeout, bool):
            raise TypeError
        waits = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"`timeout` must be a `timedelta` or a number of seconds, not {timeout!r}.") from None
    if waits.total_seconds() <= 0:
        raise ValueError(
            f"`timeout={timeout!r}`: how long a collective may wait must be positive (the default is 5 minutes; a"
            " few seconds already fails a broken run fast)."
        )
    return waits
