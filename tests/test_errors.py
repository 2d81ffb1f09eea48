"""Bad input gets its own clear error. What the main process can judge (the model, the strategy's
arguments, plan files, the Trainer's flags, DataLoaders passed to `fit` itself) is refused before any
process starts; what only the processes see (a datamodule's batches, the optimizers `setup` builds)
ends the run at the first step, naming the rank. Either way no process is left running."""

from __future__ import annotations

import os
import random
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import lightning as L
from lightning.pytorch.callbacks import BackboneFinetuning, BatchSizeFinder, EMAWeightAveraging, ModelPruning
from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging
from lightning.pytorch.plugins.precision import DoublePrecision
from lightning.pytorch.tuner import Tuner
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hetero import HeteroPlan, HeteroStrategy, PipelineModule
from lightning_hetero.data import peek_batch
from tests.conftest import hetero, max_param_diff, trainer, worker_processes
from tests.models import Net, regression_data


class NoContract(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(6, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NormedNoContract(NoContract):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.InstanceNorm1d(3, track_running_stats=True)


class NoLoss(PipelineModule, L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 3)])

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)


class Variant(Net):
    """`Net` with one thing broken, chosen by name."""

    def __init__(self, broken: str) -> None:
        super().__init__()
        self.broken = broken
        if broken == "orphan":
            self.extra = nn.Parameter(torch.zeros(3))
        if broken == "batchnorm":
            self.layers[1] = nn.BatchNorm1d(16)
        if broken == "manual":
            self.automatic_optimization = False

    def pipeline_layers(self) -> list[nn.Module]:
        if self.broken == "foreign":
            return [nn.Linear(6, 3)]
        return super().pipeline_layers()


class IterStep(Net):
    def training_step(self, dataloader_iter: Any) -> torch.Tensor:  # type: ignore[override]
        return super().training_step(next(dataloader_iter), 0)


class OwnCallbacks(Net):
    """A model that brings its callbacks (``configure_callbacks``), which Lightning adds in each process."""

    def __init__(self, *callbacks: Any) -> None:
        super().__init__()
        self.own = list(callbacks)

    def configure_callbacks(self) -> list:
        return self.own


class OwnDoublePrecision(DoublePrecision):
    """A user's variant of one of Lightning's precision plugins."""


class AutocastInStep(Net):
    """A step that computes the model under an autocast of its own."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = self(x)
        return self.pipeline_loss(out.float(), y)


class CastsInStep(Net):
    """A step that casts the batch (float64, as NumPy gives it) to the model's dtype itself."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = (t.to(self.dtype) for t in batch)
        return self.pipeline_loss(self(x), y)


class NoForward(L.LightningModule):
    """Blocks and a loss, but no `forward`: its step calls the layers itself."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.net)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.pipeline_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class CallsItsLayers(NoForward):
    """A `forward`, which the step does not call: it calls the layers itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class InputGradientInStep(Net):
    """A gradient penalty on the inputs, taken inside the step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x.requires_grad_(True)
        out = self(x)
        (slope,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return self.pipeline_loss(out, y) + slope.pow(2).mean()


class AutocastOff(Net):
    """A step whose autocast is switched off (an option the model offers, off here)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.autocast("cpu", dtype=torch.float16, enabled=False):
            out = self(x)
        return self.pipeline_loss(out, y)


class CallbacksFromTheTrainer(Net):
    """`configure_callbacks` that reads the Trainer, which the model has only in the processes."""

    def configure_callbacks(self) -> list:
        return [ModelCheckpoint(every_n_train_steps=self.trainer.max_steps, dirpath=self.trainer.default_root_dir)]


