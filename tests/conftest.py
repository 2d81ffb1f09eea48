from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path
from typing import Any, Literal

import lightning as L
import psutil
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

import lightning_hetero  # noqa: F401  (registers strategy="hetero")
from lightning_hetero import HeteroStrategy

# Collectives fail within this many seconds instead of hanging the suite when something is wrong.
TIMEOUT = 60

# The suite forks its workers (fast). A child forked after the parent ran multi-threaded OpenMP
# work can hang, so the test process itself stays single-threaded; the workers set their own.
torch.set_num_threads(1)


def hetero(**kwargs: Any) -> HeteroStrategy:
    """A hetero strategy on emulated CPU stages, forked, with a short collective timeout. Its CPU
    fraction stays where it starts (`cpu_fraction="auto"`'s start, each process's fair share of
    the cores) unless a test asks for "auto", which moves it while training."""
    kwargs.setdefault("start_method", "fork")
    kwargs.setdefault("stages", ["cpu", "cpu"])
    kwargs.setdefault("micro_batches", 2)
    kwargs.setdefault("timeout", TIMEOUT)
    if "plan" not in kwargs and "cpu_fraction" not in kwargs:
        kwargs["cpu_fraction"] = HeteroStrategy(**kwargs).cpu_fraction
    return HeteroStrategy(**kwargs)


def trainer(strategy: Any, log_dir: Path | None = None, **kwargs: Any) -> L.Trainer:
    """A quiet Trainer in float64; ``strategy=None`` is the plain single-process reference."""
    kwargs.setdefault("precision", "64-true")
    kwargs.setdefault("enable_checkpointing", False)
    kwargs.setdefault("enable_progress_bar", False)
    kwargs.setdefault("enable_model_summary", False)
    kwargs.setdefault("num_sanity_val_steps", 0)
    kwargs.setdefault("log_every_n_steps", 1)
    kwargs.setdefault("logger", CSVLogger(str(log_dir), name="", version="") if log_dir is not None else False)
    if strategy is None:
        return L.Trainer(accelerator="cpu", devices=1, **kwargs)
    return L.Trainer(strategy=strategy, **kwargs)


def max_param_diff(a: torch.nn.Module | dict, b: torch.nn.Module | dict) -> float:
    sa = a if isinstance(a, dict) else a.state_dict()
    sb = b if isinstance(b, dict) else b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)


@pytest.fixture
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any worker process is started."""
    import torch.multiprocessing as mp

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("worker processes were started before the bad input was reported")

    monkeypatch.setattr(mp, "start_processes", refuse)


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine reports one GPU: strategies on `cuda:0` are built and checked, and refused or
    stopped before anything runs there."""
    import lightning_hetero.accelerator
    import lightning_hetero.topology

    for module in (lightning_hetero.topology, lightning_hetero.accelerator):
        monkeypatch.setattr(module, "num_cuda_devices", lambda: 1)


