"""On a machine with a GPU: the CPU beside the GPU against the GPU alone, and fine mode's offload
against the GPU alone and against torchao's offload, for the recipes' models and a larger GPT, each
measured side by side in one run.

- **CPU worker + GPU / GPU alone** (samples/s): plain Lightning on the GPU (``accelerator="gpu"``)
  against ``HeteroStrategy(stages=["cuda:0"])`` with one CPU worker (the cores the GPU's process
  leaves) and ``AdaptiveRebalancer``, which starts the CPU at 0 and gives it the share it earns.
  Measured over the second half of the run, once the rebalancer has settled. The goal is never
  below 1.00: where the CPU does not help, its share falls to 0.
- **Where the rebalanced row's gap comes from**: the same with the CPU worker's share held at 0
  (``cpu_fraction=0.0``, no rebalancer), with its torch threads as the strategy gives them and with
  one (``cpu_threads=1``), the GPU stage under hetero with no CPU worker (``cpu_workers=0``), and
  plain Lightning on the GPU in a process of its own started as the stage's is, with its one torch
  thread (``child``): what the process costs, apart from what the strategy does.
- **Fine mode, every bucket offloaded / GPU alone**: step time, and the GPU's peak memory beside it
  (the optimizer state lives in CPU memory).
- **torchao's CPUOffloadOptimizer / GPU alone**: the same model under plain Lightning on the GPU,
  its optimizer wrapped in ``torchao.optim.CPUOffloadOptimizer`` (where torchao is installed).
- **DeepSpeed ZeRO-Offload**: the same model under Lightning's ``DeepSpeedStrategy`` (ZeRO stage 2,
  ``offload_optimizer=True``: the optimizer's state and step on the CPU, with DeepSpeed's
  ``DeepSpeedCPUAdam`` in place of the model's Adam or AdamW), where deepspeed is installed. Its CPU
  Adam is a C++ extension compiled at its first use (a C++ compiler and ninja are needed); where
  that fails, the row says why.

Each ratio is of median steps over the second half of the run, each step's wall time on the host of
the rank that drives the GPU; the note beside it gives the mean over the same steps (the wall clock
between the middle and the end, the GPU synchronized at both ends: a plain GPU run queues its kernels
ahead), the garbage collections that ran in them, and under hetero the GPU rank's step in parts, as
the strategy's own records time them (``PHASES``). A process's one full collection of the objects
torch and Lightning make takes a few hundred milliseconds: in a run of 100 steps of 4 ms that is
half again on the mean, and in a long run nothing. Hetero runs start their processes from a
forkserver, since this process has used CUDA (the GPU-alone runs). Where there is no CUDA device,
every row says so.

    python -m benchmarks.cuda [--steps N] [--repeats R] [--models NAME] [--configs gpu,idle,...]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import multiprocessing
import os
import statistics
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import torch
from torch.utils.data import DataLoader

from benchmarks.common import Row, step_times
from benchmarks.planner import digits_loader, token_loader
from lightning_hetero import HeteroStrategy
from lightning_hetero.callbacks import AdaptiveRebalancer
from lightning_hetero.launcher import _preload_forkserver

DEFAULTS = dict(steps=200, repeats=2)
NO_CUDA = "not run: no CUDA device on this machine"
NAMES = {
    "rebalanced": "CPU worker + GPU, rebalanced / GPU alone (samples/s)",
    "idle": "CPU worker idle + GPU / GPU alone (samples/s)",
    "idle1": "CPU worker idle with one torch thread + GPU / GPU alone (samples/s)",
    "alone": "the GPU stage alone under hetero / GPU alone (samples/s)",
    "child": "plain Lightning on the GPU in a forkserver process with one torch thread / GPU alone (samples/s)",
    "offload": "fine mode, every bucket offloaded / GPU alone (step time)",
    "torchao": "fine mode, every bucket offloaded / torchao CPUOffloadOptimizer (step time)",
    "deepspeed": "fine mode, every bucket offloaded / DeepSpeed ZeRO-Offload, stage 2 (step time)",
}


PHASES = ("compute", "optimizer", "wait", "data", "total")
"""The parts of a step that the strategy's own records time (``StepRecord``), shown in the notes:
the share's forward and backward (on a GPU, its time on the device), the optimizer step, sharing
the step's results (the exchange and logging them through Lightning), the time between steps
(loading, the training loop's own work), and the whole step."""


class Facts(L.Callback):
    """Each rank writes, at the end of the fit, its CPU fraction, threads, peak GPU memory and whether
    it started CUDA, and over the steps from the middle of the run to its end: the mean step (the
    wall clock between the two, the GPU synchronized at both ends), the median step (each step's
    wall time on the host), the garbage collections that ran, with their time, and under hetero the
    median of each part of a step its records time (``PHASES``). A one-off full collection of a
    process's objects (a few hundred milliseconds where torch and Lightning are imported) weighs in
    a short run's mean as a few milliseconds a step, and in its median not at all."""

    def __init__(self, out: Path, start: int) -> None:
        self.out, self.start = out, start
        self._t0: float | None = None
        self._ends: list[float] = []
        self._collections: list[tuple[int, float]] = []
        self._collecting: float | None = None

    @staticmethod
    def _now(trainer: L.Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        return time.perf_counter()

    def _collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._collecting = time.perf_counter()
        elif self._collecting is not None:
            self._collections.append((info["generation"], time.perf_counter() - self._collecting))
            self._collecting = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.start and self._t0 is None:
            self._t0 = self._now(trainer)
            self._ends = [self._t0]
            gc.callbacks.append(self._collection)
        elif self._t0 is not None:
            self._ends.append(time.perf_counter())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        cuda = trainer.strategy.root_device.type == "cuda"
        end = self._now(trainer)
        if self._collection in gc.callbacks:
            gc.callbacks.remove(self._collection)
        steps = [b - a for a, b in zip(self._ends, self._ends[1:])]
        facts = {
            "device": trainer.strategy.root_device.type,
            "fraction": getattr(trainer.strategy, "cpu_fraction", 0.0),
            "threads": torch.get_num_threads(),
            "peak_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
            "cuda_started": torch.cuda.is_initialized(),  # on a CPU worker: a CUDA context it holds for nothing
            "step": (end - self._t0) / (trainer.global_step - self.start) if self._t0 is not None else None,
            "median_step": statistics.median(steps) if steps else None,
            "gc_ms": 1e3 * sum(seconds for _, seconds in self._collections),
            "full_gcs": sum(generation == 2 for generation, _ in self._collections),
            "phases_ms": self._median_phases(trainer),
        }
        (self.out / f"facts{trainer.global_rank}.json").write_text(json.dumps(facts))

    def _median_phases(self, trainer: L.Trainer) -> dict[str, float] | None:
        """Under hetero, the median of each of ``PHASES`` over this rank's records of the window."""
        records = [r for r in getattr(trainer.strategy, "step_records", []) if r.step >= self.start]
        if not records:
            return None
        return {kind: 1e3 * statistics.median(getattr(r, kind) for r in records) for kind in PHASES}


class SyncProbe(L.Callback):
    """On a rank that trains on a GPU: every call that made the CPU wait for the GPU during the
    steps ``first`` to ``last - 1`` (torch's sync debug mode), printed at ``last`` with where it was
    made and how many times a step. A plain GPU run queues its steps ahead and waits only where
    asked; each wait in a hetero step is GPU time the next step's Python no longer hides."""

    def __init__(self, name: str, first: int, last: int) -> None:
        self.name, self.first, self.last = name, first, last
        self.sites: Counter[str] = Counter()
        self._saved: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.strategy.root_device.type != "cuda":
            return
        if trainer.global_step == self.first and self._saved is None:
            self._saved = (warnings.showwarning, warnings.filters[:])
            warnings.simplefilter("always")
            warnings.showwarning = self._note
            torch.cuda.set_sync_debug_mode("warn")
        elif trainer.global_step == self.last and self._saved is not None:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning, warnings.filters[:] = self._saved
            steps = self.last - self.first
            print(f"{self.name}, rank {trainer.global_rank}: waits for the GPU per step, by where they were made", flush=True)
            for site, count in self.sites.most_common() or [("none", 0)]:
                print(f"  {count / steps:5.1f}  {site}", flush=True)

    def _note(self, message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if "synchroniz" not in str(message):
            return self._saved[0](message, category, filename, lineno, *rest)
        stack = traceback.extract_stack()[:-1]
        if any(f.name == "set_sync_debug_mode" for f in stack):  # switching the mode on, not the step
            return None
        # The innermost frames of the library, Lightning and torch's Python that led to the wait.
        frames = [f for f in stack if "benchmarks" not in f.filename and "warnings" not in f.filename]
        self.sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))] += 1


