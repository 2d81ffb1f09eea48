"""Starting the processes of a hetero run (fork, spawn or forkserver), after checking the model.

Lightning's multiprocessing launcher starts one process per local rank and hands rank 0's
results and weights back to the main process. The hetero launcher wraps it to

- check the model contract in the main process, so a model that cannot run gets its error
  before any process starts;
- bring the weights back in the precision they were trained in (e.g. float64);
- return ``trainer.predict``'s predictions: rank 0 assembles every worker's share, and sends
  its results as bytes, so no tensor depends on shared memory of a process that has exited
  (the reason Lightning refuses to return predictions from launchers of its own kind).
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.connectors.signal_connector import _SIGNUM
from typing_extensions import override

import lightning.pytorch as pl

if TYPE_CHECKING:
    from lightning_hetero.strategy import HeteroStrategy

__all__ = ["HeteroLauncher"]


class _Processes(_MultiProcessingLauncher):
    """Lightning's launcher, returning rank 0's results as bytes and weights in their trained precision."""

    @override
    def _collect_rank_zero_results(self, trainer: "pl.Trainer", results: Any) -> Any:
        output = super()._collect_rank_zero_results(trainer, results)
        if output is None:
            return None
        buffer = io.BytesIO()
        torch.save(output.trainer_results, buffer)
        return output._replace(trainer_results=buffer.getvalue())

    @override
    def _recover_results_in_main_process(self, worker_output: Any, trainer: "pl.Trainer") -> None:
        if worker_output.weights_path is not None:
            trainer.strategy.precision_plugin.convert_module(trainer.lightning_module)
        super()._recover_results_in_main_process(worker_output, trainer)


class HeteroLauncher(_Launcher):
    """Checks the model, then starts one process per CPU worker and stage on this node."""

    def __init__(self, strategy: "HeteroStrategy", start_method: str) -> None:
        self._strategy = strategy
        self._processes = _Processes(strategy, start_method=start_method)  # type: ignore[arg-type]

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return self._processes.is_interactive_compatible

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        model = args[0] if args and isinstance(args[0], LightningModule) else None
        if model is None and trainer is not None:
            model = trainer.lightning_module
        if model is not None:
            self._strategy.check_model(model)
        results = self._processes.launch(function, *args, trainer=trainer, **kwargs)
        if trainer is None or not isinstance(results, bytes):
            return results
        return torch.load(io.BytesIO(results), weights_only=False)  # written by our own rank 0 above

    @override
    def kill(self, signum: _SIGNUM) -> None:
        self._processes.kill(signum)
