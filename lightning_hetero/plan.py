"""``HeteroPlan``: the one description of how a hetero run is laid out.

A plan says which devices run the pipeline stages and where the layers are cut between them,
how the pipeline's share is cut into micro-batches and scheduled, how much of each batch the CPU
workers compute, which fine-mode buckets are offloaded, and how the CPU's cores are split
between data loading and compute. The workload analyzer writes one; ``HeteroStrategy(plan=...)``
replays one, from the object or from its YAML file.

Every run follows a plan: ``HeteroStrategy``'s layout arguments are turned into one
(``layout_plan``), so the layout is checked here, in one place, and read from one value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Optional, Union

from lightning.pytorch.utilities import rank_zero_warn
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from torch import nn

from lightning_hetero.files import atomic_write
from lightning_hetero.module import check_model_contract, check_replica_contract, layer_names, offers_blocks
from lightning_hetero.module import tied_parameters
from lightning_hetero.multimodal import check_encoder_placement, check_placement, encoder_stages
from lightning_hetero.numa import check_cpu_cores, cpu_worker_cores
from lightning_hetero.offload import bucket_indices, check_offload
from lightning_hetero.pipeline import V_SHAPED, ZERO_BUBBLE, holders, is_multi_stage, partition_layers, resolve_schedule
from lightning_hetero.pipeline import schedule_class, schedule_name
from lightning_hetero.sync import make_buckets
from lightning_hetero.topology import parse_device, resolve_stage_devices

__all__ = ["HeteroPlan", "LAYOUT_ARGUMENTS", "layout_plan"]

LAYOUT_ARGUMENTS = (
    "parallelism",
    "mode",
    "stages",
    "cpu_workers",
    "cpu_threads",
    "micro_batches",
    "schedule",
    "cpu_fraction",
    "offload",
    "bucket_size_mb",
    "encoders",
    "shard_cpu_optimizer",
    "shard_across_nodes",
    "stages_per_process",
)
"""``HeteroStrategy``'s arguments that a plan sets."""