def models(smoke: bool) -> list[tuple[str, Callable[[], L.LightningModule], Callable[[int], DataLoader]]]:
    """(name, model, loader of ``n`` batches) for the recipes' models and a larger GPT."""
    from recipes.gpt import GPT
    from recipes.mlp import DigitsMLP

    if smoke:
        return [("GPT (tiny)", lambda: GPT(width=32, heads=2, layers=2), lambda n: token_loader(8 * n, 8))]
    return [
        ("MLP recipe (digits), batch 100", DigitsMLP, lambda n: digits_loader(100 * n, 100)),
        ("GPT recipe (small), batch 32", GPT, lambda n: token_loader(32 * n, 32)),
        (
            "GPT, 8 blocks of width 512, context 256, batch 32",
            lambda: GPT(vocab_size=8000, context=256, width=512, layers=8, heads=8),
            lambda n: token_loader(32 * n, 32, vocab=8000, context=256),
        ),
    ]


def with_torchao_offload(model: L.LightningModule) -> L.LightningModule:
    """``model`` with the optimizer its ``configure_optimizers`` returns rebuilt inside torchao's
    ``CPUOffloadOptimizer`` (same class and hyperparameters; the optimizer steps on the CPU)."""
    from torchao.optim import CPUOffloadOptimizer

    own = model.configure_optimizers

    def configure_optimizers() -> Any:
        optimizer = own()
        hyper = {k: v for k, v in optimizer.defaults.items() if k in ("lr", "betas", "eps", "weight_decay")}
        offloaded = CPUOffloadOptimizer(model.parameters(), type(optimizer), **hyper)
        # It skips Optimizer.__init__, so it lacks the two attributes Lightning checks an optimizer for.
        offloaded.defaults, offloaded.state = dict(optimizer.defaults), {}
        return offloaded

    model.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    return model


