"""Every rank of a node iterates the same batches in the same order, and takes its share of each.

The user's DataLoader is kept as it is wherever its order cannot differ between processes (a
sequential sampler, or a ``RandomSampler`` with its own generator, which every process copies),
so a hetero run sees exactly the batches a single-process run sees. A ``RandomSampler`` without
a generator draws from each process's global RNG, which the workers consume differently (dropout
on the CPU worker, none on a middle stage); it is replaced by a ``DistributedSampler`` that
shuffles from a shared seed. With several nodes, the nodes split the data as in DDP.
"""

from __future__ import annotations

from typing import Optional

from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DataLoader, RandomSampler

__all__ = ["same_batches_on_every_rank"]


def same_batches_on_every_rank(
    dataloader: object, *, num_nodes: int, node_rank: int, overfit_batches: float, stage: Optional[RunningStage]
) -> object:
    """Return a loader that yields the same batches on every rank of this node (see module doc)."""
    if not isinstance(dataloader, DataLoader):
        return dataloader
    sampler = dataloader.sampler
    if dataloader.batch_sampler is not None and hasattr(dataloader.batch_sampler, "sampler"):
        sampler = dataloader.batch_sampler.sampler
    shuffled = isinstance(sampler, RandomSampler)
    if num_nodes == 1 and not (shuffled and sampler.generator is None):
        return dataloader
    mode = RunningStage.PREDICTING if stage == RunningStage.PREDICTING else None
    replacement = _get_distributed_sampler(
        dataloader, shuffled, overfit_batches=overfit_batches, mode=mode, num_replicas=num_nodes, rank=node_rank
    )
    return _update_dataloader(dataloader, replacement, mode=mode)