class LoadsWithoutReturning(Net):
    """A `load_state_dict` of its own that returns nothing (the weights handed back still load)."""

    def load_state_dict(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        super().load_state_dict(*args, **kwargs)


class TwoOptimizers(Net):
    def configure_optimizers(self) -> list:
        first, rest = list(self.parameters())[:2], list(self.parameters())[2:]
        return [torch.optim.SGD(first, lr=0.1), torch.optim.SGD(rest, lr=0.1)]


class Lazy(Net):
    """A layer whose parameters take their shape at the first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[4] = nn.LazyLinear(3)


class GathersInStep(Net):
    """The DDP idiom of gathering a value across processes inside `training_step`."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.all_gather(loss.detach())
        return loss


class CallsStrategyInStep(Net):
    """A collective of the strategy's inside `training_step` (DDP runs it on every process)."""

    def __init__(self, call: str) -> None:
        super().__init__()
        self.call = call

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        strategy = self.trainer.strategy
        {
            "broadcast": lambda: strategy.broadcast(batch_idx),
            "gather": lambda: strategy.gather(batch_idx),  # type: ignore[attr-defined]
            "reduce": lambda: strategy.reduce(torch.tensor(1.0)),
            "barrier": lambda: strategy.barrier(),
        }[self.call]()
        return super().training_step(batch, batch_idx)


class ExtraLoss(Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        return self.pipeline_loss(out, y) + 0.1 * out.abs().mean()


class L2Penalty(Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.pipeline_loss(self(x), y) + 1e-3 * sum(p.pow(2).sum() for p in self.parameters())


class LogsAnotherStagesWeight(Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.log("first_weight", self.layers[0].weight.sum())
        return self.pipeline_loss(self(x), y)


class OwnBackward(Net):
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        (0.5 * loss).backward()


class SparseEmbedding(NoContract):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 3, sparse=True)


class FunctionalSparse(NoContract):
    """Sparse gradients from a functional op on a parameter of its own, not an `nn.Embedding`."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 6, dtype=torch.float64))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[0]
        rows = nn.functional.embedding((x.abs() * 3).long().clamp(max=9)[:, 0], self.table, sparse=True)
        return self.net(x + rows.to(x.dtype)).sum()


class SmallPenaltyInStep(Net):
    """An extra term in `training_step` the stages would not train on, small beside the loss."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        return self.pipeline_loss(out, y) + 2e-5 * out.abs().mean()


class DictHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.linear(h)}


class DictOutput(Net):
    def __init__(self) -> None:
        super().__init__()
        self.layers[5] = DictHead()

    def pipeline_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output["logits"], target)


class ClosureOptimizer(torch.optim.SGD):
    """Evaluates the loss in its step, as sharpness-aware optimizers do."""

    def step(self, closure: Any = None) -> Any:
        loss = closure()
        super().step()
        return loss


class WithClosureOptimizer(Net):
    def configure_optimizers(self) -> Any:
        return ClosureOptimizer(self.parameters(), lr=0.1)


class _ToDict(nn.Module):
    def forward(self, x: torch.Tensor) -> dict:
        return {"hidden": x}


class _FromDict(nn.Module):
    def forward(self, inputs: dict) -> torch.Tensor:
        return inputs["hidden"]


class DictBetweenStages(Net):
    """Two blocks, one a stage, the first handing the second a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Sequential(nn.Linear(6, 16), _ToDict()), nn.Sequential(_FromDict(), nn.Tanh(), nn.Linear(16, 3))]
        )


class ReentrantCheckpoint(NoContract):
    """Uses a layer outside and inside a reentrant activation checkpoint, which runs a backward of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        hidden = self.inner(self.net(batch[0]))
        hidden = torch.utils.checkpoint.checkpoint(self.inner, hidden, use_reentrant=True)
        return nn.functional.mse_loss(hidden, batch[1])


class LossUnderAnotherKey(Net):
    def training_step(self, batch: Any, batch_idx: int) -> dict:
        x, y = batch
        return {"train_loss": self.pipeline_loss(self(x), y)}


class WithLBFGS(Net):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters())


def fit(
    model: Optional[L.LightningModule] = None, strategy: Any = None, data: Any = None, val: Any = None, **kwargs: Any
) -> None:
    strategy = strategy or hetero(cpu_fraction=0.5)
    trainer(strategy, max_steps=1, **kwargs).fit(model or Net(), data if data is not None else regression_data(), val)


def as_python_c(run: Callable[[], Any]) -> Any:
    """``run()`` as under ``python -c`` (no script to run again)."""
    before = sys.argv
    sys.argv = ["-c"]
    try:
        return run()
    finally:
        sys.argv = before


def with_environment(variables: dict[str, str], run: Callable[[], Any]) -> Any:
    """``run()`` with ``variables`` set in the environment (as an earlier run in the process may leave them)."""
    with mock.patch.dict(os.environ, variables):
        return run()


def as_node_zero(run: Callable[[], Any]) -> Any:
    """``run()`` as node 0 of several, started with the strategy's own launch (``NODE_RANK`` set)."""
    return with_environment({"NODE_RANK": "0"}, run)


def plan_file(directory: Path, **changes: Any) -> Path:
    """A plan's YAML file for `Net` on three stages, with ``changes`` written over it."""
    plan = HeteroPlan(stages=["cpu"] * 3, boundaries=[2, 4], micro_batches=3, cpu_fraction=0.25)
    path = directory / "plan.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.merge(OmegaConf.create(plan.to_yaml()), changes)))
    return path


def written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def from_plan(directory: Path, **changes: Any) -> HeteroStrategy:
    return HeteroStrategy(plan=plan_file(directory, **changes), start_method="fork", timeout=20)


def loader(x: torch.Tensor, *rest: torch.Tensor, **kwargs: Any) -> DataLoader:
    return DataLoader(TensorDataset(x, *rest), batch_size=4, **kwargs)


def rows_disagree(items: list) -> tuple:
    """A collate that loses samples of the targets: 4 inputs, 3 targets."""
    x, y = zip(*items)
    return torch.stack(x), torch.stack(y)[:-1]


X, Y = torch.randn(12, 6), torch.randn(12, 3)


@dataclass(frozen=True)
class Bad:
    run: Callable[[Path], Any]
    message: str
    in_run: bool = False
    """Found by the processes, whose error names the rank and its role."""
    rank: str = ""
    """Which rank, where only one can find it (``"global rank 2 (stage1"``)."""


