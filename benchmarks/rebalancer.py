"""The adaptive rebalancer under emulated heterogeneity: rebalanced vs a fixed 50/50 split vs the ideal.

This machine has no GPU, so the speeds of the two sides are emulated with the strategy's
test-only ``emulated_speed`` knob: the pipeline (two emulated stages) computes ``--pipeline-speed``
samples per second and the CPU worker ``ratio`` times that (1:3 and 1:10: the CPU is the slower
side), on a small model whose real compute fits inside the emulated time. For each ratio, in one
run and alternating, repeated:

- CPU alone (``cpu_fraction=1``) and pipeline alone (``cpu_fraction=0``): each side's standalone
  throughput; the *ideal* is their sum;
- a fixed 50/50 split (``cpu_fraction=0.5``);
- the ``AdaptiveRebalancer`` starting from the strategy's default fraction: its throughput over
  the whole run (baseline window, probe and moves included) and once settled (the last half).

Throughput is samples per second from the median step time (the mean, for the whole run).

    python -m benchmarks.rebalancer [--steps N] [--repeats R] [--pipeline-speed S]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks.common import MLP, Row, step_times, synthetic_loader
from lightning_hetero import HeteroStrategy
from lightning_hetero.callbacks import AdaptiveRebalancer

FEATURES = 16


class FinalFraction(L.Callback):
    """Global rank 0 writes the CPU fraction the run ended with."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero:
            self.out.write_text(str(trainer.strategy.cpu_fraction))


DEFAULTS = dict(steps=60, alone_steps=10, repeats=2, batch_size=64, pipeline_speed=500.0, every=5, ratios=[3, 10])


def measure(
    steps: int, alone_steps: int, repeats: int, batch_size: int, pipeline_speed: float, every: int, ratios: list[int]
) -> list[dict]:
    """Per CPU:pipeline speed ratio: samples/s of each configuration and the settled fractions."""
    torch.set_num_threads(1)  # this process only launches; keep it fork-safe (see launcher.py)
    loader = synthetic_loader(batch_size * steps, batch_size, features=FEATURES)
    fractions: list[float] = []

    def run(cpu_speed: float, steps: int, rebalance: bool = False, **kwargs: Any) -> list[float]:
        speed = {"cpu": cpu_speed, "pipeline": pipeline_speed}
        strategy = HeteroStrategy(stages=["cpu", "cpu"], micro_batches=2, start_method="fork", emulated_speed=speed, **kwargs)
        model = MLP(width=32, depth=4, features=FEATURES)
        if not rebalance:
            return step_times(strategy, model, loader, steps)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "fraction"
            callbacks = [AdaptiveRebalancer(every_n_steps=every, verbose=False), FinalFraction(out)]
            times = step_times(strategy, model, loader, steps, callbacks=callbacks)
            fractions.append(float(out.read_text()))
            return times

    results = []
    for ratio in ratios:
        cpu_speed = pipeline_speed / ratio
        times: dict[str, list[float]] = {"cpu": [], "pipeline": [], "fixed": [], "whole": [], "settled": []}
        fractions.clear()
        for _ in range(repeats):
            times["cpu"] += run(cpu_speed, alone_steps, cpu_fraction=1.0)
            times["pipeline"] += run(cpu_speed, alone_steps, cpu_fraction=0.0)
            times["fixed"] += run(cpu_speed, steps, cpu_fraction=0.5)
            rebalanced = run(cpu_speed, steps, rebalance=True)
            times["whole"].append(statistics.mean(rebalanced))
            times["settled"] += rebalanced[len(rebalanced) // 2 :]
        throughput = {k: batch_size / statistics.median(v) for k, v in times.items()}
        ideal = throughput["cpu"] + throughput["pipeline"]
        results.append({"ratio": ratio, "ideal": ideal, **throughput, "fractions": list(fractions)})
    return results


def rows(smoke: bool = False) -> list[Row]:
    sizes = dict(steps=12, alone_steps=6, repeats=1, every=3, ratios=[3]) if smoke else {}
    out = []
    for r in measure(**{**DEFAULTS, **sizes}):
        ideal_fraction = 1 / (1 + r["ratio"])
        for key, label, goal in (("settled", "rebalanced (settled)", ">= 0.9"), ("fixed", "fixed 50/50 split", "")):
            note = f"fraction {', '.join(f'{f:.3f}' for f in r['fractions'])} (ideal {ideal_fraction:.3f})" if key == "settled" else ""
            out.append(Row("rebalancer", f"CPU:pipeline 1:{r['ratio']}, {label} / ideal (samples/s)", r[key] / r["ideal"], goal, note))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="steps of the rebalanced and fixed-split runs")
    parser.add_argument("--alone-steps", type=int, default=DEFAULTS["alone_steps"], help="steps of the standalone runs")
    parser.add_argument("--repeats", type=int, default=DEFAULTS["repeats"])
    parser.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    parser.add_argument("--pipeline-speed", type=float, default=DEFAULTS["pipeline_speed"], help="emulated pipeline samples/s")
    parser.add_argument("--every", type=int, default=DEFAULTS["every"], help="the rebalancer's every_n_steps")
    args = parser.parse_args()
    results = measure(**vars(args), ratios=DEFAULTS["ratios"])
    print(
        f"MLP 4x32, batch {args.batch_size}, 1 CPU worker + 2 emulated stages (2 micro-batches);"
        f" emulated pipeline {args.pipeline_speed:g} samples/s; samples/s as a ratio of the ideal"
    )
    header = f"{'CPU:pipeline':>12s} {'ideal (samples/s)':>18s} {'fixed 50/50':>12s} {'rebalanced, whole run':>22s}"
    print(header + f" {'rebalanced, settled':>20s} {'settled fraction (ideal)':>25s}")
    for r in results:
        ideal = r["ideal"]
        print(
            f"{'1:' + str(r['ratio']):>12s} {ideal:18.1f} {r['fixed'] / ideal:12.3f} {r['whole'] / ideal:22.3f}"
            f" {r['settled'] / ideal:20.3f} {' '.join(f'{f:.3f}' for f in r['fractions']):>17s} ({1 / (1 + r['ratio']):.3f})"
        )


if __name__ == "__main__":
    main()
