"""Pipeline schedules with several stages per process (`pipeline.py`): Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble, ZBVZeroBubble and DualPipeV, each process holding two of the stages (a loop, or
a V), train the model one process trains (float64, 1e-10) across 2 and 3 processes, CPU fractions 0,
mid and 1, coarse and fine (zero-bubble's weight pass included), with accumulation, clipping, the
rebalancer and a resume; the monitor's trace shows every process's stage work; what a schedule cannot
take is refused before any process starts."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hetero import HeteroStrategy
from lightning_hetero.pipeline import V_SHAPED, available_schedules, holders, stages_of
from lightning_hetero.plan import HeteroPlan
from lightning_hetero.planner import schedule_candidates
from lightning_hetero.profiling import Profile
from tests.conftest import RecordCopies, assert_copies_identical, hetero, max_param_diff, trainer
from tests.models import Net, TiedNet, regression_data
from tests.test_replicas import assert_same_run

TOL = 1e-10
STEPS = 8


SCHEDULES = available_schedules()


def micro_batches(schedule: str, processes: int) -> int:
    """A count the schedule takes: DualPipeV one per stage, the others one per process."""
    return 2 * processes if schedule == "DualPipeV" else processes


def fit(strategy: Any, steps: int = STEPS, ckpt: Path | None = None, **kwargs: Any) -> Net:
    model = Net().double()  # a checkpoint loads before the precision plugin converts the model
    trainer(strategy, max_steps=steps, **kwargs).fit(model, regression_data(), ckpt_path=ckpt)
    return model


@pytest.fixture(scope="module")
def plain() -> Net:
    return fit(None)


def test_stages_sit_in_a_loop_or_a_v() -> None:
    assert [stages_of(r, 3, 2, v_shaped=False) for r in range(3)] == [[0, 3], [1, 4], [2, 5]]
    assert [stages_of(r, 3, 2, v_shaped=True) for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert holders(2, 2, v_shaped=True) == [0, 1, 1, 0] and holders(2, 3, v_shaped=False) == [0, 1, 0, 1, 0, 1]


@pytest.mark.parametrize("fraction", [0.0, 0.4, 1.0], ids=["no-cpu-share", "mid", "all-on-cpu"])
@pytest.mark.parametrize("processes", [2, 3])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_coarse_mode_trains_the_one_process_model(
    tmp_path: Path, plain: Net, schedule: str, processes: int, fraction: float
) -> None:
    strategy = hetero(stages=["cpu"] * processes, schedule=schedule, micro_batches=micro_batches(schedule, processes), cpu_fraction=fraction)
    assert strategy.plan.stages_per_process == 2
    model = fit(strategy, callbacks=[RecordCopies(tmp_path)])
    assert_copies_identical(tmp_path)
    assert max_param_diff(plain, model) < TOL


@pytest.mark.parametrize("processes", [2, 3])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_fine_mode_steps_each_bucket_as_its_gradients_arrive(tmp_path: Path, plain: Net, schedule: str, processes: int) -> None:
    """A bucket per block, every other one offloaded: each is summed and stepped once its gradients
    of every micro-batch have arrived, also where a zero-bubble schedule computes them in a pass of
    their own."""
    strategy = hetero(
        mode="fine", bucket_size_mb=1e-5, offload=[0, 2], stages=["cpu"] * processes, schedule=schedule,
        micro_batches=micro_batches(schedule, processes), cpu_fraction=0.4,
    )  # fmt: skip
    model = fit(strategy, callbacks=[RecordCopies(tmp_path)])
    assert_copies_identical(tmp_path)
    assert max_param_diff(plain, model) < TOL


@pytest.mark.parametrize(
    ("schedule", "mode"), [("Interleaved1F1B", "coarse"), ("ZBVZeroBubble", "fine"), ("DualPipeV", "coarse")]
)
def test_with_accumulation_and_clipping(tmp_path: Path, schedule: str, mode: str) -> None:
    if schedule not in SCHEDULES:
        pytest.skip(f"this torch has no {schedule}")
    strategy = hetero(mode=mode, stages=["cpu", "cpu"], schedule=schedule, micro_batches=4, cpu_fraction=0.3)
    assert_same_run(tmp_path, strategy, accumulate_grad_batches=2, gradient_clip_val=0.05)


def test_the_rebalancer_moves_the_cpu_share(tmp_path: Path, plain: Net) -> None:
    """`cpu_fraction="auto"`: the rebalancer moves the share while training; whatever it chooses, and
    however the pipeline's share then splits into micro-batches, the model is the one process's."""
    strategy = hetero(stages=["cpu", "cpu"], schedule="Interleaved1F1B", micro_batches=2, cpu_fraction="auto")
    assert max_param_diff(plain, fit(strategy)) < TOL


@pytest.mark.parametrize(
    ("schedule", "mode", "cpu_workers"), [("Interleaved1F1B", "coarse", 1), ("ZBVZeroBubble", "fine", 1), ("ZBVZeroBubble", "coarse", 0)]
)
def test_resume_matches_the_uninterrupted_run(tmp_path: Path, schedule: str, mode: str, cpu_workers: int) -> None:
    """Without a CPU worker, global rank 0 is the first stage process, which in a V holds the first
    and the last stage: the checkpoint gathers every process's stages into one state."""
    if schedule not in SCHEDULES:
        pytest.skip(f"this torch has no {schedule}")

    def strategy() -> HeteroStrategy:
        return hetero(
            mode=mode, stages=["cpu", "cpu"], schedule=schedule, micro_batches=2, cpu_workers=cpu_workers,
            cpu_fraction=0.5 if cpu_workers else 0.0,
        )  # fmt: skip

    saving = ModelCheckpoint(tmp_path, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    whole = fit(strategy(), callbacks=[saving], enable_checkpointing=True)
    resumed = fit(strategy(), ckpt=tmp_path / "step=4.ckpt")
    assert max_param_diff(whole, resumed) < TOL
    assert max_param_diff(fit(None, ckpt=tmp_path / "step=4.ckpt"), resumed) < TOL  # an ordinary checkpoint


@pytest.mark.parametrize(
    ("schedule", "cpu_workers", "processes"),
    [("ZBVZeroBubble", 0, 2), ("Interleaved1F1B", 1, 2), ("DualPipeV", 1, 2), ("Interleaved1F1B", 1, 1), ("LoopedBFS", 0, 1)],
)
def test_validation_and_prediction_give_one_process_outputs(schedule: str, cpu_workers: int, processes: int) -> None:
    """Forward only, the stages in a loop over several processes run torch's schedule; in a V (whose
    first process holds the last stage too, here the run's global rank 0 without a CPU worker) and in
    a loop on one process, where a process holds consecutive stages, every micro-batch goes through
    the stages in order."""
    if schedule not in SCHEDULES:
        pytest.skip(f"this torch has no {schedule}")
    validation, prediction = regression_data(n=20, seed=3), regression_data(n=25, batch_size=6, seed=4)
    plain, model = Net().double(), Net().double()
    reference = trainer(None, max_steps=STEPS)
    reference.fit(plain, regression_data(), val_dataloaders=validation)
    layout = dict(stages=["cpu"] * processes, schedule=schedule, micro_batches=4, cpu_workers=cpu_workers, cpu_fraction=0.0)
    run = trainer(hetero(**layout), max_steps=STEPS)
    run.fit(model, regression_data(), val_dataloaders=validation)
    assert max_param_diff(plain, model) < TOL
    assert float(run.callback_metrics["val_loss"]) == pytest.approx(float(reference.callback_metrics["val_loss"]), abs=1e-12)
    predicted = trainer(hetero(**layout)).predict(model, prediction)
    expected = trainer(None).predict(plain, prediction)
    assert len(predicted) == len(expected) and all(torch.allclose(a, b, atol=1e-12) for a, b in zip(predicted, expected))


def test_the_trace_shows_every_stage_process_at_work(tmp_path: Path) -> None:
    from lightning_hetero.callbacks import UtilizationMonitor

    monitor = UtilizationMonitor(every_n_steps=2, trace_steps=4, save_dir=str(tmp_path), summary=False)
    strategy = hetero(stages=["cpu", "cpu"], schedule="Interleaved1F1B", micro_batches=2, cpu_fraction=0.3)
    fit(strategy, steps=4, callbacks=[monitor])
    spans = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    for rank in (1, 2):  # both stage processes, each computing its two stages, and waiting between them
        track = sorted((e for e in spans if e["pid"] == rank), key=lambda e: e["ts"])
        assert {"compute", "send/recv (and bubbles)"} <= {e["name"] for e in track}
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(track, track[1:]))  # no overlap


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(schedule="DualPipeV", micro_batches=2), "cannot run `micro_batches=2` with 2 stage process"),
        (dict(schedule="Interleaved1F1B", micro_batches=5), "rounds \\(micro_batches // 2\\) divide"),
        (dict(schedule="GPipe", stages_per_process=2), "runs one stage per process"),
        (dict(schedule="Interleaved1F1B", stages_per_process=1), "`stages_per_process` must be 2 or more"),
        (dict(schedule="ZBVZeroBubble", stages_per_process=3), "two stages per process in a V"),
        (dict(schedule="Zigzag"), "not one of torch's pipeline schedules"),
        (dict(schedule="PipelineScheduleMulti"), "torch's base class of pipeline schedules"),
        (dict(schedule="PipelineScheduleSingle"), "torch's base class of pipeline schedules"),
    ],
    ids=["too-few-micro-batches", "rounds", "single-stage", "multi-stage-with-one", "v-with-three", "unknown", "base-multi", "base-single"],
)
def test_what_a_schedule_cannot_take_is_refused_when_the_strategy_is_made(arguments: dict, message: str) -> None:
    if arguments["schedule"] in ("DualPipeV", "ZBVZeroBubble") and arguments["schedule"] not in SCHEDULES:
        pytest.skip(f"this torch has no {arguments['schedule']}")
    with pytest.raises(ValueError, match=message):
        HeteroStrategy(stages=["cpu", "cpu"], **arguments)


