"""The adaptive rebalancer: the decision rule on simulated windows (convergence, hysteresis, never
slower than the idle CPU, probing), then real runs on emulated stages whose speeds are set with
the test-only ``emulated_speed`` knob (convergence, equivalence while the fraction moves, resume)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.multiprocessing import ProcessRaisedException
from torch.utils.data import DataLoader, TensorDataset

from lightning_hetero.callbacks import AdaptiveRebalancer
from lightning_hetero.rebalancer import REASONS, Balancer, Window, summarize
from lightning_hetero.record import StepRecord
from lightning_hetero.shares import split_batch
from tests.conftest import TIMEOUT, RecordCopies, assert_copies_identical, hetero, max_param_diff, trainer
from tests.models import Net, read_metrics

TOL = 1e-10
BATCH, MICRO = 64, 2
PIPELINE_SPEED = 1000.0  # samples/s of the emulated pipeline


# ----------------------------------------------------------------- simulation


def measure(fraction: float, cpu_speed: float, pipeline_speed: float = PIPELINE_SPEED, *, sync: float = 0.0,
            overhead: float = 0.005, noise: float = 0.0, rng: Optional[random.Random] = None) -> Window:
    """What a window at ``fraction`` measures when each side takes samples / speed seconds."""
    pipeline = split_batch(BATCH, fraction, 1, MICRO).pipeline_size
    cpu = BATCH - pipeline
    jitter = (lambda: 1 + rng.uniform(-noise, noise)) if rng is not None else (lambda: 1.0)
    cpu_time, pipe_time = cpu / cpu_speed * jitter(), pipeline / pipeline_speed * jitter()
    spent = sync if cpu else 0.0
    return Window(
        fraction=fraction,
        batch_size=BATCH,
        steps=8,
        step_time=overhead + max(cpu_time, pipe_time) + spent,
        cpu_per_sample=cpu_time / cpu if cpu else None,
        pipeline_per_sample=pipe_time / pipeline if pipeline else None,
        sync=spent,
        overhead=overhead,
    )


def run(balancer: Balancer, start: float, speeds: list[float], **kwargs: Any) -> list[float]:
    """The fraction after every decision, the CPU's speed in window ``i`` being ``speeds[i]``."""
    decision = balancer.start(start)
    fractions = []
    for speed in speeds:
        decision = balancer.decide(measure(decision.fraction, speed, **kwargs))
        fractions.append(decision.fraction)
    return fractions


def ideal(cpu_speed: float, pipeline_speed: float = PIPELINE_SPEED) -> float:
    return cpu_speed / (cpu_speed + pipeline_speed)


RATIOS = {"1:1": 1.0, "1:3": 1 / 3, "1:10": 1 / 10}


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("start", [0.0, 1 / 3, 0.9])
def test_converges_within_the_stated_decisions_and_stays(ratio: str, start: float) -> None:
    speed = RATIOS[ratio] * PIPELINE_SPEED
    fractions = run(Balancer(MICRO), start, [speed] * 40)
    # A baseline window, a probe (at the starting fraction, or the smallest share from 0), then
    # at most ceil(distance / max_step) moves, plus one.
    first = start if start > 0 else MICRO / BATCH
    bound = 2 + math.ceil(abs(first - ideal(speed)) / 0.25) + 1
    assert all(abs(f - ideal(speed)) <= 0.05 for f in fractions[bound - 1 :]), fractions
    assert len(set(fractions[bound - 1 :])) == 1  # and stays put


@pytest.mark.parametrize("ratio", ["1:1", "1:3"])
def test_noise_does_not_make_it_oscillate(ratio: str) -> None:
    speed = RATIOS[ratio] * PIPELINE_SPEED
    for seed in range(20):
        fractions = run(Balancer(MICRO), 0.0, [speed] * 60, noise=0.1, rng=random.Random(seed))
        settled = fractions[5:]
        assert all(abs(f - ideal(speed)) <= 0.05 for f in settled), (seed, settled)
        moves = sum(a != b for a, b in zip(settled, settled[1:]))
        assert moves <= 4, (seed, settled)  # the dead band and smoothing absorb +-10% noise


