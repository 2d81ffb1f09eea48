"""What a rank's process and device are using: CPU utilization, memory, and on CUDA the GPU's
utilization (NVML, through nvidia-ml-py) and torch's memory counters; how the process's
allocator keeps freed memory (``keep_freed_memory``); and a process on the CPU that leaves CUDA
alone (``leave_cuda_rng_alone``)."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from functools import partial
from typing import Callable, Optional

import psutil
import torch

__all__ = ["device_stats", "keep_freed_memory", "leave_cuda_rng_alone"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)

_process: Optional[psutil.Process] = None
_meters: dict[str, tuple[float, float]] = {}


def device_stats(device: torch.device, meter: str = "default") -> dict[str, float]:
    """This process's CPU utilization since the previous call with the same ``meter`` (1.0: as
    much CPU time as its torch threads could use; gloo's and CUDA's own threads can take it above
    1) and resident memory; on a CUDA device, torch's allocated and peak memory and, where NVML can
    be read, the GPU's utilization and memory in use."""
    global _process
    if _process is None or _process.pid != os.getpid():  # first call in this process (or a fork)
        _process = psutil.Process(os.getpid())
        _meters.clear()
    times = _process.cpu_times()
    now, used = time.monotonic(), times.user + times.system
    last = _meters.get(meter)
    _meters[meter] = (now, used)
    stats = {"rss_gb": _process.memory_info().rss / 2**30}
    if last is not None and now > last[0]:
        stats["cpu_util"] = (used - last[1]) / (now - last[0]) / max(1, torch.get_num_threads())
    if device.type == "cuda":
        stats["gpu_mem_allocated_gb"] = torch.cuda.memory_allocated(device) / 2**30
        stats["gpu_mem_peak_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        stats.update(_nvml(device))
    return stats


def _nvml(device: torch.device) -> dict[str, float]:
    try:
        import pynvml

        pynvml.nvmlInit()
        # NVML numbers the physical GPUs; torch's index is within CUDA_VISIBLE_DEVICES.
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(device))
        rates, memory = pynvml.nvmlDeviceGetUtilizationRates(handle), pynvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception:  # no driver, no permission, no nvidia-ml-py: torch's numbers still stand
        return {}
    return {"gpu_util": rates.gpu / 100.0, "gpu_mem_used_gb": memory.used / 2**30, "gpu_mem_total_gb": memory.total / 2**30}


def keep_freed_memory(mmap_bytes: int = 32 * 2**20, trim_bytes: int = 1024 * 2**20) -> bool:
    """Have glibc's malloc keep memory this process frees for reuse, instead of handing it back to
    the operating system and faulting fresh pages in at the next step: blocks up to ``mmap_bytes``
    come from the heap, and up to ``trim_bytes`` of free heap stay with the process. Every step
    frees and allocates its gradients and the optimizer's temporaries again; with glibc's adaptive
    defaults a process started by fork or forkserver paid 15% of a small model's step for it
    (BENCHMARKS.md), as PyTorch's performance guide suggests tcmalloc or jemalloc for. Left as it is
    where the user set ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` (or
    ``LIGHTNING_HETERO_KEEP_FREED_MEMORY=0``), and off glibc. Returns whether it changed anything."""
    if not sys.platform.startswith("linux") or os.environ.get("LIGHTNING_HETERO_KEEP_FREED_MEMORY", "1") == "0":
        return False
    if any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    changed = bool(mallopt(_M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_bytes))
    log.debug("hetero: malloc keeps freed memory (%s)", changed)
    return changed


def leave_cuda_rng_alone() -> Callable[[], None]:
    """In a process that trains on the CPU (beside GPU stages, or emulated ones): Lightning's fit
    saves and restores the random state around its sanity check (``isolate_rng`` in
    ``Trainer._run_stage``) with every GPU's wherever ``torch.cuda.is_available()``, which starts
    CUDA, and the context that starts holds GPU memory for a process that never uses the GPU. From
    now on that leaves CUDA's state out (what Lightning offers for forked processes,
    ``include_cuda=False``); returns what puts Lightning's back. Nothing changes where CUDA had
    already started in the process."""
    import lightning.pytorch.trainer.trainer as trainer_module

    isolate = getattr(trainer_module, "isolate_rng", None)
    if isolate is None or torch.cuda.is_initialized():
        return lambda: None
    trainer_module.isolate_rng = partial(isolate, include_cuda=False)

    def restore() -> None:
        trainer_module.isolate_rng = isolate

    return restore