def test_a_schedule_this_torch_lacks_names_the_torch_that_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_hetero.pipeline as pipeline

    def lacking(name: str) -> type:
        raise ValueError(f"Unknown schedule type {name}")

    monkeypatch.setattr(pipeline, "get_schedule_class", lacking)
    with pytest.raises(ValueError, match="came with torch 2.8; this torch .* lacks it"):
        HeteroStrategy(stages=["cpu", "cpu"], schedule="DualPipeV", micro_batches=4)


def test_a_model_with_fewer_blocks_than_stages_is_refused_before_any_process_starts(no_processes: None) -> None:
    strategy = hetero(schedule="Interleaved1F1B", micro_batches=2, cpu_fraction=0.5, stages=["cpu"] * 4)
    with pytest.raises(ValueError, match="Cannot cut 6 layer\\(s\\) into 8 pipeline stages"):
        trainer(strategy, max_steps=1).fit(Net(), regression_data())


def test_an_encoder_placed_for_a_later_stage_is_refused_with_a_split_backward(no_processes: None) -> None:
    """A zero-bubble schedule's input pass gives a stage after the first no gradient for an encoder's
    output it took in; in the first stage (whose backward is whole) or with a whole backward, it trains
    (``tests/test_multimodal.py``)."""
    from tests.models import PipelinedMultimodal

    class LateEncoders(PipelinedMultimodal):
        def __init__(self) -> None:
            super().__init__()
            self.before = nn.Identity()

        def pipeline_layers(self) -> list:
            return [self.before, self.fuse, *self.backbone]

    def plan(schedule: str, boundaries: list[int]) -> HeteroPlan:
        return HeteroPlan(
            stages=["cpu", "cpu"], schedule=schedule, stages_per_process=2, boundaries=boundaries, micro_batches=4,
            encoders={"image": "cpu0"}, parallelism="pipeline", cpu_fraction=0.3,
        )  # fmt: skip

    for schedule in ("ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"):
        if schedule in SCHEDULES:
            with pytest.raises(ValueError, match=r"placed encoders \['image'\] in stage\(s\) after the first \(\[1\]\)"):
                plan(schedule, [1, 2, 3]).place_blocks(LateEncoders())
            plan(schedule, [2, 3, 4]).place_blocks(LateEncoders())  # the encoders in the first stage
    plan("Interleaved1F1B", [1, 2, 3]).place_blocks(LateEncoders())


