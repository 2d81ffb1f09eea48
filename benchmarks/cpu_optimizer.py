"""How fast the CPU runs an offloaded optimizer step, against torch's other Adam implementations
and against the machine's memory bandwidth.

An Adam step reads a parameter, its gradient and two moments and writes back the parameter and
both moments: 28 bytes per fp32 parameter. With the memory bandwidth measured here (the faster of
two streaming kernels over large tensors with all threads, an in-place ``a += s*b`` and a sum:
bytes read plus bytes written per second), bandwidth / 28 is the most parameters per second any
Adam can update. Every configuration, the bandwidth measurement
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

from benchmarks.common import Row
from lightning_hetero.offload import OffloadStep, param_index

ADAM_BYTES_PER_PARAM = 28


def triad(numel: int) -> Callable[[], None]:
    """An in-place STREAM-style triad ``a += s*b``: 12 bytes per fp32 element, and, like Adam, it
    writes only lines it has read (a triad into a third tensor moves 12 or 16 bytes an element
    depending on whether its stores bypass the cache, which the machine decides)."""
    a, b = torch.randn(numel), torch.randn(numel)
    return lambda: a.add_(b, alpha=0.5)


def read(numel: int) -> Callable[[], None]:
    """A sum: 4 bytes read per fp32 element, nothing written."""
    a = torch.randn(numel)
    return lambda: a.sum()


STREAMS = {"triad": (triad, 12), "read": (read, 4)}
"""Memory-bound kernels and the bytes each moves per element; the faster gives the bandwidth."""


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


NAMES = ["single-tensor", "foreach", "fused", "offloaded", "offloaded+copies"]
DEFAULTS = dict(params=16 * 2**20, repeats=15, threads=[1, 2])


def measure(params: int, repeats: int, threads: list[int]) -> dict[int, dict[str, float]]:
    """Per thread count: G params/s of each configuration, and the bandwidth bound."""
    n, cores = params, torch.get_num_threads()
    results = {}
    for count in threads:
        configs = {
            "single-tensor": adam_step(n, foreach=False),
            "foreach": adam_step(n, foreach=True),
            "fused": adam_step(n, fused=True),
            "offloaded": offloaded_step(n, host_copies=False),
            "offloaded+copies": offloaded_step(n, host_copies=True),
            **{name: kernel(n) for name, (kernel, _) in STREAMS.items()},
        }
        times: dict[str, list[float]] = {name: [] for name in configs}
        for run in configs.values():  # warm-up: allocate state
            run()
        for _ in range(repeats):
            for name, run in configs.items():
                # The bandwidth is the machine's, measured with all its threads.
                torch.set_num_threads(cores if name in STREAMS else count)
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        torch.set_num_threads(cores)
        rate = {name: n / statistics.median(t) / 1e9 for name, t in times.items()}
        bandwidth = max(rate.pop(name) * nbytes for name, (_, nbytes) in STREAMS.items())
        rate["bound"] = bandwidth / ADAM_BYTES_PER_PARAM
        results[count] = rate
    return results


def rows(smoke: bool = False) -> list[Row]:
    sizes = dict(params=2**16, repeats=2) if smoke else dict(params=DEFAULTS["params"], repeats=DEFAULTS["repeats"])
    threads = max(DEFAULTS["threads"])
    rate = measure(**sizes, threads=[threads])[threads]
    return [
        Row("CPU optimizer", f"offloaded AdamW / torch {peer} AdamW, {threads} threads (params/s)", rate["offloaded"] / rate[peer])
        for peer in ("foreach", "fused")
    ] + [
        Row(
            "CPU optimizer",
            f"offloaded AdamW / memory-bandwidth bound, {threads} threads (params/s)",
            rate["offloaded"] / rate["bound"],
            "<= 1",
            f"bound {rate['bound']:.2f} G params/s",
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=DEFAULTS["params"])
    parser.add_argument("--repeats", type=int, default=DEFAULTS["repeats"])
    parser.add_argument("--threads", type=int, nargs="+", default=DEFAULTS["threads"])
    args = parser.parse_args()
    print(f"AdamW on {args.params / 2**20:.0f} Mi fp32 parameters; G params/s (median of {args.repeats}), alternating")
    print(f"{'threads':>7s} " + " ".join(f"{name:>16s}" for name in NAMES) + f" {'bound':>7s} {'fused/bound':>11s}")
    for threads, rate in measure(args.params, args.repeats, args.threads).items():
        cells = " ".join(f"{rate[name]:16.3f}" for name in NAMES)
        print(f"{threads:7d} {cells} {rate['bound']:7.3f} {rate['fused'] / rate['bound']:11.2f}")


if __name__ == "__main__":
    main()
