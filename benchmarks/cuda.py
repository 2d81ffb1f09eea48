"""On a machine with a GPU: the CPU beside the GPU against the GPU alone, and fine mode's offload
against the GPU alone, for the recipes' models and a larger GPT, each measured side by side in one run.

- **CPU worker + GPU / GPU alone** (samples/s): plain Lightning on the GPU (``accelerator="gpu"``)
  against ``HeteroStrategy(stages=["cuda:0"])`` with one CPU worker (the cores the GPU's process
  leaves) and ``AdaptiveRebalancer``, which starts the CPU at 0 and gives it the share it earns.
  Measured over the second half of the run, once the rebalancer has settled. The goal is never
  below 1.00: where the CPU does not help, its share falls to 0.
- **Fine mode, every bucket offloaded / GPU alone**: step time, and the GPU's peak memory beside it
  (the optimizer state lives in CPU memory).

Hetero runs start their processes with spawn, since this process has used CUDA (the GPU-alone
runs). Where there is no CUDA device, every row says so.

    python -m benchmarks.cuda [--steps N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from benchmarks.common import Row, step_times
from benchmarks.planner import digits_loader, token_loader
from lightning_hetero import HeteroStrategy
from lightning_hetero.callbacks import AdaptiveRebalancer

DEFAULTS = dict(steps=200, repeats=2)
NO_CUDA = "not run: no CUDA device on this machine"
NAMES = {
    "rebalanced": "CPU worker + GPU, rebalanced / GPU alone (samples/s)",
    "offload": "fine mode, every bucket offloaded / GPU alone (step time)",
}


class Facts(L.Callback):
    """Each rank writes, at the end of the fit, its CPU fraction, threads and peak GPU memory."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        cuda = trainer.strategy.root_device.type == "cuda"
        facts = {
            "fraction": getattr(trainer.strategy, "cpu_fraction", 0.0),
            "threads": torch.get_num_threads(),
            "peak_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        }
        (self.out / f"facts{trainer.global_rank}.json").write_text(json.dumps(facts))


def models(smoke: bool) -> list[tuple[str, Callable[[], L.LightningModule], Callable[[int], DataLoader]]]:
    """(name, model, loader of ``n`` batches) for the recipes' models and a larger GPT."""
    from recipes.gpt import GPT
    from recipes.mlp import DigitsMLP

    if smoke:
        return [("GPT (tiny)", lambda: GPT(width=32, heads=2, layers=2), lambda n: token_loader(8 * n, 8))]
    return [
        ("MLP recipe (digits), batch 100", DigitsMLP, lambda n: digits_loader(100 * n, 100)),
        ("GPT recipe (small), batch 32", GPT, lambda n: token_loader(32 * n, 32)),
        (
            "GPT, 8 blocks of width 512, context 256, batch 32",
            lambda: GPT(vocab_size=8000, context=256, width=512, layers=8, heads=8),
            lambda n: token_loader(32 * n, 32, vocab=8000, context=256),
        ),
    ]


def _run(strategy: Any, model: L.LightningModule, loader: DataLoader, steps: int, **kwargs: Any) -> dict[str, Any]:
    """Step times of the second half of a fit, and every rank's facts."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        callbacks = [Facts(out), *kwargs.pop("callbacks", [])]
        if strategy is None:
            torch.cuda.reset_peak_memory_stats()
            kwargs.update(accelerator="gpu", devices=1)
        times = step_times(strategy, model, loader, steps, callbacks=callbacks, **kwargs)
        facts = [json.loads(p.read_text()) for p in sorted(out.glob("facts*.json"))]
    return {"step": statistics.median(times[len(times) // 2 :]), "facts": facts}


def measure(steps: int, repeats: int, smoke: bool = False) -> list[dict[str, Any]]:
    results = []
    for name, model, loader in models(smoke):
        every = max(2, steps // 20)
        configs: dict[str, Callable[[], Any]] = {
            "gpu": lambda: _run(None, model(), loader(steps), steps),
            "rebalanced": lambda: _run(
                HeteroStrategy(stages=["cuda:0"], cpu_workers=1, start_method="spawn"),
                model(),
                loader(steps),
                steps,
                callbacks=[AdaptiveRebalancer(every_n_steps=every)],
            ),
            "offload": lambda: _run(
                HeteroStrategy(stages=["cuda:0"], cpu_workers=0, mode="fine", offload="all", start_method="spawn"),
                model(),
                loader(steps),
                steps,
            ),
        }
        results.append({"model": name, **_alternate(configs, repeats)})
    return results


def _alternate(configs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for _ in range(repeats):
        for name, run in configs.items():
            runs[name].append(run())
    return runs


def rows(smoke: bool = False, **sizes: int) -> list[Row]:
    if not torch.cuda.is_available():
        return [Row("CUDA", name, math.nan, "", NO_CUDA) for name in NAMES.values()]
    out = []
    for r in measure(**(dict(steps=12, repeats=1) if smoke else {**DEFAULTS, **sizes}), smoke=smoke):
        gpu = statistics.median(run["step"] for run in r["gpu"])
        rebalanced = statistics.median(run["step"] for run in r["rebalanced"])
        fractions = [run["facts"][0]["fraction"] for run in r["rebalanced"]]
        threads = r["rebalanced"][0]["facts"][0]["threads"]
        out.append(
            Row("CUDA", f"{r['model']}: {NAMES['rebalanced']}", gpu / rebalanced, ">= 1.00",
                f"settled CPU fraction {', '.join(f'{f:.2f}' for f in fractions)}; CPU worker threads {threads}")
        )
        offload = statistics.median(run["step"] for run in r["offload"])
        peak = {name: statistics.median(run["facts"][-1]["peak_mb"] for run in r[name]) for name in ("gpu", "offload")}
        out.append(
            Row("CUDA", f"{r['model']}: {NAMES['offload']}", offload / gpu, "",
                f"peak GPU memory {peak['offload']:.0f} MB offloaded vs {peak['gpu']:.0f} MB")
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    parser.add_argument("--repeats", type=int, default=DEFAULTS["repeats"])
    args = parser.parse_args()
    for row in rows(steps=args.steps, repeats=args.repeats):
        print(f"{row.configuration:90s} {row.ratio:7.3f}  {row.note}")


if __name__ == "__main__":
    main()