def test_a_schedule_named_for_a_model_without_blocks_is_said_to_have_no_effect(no_processes: None) -> None:
    from tests.models import TwoPass

    with pytest.warns(UserWarning, match=r"`schedule='Interleaved1F1B'` orders a pipeline's stages, but `TwoPass`"):
        HeteroStrategy(stages=["cpu", "cpu"], schedule="Interleaved1F1B").check_model(TwoPass())
    with pytest.warns(UserWarning, match=r"`stages_per_process=2` orders"):
        HeteroStrategy(stages=["cpu", "cpu"], stages_per_process=2).check_model(TwoPass())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HeteroStrategy(stages=["cpu", "cpu"]).check_model(TwoPass())  # nothing named
        HeteroStrategy(stages=["cpu", "cpu"], schedule="1F1B", parallelism="replicas").check_model(Net())  # blocks


def test_a_single_stage_schedule_keeps_one_stage_per_process() -> None:
    assert HeteroStrategy(stages=["cpu", "cpu"], schedule="1F1B", micro_batches=2).plan.stages_per_process == 1


def _analyzed(tmp_path: Path, model: Net, **kwargs: Any) -> tuple[Net, HeteroPlan, str]:
    """Fit ``model`` with the workload analyzer planning the run; the model, the plan and explain.txt."""
    from lightning_hetero.callbacks import WorkloadAnalyzer

    analyzer = WorkloadAnalyzer(repeats=1, warmup_steps=2, measure_steps=1, save_dir=str(tmp_path))
    strategy = hetero(stages=["cpu", "cpu"], **{"cpu_fraction": 0.5, **kwargs})
    trainer(strategy, max_steps=STEPS, callbacks=[analyzer]).fit(model, regression_data())
    return model, HeteroPlan.load(tmp_path / "plan.yaml"), (tmp_path / "explain.txt").read_text()


