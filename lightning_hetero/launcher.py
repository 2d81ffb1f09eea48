"""Starting the processes of a hetero run, after checking the model in the main process.

Two ways, both Lightning's own launchers underneath:

- ``"popen"`` (the default for scripts, as for Lightning's DDP): the main process becomes global
  rank 0 and runs the script again for every other rank. Nothing is pickled, and it is safe
  after the main process has run multi-threaded torch code.
- ``"fork"`` (the default in notebooks), ``"spawn"``, ``"forkserver"``: one child per rank; rank 0
  hands the trained weights, metrics and results back. Fork is the fastest start, but a child
  forked after the parent ran multi-threaded (OpenMP) torch work can hang in its first parallel
  op; run such programs with ``"popen"`` or ``"spawn"``.

Whatever the method, the model contract, and the DataLoaders passed to the trainer's method, are
checked in the main process first, so a model or data that cannot run gets its error before any
process starts.

A process that fails (an exception, a signal, a crash) ends the run at once: the launcher gives
the others ``GRACE_S`` seconds to end by themselves, kills those left (SIGKILL: a process blocked
in a collective never handles SIGTERM), and raises an error that names the rank that failed
first, its role, and why. A process that hangs without failing is ended by the strategy's
``timeout``: its peers' collectives fail, and the launcher stops everything.
"""

from __future__ import annotations

import ast
import atexit
import gc
import inspect
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import torch
import torch.multiprocessing as mp
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.strategies.launchers.multiprocessing import (
    _check_bad_cuda_fork,
    _check_missing_main_guard,
    _disable_module_memory_sharing,
)
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _set_num_threads_if_needed
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import BaseFinetuning, BatchSizeFinder, LearningRateFinder, ModelPruning
from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import _GlobalStateSnapshot
from lightning.pytorch.trainer.connectors.signal_connector import _SIGNUM
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException, _TunerExitException
from torch import Tensor
from torch.multiprocessing.spawn import ProcessContext, ProcessException, ProcessExitedException
from typing_extensions import override

import lightning.pytorch as pl

from lightning_hetero.data import check_before_launch
from lightning_hetero.module import check_fine_clipping
from lightning_hetero.multimodal import modality_encoders
from lightning_hetero.batchnorm import has_batch_norm
from lightning_hetero.signals import pass_on
from lightning_hetero.topology import READY_DIR_ENV, RanksGone, first_to_leave, recorded_failures

if TYPE_CHECKING:
    from lightning_hetero.strategy import HeteroStrategy

__all__ = ["HeteroLauncher", "GRACE_S", "resolve_start_method", "started_other_ranks"]

log = logging.getLogger(__name__)

GRACE_S = 2.0
"""Seconds the other processes get to end by themselves after one failed, before they are killed."""
EXIT_S = 10.0
"""How long a rank that closed its connections may take to end, before the error says no rank has."""


def _plans_the_cut(trainer: Optional["pl.Trainer"], strategy: "HeteroStrategy") -> bool:
    """Whether a planner is to give this fit's layout, the cut included, in the processes: one given to
    ``plan_with`` already, or a ``WorkloadAnalyzer``, which registers itself there from its ``setup``."""
    from lightning_hetero.callbacks import WorkloadAnalyzer  # the callbacks import the strategy's modules

    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return False
    return strategy._planner is not None or any(isinstance(cb, WorkloadAnalyzer) for cb in trainer.callbacks)


def resolve_start_method(start_method: str) -> str:
    """``"auto"`` is ``"fork"`` in a notebook, or where there is no script to run again
    (``python -c``, or code read from the standard input), and ``"popen"`` otherwise; any other must
    exist here."""
    no_script = sys.argv[:1] in (["-c"], ["-"], [""])
    if start_method == "auto":
        return "fork" if _IS_INTERACTIVE or no_script else "popen"
    if start_method == "popen" and no_script:
        raise ValueError(
            "`start_method='popen'` runs the script again for every other process, and `python -c` (or code read"
            " from the standard input) has no script to run: use `start_method='fork'` or `'spawn'`, or put the"
            " code in a file."
        )
    if start_method not in ["popen", *mp.get_all_start_methods()]:
        raise ValueError(
            f"`start_method={start_method!r}` is not available here; choose one of"
            f" {['auto', 'popen', *mp.get_all_start_methods()]}."
        )
    return start_method


