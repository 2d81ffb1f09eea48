"""Ranks, roles, devices and process groups of a hetero run.

One node is one *hetero group*: ``cpu_workers`` CPU-worker ranks followed by one rank per device,
each a pipeline stage or, where the devices hold whole replicas of the model, a replica. CPU
workers come first so that global rank 0, where Lightning logs and writes checkpoints, holds a
full replica of the model. Several nodes are data-parallel replicas of each other.
"""

from __future__ import annotations

import atexit
import itertools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.accelerators.cuda import num_cuda_devices
from lightning.fabric.utilities.distributed import _init_dist_connection

from lightning_hetero.mesh import LocalMesh
from lightning_hetero.numa import format_cpulist

__all__ = [
    "Role",
    "Topology",
    "ProcessGroups",
    "parse_device",
    "resolve_stage_devices",
    "build_process_groups",
    "threads_for",
    "pin_to",
    "usable_cores",
    "restart_store",
    "record_failure",
    "recorded_failures",
    "first_to_leave",
    "READY_DIR_ENV",
    "gather_object_to",
    "tied_groups",
    "destroy_process_groups",
    "connect",
]

StagesArg = Union[Literal["auto"], int, Sequence[Union[str, int, torch.device]]]


@dataclass(frozen=True)
class Role:
    """What one process does: a CPU worker (a full replica on the CPU), a pipeline stage (a slice of
    the layers on a device) or a replica (the whole model on a device)."""

    kind: Literal["cpu", "stage", "replica"]
    index: int
    num_stages: int
    """Device ranks per node: pipeline stages, or replicas."""

    @property
    def is_cpu_worker(self) -> bool:
        return self.kind == "cpu"

    @property
    def is_stage(self) -> bool:
        return self.kind == "stage"

    @property
    def is_first_stage(self) -> bool:
        return self.is_stage and self.index == 0

    @property
    def is_last_stage(self) -> bool:
        """The last stage process (which holds the last stage unless a V-shaped schedule gives it to the first)."""
        return self.is_stage and self.index == self.num_stages - 1

    @property
    def counts_own_samples(self) -> bool:
        """Whether no other rank of its node computes this rank's samples: a CPU worker, a device
        replica, or the first stage (every stage computes the pipeline's share)."""
        return self.kind in ("cpu", "replica") or self.index == 0

    def __str__(self) -> str:
        return f"{self.kind}{self.index}"


@dataclass(frozen=True, kw_only=True)
class Topology:
    """The layout of processes: CPU workers, then stages, on each of ``num_nodes`` nodes."""

    cpu_workers: int
    """CPU-worker processes per node, each with a full replica of the model."""
    stage_devices: tuple[torch.device, ...]
    """The device of each pipeline stage, in pipeline order."""
    num_nodes: int = 1
    """Nodes; each holds one hetero group, and the groups are data-parallel replicas."""
    replicas: bool = False
    """The devices hold whole replicas of the model instead of pipeline stages."""
    cpu_cores: Optional[tuple[tuple[int, ...], ...]] = None
    """The cores each CPU worker is pinned to (``numa.py``); ``None``: not pinned."""

    @property
    def num_stages(self) -> int:
        return len(self.stage_devices)

    @property
    def procs_per_node(self) -> int:
        return self.cpu_workers + self.num_stages

    @property
    def world_size(self) -> int:
        return self.procs_per_node * self.num_nodes

    @property
    def local_devices(self) -> list[torch.device]:
        """The device of each local rank on a node."""
        return [torch.device("cpu")] * self.cpu_workers + list(self.stage_devices)

    @property
    def uses_cuda(self) -> bool:
        return any(d.type == "cuda" for d in self.stage_devices)

    def role(self, local_rank: int) -> Role:
        if local_rank < self.cpu_workers:
            return Role("cpu", local_rank, self.num_stages)
        return Role("replica" if self.replicas else "stage", local_rank - self.cpu_workers, self.num_stages)

    def cpu_ranks(self, node: int) -> list[int]:
        base = node * self.procs_per_node
        return list(range(base, base + self.cpu_workers))

    def stage_ranks(self, node: int) -> list[int]:
        base = node * self.procs_per_node + self.cpu_workers
        return list(range(base, base + self.num_stages))

    def node_ranks(self, node: int) -> list[int]:
        return self.cpu_ranks(node) + self.stage_ranks(node)

    def describe(self) -> str:
        stages = ", ".join(str(d) for d in self.stage_devices)
        kind = "replica(s)" if self.replicas else "stage(s)"
        pinned = f" on cores {' | '.join(format_cpulist(c) for c in self.cpu_cores)}" if self.cpu_cores else ""
        return f"{self.cpu_workers} CPU worker(s){pinned} + {self.num_stages} {kind} [{stages}] x {self.num_nodes} node(s)"

    def check_world_size(self, started: int) -> None:
        """Raise where a launcher started another number of processes than the layout needs."""
        if started != self.world_size:
            nodes = started // self.procs_per_node
            hint = (
                f" The launcher started {self.procs_per_node} per node on {nodes} nodes: pass `Trainer(num_nodes={nodes})`."
                if started % self.procs_per_node == 0 and nodes != self.num_nodes
                else f" Start {self.procs_per_node} processes per node (e.g. `torchrun --nproc-per-node={self.procs_per_node}`)."
            )
            raise RuntimeError(
                f"The hetero layout {self.describe()} needs {self.world_size} processes, but the launcher started"
                f" {started}.{hint}"
            )

    def device_names(self) -> list[str]:
        """Each global rank's name in logs: its role (``cpu0``, ``stage1``), ``node1.stage0`` on
        further nodes."""
        names = []
        for rank in range(self.world_size):
            node, local = divmod(rank, self.procs_per_node)
            names.append(str(self.role(local)) if node == 0 else f"node{node}.{self.role(local)}")
        return names

    def rank_name(self, node: int, local_rank: int) -> str:
        """A process, for messages: ``global rank 2 (stage1 of <the layout>)``."""
        rank = node * self.procs_per_node + local_rank
        return f"global rank {rank} ({self.role(local_rank)} of {self.describe()})"