def test_a_small_gain_under_noise_is_kept_on_average_and_never_lost() -> None:
    # At 1:10 the CPU saves ~6% of the step; 5% noise sometimes hides that, and the rebalancer
    # then measures the baseline again or idles for a while: never slower, most of the gain kept.
    speed, baseline = 100.0, measure(0.0, 100.0).step_time
    relative = []
    for seed in range(20):
        fractions = run(Balancer(MICRO), 0.0, [speed] * 60, noise=0.05, rng=random.Random(seed))[5:]
        relative.append(sum(measure(f, speed).step_time for f in fractions) / len(fractions) / baseline)
    best = min(measure(f, speed).step_time for f in Balancer(MICRO)._grid(BATCH)) / baseline
    assert max(relative) <= 1.0 and sum(relative) / len(relative) <= best + 0.02, (best, relative)


def test_follows_a_ratio_that_changes_mid_run() -> None:
    speeds = [1000.0] * 15 + [250.0] * 15 + [2000.0] * 15  # 1:1, then a busy CPU (1:4), then 2:1
    fractions = run(Balancer(MICRO), 0.0, speeds)
    for start, speed in ((0, 1000.0), (15, 250.0), (30, 2000.0)):
        after = fractions[start + 4 : start + 15]  # within four decisions of the change
        assert all(abs(f - ideal(speed)) <= 0.05 for f in after), (speed, fractions)


def test_fractions_keep_the_micro_batches_equal() -> None:
    balancer = Balancer(MICRO)
    fractions = run(balancer, 0.37, [700.0] * 10 + [130.0] * 10)
    for fraction in fractions:
        shares = split_batch(BATCH, fraction, 1, MICRO)
        assert shares.pipeline_size % MICRO == 0 and shares.micro_batches in (0, MICRO)
        assert fraction in balancer._grid(BATCH)