def _weighed(explanation: str) -> list[tuple[str, int]]:
    table = explanation.split("each schedule weighed")[1].split("\n\n")[0].splitlines()[2:]
    return sorted((line.split()[0], int(line.split()[1])) for line in table)


@pytest.mark.skipif("Interleaved1F1B" not in SCHEDULES, reason="this torch lacks Interleaved1F1B")
def test_the_analyzer_plans_the_multi_stage_schedule_it_is_given(tmp_path: Path, plain: Net) -> None:
    """Named, the schedule stays; the planner cuts the blocks into the stages per process it finds
    fastest, and the run trains as one process does."""
    model, plan, explanation = _analyzed(tmp_path, Net().double(), schedule="Interleaved1F1B")
    assert max_param_diff(plain, model) < TOL
    assert plan.schedule == "Interleaved1F1B" and plan.stages_per_process in (2, 3)  # Net has six blocks
    assert len(plan.boundaries) == 2 * plan.stages_per_process - 1
    assert f"schedule Interleaved1F1B, {plan.stages_per_process} stages per process" in explanation
    assert _weighed(explanation) == [("Interleaved1F1B", 2), ("Interleaved1F1B", 3)]


@pytest.mark.skipif("DualPipeV" not in SCHEDULES, reason="this torch lacks DualPipeV")
def test_a_schedule_named_in_another_case_is_planned_as_torchs_spelling(tmp_path: Path, plain: Net) -> None:
    """torch knows schedule names in any case: ``"dualpipev"`` is DualPipeV, in the plan and to the
    planner, which weighs it in a V (two stages per process) only."""
    assert HeteroStrategy(stages=["cpu", "cpu"], schedule="dualpipev", micro_batches=4).plan.schedule == "DualPipeV"
    model, plan, explanation = _analyzed(tmp_path, Net().double(), schedule="dualpipev", micro_batches=4)
    assert max_param_diff(plain, model) < TOL
    assert (plan.schedule, plan.stages_per_process) == ("DualPipeV", 2)
    assert "schedule DualPipeV, 2 stages per process" in explanation
    assert schedule_candidates("dualpipev", "auto", processes=2, layers=6) == [("DualPipeV", 2)]