class OptimizerMemory(L.Callback):
    """Every rank writes the elements of optimizer state it holds (tensors of one or more dimensions) to
    ``out/optimizer{global rank}.pt``: its offloaded bucket steps' (``offloaded``) and its optimizer's
    (``user``), and whether every offloaded step is split between the CPU workers (``sharded``)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning_hetero.offload import OffloadStep
        from lightning_hetero.sharding import ShardedStep

        def elements(states: Any) -> int:
            return sum(t.numel() for state in states for t in state.values() if torch.is_tensor(t) and t.dim() > 0)

        offloaded = [s for s in trainer.strategy.bucket_steps if isinstance(s, OffloadStep)]
        held = elements(state for s in offloaded if s.optimizer is not None for state in s.optimizer.state.values())
        user = elements(trainer.optimizers[0].state.values())
        sharded = all(isinstance(s, ShardedStep) for s in offloaded)
        torch.save({"offloaded": held, "user": user, "sharded": sharded}, self.out / f"optimizer{trainer.global_rank}.pt")


class RecordCopies(L.Callback):
    """Every rank writes the parameters and buffers it holds after every training batch (invariant 3's evidence).

    A CPU worker with no share of a step keeps out of it (the strategy refreshes its replica
    before it is used again); its copies are not compared while they are stale."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        tensors = [*pl_module.named_parameters(), *pl_module.named_buffers()]  # BatchNorm's statistics too
        held = {n: p.detach().cpu().clone() for n, p in tensors if not p.is_meta}
        self.steps.append(held if trainer.strategy.engine.replica_is_current else {})

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save(self.steps, self.out_dir / f"copies{trainer.global_rank}.pt")


def assert_copies_identical(out_dir: Path, tol: float = 0.0) -> list[float]:
    """After every step, every copy of every parameter is bit-identical on all ranks holding one
    (or, with ``tol``, within it: copies on a GPU and on the CPU, whose optimizer kernels round
    differently). Returns the largest difference after each step."""
    ranks = [torch.load(path) for path in sorted(out_dir.glob("copies*.pt"))]
    assert len(ranks) > 1 and all(len(r) == len(ranks[0]) > 0 for r in ranks)
    assert any(len(held) for r in ranks for held in r)
    largest = []
    for step in range(len(ranks[0])):
        seen: dict[str, torch.Tensor] = {}
        differences = [0.0]
        for held in ranks:
            for name, value in held[step].items():
                if name in seen:
                    differences.append((seen[name].double() - value.double()).abs().max().item() if value.numel() else 0.0)
                    assert differences[-1] <= tol if tol else torch.equal(seen[name], value), (
                        f"copies of {name} differ after batch {step} by {differences[-1]:.3g}"
                    )
                seen[name] = value
        largest.append(max(differences))
    return largest


class Fault(L.Callback):
    """Makes global rank ``rank`` fail in the middle of training step ``step`` (fault-injection tests):
    in the forward of the first layer with parameters it holds, the process kills itself with
    SIGKILL (``how="kill"``), raises ``RuntimeError("injected fault")`` (``"raise"``) or
    ``KeyboardInterrupt`` (``"interrupt"``), leaves by ``sys.exit(0)`` (``"exit"``), or hangs (``"hang"``). With ``once``, a marker file there makes it fail on the first attempt only.
    With ``at_start``, it fails as the step starts instead (a CPU worker with no share runs no forward)."""

    def __init__(
        self, rank: int, step: int, how: Literal["kill", "raise", "interrupt", "exit", "hang"], once: Path | None = None, at_start: bool = False
    ) -> None:
        self.rank, self.step, self.how, self.once, self.at_start = rank, step, how, once, at_start

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        if self.once is not None and self.once.exists():
            return
        if self.at_start:
            return self._fail()
        held = [m for m in pl_module.pipeline_layers() if any(not p.is_meta for p in m.parameters())]
        held[0].register_forward_hook(self._fail)

    def _fail(self, *args: Any) -> None:
        if self.once is not None:
            self.once.touch()
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.how == "hang":
            signal.pause()  # woken only by a signal: the launcher's kill
        if self.how == "interrupt":
            raise KeyboardInterrupt
        if self.how == "exit":
            sys.exit(0)
        raise RuntimeError("injected fault")


class SelfSignal(L.Callback):
    """Makes each of ``ranks`` (global ranks; ``None``: every rank) send itself ``signum`` once, in
    training step ``step``, each at its own point of the step: global rank r before the step
    (``r % 3 == 0``), after its backward (1) or after the step (2), as a signal sent to every
    process at once lands in each at a different point. Writes each rank's global step after every
    training batch to ``out_dir/step{rank}.txt``."""

    POINTS = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")

    def __init__(self, signum: int, step: int, out_dir: Path, ranks: list[int] | None = None, parent: bool = False) -> None:
        self.signum, self.step, self.out_dir, self.ranks, self.sent = signum, step, out_dir, ranks, False
        self.parent = parent  # send it to the process that started this one instead (a fork launch's main process)
        for point in self.POINTS:
            setattr(self, point, functools.partial(self._maybe_send, point))

    def _maybe_send(self, point: str, trainer: L.Trainer, *args: Any) -> None:
        rank = trainer.global_rank
        if point == "on_train_batch_end":  # whole or not at all: a rank may be killed while it writes
            written = self.out_dir / f".step{rank}.txt"
            written.write_text(str(trainer.global_step))
            os.replace(written, self.out_dir / f"step{rank}.txt")
        mine = self.ranks is None or rank in self.ranks
        if mine and not self.sent and trainer.global_step == self.step and point == self.POINTS[rank % 3]:
            self.sent = True
            os.kill(os.getppid() if self.parent else os.getpid(), self.signum)


def worker_processes() -> list[psutil.Process]:
    """This process's children, but for multiprocessing's own helpers (a forkserver, a resource
    tracker) that an earlier test in this session may have started, which live as long as it."""
    helpers = ("forkserver", "resource_tracker")
    return [p for p in psutil.Process().children(recursive=True) if not any(h in " ".join(p.cmdline()) for h in helpers)]