def with_deepspeed_cpu_adam(model: L.LightningModule) -> L.LightningModule:
    """``model`` with its Adam or AdamW rebuilt as DeepSpeed's ``DeepSpeedCPUAdam`` (same
    hyperparameters), the optimizer ZeRO-Offload steps on the CPU (DeepSpeed refuses a torch one there)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    own = model.configure_optimizers

    def configure_optimizers() -> Any:
        optimizer = own()
        hyper = {k: v for k, v in optimizer.defaults.items() if k in ("lr", "betas", "eps", "weight_decay")}
        return DeepSpeedCPUAdam(model.parameters(), adamw_mode=isinstance(optimizer, torch.optim.AdamW), **hyper)

    model.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    return model


def _deepspeed(model: L.LightningModule, loader: DataLoader, steps: int) -> dict[str, Any]:
    """ZeRO-Offload's run, in this process (DeepSpeed starts a process group of one, taken down after)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    # Lightning's DeepSpeedStrategy sets RANK, WORLD_SIZE and LOCAL_RANK in this process's
    # environment, after which a fit takes its processes as launched from outside and waits for them.
    with mock.patch.dict(os.environ):
        try:
            return _run(DeepSpeedStrategy(stage=2, offload_optimizer=True), with_deepspeed_cpu_adam(model), loader, steps)
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


