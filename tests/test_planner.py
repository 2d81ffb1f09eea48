"""The planner's solvers against brute force on synthetic cost tables whose optimum is known."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_hetero.planner import (
    Machine,
    calibrated_optimizer_rates,
    choose_offload,
    finish_times,
    offload_plan,
    Task,
    partition,
    pipeline_tasks,
    compare_layouts,
    plan_replicas,
    plan_run,
    predict,
    predict_plan,
    share_cores,
    step_method_rate,
)
from lightning_hetero.plan import HeteroPlan
from lightning_hetero.profiling import DeviceTimes, LayerProfile, LinkProfile, Profile

MB = 2**20


def profile(
    per_sample: list[float],
    params: list[int] | None = None,
    stages: int = 2,
    cpu_slowdown: float = 1.0,
    activation: float = 0.0,
    optimizer_s_per_param: float = 0.0,
) -> Profile:
    """Layers whose forward+backward takes ``per_sample`` seconds per sample on every stage device
    (forward and backward half each), ``cpu_slowdown`` times as long on the CPU worker."""
    params = params or [1000] * len(per_sample)
    layers = [
        LayerProfile(name=f"layers.{i}", params=n, param_bytes=4 * n, activation_bytes=activation, output_bytes=0.0, flops=0.0)
        for i, n in enumerate(params)
    ]

    def times(scale: float) -> DeviceTimes:
        halves = [(0.0, t * scale / 2) for t in per_sample]
        return DeviceTimes("cpu", 1, halves, halves, optimizer_s_per_param, optimizer_s_per_param)

    devices = {f"stage{s}": times(1.0) for s in range(stages)}
    devices["cpu"] = times(cpu_slowdown)
    return Profile(batch_size=16, layers=layers, devices=devices)


def machine(stages: int, speed: list[float] | None = None, memory: list[float | None] | None = None, cpu: int = 1) -> Machine:
    return Machine(
        stages=[f"stage{s}" for s in range(stages)],
        stage_names=["cpu"] * stages,
        stage_speed=speed or [1.0] * stages,
        memory=memory or [None] * stages,
        cpu_workers=cpu,
    )


def cuts(layers: int, stages: int):
    for inner in itertools.combinations(range(1, layers), stages - 1):
        bounds = [0, *inner, layers]
        yield list(zip(bounds, bounds[1:]))


@pytest.mark.parametrize("seed", range(12))
def test_partition_is_the_best_contiguous_cut(seed: int) -> None:
    rng = random.Random(seed)
    layers, stages = rng.randint(3, 7), rng.randint(1, 3)
    per_sample = [rng.uniform(0.1, 1.0) for _ in range(layers)]
    speed = [rng.choice([0.5, 1.0, 2.0]) for _ in range(stages)]
    prof = profile(per_sample, params=[rng.randint(1, 50) * 1000 for _ in range(layers)], stages=stages)
    memory = [rng.choice([None, 2e6, 6e6]) for _ in range(stages)]
    mach = machine(stages, speed, memory)

    def stage_time(s: int, b: tuple[int, int]) -> float:
        return sum(per_sample[b[0] : b[1]]) / speed[s]

    def fits(s: int, b: tuple[int, int]) -> bool:
        need = 4 * sum(prof.layers[i].param_bytes for i in range(*b))  # weights, gradients, Adam's two moments
        return memory[s] is None or need <= memory[s]

    feasible = [c for c in cuts(layers, stages) if all(fits(s, b) for s, b in enumerate(c))]
    if not feasible:
        with pytest.raises(ValueError):
            partition(prof, mach, micro_batch=1, micro_batches=1)
        return
    best = min(max(stage_time(s, b) for s, b in enumerate(c)) for c in feasible)
    chosen = partition(prof, mach, micro_batch=1, micro_batches=1)
    assert chosen in feasible
    assert max(stage_time(s, b) for s, b in enumerate(chosen)) == pytest.approx(best)


def test_one_stage_and_one_layer_per_stage() -> None:
    prof = profile([1.0, 2.0, 3.0], stages=3)
    assert partition(prof, machine(1), 1, 1) == [(0, 3)]
    assert partition(prof, machine(3), 1, 1) == [(0, 1), (1, 2), (2, 3)]


def test_a_layer_too_big_for_any_device() -> None:
    prof = profile([1.0, 1.0], params=[1000, 10**8])
    with pytest.raises(ValueError, match=r"Layer 1 \(layers.1\) needs 1.49 GiB"):
        partition(prof, machine(2, memory=[1e9, 1e9]), 1, 1)


@pytest.mark.parametrize("cpu_slowdown", [0.5, 1.0, 3.0, 10.0])
@pytest.mark.parametrize("stages", [1, 2])
def test_micro_batches_and_cpu_share_are_the_best_the_model_allows(cpu_slowdown: float, stages: int) -> None:
    """Brute force over every micro-batch count and pipeline share, with the step time written out."""
    per_sample, batch = [0.2, 0.3, 0.1, 0.4], 16
    prof = profile(per_sample, stages=stages, cpu_slowdown=cpu_slowdown)
    prof.step_overhead_s = 0.05
    mach = machine(stages)
    mach.sync = LinkProfile(latency=0.02, bytes_per_s=1e9)
    bounds = partition(prof, mach, 1, 1)
    slowest = max(sum(per_sample[a:b]) for a, b in bounds)

    def step(m: int, pipeline: int) -> float:
        pipe = (m + stages - 1) * slowest * pipeline / m if pipeline else 0.0
        cpu = sum(per_sample) * cpu_slowdown * (batch - pipeline)
        sync = sum(mach.sync.time(4 * sum(prof.layers[i].params for i in range(a, b))) for a, b in bounds)
        return max(pipe, cpu) + (sync if pipeline < batch else 0.0) + 0.05

    best = min(step(m, p) for m in range(1, 9) for p in range(0, batch + 1, m) if p % m == 0)
    plan, prediction = plan_run(prof, mach, batch, max_micro_batches=8)
    assert prediction.step_s == pytest.approx(best)
    pipeline = round((1 - plan.cpu_fraction) * batch)
    assert step(plan.micro_batches, pipeline) == pytest.approx(best)
    # A fixed cost is the same for every layout: another one moves the step time, not the plan.
    prof.step_overhead_s = 0.5
    replanned, repredicted = plan_run(prof, mach, batch, max_micro_batches=8)
    assert repredicted.step_s == pytest.approx(best + 0.45)
    assert repredicted.step_s - repredicted.overhead_s == pytest.approx(prediction.step_s - prediction.overhead_s)
    assert (replanned.micro_batches, replanned.cpu_fraction) == (plan.micro_batches, plan.cpu_fraction)


@pytest.mark.parametrize("cpu_slowdown", [0.5, 1.0, 3.0, 50.0])
@pytest.mark.parametrize("devices", [1, 2])
def test_replicas_take_the_best_share_the_model_allows(cpu_slowdown: float, devices: int) -> None:
    """Brute force over the devices' share: each device computes its even part with the whole model,
    the CPU worker the rest, then one sum of the whole model between the replicas with a share."""
    per_sample, batch = [0.2, 0.3, 0.1, 0.4], 16
    prof = profile(per_sample, stages=devices, cpu_slowdown=cpu_slowdown)
    prof.step_overhead_s = 0.05
    mach = machine(devices)
    mach.sync = LinkProfile(latency=0.02, bytes_per_s=1e9)

    def step(on_devices: int) -> float:
        parts = [on_devices // devices + (i < on_devices % devices) for i in range(devices)]
        compute = max([sum(per_sample) * n for n in parts] + [sum(per_sample) * cpu_slowdown * (batch - on_devices)])
        summing = devices + (on_devices < batch)  # every device sums; the CPU worker where it has a share
        sync = mach.sync.time(4 * sum(layer.params for layer in prof.layers)) if summing > 1 else 0.0
        return compute + sync + 0.05

    best = min(step(n) for n in range(batch + 1))
    plan, prediction = plan_replicas(prof, mach, batch)
    assert prediction.step_s == pytest.approx(best) and plan.predicted_step_s == pytest.approx(best)
    assert step(round((1 - plan.cpu_fraction) * batch)) == pytest.approx(best)
    assert (plan.parallelism, plan.micro_batches, plan.boundaries, prediction.bubble) == ("replicas", 1, [], 0.0)
    assert prediction.memory == [pytest.approx(4 * 4 * sum(layer.params for layer in prof.layers))] * devices
    if cpu_slowdown == 50.0:
        assert plan.cpu_fraction == 0.0


def test_pipeline_or_replicas_whichever_is_faster_and_fits() -> None:
    """Two equal devices: replicas have no bubble, so they win where the whole model fits a device;
    where it does not, only the pipeline is left."""
    prof = profile([0.2, 0.3, 0.1, 0.4], stages=2, cpu_slowdown=50.0)
    both = compare_layouts(prof, machine(2), 16, max_micro_batches=4)
    assert list(both) == ["replicas", "pipeline"]
    assert both["replicas"][1].step_s < both["pipeline"][1].step_s
    half = 4 * 4 * 2000 + 1.0  # weights, gradients and Adam's moments of two of the four layers
    tight = compare_layouts(prof, machine(2, memory=[half, half]), 16, max_micro_batches=4)
    assert list(tight) == ["pipeline"]
    with pytest.raises(ValueError, match="No layout of replicas fits"):
        plan_replicas(prof, machine(2, memory=[half, half]), 16)


def test_a_cpu_far_slower_than_the_pipeline_gets_nothing() -> None:
    prof = profile([0.2, 0.3, 0.1, 0.4], cpu_slowdown=50.0)
    plan, prediction = plan_run(prof, machine(2), 16)
    assert plan.cpu_fraction == 0.0 and prediction.sync_s == 0.0 and prediction.cpu_s == 0.0


@pytest.mark.parametrize(
    "processes, threads, cores, expected",
    [
        ([[1.0], [1.0]], [1, 1], 1, 2.0),  # two on one core: each at half speed
        ([[1.0], [1.0]], [1, 1], 2, 1.0),  # a core each
        ([[1.0], [1.0], [1.0]], [1, 1, 1], 2, 1.5),  # three on two cores: two thirds each
        ([[1.0], [1.0], [1.0]], [1, 1, 1], 1.8, 1 / 0.6),  # measured to get 1.8 cores' worth together
        ([[2.0], [1.0]], [1, 1], 2, 2.0),  # one thread cannot use the core the other leaves
        ([[2.0], [1.0], [1.0]], [1, 1, 1], 2, 2.5),  # 1.5 s of sharing, then a core each
        ([[1.0], [1.0]], [0, 1], 1, 1.0),  # a GPU's process takes no core
        ([[1.0], [1.0]], [1, 1], None, 1.0),  # nothing shared
    ],
)
def test_processes_share_the_cores(processes, threads, cores, expected) -> None:
    tasks = [[Task(seconds) for seconds in p] for p in processes]
    assert share_cores(tasks, threads, cores) == pytest.approx(expected)


def test_each_process_finishes_when_its_work_is_played_out() -> None:
    # Three on two cores: two thirds of its speed each until the short ones end at 1.5 s; the long
    # one has 1 s left, alone on a core.
    tasks = [[Task(2.0)], [Task(1.0)], [Task(1.0)], []]
    assert finish_times(tasks, [1, 1, 1, 1], 2) == pytest.approx([2.5, 1.5, 1.5, 0.0])


@pytest.mark.parametrize("cpu_fraction", [0.0, 0.5])
def test_the_optimizer_steps_are_calibrated_to_the_run(cpu_fraction: float) -> None:
    """Each role's rate is scaled until the layout plays its step out in the measured time, also
    where the steps share the cores (three processes on two); roles without a step in the layout,
    or not measured, are left out."""
    prof = profile([0.2, 0.3, 0.1, 0.4], optimizer_s_per_param=1e-4)
    mach = machine(2)
    mach.cores = 2
    plan = HeteroPlan(stages=["cpu", "cpu"], boundaries=[2], micro_batches=2, cpu_fraction=cpu_fraction)
    before = predict_plan(prof, mach, plan)
    shared = cpu_fraction > 0
    # Each stage steps its 2000 parameters, the CPU worker (with a share) all 4000: three on two
    # cores run at two thirds of their speed until the stages are done, then the CPU worker alone.
    assert before.optimizer_by_role == pytest.approx(
        {"stage0": 0.3, "stage1": 0.3, "cpu": 0.5} if shared else {"stage0": 0.2, "stage1": 0.2}
    )
    measured = {"stage0": 0.1, "stage1": 0.3, "cpu": 0.5, "stage7": 1.0}
    rates = calibrated_optimizer_rates(prof, mach, plan, measured)
    assert set(rates) == ({"stage0", "stage1", "cpu"} if shared else {"stage0", "stage1"})
    if not shared:  # nothing shared: the measured time over the parameters
        assert rates == pytest.approx({"stage0": 0.5e-4, "stage1": 1.5e-4})
    assert prof.devices["stage0"].optimizer_s_per_param == 1e-4  # the profile given is left as it was
    for role, rate in rates.items():
        prof.devices[role].optimizer_s_per_param = rate
    after = predict_plan(prof, mach, plan)
    assert after.optimizer_by_role == pytest.approx({role: measured[role] for role in rates}, rel=2e-3)
    assert after.optimizer_s == max(after.optimizer_by_role.values())


def test_tasks_wait_for_the_tasks_they_follow() -> None:
    # Process 1's task starts half a second after process 0's first ends, then runs alone.
    tasks = [[Task(1.0), Task(1.0)], [Task(1.0, after=[(0, 0, 0.5)])]]
    assert share_cores(tasks, [1, 1], 1) == pytest.approx(3.0)  # 0-1: p0; 1-1.5: p0; 1.5-2.5 shared; 2.5-3 p1
    with pytest.raises(ValueError, match="cycle"):
        share_cores([[Task(1.0, after=[(1, 0, 0.0)])], [Task(1.0, after=[(0, 0, 0.0)])]], [1, 1], None)


@pytest.mark.parametrize("schedule, micro_batches", [("GPipe", 1), ("GPipe", 4), ("1F1B", 2), ("1F1B", 4)])
def test_pipeline_tasks_follow_the_schedule(schedule: str, micro_batches: int) -> None:
    """Equal stages with nothing shared: the schedule takes (m + p - 1) micro-batches of a stage,
    as the fill-drain bound says; the replay comes after."""
    prof = profile([0.25] * 6, stages=3)
    tasks = pipeline_tasks(prof, machine(3), [(0, 2), (2, 4), (4, 6)], 12, micro_batches, schedule)
    assert [len(t) for t in tasks] == [2 * micro_batches] * 2 + [2 * micro_batches + 1]
    assert share_cores(tasks, [1, 1, 1], None) == pytest.approx((micro_batches + 2) * 0.5 * 12 / micro_batches)


@pytest.mark.parametrize("cores", [None, 2, 3])
def test_processes_on_the_cpu_share_its_cores(cores: int | None) -> None:
    """Two emulated stages and a CPU worker, one thread each: on two cores the three cannot all run
    at full speed, so the CPU's share is no longer free; on three, as if nothing were shared."""
    per_sample, batch = [0.2, 0.3, 0.1, 0.4], 16
    prof = profile(per_sample, optimizer_s_per_param=1e-4)
    mach = machine(2)
    mach.cores = cores
    plan, prediction = plan_run(prof, mach, batch, max_micro_batches=8)
    free_plan, free = plan_run(prof, machine(2), batch, max_micro_batches=8)
    pipeline = round((1 - plan.cpu_fraction) * batch)
    bounds = plan.cut([layer.name for layer in prof.layers])
    tasks = pipeline_tasks(prof, mach, bounds, pipeline, plan.micro_batches, "GPipe")
    cpu = sum(per_sample) * (batch - pipeline)
    together = share_cores(tasks + ([[Task(cpu)]] if cpu else []), [1, 1, 1][: 2 + bool(cpu)], cores)
    assert prediction.cores_s == pytest.approx(together)
    assert prediction.step_s == pytest.approx(max(prediction.pipeline_s, cpu, together) + prediction.optimizer_s)
    if cores == 2:  # the shared cores bind: the CPU's share no longer comes free
        free_bounds = free_plan.cut([layer.name for layer in prof.layers])
        shared = round((1 - free_plan.cpu_fraction) * batch)
        as_if_free = predict(prof, mach, free_bounds, batch, shared, free_plan.micro_batches)
        assert as_if_free.cores_s > max(as_if_free.pipeline_s, as_if_free.cpu_s)
        assert free.step_s < prediction.step_s <= as_if_free.step_s
        assert plan != free_plan
    else:  # a core each: the same plan as with nothing shared
        assert plan == free_plan and prediction.step_s == pytest.approx(free.step_s)