_CUDA_STARTED_BEFORE_FORK = (
    "This process has already started CUDA, and ranks forked from it cannot use it (torch refuses to start it"
    " again in a forked process): a GPU stage could not run, nor could anything on a CPU rank that reaches for"
    " the GPU. On a machine with a GPU any Trainer's fit starts CUDA, even on the CPU (Lightning saves the CUDA"
    " random state around its sanity check), as does a tensor put on the GPU. Restart the Python process (the"
    " notebook's kernel) and make this fit the first use of CUDA, or start the ranks with start_method='popen'"
    " (from a script), or 'forkserver' or 'spawn' (with the model's class importable; forkserver starts the"
    " ranks of every fit after the first in a fraction of a second)."
)

_THREADS_AFTER_FORK = (
    "This process has already run multi-threaded torch work, and a process forked from it hangs at its first"
    " multi-threaded operation (torch's OpenMP keeps the threads of that work, which a fork does not copy): a"
    " probe forked just now did. The ranks would hang there, on the CPU workers and any emulated stage. Start the"
    " ranks with start_method='popen' (from a script), or 'forkserver' or 'spawn' (with the model's class"
    " importable), or restart the Python process (the notebook's kernel) and fit before any other torch work, or"
    " call `torch.set_num_threads(1)` before that work."
)


def _parallel_op() -> None:
    torch.set_num_threads(2)
    torch.ones(1 << 17).sum()  # above torch's grain size: run by an OpenMP team of two


def forked_threads_work(timeout: float = 10.0) -> bool:
    """Whether a process forked from this one can run a multi-threaded torch operation: not where
    this process has run one (GNU OpenMP's thread pool outlives its work, and a forked child waits
    for pool threads it does not have). A forked probe runs one, and is killed after ``timeout`` s."""
    probe = mp.get_context("fork").Process(target=_parallel_op, daemon=True)
    probe.start()
    probe.join(timeout)
    if probe.is_alive():
        probe.kill()
        probe.join()
        return False
    return True


class _ResultsFile(NamedTuple):
    """Where global rank 0 of a fork or spawn launch wrote the trainer call's results for the main process."""

    path: str

    def take(self) -> Any:
        """The results, read once: the file and its folder go."""
        try:
            return torch.load(self.path, weights_only=False)  # written by our own rank 0
        finally:
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


class _Terminated(NamedTuple):
    """What global rank 0 returns to the main process (fork, spawn) when a SIGTERM ended the run."""

    output: Any


