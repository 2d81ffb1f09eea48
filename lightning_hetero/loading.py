"""The CPU's cores are one budget: loading the batches, the CPU workers' compute, the stages' own.

Three consumers share a node's cores: the DataLoader's worker processes (decoding, augmenting,
collating), the CPU workers' share of every batch, and the stage processes (an emulated stage's
layers; a GPU stage's driver thread and, in fine mode, its offloaded optimizer steps). Every rank
of a node iterates the same batches itself (``data.py``), so loading costs the node its
per-batch work once per rank.

Before training, the workload analyzer measures how long the user's own training DataLoader takes
per batch with 0, 1, 2, ... worker processes (``measure_loader``) and splits the cores
(``split_cores``) so that the step, waiting for data included, is shortest. While training, the
rebalancer follows the step records' wait for data and moves cores toward loading when it grows
and back when it ends (``LoadBalancer``). A new number of loader workers takes effect where the
DataLoader starts a new iterator: at the next epoch (an iterator's worker processes are fixed
when it starts); the CPU workers' threads change at once.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from torch.utils.data import DataLoader, RandomSampler, IterableDataset, SequentialSampler

from lightning_hetero.data import rebuilt, sampler_of, with_workers

__all__ = [
    "peek_batches",
    "LoaderTimes",
    "CoreSplit",
    "LoadBalancer",
    "LoaderPolicy",
    "check_loader_policy",
    "compute_between_loads",
    "measure_loader",
    "set_workers",
    "split_cores",
    "tunable",
]

LoaderPolicy = Union[int, Literal["auto", "tune", "keep"]]
"""``HeteroStrategy(dataloader_workers=...)``: ``"auto"`` plans and re-splits the worker processes of
training DataLoaders built with PyTorch's default ``num_workers=0`` and keeps a count the user set;
``"tune"`` does so for every training DataLoader, a count the user set included; ``"keep"`` changes
no DataLoader; an int gives every DataLoader that many workers per rank, fixed."""


def check_loader_policy(policy: Any) -> LoaderPolicy:
    """``dataloader_workers`` as given, or a clear error."""
    if isinstance(policy, bool) or not (policy in ("auto", "tune", "keep") or (isinstance(policy, int) and policy >= 0)):
        raise ValueError(
            f"`dataloader_workers={policy!r}` must be 'auto' (plan the workers of DataLoaders left at"
            " `num_workers=0`), 'tune' (of every training DataLoader), 'keep' (change none) or a count >= 0."
        )
    return policy


def tunable(loader: Any, policy: LoaderPolicy) -> bool:
    """Whether the package may choose ``loader``'s worker processes under ``policy``. Not where a
    ``RandomSampler`` shuffles from a generator of its own: it draws once more from it when its
    indices run out, which worker processes reach by prefetching and Lightning's loop without them
    does not, so the next epoch's order would follow the worker count. Not over an ``IterableDataset``
    either: each worker iterates it (sharding itself by ``get_worker_info()``, or not), so the worker
    count decides what is in a batch."""
    if not isinstance(loader, DataLoader) or isinstance(policy, int) or policy == "keep":
        return False
    if isinstance(loader.dataset, IterableDataset):
        return False
    sampler = sampler_of(loader)
    if isinstance(sampler, RandomSampler) and sampler.generator is not None:
        return False
    return policy == "tune" or loader.num_workers == 0


def set_workers(loader: DataLoader, workers: int) -> None:
    """Give ``loader`` ``workers`` worker processes from its next iterator on (the next epoch)."""
    if loader.num_workers == workers:
        return
    loader.num_workers = workers
    loader.prefetch_factor = 2 if workers else None
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:  # persistent workers: the next epoch starts a new iterator
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        loader._iterator = None


@dataclass(frozen=True)
class LoaderTimes:
    """Seconds per batch that one process waits for the training DataLoader, with each number of
    worker processes, the loader alone (nothing else running in that process)."""

    workers: tuple[int, ...]
    seconds: tuple[float, ...]
    batch_size: Optional[int] = None

    def at(self, workers: int) -> float:
        """The time per batch with ``workers`` worker processes (the most measured, beyond them)."""
        known = dict(zip(self.workers, self.seconds))
        return known.get(workers, known[max(w for w in self.workers if w <= workers)])

    @property
    def in_process(self) -> float:
        """One core's work per batch: loading in the training process itself (0 workers)."""
        return self.at(0)

    def rows(self) -> list[str]:
        return [f"  {w} worker(s): {s * 1e3:9.2f} ms per batch" for w, s in zip(self.workers, self.seconds)]


