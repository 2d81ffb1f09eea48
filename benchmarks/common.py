"""Shared pieces of the benchmarks: a step timer, a synthetic model, and side-by-side alternation.

The machines these run on are shared VMs whose speed drifts by tens of percent, so a benchmark
never compares numbers from different runs: it alternates the configurations it compares inside
one run, repeats them, and reports medians and ratios.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hetero import PipelineModule
from lightning_hetero.topology import pin_to


@dataclass
class Row:
    """One line of the benchmark table: a ratio measured side by side in one run."""

    benchmark: str
    configuration: str
    ratio: float
    goal: str = ""
    note: str = ""


def send_rows(benchmark: str, smoke: bool, send: Connection) -> None:
    """Run ``benchmarks.<benchmark>.rows`` and send what it returns (the target of the entry
    command's process per benchmark)."""
    send.send(importlib.import_module(f"benchmarks.{benchmark}").rows(smoke=smoke))


class StepTimer(L.Callback):
    """Wall time of each training iteration (batch end to batch end) on global rank 0, written as JSON."""

    def __init__(self, out: Path, warmup: int = 3) -> None:
        self.out, self.warmup = out, warmup
        self.times: list[float] = []
        self._last: float | None = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        if self._last is not None and trainer.global_step > self.warmup:
            self.times.append(now - self._last)
        self._last = now

    def on_fit_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps(self.times))


class MLP(PipelineModule, L.LightningModule):
    """`depth` blocks of Linear+Tanh, a regression head; big enough that compute dominates a step."""

    def __init__(self, width: int = 512, depth: int = 6, features: int = 64, fused_adam: bool = False) -> None:
        super().__init__()
        self.fused_adam = fused_adam
        torch.manual_seed(0)
        blocks: list[nn.Module] = [nn.Linear(features, width)]
        for _ in range(depth - 2):
            blocks += [nn.Tanh(), nn.Linear(width, width)]
        blocks += [nn.Tanh(), nn.Linear(width, 1)]
        self.layers = nn.ModuleList(blocks)

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=self.fused_adam or None)


class CNN(PipelineModule, L.LightningModule):
    """A small convolutional classifier on ``size`` x ``size`` images (digits-like at 8)."""

    def __init__(self, channels: int = 64, size: int = 16, classes: int = 10) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            [
                nn.Conv2d(1, channels, 3, padding=1),
                nn.ReLU(),
                nn.Conv2d(channels, channels, 3, padding=1),
                nn.ReLU(),
                nn.Conv2d(channels, 2 * channels, 3, padding=1, stride=2),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(2 * channels * (size // 2) ** 2, classes),
            ]
        )

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def image_loader(samples: int, batch_size: int, size: int = 16, classes: int = 10) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    images = torch.randn(samples, 1, size, size, generator=g)
    data = TensorDataset(images, torch.randint(0, classes, (samples,), generator=g))
    return DataLoader(data, batch_size=batch_size, drop_last=True)


def synthetic_loader(samples: int, batch_size: int, features: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(samples, features, generator=g), torch.randn(samples, 1, generator=g))
    return DataLoader(data, batch_size=batch_size, drop_last=True)


def step_times(
    strategy: Any,
    model: L.LightningModule,
    loader: DataLoader,
    steps: int,
    callbacks: list | None = None,
    logger: Any = False,
    **trainer_kwargs: Any,
) -> list[float]:
    """Train ``steps`` steps and return the per-step wall times after warm-up."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        kwargs: dict[str, Any] = {"strategy": strategy} if strategy is not None else {"accelerator": "cpu", "devices": 1}
        kwargs.update(trainer_kwargs)
        trainer = L.Trainer(
            max_steps=steps,
            callbacks=[StepTimer(out), *(callbacks or [])],
            logger=logger,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **kwargs,
        )
        trainer.fit(model, loader)
        return json.loads(out.read_text())


def pin_rank(rank: int, processes: int) -> None:
    """Keep process ``rank`` of a run of ``processes`` on a core of its own, every thread it has and
    starts, where the machine has a core for each (otherwise leave it to the OS). On two cores, two
    pipeline processes that the OS moves between them ran 15% slower, and one run's median step
    varied from the next's by up to 30%; kept one to a core, by up to 10%."""
    cores = sorted(os.sched_getaffinity(0))
    if processes <= len(cores):
        pin_to([cores[rank]])


class OneCorePerRank(L.Callback):
    """Pins each rank of a strategy's run to a core of its own (``pin_rank``) from Lightning's
    ``setup`` hook on, as a loop by hand pins its processes, so the two are compared alike."""

    def __init__(self, processes: int) -> None:
        self.processes = processes

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        pin_rank(trainer.global_rank, self.processes)


def interleave_runs(configs: dict[str, Callable[[], list[float]]], repeats: int) -> dict[str, list[list[float]]]:
    """Run every configuration ``repeats`` times, interleaved, every other repeat in the reverse order
    (so none always runs first, or right after the same one); return each one's step times, run by run."""
    runs: dict[str, list[list[float]]] = {name: [] for name in configs}
    for repeat in range(repeats):
        for name, run in list(configs.items())[:: -1 if repeat % 2 else 1]:
            runs[name].append(run())
    return runs


def interleave(configs: dict[str, Callable[[], list[float]]], repeats: int) -> dict[str, list[float]]:
    """Run every configuration ``repeats`` times, interleaved; return each one's step times."""
    return {name: [t for run in runs for t in run] for name, runs in interleave_runs(configs, repeats).items()}


@dataclass
class PairedRatio:
    """A ratio of two configurations' step times taken run by run (``paired_ratio``): the median of
    the repeats' ratios, and their range."""

    median: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.median:.3f} (repeats {self.low:.3f}-{self.high:.3f})"


def paired_ratio(numerator: list[list[float]], denominator: list[list[float]]) -> PairedRatio:
    """``numerator`` over ``denominator``, each repeat's median step over the other's in the same
    repeat (run next to it, so a drift of the machine's speed between repeats cancels), then the
    median of those ratios. On a shared two-core VM one run's median moves from the next's by up
    to 30% (10% with one core per process, ``pin_rank``); the repeats' ratios show how far a ratio
    can be trusted."""
    ratios = [statistics.median(a) / statistics.median(b) for a, b in zip(numerator, denominator, strict=True)]
    return PairedRatio(statistics.median(ratios), min(ratios), max(ratios))


def alternate(configs: dict[str, Callable[[], list[float]]], repeats: int) -> dict[str, float]:
    """Run every configuration ``repeats`` times, interleaved; return each one's median step time."""
    return {name: statistics.median(times) for name, times in interleave(configs, repeats).items()}
