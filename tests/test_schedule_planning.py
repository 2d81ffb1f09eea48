"""The planner's model of pipeline schedules with one or several stages per process: each schedule's
order (torch's own), its bubble and the activations it holds, and the choice of schedule, stages
per process and cut."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_hetero.pipeline import available_schedules, holders, schedule_actions, schedule_class, takes
from lightning_hetero.plan import HeteroPlan
from lightning_hetero.planner import (
    explain,
    finish_times,
    main as planner_main,
    pipeline_tasks,
    plan_run,
    predict,
    predict_plan,
    partition,
    predict_replicas,
    schedule_candidates,
    _by_stage,
    _cut,
    _held,
    _holders,
    _stage_memory,
)
from lightning_hetero.profiling import LinkProfile, Profile, TiedProfile
from tests.test_planner import machine, profile


AVAILABLE = available_schedules()
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


def gpus(processes: int, **kwargs) -> object:
    """Stage processes on GPUs: nothing shared between them, a send only delays its receiver."""
    found = machine(processes, cpu=0, **kwargs)
    found.stage_names = [f"cuda:{i}" for i in range(processes)]
    return found


def even(layers: int, stages: int) -> list[tuple[int, int]]:
    size = layers // stages
    return [(s * size, (s + 1) * size) for s in range(stages)]


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", *AVAILABLE])
@pytest.mark.parametrize("processes", [2, 3])
def test_every_micro_batch_passes_every_stage_once_on_its_holder(schedule: str, processes: int) -> None:
    per_process = 1 if schedule in ("GPipe", "1F1B") else 2
    m = 2 * processes * per_process
    assert takes(schedule_class(schedule), processes, per_process, m)
    actions = schedule_actions(schedule, processes, per_process, m)
    owner = holders(processes, per_process, schedule in V_SHAPED)
    assert len(actions) == processes
    seen: dict[tuple[str, int, int], int] = {}
    for process, order in enumerate(actions):
        for kind, stage, k in order:
            assert owner[stage] == process
            seen[kind, stage, k] = seen.get((kind, stage, k), 0) + 1
    for stage in range(processes * per_process):
        for k in range(m):
            assert seen.get(("F", stage, k)) == 1
            whole, split = seen.get(("B", stage, k), 0), (seen.get(("I", stage, k), 0), seen.get(("W", stage, k), 0))
            assert (whole, split) in ((1, (0, 0)), (0, (1, 1)))
    assert sum(seen.values()) == sum(len(order) for order in actions)


@pytest.mark.parametrize("processes, m", [(2, 4), (2, 8), (3, 6)])
def test_each_schedules_bubble_on_equal_stages(processes: int, m: int) -> None:
    """Equal stages, free links: one stage per process idles (p - 1) / (m + p - 1) of the schedule;
    V stages per process in a loop, (p - 1) / (V m + p - 1) (Megatron's interleaving); splitting
    the backward (zero bubble) fills more of what is left."""
    prof = profile([0.01] * 24, stages=processes)

    def bubble(schedule: str, per_process: int) -> float:
        bounds = even(24, processes * per_process)
        return predict(prof, gpus(processes), bounds, 16 * m, 16 * m, m, schedule=schedule).bubble

    single = (processes - 1) / (m + processes - 1)
    assert bubble("GPipe", 1) == pytest.approx(single) and bubble("1F1B", 1) == pytest.approx(single)
    for schedule in ("Interleaved1F1B", "LoopedBFS"):
        if schedule in AVAILABLE:
            for per_process in (2, 4):
                assert bubble(schedule, per_process) == pytest.approx((processes - 1) / (per_process * m + processes - 1))
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        if schedule in AVAILABLE:
            assert 0 < bubble(schedule, 2) < bubble("Interleaved1F1B", 2)


def test_the_activations_each_schedule_holds() -> None:
    """Activations only (no parameters to speak of): GPipe holds every micro-batch's, 1F1B at most
    as many as stages after it (p - r); a loop of stages breadth-first (LoopedBFS) all of them too;
    interleaved 1F1B and the zero-bubble schedules far fewer."""
    processes, m, layers = 2, 8, 8
    prof = profile([0.01] * layers, params=[1] * layers, stages=processes, activation=1000.0)
    u = 4

    def activations(schedule: str, per_process: int) -> list[float]:
        bounds = even(layers, processes * per_process)
        memory = predict(prof, gpus(processes), bounds, u * m, u * m, m, schedule=schedule).memory
        return [round((held - 4 * 4 * layers / processes) / (1000.0 * u * layers / processes), 3) for held in memory]

    assert activations("GPipe", 1) == [m, m]  # in units of a process's layers for one micro-batch
    assert activations("1F1B", 1) == [2, 1]
    if "LoopedBFS" in AVAILABLE:
        assert activations("LoopedBFS", 2) == [m, m]
    for schedule in ("Interleaved1F1B", "ZBVZeroBubble", "InterleavedZeroBubble"):
        if schedule in AVAILABLE:
            held = activations(schedule, 2)
            assert all(1 <= h < m / 2 for h in held), (schedule, held)


def test_a_process_on_the_cpu_sends_with_its_own_time() -> None:
    """gloo sends with the sending process's thread: on CPU stage processes the send is the
    sender's work; a GPU's send only delays its receiver."""
    prof = profile([0.01] * 4, stages=2)
    prof.layers[1].output_bytes = 1.0
    link = LinkProfile(latency=0.5, bytes_per_s=1e9)
    on_cpu, on_gpus = machine(2, cpu=0), gpus(2)
    on_cpu.pipeline = on_gpus.pipeline = link
    cpu = pipeline_tasks(prof, on_cpu, [(0, 2), (2, 4)], 8, 2, "GPipe")
    gpu = pipeline_tasks(prof, on_gpus, [(0, 2), (2, 4)], 8, 2, "GPipe")
    assert cpu[0][0].seconds == pytest.approx(gpu[0][0].seconds + 0.5)  # stage 0's forward sends
    assert gpu[1][0].after == [(0, 0, pytest.approx(0.5))] and cpu[1][0].after == [(0, 0, 0.0)]
    assert max(finish_times(cpu, [1, 1], None)) > max(finish_times(gpu, [0, 0], None))


def test_each_action_costs_its_process_the_runtimes_time() -> None:
    """Layers that take no time: GPipe's step is its (m + p - 1) forwards and as many backwards one
    after another, each the measured cost of an action (``DeviceTimes.action_s``, what the analyzer
    times on a tiny pipeline); a pipeline of one stage runs no schedule; more stages per process,
    more actions."""
    prof = profile([0.0] * 8, stages=2)
    for times in prof.devices.values():
        times.action_s = 1e-3
    m = 4
    gpipe = predict(prof, gpus(2), even(8, 2), 16, 16, m, schedule="GPipe")
    assert gpipe.pipeline_s == pytest.approx(2 * (m + 1) * 1e-3)
    assert predict(prof, gpus(1), even(8, 1), 16, 16, 1).pipeline_s == 0.0
    elsewhere = gpus(2)
    elsewhere.action_s = 2e-3  # a machine the profile was not taken on (`hetero-plan --action-us`)
    assert predict(prof, elsewhere, even(8, 2), 16, 16, m, schedule="GPipe").pipeline_s == pytest.approx(2 * (m + 1) * 2e-3)
    if "Interleaved1F1B" in AVAILABLE:
        assert predict(prof, gpus(2), even(8, 4), 16, 16, m, schedule="Interleaved1F1B").pipeline_s > gpipe.pipeline_s


def test_the_planner_fills_the_bubble_of_idle_devices() -> None:
    """GPUs that wait in the bubble: the planner weighs every schedule and picks one with several
    stages per process, whose predicted step beats GPipe's and 1F1B's; the plan replays to the same
    prediction and is one a run takes."""
    if not AVAILABLE:
        pytest.skip("this torch has no multi-stage schedule")
    prof = profile([0.01] * 12, stages=2, cpu_slowdown=100.0)
    plan, prediction = plan_run(prof, gpus(2), 32, schedule="auto", max_micro_batches=4)
    weighed = {(c.schedule, c.stages_per_process): c for c in prediction.considered}
    assert set(weighed) == set(schedule_candidates("auto", "auto", 2, 12))
    assert plan.schedule in AVAILABLE and plan.stages_per_process >= 2
    assert len(plan.boundaries) == 2 * plan.stages_per_process - 1
    assert prediction.considered[0].step_s == prediction.step_s == min(c.step_s for c in prediction.considered)
    assert prediction.step_s < min(weighed["GPipe", 1].step_s, weighed["1F1B", 1].step_s)
    assert prediction.bubble < weighed["GPipe", 1].bubble
    assert predict_plan(prof, gpus(2), plan, 32) == prediction
    HeteroPlan(**{**plan.as_dict(), "stages": ["cpu", "cpu"]})  # valid: a run takes it


def test_sends_dearer_than_the_bubble_keep_one_stage_per_process() -> None:
    prof = profile([0.01] * 12, stages=2, cpu_slowdown=100.0)
    for layer in prof.layers:
        layer.output_bytes = 1.0
    slow = gpus(2)
    slow.pipeline = LinkProfile(latency=1.0, bytes_per_s=1e9)  # a second per send
    plan, prediction = plan_run(prof, slow, 32, schedule="auto", max_micro_batches=4)
    assert (plan.schedule, plan.stages_per_process) in (("GPipe", 1), ("1F1B", 1))


@pytest.mark.parametrize("batch, limit", [(32, 40e6), (27, 60e6), (25, 50e6)])
def test_every_stage_process_fits_its_memory(batch: int, limit: float) -> None:
    """Activations that fill a GPU: GPipe, which holds every micro-batch's, fits at no micro-batch
    count; the planner's choice fits each process's memory, its stages' together, as does every
    schedule it weighed, also where the batch splits into fewer, larger micro-batches than planned
    (27 samples in 8: 3 of 9; 25 in 7: 5 of 5), or runs the schedule's fallback (which may hold every
    micro-batch)."""
    prof = profile([0.01] * 8, params=[1] * 8, stages=2, activation=1e6, cpu_slowdown=100.0)
    tight = gpus(2, memory=[limit] * 2)  # GPipe holds a whole batch's activations, 4e6 bytes a sample
    plan, prediction = plan_run(prof, tight, batch, schedule="auto", max_micro_batches=8)
    assert "GPipe" not in [c.schedule for c in prediction.considered]
    assert all(held <= limit for held in prediction.memory)
    for choice in prediction.considered:
        assert all(held <= limit for held in choice.memory), choice
    with pytest.raises(ValueError, match="No layout fits"):
        plan_run(prof, tight, batch, schedule="GPipe", max_micro_batches=8)


@pytest.mark.parametrize("schedule", [s for s in ("ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV") if s in AVAILABLE])
def test_a_zero_bubble_schedule_keeps_the_blocks_of_placed_encoders_in_its_first_stage(schedule: str) -> None:
    """Its split backward gives a later stage no gradient to send back to a placed encoder: the first
    stage keeps every layer up to the last that holds one, where the fastest cut alone would not; a
    schedule with a whole backward cuts as it likes. Where the rest cannot fill the other stages, the
    named schedule is refused with what to do."""
    prof = profile([0.3] + [0.1] * 7, stages=2, cpu_slowdown=100.0)
    free, _ = plan_run(prof, gpus(2), 16, schedule=schedule, max_micro_batches=4)
    assert free.boundaries[0] == 1  # the heavy first layer alone: the fastest cut
    kept, _ = plan_run(prof, gpus(2), 16, schedule=schedule, max_micro_batches=4, encoder_layers=3)
    assert kept.boundaries[0] >= 3
    if "Interleaved1F1B" in AVAILABLE:
        whole, _ = plan_run(prof, gpus(2), 16, schedule="Interleaved1F1B", max_micro_batches=4, encoder_layers=3)
        assert whole.boundaries[0] == 1
    _, free = plan_run(prof, gpus(2), 16, schedule="auto", max_micro_batches=4)
    _, weighed = plan_run(prof, gpus(2), 16, schedule="auto", max_micro_batches=4, encoder_layers=3)
    step = {c.schedule: c.step_s for c in free.considered}
    kept = {c.schedule: c.step_s for c in weighed.considered}
    assert kept[schedule] > step[schedule]  # weighed, with its first stage kept: slower than the free cut
    with pytest.raises(ValueError, match=r"the first 6 layers \(up to the last that takes in a placed encoder's"):
        plan_run(prof, gpus(2), 16, schedule=schedule, max_micro_batches=4, encoder_layers=6)
    tight = profile([0.01] * 8, params=[1] * 8, stages=2, activation=1e6)
    with pytest.raises(ValueError, match="No layout fits"):  # memory, whatever the encoders
        plan_run(tight, gpus(2, memory=[1.0, 1.0]), 16, schedule=schedule, max_micro_batches=4, encoder_layers=2)


def test_a_tied_weight_counts_once_where_one_process_holds_every_use(tmp_path: Path) -> None:
    """The first and the last layer share 500 of their parameters: a process holding both (the one
    stage of replicas; the first process of a V) holds them once, weights, gradients and optimizer
    state; processes holding one use each hold a copy each."""
    untied = profile([0.01] * 4, params=[1000] * 4, stages=2)
    tied = profile([0.01] * 4, params=[1000] * 4, stages=2)
    tied.tied = [TiedProfile(layers=[0, 3], params=500, param_bytes=2000)]
    assert tied.held(range(4)) == (3500, 14000) and tied.held([0, 1]) == (2000, 8000)
    assert Profile.load(tied.save(tmp_path / "profile.json")).tied == tied.tied
    once = (2 + tied.optimizer_state_factor) * 2000  # weights, gradients and state of the shared part

    def memory(prof: Profile, bounds: list, schedule: str) -> list[float]:
        return predict(prof, gpus(2), bounds, 16, 16, 4, schedule=schedule).memory

    whole = [predict_replicas(p, gpus(2), 16, 16).memory[0] for p in (untied, tied)]
    assert whole[0] - whole[1] == pytest.approx(once)
    assert memory(untied, even(4, 2), "1F1B") == memory(tied, even(4, 2), "1F1B")  # a copy on each process
    if "ZBVZeroBubble" in AVAILABLE:
        v = [memory(p, even(4, 4), "ZBVZeroBubble") for p in (untied, tied)]
        assert v[0][0] - v[1][0] == pytest.approx(once) and v[0][1] == v[1][1]
    # Offloading a bucket frees its optimizer state; buckets count the shared part in each of its
    # layers, but what is freed is never more than the stage holds.
    assert _stage_memory(tied, range(4), 0.0, offloaded_params=4000) == pytest.approx(2 * tied.held(range(4))[1])


@pytest.mark.skipif("ZBVZeroBubble" not in AVAILABLE, reason="this torch has no ZBVZeroBubble")
def test_a_v_whose_first_process_holds_a_tied_weight_once_fits_where_each_half_would_not() -> None:
    """The V's first process holds the first and the last layer, which share 500 of their 1000
    parameters: together 1500, within its memory; each stage alone in half of it would not be."""
    tied = profile([0.01] * 4, params=[1000, 200, 200, 1000], stages=2)
    tied.tied = [TiedProfile(layers=[0, 3], params=500, param_bytes=2000)]
    per_byte = 2 + tied.optimizer_state_factor  # weights, gradients, optimizer state
    memory = per_byte * 7000.0  # the process's 6000 bytes fit; half of it holds no 4000-byte layer
    bounds = partition(tied, gpus(2, memory=[memory, memory]), 4, 4, "ZBVZeroBubble", stages_per_process=2)
    assert bounds == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert max(predict(tied, gpus(2), bounds, 16, 16, 4, schedule="ZBVZeroBubble").memory) <= memory
    untied = profile([0.01] * 4, params=[1000, 200, 200, 1000], stages=2)
    with pytest.raises(ValueError, match="No cut"):  # without the sharing, 8000 bytes do not fit
        partition(untied, gpus(2, memory=[memory, memory]), 4, 4, "ZBVZeroBubble", stages_per_process=2)


@pytest.mark.parametrize("seed", range(16))
def test_a_cut_with_several_stages_per_process_fits_each_process_and_is_found_where_an_even_split_is(seed: int) -> None:
    """Whatever the sizes, tied weights and memory: the cut found fits every process as ``predict``
    counts it, and a cut is found wherever one with each stage in an even part of its process's memory is."""
    import random

    rng = random.Random(seed)
    schedule = rng.choice([s for s in AVAILABLE if s != "LoopedBFS"] or pytest.skip("no multi-stage schedule"))
    layers, m = rng.randint(4, 9), 4
    prof = profile([rng.uniform(0.001, 0.01) for _ in range(layers)], params=[rng.randint(1, 20) * 100 for _ in range(layers)],
                   activation=rng.choice([0.0, 10.0]))
    if rng.random() < 0.7:
        prof.tied = [TiedProfile(layers=[0, layers - 1], params=100, param_bytes=400)]
    mach = gpus(2, memory=[rng.uniform(4e4, 2e5) for _ in range(2)])
    owner = _holders(2, 4, schedule)
    held = _held(schedule_actions(schedule, 2, 2, m), 4)
    even = _cut(prof, 4.0, held, owner, False, 0, _by_stage(mach, owner), refuse=False)
    try:
        bounds = partition(prof, mach, 4.0, m, schedule, stages_per_process=2)
    except ValueError:
        assert even is None
        return
    memory = predict(prof, gpus(2), bounds, 4 * m, 4 * m, m, schedule=schedule).memory
    assert all(need <= limit * (1 + 1e-12) for need, limit in zip(memory, mach.memory))