def _in_order(loader: DataLoader) -> DataLoader:
    """The loader over its dataset in order (no sampler's generator advances), batched as it is."""
    if isinstance(loader.dataset, IterableDataset) or loader.batch_sampler is None:
        return loader
    return rebuilt(loader, SequentialSampler(loader.dataset))


def peek_batches(loader: Any, count: int) -> list[Any]:
    """The first ``count`` batches of ``loader``'s dataset in order, read in this process, changing
    nothing the training run sees (as ``measure_loader`` reads: no sampler's generator advances, every
    random generator is put back); ``[]`` for what is not a DataLoader."""
    if not isinstance(loader, DataLoader):
        return []
    probe = _in_order(loader)
    states = _collect_rng_states(include_cuda=False)
    try:
        batches = []
        for batch in with_workers(probe, 0):
            batches.append(batch)
            if len(batches) >= count:
                break
        return batches
    finally:
        _set_rng_states(states)


def measure_loader(
    loader: Any,
    max_workers: int,
    budget_s: float = 20.0,
    enough_s: Optional[float] = None,
    only: Optional[int] = None,
) -> Optional[LoaderTimes]:
    """How long ``loader`` takes per batch with 0, 1, ..., ``max_workers`` worker processes (``only``:
    with that many, and in the training process itself, 0): its own
    dataset, transforms and collate function, a few batches each, in this process. Nothing the
    training run sees changes: the batches are read in order from a loader over the same dataset
    (no sampler's generator advances), and every random generator is put back as it was. Stops
    adding workers once one more does not make a batch at least 10% faster than fewer workers did
    (one worker is worth measuring whatever it gives: it overlaps loading with the step), once a batch takes
    less than ``enough_s``, or after ``budget_s`` seconds. ``None`` for what is not a DataLoader."""
    if not isinstance(loader, DataLoader):
        return None
    probe = _in_order(loader)
    states = _collect_rng_states(include_cuda=False)
    workers: list[int] = []
    seconds: list[float] = []
    start = time.perf_counter()
    try:
        counts = range(max_workers + 1) if only is None else sorted({0, only})
        if max(counts) > 0:
            # Not timed: the first worker process this process starts pays its one-time set-up
            # (what a loader's first batches pay once in training), which would count against one worker.
            _per_batch(with_workers(probe, 1), 1)
        for count in counts:
            per_batch = _per_batch(with_workers(probe, count), count)
            if per_batch is None:
                break
            workers.append(count)
            seconds.append(per_batch)
            if only is None and enough_s is not None and per_batch <= enough_s:
                break
            if only is None and count >= 2 and per_batch > 0.9 * min(seconds[1:-1]):
                break
            if time.perf_counter() - start > budget_s:
                break
    finally:
        _set_rng_states(states)
    if not workers:
        return None
    return LoaderTimes(tuple(workers), tuple(seconds), loader.batch_size)


def _per_batch(loader: Any, workers: int) -> Optional[float]:
    """Seconds per batch in the steady state: after ``2 * workers + 2`` batches (those that start
    the worker processes, were prefetched at once, and pay a new process's first touches of the
    memory it shares with this one), the mean over the next ``max(4, 4 * workers)``;
    the worker processes are shut down before it returns, so they cost the next measurement nothing."""
    iterator, count, begin = iter(loader), 0, time.perf_counter()
    try:
        for _ in range(2 * workers + 2):
            next(iterator)
        begin = time.perf_counter()
        for _ in range(max(4, 4 * workers)):
            next(iterator)
            count += 1
    except StopIteration:
        if not count:
            return None
    finally:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
    return (time.perf_counter() - begin) / count