@pytest.mark.parametrize("batch,micro", [(10, 4), (6, 4), (3, 4), (64, 2)])
def test_the_grid_holds_every_equal_cut(batch: int, micro: int) -> None:
    grid = Balancer(micro)._grid(batch)
    pipelines = sorted(split_batch(batch, f, 1, micro).pipeline_size for f in grid)
    expected = sorted({batch} | {k * micro for k in range(batch // micro + 1) if k * micro < batch})
    assert pipelines == expected  # 0 (the whole batch on the pipeline), every multiple, and 1


def test_a_batch_smaller_than_the_micro_batches_does_not_break_it() -> None:
    balancer = Balancer(4)
    balancer.start(0.0)
    window = Window(0.0, 3, 5, 0.01, None, 0.003, 0.0, 0.001)
    assert balancer.decide(window).fraction == 1.0  # the CPU is the only way to share such a batch


def test_each_move_is_bounded_except_a_move_to_zero() -> None:
    fractions = run(Balancer(MICRO, max_step=0.1), 0.9, [100.0] * 20)
    moves = [(a, b) for a, b in zip(fractions, fractions[1:]) if a != b and a > 0 and b > 0]
    assert moves and all(abs(a - b) <= 0.1 + 1e-9 for a, b in moves)
    assert abs(fractions[-1] - ideal(100.0)) <= 0.05


def test_the_model_drops_a_share_whose_sync_costs_more_than_it_saves() -> None:
    balancer = Balancer(MICRO)
    balancer.decide(measure(balancer.start(0.5).fraction, 1000.0))  # baseline; probe at 0.5
    # Measured faster than the baseline (noise, say), but the model counts the sync: 0 wins.
    window = measure(0.5, 1000.0, sync=0.05)
    decision = balancer.decide(replace(window, step_time=0.5 * balancer.baseline))
    assert (decision.reason, decision.fraction) == ("cpu-would-slow", 0.0)
    assert decision.predicted_step_time == pytest.approx(window.overhead + BATCH / PIPELINE_SPEED)


def test_predictions_count_the_sync() -> None:
    balancer = Balancer(MICRO)
    balancer.decide(measure(balancer.start(0.0).fraction, 1000.0))
    decision = balancer.decide(measure(MICRO / BATCH, 1000.0, sync=0.002))
    assert decision.reason == "balance"
    assert decision.predicted_step_time == pytest.approx(0.005 + max(
        (BATCH - split_batch(BATCH, decision.fraction, 1, MICRO).pipeline_size) / 1000.0,
        split_batch(BATCH, decision.fraction, 1, MICRO).pipeline_size / 1000.0,
    ) + 0.002)


@pytest.mark.parametrize("margin,kept", [(0.0, True), (0.2, False)])
def test_a_probe_must_beat_the_baseline_by_the_margin(margin: float, kept: bool) -> None:
    # 1:10 saves ~6% of the step at best.
    fractions = run(Balancer(MICRO, margin=margin), 0.1, [100.0] * 6)
    assert (fractions[-1] > 0) == kept


def test_a_large_change_replaces_the_estimates_at_once() -> None:
    balancer = Balancer(MICRO)
    run(balancer, 0.5, [1000.0] * 6)
    balancer.decide(measure(balancer.fraction, 250.0))
    assert balancer.cpu_per_sample == pytest.approx(1 / 250.0)  # not blended with the old 1/1000


def test_several_cpu_workers_share_the_cpu_side() -> None:
    # Two CPU workers, each at 500 samples/s: the CPU side computes 1000 samples/s, like the pipeline.
    balancer = Balancer(MICRO, cpu_workers=2)
    balancer.cpu_per_sample, balancer.pipeline_per_sample = 1 / 500, 1 / 1000
    assert balancer._target() == pytest.approx(0.5)
    window = measure(0.5, 1000.0)
    assert balancer._predict(window, 0.5) == pytest.approx(window.overhead + 0.032)


def test_it_leaves_fraction_one_when_the_pipeline_gets_faster() -> None:
    balancer = Balancer(MICRO, probe_after=3)
    fractions = run(balancer, 1.0, [1000.0] * 3, pipeline_speed=10.0)  # a slow pipeline: all on the CPU
    assert fractions == [1.0, 1.0, 1.0]
    # The pipeline gets 100x faster. At fraction 1 it is not measured; it is probed now and then.
    fractions = [balancer.decide(measure(balancer.fraction, 1000.0, 1000.0)).fraction for _ in range(8)]
    assert abs(fractions[-1] - 0.5) <= 0.05, fractions


def test_a_step_just_off_fraction_one_goes_back_when_the_pipeline_is_slow() -> None:
    balancer = Balancer(MICRO)
    balancer.decide(measure(balancer.start(0.0).fraction, 1000.0, 10.0))
    decision = balancer.decide(measure(1 - MICRO / BATCH, 1000.0, 10.0))
    # The balance point (0.99) is in this cell of the grid, but 2 samples on the pipeline take
    # 0.2 s where the CPU does the whole batch in 0.064 s: that is no noise to hold against.
    assert decision.fraction == 1.0


def test_a_fraction_set_from_outside_is_adopted_as_a_probe() -> None:
    balancer = Balancer(MICRO)
    run(balancer, 0.0, [1000.0] * 4)
    balancer.adopt(0.75)
    assert balancer.probing and balancer.fraction == 0.75
    assert balancer.decide(measure(0.75, 1000.0)).fraction < 0.75


def test_a_cpu_too_slow_to_help_gets_nothing_and_is_probed_later() -> None:
    balancer = Balancer(MICRO, probe_after=5)
    fractions = run(balancer, 1 / 3, [10.0] * 60)  # 1:100: even its smallest share lengthens the step
    assert fractions[1] == 0.0  # the probe is dropped at its first measurement
    probes = [i for i, f in enumerate(fractions) if f > 0]
    assert probes and all(fractions[i + 1] == 0.0 for i in probes if i + 1 < len(fractions))
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # tried again, less often each time it fails
    assert sum(f > 0 for f in fractions) <= 4


def test_sync_that_costs_more_than_the_cpu_saves_means_fraction_zero() -> None:
    # The CPU is as fast as the pipeline, but summing its gradients costs more than its share saves.
    fractions = run(Balancer(MICRO), 0.5, [1000.0] * 20, sync=0.05)
    assert fractions[1] == 0.0 and sum(f > 0 for f in fractions[1:]) <= 2  # only a rare probe


def test_probing_finds_a_cpu_that_became_free() -> None:
    speeds = [10.0] * 10 + [1000.0] * 30  # another job held the CPU, then finished
    fractions = run(Balancer(MICRO, probe_after=5), 0.0, speeds)
    assert fractions[9] == 0.0 and abs(fractions[-1] - 0.5) <= 0.05


def test_a_machine_that_slows_down_as_a_whole_is_verified_against_a_new_baseline() -> None:
    balancer = Balancer(MICRO)
    decision = balancer.start(0.0)
    for _ in range(6):
        decision = balancer.decide(measure(decision.fraction, 1000.0))
    assert decision.fraction == 0.5
    # Everything gets 3x slower: the step is now slower than the old baseline.
    decision = balancer.decide(measure(0.5, 300.0, 300.0))
    assert (decision.reason, decision.fraction) == ("verify", 0.0)
    decision = balancer.decide(measure(0.0, 300.0, 300.0))
    assert (decision.reason, decision.fraction) == ("balance", 0.5)  # the CPU still helps: back to it


def test_state_round_trips_without_the_settings() -> None:
    balancer = Balancer(MICRO)
    run(balancer, 0.2, [300.0] * 7)
    copy = Balancer(MICRO)
    copy.load_state_dict(json.loads(json.dumps(balancer.state_dict())))
    assert copy == balancer
    other = Balancer(4, deadband=0.1)
    other.load_state_dict(balancer.state_dict())
    assert (other.micro_batches, other.deadband) == (4, 0.1)  # the callback's settings win on resume


def _record(rank: int, role: str, samples: int, share: float, sync: float, total: float) -> StepRecord:
    return StepRecord(step=0, rank=rank, role=role, samples=samples, share=share, sync=sync, total=total,
                      cpu_fraction=0.5)


def test_summarize_takes_the_slowest_worker_of_each_side() -> None:
    step = [
        _record(0, "cpu0", 16, 0.032, 0.004, 0.050),  # 2 ms/sample
        _record(1, "cpu1", 16, 0.048, 0.002, 0.051),  # 3 ms/sample: the CPU side's pace
        _record(2, "stage0", 32, 0.040, 0.003, 0.052),
        _record(3, "stage1", 32, 0.044, 0.003, 0.050),  # the pipeline's pace
    ]
    window = summarize([[r] for r in step], 0.5)
    assert window is not None
    assert window.batch_size == 64 and window.steps == 1
    assert window.cpu_per_sample == pytest.approx(0.003)  # per sample, on the slowest CPU worker
    assert window.pipeline_per_sample == pytest.approx(0.044 / 32)
    assert window.sync == pytest.approx(0.002) and window.step_time == pytest.approx(0.052)
    assert window.overhead == pytest.approx(0.052 - 0.048 - 0.002)
    assert summarize([[r] for r in step], 0.25) is None  # no step ran at that fraction


def test_summarize_adds_up_the_replicas_parts() -> None:
    """Device replicas each compute a part of the devices' share: together they are the devices'
    side, at the pace of the slowest (a CPU worker and two replicas, 10 ms a sample everywhere)."""
    step = [
        _record(0, "cpu0", 32, 0.320, 0.0, 0.33),
        _record(1, "replica0", 16, 0.160, 0.0, 0.33),
        _record(2, "replica1", 16, 0.160, 0.0, 0.33),
    ]
    window = summarize([[r] for r in step], 0.5)
    assert window is not None and window.batch_size == 64
    assert window.cpu_per_sample == pytest.approx(0.010) and window.pipeline_per_sample == pytest.approx(0.160 / 32)


def test_summarize_shares_an_accumulated_steps_sum_out_over_its_batches() -> None:
    # Three batches per optimizer step; only the last one sums gradients (30 ms).
    def rank(role: str, samples: int, share: float) -> list[StepRecord]:
        return [
            StepRecord(step=step, rank=0, role=role, samples=samples, share=share, total=0.05 + (0.03 if last else 0.0),
                       sync=0.03 if last else 0.0, cpu_fraction=0.5)
            for step in (0, 1) for last in (False, False, True)
        ]

    window = summarize([rank("cpu0", 32, 0.032), rank("stage0", 32, 0.016)], 0.5)
    assert window is not None and window.steps == 2 and window.batch_size == 64
    assert window.sync == pytest.approx(0.01) and window.step_time == pytest.approx(0.06)
    assert window.cpu_per_sample == pytest.approx(0.001) and window.pipeline_per_sample == pytest.approx(0.0005)


@pytest.mark.parametrize(
    "kwargs",
    [{"every_n_steps": 0}, {"warmup_steps": 10}, {"max_step": 0.0}, {"deadband": 1.0}, {"probe_after": 0}],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must"):
        AdaptiveRebalancer(**kwargs)


@pytest.mark.parametrize("speed", [{"gpu": 3.0}, {"cpu": 0}, {"pipeline": -1.0}, {"cpu": float("inf")}, [1.0]])
def test_bad_emulated_speeds_are_refused_before_any_process_starts(speed: Any, no_processes: None) -> None:
    with pytest.raises(ValueError, match="emulated_speed"):
        hetero(emulated_speed=speed)


# ------------------------------------------------------------------ real runs


def data(steps: int, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(BATCH * steps, 6, generator=g), torch.randn(BATCH * steps, 3, generator=g)),
                      batch_size=BATCH)


class RecordFractions(L.Callback):
    """Global rank 0 writes the CPU fraction each training batch ran with."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.fractions: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.fractions.append(trainer.strategy.cpu_fraction)

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero:
            self.out.write_text(json.dumps(self.fractions))


class ChangeSpeed(L.Callback):
    """From ``step`` on, the CPU worker is emulated at another speed (on every rank alike)."""

    def __init__(self, step: int, speed: dict[str, float]) -> None:
        self.step, self.speed = step, speed

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.strategy.set_emulated_speed(self.speed)


def decisions(log_dir: Path) -> list[dict[str, float]]:
    return [row for row in read_metrics(log_dir) if "rebalancer/cpu_fraction" in row]


EVERY = 4
# Real runs: slow enough emulated speeds that the strategy's fixed cost per step (~15 ms on two
# shared cores, for this tiny model) leaves the CPU's share a gain the measurements can see.
REAL_PIPELINE = 500.0
# Where the decisions themselves are checked: slower still, so that the step's jitter on a busy
# 2-core machine (milliseconds) stays well under the 1:10 split's gain (about 23 ms of 256).
DECIDING_PIPELINE = 250.0


@pytest.mark.parametrize("ratio", RATIOS)
def test_real_run_converges_to_the_ideal_split(tmp_path: Path, ratio: str) -> None:
    cpu_speed = RATIOS[ratio] * DECIDING_PIPELINE
    strategy = hetero(micro_batches=MICRO, emulated_speed={"cpu": cpu_speed, "pipeline": DECIDING_PIPELINE})
    rebalancer = AdaptiveRebalancer(every_n_steps=EVERY, warmup_steps=1)
    trainer(strategy, tmp_path, max_steps=7 * EVERY, callbacks=[rebalancer]).fit(Net(), data(7 * EVERY))
    rows = decisions(tmp_path)
    fractions = [row["rebalancer/cpu_fraction"] for row in rows]
    assert rows[0]["rebalancer/reason"] == REASONS.index("baseline") and fractions[0] == 0.0
    # Baseline, probe, one move (the run starts at 1/3, within max_step of every ideal here).
    assert all(abs(f - ideal(cpu_speed, DECIDING_PIPELINE)) <= 0.05 for f in fractions[3:]), fractions
    assert len(set(fractions[3:])) == 1
    measured = [row["rebalancer/cpu_s_per_sample"] for row in rows[3:]]
    assert all(m == pytest.approx(1 / cpu_speed, rel=0.2) for m in measured)  # the knob's pace, measured


def test_real_run_follows_a_cpu_that_slows_down(tmp_path: Path) -> None:
    strategy = hetero(micro_batches=MICRO, emulated_speed={"cpu": DECIDING_PIPELINE, "pipeline": DECIDING_PIPELINE})
    busy = DECIDING_PIPELINE / 10
    slower = ChangeSpeed(5 * EVERY, {"cpu": busy, "pipeline": DECIDING_PIPELINE})  # another job takes the CPU
    callbacks = [AdaptiveRebalancer(every_n_steps=EVERY, warmup_steps=1), slower, RecordFractions(tmp_path / "f")]
    trainer(strategy, tmp_path, max_steps=10 * EVERY, callbacks=callbacks).fit(Net(), data(10 * EVERY))
    fractions = json.loads((tmp_path / "f").read_text())
    assert abs(fractions[5 * EVERY - 1] - 0.5) <= 0.05, fractions  # 1:1 before the change
    # Within three decisions of the change (1:10), the split follows, and stays.
    assert all(abs(f - ideal(busy, DECIDING_PIPELINE)) <= 0.05 for f in fractions[8 * EVERY :]), fractions


def test_real_run_drops_a_cpu_that_cannot_help(tmp_path: Path) -> None:
    # It starts from a share of two samples, which at a 50th of the pipeline's speed cost more than its 64.
    speed = {"cpu": DECIDING_PIPELINE / 50, "pipeline": DECIDING_PIPELINE}
    strategy = hetero(micro_batches=MICRO, cpu_fraction=2 / BATCH, emulated_speed=speed)
    trainer(strategy, tmp_path, max_steps=6 * EVERY, callbacks=[AdaptiveRebalancer(every_n_steps=EVERY, warmup_steps=1)]).fit(
        Net(), data(6 * EVERY)
    )
    rows = decisions(tmp_path)
    assert [row["rebalancer/cpu_fraction"] for row in rows[2:]] == [0.0] * (len(rows) - 2)
    assert rows[2]["rebalancer/reason"] in (REASONS.index("cpu-would-slow"), REASONS.index("cpu-did-not-help"))


@pytest.mark.parametrize("mode,accumulate", [("coarse", 1), ("fine", 1), ("coarse", 2)])
def test_parameters_match_the_reference_while_the_fraction_moves(tmp_path: Path, mode: str, accumulate: int) -> None:
    steps = 6 * EVERY
    plain = Net(optimizer="adamw")
    trainer(None, max_steps=steps, accumulate_grad_batches=accumulate).fit(plain, data(steps * accumulate))
    model = Net(optimizer="adamw")
    strategy = hetero(mode=mode, micro_batches=MICRO, emulated_speed={"cpu": 150.0, "pipeline": REAL_PIPELINE})
    callbacks = [AdaptiveRebalancer(every_n_steps=EVERY, warmup_steps=1), RecordCopies(tmp_path), RecordFractions(tmp_path / "f")]
    trainer(strategy, max_steps=steps, callbacks=callbacks, accumulate_grad_batches=accumulate).fit(
        model, data(steps * accumulate)
    )
    fractions = json.loads((tmp_path / "f").read_text())
    assert len(set(fractions)) >= 3  # idle, probe, balanced: the split moved during the run
    assert_copies_identical(tmp_path)
    assert max_param_diff(plain, model) < TOL


@pytest.mark.parametrize("resumed_as", ["same", "no-cpu-worker", "from-a-balancer-never-started"])
def test_resume_continues_with_the_same_fraction_and_parameters(tmp_path: Path, resumed_as: str) -> None:
    """A resumed run takes the checkpoint's split; one without CPU workers holds at none (it once
    failed applying the checkpoint's share); a checkpoint whose balancer never started (a run
    without CPU workers saves one) starts this run's from its baseline."""
    steps, cut = 8 * EVERY, 4 * EVERY  # two epochs; the checkpoint is the first one's end
    speed = {"cpu": 150.0, "pipeline": REAL_PIPELINE}

    def fit(
        out: str, max_steps: int, ckpt_path: Optional[Path] = None, checkpoint: Optional[ModelCheckpoint] = None, **layout: Any
    ) -> Net:
        # Created in float64, so resuming loads the checkpoint's weights without rounding them.
        model = Net(optimizer="adamw").double()
        callbacks: list[L.Callback] = [AdaptiveRebalancer(every_n_steps=EVERY, warmup_steps=1), RecordFractions(tmp_path / out)]
        if checkpoint is not None:
            callbacks.append(checkpoint)
        strategy = hetero(micro_batches=MICRO, emulated_speed=speed, **layout)
        logs = tmp_path / f"{out}_logs"
        trainer(strategy, logs, max_steps=max_steps, callbacks=callbacks, enable_checkpointing=checkpoint is not None).fit(
            model, data(cut), ckpt_path=ckpt_path
        )
        return model

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=cut, save_top_k=-1)
    whole = fit("whole", steps, checkpoint=checkpoint)
    path = tmp_path / "ckpt" / f"step={cut}.ckpt"
    saved = torch.load(path, weights_only=False)
    (name, state), = [(k, v) for k, v in saved["callbacks"].items() if k.startswith("AdaptiveRebalancer")]
    whole_fractions = json.loads((tmp_path / "whole").read_text())
    assert whole_fractions[cut] > 0.0
    assert state["balancer"]["fraction"] == whole_fractions[cut] and state["decisions"]
    if resumed_as == "from-a-balancer-never-started":
        saved["callbacks"][name]["balancer"] = Balancer(MICRO, 1).state_dict()
        path = tmp_path / "never_started.ckpt"
        torch.save(saved, path)
    resumed = fit("resumed", steps, ckpt_path=path, **({"cpu_workers": 0} if resumed_as == "no-cpu-worker" else {}))
    plain = Net(optimizer="adamw")
    trainer(None, max_steps=steps).fit(plain, data(cut))
    resumed_fractions = json.loads((tmp_path / "resumed").read_text())
    if resumed_as == "same":
        assert resumed_fractions[0] == whole_fractions[cut]  # the balanced split, not a new baseline
    elif resumed_as == "no-cpu-worker":
        assert set(resumed_fractions) == {0.0}
    else:
        first = decisions(tmp_path / "resumed_logs")[0]
        assert first["rebalancer/reason"] == REASONS.index("baseline") and resumed_fractions[0] == 0.0
    assert max_param_diff(plain, resumed) < TOL and max_param_diff(whole, resumed) < TOL


def test_the_default_fraction_is_the_share_the_cpu_earns(tmp_path: Path) -> None:
    """`cpu_fraction="auto"` (the default): with no rebalancer of the user's, the strategy adds one
    with its defaults, which measures the CPU from the first steps and gives it its share."""
    speed = {"cpu": DECIDING_PIPELINE, "pipeline": DECIDING_PIPELINE}
    strategy = hetero(micro_batches=MICRO, cpu_fraction="auto", emulated_speed=speed)
    steps = 40  # the defaults' windows: a baseline (10 steps), a probe (4), then a decision every 10
    trainer(strategy, tmp_path, max_steps=steps, callbacks=[RecordFractions(tmp_path / "f")]).fit(Net(), data(steps))
    fractions = json.loads((tmp_path / "f").read_text())
    rows = decisions(tmp_path)
    assert [row["rebalancer/reason"] for row in rows[:2]] == [REASONS.index("baseline"), REASONS.index("probe")]
    assert fractions[:10] == [0.0] * 10 and fractions[10] == pytest.approx(1 / 3, abs=0.02)  # the fair share (on the grid), probed
    assert abs(fractions[-1] - 0.5) <= 0.05, fractions  # as fast as the pipeline: half of every batch


def test_the_default_fraction_drops_a_cpu_that_cannot_help(tmp_path: Path) -> None:
    speed = {"cpu": DECIDING_PIPELINE / 50, "pipeline": DECIDING_PIPELINE}
    strategy = hetero(micro_batches=MICRO, cpu_fraction="auto", emulated_speed=speed)
    small = DataLoader(data(24).dataset, batch_size=12)  # a short probe: the CPU's 4 samples take 0.8 s
    trainer(strategy, tmp_path, max_steps=24, callbacks=[RecordFractions(tmp_path / "f")]).fit(Net(), small)
    fractions = json.loads((tmp_path / "f").read_text())
    assert fractions[10:14] == [pytest.approx(1 / 3, abs=0.1)] * 4 and fractions[14:] == [0.0] * 10, fractions
    assert decisions(tmp_path)[2]["rebalancer/reason"] in (REASONS.index("cpu-would-slow"), REASONS.index("cpu-did-not-help"))


@pytest.mark.parametrize("cpu_fraction", [0.25, "auto-with-mine"])
def test_a_given_fraction_or_rebalancer_is_kept(tmp_path: Path, cpu_fraction: Any) -> None:
    """An explicit fraction stays as given; a rebalancer of the user's is the only one."""
    mine = cpu_fraction == "auto-with-mine"
    strategy = hetero(micro_batches=MICRO, cpu_fraction="auto" if mine else cpu_fraction)
    callbacks: list = [RecordFractions(tmp_path / "f")] + [AdaptiveRebalancer(every_n_steps=4, warmup_steps=1)] * mine
    trainer(strategy, tmp_path, max_steps=12, callbacks=callbacks).fit(Net(), data(12))
    fractions = json.loads((tmp_path / "f").read_text())
    if mine:
        assert [row["step"] for row in decisions(tmp_path)][:2] == [0, 4]  # its every_n_steps, not the default's
    else:
        assert fractions == [0.25] * 12 and not decisions(tmp_path)


def test_does_nothing_without_cpu_workers_unless_it_may_move_the_loaders(tmp_path: Path) -> None:
    strategy = hetero(cpu_workers=0, micro_batches=MICRO)
    rebalancer = AdaptiveRebalancer(every_n_steps=1, warmup_steps=0, balance_loading=False)
    trainer(strategy, tmp_path / "off", max_steps=4, callbacks=[rebalancer]).fit(Net(), data(4))
    assert read_metrics(tmp_path / "off") and not decisions(tmp_path / "off")
    # With the loaders to move (a DataLoader left at `num_workers=0`), it decides on them only.
    strategy = hetero(cpu_workers=0, micro_batches=MICRO)
    rebalancer = AdaptiveRebalancer(every_n_steps=1, warmup_steps=0)
    trainer(strategy, tmp_path / "on", max_steps=4, callbacks=[rebalancer]).fit(Net(), data(4))
    rows = decisions(tmp_path / "on")
    assert rows and all(row["rebalancer/cpu_fraction"] == 0.0 for row in rows)
    assert all(row["rebalancer/reason"] == REASONS.index("hold") for row in rows)


def test_does_nothing_without_the_hetero_strategy() -> None:
    with pytest.warns(UserWarning, match="AdaptiveRebalancer does nothing"):
        trainer(None, max_steps=2, callbacks=[AdaptiveRebalancer(every_n_steps=1, warmup_steps=0)]).fit(Net(), data(2))


def test_a_failed_decision_ends_every_rank_with_its_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Balancer, window: Window) -> None:
        raise ZeroDivisionError("a broken measurement")

    monkeypatch.setattr(Balancer, "decide", broken)  # the forked ranks inherit it; only rank 0 decides
    strategy = hetero(micro_batches=MICRO, timeout=TIMEOUT)
    with pytest.raises(ProcessRaisedException, match="a broken measurement") as error:
        trainer(strategy, max_steps=4, callbacks=[AdaptiveRebalancer(every_n_steps=2, warmup_steps=0)]).fit(Net(), data(4))
    # Whichever rank reports first, the error names rank 0 as where it happened.
    assert "raised on global rank 0" in str(error.value) or "failed on global rank 0" in str(error.value)


def test_the_other_ranks_raise_rank_zeros_failure_instead_of_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a rank other than 0 (as under torchrun, where no launcher stops the others), the broadcast
    # brings rank 0's failure, and it is raised there too.
    from types import SimpleNamespace

    import lightning_hetero.rebalancer as module

    sent = RuntimeError("AdaptiveRebalancer failed on global rank 0: ZeroDivisionError()")
    strategy = SimpleNamespace(
        cpu_fraction=0.0, gather_step_records=lambda count, dst: [], broadcast=lambda obj, src: sent
    )
    monkeypatch.setattr(module, "hetero_strategy", lambda trainer: strategy)
    callback = AdaptiveRebalancer(every_n_steps=1, warmup_steps=0)
    callback.balancer = Balancer(MICRO)
    fake_trainer = SimpleNamespace(global_step=1, is_global_zero=False)
    with pytest.raises(RuntimeError, match="failed on global rank 0"):
        callback.on_train_batch_end(fake_trainer, None)  # type: ignore[arg-type]