class _Processes(_MultiProcessingLauncher):
    """Lightning's fork/spawn launcher, returning rank 0's results as bytes and weights in their trained precision.

    Results travel as bytes so that no tensor depends on the shared memory of a process that has
    exited, which is why Lightning itself refuses to return predictions from launchers of this kind.
    """

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        # Lightning's launch, with `_join` in place of torch's join, which asks the processes left
        # to end with SIGTERM and waits 30 s before it kills them.
        if self._start_method in ("fork", "forkserver"):
            _check_bad_cuda_fork()  # Lightning's: whether this process is itself a bad fork
            if self._start_method == "fork" and torch.cuda.is_initialized():  # whether its children would be
                raise RuntimeError(_CUDA_STARTED_BEFORE_FORK)
            if self._start_method == "fork" and not forked_threads_work():
                raise RuntimeError(_THREADS_AFTER_FORK)
        if self._start_method == "spawn":
            _check_missing_main_guard()
        if self._already_fit and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            raise NotImplementedError(
                "Calling `trainer.fit()` twice on the same Trainer with the fork, spawn or forkserver start method is"
                " not supported. Create a new Trainer and pass `fit(ckpt_path=...)`."
            )
        assert self._strategy.cluster_environment is not None
        os.environ["MASTER_PORT"] = str(self._strategy.cluster_environment.main_port)
        if self._start_method == "forkserver" and trainer is not None:
            _preload_forkserver(trainer.lightning_module)
        return_queue = mp.get_context(self._start_method).SimpleQueue()
        process_args = [trainer, function, args, kwargs, return_queue]
        if self._start_method == "spawn":
            process_args.append(_GlobalStateSnapshot.capture())
        with _frozen_for_fork(self._start_method):
            context = mp.start_processes(
                self._wrapping_function,
                args=process_args,
                nprocs=self._strategy.num_processes,
                start_method=self._start_method,
                join=False,
            )
        self.procs = context.processes
        with _passing_sigterm_to(context.processes):
            try:
                _join(context, self._strategy.rank_name)
            except BaseException:  # Ctrl-C here (or a failure): the processes must not train on
                _stop([p for p in context.processes if p.is_alive()], grace=0.0)
                raise
        if return_queue.empty():
            raise RuntimeError(
                "[hetero] Every process ended without a failure, but global rank 0 returned no result: a rank left"
                " the trainer call by `sys.exit`."
            )
        worker_output = return_queue.get()
        terminated = isinstance(worker_output, _Terminated)
        if terminated:
            worker_output = worker_output.output
        if trainer is None:
            return worker_output
        self._already_fit |= trainer.state.fn == TrainerFn.FITTING
        self._recover_results_in_main_process(worker_output, trainer)
        results = worker_output.trainer_results.take()
        if terminated:
            raise SIGTERMException()  # every rank ended at the same step after a SIGTERM (`signals.py`)
        return results

    @override
    def _wrapping_function(self, process_idx: int, trainer: Any, function: Callable, args: Any, kwargs: Any, *rest: Any) -> None:
        # spawn and forkserver hand every child the model's CPU tensors in shared memory; Lightning
        # copies them apart only for its CPUAccelerator. Each rank must own its parameters.
        if self._start_method in ("spawn", "forkserver"):
            args, kwargs = _disable_module_memory_sharing((args, kwargs))
        if self._start_method == "fork":
            _forget_compile_pools()
        failed = True
        try:
            super()._wrapping_function(process_idx, trainer, function, args, kwargs, *rest)
            failed = False
        except SIGTERMException:
            # Every rank raises it at the same step (`signals.py`). Each ends its call as a finished one
            # (every rank then holds the whole model), rank 0 hands the main process what it trained so
            # far, and `fit` raises it there in turn (where the `on_exception` hooks run, as with
            # Lightning's spawn launch).
            assert trainer is not None
            trainer.strategy.refresh_replicas()  # as at the end of training: rank 0 may be a stale CPU worker
            trainer._teardown()
            output = self._collect_rank_zero_results(trainer, None)
            if process_idx == 0:
                rest[0].put(_Terminated(move_data_to_device(output, "cpu")))
        except BaseException as error:
            if _distributed_is_initialized():  # the error happened in this worker's run
                error.add_note(self._strategy.describe_rank())
            if isinstance(error, KeyboardInterrupt):  # torch's wrapper would end the process quietly, code 0
                raise RuntimeError("[hetero] This rank was interrupted (KeyboardInterrupt).") from error
            if isinstance(error, SystemExit):  # so would `sys.exit(0)`, which only a finished rank may seem to do
                raise RuntimeError(
                    f"[hetero] This rank left the trainer call by `sys.exit({error.code})` while the others ran on; end a"
                    " run early on every rank alike (`trainer.should_stop = True` everywhere)."
                ) from error
            raise
        finally:
            _finish_wandb_run(failed)

    @override
    def _collect_rank_zero_results(self, trainer: "pl.Trainer", results: Any) -> Any:
        # The results (predictions: any size) go through a file, as Lightning's weights do: the queue
        # to the main process is a pipe that holds 64 KiB, and the main process reads it only once
        # every rank has ended, so a larger put would never return.
        output = super()._collect_rank_zero_results(trainer, results)
        if output is None:
            return None
        path = os.path.join(tempfile.mkdtemp(prefix="hetero-results-"), "results.pt")
        torch.save(output.trainer_results, path)
        return output._replace(trainer_results=_ResultsFile(path))

    @override
    def _recover_results_in_main_process(self, worker_output: Any, trainer: "pl.Trainer") -> None:
        if worker_output.weights_path is None:
            return super()._recover_results_in_main_process(worker_output, trainer)
        module = trainer.lightning_module
        module.configure_model()  # layers built there exist only in the workers so far (the hook is idempotent)
        trainer.strategy.precision_plugin.convert_module(module)
        with _loading_as_trained(module):
            super()._recover_results_in_main_process(worker_output, trainer)