_BEFORE_PINNING: Optional[int] = None
"""The cores this process could run on before ``pin_to`` kept it to its own."""


def usable_cores() -> int:
    """The cores the run's processes may use (this process's affinity, where the OS has one): a CPU
    worker pinned to its NUMA node's cores counts those it had before, as every other rank of its
    node does, so that decisions every rank takes alike from it agree."""
    if _BEFORE_PINNING is not None:
        return _BEFORE_PINNING
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def threads_for(
    role: Role,
    topology: Topology,
    cores: int,
    cpu_threads: int | None = None,
    cpu_share: bool = True,
    stage_threads: int | None = None,
) -> int:
    """Torch threads for one process of a node with ``cores`` cores.

    Emulated (CPU) stages share the cores evenly with the CPU workers; while the CPU workers have
    no share of the batches (``cpu_share=False``: they compute nothing), the emulated stages share
    them alone. With GPU stages (or GPU replicas), each of their processes keeps one core to drive
    its device and the CPU workers share the rest. ``cpu_threads`` overrides the CPU workers' count,
    ``stage_threads`` the emulated stages' (a plan's split of the cores between loading and compute).
    A CPU worker pinned to cores (``topology.cpu_cores``) takes one thread per core it has.
    """
    gpu_stages = sum(d.type == "cuda" for d in topology.stage_devices)
    if not role.is_cpu_worker and topology.stage_devices[role.index].type == "cuda":
        return 1  # a GPU stage or replica drives its device
    if role.is_stage:
        if stage_threads is not None:
            return stage_threads
        if cpu_share:
            return max(1, cores // topology.procs_per_node)
        return max(1, (cores - gpu_stages) // (topology.num_stages - gpu_stages))
    if cpu_threads is not None:
        return cpu_threads
    if topology.cpu_cores is not None and role.is_cpu_worker:
        return len(topology.cpu_cores[role.index])
    if gpu_stages:
        return max(1, (cores - gpu_stages) // topology.cpu_workers)
    return max(1, cores // topology.procs_per_node)


def resolve_stage_devices(stages: StagesArg) -> tuple[torch.device, ...]:
    """Turn the ``stages`` argument into one device per stage, or raise a clear error.

    ``"auto"`` is one stage per visible GPU, or two emulated CPU stages where there is none. An int
    is that many GPUs (or emulated CPU stages where there is no GPU). A list names each device.
    """
    gpus = num_cuda_devices()
    if stages == "auto":
        return tuple(torch.device("cuda", i) for i in range(gpus)) or (torch.device("cpu"),) * 2
    if isinstance(stages, bool) or not isinstance(stages, (int, list, tuple)):
        raise ValueError(
            f"`stages={stages!r}` is not understood. Pass 'auto', a number of stages, or a list of devices"
            " such as ['cuda:0', 'cuda:1'] (or ['cpu', 'cpu'] to emulate the pipeline on CPU processes)."
        )
    if isinstance(stages, int):
        if stages < 1:
            raise ValueError(f"`stages={stages}`: a hetero run needs at least one pipeline stage.")
        if gpus == 0:
            return (torch.device("cpu"),) * stages
        if stages > gpus:
            raise ValueError(
                f"`stages={stages}` asks for {stages} GPU stages but this machine has {gpus} GPU(s)."
                " Use fewer stages, and put the CPU to work as a CPU worker (`cpu_workers`)."
            )
        return tuple(torch.device("cuda", i) for i in range(stages))
    if len(stages) == 0:
        raise ValueError("`stages=[]`: a hetero run needs at least one pipeline stage.")
    devices = []
    next_gpu = 0
    for item in stages:
        device = parse_device(item)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", next_gpu)
        if device.type == "cuda":
            if gpus == 0:
                raise ValueError(f"Stage device '{item}' is a GPU, but CUDA is not available on this machine.")
            if device.index >= gpus:
                raise ValueError(f"Stage device '{device}' does not exist: this machine has {gpus} GPU(s).")
            next_gpu = device.index + 1
        devices.append(device)
    cuda = [d for d in devices if d.type == "cuda"]
    if len(set(cuda)) != len(cuda):
        raise ValueError(f"`stages={list(stages)!r}` places two stages on the same GPU; give each stage its own GPU.")
    return tuple(devices)


def parse_device(item: Union[str, int, torch.device]) -> torch.device:
    """A stage device from its name, checked for form (not for existence on this machine)."""
    if isinstance(item, torch.device):
        device = item
    elif isinstance(item, int) and not isinstance(item, bool):
        device = torch.device("cuda", item)
    elif isinstance(item, str):
        try:
            device = torch.device(item)
        except RuntimeError:
            raise ValueError(f"Stage device '{item}' is not a device name; use 'cpu', 'cuda' or 'cuda:N'.") from None
    else:
        raise ValueError(f"Stage device {item!r} is not a device; use 'cpu', 'cuda', 'cuda:N' or a GPU index.")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"Stage device '{device}' is not supported; stages run on 'cpu' (emulated) or 'cuda'.")
    if device.type == "cpu":
        return torch.device("cpu")
    return device


@dataclass
class ProcessGroups:
    """The process groups this rank communicates in.

    ``control`` is every rank, on gloo: losses, logged values, decisions and small tensors, which
    travel as CPU tensors whatever the device (the default group may be NCCL for CUDA tensors).
    ``node`` is every rank of this node, on gloo. ``stage`` connects this node's stages (the
    pipeline's sends and receives). ``sync[s]`` joins stage ``s`` with the CPU workers of its node,
    for gradient sync; it is ``None`` where this rank is not a member. ``replica`` joins this rank
    with the same local rank on every other node (gloo: gradients travel as CPU buffers).
    ``stage_reports`` names the stages of a single node with CPU workers and several stages, which
    share the steps' results among themselves where the CPU workers have no share (over ``mesh``,
    ``results.ReportExchange``).
    ``mesh`` joins every rank over Unix sockets in a single-node run (``mesh.LocalMesh``): the steps'
    results and the strategy's object collectives travel over it. A run over several nodes has none,
    and sends them over gloo (``control``).

    Where the devices hold replicas, ``stage`` joins the node's device replicas (on gloo), which sum
    without the CPU workers when those have no share, and ``sync`` has one group: the node's every
    rank (every one holds every parameter).
    """

    control: dist.ProcessGroup
    node: dist.ProcessGroup
    stage: dist.ProcessGroup | None
    sync: list[dist.ProcessGroup | None]
    replica: dist.ProcessGroup | None
    stage_reports: dist.ProcessGroup | None = None
    mesh: LocalMesh | None = None


def world_backend(topology: Topology) -> str:
    """The default group's backend: gloo for CPU tensors, and NCCL for CUDA tensors where there are GPUs."""
    return "cpu:gloo,cuda:nccl" if topology.uses_cuda else "gloo"


def build_process_groups(
    topology: Topology, global_rank: int, timeout: timedelta, mesh: Optional[LocalMesh] = None
) -> ProcessGroups:
    """Create every group on every rank (``new_group`` is collective) and keep the ones this rank is in.
    ``mesh``: the one an earlier trainer call in these processes made, kept (a new one otherwise,
    on a single node)."""
    stage_backend = "nccl" if topology.uses_cuda else "gloo"
    node = global_rank // topology.procs_per_node
    control = dist.new_group(backend="gloo", timeout=timeout)
    node_group = control
    if topology.num_nodes > 1:
        for n in range(topology.num_nodes):
            group = dist.new_group(topology.node_ranks(n), timeout=timeout, backend="gloo")
            if n == node:
                node_group = group
    stage_group = None
    sync: list[dist.ProcessGroup | None] = [None] * (1 if topology.replicas else topology.num_stages)
    for n in range(topology.num_nodes):
        ranks = topology.stage_ranks(n)
        group = dist.new_group(ranks, timeout=timeout, backend="gloo" if topology.replicas else stage_backend)
        if n == node and global_rank in ranks:
            stage_group = group
    for n in range(topology.num_nodes if topology.replicas else 0):
        ranks = topology.node_ranks(n)
        group = dist.new_group(ranks, timeout=timeout, backend="gloo") if len(ranks) > 1 else None
        if n == node:
            sync[0] = group
    for n in range(topology.num_nodes if not topology.replicas else 0):
        for s, stage_rank in enumerate(topology.stage_ranks(n)):
            ranks = topology.cpu_ranks(n) + [stage_rank]
            group = dist.new_group(ranks, timeout=timeout, backend="gloo") if len(ranks) > 1 else None
            if n == node and global_rank in ranks:
                sync[s] = group
    replica = None
    if topology.num_nodes > 1:
        for local in range(topology.procs_per_node):
            ranks = [n * topology.procs_per_node + local for n in range(topology.num_nodes)]
            group = dist.new_group(ranks, timeout=timeout, backend="gloo")
            if global_rank in ranks:
                replica = group
    stage_reports = stage_group if topology.replicas and topology.num_stages > 1 else None
    if not topology.replicas and topology.num_nodes == 1 and topology.cpu_workers and topology.num_stages > 1:
        group = dist.new_group(topology.stage_ranks(0), timeout=timeout, backend="gloo")
        stage_reports = group if global_rank in topology.stage_ranks(0) else None
    return ProcessGroups(
        control=control,
        node=node_group,
        stage=stage_group,
        sync=sync,
        replica=replica,
        stage_reports=stage_reports,
        mesh=mesh or (LocalMesh.connect(control, timeout) if topology.num_nodes == 1 else None),
    )


def tied_groups(
    topology: Topology, global_rank: int, process_sets: Sequence[tuple[int, ...]], timeout: timedelta
) -> list[tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]]:
    """For each set of stage processes whose stages share parameters (tied weights), the groups
    their gradients are summed over on this rank's node: those processes with the CPU workers, and
    those processes alone (``None`` for one process: nobody to sum with); ``None`` where this rank
    is not a member (collective: every rank creates every group)."""
    node = global_rank // topology.procs_per_node
    found = []
    for processes in process_sets:
        mine: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None)
        for n in range(topology.num_nodes):
            holders = [topology.stage_ranks(n)[s] for s in processes]
            members = topology.cpu_ranks(n) + holders
            without_cpu = dist.new_group(holders, timeout=timeout, backend="gloo") if len(holders) > 1 else None
            with_cpu = dist.new_group(members, timeout=timeout, backend="gloo") if topology.cpu_workers else without_cpu
            if n == node:
                mine = (with_cpu if global_rank in members else None, without_cpu if global_rank in holders else None)
        found.append(mine)
    return found


def gather_object_to(obj: Any, dst: int, group: dist.ProcessGroup) -> list[Any] | None:
    """Every member's ``obj`` (picklable), in the group's rank order, on global rank ``dst``;
    ``None`` on the others (a collective over ``group``)."""
    parts: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, parts, dst=dst, group=group)
    return parts


