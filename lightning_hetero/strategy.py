"""``HeteroStrategy``: the Lightning integration of a hetero run.

Each step, the batch is split by the CPU fraction (``shares.py``); the CPU workers run the
module's ``training_step`` on their share while the stages run the pipeline schedule on theirs
(``workers.py``, ``pipeline.py``); every rank then learns the whole batch's loss and logged values
(``results.py``), the gradients are summed (``sync.py``) and every rank steps its optimizer. The
result is the same model a single process would train on the same batches.
"""

from __future__ import annotations

import atexit
import time
from pathlib import Path
import warnings
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.utils import _sync_module_states
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import DeviceStatsMonitor
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors
from typing_extensions import override

import lightning.pytorch as pl
from lightning_hetero.accelerator import HeteroAccelerator
from lightning_hetero.launcher import HeteroLauncher
from lightning_hetero.data import same_batches_on_every_rank, with_workers
from lightning_hetero.files import AtomicCheckpointIO
from lightning_hetero.finite import NonfinitePolicy, check_policy, describe_nonfinite, nonfinite_error, nonfinite_parts
from lightning_hetero.devices import device_stats
from lightning_hetero.module import check_model_contract, layer_names
from lightning_hetero.plan import HeteroPlan
from lightning_hetero.pipeline import Pipeline, ScheduleArg, StageModule, partition_layers, resolve_schedule
from lightning_hetero.record import Recorder, StepClock, StepRecord
from lightning_hetero.results import ReportExchange, WorkerReport, combine_logs, combine_loss, merge_outputs, relog
from lightning_hetero.shares import Shares, split_batch
from lightning_hetero.state import (
    refresh_replicas,
    gather_module_state,
    gather_optimizer_state,
    load_with_offloaded_state,
    move_materialized,
    with_offloaded_state,
)
from lightning_hetero.offload import BucketStep, DeviceStep, OffloadStep, check_offload, choose_offloaded, param_index
from lightning_hetero.sync import GradientSync, OverlappedSync, add_grads, clip_to_norm, global_grad_norm, make_buckets
from lightning_hetero.topology import (
    ProcessGroups,
    Role,
    StagesArg,
    Topology,
    build_process_groups,
    resolve_stage_devices,
    restart_store,
    threads_for,
    usable_cores,
    world_backend,
)
from lightning_hetero.workers import CpuWorker, GradPolicy, StageWorker, batch_size_of

__all__ = ["HeteroStrategy"]

_PRECISIONS = (Precision, DoublePrecision, MixedPrecision, HalfPrecision)


