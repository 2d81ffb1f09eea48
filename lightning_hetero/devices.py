"""What a rank's process and device are using: CPU utilization, memory, and on CUDA the GPU's
utilization (NVML, through nvidia-ml-py) and torch's memory counters."""

from __future__ import annotations

import os
import time
from typing import Optional

import psutil
import torch

__all__ = ["device_stats"]

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
