"""A long run does not leak: every rank's resident memory and open file descriptors, after a
warm-up and at the end of thousands of steps.

1 CPU worker + 2 emulated stages train a small MLP for ``--steps`` steps over many short epochs,
with what a long run does along the way: a torchmetrics metric logged every step (its value for
the whole batch made from the workers' shares, as the recipes' are), a checkpoint (and ``last.ckpt``) every
``--checkpoint-every`` steps, written atomically and the previous one removed, and a CSV log.
Every rank measures itself (psutil) at step ``--warmup`` and every ``--every`` steps after; rank 0
gathers the measurements and prints, per rank, memory at the start, the middle and the end, its
growth (the goal: under 5%) over the run and over its second half, descriptors at the start and
the end, and the run's time.

    python -m benchmarks.soak [--steps 5000] [--warmup 200] [--every 250] [--checkpoint-every 500]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import psutil
import torch
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from benchmarks.common import MLP, synthetic_loader
from lightning_hetero import HeteroStrategy


class MeteredMLP(MLP):
    """The MLP, logging its mean absolute error every step through a torchmetrics metric."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.train_mae = torchmetrics.MeanAbsoluteError()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        output = self(inputs)
        self.train_mae(output, targets)
        self.log("train_mae", self.train_mae)
        return self.pipeline_loss(output, targets)


class Usage(L.Callback):
    """Each rank's resident memory (MiB) and open descriptors at step ``warmup``, every ``every``
    steps after it, and at the end; rank 0 writes every rank's series to ``out`` (JSON)."""

    def __init__(self, out: Path, warmup: int, every: int) -> None:
        self.out, self.warmup, self.every = out, warmup, every
        self.series: list[tuple[int, float, int]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step >= self.warmup and (step - self.warmup) % self.every == 0:
            self._measure(step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._measure(trainer.global_step)
        gathered = trainer.strategy.gather((trainer.strategy.device_names[trainer.global_rank], self.series), dst=0)
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps(gathered))

    def _measure(self, step: int) -> None:
        process = psutil.Process()
        self.series.append((step, process.memory_info().rss / 2**20, process.num_fds()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--checkpoint-every", type=int, default=500)
    parser.add_argument("--batches-per-epoch", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "usage.json"
        # forkserver: the workers must not be forked from a process that has run torch work.
        strategy = HeteroStrategy(stages=["cpu", "cpu"], micro_batches=2, cpu_fraction=0.5, start_method="forkserver")
        checkpoints = ModelCheckpoint(dirpath=Path(tmp) / "ckpt", every_n_train_steps=args.checkpoint_every, save_last=True)
        trainer = L.Trainer(
            strategy=strategy,
            max_steps=args.steps,
            callbacks=[Usage(out, min(args.warmup, args.steps), args.every), checkpoints],
            logger=CSVLogger(tmp, name="soak"),
            log_every_n_steps=50,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        start = time.monotonic()
        trainer.fit(MeteredMLP(width=64, depth=4, features=16), synthetic_loader(32 * args.batches_per_epoch, 32, features=16))
        elapsed = time.monotonic() - start
        report(json.loads(out.read_text()))
        print(f"{args.steps} steps in {elapsed:.0f} s ({1e3 * elapsed / args.steps:.1f} ms per step, start included)")


def report(gathered: list[tuple[str, list[tuple[int, float, int]]]]) -> None:
    """Per rank: memory at the first, middle and last measurement and its growth over the whole run
    and over its second half (a leak keeps growing; a warming cache does not), and descriptors."""
    print(f"{'rank':10s} {'steps':>10s} {'RSS start':>10s} {'RSS mid':>8s} {'RSS end':>8s} {'growth':>7s}"
          f" {'2nd half':>8s} {'fds':>9s}")
    for rank, (name, series) in enumerate(gathered):
        (first, rss0, fds0), (_, rss_mid, _), (last, rss1, fds1) = series[0], series[len(series) // 2], series[-1]
        print(
            f"{rank} {name:8s} {first:>4d}-{last:<5d} {rss0:8.1f}Mi {rss_mid:6.1f}Mi {rss1:6.1f}Mi"
            f" {100 * (rss1 / rss0 - 1):+6.2f}% {100 * (rss1 / rss_mid - 1):+7.2f}% {fds0:>4d}->{fds1:<4d}"
        )

if __name__ == "__main__":
    main()
