"""The CPU workers' optimizer with one CPU worker vs split between two (``sharding.py``), in one run.

Fine mode, every bucket offloaded, an MLP whose optimizer step is a large part of a step (6 blocks
of width ``width``, AdamW, batches of 8), one emulated stage, the CPU workers taking a quarter of
every batch. With one CPU worker, the stage and the CPU worker each step every offloaded bucket
(the stage in its host memory); with two, pinned one per core (``cpu_workers=[[0], [1]]``, as
``"auto"`` pins one per NUMA node), each owns about half of every bucket's fp32 state, steps it,
and broadcasts it; and two that each step all of it (``shard_cpu_optimizer=False``). Then coarse mode, where
every CPU worker steps its replica's optimizer after the sum: two CPU workers splitting it vs two
stepping all of it. Alternating, repeated; reported: the median step time, fine mode's offloaded
step's parameters per second (every CPU worker's bucket steps of a step, the slowest process's
time), and the optimizer state each process holds (offloaded or its own).

    python -m benchmarks.sharding [--width W] [--steps S] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks.common import MLP, Row, interleave, step_times, synthetic_loader
from lightning_hetero import HeteroStrategy
from lightning_hetero.offload import OffloadStep

DEFAULTS = dict(width=1024, steps=20, repeats=3)
FRACTION = 0.25


class OptimizerWork(L.Callback):
    """Global rank 0 writes the bucket steps' time of each step (the slowest process's) and the optimizer
    state every process holds, as JSON."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        steps = [s.optimizer for s in strategy.bucket_steps if isinstance(s, OffloadStep) and s.optimizer is not None]
        states = [state for o in [*steps, *trainer.optimizers] for state in o.state.values()]
        held = sum(t.numel() for state in states for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
        records = [sum(b - a for kind, a, b in r.side_spans if kind.endswith("step")) for r in strategy.step_records[3:]]
        everyone = strategy.gather((strategy.role.is_cpu_worker, held, records), dst=0)
        if trainer.is_global_zero:
            # Until every copy is updated: the slowest process's bucket steps (a stage's include its wait
            # for the owners' broadcasts).
            seconds = [max(step) for step in zip(*(r for _, _, r in everyone))]
            self.out.write_text(json.dumps({"held": [h for _, h, _ in everyone], "seconds": seconds}))


def run(width: int, steps: int, workers: Any, results: dict[str, Any], name: str) -> list[float]:
    mode = "coarse" if name.startswith("coarse") else "fine"
    strategy = HeteroStrategy(
        mode=mode, offload="all" if mode == "fine" else "auto", stages=["cpu"], cpu_workers=workers, cpu_fraction=FRACTION,
        start_method="fork", shard_cpu_optimizer="whole" not in name,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "work.json"
        times = step_times(strategy, MLP(width=width), synthetic_loader(64 * steps, 8), steps, callbacks=[OptimizerWork(out)])
        work = json.loads(out.read_text())
    results.setdefault(name, {"seconds": [], "held": work["held"]})["seconds"] += work["seconds"]
    return times


def measure(width: int, steps: int, repeats: int) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)  # this process only launches; keep it fork-safe (see launcher.py)
    cores = sorted(os.sched_getaffinity(0))
    pinned = [[cores[0]], [cores[-1]]]
    configs = {
        "one CPU worker": 1,
        "two CPU workers, split": pinned,
        "two CPU workers, whole copies": pinned,
        "coarse, two CPU workers, split": pinned,
        "coarse, two CPU workers, whole copies": pinned,
    }
    results: dict[str, Any] = {}
    times = interleave({name: (lambda n=name, w=w: run(width, steps, w, results, n)) for name, w in configs.items()}, repeats)
    params = sum(p.numel() for p in MLP(width=width).parameters())
    return {
        name: {
            "step_s": statistics.median(times[name]),
            "params_per_s": params / statistics.median(results[name]["seconds"]) if any(results[name]["seconds"]) else 0.0,
            "held": results[name]["held"],
        }
        for name in configs
    }


def rows(smoke: bool = False) -> list[Row]:
    sizes = dict(width=128, steps=6, repeats=1) if smoke else {}
    m = measure(**{**DEFAULTS, **sizes})
    one, two, whole = m["one CPU worker"], m["two CPU workers, split"], m["two CPU workers, whole copies"]
    held = lambda r: f"optimizer state per process (CPU workers, then the stage): {r['held']}"  # noqa: E731
    return [
        Row("sharding", "2 CPU workers, split / 1 CPU worker (step time)", two["step_s"] / one["step_s"], "< 1", held(two)),
        Row("sharding", "2 CPU workers, split / 1 CPU worker (offloaded parameters/s)", two["params_per_s"] / one["params_per_s"], "> 1", held(one)),
        Row("sharding", "2 CPU workers, split / 2 CPU workers, whole copies (step time)", two["step_s"] / whole["step_s"], "< 1", held(whole)),
        Row("sharding", "coarse: 2 CPU workers, split / whole copies (step time)", m["coarse, two CPU workers, split"]["step_s"] / m["coarse, two CPU workers, whole copies"]["step_s"], "< 1", held(m["coarse, two CPU workers, split"])),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key}", type=int, default=value)
    args = parser.parse_args()
    results = measure(**vars(args))
    params = sum(p.numel() for p in MLP(width=args.width).parameters())
    print(f"MLP of width {args.width} ({params / 1e6:.1f} M parameters), fine mode: every bucket offloaded; cpu_fraction {FRACTION}")
    for name, r in results.items():
        rate = f"offloaded step {r['params_per_s'] / 1e9:6.3f} G params/s, " if r["params_per_s"] else ""
        print(f"{name:>38s}: step {r['step_s'] * 1e3:8.2f} ms, {rate}optimizer state per process {r['held']}")


if __name__ == "__main__":
    main()