def test_a_schedule_named_with_stages_per_process_it_cannot_take_is_refused() -> None:
    with pytest.raises(ValueError, match="runs one stage per process"):
        schedule_candidates("1F1B", 2, 2, 8)
    if "ZBVZeroBubble" in AVAILABLE:
        with pytest.raises(ValueError, match="two stages per process in a V"):
            schedule_candidates("ZBVZeroBubble", 3, 2, 8)


@pytest.mark.parametrize("schedule", ["1F1B", *[s for s in AVAILABLE if s == "DualPipeV"]])
def test_a_batch_too_small_for_the_schedule_is_planned_in_its_fallbacks_order(schedule: str) -> None:
    """One sample a step: fewer micro-batches than 1F1B or DualPipeV takes. The run goes in the
    fallback's order (GPipe's, ZBVZeroBubble's), and is planned so, with the schedule named at the
    fewest micro-batches it takes (2 for 1F1B on two stages, 4 for DualPipeV's four)."""
    plan, prediction = plan_run(profile([0.01] * 6, stages=2), gpus(2), 1, schedule=schedule, max_micro_batches=4)
    assert (plan.schedule, plan.micro_batches) == (schedule, 2 if schedule == "1F1B" else 4) and prediction.step_s > 0


def test_a_schedule_named_with_more_stages_than_blocks_is_refused_for_what_it_is() -> None:
    if "Interleaved1F1B" not in AVAILABLE:
        pytest.skip("this torch lacks Interleaved1F1B")
    with pytest.raises(ValueError, match="Schedule 'Interleaved1F1B' at 2 stages per process cuts the model into 4 stages over 2"):
        plan_run(profile([0.01] * 3, stages=2), gpus(2), 16, schedule="Interleaved1F1B", max_micro_batches=4)
    with pytest.raises(ValueError, match="No schedule the planner weighs runs `stages_per_process=5`"):
        plan_run(profile([0.01] * 12, stages=2), gpus(2), 16, schedule="auto", stages_per_process=5, max_micro_batches=4)