@pytest.mark.parametrize("cpu_slowdown", [1.0, 50.0])
def test_the_step_methods_own_work_is_paid_per_sample(cpu_slowdown: float) -> None:
    """Measured on a last stage's replay, it is charged to the replay (the last stage's process ends
    that much later) and to the CPU's share."""
    prof = profile([0.2, 0.3, 0.1, 0.4], cpu_slowdown=cpu_slowdown)
    mach = machine(2)
    plan, before = plan_run(prof, mach, 16)
    assert predict_plan(prof, mach, plan) == before  # the plan's layout, predicted again
    pipeline = round((1 - plan.cpu_fraction) * 16)
    bounds = plan.cut([layer.name for layer in prof.layers])

    def ends() -> list[float]:
        return finish_times(pipeline_tasks(prof, mach, bounds, pipeline, plan.micro_batches, plan.schedule), [0, 0], None)

    ends_before = ends()
    prof.step_method_s_per_sample = step_method_rate(prof, mach, plan, replay_s=0.8, samples=8)
    assert prof.step_method_s_per_sample == pytest.approx(0.1)  # this loss is free
    after = predict_plan(prof, mach, plan)
    assert ends() == pytest.approx([ends_before[0], ends_before[1] + 0.1 * pipeline])
    assert after.pipeline_s == pytest.approx(max(ends())) and before.pipeline_s == pytest.approx(max(ends_before))
    assert after.cpu_s == pytest.approx(before.cpu_s + (0.1 * (16 - pipeline) if before.cpu_s else 0.0))


