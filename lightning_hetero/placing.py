"""Placing this rank's part of the model, and the step engine around it.

Once per process, when the strategy sets up, after the model's own ``setup`` and the plan: the
plan's blocks are cut at its bounds, this rank's role takes its part (``workers.py``), with the
groups its tied weights and BatchNorm layers need, and the step engine (``engine.py``) runs it;
when the run fits, the role builds the gradient sync of the plan's mode (``sync.py``).
"""

from __future__ import annotations

from datetime import timedelta
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch.optim import Optimizer

from lightning_hetero.batchnorm import ReplicaNorm, has_batch_norm
from lightning_hetero.engine import StepEngine
from lightning_hetero.finite import NonfinitePolicy
from lightning_hetero.module import tied_parameters
from lightning_hetero.multimodal import EncoderExchange, encoder_stages, modality_encoders, modality_rows, offers_modalities
from lightning_hetero.pipeline import resolve_schedule
from lightning_hetero.plan import HeteroPlan
from lightning_hetero.record import Recorder
from lightning_hetero.results import ReportExchange, relog
from lightning_hetero.sharding import Sharding
from lightning_hetero.shares import Shares
from lightning_hetero.sync import GlobalNorm, GradSync
from lightning_hetero.topology import ProcessGroups, Topology, tied_groups
from lightning_hetero.workers import ROLES, Placement, Tied

__all__ = ["place_rank", "build_sync", "replica_norm", "encoder_exchange", "sharding_of"]


def place_rank(
    module: LightningModule,
    plan: HeteroPlan,
    topology: Topology,
    groups: ProcessGroups,
    *,
    node_rank: int,
    local_rank: int,
    device: torch.device,
    timeout: timedelta,
    nonfinite: NonfinitePolicy,
    whole_batch_norm: bool,
) -> StepEngine:
    """Cut ``module`` by ``plan`` and place this rank's part on ``device``; its step engine.
    Collective: every rank of every node creates the same groups (tied weights, BatchNorm)."""
    global_rank = node_rank * topology.procs_per_node + local_rank
    role = topology.role(local_rank)
    layers, bounds = plan.place_blocks(module)
    owner = plan.stage_holders()
    tied = tied_parameters(layers, bounds)
    # Tied weights are summed between the processes that hold their stages (one, where a process
    # holds all of them: its backward adds their uses up, as one process's does).
    processes = [tuple(sorted({owner[s] for s in stages})) for stages, _ in tied]
    sums = tied_groups(topology, global_rank, processes, timeout)
    tied_sums = [Tied(stages, params, *pair) for (stages, params), pair in zip(tied, sums)]
    schedule = resolve_schedule(plan.schedule, topology.num_stages, plan.micro_batches, plan.stages_per_process)
    if len(bounds) > topology.num_stages:
        # Several stages per process: each stage is summed over its process's sync group.
        sync, ranks = [groups.sync[o] for o in owner], [topology.stage_ranks(node_rank)[o] for o in owner]
        placement = Placement(layers, bounds, sync, ranks, tied_sums, holders=owner)
    else:
        placement = Placement(layers, bounds, groups.sync, topology.stage_ranks(node_rank), tied_sums)
    worker = ROLES[role.kind].place(module, placement, role.index, device=device, group=groups.stage, schedule=schedule)
    if plan.parallelism == "replicas" and has_batch_norm(module):
        worker.norm = replica_norm(module, topology, whole_batch_norm, timeout)
    if offers_modalities(module):
        worker.encoders = encoder_exchange(module, topology, placement, node_rank, local_rank, device, timeout)
        worker.encoders.set_placement(plan.encoders)
    owners = topology.cpu_workers * (topology.num_nodes if plan.shard_across_nodes else 1)
    if plan.shard_cpu_optimizer and owners >= 2:
        worker.sharding = sharding_of(topology, node_rank, local_rank, plan.mode, plan.shard_across_nodes, timeout)
    return StepEngine(
        worker=worker,
        exchange=ReportExchange(
            groups.control,
            mesh=groups.mesh,
            cpu_workers=topology.cpu_workers if topology.num_nodes == 1 else 0,
            stages=groups.stage_reports,
        ),
        log=partial(relog, module, device=device),
        names=topology.device_names(),
        cpu_workers=topology.cpu_workers,
        nonfinite=nonfinite,
        device=device,
        recorder=Recorder(global_rank, str(role), device),
        outputs=(groups.node, topology.node_ranks(node_rank)[0]),
    )


def build_sync(
    engine: StepEngine, plan: HeteroPlan, topology: Topology, groups: ProcessGroups, optimizer: Optimizer, skip: bool
) -> GradSync:
    """The gradient sync of ``plan.mode`` for this rank's worker (``skip``: ``nonfinite="skip"``)."""
    worker = engine.worker
    return worker.build_sync(
        plan.mode,
        norm=GlobalNorm(worker.norm_slot, worker.placement.num_processes, topology.num_nodes, groups.control, groups.mesh),
        replica_group=groups.replica,
        optimizer=optimizer,
        bucket_bytes=int(plan.bucket_size_mb * 2**20),
        offload=plan.offload,
        control=groups.control,
        skip_nonfinite=skip,
        sharding=worker.sharding,
        mesh=groups.mesh,
    )