CASES = {
    # The model contract.
    # (A model without blocks trains as replicas: tests/test_replicas.py. Asked for a pipeline, it is refused.)
    "no-layers": Bad(
        lambda _: fit(NoContract(), hetero(cpu_fraction=0.5, parallelism="pipeline")),
        "does not follow the hetero model contract: it has no `pipeline_layers()`",
    ),
    "sparse-gradients": Bad(
        lambda _: fit(SparseEmbedding()), "`SparseEmbedding.embedding` makes sparse gradients (`sparse=True`)"
    ),
    "own-backward-in-a-pipeline": Bad(lambda _: fit(OwnBackward()), "`OwnBackward` overrides `backward`, which a pipeline cannot call"),
    "unknown-parallelism": Bad(lambda _: HeteroStrategy(parallelism="tensor"), "`parallelism='tensor'` must be 'auto'"),
    "tuner-in-forked-processes": Bad(
        lambda p: Tuner(trainer(hetero(), p)).lr_find(Net(), regression_data(), num_training=4),
        "`Tuner(trainer)`'s LearningRateFinder runs in the processes the strategy starts, and with `start_method='fork'`",
    ),
    "batch-size-finder-callback": Bad(
        lambda p: trainer(hetero(), p, callbacks=[BatchSizeFinder(max_trials=2)]).fit(Net(), regression_data()),
        "The `BatchSizeFinder` callback is not supported by the hetero strategy, as Lightning does not support it with DDP",
    ),
    "tuner-scale-batch-size": Bad(
        lambda p: Tuner(trainer(hetero(start_method="popen"), p)).scale_batch_size(Net(), regression_data(), max_trials=2),
        "`Tuner(trainer).scale_batch_size` is not supported by the hetero strategy",
    ),
    "zero-timeout": Bad(lambda _: HeteroStrategy(timeout=0), "`timeout=0`: how long a collective may wait must be positive"),
    "negative-timeout": Bad(lambda _: HeteroStrategy(timeout=timedelta(seconds=-5)), "must be positive"),
    "timeout-of-words": Bad(lambda _: HeteroStrategy(timeout="soon"), "`timeout` must be a `timedelta` or a number"),
    "endless-timeout": Bad(lambda _: HeteroStrategy(timeout=float("inf")), "`timeout` must be a `timedelta` or a number"),
    "instancenorm-stats-in-replicas": Bad(
        lambda _: fit(NormedNoContract()), "contains InstanceNorm1d with running statistics, which the hetero strategy"
    ),
    "no-loss": Bad(lambda _: fit(NoLoss()), "it has no `pipeline_loss()`"),
    "foreign-layer": Bad(lambda _: fit(Variant("foreign")), "is not a submodule of the model"),
    "orphan-parameter": Bad(lambda _: fit(Variant("orphan")), "trainable parameters outside `pipeline_layers()`: extra"),
    "batchnorm-in-a-pipeline": Bad(
        lambda _: fit(Variant("batchnorm")), "contains BatchNorm1d with running statistics, which a pipeline"
    ),
    "more-stages-than-layers": Bad(
        lambda _: fit(strategy=hetero(stages=["cpu"] * 7)), "Cannot cut 6 layer(s) into 7 pipeline stages"
    ),
    # The strategy's arguments.
    "cpu-fraction-above-1": Bad(lambda _: HeteroStrategy(cpu_fraction=1.5), "`cpu_fraction=1.5` must be 'auto' or a number between 0 and 1"),
    "cpu-fraction-negative": Bad(lambda _: HeteroStrategy(cpu_fraction=-0.1), "`cpu_fraction=-0.1` must be 'auto' or a number between 0 and 1"),
    "cpu-fraction-text": Bad(lambda _: HeteroStrategy(cpu_fraction="half"), "`cpu_fraction='half'` must be 'auto' or a number between 0 and 1"),
    "cpu-share-without-cpu-worker": Bad(lambda _: HeteroStrategy(cpu_fraction=0.5, cpu_workers=0), "`cpu_workers=0` starts no CPU worker"),
    "missing-gpu": Bad(lambda _: HeteroStrategy(stages=["cuda:0"]), "is a GPU, but CUDA is not available on this machine"),
    "unknown-device": Bad(lambda _: HeteroStrategy(stages=["cpu", "tpu"]), "Stage device 'tpu' is not a device name"),
    "unsupported-device": Bad(lambda _: HeteroStrategy(stages=["mps"]), "Stage device 'mps' is not supported"),
    "no-stages": Bad(lambda _: HeteroStrategy(stages=0), "a hetero run needs at least one pipeline stage"),
    "stages-text": Bad(lambda _: HeteroStrategy(stages="many"), "`stages='many'` is not understood"),
    "unknown-schedule": Bad(lambda _: HeteroStrategy(schedule="Foo"), "Schedule 'Foo' is not one of torch's pipeline schedules"),
    "multi-stage-schedule-with-one-stage": Bad(
        lambda _: HeteroStrategy(schedule="Interleaved1F1B", stages_per_process=1), "`stages_per_process` must be 2 or more"
    ),
    "too-few-micro-batches": Bad(
        lambda _: HeteroStrategy(schedule="1F1B", stages=["cpu"] * 3, micro_batches=2), "needs at least as many micro-batches"
    ),
    "micro-batches-0": Bad(lambda _: HeteroStrategy(micro_batches=0), "`micro_batches=0` must be an integer >= 1"),
    "cpu-workers-negative": Bad(lambda _: HeteroStrategy(cpu_workers=-1), "`cpu_workers=-1` must be an integer >= 0"),
    "unknown-mode": Bad(lambda _: HeteroStrategy(mode="medium"), "`mode='medium'` is not a hetero mode"),
    "unknown-nonfinite-policy": Bad(lambda _: HeteroStrategy(nonfinite="ignore"), "`nonfinite='ignore'` must be 'error'"),
    "plan-and-arguments": Bad(lambda p: HeteroStrategy(plan=plan_file(p), micro_batches=2), "['micro_batches'] are given beside the plan"),
    # Plan files.
    "plan-layer-count": Bad(
        lambda p: fit(strategy=from_plan(p, boundaries=[2, 9])),
        "Plan: boundaries [2, 9] do not cut the model's 6 layers into 3 non-empty stages in order",
    ),
    "plan-unknown-schedule": Bad(lambda p: from_plan(p, schedule="Foo"), "plan.yaml: Schedule 'Foo' is not one of torch's pipeline schedules"),
    "plan-fraction-out-of-range": Bad(
        lambda p: from_plan(p, cpu_fraction=1.5), "plan.yaml: Plan: `cpu_fraction=1.5` must be between 0 and 1"
    ),
    "plan-device-missing": Bad(
        lambda p: from_plan(p, stages=["cuda:0", "cuda:1", "cuda:2"]),
        "plan.yaml cannot run on this machine: Stage device 'cuda:0' is a GPU, but CUDA is not available",
    ),
    "plan-unknown-key": Bad(lambda p: from_plan(p, pipeline_depth=2), "plan.yaml: Key 'pipeline_depth' not in 'HeteroPlan'"),
    "plan-bucket-size-nan": Bad(lambda p: from_plan(p, bucket_size_mb=float("nan")), "plan.yaml: Plan: `bucket_size_mb=nan` must be a"),
    "plan-file-of-a-list": Bad(
        lambda p: HeteroStrategy(plan=written(p / "plan.yaml", "- cpu\n- cpu\n")), "plan.yaml: it holds no plan. A plan is a mapping"
    ),
    "plan-file-empty": Bad(lambda p: HeteroStrategy(plan=written(p / "plan.yaml", "")), "plan.yaml: it holds no plan"),
    "plan-file-of-a-number": Bad(lambda p: HeteroStrategy(plan=written(p / "plan.yaml", "5\n")), "plan.yaml: Invalid loaded object"),
    "plan-of-a-number": Bad(lambda _: HeteroStrategy(plan=5), "`plan=5` must be a HeteroPlan or the path of a plan file"),
    "bucket-size-inf": Bad(lambda _: HeteroStrategy(bucket_size_mb=float("inf")), "`bucket_size_mb=inf` must be a positive number"),
    # The Trainer's flags, and the model's way of training.
    "precision-16-mixed": Bad(
        lambda _: L.Trainer(strategy="hetero", precision="16-mixed", accelerator="hetero"),
        "float16 mixed precision needs a loss scale agreed between all workers",
    ),
    "manual-optimization": Bad(lambda _: fit(Variant("manual")), "uses manual optimization"),
    "lazy-layers": Bad(lambda _: fit(Lazy()), "`Lazy` has lazy layers whose parameters have no shape until a first forward (layers.4.weight"),
    "lazy-layers-as-replicas": Bad(
        lambda _: fit(Lazy(), hetero(cpu_fraction=0.5, parallelism="replicas")), "`Lazy` has lazy layers whose parameters"
    ),
    "all-gather-in-a-step-method": Bad(
        lambda _: fit(GathersInStep(), hetero(cpu_fraction=0.5, timeout=60)),
        "`self.all_gather` in a step method: under the hetero strategy a step method runs on one worker's share",
        in_run=True,
    ),
    **{
        f"strategy-{call}-in-a-step-method": Bad(
            lambda _, call=call: fit(CallsStrategyInStep(call), hetero(cpu_fraction=0.5, timeout=60)),
            f"`trainer.strategy.{call}` in a step method: under the hetero strategy a step method runs on one worker's share",
            in_run=True,
        )
        for call in ("broadcast", "gather", "reduce", "barrier")
    },
    "dataloader-iter-step": Bad(lambda _: fit(IterStep()), "`IterStep.training_step` must take `(batch, batch_idx)`"),
    # DataLoaders passed to `fit`: a first batch is read in the main process.
    "batches-not-pairs": Bad(
        lambda _: fit(data=loader(X, Y, torch.randn(12)), strategy=hetero(cpu_fraction=0.0)),
        "The train dataloader's first batch: The hetero strategy expects every batch to be a pair `(inputs, targets)`,"
        " but got a list of length 3",
    ),
    "samples-disagree": Bad(
        lambda _: fit(data=loader(X, Y, collate_fn=rows_disagree)),
        "The train dataloader's first batch: The hetero strategy divides every batch between its workers by samples,"
        " along the first dimension of each of its tensors, so every tensor needs one row per sample; this batch holds"
        " tensors of shapes (4, 6), (3, 3)",
    ),
    "weight-averaging-of-a-pipeline": Bad(
        lambda _: fit(callbacks=[StochasticWeightAveraging(swa_lrs=0.01)]),
        "`StochasticWeightAveraging` averages every parameter of the model on every rank, but in a pipeline",
    ),
    "ema-of-a-pipeline": Bad(
        lambda _: fit(callbacks=[EMAWeightAveraging()]),
        "`EMAWeightAveraging` averages every parameter of the model on every rank, but in a pipeline",
    ),
    "pruning-of-a-pipeline": Bad(
        lambda _: fit(callbacks=[ModelPruning("l1_unstructured", amount=0.5)]),
        "`ModelPruning` prunes every parameter of the model on every rank, but in a pipeline",
    ),
    "fine-tuning-of-a-pipeline": Bad(
        lambda _: fit(callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)]),
        "`BackboneFinetuning` unfreezes layers with `BaseFinetuning.unfreeze_and_add_param_group`, which compares",
    ),
    "weight-averaging-of-a-pipeline-from-the-model": Bad(
        lambda _: fit(OwnCallbacks(StochasticWeightAveraging(swa_lrs=0.01))),
        "`StochasticWeightAveraging` averages every parameter of the model on every rank, but in a pipeline",
    ),
    "batch-size-finder-from-the-model": Bad(
        lambda _: fit(OwnCallbacks(BatchSizeFinder(max_trials=2)), strategy=hetero(cpu_fraction=0.5, parallelism="replicas")),
        "The `BatchSizeFinder` callback is not supported by the hetero strategy",
    ),
    "a-checkpoint-path-that-is-not-there": Bad(
        lambda tmp: trainer(hetero(cpu_fraction=0.5), max_steps=1).fit(Net(), regression_data(), ckpt_path=tmp / "no.ckpt"),
        "Checkpoint file not found: ",
    ),
    "a-checkpoint-path-to-validate-that-is-not-there": Bad(
        lambda tmp: trainer(hetero(cpu_fraction=0.5)).validate(Net(), regression_data(), ckpt_path=str(tmp / "no.ckpt")),
        "Checkpoint file not found: ",
    ),
    "several-nodes-without-a-launch": Bad(
        lambda _: fit(num_nodes=2), "`num_nodes=2` needs this script started on every node: under torchrun or srun"
    ),
    "training-loaders-of-different-batch-sizes": Bad(
        lambda _: fit(data={"a": loader(X, Y), "b": DataLoader(TensorDataset(X[:10], Y[:10]), batch_size=4)}),
        "The training dataloaders give batches of different sizes in one step ('a': batches of 4, the last of 4, 'b':"
        " batches of 4, the last of 2)",
    ),
    "val-samples-disagree": Bad(
        lambda _: fit(val=loader(X, Y, collate_fn=rows_disagree)),
        "The val dataloader's first batch: The hetero strategy divides every batch",
    ),
    "shuffled-evaluation-data": Bad(
        lambda _: fit(val=loader(X, Y, shuffle=True)),
        "The val dataloader's RandomSampler draws from the global random generator",
    ),
    # What only the processes see: a datamodule's batches, the optimizers, the processes that join.
    "datamodule-batches-not-pairs": Bad(
        lambda _: fit(data=L.LightningDataModule.from_datasets(TensorDataset(X, Y, torch.randn(12)), batch_size=4)),
        "expects every batch to be a pair `(inputs, targets)`, but got a list of length 3",
        in_run=True,
    ),
    "precision-plugin-of-ones-own": Bad(
        lambda _: trainer(hetero(), plugins=[OwnDoublePrecision()], precision=None),
        "The hetero strategy runs precision plugins of its own, one for each of Lightning's (Precision, DoublePrecision,"
        " HalfPrecision, MixedPrecision), and `OwnDoublePrecision` is none of them",
    ),
    "autocast-in-the-step-of-a-pipeline": Bad(
        lambda _: fit(AutocastInStep(), hetero(cpu_fraction=0.5, timeout=60), precision="32-true"),
        "`AutocastInStep.training_step` calls the model under `torch.autocast` of its own (bfloat16 on cpu, where the"
        " Trainer's precision computes no autocast), but a pipeline's stages compute its blocks outside the step method",
        in_run=True,
        rank="global rank 2 (stage1",
    ),
    "a-cast-in-the-step-of-a-pipeline": Bad(
        lambda _: fit(CastsInStep(), hetero(cpu_fraction=0.5, timeout=60), loader(X.double(), Y.double()), precision="32-true"),
        "The pipeline's first stage took `pipeline_inputs(batch)` as ['torch.float64'], and the model's weights are"
        " ['torch.float32']: the stages compute the blocks on the batch as the loader gives it, outside `training_step`",
        in_run=True,
        rank="global rank 1 (stage0",
    ),
    "a-pipeline-model-without-forward": Bad(
        lambda _: fit(NoForward()),
        "`NoForward` has no `forward`: a pipeline's last stage runs your step methods with `self(inputs)` answered",
    ),
    "a-step-that-calls-the-layers-itself": Bad(
        lambda _: fit(CallsItsLayers(), hetero(cpu_fraction=0.5, timeout=60)),
        "`CallsItsLayers.training_step` ran on the pipeline's last stage, where `self(inputs)` gives the pipeline's"
        " output, and computed with layers this stage does not hold",
        in_run=True,
        rank="global rank 2 (stage1",
    ),
    "a-gradient-taken-inside-the-step-of-a-pipeline": Bad(
        lambda _: fit(InputGradientInStep(), hetero(cpu_fraction=0.5, timeout=60)),
        "`InputGradientInStep.training_step` ran on the pipeline's last stage, where `self(inputs)` gives the"
        " pipeline's output, computed on the stages: it carries no graph back to the inputs or the layers",
        in_run=True,
        rank="global rank 2 (stage1",
    ),
    "sparse-gradients-of-a-functional-op": Bad(
        lambda _: fit(FunctionalSparse(), hetero(cpu_fraction=0.5, timeout=60)),
        "A parameter of shape (10, 6) received a sparse gradient (`F.embedding(..., sparse=True)` or another op that"
        " makes one), which the hetero strategy does not sum between its workers",
        in_run=True,
    ),
    "a-small-extra-term-in-the-step-of-a-pipeline": Bad(
        lambda _: fit(SmallPenaltyInStep(), hetero(cpu_fraction=0.5, timeout=60)),
        "`SmallPenaltyInStep.training_step` returned a loss of",
        in_run=True,
        rank="global rank 2 (stage1",
    ),
    "a-dict-from-the-last-block-of-a-pipeline": Bad(
        lambda _: fit(DictOutput(), hetero(cpu_fraction=0.5, timeout=60)),
        "The model's last block (DictHead) returned a dict, which torch's pipelining cannot hand to `pipeline_loss`",
        in_run=True,
    ),
    "two-optimizers": Bad(
        lambda _: fit(TwoOptimizers(), hetero(cpu_fraction=0.5, timeout=60)),
        "[hetero] The hetero strategy trains with automatic optimization, one optimizer: give each part of the model a"
        " parameter group of its own in one optimizer instead",
        in_run=True,
    ),
    "loss-other-than-pipeline-loss": Bad(
        lambda _: fit(ExtraLoss()),
        "`training_step` must return exactly that loss",
        in_run=True,
        rank="global rank 2 (stage1",  # the last stage replays the step on the pipeline's outputs
    ),
    "a-dict-without-the-loss": Bad(
        lambda _: fit(LossUnderAnotherKey(), strategy=hetero(cpu_fraction=0.5, parallelism="replicas")),
        "`training_step` returned a dict with no 'loss' key (keys: ['train_loss'])",
        in_run=True,
    ),
    "popen-under-python-c": Bad(
        lambda _: as_python_c(lambda: HeteroStrategy(start_method="popen")),
        "`python -c` (or code read from the standard input) has no script to run: use `start_method='fork'` or `'spawn'`",
    ),
    "lbfgs": Bad(lambda _: fit(WithLBFGS()), "LBFGS re-evaluates the loss inside `optimizer.step`", in_run=True),
    "a-dict-between-stages": Bad(
        lambda _: fit(DictBetweenStages()),
        "A pipeline block (Sequential, the last of its stage) returned a dict, which a stage cannot send to the next",
        in_run=True,
        rank="global rank 1 (stage0",
    ),
    "reentrant-checkpoint-in-fine-mode": Bad(
        lambda _: fit(ReentrantCheckpoint(), strategy=hetero(cpu_fraction=0.5, mode="fine", bucket_size_mb=1e-5)),
        "or a reentrant activation checkpoint (`torch.utils.checkpoint(..., use_reentrant=True)`",
        in_run=True,
    ),
    "penalty-over-other-stages-parameters": Bad(
        lambda _: fit(L2Penalty()),
        "returned a loss computed from layers this pipeline stage does not hold",
        in_run=True,
        rank="global rank 2 (stage1",
    ),
    "a-logged-value-from-other-stages-layers": Bad(
        lambda _: fit(LogsAnotherStagesWeight()),
        "`self.log('first_weight', ...)` logs a value computed from layers this pipeline stage does not hold",
        in_run=True,
        rank="global rank 2 (stage1",
    ),
    "optimizer-step-calls-its-closure-in-fine-mode": Bad(
        lambda _: fit(WithClosureOptimizer(), strategy=hetero(mode="fine")),
        "`ClosureOptimizer.step` calls its closure (it evaluates the loss again), which fine mode cannot give it",
        in_run=True,
    ),
    "an-environment-left-by-deepspeed": Bad(
        lambda _: with_environment({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}, fit),
        "needs 3 processes, but the launcher started 1. Start 3 processes per node",
    ),
    "a-node-never-starts": Bad(
        lambda _: as_node_zero(lambda: fit(strategy=hetero(timeout=2), num_nodes=2)),
        "not all 6 processes of the layout joined within the timeout (2 s). With `num_nodes=2`, start the same"
        " command on every node",
        in_run=True,
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_input_gets_its_own_clear_error(case: Bad, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not case.in_run:
        import torch.multiprocessing as mp

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("worker processes were started before the bad input was reported")

        monkeypatch.setattr(mp, "start_processes", refuse)
    with pytest.raises(Exception) as error:
        case.run(tmp_path)
    text = "\n".join([str(error.value), *getattr(error.value, "__notes__", [])])
    assert case.message in text
    if case.in_run:
        assert re.search(r"global rank \d \((cpu|stage|replica)\d of 1 CPU worker\(s\) \+ 2 (stage|replica)\(s\)", text)
        assert case.rank in text
    assert worker_processes() == [], "a worker process was left running"


def test_a_pipeline_of_gpu_and_cpu_stages_is_refused_before_any_process_starts(
    no_processes: None, one_gpu: None
) -> None:
    """On a machine with a GPU, `stages=["cuda:0", "cpu"]` would put a CPU process in the stages' NCCL
    group: refused, pointing to a CPU worker. The same stages holding replicas
    (`parallelism="replicas"`) are not a pipeline, and pass this check."""
    strategy = hetero(stages=["cuda:0", "cpu"], cpu_fraction=0.5)
    with pytest.raises(ValueError, match=r"puts GPU and CPU stages in one pipeline.*as a CPU worker \(`cpu_workers`"):
        trainer(strategy, max_steps=1).fit(Net(), regression_data())
    replicas = hetero(stages=["cuda:0", "cpu"], cpu_fraction=0.5, parallelism="replicas")
    assert len(replicas.plan.place_blocks(Net())[1]) == 1  # one piece: the whole model


class LazyFile(torch.utils.data.Dataset):
    """Opens its "file" on first use, as datasets over h5py or memory-mapped files do, and draws an
    augmentation from the global generators."""

    def __init__(self) -> None:
        self.handle: Optional[object] = None

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.handle is None:
            self.handle = object()
        random.random()
        np.random.rand()
        return torch.randn(3), torch.tensor(index)


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_peeked_batch_moves_no_generator_and_opens_nothing(shuffle: bool) -> None:
    dataset = LazyFile()
    generator = torch.Generator().manual_seed(3)
    loader = DataLoader(dataset, batch_size=4, shuffle=shuffle, generator=generator if shuffle else None)
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy(), generator.get_state())
    batch = peek_batch(loader)
    assert batch[0].shape == (4, 3) and batch[1].tolist() == [0, 1, 2, 3]
    assert torch.equal(states[0], torch.get_rng_state()) and states[1] == random.getstate()
    assert (states[2] == np.random.get_state()[1]).all() and torch.equal(states[3], generator.get_state())
    assert dataset.handle is None, "the peek opened the dataset's file in the main process"


def test_a_batch_that_cannot_be_read_beforehand_is_left_to_the_processes() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self) -> Any:
            raise AssertionError("the stream was consumed before the run")

    class Broken(LazyFile):
        def __getitem__(self, index: int) -> Any:
            raise OSError("only readable in a worker")

    assert peek_batch(DataLoader(Stream(), batch_size=4)) is None
    assert peek_batch(DataLoader(Broken(), batch_size=4)) is None
    assert peek_batch(DataLoader(LazyFile(), batch_size=None))[0].shape == (3,)


