"""Every rank of a node iterates the same batches in the same order, and takes its share of each.

The user's DataLoader is kept as it is wherever its order cannot differ between processes (a
sequential sampler, a ``RandomSampler`` with its own generator, which every process copies, or
the ``DistributedSampler`` Lightning injects to split the data between nodes). A random sampler
without a generator (``RandomSampler``, ``SubsetRandomSampler``, ``WeightedRandomSampler``) draws
from each process's global RNG, which the workers consume differently (dropout on the CPU worker,
none on a middle stage): in a training loader a ``RandomSampler`` is replaced by a
``DistributedSampler`` that shuffles from the shared seed (``seed_everything``'s, or 0), as
Lightning's DDP does, and the others draw from a generator of that seed and the epoch (also
inside the wrapper Lightning gives them with several nodes); in an evaluation loader
it is an error, since its order could not be kept. (A sampler of your own that draws from the
global RNG cannot be told apart: give it a generator.)

DataLoaders handed to the trainer's method itself (``trainer.fit(model, loader)``) are checked in
the main process before any process starts (``check_before_launch``): their order, and the shape
of a first batch read without moving the global random generators (unless the model reshapes
batches in a batch-transfer hook). Loaders from a datamodule or a ``*_dataloader()`` hook exist
only once each process has set them up; their batches are checked at the first step, and the
error names the rank.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler

import lightning.pytorch as pl

from lightning_hetero.module import pipeline_pair
from lightning_hetero.shares import batch_size_of

__all__ = ["same_batches_on_every_rank", "sampler_of", "rebuilt", "with_workers", "check_before_launch", "peek_batch", "training_loader"]

_BATCH_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")

_STAGES = {
    TrainerFn.VALIDATING: RunningStage.VALIDATING,
    TrainerFn.TESTING: RunningStage.TESTING,
    TrainerFn.PREDICTING: RunningStage.PREDICTING,
}


def same_batches_on_every_rank(
    dataloader: object, stage: Optional[RunningStage], epoch: int = 0, keep_sampler: bool = False
) -> object:
    """Return a loader that yields the same batches on every rank of this node (see module doc);
    ``epoch``: the epoch it starts in (a sampler given a generator here draws from seed and epoch);
    ``keep_sampler``: the Trainer's ``use_distributed_sampler=False``, which a sampler drawing from the
    global random generator cannot be kept under (said in a warning)."""
    if not isinstance(dataloader, DataLoader):
        return dataloader
    sampler = sampler_of(dataloader)
    if isinstance(sampler, DistributedSamplerWrapper):  # several nodes: Lightning's split of the user's sampler
        sampler = sampler.dataset._sampler
    if getattr(sampler, "generator", False) is not None:  # its own generator, or none needed
        return dataloader
    if stage != RunningStage.TRAINING:
        raise ValueError(
            f"The {stage.dataloader_prefix if stage else 'evaluation'} dataloader's {type(sampler).__name__} draws"
            " from the global random generator, which the hetero strategy's processes do not share, so they would"
            " not see the same batches. Use `shuffle=False`, or give the sampler (or the DataLoader) a"
            " `generator=torch.Generator().manual_seed(...)`."
        )
    if keep_sampler:
        rank_zero_warn(
            f"`Trainer(use_distributed_sampler=False)` keeps each process's own sampler, but the training loader's"
            f" {type(sampler).__name__} draws from the global random generator, which the hetero strategy's processes"
            " do not share (what each draws from it while training differs), and every process must see the same"
            " batches: the strategy gives it a generator of the seed and the epoch all the same. To keep an order of"
            " your own, give the sampler (or the DataLoader) a `generator=torch.Generator().manual_seed(...)`.",
        )
    if isinstance(sampler, RandomSampler):
        replacement = _get_distributed_sampler(dataloader, True, overfit_batches=0, num_replicas=1, rank=0)
        return rebuilt(dataloader, replacement)
    # SubsetRandomSampler, WeightedRandomSampler, ...: a generator of the shared seed and the epoch,
    # the same in every process (a loader made again each epoch draws anew each epoch).
    sampler.generator = torch.Generator().manual_seed(int(os.getenv("PL_GLOBAL_SEED", 0)) * 1_000_003 + epoch)
    return dataloader


def sampler_of(dataloader: DataLoader) -> Any:
    """The sampler that orders a loader's samples: its batch sampler's, where that has one."""
    batches = dataloader.batch_sampler
    return batches.sampler if batches is not None and hasattr(batches, "sampler") else dataloader.sampler


def training_loader(trainer: "pl.Trainer") -> Any:
    """The training loader a fit will iterate, as the user gave it (to ``fit``, or by a datamodule's or
    the module's ``train_dataloader()``), before Lightning has set it up: from a ``setup`` hook on."""
    return trainer.fit_loop._data_source.dataloader()


_LOADERS = {
    "training_step": "train_dataloader",
    "validation_step": "val_dataloaders",
    "test_step": "test_dataloaders",
    "predict_step": "predict_dataloaders",
}


def loader_batch_size(trainer: "pl.Trainer", method: str, index: int = 0) -> Optional[int]:
    """The ``batch_size`` of the loader whose batches ``method`` runs on (the ``index``-th of several;
    the first of a list of training loaders, which share one), where it names one (not where a batch
    sampler of the user's, or a dict of training loaders, make the batches)."""
    loaders = getattr(trainer, _LOADERS[method], None)
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[index] if index < len(loaders) else None
    size = getattr(loaders, "batch_size", None)
    return size if isinstance(size, int) else None


def with_workers(dataloader: object, workers: int) -> object:
    """The same loader with ``workers`` worker processes (a plan's split of the CPU's cores)."""
    if not isinstance(dataloader, DataLoader) or dataloader.num_workers == workers:
        return dataloader
    if workers == 0:
        return rebuilt(dataloader, num_workers=0, persistent_workers=False, prefetch_factor=None)
    return rebuilt(dataloader, num_workers=workers)


def rebuilt(dataloader: DataLoader, sampler: Optional[Sampler] = None, **changes: Any) -> DataLoader:
    """The same loader with another sampler, or other settings (``changes``). A ``BatchSampler``
    given as ``batch_sampler=`` is kept, over the new sampler (Lightning's re-instantiation, made for
    its own samplers, drops it, and the loader would yield single samples)."""
    given = dataloader.batch_sampler
    own_batches = type(given) is BatchSampler and dataloader.batch_size is None
    if sampler is None:
        sampler = given.sampler if own_batches else dataloader.sampler
    args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, sampler)
    if own_batches:
        batches = BatchSampler(sampler, batch_size=given.batch_size, drop_last=given.drop_last)
        kwargs.update(batch_sampler=batches, sampler=None, batch_size=1, shuffle=False, drop_last=False)
    kwargs.update(changes)
    return _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)


