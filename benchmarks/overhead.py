"""The cost of the strategy itself: hetero with one stage and no CPU share vs plain Lightning.

Both train the same MLP on the same batches on this machine's cores; the hetero run has one
emulated stage (and, in the second row, an idle CPU worker that still takes part in the gradient
sync). Prints median step times and their ratios, measured alternately in one run.

    python -m benchmarks.overhead [--steps N] [--repeats R]
"""

from __future__ import annotations

import argparse

from benchmarks.common import MLP, alternate, step_times, synthetic_loader
from lightning_hetero import HeteroStrategy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    loader = synthetic_loader(args.batch_size * args.steps, args.batch_size)

    def run(strategy_kwargs: dict | None) -> list[float]:
        # forkserver: the hetero workers must not be forked from this process, which has run
        # multi-threaded torch work (see lightning_hetero/launcher.py).
        strategy = None
        if strategy_kwargs is not None:
            strategy = HeteroStrategy(stages=["cpu"], start_method="forkserver", **strategy_kwargs)
        return step_times(strategy, MLP(width=args.width), loader, args.steps)

    medians = alternate(
        {
            "plain Lightning, 1 process": lambda: run(None),
            "hetero, 1 stage, no CPU worker": lambda: run({"cpu_workers": 0, "micro_batches": 1}),
            "hetero, 1 stage + idle CPU worker": lambda: run({"cpu_workers": 1, "cpu_fraction": 0.0, "micro_batches": 1}),
        },
        repeats=args.repeats,
    )
    base = medians["plain Lightning, 1 process"]
    print(f"{'configuration':40s} {'median step (ms)':>17s} {'vs plain':>9s}")
    for name, median in medians.items():
        print(f"{name:40s} {median * 1e3:17.2f} {median / base:9.3f}")


if __name__ == "__main__":
    main()