@pytest.mark.skipif("ZBVZeroBubble" not in SCHEDULES, reason="this torch lacks ZBVZeroBubble")
def test_in_a_v_the_analyzer_times_the_replay_on_the_first_process(tmp_path: Path) -> None:
    """The first process holds a V's last stage and replays the step method there: its warm-up gives the
    step method's own work per sample (nothing is replayed on the last stage process)."""
    _analyzed(tmp_path, Net().double(), schedule="ZBVZeroBubble", cpu_workers=0, cpu_fraction=0.0)
    assert Profile.load(tmp_path / "profile.json").step_method_s_per_sample > 0


def test_the_analyzer_chooses_the_schedule_left_to_it(tmp_path: Path, plain: Net) -> None:
    """``schedule="auto"`` (the default): every schedule this torch has is weighed, and explain.txt
    shows each one's fastest layout beside the one chosen."""
    model, plan, explanation = _analyzed(tmp_path, Net().double())
    assert max_param_diff(plain, model) < TOL
    expected = [("GPipe", 1), ("1F1B", 1)] + [(n, k) for n in SCHEDULES for k in ((2,) if n in V_SHAPED else (2, 3))]
    assert _weighed(explanation) == sorted(expected)
    first = explanation.split("each schedule weighed")[1].splitlines()[2].split()
    assert (first[0], int(first[1])) == (plan.schedule, plan.stages_per_process)


def test_the_analyzer_weighs_several_stages_per_process_for_tied_weights(tmp_path: Path) -> None:
    """Tied weights (the first block's weight in the fifth): every schedule is weighed, and the run
    with the one chosen trains as one process does."""
    reference = TiedNet().double()
    trainer(None, max_steps=STEPS).fit(reference, regression_data())
    model, _, explanation = _analyzed(tmp_path, TiedNet().double())
    assert ("ZBVZeroBubble", 2) in _weighed(explanation) or "ZBVZeroBubble" not in SCHEDULES
    assert max_param_diff(reference, model) < TOL
    profile = Profile.load(tmp_path / "profile.json")  # the planner counts the shared weight once where one process holds both uses
    shared = reference.layers[0].weight
    assert [(t.layers, t.params, t.param_bytes) for t in profile.tied] == [([0, 4], shared.numel(), shared.numel() * 8)]
    assert profile.held(range(len(profile.layers)))[0] == sum(p.numel() for p in reference.parameters())


def test_a_schedule_left_to_the_planner_is_gpipe_without_one() -> None:
    assert HeteroStrategy(stages=["cpu", "cpu"]).plan.schedule == "GPipe"
    if "Interleaved1F1B" in SCHEDULES:
        plan = HeteroStrategy(stages=["cpu", "cpu"], stages_per_process=3, micro_batches=2).plan
        assert (plan.schedule, plan.stages_per_process) == ("Interleaved1F1B", 3)
    assert HeteroStrategy(stages=["cpu", "cpu"], schedule="1F1B", micro_batches=2).schedule_request == ("1F1B", "auto")
