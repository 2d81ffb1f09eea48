"""``HeteroAccelerator``: the accelerator of a hetero run, whose processes sit on different devices.

Lightning gives a run one accelerator; in a hetero run the CPU workers sit on the CPU and the
stages on GPUs (or on the CPU, emulated). This accelerator serves each process's own device.
"""

from __future__ import annotations

from typing import Any, Union

import torch
from lightning.fabric.accelerators.cuda import num_cuda_devices
from lightning.fabric.accelerators.registry import _AcceleratorRegistry
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.accelerators.cpu import get_cpu_stats
from typing_extensions import override

import lightning.pytorch as pl

__all__ = ["HeteroAccelerator"]

_CUDA_AFTER_FORK = (
    "CUDA could not start on {device} in this rank. The ranks were forked (start_method='fork', the default in"
    " notebooks and under `python -c`) from a process that had already started CUDA, and a forked process"
    " cannot. Start the ranks with start_method='popen' or 'spawn', or leave CUDA alone in the main process"
    " before the fit (ask for the device count with `torch.cuda.device_count()`, which reads NVML)."
)
_FORK_REFUSAL = "Cannot re-initialize CUDA in forked subprocess"


class HeteroAccelerator(Accelerator):
    """One accelerator for a run whose CPU workers and pipeline stages use different devices."""

    @override
    def setup_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            return
        try:
            torch.cuda.set_device(device)
        except RuntimeError as error:
            if _FORK_REFUSAL in str(error):
                raise RuntimeError(_CUDA_AFTER_FORK.format(device=device)) from error
            raise

    _strategy: Any = None

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        from lightning_hetero.strategy import HeteroStrategy

        self._strategy = trainer.strategy
        if not isinstance(trainer.strategy, HeteroStrategy):
            raise ValueError(
                "`accelerator='hetero'` places CPU workers and pipeline stages on their devices and only works"
                f" with the hetero strategy, not {type(trainer.strategy).__name__}. Use `strategy='hetero'`."
            )

    @override
    def get_device_stats(self, device: _DEVICE) -> dict[str, Any]:
        """The machine's CPU stats (as Lightning's CPU accelerator gives them), this process's and
        its device's (``devices.device_stats``), and, in a running hetero run with Lightning's
        ``DeviceStatsMonitor``, every device's latest, keyed ``<device>/<stat>`` (``cpu0/cpu_util``,
        ``stage1/gpu_util``): they arrive with each step's results, so no collective runs here."""
        from lightning_hetero.devices import device_stats

        stats = {**get_cpu_stats(), **device_stats(torch.device(device))}
        engine = getattr(self._strategy, "engine", None)
        others = engine.latest_device_stats if engine is not None else {}
        return {**stats, **{f"{name}/{key}": value for name, theirs in others.items() for key, value in theirs.items()}}

    @override
    def teardown(self) -> None:
        pass

    @staticmethod
    @override
    def parse_devices(devices: Union[int, str, list]) -> Union[int, str, list]:
        # The strategy's `stages` and `cpu_workers` decide the devices; the Trainer's flag is not used.
        return devices

    @staticmethod
    @override
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [torch.device("cuda", i) for i in range(num_cuda_devices())] or [torch.device("cpu")]

    @staticmethod
    @override
    def auto_device_count() -> int:
        return max(1, num_cuda_devices())

    @staticmethod
    @override
    def is_available() -> bool:
        return True

    @staticmethod
    @override
    def name() -> str:
        return "hetero"

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: _AcceleratorRegistry) -> None:
        accelerator_registry.register(cls.name(), cls, description=cls.__name__)