@dataclass(kw_only=True)
class HeteroPlan:
    """The layout of a hetero run. Every field is what ``HeteroStrategy`` takes of the same name,
    except ``boundaries``, which fixes where the layers are cut."""

    parallelism: Literal["auto", "pipeline", "replicas"] = "auto"
    """What the devices hold: ``"pipeline"``, a stage each (the model's ``pipeline_layers()`` cut between
    them); ``"replicas"``, the whole model each (any LightningModule); ``"auto"``, a pipeline where
    the model offers blocks, replicas where it does not."""
    mode: Literal["coarse", "fine"] = "coarse"
    """Coarse: gradients summed after the backward; fine: bucket by bucket during it."""
    stages: list[str] = field(default_factory=lambda: ["cpu", "cpu"])
    """The device of each pipeline stage, in order ('cpu' emulates a stage on a CPU process)."""
    boundaries: list[Union[int, str]] = field(default_factory=list)
    """Where each stage after the first begins: a layer's index in ``pipeline_layers()`` or its
    module name (e.g. ``"blocks.6"``). Empty: cut by parameter count."""
    micro_batches: int = 4
    """Micro-batches the pipeline's share of a batch is cut into."""
    schedule: str = "GPipe"
    """A schedule ``get_schedule_class`` knows: one stage per process (GPipe, 1F1B) or several
    (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)."""
    stages_per_process: int = 1
    """Stages each stage process holds: 1 for a single-stage schedule, 2 or more for a multi-stage one
    (2 for the V-shaped ZBVZeroBubble and DualPipeV); the blocks are cut into that many times the
    processes' stages."""
    cpu_workers: int = 1
    """CPU-worker processes, each with a full replica."""
    cpu_cores: Optional[list[list[int]]] = None
    """The cores each CPU worker is pinned to, one list per worker (``cpu_workers="auto"``: its NUMA
    node's; ``numa.py``); its torch threads default to their number. None: not pinned."""
    cpu_threads: Optional[int] = None
    """torch threads per CPU worker (None: the cores the other processes leave)."""
    stage_threads: Optional[int] = None
    """torch threads per stage process: an emulated stage's layers, a GPU stage's offloaded optimizer
    steps (None: an emulated stage shares the cores with the CPU workers, a GPU stage keeps one)."""
    cpu_fraction: float = 0.0
    """The share of every batch the CPU workers compute, in [0, 1]."""
    offload: Any = field(default_factory=list)
    """Fine mode: the buckets whose optimizer step runs on the CPU, as a list of bucket indices (0 is
    the last layers' bucket), or ``"auto"``, ``"none"``, ``"all"`` (see ``HeteroStrategy``)."""
    bucket_size_mb: float = 25.0
    """Fine mode: the parameter size that closes a bucket."""
    shard_cpu_optimizer: bool = True
    """With two or more CPU workers: the optimizer state they hold (fine mode's offloaded buckets, coarse
    mode's replicas') and its step split between them (``sharding.py``); ``False``: every CPU worker
    steps all of it."""
    shard_across_nodes: bool = False
    """With several nodes: split it between the CPU workers of every node instead of each node's."""
    dataloader_workers: Optional[int] = None
    """DataLoader worker processes per rank (None: as the DataLoader was built)."""
    encoders: dict[str, str] = field(default_factory=dict)
    """A multimodal model's encoders placed on one process, by modality: ``"cpuN"`` or ``"deviceN"``
    computes it for every worker's share (``multimodal.py``); an encoder left out is ``"split"``:
    every worker computes it on its own share."""
    predicted_step_s: Optional[float] = None
    """The step time the planner predicted for this layout (information, not layout)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise a clear error for a plan no run could follow. The model is checked by ``cut``, and
        the devices' existence when a strategy takes the plan (it may be for another machine)."""
        if self.parallelism not in ("auto", "pipeline", "replicas"):
            raise ValueError(
                f"`parallelism={self.parallelism!r}` must be 'auto', 'pipeline' (the devices hold pipeline stages)"
                " or 'replicas' (each holds the whole model)."
            )
        if self.parallelism == "replicas" and self.boundaries:
            raise ValueError("Plan: replicas hold the whole model; `boundaries` cut pipeline stages.")
        if self.mode not in ("coarse", "fine"):
            raise ValueError(f"Plan: `mode={self.mode!r}` must be 'coarse' or 'fine'.")
        if not self.stages:
            raise ValueError("Plan: `stages` is empty; a run needs at least one pipeline stage.")
        devices = [parse_device(d) for d in self.stages]
        _check_positive("stages_per_process", self.stages_per_process)
        cut = len(devices) * self.stages_per_process
        if len(self.boundaries) not in (0, cut - 1):
            raise ValueError(
                f"Plan: {cut} stages need {cut - 1} boundaries (where each stage after the first"
                f" begins), but the plan gives {len(self.boundaries)}: {list(self.boundaries)}."
            )
        indices = [b for b in self.boundaries if isinstance(b, int)]
        if any(b < 1 for b in indices) or indices != sorted(set(indices)):
            raise ValueError(f"Plan: layer-index boundaries must increase and be >= 1, got {list(self.boundaries)}.")
        _check_positive("micro_batches", self.micro_batches)
        resolve_schedule(self.schedule, len(devices), self.micro_batches, self.stages_per_process)
        if self.cpu_workers < 0:
            raise ValueError(f"Plan: `cpu_workers={self.cpu_workers}` must be >= 0.")
        if self.cpu_cores is not None:
            if len(self.cpu_cores) != self.cpu_workers:
                raise ValueError(
                    f"Plan: `cpu_cores` gives {len(self.cpu_cores)} core set(s) for {self.cpu_workers} CPU worker(s);"
                    " give one per CPU worker."
                )
            self.cpu_cores = check_cpu_cores(self.cpu_cores, here=False)  # this machine's cores: when a strategy takes it
        if self.cpu_threads is not None:
            _check_positive("cpu_threads", self.cpu_threads)
        if self.stage_threads is not None:
            _check_positive("stage_threads", self.stage_threads)
        if not 0.0 <= self.cpu_fraction <= 1.0:
            raise ValueError(f"Plan: `cpu_fraction={self.cpu_fraction}` must be between 0 and 1.")
        if self.cpu_fraction > 0 and self.cpu_workers == 0:
            raise ValueError(f"Plan: `cpu_fraction={self.cpu_fraction}` gives the CPU a share, but `cpu_workers=0`.")
        if isinstance(self.offload, str):
            if self.offload not in ("auto", "none", "all"):
                raise ValueError(f"Plan: `offload={self.offload!r}` must be 'auto', 'none', 'all' or a list of buckets.")
        elif not bucket_indices(self.offload):
            raise ValueError(f"Plan: `offload={self.offload!r}` must be 'auto', 'none', 'all' or a list of bucket indices (integers >= 0).")
        if self.offload not in ("auto", "none", []) and self.mode != "fine":
            raise ValueError("Plan: offloaded buckets need `mode: fine`.")
        if not 0 < self.bucket_size_mb < math.inf:  # as `from_arguments` checks it (NaN fails both)
            raise ValueError(f"Plan: `bucket_size_mb={self.bucket_size_mb}` must be a positive number of megabytes.")
        if self.dataloader_workers is not None and self.dataloader_workers < 0:
            raise ValueError(f"Plan: `dataloader_workers={self.dataloader_workers}` must be >= 0.")
        self.encoders = check_placement(self.encoders)

    def for_model(self, model: nn.Module) -> HeteroPlan:
        """This plan with ``parallelism`` decided for ``model`` (``"auto"``: a pipeline where it offers
        blocks, replicas where it does not)."""
        if self.parallelism != "auto":
            return self
        return replace(self, parallelism="pipeline" if offers_blocks(model) else "replicas")

    def stage_holders(self) -> list[int]:
        """The stage process that holds each of the pipeline's stages: stage ``s`` is process ``s`` with
        one stage per process, placed as the schedule places them with several (``pipeline.holders``)."""
        return holders(len(self.stages), self.stages_per_process, schedule_name(schedule_class(self.schedule)) in V_SHAPED)

    def runs_on(self, other: HeteroPlan) -> bool:
        """Whether this plan lays out the processes of ``other``'s run: the same stages, CPU workers and mode."""
        def processes(plan: HeteroPlan) -> tuple:
            return [str(d) for d in resolve_stage_devices(plan.stages)], plan.cpu_workers, plan.mode

        return processes(self) == processes(other)

    def place_blocks(
        self, model: nn.Module, cut_later: bool = False, whole_batch_norm: bool = False
    ) -> tuple[list[nn.Module], list[tuple[int, int]]]:
        """The model's blocks and each stage's ``[start, stop)`` of them, the contract checked. In a
        pipeline, ``pipeline_layers()`` cut where the plan cuts them, or balanced by parameter count;
        replicas hold all of the model's parameter blocks (``check_replica_contract``) in one piece.
        Raises a clear error where the blocks cannot fill the stages or the offloaded buckets do not exist.
        ``cut_later``: the cut is yet to be planned (``WorkloadAnalyzer``), and what depends on it only
        is checked then; ``whole_batch_norm``: ``Trainer(sync_batchnorm=True)``, for the encoders' places."""
        replicas = self.for_model(model).parallelism == "replicas"
        check_encoder_placement(model, self.encoders, self.cpu_workers, len(self.stages), replicas, whole_batch_norm)
        if replicas:
            layers = check_replica_contract(model)
            bounds = [(0, len(layers))]
        else:
            if len({device.type for device in resolve_stage_devices(self.stages)}) > 1:
                raise ValueError(
                    f"`stages={list(self.stages)}` puts GPU and CPU stages in one pipeline. Its stages send each other"
                    " their activations over NCCL, which needs a GPU in every stage's process, and a pipeline runs at"
                    " the pace of its slowest stage. Give every stage a GPU, and put the CPU to work as a CPU worker"
                    " (`cpu_workers`: it trains a share of every batch beside the pipeline)."
                )
            layers = check_model_contract(model)
            count = len(self.stages) * self.stages_per_process
            bounds = self.cut(layer_names(model, layers)) or partition_layers(layers, count)
            if not cut_later:
                self._check_split_backward(model, encoder_stages(model, self.encoders, layers, bounds))
        if not isinstance(self.offload, str) and self.offload:
            tied = [stages for stages, _ in tied_parameters(layers, bounds)]
            count = len(make_buckets(layers, bounds, int(self.bucket_size_mb * 2**20), tied))
            if self.offload[-1] >= count:
                raise ValueError(
                    f"`offload={self.offload}` names bucket {self.offload[-1]}, but the model has"
                    f" {'1 bucket (0)' if count == 1 else f'{count} buckets (0 to {count - 1})'}"
                    f" at `bucket_size_mb={self.bucket_size_mb:g}`."
                )
        return layers, bounds

    def _check_split_backward(self, model: nn.Module, placed: Mapping[str, int]) -> None:
        """A zero-bubble schedule computes a stage's input gradient apart from its weights': the output of
        an encoder placed on another process, which a stage after the first takes in, would get no
        gradient to send back. Refused with what to do."""
        late = {modality: stage for modality, stage in placed.items() if stage > 0}
        if late and schedule_name(schedule_class(self.schedule)) in ZERO_BUBBLE:
            raise ValueError(
                f"`{type(model).__name__}` takes the placed encoders {sorted(late)} in stage(s) after the first"
                f" ({sorted(set(late.values()))}), where schedule {self.schedule!r} splits the backward and their"
                " outputs would get no gradient. Use a schedule with a whole backward ('Interleaved1F1B', 'LoopedBFS',"
                " 'GPipe', '1F1B'), cut the stages so the encoders are in the first, or leave them 'split'."
            )

    def cut(self, layer_names: Sequence[str]) -> list[tuple[int, int]] | None:
        """Each stage's ``[start, stop)`` layers for a model whose layers have these module names;
        ``None`` when the plan leaves the cut to the parameter-count partition."""
        if not self.boundaries:
            return None
        starts = [0]
        for b in self.boundaries:
            if isinstance(b, str):
                if b not in layer_names:
                    shown = ", ".join(layer_names[:8]) + (" ..." if len(layer_names) > 8 else "")
                    raise ValueError(f"Plan: boundary {b!r} is not one of the model's layers ({shown}).")
                b = list(layer_names).index(b)
            starts.append(b)
        if starts != sorted(set(starts)) or starts[-1] >= len(layer_names):
            raise ValueError(
                f"Plan: boundaries {list(self.boundaries)} do not cut the model's {len(layer_names)} layers into"
                f" {len(starts)} non-empty stages in order."
            )
        return list(zip(starts, [*starts[1:], len(layer_names)]))

    # ------------------------------------------------------------------ files

    def to_yaml(self) -> str:
        return OmegaConf.to_yaml(OmegaConf.structured(self))

    def save(self, path: Union[str, Path]) -> Path:
        """Write the plan as YAML, whole or not at all (``atomic_write``)."""
        with atomic_write(path, "w") as f:
            f.write(self.to_yaml())
        return Path(path)

    @classmethod
    def from_arguments(
        cls,
        *,
        parallelism: str,
        mode: str,
        stages: Any,
        cpu_workers: Any,
        cpu_threads: Any,
        micro_batches: Any,
        schedule: Any,
        cpu_fraction: Any,
        offload: Any,
        bucket_size_mb: Any,
        encoders: Any = None,
        shard_cpu_optimizer: Any = True,
        shard_across_nodes: Any = False,
        stages_per_process: Any = "auto",
    ) -> HeteroPlan:
        """The plan of ``HeteroStrategy``'s layout arguments (see its docstring), after checking each
        one: ``stages`` becomes one device per stage, ``cpu_fraction="auto"`` a number."""
        if mode not in ("coarse", "fine"):
            raise ValueError(f"`mode={mode!r}` is not a hetero mode; use 'coarse' or 'fine'.")
        check_offload(offload, mode)
        if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)) or not 0 < bucket_size_mb < math.inf:
            raise ValueError(f"`bucket_size_mb={bucket_size_mb!r}` must be a positive number of megabytes.")
        cpu_workers, cpu_cores = _cpu_workers(cpu_workers)
        for name, value in (("shard_cpu_optimizer", shard_cpu_optimizer), ("shard_across_nodes", shard_across_nodes)):
            if not isinstance(value, bool):
                raise ValueError(f"`{name}={value!r}` must be True or False.")
        if shard_across_nodes and not shard_cpu_optimizer:
            raise ValueError(
                "`shard_across_nodes=True` splits the CPU workers' optimizer state between every node's CPU workers,"
                " and `shard_cpu_optimizer=False` asks for whole copies: drop one of them."
            )
        _check_int("micro_batches", micro_batches, minimum=1)
        if schedule == "auto":  # the workload analyzer's to choose; without it, GPipe (or a loop of stages)
            schedule = "GPipe" if stages_per_process in ("auto", 1) else "Interleaved1F1B"
        name = schedule_name(schedule)
        if stages_per_process == "auto":
            stages_per_process = 2 if is_multi_stage(schedule_class(name)) else 1
        _check_int("stages_per_process", stages_per_process, minimum=1)
        if cpu_threads is not None:
            _check_int("cpu_threads", cpu_threads, minimum=1)
        devices = resolve_stage_devices(stages)
        return cls(
            parallelism=parallelism,
            mode=mode,
            stages=[str(d) for d in devices],
            cpu_workers=cpu_workers,
            cpu_cores=cpu_cores,
            cpu_threads=cpu_threads,
            micro_batches=micro_batches,
            schedule=name,
            stages_per_process=stages_per_process,
            cpu_fraction=_fraction(cpu_fraction, cpu_workers, [d.type for d in devices]),
            offload=offload if isinstance(offload, str) else sorted(set(offload)),
            bucket_size_mb=float(bucket_size_mb),
            encoders=check_placement(encoders),
            shard_cpu_optimizer=shard_cpu_optimizer,
            shard_across_nodes=shard_across_nodes,
        )

    @classmethod
    def load(cls, path: Union[str, Path]) -> HeteroPlan:
        """Read a plan from YAML; unknown keys, wrong types and impossible values are errors that name the file."""
        try:
            loaded = OmegaConf.load(path)
            if not isinstance(loaded, DictConfig) or not loaded:
                raise ValueError(
                    "it holds no plan. A plan is a mapping of its fields (`stages: [...]`, `cpu_fraction: ...`), as"
                    " `HeteroPlan.save` and the workload analyzer write it."
                )
            if "shard_offloaded" in loaded:
                rank_zero_warn(f"Plan file {path}: `shard_offloaded` is now `shard_cpu_optimizer`; read as such.")
                loaded["shard_cpu_optimizer"] = loaded.pop("shard_offloaded")
            config = OmegaConf.merge(OmegaConf.structured(cls), loaded)
            return OmegaConf.to_object(config)  # type: ignore[return-value]
        except FileNotFoundError:
            raise
        except (OmegaConfBaseException, ValueError, OSError) as error:  # OSError: a YAML value that is not a mapping
            raise ValueError(f"Plan file {path}: {error}") from None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        """The plan as aligned ``field  value`` lines."""
        rows = [(name, _show(value)) for name, value in self.as_dict().items()]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)

    def __str__(self) -> str:
        return self.table()