def check_every_rank_agrees(
    mine: Any, group: dist.ProcessGroup, rank_name: Callable[[int], str], what: str, advice: str
) -> None:
    """Raise on every rank where some rank's ``mine`` (a mapping of comparable values) differs from global
    rank 0's: processes that each built their own run (popen, torchrun, SLURM, several nodes) from
    commands or scripts that differ. A collective over ``group``, every rank reaching it."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    first = everyone[0]
    for rank, theirs in enumerate(everyone):
        differ = [key for key in first if theirs.get(key) != first[key]] + [key for key in theirs if key not in first]
        if differ:
            key = differ[0]
            raise ValueError(
                f"The processes of this run were started with different {what}: {rank_name(rank)} has {key}"
                f" {theirs.get(key)!r}, global rank 0 {first.get(key)!r}{' (and more)' if len(differ) > 1 else ''}."
                f" {advice}"
            )


def connect(
    environment: Any,
    topology: Topology,
    global_rank: int,
    timeout: timedelta,
    rank_name: str,
    gone: Optional[Callable[[], Optional[str]]] = None,
    mesh: Optional[LocalMesh] = None,
) -> ProcessGroups:
    """Join the run's default process group (in the store of a torchrun restart where there is one,
    ``restart_store``), wait for every rank (``gone``: see ``_all_arrive``) and build every group
    (collective). ``rank_name``: this process, for errors; ``mesh``: an earlier call's, kept."""
    _wait_for_local_ranks(environment.local_rank(), topology.procs_per_node, timeout, gone)
    store = restart_store(timeout)
    try:
        _init_dist_connection(
            environment, world_backend(topology), timeout=timeout, **({"store": store} if store is not None else {})
        )
    except dist.DistError as error:
        if "EADDRINUSE" in str(error) or "address already in use" in str(error).lower():
            error.add_note(
                f"[hetero] On {rank_name}: the run's port (`MASTER_PORT={os.environ.get('MASTER_PORT')}`) is in use,"
                " by another run or by the processes of one that did not end: end it, or set another `MASTER_PORT`."
            )
            raise
        error.add_note(
            f"[hetero] On {rank_name}: not all {topology.world_size} processes of the layout joined"
            f" within the timeout ({timeout.total_seconds():g} s). With `num_nodes={topology.num_nodes}`,"
            " start the same command on every node: torchrun or srun on each, or, with the strategy's own"
            " launch, the script with `NODE_RANK`, `MASTER_ADDR` and `MASTER_PORT` set."
        )
        raise
    atexit.unregister(_leave)
    atexit.register(_leave)
    _all_arrive(topology.world_size, timeout, gone)
    return build_process_groups(topology, global_rank, timeout, mesh)