@dataclass(frozen=True)
class CoreSplit:
    """How a node's cores are split: the DataLoader's workers per rank, the CPU workers' threads,
    and what the split predicts."""

    dataloader_workers: int
    cpu_threads: Optional[int]
    """Torch threads per CPU worker (``None``: as the topology shares the cores out)."""
    step_s: float
    """The predicted step, waiting for data included."""
    loading_cores: float
    """Cores the loader workers of every rank keep busy on average."""
    compute_s: float = 0.0
    """The step it was given: computing, without loading."""
    given_threads: Optional[int] = None
    """The CPU workers' threads it was given."""
    stage_threads: Optional[int] = None
    """Torch threads per emulated stage process (``None``: as the topology shares the cores out)."""
    source: str = "predicted by the profile"
    """Where ``compute_s`` came from."""
    candidates: tuple[tuple[int, float], ...] = ()
    """(workers, predicted step) for every measured worker count."""

    def rows(self) -> list[str]:
        return [f"  {w} worker(s): predicted step {s * 1e3:9.2f} ms" for w, s in self.candidates]


def split_cores(
    times: LoaderTimes,
    step_s: float,
    cores: int,
    loading_ranks: int,
    cpu_workers: int,
    stage_cores: float,
    cpu_threads: Optional[int] = None,
    fixed_workers: Optional[int] = None,
    emulated_stages: int = 0,
    gpu_stages: int = 0,
) -> CoreSplit:
    """Split ``cores`` between loading and compute for a step that computes for ``step_s`` seconds
    (without loading), where ``loading_ranks`` processes each load every batch, ``cpu_workers``
    CPU workers compute with ``cpu_threads`` threads each (``None``: the cores the stages leave)
    and the stages keep ``stage_cores`` cores.

    The model, which a hand calculation follows:

    - a batch takes one core ``L0 = times.in_process`` seconds to load; with 0 workers each rank
      loads it itself, between steps: ``T(0) = step_s + L0``;
    - with ``w`` workers per rank loading overlaps the step, and a rank gets a batch every
      ``L(w)`` seconds (measured, the loader alone), or every ``loading_ranks * L0 / min(cores,
      loading_ranks * w)`` where the node's loaders together have fewer cores than that. Over a step of ``T = max(step_s, L(w))`` the node's loaders keep
      ``x = loading_ranks * L0 / T`` cores busy; where that is more than the compute leaves free
      (``cores - compute``, ``compute = stage_cores + cpu_workers * threads``), the compute runs
      on ``cores - x`` cores: ``T(w) = max(step_s * compute / (cores - x), L(w))``;
    - the count with the shortest ``T`` wins (fewer workers where within 2%). Where its loaders need
      cores the compute had, the compute gets the ``cores - ceil(x)`` left: the CPU workers first
      give up threads, ``floor((cores - ceil(x) - stage_cores) / cpu_workers)`` each (at least 1);
      where that is not enough, the ``emulated_stages`` share what is left beside the ``gpu_stages``
      (which keep a core each), ``floor((left - gpu_stages) / emulated_stages)`` each (at least 1).

    ``fixed_workers``: the DataLoader's count is the user's; only its consequences are predicted.
    """
    threads = cpu_threads if cpu_threads is not None else max(1, math.floor((cores - stage_cores) / max(1, cpu_workers)))
    compute = min(float(cores), stage_cores + cpu_workers * threads) if cpu_workers else min(float(cores), stage_cores)
    compute = max(compute, 1.0)
    load0 = times.in_process
    candidates: list[tuple[int, float, float]] = []
    for workers in times.workers if fixed_workers is None else (fixed_workers,):
        if workers == 0:
            candidates.append((0, step_s + load0, 0.0))
            continue
        # All ranks' loaders together have at most one core per worker process, and the node's cores.
        per_batch = max(times.at(workers), loading_ranks * load0 / min(cores, loading_ranks * workers))
        busy = loading_ranks * load0 / max(step_s, per_batch)
        free = cores - compute
        slowed = step_s if busy <= free else step_s * compute / max(cores - busy, 1.0)
        candidates.append((workers, max(slowed, per_batch), busy))
    fastest = min(step for _, step, _ in candidates)
    workers, step, busy = next(c for c in candidates if c[1] <= fastest * 1.02)
    chosen_threads, stage_threads = cpu_threads, None
    if workers and busy > cores - compute:
        left = cores - math.ceil(busy)
        if cpu_workers:
            chosen_threads = max(1, math.floor((left - stage_cores) / cpu_workers))
            left -= cpu_workers * chosen_threads
        if emulated_stages and left < stage_cores:
            stage_threads = max(1, math.floor((left - gpu_stages) / emulated_stages))
    return CoreSplit(
        workers,
        chosen_threads,
        step,
        busy,
        compute_s=step_s,
        given_threads=cpu_threads,
        stage_threads=stage_threads,
        candidates=tuple((w, s) for w, s, _ in candidates),
    )