@contextmanager
def _loading_as_trained(module: LightningModule) -> Iterator[None]:
    """Lightning loads the trained weights into this process's model leniently (its layers may differ
    from the ranks'), through the run's checkpoint IO. Each tensor takes the dtype it trained in (a
    layer the model keeps in float32 under `bf16-true`, cast after the precision's conversion, would be
    rounded into this process's converted copy), and the weights the model here has no place for are
    named, which would be lost without a word."""
    load = module.load_state_dict

    def told(state_dict: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        for name, tensor in module.state_dict(keep_vars=True).items():
            trained = state_dict.get(name)
            if isinstance(trained, Tensor) and tensor.is_floating_point() and trained.dtype != tensor.dtype:
                tensor.data = tensor.data.to(trained.dtype)  # in place: the same parameter, ties kept
        result = load(state_dict, *args, **kwargs)
        # A `load_state_dict` of the model's own may return nothing.
        lost, kept = getattr(result, "unexpected_keys", ()), getattr(result, "missing_keys", ())
        if lost or kept:
            said = [f"has no {_some(lost)}, which the strategy's processes trained"] if lost else []
            said += [f"got no trained value for {_some(kept)}, which keep the values they had before the call"] if kept else []
            warnings.warn(
                f"`{type(module).__name__}` in this process {', and '.join(said)}: the model's weights are named"
                " otherwise here than in the processes. Layers built in `setup` (or another hook that runs only there)"
                " exist only in them, and a callback that reparametrizes layers there renames their weights"
                " (`ModelPruning(make_pruning_permanent=False)`: `weight_orig`, `weight_mask`). Build layers in"
                " `__init__` or `configure_model`, which this process runs too, or use `start_method='popen'`, where"
                " this process is rank 0."
            )
        return result

    module.load_state_dict = told  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.load_state_dict


def _model_callbacks(model: LightningModule) -> list:
    """The callbacks the model's ``configure_callbacks`` gives, which Lightning adds in each process
    (so that they are checked here too, before any starts; where the hook needs the Trainer, which
    the model has only in the processes, none)."""
    if not is_overridden("configure_callbacks", model):
        return []
    try:
        callbacks = model.configure_callbacks()
    except Exception:  # noqa: BLE001 - a hook that reads `self.trainer`, not attached yet: the processes check it
        return []
    return list(callbacks) if isinstance(callbacks, Sequence) else [callbacks]


def _check_pipeline_callbacks(callbacks: Sequence[Any]) -> None:
    """Refuse the callbacks that need every parameter's values on every rank, which a pipeline's
    stages do not hold while training (the other stages' layers are on the meta device there)."""
    for callback in callbacks:
        name = type(callback).__name__
        if isinstance(callback, (StochasticWeightAveraging, WeightAveraging, ModelPruning)):
            what = "prunes" if isinstance(callback, ModelPruning) else "averages"
            raise ValueError(
                f"`{name}` {what} every parameter of the model on every rank, but in a pipeline a stage holds only"
                " its own layers while training (the others' exist on the meta device there). Train the model as"
                " replicas (`parallelism='replicas'`), where it works, or leave it out."
            )
        if isinstance(callback, BaseFinetuning):
            raise ValueError(
                f"`{name}` unfreezes layers with `BaseFinetuning.unfreeze_and_add_param_group`, which compares the"
                " values of every parameter of the model with the optimizer's, but in a pipeline a stage holds only"
                " its own layers while training (the others' exist on the meta device there). Train the model as"
                " replicas (`parallelism='replicas'`), where it works, or unfreeze in a hook of the model or a"
                " callback of your own: `requires_grad_(True)` on the layers, then `optimizer.add_param_group(...)`."
            )


def _preload_forkserver(module: Optional[LightningModule]) -> None:
    """Have the forkserver import torch, Lightning, this package and the model's module once, where it
    starts (at the process's first forkserver launch): every rank it forks after that starts with
    them imported, in a fraction of a second instead of a spawned rank's seconds. The server is a new
    interpreter, so it is safe after this process started CUDA, as spawn is. Its objects are frozen
    last, so that its ranks leave them out of their garbage collections (``_frozen_for_fork``)."""
    origin = type(module).__module__ if module is not None else "__main__"
    preload_forkserver([origin] if origin != "__main__" else [])  # the server cannot import the main module by name


def preload_forkserver(modules: Sequence[str]) -> None:
    """Have the forkserver, where it starts, import this package, then ``modules``, then freeze its
    objects (``_preload_forkserver``; also for other strategies' ranks that share the forkserver)."""
    preload = ["lightning_hetero", *modules, "lightning_hetero._forkserver_freeze"]
    mp.get_context("forkserver").set_forkserver_preload(preload)


@contextmanager
def _frozen_for_fork(start_method: str) -> Iterator[None]:
    """Forks made inside leave the objects this process holds out of their garbage collections.

    A forked rank inherits every object of the main process (about 400,000 once torch and
    Lightning are imported). Its first full collection, which comes in its first training steps,
    walks all of them and writes to each one's header: 0.3 s in which the rank stops (0.2 s in the
    main process, which owns those pages), and a private copy of every page they sit on. As
    Python's documentation of ``gc.freeze`` advises before a fork, they are frozen while the ranks
    are forked: the ranks never walk them, and the main process unfreezes its own straight after.
    Where something here has frozen objects already, it manages that itself and is left alone.
    """
    if start_method != "fork" or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def _passing_sigterm_to(processes: Sequence[Any]) -> Iterator[None]:
    """While the main process of a fork/spawn launch waits for its ranks, a SIGTERM it gets (a ``kill``
    of the script) goes on to them: they end at the same step (``signals.py``), and ``fit`` raises it
    here in turn. (By default it would end this process alone, and the ranks would train on.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def to_ranks(signum: int, frame: Any) -> None:
        pass_on(signum, [p.pid for p in processes if p.pid is not None and p.is_alive()])

    previous = signal.signal(signal.SIGTERM, to_ranks)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _forget_compile_pools() -> None:
    """In a forked process: the thread pool ``torch.compile`` compiles its kernels in, where the parent
    has made it, is the parent's (its threads were not forked), and a compilation here would wait on
    it forever; let this process make its own. (torch resets its process pool after a fork itself.)"""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    cache_clear = getattr(getattr(getattr(async_compile, "AsyncCompile", None), "pool", None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


def _warn_of_encoder_norms_over_nodes(model: LightningModule) -> None:
    """Several nodes, ``sync_batchnorm=True``: an encoder's BatchNorm sums over every worker with a
    share, and a worker whose share carries none of its modality does not call it."""
    normed = [m for m, encoder in modality_encoders(model).items() if has_batch_norm(encoder)]
    if normed:
        warnings.warn(
            f"`sync_batchnorm=True` on several nodes: the BatchNorm of encoder {normed[0]!r} takes its statistics"
            " over every worker with a share of a batch, and a worker whose share carries no input of that modality"
            " does not call it, so the others would wait for it until the timeout. Give every share every"
            " modality (or one node: there the statistics follow the modality's rows), or keep `sync_batchnorm` off."
        )


def _some(names: Sequence[str]) -> str:
    return f"{list(names[:5])}{' ...' if len(names) > 5 else ''}"


def _check_checkpoint_path(function: Callable, args: tuple, kwargs: dict, io: Any) -> None:
    """A trainer call's ``ckpt_path`` that names a local file that is not there: refused here, as a plain
    Trainer refuses it (``FileNotFoundError``), not by every process once they have started. Only where
    the run's checkpoint IO reads the path as a file (a CheckpointIO of one's own may read it otherwise)."""
    if not isinstance(io, TorchCheckpointIO) or type(io).load_checkpoint is not TorchCheckpointIO.load_checkpoint:
        return
    try:
        path = inspect.signature(function).bind(*args, **kwargs).arguments.get("ckpt_path")
    except (TypeError, ValueError):
        return
    if not isinstance(path, (str, os.PathLike)):
        return
    text = os.fspath(path)
    if text in ("last", "best", "hpc") or text.startswith("registry") or "://" in text:
        return  # Lightning finds these itself, or another filesystem holds them
    if not get_filesystem(text).exists(text):  # as Lightning's checkpoint IO looks for it (`~` expanded)
        raise FileNotFoundError(f"Checkpoint file not found: {text}")


def _check_main_guard(start_method: str) -> None:
    """A spawned process imports the main script again, all of its top level: a Trainer started there,
    outside ``if __name__ == "__main__":``, would start again in every process, which Python refuses
    there. Said before any process starts, where the script's line shows which call it is."""
    main = sys.modules.get("__main__")
    frame = sys._getframe()
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is getattr(main, "__dict__", None)):
        frame = frame.f_back
    path = getattr(main, "__file__", None)
    if frame is None or not path or not os.path.isfile(path):
        return  # not called from the script's top level (a function, a test, an interactive session)
    try:
        with open(path, encoding="utf-8") as file:
            tree = ast.parse(file.read(), path)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return
    line = frame.f_lineno
    statement = next((s for s in tree.body if s.lineno <= line <= (s.end_lineno or s.lineno)), None)
    if statement is None or _is_main_guard(statement):
        return
    raise RuntimeError(
        f"`start_method={start_method!r}` starts each process by importing your script again, and the Trainer is"
        f" started at its top level ({path}, line {line}), which every new process would run again. Put that code"
        ' under `if __name__ == "__main__":` (or in a function called from there), or use `start_method="fork"`'
        ' or "popen".'
    )