def check_before_launch(
    trainer: "pl.Trainer", model: "pl.LightningModule", args: Sequence[Any], pairs: bool = True
) -> None:
    """Check the DataLoaders among ``args`` (the trainer method's arguments as Lightning hands them to
    the launcher: the model, then the loaders) as every process would at its first batch; ``pairs``:
    the training batches must give the first block's inputs and the loss's target (a pipeline's:
    ``pipeline_inputs``). Skipped where the model reshapes its batches in a batch-transfer hook (the
    processes see the result), and for a validation loader the fit will not use."""
    if any(is_overridden(hook, model) for hook in _BATCH_HOOKS):
        return
    fn = trainer.state.fn
    if fn == TrainerFn.FITTING:
        loaders = [(RunningStage.TRAINING, args[1] if len(args) > 1 else None)]
        if is_overridden("validation_step", model) and trainer.limit_val_batches != 0:
            loaders.append((RunningStage.VALIDATING, args[2] if len(args) > 2 else None))
    elif fn in _STAGES:
        loaders = [(_STAGES[fn], args[1] if len(args) > 1 else None)]
    else:
        return
    for stage, loader in loaders:
        if stage == RunningStage.TRAINING and isinstance(loader, (Mapping, list, tuple)):
            _check_combined(dict(loader) if isinstance(loader, Mapping) else dict(enumerate(loader)))
        if not isinstance(loader, DataLoader):
            continue  # a datamodule, several loaders, or nothing: checked in the processes
        if stage != RunningStage.TRAINING:
            same_batches_on_every_rank(loader, stage)
        batch = peek_batch(loader)
        if batch is None:
            continue
        try:
            rows = batch_size_of(batch)
            if stage == RunningStage.TRAINING and pairs:
                pipeline_pair(model, batch)
        except (TypeError, ValueError) as error:
            raise type(error)(f"The {stage.dataloader_prefix} dataloader's first batch: {error}") from None
        samples = min(loader.batch_size, len(loader.dataset)) if loader.batch_size else None
        if samples is not None and rows != samples:
            rank_zero_warn(
                f"The {stage.dataloader_prefix} dataloader collates {samples} samples into a first batch whose tensors"
                f" have {rows} rows along their first dimension, where the hetero strategy divides every batch between"
                " its workers. If that dimension is not the samples' (sequences time first, for an `nn.LSTM`, `nn.GRU`"
                " or `nn.Transformer` without `batch_first=True`), each worker computes a slice of it, and the model"
                " trained is not one process's: put the samples first. Rows that are each a sample of their own"
                " (tokens flattened with their targets) are divided as they should be."
            )