READY_DIR_ENV = "LIGHTNING_HETERO_READY_DIR"
"""Set by the strategy's own launch (popen) for the processes it starts: a folder where each
notes that it got as far as joining the run (``_wait_for_local_ranks``)."""


def _wait_for_local_ranks(
    local_rank: int, local_ranks: int, timeout: timedelta, gone: Optional[Callable[[], Optional[str]]]
) -> None:
    """Under the strategy's own launch, before the default group is joined: each process it started
    notes that it got here, and the process that started them waits for those notes while watching
    them (``gone``), so that one that failed before joining (an error before ``fit``, in another
    rank's part of the script) ends the run at once with its name, rather than leaving this
    process in torch's rendezvous until the timeout. (A Ctrl+C here ends the wait at once, too.)"""
    folder = os.environ.get(READY_DIR_ENV)
    if folder is None or dist.is_initialized():
        return
    if local_rank != 0:
        Path(folder, str(local_rank)).touch()
        return
    deadline = time.monotonic() + timeout.total_seconds()
    while any(not Path(folder, str(rank)).exists() for rank in range(1, local_ranks)):
        ended = gone() if gone is not None else None
        if ended:
            raise RanksGone(
                f"[hetero] Before joining the run, {ended} (its error is printed above). The other processes"
                " were stopped."
            )
        if time.monotonic() > deadline:
            return  # torch's rendezvous fails with its own timeout error
        time.sleep(0.05)