class HeteroStrategy(ParallelStrategy):
    """Train one model on CPU workers and a pipeline of stages at the same time.

    Args:
        mode: ``"coarse"``: each worker trains its share of every batch, then gradients are summed.
            ``"fine"``: as coarse, but each bucket of gradients is summed and stepped while the
            backward is still busy with earlier layers, optionally on the CPU (``offload``).
        stages: ``"auto"`` (one stage per GPU; two emulated CPU stages where there is no GPU), a
            number of stages, or a list of devices such as ``["cuda:0", "cuda:1"]`` or ``["cpu", "cpu"]``.
        cpu_workers: CPU-worker processes, each with a full replica of the model (0: pipeline only).
        cpu_threads: torch threads per CPU worker; ``None`` shares the machine's cores out.
        micro_batches: micro-batches the pipeline's share is cut into.
        schedule: a single-stage-per-rank schedule known to ``get_schedule_class`` ("GPipe", "1F1B").
        cpu_fraction: the share of every batch the CPU workers compute, in ``[0, 1]``. ``"auto"``
            starts at each process's fair share of the cores when stages are emulated on the CPU,
            and at 0 with GPU stages.
        start_method: how processes start where no external launcher (torchrun, SLURM) starts them:
            ``"popen"`` runs the script again for every other rank, as Lightning's DDP does;
            ``"fork"``, ``"spawn"`` and ``"forkserver"`` start children of the main process.
            ``"auto"`` is ``"fork"`` in a notebook and ``"popen"`` otherwise (see ``launcher.py``).
        timeout: how long a collective may wait before the run fails (a ``timedelta`` or seconds).
        offload: fine mode: which buckets' optimizer steps run on the CPU, with fp32 master weights
            and optimizer state in CPU memory: ``"none"``, ``"all"``, a list of bucket indices (0 is
            the last layers' bucket), or ``"auto"``: on GPU stages, the buckets the backward finishes
            first until the optimizer state left on the GPU fits in a quarter of its memory.
        bucket_size_mb: fine mode: the parameter size that closes a bucket (a bucket holds whole
            layers of one stage).
        plan: a ``HeteroPlan`` (or the path of its YAML file) to replay: it sets every layout
            argument above and where the layers are cut, so leave those at their defaults.
        nonfinite: what a NaN or Inf in any worker's loss or gradients does to its training step,
            decided alike on every rank (``finite.py``): ``"error"`` ends the run with an error that
            names the step and the workers; ``"skip"`` skips that optimizer step on every rank
            (gradients dropped, the optimizer's state untouched), counts it in ``skipped_steps`` and
            logs ``hetero/skipped_steps``. In fine mode, ``"skip"`` steps the buckets after the
            backward instead of during it (every rank must know the verdict before any steps).
        emulated_speed: TESTING ONLY, off by default. Emulates workers of known speeds on a machine
            that has no such devices (tests and benchmarks of the rebalancer): ``{"cpu": r,
            "pipeline": q}`` makes each CPU worker's share of a training batch take at least
            ``samples / r`` seconds and the pipeline's at least ``samples / q`` (a worker that
            finishes its real work sooner sleeps out the rest). Either key may be left out. Never
            use it to train a model you care about: it only makes the run slower.
    """

    strategy_name = "hetero"

    def __init__(
        self,
        mode: Literal["coarse", "fine"] = "coarse",
        stages: StagesArg = "auto",
        cpu_workers: int = 1,
        cpu_threads: Optional[int] = None,
        micro_batches: int = 4,
        schedule: ScheduleArg = "GPipe",
        cpu_fraction: Union[float, Literal["auto"]] = "auto",
        start_method: Literal["auto", "popen", "fork", "spawn", "forkserver"] = "auto",
        timeout: Union[timedelta, float] = timedelta(minutes=5),
        offload: Union[Literal["auto", "none", "all"], Sequence[int]] = "auto",
        bucket_size_mb: float = 25.0,
        plan: Union[HeteroPlan, str, Path, None] = None,
        nonfinite: NonfinitePolicy = "error",
        emulated_speed: Optional[Mapping[str, float]] = None,
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
        if plan is not None:
            plan = _usable_plan(plan)
            given = {
                name: value
                for name, value, default in (
                    ("mode", mode, "coarse"),
                    ("stages", stages, "auto"),
                    ("cpu_workers", cpu_workers, 1),
                    ("cpu_threads", cpu_threads, None),
                    ("micro_batches", micro_batches, 4),
                    ("schedule", schedule, "GPipe"),
                    ("cpu_fraction", cpu_fraction, "auto"),
                    ("offload", offload, "auto"),
                    ("bucket_size_mb", bucket_size_mb, 25.0),
                )
                if value != default
            }
            if given:
                raise ValueError(
                    f"Pass the layout either as a plan or as arguments, not both: the plan sets {sorted(given)} too."
                )
            mode, stages, cpu_workers, cpu_threads = plan.mode, plan.stages, plan.cpu_workers, plan.cpu_threads
            micro_batches, schedule, cpu_fraction = plan.micro_batches, plan.schedule, plan.cpu_fraction
            offload, bucket_size_mb = plan.offload, plan.bucket_size_mb
        if mode not in ("coarse", "fine"):
            raise ValueError(f"`mode={mode!r}` is not a hetero mode; use 'coarse' or 'fine'.")
        check_offload(offload, mode)
        if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)) or bucket_size_mb <= 0:
            raise ValueError(f"`bucket_size_mb={bucket_size_mb!r}` must be a positive number of megabytes.")
        _check_int("cpu_workers", cpu_workers, minimum=0)
        _check_int("micro_batches", micro_batches, minimum=1)
        if cpu_threads is not None:
            _check_int("cpu_threads", cpu_threads, minimum=1)
        if start_method == "auto":
            start_method = "fork" if _IS_INTERACTIVE else "popen"
        if start_method not in ["popen", *mp.get_all_start_methods()]:
            raise ValueError(
                f"`start_method={start_method!r}` is not available here; choose one of"
                f" {['auto', 'popen', *mp.get_all_start_methods()]}."
            )
        self.mode = mode
        self._stage_devices = resolve_stage_devices(stages)
        self._cpu_workers = cpu_workers
        self._cpu_threads = cpu_threads
        self._micro_batches = micro_batches
        self._schedule = resolve_schedule(schedule, len(self._stage_devices), micro_batches)
        self._cpu_fraction = self._resolve_fraction(cpu_fraction, cpu_workers)
        self._start_method = start_method
        self._emulated_speed = _check_emulated_speed(emulated_speed)
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        self._nonfinite = check_policy(nonfinite)
        self.skipped_steps = 0
        """Optimizer steps skipped for NaN or Inf (``nonfinite="skip"``) in this process's run."""
        self._window_nonfinite = False  # a batch of this optimizer step's window saw NaN or Inf
        self._skip_step = False  # this batch's optimizer step is skipped on every rank
        self._num_nodes = 1
        self._groups: Optional[ProcessGroups] = None
        self._control: Optional[dist.ProcessGroup] = None
        self._exchange: Optional[ReportExchange] = None
        self._worker: Optional[Union[CpuWorker, StageWorker]] = None
        self._grad_sync: Optional[GradientSync] = None
        self._sync_gradients = True
        self._layers: Optional[list[nn.Module]] = None
        self._bounds: list[tuple[int, int]] = []
        self._default_precision: Optional[Precision] = None
        self._offload = offload if isinstance(offload, str) else sorted(set(offload))
        self._plan: Optional[HeteroPlan] = plan
        self._bucket_bytes = int(bucket_size_mb * 2**20)
        self._overlap: Optional[OverlappedSync] = None
        self._stale = False  # CPU workers kept out of recent optimizer steps (see `_refresh_replicas`)
        self._window_has_cpu_share = False
        self._detached = False
        self._recorder: Optional[Recorder] = None
        self._clock: Optional[StepClock] = None
        self._samples = 0
        self._step_fraction = 0.0
        self._report_device_stats = False
        self.latest_device_stats: dict[str, dict[str, float]] = {}
        """Every device's latest process and device stats, by device name (with ``DeviceStatsMonitor``)."""

    # ------------------------------------------------------------------ layout

    def _resolve_fraction(self, cpu_fraction: Union[float, str], cpu_workers: int) -> float:
        if cpu_fraction == "auto":
            if cpu_workers == 0 or any(d.type == "cuda" for d in self._stage_devices):
                return 0.0
            return cpu_workers / (cpu_workers + len(self._stage_devices))
        if isinstance(cpu_fraction, bool) or not isinstance(cpu_fraction, (int, float)) or not 0 <= cpu_fraction <= 1:
            raise ValueError(f"`cpu_fraction={cpu_fraction!r}` must be 'auto' or a number between 0 and 1.")
        if cpu_workers == 0 and cpu_fraction > 0:
            raise ValueError(
                f"`cpu_fraction={cpu_fraction}` gives the CPU a share, but `cpu_workers=0` starts no CPU worker."
            )
        return float(cpu_fraction)

    @property
    def topology(self) -> Topology:
        return Topology(cpu_workers=self._cpu_workers, stage_devices=self._stage_devices, num_nodes=self._num_nodes)

    @property
    def role(self) -> Role:
        return self.topology.role(self.local_rank)

    def layout(self) -> dict[str, Any]:
        """This run's layout, for logs (a plan's, where the run follows one)."""
        if self._plan is not None:
            return self._plan.as_dict()
        return {
            "mode": self.mode,
            "stages": [str(d) for d in self._stage_devices],
            "cpu_workers": self._cpu_workers,
            "micro_batches": self._micro_batches,
            "schedule": self._schedule.__name__,
            "cpu_fraction": self._cpu_fraction,
            "num_nodes": self._num_nodes,
        }

    @property
    def device_names(self) -> list[str]:
        """Each global rank's name in logs: its role (``cpu0``, ``stage1``), ``node1.stage0`` on
        further nodes."""
        names = []
        for rank in range(self.topology.world_size):
            node, local = divmod(rank, self.topology.procs_per_node)
            role = str(self.topology.role(local))
            names.append(role if node == 0 else f"node{node}.{role}")
        return names

    @property
    def cpu_fraction(self) -> float:
        """The share of each batch the CPU workers compute."""
        return self._cpu_fraction

    def set_cpu_fraction(self, fraction: float) -> None:
        """Give the CPU workers ``fraction`` of the batches from the next one on. Every rank must
        set the same value at the same step (decide on one rank and broadcast)."""
        if not 0.0 <= fraction <= 1.0 or (fraction > 0 and self._cpu_workers == 0):
            raise ValueError(f"A CPU fraction of {fraction} is not possible with {self._cpu_workers} CPU worker(s).")
        self._cpu_fraction = float(fraction)
        self._set_threads()

    def _set_threads(self) -> None:
        """This process's torch threads for the current CPU fraction (``threads_for``): an emulated
        stage takes the cores of CPU workers that have no share."""
        if self._groups is None:  # not in a worker process (yet)
            return
        threads = threads_for(self.role, self.topology, usable_cores(), self._cpu_threads, self._cpu_fraction > 0)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
            if self._overlap is not None:
                self._overlap.set_threads(threads)

    @property
    def micro_batches(self) -> int:
        """The micro-batches the pipeline's share is cut into."""
        return self._micro_batches

    @property
    def emulated_speed(self) -> dict[str, float]:
        """TESTING ONLY: the samples per second workers are slowed down to (see the class doc)."""
        return dict(self._emulated_speed)

    def set_emulated_speed(self, speed: Optional[Mapping[str, float]]) -> None:
        """TESTING ONLY: emulate other worker speeds from the next batch on (``None``: real speed).
        Every rank must set the same value at the same step."""
        self._emulated_speed = _check_emulated_speed(speed)

    def shares(self, batch_size: int) -> Shares:
        """How a batch of ``batch_size`` samples is divided this step."""
        return split_batch(batch_size, self._cpu_fraction, self._cpu_workers, self._micro_batches)

    # ------------------------------------------------------- Lightning plumbing

    @property
    def is_distributed(self) -> bool:
        # Lightning then injects a DistributedSampler built from `distributed_sampler_kwargs`, which
        # splits the data between nodes; within a node every rank must see the same batches, so a
        # single node keeps the user's loader (see `process_dataloader`).
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
        # Lightning hands a string strategy the accelerator it picked for the machine (CPU or CUDA);
        # a hetero run's processes sit on different devices, which only HeteroAccelerator serves.
        if accelerator is not None and not isinstance(accelerator, HeteroAccelerator):
            accelerator = HeteroAccelerator()
        self._accelerator = accelerator

    @property
    @override
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is not None:
            return self._precision_plugin
        if self._default_precision is None:
            self._default_precision = Precision()
            _clip_with(self._default_precision, self)
        return self._default_precision

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        if plugin is not None:
            if type(plugin) not in _PRECISIONS or getattr(plugin, "precision", None) == "16-mixed":
                raise ValueError(
                    f"The hetero strategy does not support {getattr(plugin, 'precision', type(plugin).__name__)!r}"
                    " precision: float16 mixed precision needs a loss scale agreed between all workers. Use"
                    " '32-true', '64-true', 'bf16-mixed', 'bf16-true' or '16-true'."
                )
            _clip_with(plugin, self)
        self._precision_plugin = plugin

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # All ranks of a node see the same batch and take their share of it; nodes split the data.
        return {"num_replicas": self._num_nodes, "rank": self.node_rank}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        dataloader = same_batches_on_every_rank(dataloader, trainer.state.stage)
        if self._plan is not None and self._plan.dataloader_workers is not None:
            dataloader = with_workers(dataloader, self._plan.dataloader_workers)
        return dataloader

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Weights load into the whole model before `setup` cuts it into stages.
        return False

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = HeteroLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _cut(self, model: nn.Module, layers: list[nn.Module]) -> list[tuple[int, int]]:
        """Each stage's layers: where the plan cuts them, or balanced by parameter count."""
        planned = self._plan.cut(layer_names(model, layers)) if self._plan is not None else None
        return planned if planned is not None else partition_layers(layers, len(self._stage_devices))

    def apply_plan(self, plan: HeteroPlan) -> None:
        """Take a plan's layout for this run (the workload analyzer does this before the model is
        cut). Its stages and CPU workers must be the run's: the processes exist already."""
        running = (list(map(str, self._stage_devices)), self._cpu_workers, self.mode)
        if (list(map(str, resolve_stage_devices(plan.stages))), plan.cpu_workers, plan.mode) != running:
            raise ValueError(f"A plan for {plan.stages} x {plan.cpu_workers} CPU worker(s) cannot lay out this run.")
        self._plan = plan
        self._micro_batches = plan.micro_batches
        self._schedule = resolve_schedule(plan.schedule, len(self._stage_devices), plan.micro_batches)
        self._cpu_fraction = plan.cpu_fraction
        self._offload = list(plan.offload) if plan.mode == "fine" else self._offload
        self._bucket_bytes = int(plan.bucket_size_mb * 2**20)
        self._cpu_threads = plan.cpu_threads if plan.cpu_threads is not None else self._cpu_threads
        self._set_threads()

    @property
    def plan(self) -> Optional[HeteroPlan]:
        """The plan this run follows, if one was given or made by the workload analyzer."""
        return self._plan

    @property
    def process_groups(self) -> Optional[ProcessGroups]:
        return self._groups

    def check_model(self, model: LightningModule) -> list[nn.Module]:
        """Check the model contract and that the layers fill the stages; raise before any process starts."""
        layers = check_model_contract(model)
        bounds = self._cut(model, layers)
        if not isinstance(self._offload, str):
            count = len(make_buckets(layers, bounds, self._bucket_bytes))
            if self._offload and self._offload[-1] >= count:
                raise ValueError(
                    f"`offload={self._offload}` names bucket {self._offload[-1]}, but the model has {count} buckets"
                    f" (0 to {count - 1}) at `bucket_size_mb={self._bucket_bytes / 2**20:g}`."
                )
        return layers

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        expected = self.topology.world_size
        if self.world_size != expected:
            raise RuntimeError(
                f"The hetero layout {self.topology.describe()} needs {expected} processes, but the launcher started"
                f" {self.world_size}. Start {self.num_processes} processes per node (e.g. `torchrun"
                f" --nproc-per-node={self.num_processes}`)."
            )
        store = restart_store(self._timeout)
        try:
            _init_dist_connection(
                self.cluster_environment,
                world_backend(self.topology),
                timeout=self._timeout,
                **({"store": store} if store is not None else {}),
            )
        except dist.DistError as error:
            error.add_note(
                f"[hetero] On {self.rank_name(self.local_rank)}: not all {expected} processes of the layout joined"
                f" within the timeout ({self._timeout.total_seconds():g} s). With `num_nodes={self.num_nodes}`,"
                " start the same command on every node: torchrun or srun on each, or, with the strategy's own"
                " launch, the script with `NODE_RANK`, `MASTER_ADDR` and `MASTER_PORT` set."
            )
            raise
        # A process that exits with gloo groups alive can abort in interpreter finalization
        # ("terminate called without an active exception"); take them down while Python is whole.
        atexit.unregister(_destroy_process_groups)
        atexit.register(_destroy_process_groups)
        self._groups = build_process_groups(self.topology, self.global_rank, self._timeout)
        self._control = self._groups.control
        self._exchange = ReportExchange(self._control)
        self._recorder = Recorder(self.global_rank, str(self.role), self.root_device)
        self._set_threads()
        if isinstance(self.precision_plugin, MixedPrecision):
            # Lightning picks one autocast device for the run; each hetero process computes on its own.
            self.precision_plugin.device = self.root_device.type
        if self._emulated_speed:
            rank_zero_warn(
                f"`emulated_speed={self._emulated_speed}` slows this run down on purpose to emulate other devices:"
                " it is for tests and benchmarks only."
            )
        # Logged values are combined over the workers before Lightning sees them (`results.py`),
        # so its advice to pass `sync_dist=True` does not apply.
        warnings.filterwarnings("ignore", message=".*when logging on epoch level in distributed setting.*")

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self._layers is None:
            self._layers = check_model_contract(module)
            if not (isinstance(self.launcher, HeteroLauncher) and self.launcher.copies_main_process):
                # Each process built its own model (popen, torchrun, SLURM): start all from rank 0's.
                _sync_module_states(module, self._control, 250 * 1024 * 1024, src=0, params_and_buffers_to_ignore=set())
            self.model = self.precision_plugin.convert_module(module)
            analyzer = _analyzer(trainer)
            if analyzer is not None and trainer.state.fn == TrainerFn.FITTING:
                self.apply_plan(analyzer.plan_layout(trainer, self, self._layers))
            self._bounds = self._cut(module, self._layers)
            self._place_model()
        # Every call: a previous `teardown` in this process (popen, torchrun) moved the model to the CPU.
        move_materialized(module, self.root_device)
        _update_properties(module, device=self.root_device)
        _sync_metrics_over(module, self._control)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            _check_optimizers(self.optimizers)
            self._grad_sync = self._build_grad_sync()
            if self.mode == "fine":
                _check_fine_mode(module, self.optimizers)
                self._overlap = self._build_overlap()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        # Lightning's DeviceStatsMonitor logs from rank 0: every rank sends its stats along with
        # each step's results, so the accelerator answers there without a collective of its own.
        self._report_device_stats = any(isinstance(cb, DeviceStatsMonitor) for cb in trainer.callbacks)

    def _stage_params(self, stage: int) -> list[nn.Parameter]:
        """The parameters of ``stage``'s layers, frozen ones included (they may be unfrozen later)."""
        assert self._layers is not None
        start, stop = self._bounds[stage]
        return [p for layer in self._layers[start:stop] for p in layer.parameters()]

    def _place_model(self) -> None:
        """Keep the whole replica on a CPU worker; on a stage, keep its layers on its device and
        put the others on the meta device (shapes only), so nothing can use their stale values."""
        module, role, device = self.lightning_module, self.role, self.root_device
        assert module is not None and self._layers is not None
        if role.is_cpu_worker:
            params = [p for s in range(len(self._stage_devices)) for p in self._stage_params(s)]
            self._worker = CpuWorker(module, params, role.index)
            return
        start, stop = self._bounds[role.index]
        for i, layer in enumerate(self._layers):
            if not start <= i < stop:
                layer.to("meta")
        assert self._groups is not None and self._groups.stage is not None
        pipeline = Pipeline(
            module=StageModule(self._layers[start:stop]),
            stage_index=role.index,
            num_stages=len(self._stage_devices),
            device=device,
            group=self._groups.stage,
            schedule=self._schedule,
            loss_fn=module.pipeline_loss,
        )
        self._worker = StageWorker(module, self._stage_params(role.index), pipeline)

    def _build_grad_sync(self) -> GradientSync:
        assert self._groups is not None
        if self.role.is_cpu_worker:
            buckets = [(self._stage_params(s), group) for s, group in enumerate(self._groups.sync)]
        else:
            buckets = [(self._stage_params(self.role.index), self._groups.sync[self.role.index])]
        return GradientSync(buckets, self._groups.replica)

    def _build_overlap(self) -> OverlappedSync:
        """This rank's buckets (all of them on a CPU worker, its own on a stage), each with the step
        that applies the user's optimizer to it: on the device, or offloaded to the CPU."""
        assert self._layers is not None and self._groups is not None
        buckets = make_buckets(self._layers, self._bounds, self._bucket_bytes)
        params = [[p for layer in self._layers[slice(*b.layers)] for p in layer.parameters()] for b in buckets]
        own = [b for b in buckets if b.stage == self.role.index] if self.role.is_stage else []
        offloaded = choose_offloaded(self._offload, buckets, own, params, self.root_device, self._control)
        optimizer = self.optimizers[0]
        self._optimizer_layout = param_index(optimizer)
        entries = []
        for bucket in buckets if self.role.is_cpu_worker else own:
            kind = OffloadStep if bucket.index in offloaded else DeviceStep
            step = kind(optimizer, params[bucket.index], self._optimizer_layout)
            entries.append((params[bucket.index], self._groups.sync[bucket.stage], step))
        return OverlappedSync(
            entries, self._groups.replica, norm=self._global_norm, skip_nonfinite=self._nonfinite == "skip"
        )

    def _refresh_overlap(self) -> None:
        """Rebuild the bucket steps when the optimizer's parameters changed since they were built
        (``add_param_group`` while fine-tuning), carrying the offloaded optimizer state over."""
        assert self._overlap is not None
        if param_index(self.optimizers[0]) == self._optimizer_layout:
            return
        old = self._overlap
        states = {p: s for step in old.steps if isinstance(step, OffloadStep) for p, s in step.state().items()}
        old.close()
        self._overlap = self._build_overlap()
        for step in self._overlap.steps:
            if isinstance(step, OffloadStep):
                step.load_state(states)

    @property
    def bucket_steps(self) -> list[BucketStep]:
        """This rank's bucket steps in fine mode (none in coarse mode)."""
        return self._overlap.steps if self._overlap is not None else []

    @override
    def model_to_device(self) -> None:
        # `setup` places each part of the model on its rank's device (see `_place_model`).
        pass

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        # Batches stay on the CPU: each rank moves only its own share to its device.
        return super().batch_to_device(batch, torch.device("cpu"), dataloader_idx)

    # ------------------------------------------------------------------- steps

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch, batch_idx = _batch_and_index(args, kwargs)
        module, trainer = self.lightning_module, self.lightning_module.trainer
        assert self._worker is not None
        shares = self.shares(batch_size_of(batch))
        accumulate = trainer.accumulate_grad_batches
        cpu_share = shares.pipeline_size < shares.batch_size
        if cpu_share:
            self._refresh_replicas()
        if batch_idx % accumulate == 0:
            self._window_has_cpu_share = False
            self._window_nonfinite = False
        self._window_has_cpu_share |= cpu_share
        self._skip_step = False
        # CPU workers with no share of this optimizer step keep out of its sum (and step nothing).
        detached = self._cpu_workers > 0 and self._sync_gradients and not self._window_has_cpu_share
        self._detached = detached
        # Fine mode's last micro-batch of an optimizer step: sum and step bucket by bucket during the backward.
        if self._overlap is not None and self._sync_gradients:
            self._refresh_overlap()
        overlap = self._overlap if self._sync_gradients and not (detached and self.role.is_cpu_worker) else None
        first_of_window = batch_idx % accumulate == 0 and not _overrides(module, "optimizer_zero_grad")
        grads: GradPolicy = "accumulate" if overlap is not None else "drop" if first_of_window else "keep"
        self._step_fraction = self._cpu_fraction
        speed = self._emulated_speed.get("cpu" if self.role.is_cpu_worker else "pipeline")
        self._worker.pace = 1.0 / speed if speed else 0.0
        with self.precision_plugin.train_step_context():
            clock = self._clock
            if overlap is not None:
                overlap.begin(self._worker.expected_grads(shares), *_clipping(trainer), detached=detached)
            try:
                report, output = self._worker.train_step(batch, batch_idx, shares, accumulate, grads, clock)
            except BaseException:
                if overlap is not None:
                    overlap.abort()
                raise
            if detached and self._overlap is not None:
                self._stale = True
            report.nonfinite = nonfinite_parts(report.loss, self._worker.fresh_grads)
            skipped = self._finish_overlap(overlap, report, clock)
            with _span(clock, "wait"):
                reports = self._finish_step(report)
        self._judge_nonfinite(reports, batch_idx, skipped)
        self._samples = shares.pipeline_size if self.role.is_stage else report.samples
        combined = combine_loss(reports)
        assert combined is not None
        value, dtype = combined
        loss = torch.tensor(value, dtype=dtype, device=self.root_device)
        extras = {k: v for k, v in output.items() if k != "loss"} if isinstance(output, Mapping) else {}
        return {"loss": loss, **extras} if extras else loss

    def _finish_overlap(
        self, overlap: Optional[OverlappedSync], report: WorkerReport, clock: Optional[StepClock]
    ) -> bool:
        """Fine mode, after the last backward of an optimizer step: wait for the bucket steps and add
        this rank's own non-finite gradients to its report. Where the buckets step only once every
        rank knows the global norm, a CPU worker kept out of the step still joins that collective.
        Whether the buckets were skipped for NaN or Inf (the same on every rank)."""
        if self._overlap is None or not self._sync_gradients:
            return False
        finite = not (report.nonfinite or self._window_nonfinite)
        if overlap is None:  # a CPU worker kept out of this step
            if not self._overlap.defers_steps(_clipping(self.lightning_module.trainer)[1]):
                return False
            total = self._global_norm([], finite)
            return self._nonfinite == "skip" and not bool(torch.isfinite(total))
        with _span(clock, "sync"):
            overlap.finish(finite)
        if clock is not None:
            clock.add("optimizer", overlap.step_seconds)
        if not overlap.grads_finite and "gradients" not in report.nonfinite:
            report.nonfinite += ("gradients",)
        return overlap.skipped

    def _judge_nonfinite(self, reports: list[WorkerReport], batch_idx: int, skipped: bool) -> None:
        """Apply the non-finite policy to this batch, from what every rank found: every rank sees
        the same reports (and fine mode's ``skipped`` verdict), so every rank decides the same."""
        found = {
            f"{name} (global rank {rank})": report.nonfinite
            for rank, (name, report) in enumerate(zip(self.device_names, reports))
            if report.nonfinite
        }
        trainer = self.lightning_module.trainer
        if found and self._nonfinite == "error":
            stepped = self._overlap is not None and self._sync_gradients
            raise nonfinite_error(found, trainer.global_step, trainer.current_epoch, batch_idx, stepped)
        self._window_nonfinite |= bool(found) or skipped
        self._skip_step = self._sync_gradients and self._window_nonfinite
        if self._skip_step:
            self.skipped_steps += 1
            rank_zero_warn(
                f"Skipped training step {trainer.global_step} on every rank: NaN or Inf in"
                f" {describe_nonfinite(found) or 'the summed gradients'} ({self.skipped_steps} skipped so far)."
            )
            self.lightning_module.log("hetero/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False)

    def _finish_step(self, report: WorkerReport) -> list[WorkerReport]:
        """Share every rank's report and log the combined values here, so every rank logs the same."""
        if self._report_device_stats:
            report.device = device_stats(self.root_device, meter="step")
        assert self._exchange is not None
        reports = self._exchange(report)
        if self._report_device_stats:
            self.latest_device_stats = {name: r.device or {} for name, r in zip(self.device_names, reports)}
        relog(self.lightning_module, combine_logs(reports), self.root_device)
        return reports

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        # The forward and backward ran in `training_step`; add its gradients in and sum them over the workers.
        module = self.lightning_module
        assert module is not None and self._worker is not None and self._grad_sync is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if self._worker.fresh_grads is not None:
            add_grads(self._worker.params, self._worker.fresh_grads)
            self._worker.fresh_grads = None
        if self._sync_gradients and self._overlap is None and not self._skip_step:
            if self._detached:
                self._stale = True
            if not (self._detached and self.role.is_cpu_worker):
                with _span(self._clock, "sync"):
                    self._grad_sync.all_reduce(detached=self._detached)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        if not self._sync_gradients:
            self._end_step_record()  # accumulating: no optimizer step follows this batch
        return closure_loss

    @property
    def replica_is_current(self) -> bool:
        """False on a CPU worker that kept out of recent optimizer steps (it had no share of their
        batches): its replica is refreshed from the stages before it is used again."""
        return not (self.role.is_cpu_worker and self._stale)

    def _refresh_replicas(self) -> None:
        """Bring stale CPU-worker replicas up to date from the stages (collective; a no-op unless
        the CPU workers kept out of optimizer steps since they last took part)."""
        if not self._stale:
            return
        assert self._groups is not None
        stage_params = [self._stage_params(s) for s in range(len(self._stage_devices))]
        ranks = self.topology.stage_ranks(self.node_rank)
        optimizer = self.optimizers[0] if self.optimizers else None
        refresh_replicas(self.role.is_cpu_worker, self._groups.sync, ranks, stage_params, optimizer, self.bucket_steps)
        self._stale = False

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._recorder is not None:
            self._clock = self._recorder.begin()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # Time what follows the closure (training step and backward): clipping and the step itself.
        after_closure = time.perf_counter()

        def timed_closure() -> Any:
            nonlocal after_closure
            try:
                result = closure()
            finally:
                after_closure = time.perf_counter()
            if self._skip_step:  # decided on every rank alike: nothing to step (torch's optimizers skip `grad=None`)
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.grad = None
            return result

        result = super().optimizer_step(optimizer, timed_closure, model, **kwargs)
        if self._clock is not None:
            self._clock.add_span("optimizer", after_closure, time.perf_counter())
        self._end_step_record()
        return result

    def _end_step_record(self) -> None:
        if self._recorder is not None and self._clock is not None:
            self._recorder.end(self.lightning_module.trainer.global_step, self._samples, self._step_fraction)
            self._clock = None

    @property
    def step_records(self) -> list[StepRecord]:
        """This rank's recent training steps: what it computed, communicated, stepped and waited for."""
        return list(self._recorder.records) if self._recorder is not None else []

    def gather_step_records(self, count: int = 1, dst: Optional[int] = None) -> list[list[StepRecord]]:
        """Every rank's latest ``count`` step records, indexed by global rank (a collective: call it
        on all ranks). With ``dst``, only that global rank receives them; the others get ``[]``."""
        return self.gather(self.step_records[-count:] if count > 0 else [], dst)

    def gather(self, obj: Any, dst: Optional[int] = None) -> list[Any]:
        """Every rank's ``obj`` (picklable), indexed by global rank, over the control group (a
        collective). With ``dst``, only that global rank receives them; the others get ``[]``."""
        if dst is None:
            objects: list[Any] = [None] * dist.get_world_size(self._control)
            dist.all_gather_object(objects, obj, group=self._control)
            return objects
        gathered: Optional[list[Any]] = [None] * dist.get_world_size(self._control) if self.global_rank == dst else None
        dist.gather_object(obj, gathered, dst=dst, group=self._control)
        return gathered if gathered is not None else []

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """While accumulating, each worker keeps summing locally; the sync runs on the last micro-step."""
        self._sync_gradients = False
        try:
            yield
        finally:
            self._sync_gradients = True

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        if self._overlap is not None:
            return  # fine mode clipped each bucket as it stepped, on every rank alike
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_to_norm(params, clip_val, self._global_norm([p.grad for p in params if p.grad is not None]))

    def _clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if params and self._overlap is None:
            torch.nn.utils.clip_grad_value_(params, clip_val)

    def _global_norm(self, grads: list[Tensor], finite: bool = True) -> Tensor:
        """The norm of all of the model's gradients, from this rank's ``grads``. Every rank joins
        its all-reduce, also one whose stage has no gradients; CPU workers' count for nothing
        (their replica's gradients equal the stages' after the sum). ``finite=False`` on any rank
        makes it NaN on every rank."""
        topo = self.topology
        own = grads if self.role.is_stage else None
        return global_grad_norm(
            own, self.role.index, topo.num_stages, topo.num_nodes, group=self._control, finite=finite
        )

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        batch, rest = args[0], tuple(args[1:]) + tuple(kwargs.values())
        assert self._worker is not None
        shares = self.shares(batch_size_of(batch))
        if shares.pipeline_size < shares.batch_size:
            self._refresh_replicas()
        with self.precision_plugin.predict_step_context():
            report, output = self._worker.eval_step("predict_step", batch, rest, shares)
        # Each node's first rank assembles the node's batch from its workers' shares, in batch order.
        assert self._groups is not None
        first = self.topology.node_ranks(self.node_rank)[0]
        mine = (report.samples, move_data_to_device(output, "cpu")) if report.samples else None
        parts: Optional[list[Any]] = [None] * self.num_processes if self.global_rank == first else None
        dist.gather_object(mine, parts, dst=first, group=self._groups.node)
        return merge_outputs([p for p in parts if p is not None]) if parts is not None else None

    def _eval_step(self, method: str, context: Callable, args: tuple, kwargs: dict) -> Any:
        batch, rest = args[0], tuple(args[1:]) + tuple(kwargs.values())
        assert self._worker is not None
        shares = self.shares(batch_size_of(batch))
        if shares.pipeline_size < shares.batch_size:
            self._refresh_replicas()
        with context():
            report, output = self._worker.eval_step(method, batch, rest, shares)
            self._finish_step(report)
        return output

    # --------------------------------------------------------------- collectives

    @override
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Union[Tensor, Any]:
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        return _sync_ddp(tensor.cpu(), group=group or self._control, reduce_op=reduce_op).to(tensor.device)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        gathered = _all_gather_ddp_if_available(tensor.cpu(), group=group or self._control, sync_grads=sync_grads)
        return gathered.to(tensor.device)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed_is_initialized():
            dist.barrier(group=self._control)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=self._control)
        return box[0]

    # -------------------------------------------------------------- checkpoints

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        # Lightning's default, except that a process killed while saving leaves the previous
        # checkpoint intact (see `files.py`); a CheckpointIO passed in is used as it is.
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        elif isinstance(self._checkpoint_io, _WrappingCheckpointIO):
            self._checkpoint_io.checkpoint_io = AtomicCheckpointIO()  # only where it wraps none
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        self._checkpoint_io = io

    @property
    def _rank_zero_has_everything(self) -> bool:
        return self._cpu_workers > 0

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._refresh_replicas()  # every rank calls this when a checkpoint is written
        if self._rank_zero_has_everything or self._layers is None:
            return super().lightning_module_state_dict()
        return gather_module_state(self.lightning_module, self._control)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        state = with_offloaded_state(optimizer, self.bucket_steps)
        if self._rank_zero_has_everything:
            return state
        return gather_optimizer_state(state, self._control)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        if self._layers is None or self.role.is_cpu_worker:
            return super().load_model_state_dict(checkpoint, strict=strict)
        meta = {k for k, v in module.state_dict().items() if torch.is_tensor(v) and v.is_meta}
        module.load_state_dict({k: v for k, v in checkpoint["state_dict"].items() if k not in meta}, strict=False)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            load_with_offloaded_state(optimizer, state, self.bucket_steps)
            _optimizers_to_device([optimizer], self.root_device)

    @override
    def on_train_end(self) -> None:
        # Rank 0 must hold the whole trained model: bring a stale CPU worker up to date; without a
        # CPU worker, rank 0 is stage 0: gather the whole model there. (The launcher hands rank
        # 0's weights back to the main process.)
        self._refresh_replicas()
        if self._rank_zero_has_everything or self._layers is None:
            return
        module = self.lightning_module
        full = gather_module_state(module, self._control)
        if self.global_rank == 0:
            module.load_state_dict(full, assign=True)
            move_materialized(module, self.root_device)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # In the main process of a fork/spawn run (no process group), the error is a worker's,
        # already described by that worker (see `launcher.py`).
        if _distributed_is_initialized():
            exception.add_note(self.describe_rank())

    def rank_name(self, local_rank: int) -> str:
        """A process of this node, for messages: ``global rank 2 (stage1 of <the layout>)``."""
        topo = self.topology
        rank = self.node_rank * topo.procs_per_node + local_rank
        return f"global rank {rank} ({topo.role(local_rank)} of {topo.describe()})"

    def describe_rank(self) -> str:
        """Which process this is, for error messages."""
        note = f"[hetero] raised on {self.rank_name(self.local_rank)}."
        if self.role.is_stage:
            note += " The layers of the other stages exist only on the meta device on this rank."
            if not self.role.is_last_stage:
                note += (
                    " A stage before the last never sees the model's outputs, so your step methods do not run"
                    " here: outputs they collect stay empty, and hooks such as `on_validation_epoch_end` must"
                    " handle none."
                )
        return note

    @override
    def teardown(self) -> None:
        if self._overlap is not None:
            self._overlap.close()
            self._overlap = None
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        module = self.lightning_module
        if module is not None:
            move_materialized(module, torch.device("cpu"))
            _update_properties(module, device=torch.device("cpu"))
        self.precision_plugin.teardown()
        assert self.accelerator is not None and self.cluster_environment is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        self.cluster_environment.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="CPU workers and pipelined stages train every batch together (coarse-grained)",
            mode="coarse",
        )
        strategy_registry.register(
            f"{cls.strategy_name}_fine",
            cls,
            description="hetero, with gradient sync and optimizer steps overlapped with the backward (fine-grained)",
            mode="fine",
        )


