"""The CPU's cores as one budget: the user's default loader vs the planned split vs the runtime re-split.

The MLP recipe on augmented digits (``recipes.mlp``, ``augment: true``, 28x28 images: every
training image is resampled under a random affine transform on every read), on one emulated stage
(``emulated_speed``: the stage's process sleeps out a GPU's step, as a process driving a GPU
leaves its core idle), alone and with a CPU worker beside it (which computes on the cores the
loaders want). Halfway through each run the augmentation gets
heavier (``passes`` transforms per image from the second half's first epoch): a stall starts. In
one run, alternating, repeated:

- *default*: the user's DataLoader as built (``num_workers=0``; ``dataloader_workers="keep"``),
  the rest of the workload analyzer's plan as in the others;
- *planned*: the workload analyzer's split of the cores (loader workers and CPU-worker threads
  from its measurements of the DataLoader before training), kept for the whole run;
- *re-split*: the same plan, and the rebalancer re-splitting the cores when the stall starts
  (``AdaptiveRebalancer(balance_loading=True)``: more loader workers from the next epoch, fewer
  CPU-worker threads at once).

Every run has the rebalancer for the CPU fraction (as ``cpu_fraction="auto"`` gives every run).
Reported: the median step time of each half, as ratios.

    python -m benchmarks.loading [--epochs E] [--batches B] [--repeats R] [--passes P]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks.common import Row
from lightning_hetero import HeteroStrategy
from lightning_hetero.callbacks import AdaptiveRebalancer, WorkloadAnalyzer
from recipes.mlp import DigitsData, DigitsMLP

DEFAULTS = dict(epochs=8, batches=10, repeats=2, passes=4, stage_speed=5000.0, cpu_workers=[0, 1])
SIZE = 28


class Phases(L.Callback):
    """From epoch ``heavy_from`` on, ``passes`` augmentation passes per image (on every rank, before
    the epoch's loader starts its workers); global rank 0 writes each step's wall time and the
    loader workers of each epoch."""

    def __init__(self, heavy_from: int, passes: int, out: Path) -> None:
        self.heavy_from, self.passes, self.out = heavy_from, passes, out
        self.times: list[tuple[int, float]] = []
        self.workers: list[int] = []
        self.fractions: list[float] = []
        self._last: float | None = None

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.train_dataloader.dataset.passes = self.passes if trainer.current_epoch >= self.heavy_from else 1
        self._last = None  # the epoch boundary (validation, starting workers) is not a step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.workers.append(trainer.train_dataloader.num_workers)
            self.fractions.append(trainer.strategy.cpu_fraction)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.times.append((trainer.current_epoch, now - self._last))
        self._last = now

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            rebalancer = next(cb for cb in trainer.callbacks if isinstance(cb, AdaptiveRebalancer))
            record = {"times": self.times, "workers": self.workers, "fractions": self.fractions}
            self.out.write_text(json.dumps({**record, "decisions": rebalancer.decisions}))


def run(kind: str, cpu_workers: int, epochs: int, batches: int, passes: int, stage_speed: float) -> dict[str, Any]:
    """One run of ``kind`` (default, planned, re-split): each half's step times and the workers per epoch."""
    policy = "keep" if kind == "default" else "auto"
    strategy = HeteroStrategy(
        stages=["cpu"],
        cpu_workers=cpu_workers,
        cpu_fraction="auto" if cpu_workers else 0.0,
        start_method="fork",
        emulated_speed={"pipeline": stage_speed},
        dataloader_workers=policy,
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        callbacks: list[L.Callback] = [
            Phases(epochs // 2, passes, out),
            AdaptiveRebalancer(every_n_steps=5, warmup_steps=1, balance_loading=kind == "re-split", verbose=False),
        ]
        callbacks.append(WorkloadAnalyzer(repeats=1, warmup_steps=2, measure_steps=1, save_dir=tmp))
        trainer = L.Trainer(
            strategy=strategy,
            max_epochs=epochs,
            limit_train_batches=batches,
            limit_val_batches=0,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(DigitsMLP(in_features=SIZE * SIZE), DigitsData(augment=True, image_size=SIZE))
        record = json.loads(out.read_text())
    half = epochs // 2
    light = [t for epoch, t in record["times"] if 0 < epoch < half]  # the first epoch plans and warms up
    heavy = [t for epoch, t in record["times"] if epoch > half]  # the stall's first epoch is the one it is detected in
    return {"light": light, "heavy": heavy, **{key: record[key] for key in ("workers", "fractions", "decisions")}}


KINDS = ("default", "planned", "re-split")


def measure(
    epochs: int, batches: int, repeats: int, passes: int, stage_speed: float, cpu_workers: list[int]
) -> dict[int, dict[str, Any]]:
    """Per number of CPU workers: each configuration's median step time in each half, and its loader
    workers per epoch."""
    torch.set_num_threads(1)  # this process only launches; keep it fork-safe (see launcher.py)
    results = {}
    for workers in cpu_workers:
        samples: dict[str, dict[str, list[float]]] = {k: {"light": [], "heavy": []} for k in KINDS}
        loaders: dict[str, list[list[int]]] = {k: [] for k in KINDS}
        for _ in range(repeats):
            for kind in KINDS:
                result = run(kind, workers, epochs, batches, passes, stage_speed)
                samples[kind]["light"] += result["light"]
                samples[kind]["heavy"] += result["heavy"]
                loaders[kind].append(result["workers"])
        medians = {k: {half: statistics.median(v) for half, v in halves.items()} for k, halves in samples.items()}
        results[workers] = {"medians": medians, "workers": loaders}
    return results


def _loaders(workers: list[list[int]]) -> str:
    return "; ".join(" ".join(map(str, w)) for w in workers)


def rows(smoke: bool = False) -> list[Row]:
    sizes = dict(epochs=4, batches=4, repeats=1, cpu_workers=[1]) if smoke else {}
    out = []
    for cpu_workers, result in measure(**{**DEFAULTS, **sizes}).items():
        m, loaders = result["medians"], result["workers"]
        beside = f"stage + {cpu_workers} CPU worker" if cpu_workers else "stage alone"
        note = lambda kind: f"loader workers per epoch: {_loaders(loaders[kind])}"  # noqa: E731
        out += [
            Row("loading", f"{beside}: planned / default loader, before the stall (step time)", m["planned"]["light"] / m["default"]["light"], "<= 1", note("planned")),
            Row("loading", f"{beside}: planned / default loader, during the stall (step time)", m["planned"]["heavy"] / m["default"]["heavy"], "<= 1"),
            Row("loading", f"{beside}: re-split / default loader, during the stall (step time)", m["re-split"]["heavy"] / m["default"]["heavy"], "<= 1", note("re-split")),
        ]  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=DEFAULTS["epochs"], help="epochs per run; the stall starts halfway")
    parser.add_argument("--batches", type=int, default=DEFAULTS["batches"], help="batches of 100 per epoch")
    parser.add_argument("--repeats", type=int, default=DEFAULTS["repeats"])
    parser.add_argument("--passes", type=int, default=DEFAULTS["passes"], help="augmentation passes per image during the stall")
    parser.add_argument("--stage-speed", type=float, default=DEFAULTS["stage_speed"], help="the emulated stage's samples/s")
    parser.add_argument("--cpu-workers", type=int, nargs="+", default=DEFAULTS["cpu_workers"], help="CPU workers beside the stage")
    args = parser.parse_args()
    results = measure(**vars(args))
    print(f"MLP 784-128-128-10 on augmented 28x28 digits, batch 100; one emulated stage ({args.stage_speed:g} samples/s)")
    print(f"{'CPU workers':>11s} {'configuration':>13s} {'step before the stall (ms)':>27s} {'step during it (ms)':>20s}  loader workers per epoch")
    for cpu_workers, result in results.items():
        for kind, halves in result["medians"].items():
            workers = _loaders(result["workers"][kind])
            print(f"{cpu_workers:>11d} {kind:>13s} {halves['light'] * 1e3:27.2f} {halves['heavy'] * 1e3:20.2f}  {workers}")


if __name__ == "__main__":
    main()
