"""Starting the processes of a hetero run (fork, spawn or forkserver), after checking the model.

Lightning's multiprocessing launcher starts one process per local rank and hands rank 0's
results and weights back to the main process. This launcher first checks the model contract in
the main process, so a model that cannot run gets its error before any process starts, and
brings the weights back in the precision they were trained in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from lightning.pytorch import LightningModule
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from typing_extensions import override

import lightning.pytorch as pl

if TYPE_CHECKING:
    from lightning_hetero.strategy import HeteroStrategy

__all__ = ["HeteroLauncher"]


class HeteroLauncher(_MultiProcessingLauncher):
    """Checks the model, then starts one process per CPU worker and stage on this node."""

    _strategy: "HeteroStrategy"

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        model = args[0] if args and isinstance(args[0], LightningModule) else None
        if model is None and trainer is not None:
            model = trainer.lightning_module
        if model is not None:
            self._strategy.check_model(model)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _recover_results_in_main_process(self, worker_output: Any, trainer: "pl.Trainer") -> None:
        # The workers converted the model to the run's precision (e.g. float64); convert the main
        # process's copy the same way so the trained weights come back without rounding.
        if worker_output.weights_path is not None:
            trainer.strategy.precision_plugin.convert_module(trainer.lightning_module)
        super()._recover_results_in_main_process(worker_output, trainer)