def record_failure(error: BaseException, where: str) -> None:
    """Note in the run's store that this rank failed, in which order and with what (``where``: the rank,
    for messages), so that global rank 0 can name the first failure where it cannot see the exception
    (popen: the other ranks are other programs). Best effort: a store already gone records nothing."""
    try:
        store = dist.distributed_c10d._get_default_store()
        order = store.add("hetero/failures", 1)
        while error.__cause__ is not None:  # what torch's pipelining wraps, e.g., is the step's own error
            error = error.__cause__
        text = (f"{type(error).__name__}: {error}".splitlines() or [""])[0][:400]
        store.set(f"hetero/failure/{dist.get_rank()}", f"{order}\t{where}\t{text}")
    except Exception:
        pass


def recorded_failures(ranks: Sequence[int]) -> list[tuple[int, str, str]]:
    """The failures ``record_failure`` noted for ``ranks``: (order, the rank, the error), in order."""
    found = []
    try:
        store = dist.distributed_c10d._get_default_store()
        for rank in ranks:
            key = f"hetero/failure/{rank}"
            if store.check([key]):
                order, where, text = store.get(key).decode().split("\t", 2)
                found.append((int(order), where, text))
    except Exception:
        return []
    return sorted(found)


class RanksGone(RuntimeError):
    """A trainer call found ranks of the run ended since the previous one (``connect``)."""