def test_emulated_stages_take_the_cores_of_cpu_workers_without_a_share() -> None:
    """Profiled at one thread each (two cores, a CPU worker and a stage): with no CPU share the
    strategy gives the stage both cores, and the model counts it twice as fast."""
    prof = profile([0.2, 0.3], stages=1)
    mach = machine(1)
    mach.cores = 2
    alone = predict(prof, mach, [(0, 2)], batch_size=16, pipeline_samples=16, micro_batches=1)
    assert alone.pipeline_s == pytest.approx(0.5 * 16 / 2)
    shared = predict(prof, mach, [(0, 2)], batch_size=16, pipeline_samples=8, micro_batches=1)
    assert shared.pipeline_s == pytest.approx(0.5 * 8) and shared.cpu_s == pytest.approx(0.5 * 8)
    mach.cores = None  # no cores to share: as profiled
    assert predict(prof, mach, [(0, 2)], 16, 16, 1).pipeline_s == pytest.approx(0.5 * 16)


def test_the_bubble_and_memory_are_reported() -> None:
    prof = profile([1.0] * 4, activation=100.0)
    prediction = predict(prof, machine(2), [(0, 2), (2, 4)], batch_size=16, pipeline_samples=16, micro_batches=4)
    assert prediction.bubble == pytest.approx(1 / 5)
    # weights + gradients + Adam state (4 copies of 8000 bytes) + activations of 4 micro-batches of 4 samples
    assert prediction.memory == [4 * 8000 + 2 * 100 * 16] * 2


