"""Starting the processes of a hetero run, after checking the model in the main process.

Two ways, both Lightning's own launchers underneath:

- ``"popen"`` (the default for scripts, as for Lightning's DDP): the main process becomes global
  rank 0 and runs the script again for every other rank. Nothing is pickled, and it is safe
  after the main process has run multi-threaded torch code.
- ``"fork"`` (the default in notebooks), ``"spawn"``, ``"forkserver"``: one child per rank; rank 0
  hands the trained weights, metrics and results back. Fork is the fastest start, but a child
  forked after the parent ran multi-threaded (OpenMP) torch work can hang in its first parallel
  op; run such programs with ``"popen"`` or ``"spawn"``.

Whatever the method, the model contract is checked in the main process first, so a model that
cannot run gets its error before any process starts.
"""

from __future__ import annotations

import io
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from lightning.fabric.strategies.launchers.multiprocessing import _disable_module_memory_sharing
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.connectors.signal_connector import _SIGNUM
from typing_extensions import override

import lightning.pytorch as pl

if TYPE_CHECKING:
    from lightning_hetero.strategy import HeteroStrategy

__all__ = ["HeteroLauncher"]


class _Processes(_MultiProcessingLauncher):
    """Lightning's fork/spawn launcher, returning rank 0's results as bytes and weights in their trained precision.

    Results travel as bytes so that no tensor depends on the shared memory of a process that has
    exited, which is why Lightning itself refuses to return predictions from launchers of this kind.
    """

    @override
    def _wrapping_function(self, process_idx: int, trainer: Any, function: Callable, args: Any, kwargs: Any, *rest: Any) -> None:
        # spawn and forkserver hand every child the model's CPU tensors in shared memory; Lightning
        # copies them apart only for its CPUAccelerator. Each rank must own its parameters.
        if self._start_method in ("spawn", "forkserver"):
            args, kwargs = _disable_module_memory_sharing((args, kwargs))
        failed = True
        try:
            super()._wrapping_function(process_idx, trainer, function, args, kwargs, *rest)
            failed = False
        except BaseException as error:
            if _distributed_is_initialized():  # the error happened in this worker's run
                error.add_note(self._strategy.describe_rank())
            raise
        finally:
            _finish_wandb_run(failed)

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
            module = trainer.lightning_module
            module.configure_model()  # layers built there exist only in the workers so far (the hook is idempotent)
            trainer.strategy.precision_plugin.convert_module(module)
        super()._recover_results_in_main_process(worker_output, trainer)


def _finish_wandb_run(failed: bool) -> None:
    """A child process ends with ``os._exit``, so wandb's exit hook never runs there: finish the
    run this process started (rank 0's logger run), or what it logged never reaches its files.
    A run the main process started (and this one inherited by fork or attached to) is left alone."""
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is None or getattr(run, "_init_pid", None) != os.getpid() or getattr(run, "_is_attached", True):
        return
    try:
        run.finish(exit_code=1 if failed else 0)
    except Exception as error:  # never hide the run's own outcome behind the logger's
        warnings.warn(f"Could not finish the wandb run of this worker: {error!r}")


class HeteroLauncher(_Launcher):
    """Checks the model, then starts one process per CPU worker and stage on this node."""

    def __init__(self, strategy: "HeteroStrategy", start_method: str) -> None:
        self._strategy = strategy
        self.start_method = start_method
        self._launcher: _Launcher
        if start_method == "popen":
            assert strategy.cluster_environment is not None
            self._launcher = _SubprocessScriptLauncher(
                strategy.cluster_environment, strategy.num_processes, strategy.num_nodes
            )
        else:
            self._launcher = _Processes(strategy, start_method=start_method)  # type: ignore[arg-type]

    @property
    def copies_main_process(self) -> bool:
        """Whether every rank starts from a copy of the main process's model (fork, spawn) rather than
        building its own (popen), in which case rank 0's initial weights are broadcast."""
        return self.start_method != "popen"

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return self._launcher.is_interactive_compatible

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        model = args[0] if args and isinstance(args[0], LightningModule) else None
        if model is None and trainer is not None:
            model = trainer.lightning_module
        # A model that builds its layers in `configure_model` is checked in each process, after it has.
        if model is not None and not is_overridden("configure_model", model):
            self._strategy.check_model(model)
        results = self._launcher.launch(function, *args, trainer=trainer, **kwargs)
        if trainer is None or not isinstance(results, bytes) or self.start_method == "popen":
            return results
        return torch.load(io.BytesIO(results), weights_only=False)  # written by our own rank 0 above

    @override
    def kill(self, signum: _SIGNUM) -> None:
        self._launcher.kill(signum)