_CALLS = itertools.count()
"""Trainer calls this process has connected for (every rank makes the same calls)."""


def _all_arrive(world_size: int, timeout: timedelta, gone: Optional[Callable[[], Optional[str]]]) -> None:
    """Wait until every rank has reached this trainer call, in the default group's store. Where
    ``gone`` says which ranks have ended (the processes this one started), waiting stops as soon as
    it names one: a rank that left the script after the previous call fails this one at its start,
    instead of leaving the others in a collective until the timeout."""
    call = next(_CALLS)
    store = dist.distributed_c10d._get_default_store()
    if store.add(f"hetero/arrived/{call}", 1) == world_size:
        store.set(f"hetero/all_arrived/{call}", "1")
    deadline = time.monotonic() + timeout.total_seconds()
    poll = timedelta(seconds=0.2) if gone is not None else timeout
    while True:
        try:
            store.wait([f"hetero/all_arrived/{call}"], poll)
            return
        except dist.DistStoreError:
            ended = gone() if gone is not None else None
            if ended:
                raise RanksGone(
                    f"[hetero] This trainer call needs every rank, but since the previous one {ended}. Every rank"
                    " runs the script's trainer calls, as with DDP: code between them that may fail or end on one"
                    " rank belongs under `if trainer.is_global_zero:`. The other ranks were stopped."
                ) from None
            if time.monotonic() > deadline:
                raise


def _leave() -> None:
    """At exit: a process the strategy's own launch started notes when it left (``first_to_leave``),
    in the folder it noted its joining in (a file: the run's store may be gone with rank 0), then
    takes the groups down."""
    folder, local_rank = os.environ.get(READY_DIR_ENV), os.environ.get("LOCAL_RANK", "0")
    if folder is not None and local_rank != "0":
        try:
            Path(folder, f"left.{local_rank}").write_text(str(time.monotonic_ns()))
        except OSError:
            pass
    destroy_process_groups()


def first_to_leave(local_ranks: Sequence[int]) -> Optional[int]:
    """Which of the processes of ``local_ranks`` the strategy's launch started on this node left the
    script first (``_leave``), where any has: one whose leaving failed the others' collectives may
    end after them."""
    folder = os.environ.get(READY_DIR_ENV)
    left = []
    for rank in local_ranks if folder is not None else ():
        try:
            left.append((int(Path(folder, f"left.{rank}").read_text()), rank))
        except (OSError, ValueError):
            continue
    return min(left)[1] if left else None


def destroy_process_groups() -> None:
    """Take every process group down (at exit: a process that exits with gloo groups alive can abort
    in interpreter finalization, "terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def restart_store(timeout: timedelta) -> dist.Store | None:
    """The store a process restarted by torchrun (``--max-restarts``) must rendezvous in: the
    agent's store, under a prefix of this attempt's own; ``None`` where torch's default is right.

    torch 2.13 hands the workers the rendezvous's store (``TORCHELASTIC_USE_AGENT_STORE``) and keeps
    it across restarts without separating the attempts, so a restarted rank can read the address a
    rank of the failed attempt published, and fail to connect to it (pytorch/pytorch#135712; the
    other way round it is ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``). Every node's agent restarts
    its workers in the same rendezvous round, so the restart count names the attempt everywhere.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt == "0":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/hetero/attempt_{attempt}", store)


def pin_to(cores: Sequence[int]) -> None:
    """Run this process on ``cores`` only: every thread it has (torch's pool may exist already), and
    so every thread it starts."""
    global _BEFORE_PINNING
    if _BEFORE_PINNING is None:
        _BEFORE_PINNING = usable_cores()
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else [0]:
        try:
            os.sched_setaffinity(int(task), set(cores))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
