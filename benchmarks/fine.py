"""Coarse vs fine mode on emulated stages, on a model whose optimizer step is a real share of a step.

Coarse mode sums all gradients and steps the optimizer after the backward; fine mode sums and
steps bucket by bucket while the backward is still running. The fraction of coarse mode's
sync+step time that fine mode hides is ``(coarse step - fine step) / coarse sync+step``, the
sync+step time measured on rank 0 (the CPU worker, which syncs and steps the whole model) from
the end of its autograd backward to the end of the optimizer step. That span includes the time it
waits for the stages' gradients, so the share is a lower bound's proxy, not an exact split. All
configurations alternate in one run; medians are reported.

    python -m benchmarks.fine [--steps N] [--repeats R]
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

from benchmarks.common import MLP, alternate, step_times, synthetic_loader
from lightning_hetero import HeteroStrategy


class SyncAndStepTimer(L.Callback):
    """On rank 0: the time from the end of the backward's autograd to the end of the optimizer step
    (gradient sum, clipping, optimizer step), per step, written as JSON."""

    def __init__(self, out: Path) -> None:
        self.out, self.times, self._start = out, [], 0.0

    def on_before_backward(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step > 3:
            self.times.append(time.perf_counter() - self._start)

    def on_fit_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps(self.times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)  # this process only launches; keep it fork-safe (see launcher.py)
    loader = synthetic_loader(args.batch_size * args.steps, args.batch_size)
    sync_and_step: list[float] = []

    def run(**kwargs: Any) -> list[float]:
        strategy = HeteroStrategy(stages=["cpu", "cpu"], cpu_fraction=0.3, micro_batches=2, start_method="fork", **kwargs)
        model = MLP(width=args.width, depth=args.depth, fused_adam=True)
        if kwargs["mode"] != "coarse":
            return step_times(strategy, model, loader, args.steps)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "sync.json"
            times = step_times(strategy, model, loader, args.steps, callbacks=[SyncAndStepTimer(out)])
            sync_and_step.extend(json.loads(out.read_text()))
            return times

    configs = {
        "coarse": lambda: run(mode="coarse"),
        "fine, no offload": lambda: run(mode="fine", offload="none"),
        "fine, all offloaded": lambda: run(mode="fine", offload="all"),
    }
    medians = alternate(configs, args.repeats)
    params = sum(p.numel() for p in MLP(width=args.width, depth=args.depth).parameters())
    hidden_budget = statistics.median(sync_and_step)
    print(f"MLP {args.depth}x{args.width} ({params / 1e6:.1f} M parameters), batch {args.batch_size}, fused AdamW;")
    print(f"1 CPU worker + 2 emulated stages, cpu_fraction 0.3; coarse sync+step on rank 0: {hidden_budget * 1e3:.1f} ms")
    print(f"{'configuration':24s} {'median step (ms)':>17s} {'vs coarse':>10s} {'sync+step hidden':>17s}")
    for name, median in medians.items():
        hidden = (medians["coarse"] - median) / hidden_budget
        print(f"{name:24s} {median * 1e3:17.2f} {median / medians['coarse']:10.3f} {hidden:17.2f}")


if __name__ == "__main__":
    main()