class DictBatches(Net):
    """Batches of dicts, made into `(inputs, targets)` by a batch-transfer hook."""

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch["x"], batch["y"]


@pytest.mark.parametrize(
    "case",
    [
        lambda: fit(DictBatches(), data=DataLoader([{"x": x, "y": y} for x, y in zip(X, Y)], batch_size=4)),
        lambda: fit(val=loader(X, Y, shuffle=True), limit_val_batches=0),
        lambda: fit(callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)], strategy=hetero(parallelism="replicas")),
        lambda: fit(OwnCallbacks(StochasticWeightAveraging(swa_lrs=0.01)), strategy=hetero(parallelism="replicas")),
    ],
    ids=["reshaped-by-a-hook", "validation-off", "fine-tuning-of-replicas", "weight-averaging-of-replicas-from-the-model"],
)
def test_what_the_processes_would_accept_is_not_refused_beforehand(case: Callable[[], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.multiprocessing as mp

    class Started(Exception):
        pass

    def started(*args: Any, **kwargs: Any) -> None:
        raise Started

    monkeypatch.setattr(mp, "start_processes", started)
    with pytest.raises(Started):
        case()


@pytest.mark.parametrize(
    "model", [AutocastOff, CallbacksFromTheTrainer, LoadsWithoutReturning], ids=["autocast-off", "callbacks-from-the-trainer", "load-returns-nothing"]
)
def test_what_looks_like_a_refused_case_trains(model: type, tmp_path: Path) -> None:
    trained = model()
    fit(trained, default_root_dir=str(tmp_path))
    assert max_param_diff(trained, model()) > 0  # the trained weights came back


def test_time_first_sequences_are_named_before_any_process_starts(no_processes: None) -> None:
    """An LSTM's default layout is (time, batch, features): the strategy would divide each batch along
    time. Said in a warning (rows that are each a sample of their own are divided correctly)."""
    sequences = torch.randn(20, 7, 6, dtype=torch.float64)  # 20 samples of 7 steps
    targets = torch.randn(20, 7, dtype=torch.float64)  # a target per step, as a language model's
    time_first = DataLoader(TensorDataset(sequences, targets), batch_size=4,
                            collate_fn=lambda items: tuple(torch.stack(parts, 1) for parts in zip(*items)))
    expected = r"collates 4 samples into a first batch whose tensors have 7 rows .* `batch_first=True`"
    with pytest.warns(UserWarning, match=expected), pytest.raises(AssertionError, match="worker processes were started"):
        trainer(hetero(cpu_fraction=0.5), max_steps=1).fit(NoContract(), time_first)
    batch_first = DataLoader(TensorDataset(sequences.flatten(1), torch.randn(20, 3, dtype=torch.float64)), batch_size=8)
    with warnings.catch_warnings(record=True) as record, pytest.raises(AssertionError, match="worker processes were started"):
        warnings.simplefilter("always")
        trainer(hetero(cpu_fraction=0.5), max_steps=1).fit(NoContract(), batch_first)
    assert not any("rows along their first dimension" in str(w.message) for w in record)


def test_a_port_in_use_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's port held by another (or by the ranks of one that did not end) is not a timeout."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        monkeypatch.setenv("MASTER_PORT", str(held.getsockname()[1]))
        with pytest.raises(Exception) as error:
            fit(strategy=hetero(cpu_fraction=0.5, timeout=10))
    text = "\n".join([str(error.value), *getattr(error.value, "__notes__", [])])
    assert "is in use, by another run or by the processes of one that did not end" in text
    assert "joined within the timeout" not in text


class CarriesState(NoContract):
    """A state per sample carried from one batch to the next, as a recurrent model's hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.carried: Optional[torch.Tensor] = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        hidden = self.net(batch[0] if self.carried is None else batch[0] + self.carried.sum(1, keepdim=True))
        self.carried = hidden.detach()
        return hidden.sum()


class MovesTheShare(L.Callback):
    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 2:  # every rank alike, as the rebalancer sets it
            trainer.strategy.set_cpu_fraction(0.25)


def test_a_step_that_fails_as_the_share_moves_says_it_moved(tmp_path: Path) -> None:
    """State carried per sample between batches breaks where the CPU's share moves (docs/limits.md);
    the model's own error says nothing of shares, so the strategy adds it."""
    with pytest.raises(Exception) as error:
        trainer(hetero(cpu_fraction=0.5, parallelism="replicas", stages=["cpu"], timeout=60), max_steps=4,
                callbacks=[MovesTheShare()], default_root_dir=str(tmp_path)).fit(CarriesState(), loader(X, Y))
    text = "\n".join([str(error.value), *getattr(error.value, "__notes__", [])])
    assert re.search(r"This rank.s share of the batch changed at this step, from 2 to [13] of 4 samples", text), text[-3000:]
    assert "give it a fixed `cpu_fraction`" in text and worker_processes() == []


def test_a_checkpoint_path_is_looked_for_as_lightning_looks_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`~` is the user's home, as Lightning's checkpoint IO reads it; a CheckpointIO of one's own may
    read a path as it likes, and is left to."""
    from lightning.fabric.plugins import TorchCheckpointIO

    from lightning_hetero.launcher import _check_checkpoint_path

    def fit_impl(model: Any = None, ckpt_path: Any = None) -> None: ...

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "x.ckpt").write_bytes(b"")
    _check_checkpoint_path(fit_impl, (None, "~/x.ckpt"), {}, TorchCheckpointIO())
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found: ~/y.ckpt"):
        _check_checkpoint_path(fit_impl, (None,), {"ckpt_path": "~/y.ckpt"}, TorchCheckpointIO())

    class Elsewhere(TorchCheckpointIO):
        def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> Any:
            return super().load_checkpoint(f"{path}.elsewhere", *args, **kwargs)

    _check_checkpoint_path(fit_impl, (None, "~/y.ckpt"), {}, Elsewhere())