def _run(strategy: Any, model: L.LightningModule, loader: DataLoader, steps: int, accelerator: str = "gpu", **kwargs: Any) -> dict[str, Any]:
    """The second half of a fit: its median step and its mean step on the rank that drives the GPU
    (``Facts``; rank 0 where none does), and every rank's facts. A strategy other than hetero's
    trains on one ``accelerator`` device in this process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        if not isinstance(strategy, HeteroStrategy):
            if accelerator == "gpu":
                torch.cuda.reset_peak_memory_stats()
            kwargs.update(accelerator=accelerator, devices=1)
        callbacks = [Facts(out, start=steps // 2), *kwargs.pop("callbacks", [])]
        step_times(strategy, model, loader, steps, callbacks=callbacks, **kwargs)
        facts = [json.loads(p.read_text()) for p in sorted(out.glob("facts*.json"))]
    driver = _driver(facts)
    return {"median": driver["median_step"], "step": driver["step"], "facts": facts}


def _driver(facts: list[dict[str, Any]]) -> dict[str, Any]:
    """Of a run's ranks' facts, those of the rank that drives the GPU (rank 0's where none does)."""
    return next((f for f in facts if f["device"] == "cuda"), facts[0])


def _plain_in_child(model: int, steps: int, smoke: bool, accelerator: str, callbacks: list) -> dict[str, Any]:
    torch.set_num_threads(1)  # as the strategy gives a GPU stage's process (`topology.threads_for`)
    _, build, loader = models(smoke)[model]
    return _run(None, build(), loader(steps), steps, accelerator=accelerator, callbacks=callbacks)


def plain_in_child(
    model: int, steps: int, smoke: bool = False, accelerator: str = "gpu", callbacks: list | None = None, start_method: str = "forkserver"
) -> dict[str, Any]:
    """The plain run of ``models(smoke)[model]``, in a process of its own started from a forkserver
    with one torch thread: what the GPU stage's process is, without the strategy. Beside the GPU
    alone in this process and the GPU stage alone under hetero, it splits the stage's gap into what
    the process costs and what the strategy does. The forkserver is the one hetero's runs use: where
    this starts it, it preloads what theirs would (and they then find it running). ``start_method``:
    another, for a test (a process has one forkserver, whose preload its first user sets)."""
    if start_method == "forkserver":
        _preload_forkserver(models(smoke)[model][1]())
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context(start_method)) as pool:
        return pool.submit(_plain_in_child, model, steps, smoke, accelerator, list(callbacks or [])).result()


