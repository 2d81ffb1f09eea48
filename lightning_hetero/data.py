"""Every rank of a node iterates the same batches in the same order, and takes its share of each.

The user's DataLoader is kept as it is wherever its order cannot differ between processes (a
sequential sampler, a ``RandomSampler`` with its own generator, which every process copies, or
the ``DistributedSampler`` Lightning injects to split the data between nodes). A ``RandomSampler``
without a generator draws from each process's global RNG, which the workers consume differently
(dropout on the CPU worker, none on a middle stage): a training loader's is replaced by a
``DistributedSampler`` that shuffles from the shared seed (``seed_everything``'s, or 0), as
Lightning's DDP does; an evaluation loader's is an error, since its order could not be kept.
"""

from __future__ import annotations

from typing import Optional

from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
from lightning.pytorch.trainer.states import RunningStage
from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs, _update_dataloader
from torch.utils.data import DataLoader, RandomSampler

__all__ = ["same_batches_on_every_rank", "with_workers"]


def same_batches_on_every_rank(dataloader: object, stage: Optional[RunningStage]) -> object:
    """Return a loader that yields the same batches on every rank of this node (see module doc)."""
    if not isinstance(dataloader, DataLoader):
        return dataloader
    sampler = dataloader.sampler
    if dataloader.batch_sampler is not None and hasattr(dataloader.batch_sampler, "sampler"):
        sampler = dataloader.batch_sampler.sampler
    if not isinstance(sampler, RandomSampler) or sampler.generator is not None:
        return dataloader
    if stage != RunningStage.TRAINING:
        raise ValueError(
            f"The {stage.dataloader_prefix if stage else 'evaluation'} dataloader shuffles with the global random"
            " generator, which the hetero strategy's processes do not share, so they would not see the same"
            " batches. Use `shuffle=False`, or pass the DataLoader a `generator=torch.Generator().manual_seed(...)`."
        )
    replacement = _get_distributed_sampler(dataloader, True, overfit_batches=0, num_replicas=1, rank=0)
    return _update_dataloader(dataloader, replacement)


def with_workers(dataloader: object, workers: int) -> object:
    """The same loader with ``workers`` worker processes (a plan's split of the CPU's cores)."""
    if not isinstance(dataloader, DataLoader) or dataloader.num_workers == workers:
        return dataloader
    args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, dataloader.sampler)
    kwargs["num_workers"] = workers
    if workers == 0:
        kwargs["persistent_workers"] = False
        kwargs["prefetch_factor"] = None
    return _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)
