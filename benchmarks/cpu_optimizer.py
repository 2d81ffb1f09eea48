"""How fast the CPU runs an offloaded optimizer step, against torch's other Adam implementations
and against the machine's memory bandwidth.

An Adam step reads a parameter, its gradient and two moments and writes back the parameter and
both moments: 28 bytes per fp32 parameter. With the memory bandwidth measured here (a triad over
large tensors with all threads: bytes read plus bytes written per second), bandwidth / 28 is the
most parameters per second any Adam can update. Every configuration, the bandwidth measurement
included, is timed alternately in one run; medians are reported.

    python -m benchmarks.cpu_optimizer [--params N] [--repeats R] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from lightning_hetero.offload import OffloadStep, param_index

ADAM_BYTES_PER_PARAM = 28


def triad(numel: int) -> Callable[[], None]:
    """A STREAM-style triad ``c = a + s*b`` over all threads. A store to a line not yet in cache
    reads it first, so it moves 16 bytes per fp32 element (Adam reads every line it writes, so its
    28 bytes per parameter need no such extra)."""
    a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    return lambda: torch.add(a, b, alpha=0.5, out=c)


TRIAD_BYTES_PER_ELEMENT = 16


def adam_step(numel: int, **kwargs: bool) -> Callable[[], None]:
    param = nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    optimizer = torch.optim.AdamW([param], lr=1e-3, **kwargs)
    return optimizer.step


def offloaded_step(numel: int, host_copies: bool) -> Callable[[], None]:
    """The fine-mode offloaded step on one bucket: fused CPU AdamW, and with ``host_copies`` also the
    gradient copied in and the weights copied out (what a GPU stage pays, here as memory copies)."""
    param = nn.Parameter(torch.randn(numel))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    step = OffloadStep(optimizer, [param], param_index(optimizer), host_copies=host_copies)
    grad = torch.randn(numel)

    def run() -> None:
        param.grad = grad
        step.step()

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=16 * 2**20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    n = args.params
    cores = torch.get_num_threads()
    print(f"AdamW on {n / 2**20:.0f} Mi fp32 parameters; G params/s (median of {args.repeats}), alternating")
    names = ["single-tensor", "foreach", "fused", "offloaded", "offloaded+copies"]
    print(f"{'threads':>7s} " + " ".join(f"{name:>16s}" for name in names) + f" {'bound':>7s} {'fused/bound':>11s}")
    for threads in args.threads:
        configs = {
            "single-tensor": adam_step(n, foreach=False),
            "foreach": adam_step(n, foreach=True),
            "fused": adam_step(n, fused=True),
            "offloaded": offloaded_step(n, host_copies=False),
            "offloaded+copies": offloaded_step(n, host_copies=True),
            "bandwidth": triad(n),
        }
        times: dict[str, list[float]] = {name: [] for name in configs}
        for run in configs.values():  # warm-up: allocate state
            run()
        for _ in range(args.repeats):
            for name, run in configs.items():
                # The bandwidth is the machine's, measured with all its threads.
                torch.set_num_threads(cores if name == "bandwidth" else threads)
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        rate = {name: n / statistics.median(t) / 1e9 for name, t in times.items()}
        bound = rate["bandwidth"] * TRIAD_BYTES_PER_ELEMENT / ADAM_BYTES_PER_PARAM
        cells = " ".join(f"{rate[name]:16.3f}" for name in names)
        print(f"{threads:7d} {cells} {bound:7.3f} {rate['fused'] / bound:11.2f}")


if __name__ == "__main__":
    main()