def layout_plan(
    plan: Union[HeteroPlan, str, Path, None], arguments: Mapping[str, Any], defaults: Mapping[str, Any]
) -> HeteroPlan:
    """The layout a strategy runs: a copy of ``plan`` (or the plan in that file), checked against
    this machine, or the plan of its layout ``arguments``; never both (an argument that differs
    from its default in ``defaults`` is given)."""
    if plan is None:
        return HeteroPlan.from_arguments(**arguments)
    if not isinstance(plan, (HeteroPlan, str, Path)):
        raise ValueError(f"`plan={plan!r}` must be a HeteroPlan or the path of a plan file (plan.yaml).")
    loaded = HeteroPlan.load(plan) if not isinstance(plan, HeteroPlan) else plan
    given = sorted(name for name, value in arguments.items() if value != defaults[name])
    if given:
        raise ValueError(
            f"Pass the layout either as a plan or as arguments, not both: {given} are given beside the plan, which"
            " sets the whole layout. Leave them out (with LightningCLI, a plan given on the command line leaves"
            " out a config's)."
        )
    try:
        devices = resolve_stage_devices(loaded.stages)
        if loaded.cpu_cores is not None:
            check_cpu_cores(loaded.cpu_cores)
    except ValueError as error:
        source = "The plan" if isinstance(plan, HeteroPlan) else f"Plan file {plan}"
        raise ValueError(f"{source} cannot run on this machine: {error}") from None
    return replace(loaded, stages=[str(d) for d in devices])  # a copy, its devices named as they resolve here