def _is_main_guard(statement: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` (either way round)."""
    if not isinstance(statement, ast.If) or not isinstance(statement.test, ast.Compare):
        return False
    test = statement.test
    sides = [test.left, *test.comparators]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    texts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return len(sides) == 2 and isinstance(test.ops[0], ast.Eq) and names == ["__name__"] and texts == ["__main__"]


def _join(context: ProcessContext, rank_name: Callable[[int], str]) -> None:
    """Wait for every process. When one fails, stop the others (``_stop``) and raise torch's
    exception for the one that caused the failure (``_cause``): its Python error, or the signal or
    exit code it ended with; notes name the others that failed, and those it had to kill
    (``rank_name`` names a process index, its local rank)."""
    waiting = dict(context.sentinels)  # sentinel -> process index
    while waiting:
        for sentinel in wait(list(waiting)):
            index = waiting.pop(sentinel)
            process = context.processes[index]
            process.join()
            if process.exitcode == 0:
                continue
            log.debug("hetero: process %d exited with code %s; stopping the others", index, process.exitcode)
            killed = _stop([context.processes[i] for i in waiting.values()])
            failed = [i for i, p in enumerate(context.processes) if p.exitcode and p not in killed]
            index = _cause(context, [index, *(i for i in failed if i != index)])
            # torch's join raises for the first failed process among those it waits for: the cause.
            context.sentinels = {context.processes[index].sentinel: index}
            try:
                context.join()
            except ProcessException as error:
                others = [f"{rank_name(i)}: {_last_line(context, i)}" for i in failed if i != index]
                if others:
                    error.add_note(f"[hetero] Failed too, after it: {'; '.join(others)}.")
                if killed:
                    error.add_note(_killed_note([rank_name(context.processes.index(p)) for p in killed]))
                raise


PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
)
"""What a collective raises on a process when another one of the run has ended: a consequence."""


def _cause(context: ProcessContext, failed: list[int]) -> int:
    """Which of the ``failed`` processes (the first heard of first) caused the others to fail: one a
    signal ended by itself (a kill, a crash), else one with an error of its own, else one that ended
    without a Python error (an abort: NCCL's watchdog aborts a process whose peer has gone), else
    the first heard of. A forkserver reports a child's end through the server, so a rank killed
    first can be heard of after the ranks its death broke."""
    codes = {i: context.processes[i].exitcode for i in failed}
    texts = {i: _error_text(context, i) for i in failed}
    signalled = [i for i in failed if codes[i] < 0 and codes[i] != -signal.SIGABRT]
    own = [i for i in failed if texts[i] and not any(marker in texts[i] for marker in PEER_LOST)]
    silent = [i for i in failed if not texts[i]]
    return (signalled or own or silent or failed)[0]


def _error_text(context: ProcessContext, index: int) -> str:
    """The traceback a process's Python error left in its error file (torch's ``_wrap``), or ""."""
    try:
        with open(context.error_files[index], "rb") as file:
            return str(pickle.load(file))
    except (OSError, EOFError, pickle.UnpicklingError):
        return ""


def _last_line(context: ProcessContext, index: int) -> str:
    """A process's error, as its traceback's last line says it (the notes this package adds left out)."""
    text = _error_text(context, index)
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("[hetero]")]
    return lines[-1].rstrip(".") if lines else describe_exit(context.processes[index].exitcode)


def _stop(processes: Sequence[Any], grace: float = GRACE_S) -> list[Any]:
    """Give ``processes`` (``multiprocessing.Process`` or ``subprocess.Popen``) ``grace`` seconds to
    end by themselves, then kill those left; return the ones it killed."""
    deadline = time.monotonic() + grace
    for process in processes:
        _wait(process, max(0.0, deadline - time.monotonic()))
    killed = [p for p in processes if _exit_code(p) is None]
    for process in killed:
        process.kill()
    for process in killed:
        _wait(process, None)
    return killed


def _killed_note(names: list[str]) -> str:
    return (
        f"[hetero] Still running {GRACE_S:g} s after that, and killed: {'; '.join(names)}. Where the error above is"
        " a timeout, these are the ranks that stopped taking part."
    )


def _wait(process: Any, timeout: Optional[float]) -> None:
    if isinstance(process, subprocess.Popen):
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    else:
        process.join(timeout)


def _exit_code(process: Any) -> Optional[int]:
    return process.poll() if isinstance(process, subprocess.Popen) else process.exitcode


def describe_exit(code: int) -> str:
    """How a process ended, from its exit code (negative: the signal that ended it)."""
    if code >= 0:
        return f"exited with code {code}"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    hint = {
        "SIGKILL": " (sent by a user, a scheduler, or the kernel when memory runs out)",
        "SIGSEGV": " (a crash in native code)",
        "SIGABRT": " (an abort in native code)",
    }
    return f"was killed by {name}{hint.get(name, '')}"


_STARTED: list[subprocess.Popen] = []
"""The processes this one started for the other local ranks (popen), local ranks 1, 2, ...: every
later trainer call runs in them, a new Trainer's included (the script runs it in each of them)."""


def started_other_ranks() -> bool:
    """Whether this process started the other local ranks' processes (popen) at an earlier trainer call."""
    return bool(_STARTED)


class _Script(_SubprocessScriptLauncher):
    """Lightning's popen launch, with a watch on the other ranks' processes (``_ChildWatch``):
    when one fails, the others are stopped, so this process's collectives fail at once and its
    error names the rank that failed. (Lightning's own observer kills this process too, silently.)
    The processes are this process's, not one launcher's (``_STARTED``): a new Trainer's call
    watches the ones the first call started."""

    def __init__(self, strategy: "HeteroStrategy") -> None:
        assert strategy.cluster_environment is not None
        super().__init__(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
        self.procs = list(_STARTED)
        self._strategy = strategy
        self.in_call = False

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.procs:  # the first trainer call (later ones run in the same processes)
            if self.cluster_environment.creates_processes_externally:  # a process a launch started
                _set_num_threads_if_needed(num_processes=self.num_processes)
                return function(*args, **kwargs)
            os.environ[READY_DIR_ENV] = tempfile.mkdtemp(prefix="hetero-ready-")  # the children inherit it
            atexit.register(shutil.rmtree, os.environ[READY_DIR_ENV], ignore_errors=True)
            self._call_children_scripts()
            _STARTED[:] = self.procs
        watch = _ChildWatch(self.procs, self._strategy)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        self.in_call = True
        try:
            return function(*args, **kwargs)
        except (SIGTERMException, _TunerExitException):
            # Every rank raises it at the same step (`signals.py`; the tuner's callbacks, where they
            # end the fit) and goes on to its `on_exception` hooks or its teardown, which need them
            # all: an orderly end, not a failure to stop.
            raise
        except BaseException as error:
            first = recorded_failures(range(1, self._strategy.world_size))
            watch.stop()
            if isinstance(error, RanksGone):  # it names them
                raise
            # A process killed by a signal records no error: the first error recorded may be another
            # rank's answer to its death, so the deaths come first (`failures`), and that error after them.
            signalled = watch.signalled()
            notes = watch.failures()
            if first:
                _, where, text = first[0]
                what = "The first error raised" if signalled else "The first failure"
                note = f"[hetero] {what}: {where} raised {text} (its traceback is printed above)."
                notes.insert(signalled, note)
            for note in notes:
                error.add_note(note)
            raise
        finally:
            self.in_call = False
            watch.close()

    def gone(self, first: Optional[int] = None) -> Optional[str]:
        """Which of the processes this one started have ended, for an error; ``None`` while all run.
        ``first``: the local rank that left first, named first whether or not it has ended yet."""
        ended = {rank: p.returncode for rank, p in enumerate(self.procs, 1) if p.poll() is not None}
        if not ended:
            return None
        parts = [f"{self._strategy.rank_name(first)} left the script first"] if first is not None else []
        if first in ended:
            parts[0] += f" and {describe_exit(ended.pop(first))}"
        return "; ".join(parts + [f"{self._strategy.rank_name(r)} {describe_exit(code)}" for r, code in ended.items()])


class _ChildWatch:
    """Watches the processes this one started for the other local ranks (popen): as soon as one
    fails, the others are stopped (``_stop``), and this process learns which failed and how."""

    POLL_S = 0.2

    def __init__(self, procs: list[subprocess.Popen], strategy: "HeteroStrategy") -> None:
        self._procs = procs  # local ranks 1, 2, ...
        self._strategy = strategy
        self._killed: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._run, name="hetero-child-watch", daemon=True).start()

    def _run(self) -> None:
        while not self._closed.wait(self.POLL_S):
            if any(p.poll() not in (None, 0) for p in self._procs):
                self.stop()
                return

    def stop(self) -> None:
        """Stop every process still running (after ``GRACE_S``); idempotent."""
        with self._lock:
            self._killed += _stop([p for p in self._procs if p.poll() is None])

    def signalled(self) -> int:
        """How many of the processes were killed by a signal this process did not send."""
        return sum(p.returncode is not None and p.returncode < 0 and p not in self._killed for p in self._procs)

    def failures(self) -> list[str]:
        """A line for each process that failed by itself (signals first: those are causes, not
        consequences), and one naming those it had to kill."""
        failed = [(r, p.returncode) for r, p in enumerate(self._procs, 1) if p.returncode and p not in self._killed]
        failed.sort(key=lambda item: item[1] >= 0)
        notes = [
            f"[hetero] {self._strategy.rank_name(rank)} {describe_exit(code)}"
            + (" (its error is printed above)." if code > 0 else ".")
            for rank, code in failed
        ]
        if self._killed:
            notes.append(_killed_note([self._strategy.rank_name(self._procs.index(p) + 1) for p in self._killed]))
        return notes

    def close(self) -> None:
        self._closed.set()


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
            self._launcher = _Script(strategy)
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
        environment = self._strategy.cluster_environment
        started_here = environment is None or not environment.creates_processes_externally
        if self._strategy.num_nodes > 1 and started_here and not {"NODE_RANK", "GROUP_RANK"} & set(os.environ):
            raise ValueError(
                f"`num_nodes={self._strategy.num_nodes}` needs this script started on every node: under torchrun or"
                " srun on each, or, with the strategy's own launch, with `NODE_RANK`, `MASTER_ADDR` and `MASTER_PORT`"
                " set on each (docs/launching.md). Here no node rank is set, and the other nodes would be waited for"
                " until the timeout."
            )
        if self.start_method in ("spawn", "forkserver"):
            _check_main_guard(self.start_method)
        model = args[0] if args and isinstance(args[0], LightningModule) else None
        if model is None and trainer is not None:
            model = trainer.lightning_module
        # A model that builds its layers in `configure_model` is checked in each process, after it has.
        if model is not None and not is_overridden("configure_model", model):
            self._strategy.check_model(model, cut_later=_plans_the_cut(trainer, self._strategy))
            if self._strategy.whole_batch_norm and self._strategy.num_nodes > 1:
                _warn_of_encoder_norms_over_nodes(model)
        if trainer is not None and model is not None:
            pipeline = self._strategy.plan.for_model(model).parallelism == "pipeline"
            callbacks = [*trainer.callbacks, *_model_callbacks(model)]
            if pipeline:
                _check_pipeline_callbacks(callbacks)
            if self._strategy.mode == "fine":
                check_fine_clipping(model)
            check_before_launch(trainer, model, args, pairs=pipeline)
            self._check_tuner(trainer, callbacks)
        _check_checkpoint_path(function, args, kwargs, self._strategy.checkpoint_io)
        log.debug("hetero: starting %d process(es) per node with %r", self._strategy.num_processes, self.start_method)
        try:
            results = self._launcher.launch(function, *args, trainer=trainer, **kwargs)
        except ProcessExitedException as error:  # a process ended without a Python error to tell why
            error.add_note(
                f"[hetero] {self._strategy.rank_name(error.error_index)} {describe_exit(error.exit_code)} in the"
                f" middle of the run; the other processes were stopped."
            )
            raise
        return results

    def _check_tuner(self, trainer: "pl.Trainer", callbacks: list) -> None:
        """``Tuner(trainer).lr_find`` and ``scale_batch_size`` end the fit in the processes, and the
        tuner reads its result there: a process this one started (fork, spawn) keeps it.

        The batch size finder is refused, as Lightning refuses it for DDP: each process would try
        batch sizes on its own (a GPU stage runs out of memory where a CPU worker does not, and the
        processes' trials part ways), and it restores its start from a file only one process writes."""
        finders = [c for c in callbacks if isinstance(c, BatchSizeFinder)]
        if finders:
            how = "`Tuner(trainer).scale_batch_size`" if finders[0]._early_exit else "The `BatchSizeFinder` callback"
            raise ValueError(
                f"{how} is not supported by the hetero strategy, as Lightning does not support it with DDP: each"
                " process would scale the batch on its own, and one that runs out of memory (a GPU stage) would part"
                " ways with the others. Find the batch size with a plain Trainer on one device (`Tuner(L.Trainer("
                "accelerator='gpu', devices=1)).scale_batch_size(model, ...)`), then train with that batch size."
            )
        if self.start_method == "popen":
            return
        tuning = [c for c in callbacks if isinstance(c, LearningRateFinder) and c._early_exit]
        if tuning:
            raise ValueError(
                f"`Tuner(trainer)`'s {type(tuning[0]).__name__} runs in the processes the strategy starts, and with"
                f" `start_method={self.start_method!r}` its result stays in them. Use `start_method='popen'` (the"
                " default outside notebooks), where this process is one of them, or add the"
                f" `{type(tuning[0]).__name__}` callback to the Trainer: it tunes in every process and trains on."
            )

    def ranks_gone(self) -> Optional[str]:
        """Which of the ranks this process started have ended (popen; ``None`` otherwise or while all run)."""
        return self._launcher.gone() if isinstance(self._launcher, _Script) else None

    def ranks_gone_between_calls(self) -> Optional[str]:
        """``ranks_gone``, outside a trainer call (inside one, the launch names them), after a
        collective failed: a rank that left the script closes its connections as it exits, and
        takes a few seconds more to end (2.5 s measured), so it is given ``EXIT_S``."""
        if not isinstance(self._launcher, _Script) or self._launcher.in_call:
            return None
        deadline = time.monotonic() + EXIT_S
        while self.ranks_gone() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._launcher.gone(first_to_leave(range(1, self._strategy.num_processes)))

    @override
    def kill(self, signum: _SIGNUM) -> None:
        self._launcher.kill(signum)
