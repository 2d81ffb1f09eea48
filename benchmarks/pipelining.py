"""The strategy's pipeline against a plain ``torch.distributed.pipelining`` training loop.

Both run the same MLP cut at the same place into two emulated stages (two processes on this
machine's cores, gloo between them), on the same batches, with the same schedule and micro-batch
count and the same AdamW step. The plain loop is what a user would write by hand: build the
stage, iterate the same DataLoader, run ``schedule.step`` and ``optimizer.step`` per batch; no
Lightning, no CPU worker. The strategy runs with ``cpu_workers=0`` under a Lightning ``Trainer``,
so the ratio is what the strategy and Lightning's loop add to torch's own pipelining, taken repeat
by repeat (the two run next to each other; its median and range over the repeats), each process
of either side on a core of its own where the machine has one for each
(``benchmarks.common.pin_rank``). Configurations alternate in one run; medians of the per-step
times after a warm-up are reported, beside the ideal speedup of a ``p``-stage pipeline over one
device, ``p*m/(m+p-1)``: emulated stages that share two cores do not reach it (see DESIGN.md,
"Measuring speed"), so it is shown for reference only. A last row measures what Lightning's own
training loop costs (plain Lightning against the same hand-written loop without a pipeline, one
process), which every hetero row includes.

    python -m benchmarks.pipelining [--steps N] [--repeats R] [--micro-batches 1 2 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader

from benchmarks.common import MLP, OneCorePerRank, Row, interleave, interleave_runs, paired_ratio, step_times, synthetic_loader
from benchmarks.schedules import PROCESSES as STAGES
from benchmarks.schedules import plain_pipelining
from lightning_hetero import HeteroStrategy

SCHEDULES = ("GPipe", "1F1B")
WARMUP = 3
DEFAULTS = dict(steps=30, repeats=5, micro_batches=[1, 2, 4], width=512, batch_size=256)


def plain_loop(model: MLP, loader: DataLoader) -> list[float]:
    """Per-step times of a hand-written one-process loop: forward, loss, backward, AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, last = [], time.perf_counter()
    for x, y in loader:
        optimizer.zero_grad()
        model.pipeline_loss(model(x), y).backward()
        optimizer.step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times[WARMUP:]


def measure(steps: int, repeats: int, micro_batches: list[int], width: int, batch_size: int) -> tuple[list[dict], dict]:
    """Per schedule and micro-batch count: the median step of each side and the ideal speedup; then
    the median step of plain Lightning and of the hand-written loop, one process each."""
    torch.set_num_threads(1)  # this process only launches workers; keep forking safe
    loader = synthetic_loader(batch_size * steps, batch_size)
    results = []
    for schedule in SCHEDULES:
        for m in micro_batches:
            if schedule == "1F1B" and m < STAGES:
                continue  # 1F1B needs a micro-batch per stage

            def strategy(schedule: str = schedule, m: int = m) -> list[float]:
                hetero = HeteroStrategy(stages=["cpu"] * STAGES, cpu_workers=0, micro_batches=m, schedule=schedule, start_method="fork")
                return step_times(hetero, MLP(width=width), loader, steps, callbacks=[OneCorePerRank(STAGES)])

            def plain(schedule: str = schedule, m: int = m) -> list[float]:
                return plain_pipelining(MLP(width=width), loader, schedule, m)

            runs = interleave_runs({"hetero": strategy, "plain": plain}, repeats)
            medians = {name: statistics.median(t for run in r for t in run) for name, r in runs.items()}
            ratio = paired_ratio(runs["hetero"], runs["plain"])
            ideal = STAGES * m / (m + STAGES - 1)
            results.append({"schedule": schedule, "micro_batches": m, **medians, "hetero/plain": ratio, "ideal": ideal})
    lightning = {
        "lightning": lambda: step_times(None, MLP(width=width), loader, steps),
        "loop": lambda: plain_loop(MLP(width=width), loader),
    }
    reference = {name: statistics.median(t) for name, t in interleave(lightning, repeats).items()}
    return results, reference


def rows(smoke: bool = False) -> list[Row]:
    sizes = dict(steps=6, repeats=1, micro_batches=[2], width=32, batch_size=16) if smoke else {}
    results, reference = measure(**{**DEFAULTS, **sizes})
    return [
        *(
            Row(
                "pipeline overhead",
                f"{r['schedule']}, {r['micro_batches']} micro-batches: hetero / plain torch pipelining (step time)",
                r["hetero/plain"].median,
                "<= 1.05" if r["micro_batches"] == 4 else "",
                f"repeats {r['hetero/plain'].low:.3f}-{r['hetero/plain'].high:.3f}; ideal speedup p*m/(m+p-1) = {r['ideal']:.2f}",
            )
            for r in results
        ),
        Row(
            "pipeline overhead",
            "reference: plain Lightning / the same loop by hand, 1 process, no pipeline (step time)",
            reference["lightning"] / reference["loop"],
            "",
            "Lightning's own loop, which every hetero row includes",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    parser.add_argument("--repeats", type=int, default=DEFAULTS["repeats"])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=DEFAULTS["micro_batches"])
    parser.add_argument("--width", type=int, default=DEFAULTS["width"])
    parser.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    args = parser.parse_args()
    results, reference = measure(args.steps, args.repeats, args.micro_batches, args.width, args.batch_size)
    print(f"MLP 6x{args.width}, batch {args.batch_size}, {STAGES} emulated stages; median step (ms)")
    print(f"{'schedule':>8s} {'m':>3s} {'hetero':>8s} {'plain':>8s} {'hetero/plain (range over repeats)':>34s} {'ideal speedup':>13s}")
    for r in results:
        print(
            f"{r['schedule']:>8s} {r['micro_batches']:3d} {r['hetero'] * 1e3:8.2f} {r['plain'] * 1e3:8.2f}"
            f" {str(r['hetero/plain']):>34s} {r['ideal']:13.2f}"
        )
    print(
        f"one process, no pipeline: plain Lightning {reference['lightning'] * 1e3:.2f} ms, the loop by hand"
        f" {reference['loop'] * 1e3:.2f} ms ({reference['lightning'] / reference['loop']:.3f})"
    )


if __name__ == "__main__":
    main()
