"""The CPU's cores are one budget: loading, the CPU workers' compute and the stages' own.

Before training, the analyzer measures the user's DataLoader by worker processes and splits the
cores as a hand calculation does; while training, the rebalancer follows a stall that starts
mid-run (a heavier transform) and moves cores toward loading, and back once it ends; the batches,
their order and so the trained model never change.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler, TensorDataset
from torch.utils.data import get_worker_info

from lightning_hetero import HeteroPlan, HeteroStrategy
from lightning_hetero.callbacks import AdaptiveRebalancer, WorkloadAnalyzer
from lightning_hetero.data import with_workers
from lightning_hetero.loading import CoreSplit, LoadBalancer, LoaderTimes, compute_between_loads, measure_loader, peek_batches
from lightning_hetero.loading import split_cores, tunable
from tests.conftest import hetero, max_param_diff, trainer
from tests.models import Net

BATCH = 8


def busy(seconds: float) -> None:
    """Burn ``seconds`` of this thread's CPU time (a deterministic busy transform)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class BusyData(Dataset):
    """Regression samples, each of which costs ``cost`` seconds of CPU to load."""

    def __init__(self, n: int, cost: float = 0.0, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)
        self.cost = cost

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        busy(self.cost)
        return self.x[i], self.y[i]


# ------------------------------------------------------------------ the plan