@pytest.mark.parametrize("seed", range(20))
def test_offload_set_is_the_largest_the_cpu_hides(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    ready = sorted(rng.uniform(0, 1) for _ in range(n))
    cost = [rng.uniform(0.05, 0.5) for _ in range(n)]
    size = [rng.uniform(1, 10) for _ in range(n)]
    end = rng.uniform(0.5, 2.0)

    def finishes(chosen: tuple[int, ...]) -> bool:
        clock = 0.0
        for k in chosen:
            clock = max(clock, ready[k]) + cost[k]
            if clock > end:
                return False
        return True

    best = max(
        (sum(size[k] for k in c) for r in range(n + 1) for c in itertools.combinations(range(n), r) if finishes(c)),
        default=0.0,
    )
    chosen = choose_offload(ready, cost, size, end)
    assert finishes(tuple(chosen)) and sum(size[k] for k in chosen) == pytest.approx(best)


@pytest.mark.parametrize("memory_mb,offloaded", [(40, []), (26, [2]), (20, [2, 3])])
def test_offload_follows_memory_on_gpu_stages_only(memory_mb: int, offloaded: list[int]) -> None:
    prof = profile([0.1] * 4, params=[10**6] * 4)
    prof.devices["cpu"].offloaded_s_per_param = 1.0  # the CPU hides nothing: only memory decides
    gpus = machine(2, memory=[memory_mb * MB, None])
    gpus.stage_names = ["cuda:0", "cuda:1"]
    # Stage 0 holds layers 0-1 (buckets 3 and 2): 16 MB of weights and gradients, 16 MB of Adam state.
    assert offload_plan(prof, gpus, [(0, 2), (2, 4)], micro_batch=1, bucket_size_mb=1) == offloaded
    emulated = machine(2, memory=[memory_mb * MB, None])
    assert offload_plan(prof, emulated, [(0, 2), (2, 4)], micro_batch=1, bucket_size_mb=1) == []


def test_fine_mode_plans_a_stage_that_fits_only_with_offload() -> None:
    prof = profile([0.1] * 4, params=[10**6] * 4)
    prof.devices["cpu"].offloaded_s_per_param = 1.0
    gpus = machine(2, memory=[20 * MB, 20 * MB])
    gpus.stage_names = ["cuda:0", "cuda:1"]
    with pytest.raises(ValueError, match="No layout fits"):
        plan_run(prof, gpus, 16, mode="coarse")
    plan, _ = plan_run(prof, gpus, 16, mode="fine", bucket_size_mb=1)
    assert plan.offload == [0, 1, 2, 3]


def test_hypothetical_machine_scales_devices_cores_and_links() -> None:
    from lightning_hetero.planner import hypothetical_machine

    prof = profile([1.0] * 4, cpu_slowdown=4.0)
    prof.links["sync"] = LinkProfile(latency=1e-4, bytes_per_s=1e9)
    big = hypothetical_machine(prof, gpus=4, gpu_speed=10.0, cpu_workers=2, cpu_cores=34, sync_gbps=25.0)
    assert big.stage_names == [f"cuda:{i}" for i in range(4)] and big.stage_speed == [10.0] * 4
    assert big.cpu_threads == 15 and big.cpu_speed == 15.0  # (34 - 4 stage processes) / 2 workers, vs 1 profiled
    assert big.sync.bytes_per_s == 25e9 and big.sync.latency == 1e-4  # latency as profiled
    # A much faster CPU earns a share on the same GPUs.
    slow, fast = (plan_run(prof, hypothetical_machine(prof, 1, 4.0, cpu_cores=c), 16)[0] for c in (2, 64))
    assert slow.cpu_fraction == 0 < fast.cpu_fraction
    with pytest.raises(ValueError, match="no CPU-worker timings"):
        hypothetical_machine(Profile(batch_size=16, layers=prof.layers, devices={"stage0": prof.devices["stage0"]}), 1, cpu_cores=8)
