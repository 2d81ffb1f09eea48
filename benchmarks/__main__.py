"""Every benchmark this machine can run, each comparing its configurations side by side in one
run, and one table of the ratios they measured.

    python -m benchmarks [--smoke] [--only overhead pipelining ...] [--out table.md]

``--smoke`` runs each at a tiny size, so that none can rot (its numbers mean nothing). Each
benchmark also runs on its own with more detail: ``python -m benchmarks.<name> --help``.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import platform
import time
from pathlib import Path

import lightning
import torch

from benchmarks.common import Row, send_rows

BENCHMARKS = [
    "overhead",
    "pipelining",
    "schedules",
    "peers",
    "cpu_optimizer",
    "rebalancer",
    "loading",
    "multimodal",
    "sharding",
    "cuda",
    "largest",
]


def table(rows: list[Row]) -> str:
    lines = ["| benchmark | ratio | value | goal | note |", "| --- | --- | ---: | --- | --- |"]
    for row in rows:
        value = "n/a" if math.isnan(row.ratio) else f"{row.ratio:.3f}"
        lines.append(f"| {row.benchmark} | {row.configuration} | {value} | {row.goal} | {row.note} |")
    return "\n".join(lines)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return (
        f"{cpu}, {torch.get_num_threads()} threads; torch {torch.__version__}, lightning {lightning.__version__};"
        f" CUDA: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: check that every benchmark runs")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, default=BENCHMARKS)
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args()
    rows: list[Row] = []
    # Each benchmark in a fresh process: some fork workers, which is safe only from a process that
    # has not yet run multi-threaded torch, and each sets its own thread counts. A forkserver that has
    # imported torch, Lightning and the package (and run nothing) starts each in a fraction of the
    # seconds an interpreter of its own takes to import them.
    fresh = multiprocessing.get_context("forkserver")
    fresh.set_forkserver_preload(["benchmarks.common", "lightning_hetero"])
    for name in args.only:
        start = time.perf_counter()
        receive, send = fresh.Pipe(duplex=False)
        process = fresh.Process(target=send_rows, args=(name, args.smoke, send))  # not a daemon: it starts workers
        process.start()
        send.close()
        rows += receive.recv()
        process.join()
        print(f"done: {name} ({time.perf_counter() - start:.0f} s)", flush=True)
    text = f"{machine()}{' (smoke sizes)' if args.smoke else ''}\n\n{table(rows)}"
    print("\n" + text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