def _check_emulated_speed(speed: Optional[Mapping[str, float]]) -> dict[str, float]:
    if speed is None:
        return {}
    if not isinstance(speed, Mapping) or not set(speed) <= {"cpu", "pipeline"}:
        raise ValueError(
            f"`emulated_speed={speed!r}` must map 'cpu' and/or 'pipeline' to samples per second (testing only)."
        )
    for key, value in speed.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"`emulated_speed[{key!r}]={value!r}` must be a positive number of samples per second.")
    return {key: float(value) for key, value in speed.items()}


def _usable_plan(plan: Union[HeteroPlan, str, Path]) -> HeteroPlan:
    """The plan (loaded from its file), after checking that its devices exist on this machine."""
    loaded = plan if isinstance(plan, HeteroPlan) else HeteroPlan.load(plan)
    try:
        resolve_stage_devices(loaded.stages)
    except ValueError as error:
        source = "The plan" if isinstance(plan, HeteroPlan) else f"Plan file {plan}"
        raise ValueError(f"{source} cannot run on this machine: {error}") from None
    return loaded


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}={value!r}` must be an integer >= {minimum}.")


def _batch_and_index(args: tuple, kwargs: dict) -> tuple[Any, int]:
    """``training_step``'s batch and batch index (the model contract requires both)."""
    values = list(args) + list(kwargs.values())
    return values[0], values[1]


def _overrides(module: LightningModule, method: str) -> bool:
    return getattr(type(module), method) is not getattr(LightningModule, method)


def _gather_on_cpu(tensor: Tensor, group: Optional[Any] = None) -> list[Tensor]:
    """torchmetrics' state gather, through CPU copies: a metric's state may sit on a GPU stage on one
    rank and on the CPU on another, and the control group is gloo."""
    return [t.to(tensor.device) for t in gather_all_tensors(tensor.cpu(), group)]


def _sync_metrics_over(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Sync every torchmetrics ``Metric`` of the module over ``group`` (see `_gather_on_cpu`)."""
    for metric in module.modules():
        if isinstance(metric, Metric):
            metric.process_group = group
            metric.dist_sync_fn = _gather_on_cpu


def _check_optimizers(optimizers: list[Optimizer]) -> None:
    for optimizer in optimizers:
        inner = getattr(optimizer, "_optimizer", optimizer)
        if isinstance(inner, torch.optim.LBFGS):
            raise ValueError(
                "LBFGS re-evaluates the loss inside `optimizer.step` and treats all parameters as one vector,"
                " which the hetero strategy cannot split between stages. Use a first-order optimizer."
            )


def _destroy_process_groups() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _check_fine_mode(module: LightningModule, optimizers: list[Optimizer]) -> None:
    if _overrides(module, "configure_gradient_clipping"):
        raise ValueError(
            f"`{type(module).__name__}` overrides `configure_gradient_clipping`, which fine mode cannot call: it"
            " clips each bucket as its gradients complete. Use the Trainer's `gradient_clip_val` and"
            " `gradient_clip_algorithm`, or `mode='coarse'`."
        )
    if len(optimizers) != 1:
        raise ValueError(f"Fine mode steps one optimizer bucket by bucket; `configure_optimizers` gave {len(optimizers)}.")


def _clipping(trainer: "pl.Trainer") -> tuple[Optional[float], Optional[float]]:
    """(clip by value, clip by norm) as the Trainer is configured."""
    value = trainer.gradient_clip_val
    if not value:
        return None, None
    if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
        return float(value), None
    return None, float(value)


def _clip_with(plugin: Precision, strategy: "HeteroStrategy") -> None:
    """Route the precision plugin's gradient clipping through the strategy: clipping by norm needs
    the norm over all stages, not this rank's slice, and fine mode leaves no gradients to clip."""
    plugin.clip_grad_by_norm = strategy._clip_grad_by_norm  # type: ignore[method-assign]
    plugin.clip_grad_by_value = strategy._clip_grad_by_value  # type: ignore[method-assign]


def _span(clock: Optional[StepClock], kind: str) -> Any:
    return clock.span(kind) if clock is not None else nullcontext()


def hetero_strategy(trainer: "pl.Trainer") -> Optional["HeteroStrategy"]:
    """The trainer's strategy if it is a hetero one (for callbacks that only act on hetero runs)."""
    return trainer.strategy if isinstance(trainer.strategy, HeteroStrategy) else None


def _analyzer(trainer: "pl.Trainer") -> Any:
    from lightning_hetero.callbacks.analyzer import WorkloadAnalyzer

    return next((cb for cb in trainer.callbacks if isinstance(cb, WorkloadAnalyzer)), None)