def _cpu_workers(cpu_workers: Any) -> tuple[int, Optional[list[list[int]]]]:
    """``cpu_workers`` as a count and the cores of each worker where they are pinned: ``"auto"`` is one
    per NUMA node this process may use, each pinned to its node's cores (one, not pinned, on a machine
    of one node); a list of core sets pins one worker to each; a count pins none."""
    if cpu_workers == "auto":
        cores = cpu_worker_cores()
        return (len(cores), cores) if cores else (1, None)
    if isinstance(cpu_workers, str):
        raise ValueError(
            f"`cpu_workers={cpu_workers!r}` must be a count, 'auto' (one per NUMA node, pinned to its cores) or a list"
            " of core sets, one per CPU worker (e.g. [[0, 1, 2, 3], [4, 5, 6, 7]] or ['0-3', '4-7'])."
        )
    if isinstance(cpu_workers, int):
        _check_int("cpu_workers", cpu_workers, minimum=0)
        return cpu_workers, None
    cores = check_cpu_cores(cpu_workers)
    return len(cores), cores


def _fraction(cpu_fraction: Any, cpu_workers: int, device_types: list[str]) -> float:
    """``"auto"``: each process's fair share of the cores where the stages are emulated on them, and
    0 with GPU stages (the rebalancer finds the CPU's share there); otherwise the number, checked."""
    if cpu_fraction == "auto":
        if cpu_workers == 0 or "cuda" in device_types:
            return 0.0
        return cpu_workers / (cpu_workers + len(device_types))
    if isinstance(cpu_fraction, bool) or not isinstance(cpu_fraction, (int, float)) or not 0 <= cpu_fraction <= 1:
        raise ValueError(f"`cpu_fraction={cpu_fraction!r}` must be 'auto' or a number between 0 and 1.")
    if cpu_workers == 0 and cpu_fraction > 0:
        raise ValueError(
            f"`cpu_fraction={cpu_fraction}` gives the CPU a share, but `cpu_workers=0` starts no CPU worker."
        )
    return float(cpu_fraction)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}={value!r}` must be an integer >= {minimum}.")


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"Plan: `{name}={value}` must be >= 1.")


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) or "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) or "-"
    return "-" if value is None else str(value)
