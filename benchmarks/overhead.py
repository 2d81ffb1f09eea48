"""The cost of the strategy itself: hetero with one stage and no CPU share vs plain Lightning.

Both train the same MLP on the same batches on this machine's cores; the hetero run has one
emulated stage (and, in the second row, a CPU worker with no share: it computes and sums nothing,
and the stage takes its cores, but it still runs Lightning's loop and shares every step's results).
Prints median step times and their ratios, measured alternately in one run.

    python -m benchmarks.overhead [--steps N] [--repeats R]
"""

from __future__ import annotations

import argparse

from benchmarks.common import MLP, Row, alternate, step_times, synthetic_loader
from lightning_hetero import HeteroStrategy


DEFAULTS = dict(steps=40, repeats=8, width=512, batch_size=256)
GOALS = {"hetero, 1 stage, no CPU worker": "<= 1.03", "hetero, 1 stage + idle CPU worker": "<= 1.10"}
PLAIN = "plain Lightning, 1 process"


def measure(steps: int, repeats: int, width: int, batch_size: int) -> dict[str, float]:
    """Median step time of each configuration."""
    loader = synthetic_loader(batch_size * steps, batch_size)

    def run(strategy_kwargs: dict | None) -> list[float]:
        # forkserver: the hetero workers must not be forked from this process, which has run
        # multi-threaded torch work (see lightning_hetero/launcher.py).
        strategy = None
        if strategy_kwargs is not None:
            strategy = HeteroStrategy(stages=["cpu"], start_method="forkserver", **strategy_kwargs)
        return step_times(strategy, MLP(width=width), loader, steps)

    return alternate(
        {
            PLAIN: lambda: run(None),
            "hetero, 1 stage, no CPU worker": lambda: run({"cpu_workers": 0, "micro_batches": 1}),
            "hetero, 1 stage + idle CPU worker": lambda: run({"cpu_workers": 1, "cpu_fraction": 0.0, "micro_batches": 1}),
        },
        repeats=repeats,
    )


def rows(smoke: bool = False) -> list[Row]:
    medians = measure(**(dict(steps=6, repeats=1, width=32, batch_size=16) if smoke else DEFAULTS))
    return [
        Row("overhead", f"{name} / {PLAIN} (step time)", median / medians[PLAIN], GOALS[name])
        for name, median in medians.items()
        if name != PLAIN
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, default in DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    args = parser.parse_args()
    medians = measure(args.steps, args.repeats, args.width, args.batch_size)
    base = medians[PLAIN]
    print(f"{'configuration':40s} {'median step (ms)':>17s} {'vs plain':>9s}")
    for name, median in medians.items():
        print(f"{name:40s} {median * 1e3:17.2f} {median / base:9.3f}")


if __name__ == "__main__":
    main()