def compute_between_loads(steps: list[list[tuple[float, float]]], times: LoaderTimes, workers: int) -> float:
    """A training step's compute, waiting for data left out, from every rank's ``(total, data)``
    seconds of each step (``StepRecord``: the whole step, and the time between it and the one
    before) run with ``workers`` loader workers per rank: the slowest rank's time inside the step
    plus the time between steps (the training loop's own work) less what waiting for the batch took:
    loading it in-process (``L0``), or what the loaders' pace ``L(w)`` left beyond the step. The
    median over the steps."""
    inside = statistics.median(max(total - data for total, data in step) for step in steps)
    between = statistics.median(max(data for _, data in step) for step in steps)
    waited = times.in_process if workers == 0 else max(0.0, times.at(workers) - inside)
    return inside + max(0.0, between - waited)


@dataclass
class LoadBalancer:
    """Moves cores toward loading while the step waits for its batches, and back once it no longer
    does (no I/O: unit-testable on its own).

    Each decision reads one window's step time and time between steps per batch (the slowest
    rank's, ``Window.data``: waiting for the batch, and the training loop's own work), smoothed as
    the CPU fraction's estimates are (a window that differs by more than ``reset`` replaces it). The least of it seen so far is the loop's own work; the rest
    is waiting for data. Where that wait is more than ``stall`` of the step (and more than ``least``
    seconds, above the jitter of a loop) in ``confirm`` decisions in a row, one more loader worker
    per rank (up to ``max_workers``) and, where loader workers then need cores and the CPU workers
    have more than one thread, one thread fewer each (the CPU fraction's balancer then finds the
    share the slower CPU workers earn). Where the wait has stayed under half of that for ``calm``
    decisions and the split is not where it started, one move back. A move is judged at the first
    decision after it took effect (a loader's new worker count, at its next epoch): where the step
    got slower by more than ``margin`` and by more than ``least`` (a loop's jitter: one window's
    step tells no smaller difference), it is undone and no move is made for ``calm`` decisions
    (twice as many after each undone move in a row, up to 8x), so the balancer never leaves the step
    slower than where it started.

    Args:
        workers: loader workers per rank at the start; ``threads``: each CPU worker's threads
            (``None``: no CPU workers).
        max_workers: the most loader workers per rank.
        movable_workers: whether the loader workers may change (a count the user set is kept).
    """

    workers: int
    threads: Optional[int]
    max_workers: int
    movable_workers: bool = True
    stall: float = 0.1
    least: float = 0.005
    confirm: int = 2
    calm: int = 3
    margin: float = 0.02
    smoothing: float = 0.3
    reset: float = 0.3
    # The state (saved in checkpoints).
    start: Optional[tuple[int, Optional[int]]] = None
    wait: Optional[float] = None
    """The smoothed time between steps per batch."""
    floor: Optional[float] = None
    """The least ``wait`` seen: the training loop's own work."""
    calm_windows: int = 0
    stalled_windows: int = 0
    blocked: int = 0
    undone: int = 0
    """Moves undone in a row: each doubles the decisions before the next try (up to 8x ``calm``)."""
    last_move: Optional[tuple[int, Optional[int], float]] = None
    """The split before the last move, and the step time measured there."""

    def stalled_share(self, step_time: float) -> float:
        """The share of the step spent waiting for data, as the estimates stand."""
        if self.wait is None or self.floor is None or step_time <= 0:
            return 0.0
        return max(0.0, self.wait - self.floor) / step_time

    def adopt(self, workers: int, threads: Optional[int]) -> None:
        """Something else split the cores (the workload analyzer, after its warm-up): start from there."""
        self.workers, self.threads, self.start, self.last_move = workers, threads, (workers, threads), None

    def decide(self, step_time: float, data: float, in_effect: bool = True) -> tuple[int, Optional[int], str]:
        """The split from now on (loader workers per rank, CPU-worker threads), and why: ``stall``,
        ``recovered``, ``undo``, ``hold``. ``in_effect``: the last move's worker count is the one the
        loaders run with (a new count waits for the next epoch)."""
        if self.start is None:
            self.start = (self.workers, self.threads)
        if self.last_move is not None and not in_effect:
            return self.workers, self.threads, "hold"  # the move is not measurable yet
        if self.wait is None or not self.wait or abs(data / self.wait - 1) > self.reset:
            self.wait = data  # conditions changed: the window replaces the estimate
        else:
            self.wait += self.smoothing * (data - self.wait)
        self.floor = self.wait if self.floor is None else min(self.floor, self.wait)
        share = self.stalled_share(step_time)
        assert self.wait is not None and self.floor is not None
        if self.wait - self.floor < self.least:
            share = min(share, self.stall / 4)  # within a loop's jitter: no stall
        self.blocked = max(0, self.blocked - 1)
        if self.last_move is not None:
            workers, threads, before = self.last_move
            self.last_move = None
            if step_time > before * (1 + self.margin) and step_time - before > self.least:
                self.workers, self.threads = workers, threads
                self.blocked, self.undone = self.calm * 2 ** min(self.undone, 3), self.undone + 1
                return self.workers, self.threads, "undo"
            self.undone = 0
        if share > self.stall:
            self.calm_windows = 0
            self.stalled_windows += 1
            if self.blocked or self.stalled_windows < self.confirm:
                return self.workers, self.threads, "hold"
            workers = min(self.max_workers, self.workers + 1) if self.movable_workers else self.workers
            threads = self.threads
            if workers and threads is not None and threads > 1:
                threads -= 1
            return self._move(workers, threads, step_time, "stall")
        self.stalled_windows = 0
        self.calm_windows = self.calm_windows + 1 if share < self.stall / 2 else 0
        if self.calm_windows >= self.calm and (self.workers, self.threads) != self.start and not self.blocked:
            self.calm_windows = 0
            start_workers, start_threads = self.start
            threads = self.threads
            if threads is not None and start_threads is not None and threads < start_threads:
                threads += 1
            return self._move(max(start_workers, self.workers - 1), threads, step_time, "recovered")
        return self.workers, self.threads, "hold"

    def _move(self, workers: int, threads: Optional[int], step_time: float, reason: str) -> tuple[int, Optional[int], str]:
        if (workers, threads) == (self.workers, self.threads):
            return workers, threads, "hold"
        self.last_move = (self.workers, self.threads, step_time)
        self.workers, self.threads, self.stalled_windows = workers, threads, 0
        return workers, threads, reason

    def state_dict(self) -> dict[str, Any]:
        keys = (
            "workers", "threads", "start", "wait", "floor", "calm_windows", "stalled_windows", "blocked", "undone", "last_move"
        )  # fmt: skip
        return {key: getattr(self, key) for key in keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