def test_a_loader_with_a_batch_sampler_of_its_own_keeps_it_with_other_workers() -> None:
    """`DataLoader(batch_sampler=BatchSampler(...))`: given other workers, the loader still yields
    the batch sampler's batches (Lightning's re-instantiation alone would yield single samples)."""
    dataset = TensorDataset(torch.arange(10.0))
    loader = DataLoader(dataset, batch_sampler=BatchSampler(SequentialSampler(dataset), 4, drop_last=False))
    for workers in (1, 0):
        loader = with_workers(loader, workers)
        assert loader.num_workers == workers
        assert [batch.tolist() for (batch,) in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # Read in order to measure it, it is batched as it trains (it used to yield single samples).
    assert [batch.tolist() for (batch,) in peek_batches(loader, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_the_split_follows_the_hand_calculation() -> None:
    # 16 cores; 2 ranks load every batch (a GPU stage and a CPU worker); a batch is 60 ms of one
    # core, 31 ms with 2 workers, 21 ms with 3; the step computes for 40 ms; the GPU stage keeps a core.
    times = LoaderTimes((0, 1, 2, 3), (0.060, 0.061, 0.031, 0.021))
    split = split_cores(times, step_s=0.040, cores=16, loading_ranks=2, cpu_workers=1, stage_cores=1)
    # T(0) = 40 + 60 = 100 ms. T(1) = max(40, 61) = 61. With 2 or 3 workers the loaders keep
    # 2 * 60 / 40 = 3 cores busy; the compute (1 + 15 threads = 16 cores) runs on 16 - 3 = 13:
    # T = 40 * 16 / 13 = 49.2 ms (the batch arrives in 31 or 21 ms): 2 workers, the fewer.
    assert [w for w, _ in split.candidates] == [0, 1, 2, 3]
    assert [round(s * 1e3, 1) for _, s in split.candidates] == [100.0, 61.0, 49.2, 49.2]
    assert split.dataloader_workers == 2 and split.loading_cores == pytest.approx(3.0)
    # The CPU worker gives the loaders their cores: floor((16 - 3 - 1) / 1) threads.
    assert split.cpu_threads == 12 and split.step_s == pytest.approx(0.040 * 16 / 13)


def test_an_emulated_stage_gives_the_loaders_its_threads_where_no_cpu_worker_can() -> None:
    # Two cores, one emulated stage with both (no CPU worker); 32 ms to load a batch in-process, 36
    # with one worker, 16 with two; the step computes for 10 ms.
    times = LoaderTimes((0, 1, 2), (0.032, 0.036, 0.016))
    split = split_cores(times, 0.010, cores=2, loading_ranks=1, cpu_workers=0, stage_cores=2, emulated_stages=1)
    # T(0) = 10 + 32 = 42 ms. T(1): 32 / 36 = 0.89 cores busy, none free: max(10 * 2 / 1.11, 36) = 36.
    # T(2): 32 / 16 = 2 cores busy: max(10 * 2 / 1 (at least a core), 16) = 20 ms: two workers.
    assert [round(s * 1e3, 1) for _, s in split.candidates] == [42.0, 36.0, 20.0]
    assert split.dataloader_workers == 2 and split.cpu_threads is None
    assert split.stage_threads == 1  # the loaders took both cores: the stage keeps one thread


def test_loading_that_is_cheap_stays_in_the_training_process() -> None:
    times = LoaderTimes((0,), (0.0005,))
    split = split_cores(times, step_s=0.040, cores=16, loading_ranks=2, cpu_workers=1, stage_cores=1)
    assert (split.dataloader_workers, split.cpu_threads) == (0, None)
    assert split.step_s == pytest.approx(0.0405)


def test_loaders_that_fit_in_the_free_cores_take_no_threads() -> None:
    # 4 cores free beside the compute (2 CPU-worker threads on 8 cores, 2 GPU stages): 2 * 30 / 40 = 1.5 busy.
    times = LoaderTimes((0, 1), (0.030, 0.031))
    split = split_cores(times, step_s=0.040, cores=8, loading_ranks=2, cpu_workers=1, stage_cores=2, cpu_threads=4)
    assert (split.dataloader_workers, split.cpu_threads) == (1, 4) and split.step_s == pytest.approx(0.040)


def test_a_count_the_user_set_is_only_predicted() -> None:
    times = LoaderTimes((0, 4), (0.060, 0.016))
    split = split_cores(times, 0.040, 16, 2, 1, 1, fixed_workers=0)
    assert split.dataloader_workers == 0 and [w for w, _ in split.candidates] == [0]


def test_the_warm_up_gives_the_steps_compute_without_the_wait_for_data() -> None:
    times = LoaderTimes((0, 1, 2), (0.030, 0.032, 0.016))
    # Two ranks, three steps: (whole step, time between it and the step before).
    steps = [[(0.050, 0.034), (0.049, 0.033)], [(0.052, 0.035), (0.050, 0.030)], [(0.048, 0.033), (0.047, 0.031)]]
    # In-process loading: inside 16 ms (median of the slowest rank's), between 34 ms, of which 30 loading.
    assert compute_between_loads(steps, times, workers=0) == pytest.approx(0.016 + 0.004)
    # Two workers at 16 ms a batch keep up with a 16 ms step: all 34 ms between steps is the loop's.
    assert compute_between_loads(steps, times, workers=2) == pytest.approx(0.016 + 0.034)


def test_which_loaders_the_run_may_tune() -> None:
    default, own = DataLoader(BusyData(8), batch_size=4), DataLoader(BusyData(8), batch_size=4, num_workers=2)
    assert tunable(default, "auto") and not tunable(own, "auto")
    assert tunable(own, "tune") and not tunable(default, "keep") and not tunable(default, 3)
    # Shuffled from its own generator: its order would follow the worker count (see `tunable`).
    seeded = DataLoader(BusyData(8), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    assert not tunable(seeded, "auto") and not tunable(seeded, "tune")
    # Over an iterable dataset each worker iterates it: the worker count decides what is in a batch.
    iterable = DataLoader(ShardedByWorker(), batch_size=4)
    assert not tunable(iterable, "auto") and not tunable(iterable, "tune")
    with pytest.raises(ValueError, match="dataloader_workers"):
        HeteroStrategy(dataloader_workers="many")  # type: ignore[arg-type]


def test_measuring_the_loader_changes_nothing_training_sees() -> None:
    generator = torch.Generator().manual_seed(3)
    loader = DataLoader(BusyData(64, cost=0.002), batch_size=BATCH, sampler=RandomSampler(range(64), generator=generator))
    state = torch.get_rng_state()
    sampler_state = generator.get_state()
    times = measure_loader(loader, max_workers=2)
    assert times is not None and times.workers[0] == 0
    # 8 samples of 2 ms of CPU each, in the training process itself.
    assert times.in_process == pytest.approx(BATCH * 0.002, rel=0.5)
    assert torch.equal(torch.get_rng_state(), state) and torch.equal(generator.get_state(), sampler_state)
    assert loader.num_workers == 0  # the user's loader is the same object, unchanged


# ------------------------------------------------------------ the balancer


def run_balancer(balancer: LoadBalancer, windows: list[tuple[float, float]]) -> list[tuple[int, Any, str]]:
    return [balancer.decide(step, data) for step, data in windows]


def test_a_stall_moves_cores_to_loading_within_two_decisions_and_back_when_it_ends() -> None:
    balancer = LoadBalancer(workers=0, threads=4, max_workers=3)
    calm, stalled, eased = (0.050, 0.002), (0.090, 0.042), (0.055, 0.004)
    out = run_balancer(balancer, [calm, calm, stalled, stalled, eased, eased, eased, eased, eased])
    assert out[:3] == [(0, 4, "hold")] * 3  # one window of waiting could be noise
    assert out[3] == (1, 3, "stall")  # the second window of the stall
    assert out[4][2] == "hold"  # the move helped (the step is faster than before it); calm again
    # Three calm decisions later, one move back toward where it started.
    assert out[6] == (0, 4, "recovered")


def test_a_single_noisy_window_moves_nothing() -> None:
    balancer = LoadBalancer(workers=0, threads=4, max_workers=3)
    out = run_balancer(balancer, [(0.050, 0.010), (0.060, 0.021), (0.050, 0.011), (0.050, 0.013)])
    assert {reason for _, _, reason in out} == {"hold"}


def test_a_move_that_made_the_step_slower_is_undone() -> None:
    balancer = LoadBalancer(workers=1, threads=2, max_workers=2)
    out = run_balancer(balancer, [(0.050, 0.001), (0.080, 0.030), (0.080, 0.030), (0.100, 0.030), (0.080, 0.030)])
    assert out[2] == (2, 1, "stall")
    assert out[3] == (1, 2, "undo")  # slower than the 80 ms before the move
    assert out[4] == (1, 2, "hold")  # and not tried again at once


def test_a_step_slower_by_less_than_the_loops_jitter_is_not_undone() -> None:
    """A move is judged on one window's step: a difference within the loop's jitter (``least``,
    ``AdaptiveRebalancer(loading_jitter_s=...)``) is noise, not a slower step."""
    calm, stalled, eased, noisy = (0.050, 0.002), (0.090, 0.042), (0.050, 0.004), (0.058, 0.004)
    for jitter, judged in [(0.012, "hold"), (0.005, "undo")]:
        balancer = LoadBalancer(workers=0, threads=2, max_workers=1, least=jitter)
        out = run_balancer(balancer, [calm, calm, stalled, stalled, eased, eased, eased, noisy])
        assert out[3] == (1, 1, "stall") and out[6] == (0, 2, "recovered")
        assert out[7][2] == judged  # 8 ms (16%) slower than the window before the move back


def test_moves_that_keep_failing_are_tried_ever_more_rarely() -> None:
    balancer = LoadBalancer(workers=0, threads=2, max_workers=2)
    stalled, worse = (0.080, 0.030), (0.100, 0.030)
    balancer.decide(0.050, 0.001)
    tries = []
    for decision in range(60):
        step, data = worse if balancer.last_move is not None else stalled
        if balancer.decide(step, data)[2] == "stall":
            tries.append(decision)
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > 2 * gaps[0]  # 3, 6, 12, 24 decisions between tries


def test_a_move_is_judged_once_it_takes_effect() -> None:
    balancer = LoadBalancer(workers=0, threads=2, max_workers=2)
    balancer.decide(0.050, 0.001)
    balancer.decide(0.090, 0.040)
    assert balancer.decide(0.090, 0.040)[2] == "stall"
    # The new worker count waits for the next epoch: no judgement, no new move.
    assert balancer.decide(0.200, 0.150, in_effect=False) == (1, 1, "hold")
    assert balancer.decide(0.060, 0.002)[2] == "hold"


def test_a_count_the_user_set_stays_and_threads_move_alone() -> None:
    balancer = LoadBalancer(workers=4, threads=3, max_workers=8, movable_workers=False)
    balancer.decide(0.050, 0.001)
    balancer.decide(0.090, 0.040)
    assert balancer.decide(0.090, 0.040) == (4, 2, "stall")


def test_nothing_to_move_holds() -> None:
    # The loaders are the user's, with no workers: fewer compute threads would not load any faster.
    balancer = LoadBalancer(workers=0, threads=3, max_workers=8, movable_workers=False)
    balancer.decide(0.050, 0.001)
    assert balancer.decide(0.090, 0.040) == balancer.decide(0.090, 0.040) == (0, 3, "hold")


def test_the_balancers_state_round_trips() -> None:
    balancer = LoadBalancer(workers=0, threads=2, max_workers=2)
    run_balancer(balancer, [(0.05, 0.001), (0.09, 0.04), (0.09, 0.04)])
    other = LoadBalancer(workers=0, threads=2, max_workers=2)
    other.load_state_dict(json.loads(json.dumps(balancer.state_dict())))
    assert other.decide(0.06, 0.002) == balancer.decide(0.06, 0.002)


# ------------------------------------------------------------------ real runs

EVERY, EPOCH = 4, 8  # a decision every 4 steps, two per epoch
HEAVY = 0.004  # seconds of CPU per sample while the stall lasts: 32 ms a batch, on every rank
JITTER = 0.012
"""The stall waits 32 ms a batch; a busy two-core machine's loop varies by more than the default 5 ms
now and then: a wait under 12 ms is jitter here (``AdaptiveRebalancer(loading_jitter_s=...)``)."""


class StallDuring(L.Callback):
    """From epoch ``first`` to ``last`` the dataset's transform is heavier, on every rank alike
    (set before the epoch's iterator starts, so its worker processes see it too)."""

    def __init__(self, first: int, last: int, out: Path) -> None:
        self.first, self.last, self.out = first, last, out
        self.epochs: list[dict[str, Any]] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dataset = trainer.train_dataloader.dataset
        dataset.cost = HEAVY if self.first <= trainer.current_epoch <= self.last else 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            strategy = trainer.strategy
            workers = trainer.train_dataloader.num_workers
            self.epochs.append({"workers": workers, "threads": strategy.cpu_worker_threads, "step": trainer.global_step})

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            rebalancer = next((cb for cb in trainer.callbacks if isinstance(cb, AdaptiveRebalancer)), None)
            decisions = rebalancer.decisions if rebalancer is not None else []
            self.out.write_text(json.dumps({"epochs": self.epochs, "decisions": decisions}))


def test_a_stall_mid_run_moves_the_cores_and_the_model_is_unchanged(tmp_path: Path) -> None:
    epochs = 11  # room for the move back after the stall, with a noisy window or two
    steps = epochs * EPOCH
    plain = Net(optimizer="adamw")
    trainer(None, max_steps=steps).fit(plain, DataLoader(BusyData(EPOCH * BATCH), batch_size=BATCH))

    model = Net(optimizer="adamw")
    strategy = hetero(cpu_threads=2, emulated_speed={"cpu": 400.0, "pipeline": 400.0})
    record = StallDuring(first=3, last=5, out=tmp_path / "run.json")
    rebalancer = AdaptiveRebalancer(every_n_steps=EVERY, warmup_steps=1, max_dataloader_workers=1, loading_jitter_s=JITTER)
    data = DataLoader(BusyData(EPOCH * BATCH), batch_size=BATCH)
    trainer(strategy, max_steps=steps, callbacks=[rebalancer, record]).fit(model, data)
    assert max_param_diff(plain, model) < 1e-10  # the batches and their order never changed

    run = json.loads((tmp_path / "run.json").read_text())
    epochs_seen, decisions = run["epochs"], run["decisions"]
    assert [e["workers"] for e in epochs_seen[:4]] == [0, 0, 0, 0]
    # The stall starts with epoch 3 (step 24); within two decisions the cores move: a loader
    # worker per rank from the next epoch, one CPU-worker thread fewer at once.
    stall_start = 3 * EPOCH
    moves = [d for d in decisions if d.get("loading") == "stall"]
    assert moves and moves[0]["step"] <= stall_start + 2 * EVERY, decisions
    assert epochs_seen[4]["workers"] == 1 and epochs_seen[4]["threads"] == 1
    # The stall ends with epoch 6: the split goes back where it started.
    back = [d for d in decisions if d.get("loading") == "recovered"]
    assert back and back[0]["step"] > 6 * EPOCH
    assert epochs_seen[-1]["workers"] == 0 and epochs_seen[-1]["threads"] == 2


def test_without_cpu_workers_only_the_loaders_move(tmp_path: Path) -> None:
    """A pipeline alone (FastFlow's case: accelerators fed by the CPU): the rebalancer has no CPU
    share to balance, and still moves the loader workers when loading stalls the step."""
    steps = 6 * EPOCH
    plain = Net(optimizer="adamw")
    trainer(None, max_steps=steps).fit(plain, DataLoader(BusyData(EPOCH * BATCH), batch_size=BATCH))
    model = Net(optimizer="adamw")
    strategy = hetero(stages=["cpu"], cpu_workers=0, emulated_speed={"pipeline": 400.0})
    record = StallDuring(first=2, last=9, out=tmp_path / "run.json")
    rebalancer = AdaptiveRebalancer(every_n_steps=EVERY, warmup_steps=1, max_dataloader_workers=1)
    trainer(strategy, max_steps=steps, callbacks=[rebalancer, record]).fit(model, DataLoader(BusyData(EPOCH * BATCH), batch_size=BATCH))
    assert max_param_diff(plain, model) < 1e-10
    run = json.loads((tmp_path / "run.json").read_text())
    assert {d["fraction"] for d in run["decisions"]} == {0.0} and {d["reason"] for d in run["decisions"]} == {"hold"}
    assert [e["workers"] for e in run["epochs"]][:3] == [0, 0, 0] and run["epochs"][-1]["workers"] == 1
    assert all(e["threads"] is None for e in run["epochs"])


# ---------------------------------------------------------------- the analyzer


class RecordWorkers(L.Callback):
    """Rank 0 writes its training DataLoader's workers, how many DataLoaders the run tunes, and the
    analyzer's measurements and split (``LoaderTimes``, ``CoreSplit``)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record(trainer, "start")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record(trainer, "end")  # the split after the warm-up's check

    def record(self, trainer: L.Trainer, when: str) -> None:
        if trainer.is_global_zero:
            analyzer = next(cb for cb in trainer.callbacks if isinstance(cb, WorkloadAnalyzer))
            loading = [asdict(part) for part in analyzer.loading] if analyzer.loading else None
            tuned = len(trainer.strategy.tuned_loaders)
            run = json.loads(self.out.read_text()) if self.out.exists() else {}
            run[when] = {"workers": trainer.train_dataloader.num_workers, "tuned": tuned, "loading": loading}
            self.out.write_text(json.dumps(run))


def recorded(path: Path, when: str = "start") -> tuple[dict[str, Any], LoaderTimes, CoreSplit]:
    run = json.loads(path.read_text())[when]
    times, split = run["loading"]
    times = LoaderTimes(tuple(times["workers"]), tuple(times["seconds"]), times["batch_size"])
    split["candidates"] = tuple(tuple(c) for c in split["candidates"])
    return run, times, CoreSplit(**split)


def test_the_analyzer_plans_the_loader_from_its_own_measurements(tmp_path: Path) -> None:
    # One emulated stage on the two cores: a batch is 32 ms of a core to load, the step computes
    # for a few ms; two loader workers deliver a batch in about 16 ms, one in about 35.
    analyzer = WorkloadAnalyzer(repeats=1, max_micro_batches=2, warmup_steps=2, measure_steps=1, save_dir=str(tmp_path))
    data = DataLoader(BusyData(12 * BATCH, cost=HEAVY), batch_size=BATCH, drop_last=True)
    strategy = hetero(stages=["cpu"], cpu_workers=0)
    record = RecordWorkers(tmp_path / "run.json")
    trainer(strategy, max_steps=18, callbacks=[analyzer, record, StallDuring(0, 9, tmp_path / "epochs.json")]).fit(Net(), data)
    # Before training: the loader measured by worker count, and the step predicted as it starts.
    run, times, split = recorded(tmp_path / "run.json")
    # Known by construction: a core busy for that long (longer where other processes share the cores).
    assert 0.7 * BATCH * HEAVY <= times.in_process <= 2 * BATCH * HEAVY
    assert times.workers[:3] == (0, 1, 2) and (run["workers"], run["tuned"]) == (0, 1)
    assert [w for w, _ in split.candidates] == [0] and split.source == "predicted by the profile"
    # After the warm-up: the split for the step's measured compute, as the hand calculation
    # (``split_cores``'s model) gives it on the same numbers; loading a batch dwarfs the step here.
    _, _, checked = recorded(tmp_path / "run.json", "end")
    assert checked.source == "measured in the warm-up" and [w for w, _ in checked.candidates] == [0, 1, 2]
    again = split_cores(times, checked.compute_s, cores=2, loading_ranks=1, cpu_workers=0, stage_cores=2, emulated_stages=1)
    assert replace(checked, source=again.source) == again and checked.dataloader_workers >= 1
    assert HeteroPlan.load(tmp_path / "plan.yaml").dataloader_workers == checked.dataloader_workers
    epochs = json.loads((tmp_path / "epochs.json").read_text())["epochs"]
    assert [e["workers"] for e in epochs] == [0, checked.dataloader_workers]  # from the next epoch
    explanation = (tmp_path / "explain.txt").read_text()
    assert "loading a batch" in explanation and f"chosen: {checked.dataloader_workers} DataLoader worker(s)" in explanation


def test_a_loader_with_the_users_own_workers_is_kept(tmp_path: Path) -> None:
    analyzer = WorkloadAnalyzer(repeats=1, max_micro_batches=2, warmup_steps=2, measure_steps=1, save_dir=str(tmp_path))
    data = DataLoader(BusyData(8 * BATCH, cost=HEAVY), batch_size=BATCH, num_workers=1)
    callbacks = [analyzer, RecordWorkers(tmp_path / "run.json")]
    trainer(hetero(stages=["cpu"], cpu_workers=0), max_steps=3, callbacks=callbacks).fit(Net(), data)
    run, times, split = recorded(tmp_path / "run.json")
    assert (run["workers"], run["tuned"]) == (1, 0)
    assert times.workers == (0, 1) and split.dataloader_workers == 1  # measured and predicted, not changed
    assert recorded(tmp_path / "run.json", "end")[2] == split  # and not split after the warm-up either


def test_a_resumed_run_keeps_the_split(tmp_path: Path) -> None:
    """The split the rebalancer moved to is in the checkpoint, and a resumed run starts with it."""
    steps, cut = 5 * EPOCH, 3 * EPOCH  # the stall starts with epoch 2; the checkpoint is epoch 2's end

    def fit(out: str, ckpt_path: str | None = None, checkpoint: ModelCheckpoint | None = None) -> Net:
        model = Net(optimizer="adamw").double()  # in float64, so resuming loads the weights exactly
        rebalancer = AdaptiveRebalancer(every_n_steps=EVERY, warmup_steps=1, max_dataloader_workers=1, loading_jitter_s=JITTER)
        callbacks: list[L.Callback] = [rebalancer, StallDuring(2, 9, tmp_path / out)]
        if checkpoint is not None:
            callbacks.append(checkpoint)
        strategy = hetero(cpu_threads=2, emulated_speed={"cpu": 400.0, "pipeline": 400.0})
        data = DataLoader(BusyData(EPOCH * BATCH), batch_size=BATCH)
        trainer(strategy, max_steps=steps, callbacks=callbacks, enable_checkpointing=checkpoint is not None).fit(
            model, data, ckpt_path=ckpt_path
        )
        return model

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=cut, save_top_k=-1)
    whole = fit("whole.json", checkpoint=checkpoint)
    moved = json.loads((tmp_path / "whole.json").read_text())["epochs"]
    assert moved[3]["workers"] == 1 and moved[3]["threads"] == 1  # the stall's move, from epoch 3 on
    resumed = fit("resumed.json", ckpt_path=str(tmp_path / "ckpt" / f"step={cut}.ckpt"))
    first = json.loads((tmp_path / "resumed.json").read_text())["epochs"][0]
    assert (first["step"], first["workers"], first["threads"]) == (cut, 1, 1)
    plain = Net(optimizer="adamw")
    trainer(None, max_steps=steps).fit(plain, DataLoader(BusyData(EPOCH * BATCH), batch_size=BATCH))
    assert max_param_diff(plain, resumed) < 1e-10 and max_param_diff(whole, resumed) < 1e-10


def test_the_loops_jitter_is_a_number_of_seconds() -> None:
    with pytest.raises(ValueError, match="`loading_jitter_s=-1` must be a number of seconds"):
        AdaptiveRebalancer(loading_jitter_s=-1)


class _Broadcasts(L.Callback):
    """Every rank notes what rank 0 broadcast at each step's end."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        got = trainer.strategy.broadcast(("step", trainer.global_step), src=0)
        with open(self.out / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(list(got)) + "\n")


def test_a_new_split_of_the_cores_is_saved_without_a_collective_on_rank_zero_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the warm-up moves the cores and no `save_dir` is given, the plan's folder is the
    trainer's `log_dir`, itself a broadcast: asked on rank 0 only, it left every later broadcast
    one message behind on the other ranks."""
    import lightning_hetero.callbacks.analyzer as analyzer

    found = analyzer.split_cores

    def moved(*args: Any, **kwargs: Any) -> CoreSplit:  # a worker more than it found: always a new split
        split = found(*args, **kwargs)
        return replace(split, dataloader_workers=split.dataloader_workers + 1)

    monkeypatch.setattr(analyzer, "split_cores", moved)
    data = DataLoader(BusyData(12 * BATCH, cost=HEAVY / 8), batch_size=BATCH, drop_last=True)
    run = trainer(
        hetero(stages=["cpu"], cpu_workers=1),
        max_steps=8,
        callbacks=[WorkloadAnalyzer(repeats=1, max_micro_batches=2, warmup_steps=2, measure_steps=1), _Broadcasts(tmp_path)],
        default_root_dir=str(tmp_path),
    )
    run.fit(Net(), data)
    seen = [[json.loads(line) for line in (tmp_path / f"rank{r}.jsonl").read_text().splitlines()] for r in range(2)]
    assert seen[0] == seen[1] == [["step", step] for step in range(1, 9)]


class ShardedByWorker(IterableDataset):
    """Each DataLoader worker yields every ``num_workers``-th sample, the usual iterable dataset."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(48, 6, generator=g, dtype=torch.float64), torch.randn(48, 3, generator=g, dtype=torch.float64)

    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return ((self.x[i], self.y[i]) for i in range(len(self.x)) if i % workers == worker)


class MovesTheWorkers(L.Callback):
    """What the rebalancer does where loading stalls: the training loaders' workers, from epoch 1 on."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 1:
            trainer.strategy.set_dataloader_workers(2)


def test_an_iterable_datasets_loader_keeps_its_workers_and_so_its_batches() -> None:
    plain, model = Net(optimizer="sgd", scheduler=False), Net(optimizer="sgd", scheduler=False)
    trainer(None, max_epochs=3).fit(plain, DataLoader(ShardedByWorker(), batch_size=12))
    run = trainer(hetero(), max_epochs=3, callbacks=[MovesTheWorkers()])
    run.fit(model, DataLoader(ShardedByWorker(), batch_size=12))
    assert max_param_diff(plain, model) < 1e-10


class CountsTunedLoaders(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.counts = out, []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import gc

        gc.collect()
        self.counts.append(len(trainer.strategy.tuned_loaders))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (self.out / f"counts{trainer.global_rank}.json").write_text(json.dumps(self.counts))


def test_loaders_made_again_each_epoch_are_not_held(tmp_path: Path) -> None:
    """`reload_dataloaders_every_n_epochs=1`: the run tunes the loader of the epoch, and lets the
    earlier ones (and their datasets) go."""

    class Reloads(Net):
        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(self.current_epoch)
            return DataLoader(TensorDataset(torch.randn(24, 6, generator=g), torch.randn(24, 3, generator=g)), batch_size=12)

    trainer(hetero(), max_epochs=4, reload_dataloaders_every_n_epochs=1, callbacks=[CountsTunedLoaders(tmp_path)]).fit(Reloads())
    for path in sorted(tmp_path.glob("counts*.json")):
        assert json.loads(path.read_text()) == [1, 1, 1, 1], path.name