def measure(steps: int, repeats: int, smoke: bool = False, only: str = "", configs: str = "") -> Iterator[dict[str, Any]]:
    """Per model (those whose name holds ``only``), as each is measured: every configuration's runs
    (those named in ``configs``, comma-separated, where given; ``gpu`` always), alternated."""
    for index, (name, model, loader) in enumerate(models(smoke)):
        if only not in name:
            continue
        every = max(4, steps // 20)  # the rebalancer measures every_n_steps - warmup_steps (2) steps a decision
        def idle(**kwargs: Any) -> Callable[[], Any]:
            strategy = partial(HeteroStrategy, stages=["cuda:0"], cpu_fraction=0.0, start_method="forkserver", **kwargs)
            return lambda: _run(strategy(), model(), loader(steps), steps)

        runners: dict[str, Callable[[], Any]] = {
            "gpu": lambda: _run(None, model(), loader(steps), steps),
            "child": lambda: plain_in_child(index, steps, smoke),
            "rebalanced": lambda: _run(
                HeteroStrategy(stages=["cuda:0"], cpu_workers=1, start_method="forkserver"),
                model(),
                loader(steps),
                steps,
                callbacks=[AdaptiveRebalancer(every_n_steps=every)],
            ),
            "idle": idle(cpu_workers=1),
            "idle1": idle(cpu_workers=1, cpu_threads=1),
            "alone": idle(cpu_workers=0),
            "offload": lambda: _run(
                HeteroStrategy(stages=["cuda:0"], cpu_workers=0, mode="fine", offload="all", start_method="forkserver"),
                model(),
                loader(steps),
                steps,
            ),
        }
        if importlib.util.find_spec("torchao") is not None:
            runners["torchao"] = lambda: _run(None, with_torchao_offload(model()), loader(steps), steps)
        if importlib.util.find_spec("deepspeed") is not None:
            runners["deepspeed"] = lambda: _deepspeed(model(), loader(steps), steps)
        wanted = set(configs.split(",")) | {"gpu"} if configs else set(runners)
        runs: dict[str, list[Any]] = {name: [] for name in runners if name in wanted}
        for _ in range(repeats):
            for config in runs:
                run = runners[config]
                started = time.perf_counter()
                if config in PEERS:  # a peer that fails says why in its row; the others go on
                    try:
                        runs[config].append(run())
                    except Exception as error:
                        runs[config].append(f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}")
                else:
                    runs[config].append(run())
                print(f"{name}: {config} took {time.perf_counter() - started:.0f} s", flush=True)
        yield {"model": name, **runs}


PEERS = ("torchao", "deepspeed")


def _peak(runs: list[dict[str, Any]]) -> float:
    """The median over runs of the GPU rank's peak memory (MB)."""
    return statistics.median(_driver(run["facts"])["peak_mb"] for run in runs)


def _collections(runs: list[dict[str, Any]]) -> str:
    """The full garbage collections in the runs' windows on the rank that drives the GPU, and their time."""
    driver = [_driver(run["facts"]) for run in runs]
    return f"{sum(f['full_gcs'] for f in driver)} full GC(s), {sum(f['gc_ms'] for f in driver):.0f} ms of GC"


def _phases(runs: list[dict[str, Any]]) -> str:
    """Under hetero, the median over runs of each part of the GPU rank's median step (``PHASES``)."""
    phases = [_driver(run["facts"]).get("phases_ms") for run in runs]
    if not all(phases):
        return ""
    parts = ", ".join(f"{kind} {statistics.median(p[kind] for p in phases):.2f}" for kind in PHASES)
    return f"; the GPU rank's step in ms: {parts}"


def model_rows(r: dict[str, Any]) -> list[Row]:
    """The rows of one model's measurements (a peer that failed: its error, in place of its numbers).
    Each ratio is of median steps (``Facts``); the note gives the means over the window beside them,
    and the garbage collections that ran there, which a short run's mean weighs and a long run's does not."""
    failed = {config: next(run for run in runs if isinstance(run, str)) for config, runs in r.items()
              if config in PEERS and any(isinstance(run, str) for run in runs)}  # fmt: skip
    measured = {config: runs for config, runs in r.items() if config != "model" and config not in failed}
    step = {config: statistics.median(run["median"] for run in runs) for config, runs in measured.items()}
    mean = {config: statistics.median(run["step"] for run in runs) for config, runs in measured.items()}

    def against_gpu(config: str) -> str:
        return (
            f"median step {step[config] * 1e3:.2f} ms vs {step['gpu'] * 1e3:.2f} ms; means over the window"
            f" {mean[config] * 1e3:.2f} vs {mean['gpu'] * 1e3:.2f} ms ({mean['gpu'] / mean[config]:.3f});"
            f" {_collections(r[config])} vs {_collections(r['gpu'])}{_phases(r[config])}"
        )

    out = []
    if "rebalanced" in step:
        facts = r["rebalanced"][0]["facts"][0]
        fractions = ", ".join(f"{run['facts'][0]['fraction']:.2f}" for run in r["rebalanced"])
        out.append(
            Row("CUDA", f"{r['model']}: {NAMES['rebalanced']}", step["gpu"] / step["rebalanced"], ">= 1.00",
                f"{against_gpu('rebalanced')}; settled CPU fraction {fractions}; CPU worker threads {facts['threads']};"
                f" CUDA started on the CPU worker: {'yes' if facts['cuda_started'] else 'no'}")
        )  # fmt: skip
    for config in ("idle", "idle1", "alone", "child"):
        if config in step:
            threads = f"; CPU worker threads {r[config][0]['facts'][0]['threads']}" if config in ("idle", "idle1") else ""
            out.append(Row("CUDA", f"{r['model']}: {NAMES[config]}", step["gpu"] / step[config], "", against_gpu(config) + threads))
    if "offload" not in step:
        return out
    out.append(
        Row("CUDA", f"{r['model']}: {NAMES['offload']}", step["offload"] / step["gpu"], "",
            f"median step {step['offload'] * 1e3:.2f} ms vs {step['gpu'] * 1e3:.2f} ms; peak GPU memory"
            f" {_peak(r['offload']):.0f} MB offloaded vs {_peak(r['gpu']):.0f} MB")
    )  # fmt: skip
    for peer, label in (("torchao", "torchao"), ("deepspeed", "DeepSpeed")):
        if peer in step:
            out.append(
                Row("CUDA", f"{r['model']}: {NAMES[peer]}", step["offload"] / step[peer], "",
                    f"{label} median step {step[peer] * 1e3:.2f} ms, peak GPU memory {_peak(r[peer]):.0f} MB")
            )  # fmt: skip
        elif peer in failed:
            out.append(Row("CUDA", f"{r['model']}: {NAMES[peer]}", math.nan, "", f"not run: {failed[peer]}"))
        elif importlib.util.find_spec(peer) is None:
            out.append(Row("CUDA", f"{r['model']}: {NAMES[peer]}", math.nan, "", f"not run: {peer} is not installed"))
    return out


ANALYZER = "the analyzer's predicted / measured step time with a GPU stage"


def analyzer_row(steps: int = 60, smoke: bool = False) -> Row:
    """The workload analyzer on the small GPT with a GPU stage beside a CPU worker: the step it
    predicts for its plan (after its warm-up) against the step it then measures."""
    from benchmarks.planner import AnalyzerReport
    from lightning_hetero.callbacks import WorkloadAnalyzer
    from recipes.gpt import GPT

    warmup = 4 if smoke else 10
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        analyzer = WorkloadAnalyzer(warmup_steps=warmup, measure_steps=(steps - warmup) // 2, save_dir=tmp)
        # A fixed fraction (the analyzer plans it): `cpu_fraction="auto"` would rebalance away from the plan.
        strategy = HeteroStrategy(stages=["cuda:0"], cpu_workers=1, cpu_fraction=0.0, start_method="forkserver")
        model = GPT(width=32, heads=2, layers=2) if smoke else GPT()
        _run(strategy, model, token_loader(32 * steps, 32), steps, callbacks=[analyzer, AnalyzerReport(out)])
        report = json.loads(out.read_text())
    return Row("CUDA", ANALYZER, report["predicted"] / report["measured"], "",
               f"GPT recipe (small), batch 32: predicted {report['predicted'] * 1e3:.2f} ms (before training:"
               f" {report['planned'] * 1e3:.2f}), measured {report['measured'] * 1e3:.2f} ms; plan {report['plan']}")  # fmt: skip


def rows(smoke: bool = False, **sizes: int) -> list[Row]:
    if not torch.cuda.is_available():
        return [Row("CUDA", name, math.nan, "", NO_CUDA) for name in [*NAMES.values(), ANALYZER]]
    sizes = dict(steps=12, repeats=1) if smoke else {**DEFAULTS, **sizes}
    return [row for r in measure(**sizes, smoke=smoke) for row in model_rows(r)] + [analyzer_row(smoke=smoke)]


def profile(out: Path, steps: int = 40) -> None:
    """The small GPT's steps under torch's profiler (Lightning's ``PyTorchProfiler``), five steps
    near the end of each run: hetero on the GPU with the CPU worker idle (``cpu_fraction=0``), then
    the GPU alone. ``out/hetero`` and ``out/gpu`` get each rank's trace (for ui.perfetto.dev) and
    its table of operators: where the hetero step's time goes beside the GPU alone's. Then each
    again without the profiler, printing every wait for the GPU in three of its steps (``SyncProbe``)."""
    from lightning.pytorch.profilers import PyTorchProfiler

    from recipes.gpt import GPT

    # Forked, before this process touches CUDA: the profiler's schedule cannot be pickled for a forkserver.
    layouts = {"hetero": HeteroStrategy(stages=["cuda:0"], cpu_workers=1, cpu_fraction=0.0, start_method="fork"), "gpu": None}
    for name, strategy in layouts.items():
        schedule = torch.profiler.schedule(wait=steps - 8, warmup=2, active=5, repeat=1)
        profiler = PyTorchProfiler(dirpath=str(out / name), filename=name, export_to_chrome=True, schedule=schedule)
        run = _run(strategy, GPT(), token_loader(32 * steps, 32), steps, profiler=profiler)
        print(f"{name}: step {run['step'] * 1e3:.2f} ms; profile in {out / name}", flush=True)
    for name, strategy in layouts.items():
        strategy = HeteroStrategy(stages=["cuda:0"], cpu_workers=1, cpu_fraction=0.0, start_method="forkserver") if strategy else None
        _run(strategy, GPT(), token_loader(32 * steps, 32), steps, callbacks=[SyncProbe(name, steps - 6, steps - 3)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    parser.add_argument("--repeats", type=int, default=DEFAULTS["repeats"])
    parser.add_argument("--models", default="", help="only the models whose name holds this (e.g. 'GPT')")
    parser.add_argument("--configs", default="", help="only these configurations, comma-separated (e.g. 'idle,alone'; gpu always)")
    parser.add_argument("--no-analyzer", action="store_true", help="leave out the analyzer's row")
    parser.add_argument("--profile", type=Path, help="instead: profile the small GPT's steps, hetero and the GPU alone, into this folder")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return
    if args.profile is not None:
        profile(args.profile)
        return
    for r in measure(steps=args.steps, repeats=args.repeats, only=args.models, configs=args.configs):  # each model's rows once measured
        for row in model_rows(r):
            print(f"{row.configuration:100s} {row.ratio:7.3f}  {row.note}", flush=True)
    if not args.no_analyzer:
        row = analyzer_row()
        print(f"{row.configuration:100s} {row.ratio:7.3f}  {row.note}", flush=True)


if __name__ == "__main__":
    main()
