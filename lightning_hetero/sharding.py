"""The optimizer state the CPU workers hold, split between them, ZeRO-style: fine mode's offloaded
buckets and coarse mode's replicas.

[Note: a sharded bucket step]
In fine mode every rank that holds an offloaded bucket steps it with a fused CPU optimizer, so with
N CPU workers the bucket's fp32 master weights and optimizer state exist N + 1 times (each CPU
worker's, and the stage's in its host memory), and N + 1 processes do the same step. With two or
more CPU workers (one per socket: ``numa.py``) they share the work instead, as ZeRO stage 1/2
shares it between data-parallel ranks:

1. each of the bucket's parameters has one *owner*, a CPU worker (``owners``: whole parameters,
   the largest first to the least loaded worker, so each owns about 1/N of the bucket; the same
   on every rank);
2. the gradients of each owner's parameters are reduced to it alone, over the stage and the CPU
   workers (``sync.OwnerSums``: ZeRO stage 2's reduce, one per owner, where an all-reduce would
   send every sum to every process); the others are dropped. Where the steps wait for the global
   norm (clipping by norm, ``nonfinite="skip"``), the bucket is all-reduced as any other instead:
   the norm is taken from the stage's summed gradients;
3. the owner steps its parameters with its part of the optimizer state, in its own memory (its
   socket's, where it is pinned);
4. every owner in turn broadcasts its updated parameters to the bucket's other ranks (the stage,
   the other CPU workers), over a group of their own, so that every copy of every parameter is
   the same again.

The stage holds no optimizer state for the bucket, and each CPU worker 1/N of it. The optimizer's
hyperparameters and learning-rate schedule are the user's, as for any bucket step. A checkpoint
holds the whole optimizer state as a single process has it: the owners' parts are gathered to
global rank 0 when it is saved (``gather_sharded_state``), and every rank takes its own part when
one is loaded, so a run resumes with any number of CPU workers.

[Note: a sharded coarse step]
In coarse mode every rank steps its own optimizer after the sum: the stages their blocks' on their
devices, and each CPU worker its whole replica's, on the CPU. With two or more CPU workers they split
their replicas' step the same way (``ShardedOptimizer``): each owns about 1/N of the parameters
(``owners`` over the module's parameters), keeps their optimizer state and steps them; the others'
gradients are dropped once Lightning has clipped them (so ``on_before_optimizer_step`` sees every
gradient), and after the step each owner broadcasts its parameters to the other CPU workers. The
stages step as before. A CPU worker kept out of a step (no share of it) is brought up to date from
the stages as before, the whole state, and drops the others' part at its next step.

With several nodes, ``shard_across_nodes=True`` makes the CPU workers of every node the owners, so
each holds 1/(N x nodes) of the state: ZeRO across the data-parallel replicas. In fine mode each
owner's gradients are reduced to it from every node and averaged over them; in coarse mode the sums
still reach every rank (an all-reduce, which the stages need for their own steps), and only the
optimizer state and its step are split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_hetero.offload import OffloadStep, param_index
from lightning_hetero.topology import gather_object_to

__all__ = ["Sharding", "ShardedStep", "ShardedOptimizer", "owners", "gather_sharded_state"]


@dataclass(frozen=True)
class Sharding:
    """How this rank takes part in the CPU workers' split optimizer: the global ranks of the CPU workers
    that own its parts (its node's, or every node's), which of them this rank is (``None`` on a stage
    or device), by stage the group a sharded bucket's updated parameters are broadcast over (the
    stage's sync group, a group of its own; fine mode), and the owners' own group (coarse mode)."""

    cpu_ranks: tuple[int, ...]
    me: Optional[int]
    groups: dict[int, Optional[dist.ProcessGroup]]
    workers: Optional[dist.ProcessGroup] = None
    sums: dict[int, Optional[dist.ProcessGroup]] = field(default_factory=dict)
    """By stage, the same ranks as ``groups`` in a group of their own, over which a sharded bucket's
    gradients are reduced to their owners (on the sum thread, while the step thread broadcasts)."""
    nodes: int = 1
    """The nodes whose CPU workers are the owners (``shard_across_nodes``), over which the reduced
    gradients are averaged."""


def owners(params: Sequence[nn.Parameter], workers: int) -> list[int]:
    """Each parameter's owning CPU worker: the largest first, each to the worker owning the fewest
    elements so far (ties: the lower index); the same on every rank."""
    load = [0] * workers
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        w = min(range(workers), key=lambda k: (load[k], k))
        owner[i] = w
        load[w] += params[i].numel()
    return owner


class ShardedStep(OffloadStep):
    """An offloaded bucket whose masters and optimizer state are split between the CPU workers (see
    the module's note). ``params`` (and what the offloaded step holds) are this rank's own;
    ``bucket_params`` every parameter of the bucket."""

    def __init__(
        self, optimizer: Optimizer, params: Sequence[nn.Parameter], index: dict, sharding: Sharding, stage: int
    ) -> None:
        # Owners over every parameter of the bucket, whether the optimizer has it yet or not: a parameter
        # group added while fine-tuning (the steps built again) moves no parameter to another owner.
        owner = dict(zip(params, owners(list(params), len(sharding.cpu_ranks))))
        bucket = [p for p in params if p in index]
        super().__init__(optimizer, [p for p in bucket if owner[p] == sharding.me], index)
        self.bucket_params = bucket
        self.others = [p for p in bucket if owner[p] != sharding.me]
        self.by_owner = [[p for p in bucket if owner[p] == w] for w in range(len(sharding.cpu_ranks))]
        self.sharding = sharding
        self.group = sharding.groups[stage]
        self.sums_group = sharding.sums.get(stage)

    def grad_holders(self) -> list[Tensor]:
        # Every gradient of the bucket this rank holds: clipping by norm scales them all alike.
        return [*super().grad_holders(), *self.others]

    def step(self) -> None:
        for p in self.others:
            p.grad = None
        super().step()
        share_updated(self.by_owner, self.sharding, self.group)


class ShardedOptimizer:
    """Coarse mode, on a CPU worker: its optimizer steps only the parameters this worker owns, and
    the owners share what they stepped (see the module's note). ``params``: the replica's parameters
    (owners over all of them, whether the optimizer has them yet or not)."""

    def __init__(self, params: Sequence[nn.Parameter], sharding: Sharding) -> None:
        owner = owners(list(params), len(sharding.cpu_ranks))
        self.mine = {p for p, o in zip(params, owner) if o == sharding.me}
        self.by_owner = [[p for p, o in zip(params, owner) if o == w] for w in range(len(sharding.cpu_ranks))]
        self.sharding = sharding

    def before_update(self, optimizer: Optimizer) -> None:
        """After the gradients are clipped, before the optimizer reads them: the others' parameters are
        not this worker's to step, and their state (after a refresh or a load) not its to hold."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p not in self.mine:
                    p.grad = None
                    optimizer.state.pop(p, None)

    def after_update(self, optimizer: Optimizer) -> None:
        """After the optimizer step: every owner's parameters on every CPU worker (those the optimizer
        trains: a frozen parameter changes nowhere)."""
        trained = {p for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        by_owner = [[p for p in params if p in trained] for params in self.by_owner]
        share_updated(by_owner, self.sharding, self.sharding.workers)

    def state(self, optimizer: Optimizer) -> dict[nn.Parameter, Any]:
        """This worker's part of the optimizer state."""
        return {p: s for p, s in optimizer.state.items() if p in self.mine}


def share_updated(by_owner: Sequence[Sequence[nn.Parameter]], sharding: Sharding, group: Optional[dist.ProcessGroup]) -> None:
    """Each owner's updated parameters (``by_owner[w]``: CPU worker ``w``'s) on every rank of ``group``:
    one broadcast per owner and dtype, in the same order on every rank."""
    with torch.no_grad():
        for owner, params in enumerate(by_owner):
            by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
            for p in params:
                by_dtype.setdefault(p.dtype, []).append(p)
            for dtype in sorted(by_dtype, key=str):
                _broadcast(by_dtype[dtype], sharding.cpu_ranks[owner], owner == sharding.me, dtype, group)


def _broadcast(params: list[nn.Parameter], src: int, mine: bool, dtype: torch.dtype, group: Optional[dist.ProcessGroup]) -> None:
    if mine:
        flat = torch.cat([p.detach().reshape(-1).cpu() for p in params])
    else:
        flat = torch.empty(sum(p.numel() for p in params), dtype=dtype)
    dist.broadcast(flat, src, group=group)
    if not mine:
        offset = 0
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def gather_sharded_state(
    optimizer: Optimizer, mine: dict[nn.Parameter, Any], state_dict: dict[str, Any], group: dist.ProcessGroup
) -> dict[str, Any]:
    """``state_dict`` (this rank's optimizer state) with every CPU worker's part of the split state
    (``mine``: this rank's, by parameter), on global rank 0 (a collective over ``group``, every rank)."""
    index = param_index(optimizer)
    parts = gather_object_to({index[p][1]: s for p, s in mine.items()}, 0, group)
    if parts is None:
        return state_dict
    for part in parts:
        state_dict["state"].update(part)
    state_dict["state"] = dict(sorted(state_dict["state"].items()))
    return state_dict