def sharding_of(
    topology: Topology, node_rank: int, local_rank: int, mode: str, across_nodes: bool, timeout: timedelta
) -> Sharding:
    """How this rank takes part in the CPU workers' optimizer state split between them (``sharding.py``):
    the owners' ranks (its node's CPU workers, or with ``across_nodes`` every node's), which of them it
    is, per stage a group of the stage's sync group's ranks (every node's with ``across_nodes``) for
    the updated parameters of fine mode's buckets and another for their gradients, or the owners'
    group for coarse mode's. Collective: every rank creates every group of ``mode``."""
    global_rank = node_rank * topology.procs_per_node + local_rank
    sets = [[n] for n in range(topology.num_nodes)] if not across_nodes else [list(range(topology.num_nodes))]
    mine = next(nodes for nodes in sets if node_rank in nodes)
    groups: dict[int, Optional[dist.ProcessGroup]] = {}
    sums: dict[int, Optional[dist.ProcessGroup]] = {}
    workers = None
    for nodes in sets:
        cpus = [r for n in nodes for r in topology.cpu_ranks(n)]
        if topology.replicas:
            members = [(0, [r for n in nodes for r in topology.node_ranks(n)])]
        else:
            members = [(s, [*cpus, *(topology.stage_ranks(n)[s] for n in nodes)]) for s in range(topology.num_stages)]
        # Groups of their own: the broadcasts run on the step thread, the reduces on the sum thread,
        # beside the sync groups' sums.
        for stage, ranks in members if mode == "fine" else ():
            for found in (groups, sums):
                group = dist.new_group(sorted(ranks), backend="gloo", timeout=timeout)
                if nodes is mine and global_rank in ranks:
                    found[stage] = group
        if mode == "coarse":
            group = dist.new_group(cpus, backend="gloo", timeout=timeout)
            if nodes is mine:
                workers = group
    role = topology.role(local_rank)
    cpu_ranks = tuple(r for n in mine for r in topology.cpu_ranks(n))
    me = cpu_ranks.index(global_rank) if role.is_cpu_worker else None
    return Sharding(cpu_ranks, me, groups, workers if role.is_cpu_worker else None, sums, nodes=len(mine))


def replica_norm(module: LightningModule, topology: Topology, whole: bool, timeout: timedelta) -> ReplicaNorm:
    """What replicas of a model with BatchNorm layers do about their statistics: per share, or over
    the whole batch (``whole``: ``Trainer(sync_batchnorm=True)``; ``batchnorm.py``). Collective:
    every rank creates every group."""
    cpus, devices = topology.cpu_workers, topology.num_stages

    def group(ranks: list[int] | None = None) -> dist.ProcessGroup:
        # Groups of their own: the step's other collectives may run beside these (fine mode's
        # bucket sums on a side thread).
        return dist.new_group(ranks, backend="gloo", timeout=timeout)

    everyone = group()

    def of_shares(key: tuple[tuple[bool, ...], tuple[bool, ...]]) -> dist.ProcessGroup:
        # Every node's batch is split alike, so the replicas with a share are the same on every node:
        # the statistics are the whole global batch's, as DDP's SyncBatchNorm takes them. A node's
        # ranks are its CPU workers', then its devices'.
        has = [*key[0], *key[1]]
        return group([r for node in range(topology.num_nodes) for i, r in enumerate(topology.node_ranks(node)) if has[i]])

    # The groups of a batch every replica has a share of, and of a CPU share of 0 or 1, made now; a
    # batch too small for every replica makes its own when it comes (`ReplicaNorm.before`).
    keys = [((True,) * cpus, (True,) * devices)]
    if devices * topology.num_nodes > 1:
        keys.append(((False,) * cpus, (True,) * devices))
    if cpus * topology.num_nodes > 1:
        keys.append(((True,) * cpus, (False,) * devices))
    groups = {key: of_shares(key) for key in keys} if whole else {}
    rows_of = partial(modality_rows, module)
    return ReplicaNorm(module, whole, groups, devices, everyone, topology.num_nodes, of_shares, modality_encoders(module), rows_of)


def encoder_exchange(
    module: LightningModule,
    topology: Topology,
    placement: Placement,
    node_rank: int,
    local_rank: int,
    device: torch.device,
    timeout: timedelta,
) -> EncoderExchange:
    """This rank's part in a multimodal model's placed encoders (``multimodal.py``): every process of its
    node by place (``cpu0``, ``device1``), the samples each computes of a batch, and in a pipeline the
    encoders each stage calls (those in its blocks). Collective: every rank creates every node's group."""
    cpus, devices = topology.cpu_workers, topology.num_stages
    places = [f"cpu{i}" for i in range(cpus)] + [f"device{j}" for j in range(devices)]
    group = None
    for node in range(topology.num_nodes):
        # A group of its own: these sends run beside the step's other collectives.
        created = dist.new_group(topology.node_ranks(node), backend="gloo", timeout=timeout)
        if node == node_rank:
            group = created
    assert group is not None

    def cpu(index: int, shares: Shares) -> tuple[int, int]:
        return shares.cpu[index]

    def device_part(index: int, shares: Shares) -> tuple[int, int]:
        return shares.device_part(index, devices) if topology.replicas else shares.pipeline

    ranges = [(f"cpu{i}", partial(cpu, i)) for i in range(cpus)]
    ranges += [(f"device{j}", partial(device_part, j)) for j in range(devices)]
    hosts = dict(zip(places, topology.node_ranks(node_rank)))
    consumes = None
    if not topology.replicas and devices > 1:
        encoders = modality_encoders(module)
        stages = encoder_stages(module, dict.fromkeys(encoders, ""), placement.layers, placement.bounds, strict=False)
        consumes = {f"device{s}": {m for m, at in stages.items() if placement.holder(at) == s} for s in range(devices)}
    return EncoderExchange(module, hosts, ranges, places[local_rank], group, device, consumes)
