"""How well the workload analyzer predicts, and how good its plans are, on emulated stages.

For each model and layout, a run with ``WorkloadAnalyzer`` profiles, plans and trains; the
analyzer's predicted step time (after its warm-up, which measures the fixed cost per step, the
step method's own work and the optimizer steps in the run) is compared with the step it then
measures (the strategy's own step, as the analyzer logs it) and with the wall time of a whole
training iteration (the same plus Lightning's loop). "planned" is the prediction the plan was chosen
by, made before training from the profile alone. Beside it, in the same run, the same model trains with the strategy's default
layout and with plain Lightning in one process, so the plan's worth is a ratio measured side by
side. Configurations alternate; medians over repeats are reported.

With ``--replicas`` every run trains replicas (``parallelism="replicas"``): the analyzer plans
the CPU's share for replicas of the same blocks, with its cost model for replicas.

    python -m benchmarks.planner [--steps N] [--repeats R] [--recipes] [--replicas]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import CNN, MLP, image_loader, step_times, synthetic_loader
from lightning_hetero import HeteroStrategy
from lightning_hetero.callbacks import WorkloadAnalyzer


class AnalyzerReport(L.Callback):
    """On rank 0 at the end of fit: the analyzer's prediction, its measurement, and the plan."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        analyzer = next(cb for cb in trainer.callbacks if isinstance(cb, WorkloadAnalyzer))
        if trainer.global_rank == 0 and analyzer.prediction is not None and analyzer.plan is not None:
            report = {
                "planned": analyzer.plan.predicted_step_s,
                "predicted": analyzer.prediction.step_s,
                "measured": analyzer.measured_step_s,
                "plan": f"{analyzer.plan.micro_batches} mb, cpu {analyzer.plan.cpu_fraction:.2f}",
            }
            self.out.write_text(json.dumps(report))


Case = tuple[str, Callable[[], L.LightningModule], DataLoader, int]
WARMUP = 10


def token_loader(samples: int, batch_size: int, vocab: int = 2000, context: int = 64) -> DataLoader:
    """Random token windows the shape of the GPT recipe's small config (its model's cost does not
    depend on which tokens it reads)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (samples, context + 1), generator=g)
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=batch_size, drop_last=True)


def digits_loader(samples: int, batch_size: int) -> DataLoader:
    """Random 8x8 "digits" with labels, the shape of the MLP recipe's data."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(samples, 64, generator=g), torch.randint(0, 10, (samples,), generator=g))
    return DataLoader(data, batch_size=batch_size, drop_last=True)


def recipe_cases(steps: int) -> list[Case]:
    """The recipes' models at their default configs' sizes."""
    from recipes.gpt import GPT
    from recipes.mlp import DigitsMLP

    return [
        ("MLP recipe (digits), batch 100", lambda: DigitsMLP(), digits_loader(100 * steps, 100), 2),
        ("GPT recipe (small), batch 32", lambda: GPT(), token_loader(32 * steps, 32), 2),
    ]


def cases(steps: int) -> list[Case]:
    return [
        ("MLP 6x512, batch 256", lambda: MLP(width=512, depth=6), synthetic_loader(256 * steps, 256), 1),
        ("MLP 6x512, batch 256", lambda: MLP(width=512, depth=6), synthetic_loader(256 * steps, 256), 2),
        ("MLP 8x1024, batch 64", lambda: MLP(width=1024, depth=8), synthetic_loader(64 * steps, 64), 1),
        ("MLP 8x1024, batch 64", lambda: MLP(width=1024, depth=8), synthetic_loader(64 * steps, 64), 2),
        ("CNN 64ch 16x16, batch 128", lambda: CNN(), image_loader(128 * steps, 128), 2),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40, help=f"per run; the analyzer's warm-up takes {WARMUP}")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--recipes", action="store_true", help="the recipes' models instead of the synthetic ones")
    parser.add_argument("--replicas", action="store_true", help="train replicas of the blocks instead of pipelines")
    args = parser.parse_args()
    parallelism = "replicas" if args.replicas else "pipeline"

    def strategy(stages: int) -> HeteroStrategy:
        # forkserver: workers must not fork from this process, which runs plain Lightning with threads.
        # The default layout's starting fraction, held (`cpu_fraction="auto"` would also rebalance it).
        fair = HeteroStrategy(stages=["cpu"] * stages).cpu_fraction
        return HeteroStrategy(stages=["cpu"] * stages, cpu_fraction=fair, parallelism=parallelism, start_method="forkserver")

    def planned(model: Callable[[], L.LightningModule], loader: DataLoader, stages: int, into: list) -> list[float]:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "report.json"
            analyzer = WorkloadAnalyzer(warmup_steps=WARMUP, measure_steps=args.steps - WARMUP - 3, save_dir=tmp)
            times = step_times(strategy(stages), model(), loader, args.steps, callbacks=[analyzer, AnalyzerReport(out)])
            into.append(json.loads(out.read_text()))
            return times

    rows = []
    for name, model, loader, stages in (recipe_cases if args.recipes else cases)(args.steps):
        reports: list[dict[str, Any]] = []
        samples: dict[str, list[float]] = {"planned": [], "default": [], "plain": []}
        for _ in range(args.repeats):
            samples["planned"] += planned(model, loader, stages, reports)
            samples["default"] += step_times(strategy(stages), model(), loader, args.steps)
            samples["plain"] += step_times(None, model(), loader, args.steps)
        wall = {key: statistics.median(times) for key, times in samples.items()}
        before = statistics.median(r["planned"] for r in reports)
        predicted = statistics.median(r["predicted"] for r in reports)
        measured = statistics.median(r["measured"] for r in reports)
        rows.append((name, stages, reports[-1]["plan"], before, predicted, measured, wall))
        print(f"done: {name}, {stages} stage(s)", flush=True)

    print(f"\n{torch.get_num_threads()} threads; {args.steps} steps per run, {args.repeats} repeats; times in ms")
    header = (
        f"{'model':26s} {'stages':>6s} {'plan':>16s} {'planned':>7s} {'predicted':>9s} {'measured':>8s} {'error':>6s}"
        f" {'wall':>7s} {'error':>6s} {'default':>8s} {'plain':>7s} {'vs default':>10s} {'vs plain':>8s}"
    )
    print(header)
    for name, stages, plan, before, predicted, measured, wall in rows:
        print(
            f"{name:26s} {stages:6d} {plan:>16s} {before * 1e3:7.2f} {predicted * 1e3:9.2f} {measured * 1e3:8.2f}"
            f" {measured / predicted - 1:+6.0%} {wall['planned'] * 1e3:7.2f} {wall['planned'] / predicted - 1:+6.0%}"
            f" {wall['default'] * 1e3:8.2f} {wall['plain'] * 1e3:7.2f}"
            f" {wall['planned'] / wall['default']:10.3f} {wall['planned'] / wall['plain']:8.3f}"
        )


if __name__ == "__main__":
    main()