def test_a_schedule_whose_order_cannot_be_read_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch whose schedule reads more of its stages than the planner gives it: the planner warns and
    weighs the others."""
    if "Interleaved1F1B" not in AVAILABLE:
        pytest.skip("this torch has no Interleaved1F1B")
    from lightning_hetero import planner

    real = planner.schedule_actions

    def fussy(schedule, *args):
        if schedule_class(schedule).__name__ == "ScheduleInterleaved1F1B":
            raise AttributeError("'_OrderOnly' object has no attribute 'something_new'")
        return real(schedule, *args)

    monkeypatch.setattr(planner, "schedule_actions", fussy)
    prof = profile([0.01] * 8, stages=2, cpu_slowdown=100.0)
    with pytest.warns(UserWarning, match="leaves schedule 'Interleaved1F1B' out: its order could not be read"):
        _, prediction = plan_run(prof, gpus(2), 16, schedule="auto", max_micro_batches=4)
    assert "Interleaved1F1B" not in {c.schedule for c in prediction.considered} and len(prediction.considered) > 2


def test_the_schedules_the_planner_weighs() -> None:
    multi = [(n, k) for n in AVAILABLE for k in ((2,) if n in V_SHAPED else (2, 3, 4))]
    assert schedule_candidates("auto", "auto", 1, 8) == [("GPipe", 1)]
    assert schedule_candidates("auto", "auto", 2, 8) == [("GPipe", 1), ("1F1B", 1), *multi]
    assert schedule_candidates("auto", "auto", 2, 5) == [("GPipe", 1), ("1F1B", 1), *[(n, k) for n, k in multi if k == 2]]
    assert schedule_candidates("auto", "auto", 2, 8, multi_stage=[]) == [("GPipe", 1), ("1F1B", 1)]
    loops = [n for n in ("Interleaved1F1B", "LoopedBFS") if n in AVAILABLE]
    assert schedule_candidates("auto", 2, 2, 8, multi_stage=loops) == [(n, 2) for n in loops]
    assert schedule_candidates("auto", 3, 2, 8) == [(n, 3) for n, k in multi if k == 3]
    assert schedule_candidates("1F1B", "auto", 2, 8) == [("1F1B", 1)]
    if "Interleaved1F1B" in AVAILABLE:
        assert schedule_candidates("Interleaved1F1B", "auto", 3, 8) == [("Interleaved1F1B", 2)]
        assert schedule_candidates("Interleaved1F1B", 3, 2, 8) == [("Interleaved1F1B", 3)]


def test_explain_names_each_stages_process_and_the_schedules_weighed() -> None:
    if not AVAILABLE:
        pytest.skip("this torch has no multi-stage schedule")
    prof = profile([0.01] * 8, stages=2, cpu_slowdown=100.0)
    plan, prediction = plan_run(prof, gpus(2), 32, schedule="auto", max_micro_batches=4)
    text = explain(prof, plan, prediction)
    owner = plan.stage_holders()
    assert f"stage 0 (process 0: {plan.stages[0]})" in text
    assert f"stage {len(owner) - 1} (process {owner[-1]}: {plan.stages[owner[-1]]})" in text
    assert f"schedule {plan.schedule}, {plan.stages_per_process} stages per process" in text
    table = text.split("each schedule weighed")[1].splitlines()[2:]
    assert [line.split()[0] for line in table] == [c.schedule for c in prediction.considered]


def test_hetero_plan_chooses_the_schedule_or_plans_the_one_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prof = profile([0.01] * 8, stages=1, cpu_slowdown=100.0)
    path = prof.save(tmp_path / "profile.json")
    planner_main([str(path), "--gpus", "2", "--max-micro-batches", "4", "--action-us", "50"])
    out = capsys.readouterr().out
    assert "each schedule weighed" in out and "GPipe" in out
    if "Interleaved1F1B" in AVAILABLE:
        planner_main([str(path), "--gpus", "2", "--schedule", "Interleaved1F1B", "--stages-per-process", "4", "--save", str(tmp_path / "p.yaml")])
        saved = HeteroPlan.load(tmp_path / "p.yaml")
        assert (saved.schedule, saved.stages_per_process, len(saved.boundaries)) == ("Interleaved1F1B", 4, 7)
    if "ZBVZeroBubble" in AVAILABLE:
        heavy = profile([0.3] + [0.1] * 7, stages=1, cpu_slowdown=100.0).save(tmp_path / "heavy.json")
        for kept, first in (([], 1), (["--encoder-layers", "3"], 3)):
            planner_main([str(heavy), "--gpus", "2", "--schedule", "ZBVZeroBubble", *kept, "--save", str(tmp_path / "v.yaml")])
            assert HeteroPlan.load(tmp_path / "v.yaml").boundaries[0] == first
        with pytest.raises(SystemExit):
            planner_main([str(path), "--gpus", "2", "--schedule", "ZBVZeroBubble", "--stages-per-process", "3"])
        assert "two stages per process in a V" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        planner_main([str(path), "--gpus", "2", "--stages-per-process", "zero"])
    assert "give a count" in capsys.readouterr().err
    assert json.loads(path.read_text())["batch_size"] == 16
    del prof.devices["cpu"]  # profiled without a CPU worker
    without = prof.save(tmp_path / "no_cpu.json")
    with pytest.raises(SystemExit):
        planner_main([str(without), "--gpus", "2"])
    assert "no CPU-worker timings ('cpu'): its run had no CPU worker" in capsys.readouterr().err
    planner_main([str(without), "--gpus", "2", "--cpu-workers", "0"])
    assert "each schedule weighed" in capsys.readouterr().out
