"""The utilization monitor's cost: step time with and without it, alternating in one run.

The same hetero run (1 CPU worker + 2 emulated stages, CPU fraction 0.3) trains the same MLP
without the monitor, with it logging every 50 steps (Lightning's default logging interval), and
with it logging every step (its worst case), each time with a CSV logger and the trace written
at the end.

    python -m benchmarks.monitor [--steps N] [--repeats R]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from typing import Any, Optional

import torch
from lightning.pytorch.loggers import CSVLogger

from benchmarks.common import MLP, interleave, step_times, synthetic_loader
from lightning_hetero import HeteroStrategy
from lightning_hetero.callbacks import UtilizationMonitor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)  # this process only launches; keep it fork-safe (see launcher.py)
    loader = synthetic_loader(args.batch_size * args.steps, args.batch_size)

    def run(every: Optional[int]) -> list[float]:
        strategy = HeteroStrategy(stages=["cpu", "cpu"], cpu_fraction=0.3, micro_batches=2, start_method="fork")
        with tempfile.TemporaryDirectory() as tmp:
            callbacks: list[Any] = [] if every is None else [UtilizationMonitor(every_n_steps=every, save_dir=tmp)]
            logger = CSVLogger(tmp, name="", version="")
            return step_times(strategy, MLP(width=args.width), loader, args.steps, callbacks=callbacks, logger=logger)

    configs = {"without the monitor": lambda: run(None), "monitor, every 50 steps": lambda: run(50), "monitor, every step": lambda: run(1)}
    times = interleave(configs, args.repeats)
    # The mean counts the steps that log (one in 50); the median shows a typical step.
    means = {name: statistics.mean(t) for name, t in times.items()}
    medians = {name: statistics.median(t) for name, t in times.items()}
    base_mean, base_median = means["without the monitor"], medians["without the monitor"]
    print(f"MLP 6x{args.width}, batch {args.batch_size}, 1 CPU worker + 2 emulated stages, CPU fraction 0.3, CSV logger")
    print(f"{'configuration':28s} {'mean step (ms)':>15s} {'vs without':>11s} {'median step (ms)':>17s} {'vs without':>11s}")
    for name in configs:
        print(
            f"{name:28s} {means[name] * 1e3:15.2f} {means[name] / base_mean:11.3f}"
            f" {medians[name] * 1e3:17.2f} {medians[name] / base_median:11.3f}"
        )

if __name__ == "__main__":
    main()