def _check_combined(loaders: Mapping[Any, Any]) -> None:
    """Several training DataLoaders (a dict or list of them), which Lightning combines so that every step
    takes a batch of each, cycling the shorter ones: each step's batch is divided between the workers by
    samples, so all of a step's batches must hold as many. Refused where they would not: different batch
    sizes, or a short last batch of one beside a full batch of another."""
    sized = {
        name: loader
        for name, loader in loaders.items()
        if isinstance(loader, DataLoader) and loader.batch_size and not isinstance(loader.dataset, IterableDataset)
        and hasattr(loader.dataset, "__len__") and len(loader.dataset) and len(loader)
    }
    if len(sized) < 2 or len(sized) != len(loaders):
        return
    sizes = {name: loader.batch_size for name, loader in sized.items()}
    last = {
        name: loader.batch_size if loader.drop_last else len(loader.dataset) - (len(loader) - 1) * loader.batch_size
        for name, loader in sized.items()
    }
    lengths = {len(loader) for loader in sized.values()}
    uneven = len(set(sizes.values())) > 1 or (
        any(last[name] != sizes[name] for name in sized) and (len(lengths) > 1 or len(set(last.values())) > 1)
    )
    if uneven:
        described = ", ".join(f"{name!r}: batches of {sizes[name]}, the last of {last[name]}" for name in sized)
        raise ValueError(
            f"The training dataloaders give batches of different sizes in one step ({described}). Every step takes"
            " a batch of each, and the hetero strategy divides a step's batch between its workers by samples, so"
            " they must hold as many: give them one `batch_size`, and `drop_last=True` where a dataset's length"
            " does not divide by it."
        )


def peek_batch(loader: DataLoader) -> Optional[Any]:
    """A batch collated as ``loader`` collates its first one, read in this process with every random
    generator put back as it was, from a shallow copy of the dataset (so that a file a dataset opens
    on first use is not opened here and inherited by the processes). ``None`` where that cannot be
    done without consuming data: an iterable dataset, a custom batch sampler, or a dataset that
    cannot be read here (the processes report its error themselves)."""
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset) or (loader.batch_size is None and loader.batch_sampler is not None):
        return None
    states, threads = _collect_rng_states(include_cuda=False), torch.get_num_threads()
    # One thread: a parallel torch op here would start OpenMP's thread pool in a process about to fork.
    torch.set_num_threads(1)
    try:
        dataset = copy.copy(dataset)
        if loader.batch_size is None:  # automatic batching off: every item is a batch
            return loader.collate_fn(dataset[0])
        return loader.collate_fn([dataset[i] for i in range(min(loader.batch_size, len(dataset)))])
    except Exception:
        return None
    finally:
        torch.set_num_threads(threads)
        _set_rng_states(states)
