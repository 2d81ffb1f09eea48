"""The profiler measures real layers on a real device, repeatably, and leaves them as it found them."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

from lightning_hetero.profiling import (
    DeviceTimes,
    LayerProfile,
    Profile,
    kept_buffers,
    profile_layers,
    profile_loss,
    step_work,
    send_along,
    time_link,
    time_pipeline_action,
    time_window,
)

CPU = torch.device("cpu")


def mlp(width: int, depth: int = 3) -> list[nn.Module]:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(32, width)]
    for _ in range(depth - 1):
        layers += [nn.Dropout(0.1), nn.Linear(width, width)]
    return layers


def run(layers: list[nn.Module], batch: int = 64, repeats: int = 5, inputs: torch.Tensor | None = None):
    inputs = torch.randn(batch, 32) if inputs is None else inputs
    return profile_layers(layers, [f"l{i}" for i in range(len(layers))], inputs, CPU, (batch // 8, batch), repeats)[:3]


def per_sample(times: list[tuple[float, float]], samples: int) -> float:
    return sum(a + b * samples for a, b in times) / samples


def test_costs_grow_with_width_and_batch_size() -> None:
    """On one thread, as `test_repeated_profiles_agree`: with two, a process on either core stalls
    every parallel region (in one full run the narrow model's backward took 0.1-0.24 ms a layer, and
    it came out within 5x of the wide one's). The narrow model, whose layers take microseconds, is
    profiled three times and read at its fastest: on one thread a busy machine still once made its
    median 0.1-0.2 ms a layer, 10x its cost (per sample, 7.0e-5 s wide against 1.5e-5 s narrow)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        narrows, (wide_fwd, wide_bwd, wide) = [run(mlp(32)) for _ in range(3)], run(mlp(512))
    finally:
        torch.set_num_threads(threads)
    narrow = narrows[0][2]
    assert sum(layer.params for layer in wide) > 100 * sum(layer.params for layer in narrow)
    assert sum(layer.flops for layer in wide) > 100 * sum(layer.flops for layer in narrow)
    assert sum(layer.activation_bytes for layer in wide) > sum(layer.activation_bytes for layer in narrow)
    fastest_narrow = min(per_sample(fwd, 64) + per_sample(bwd, 64) for fwd, bwd, _ in narrows)
    assert per_sample(wide_fwd, 64) + per_sample(wide_bwd, 64) > 5 * fastest_narrow
    # a + b * n: a larger batch takes longer in all
    total = lambda times, n: sum(a + b * n for a, b in times)  # noqa: E731
    assert total(wide_fwd, 64) + total(wide_bwd, 64) > total(wide_fwd, 8) + total(wide_bwd, 8)


def test_repeated_profiles_agree() -> None:
    """Within 35% per sample on a shared machine (timings), exactly for what does not depend on time.
    On one thread: with two, any other process on either of two cores stalls every parallel region."""
    layers = mlp(384, depth=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first, second = run(layers, batch=128), run(layers, batch=128)
    finally:
        torch.set_num_threads(threads)
    assert first[2] == second[2]
    a, b = per_sample(first[0] + first[1], 128), per_sample(second[0] + second[1], 128)
    assert abs(a - b) / min(a, b) < 0.35


def test_profiling_leaves_layers_and_random_state_as_they_were() -> None:
    layers = [*mlp(64), nn.BatchNorm1d(64)]  # in training mode: its forward moves its running statistics
    for layer in layers[:3]:
        layer.eval()
    before = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in layers]
    modes = [layer.training for layer in layers]
    inputs = torch.randn(64, 32)
    rng = torch.get_rng_state()
    run(layers, inputs=inputs)
    assert torch.equal(torch.get_rng_state(), rng)
    assert [layer.training for layer in layers] == modes
    for layer, state in zip(layers, before):
        assert all(torch.equal(state[k], v) for k, v in layer.state_dict().items())
        assert all(p.grad is None and p.device == CPU for p in layer.parameters())


def test_a_training_steps_compute_leaves_no_trace() -> None:
    """The contention probe runs the whole model's forward, loss and backward: no gradient is
    accumulated, no running statistic or random generator moves."""
    layers = [*mlp(64), nn.BatchNorm1d(64)]
    before = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in layers]
    inputs, targets = torch.randn(16, 32), torch.randn(16, 64)
    work = step_work(layers, F.mse_loss, inputs, targets)
    rng = torch.get_rng_state()
    with torch.random.fork_rng(devices=[]), kept_buffers(layers):
        work()
        work()
    assert torch.equal(torch.get_rng_state(), rng)
    for layer, state in zip(layers, before):
        assert all(torch.equal(state[k], v) for k, v in layer.state_dict().items())
        assert all(p.grad is None for p in layer.parameters())


def test_a_window_counts_the_calls_that_end_inside_it(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = {"now": 0.0, "started": None}
    monkeypatch.setattr("lightning_hetero.profiling.time.perf_counter", lambda: clock["now"])

    def work(seconds: float = 0.1) -> None:
        clock["now"] += seconds

    def start() -> None:
        clock["started"] = clock["now"]

    assert time_window(work, 0.35, start) == pytest.approx(0.1)  # three calls inside, the fourth past it
    assert clock["started"] == pytest.approx(0.1)  # after the warm-up call
    assert time_window(lambda: work(1.0), 0.35) == pytest.approx(1.0)  # none inside: the first call


def test_speed_follows_threads_as_measured() -> None:
    times = DeviceTimes("cpu", 1, [], [], step_s_by_threads={1: 0.3, 2: 0.2})
    assert times.thread_speedup(2) == pytest.approx(1.5) and times.thread_speedup(1) == 1.0
    assert times.thread_speedup(4) == 4.0  # not measured: in proportion


def test_profile_round_trip(tmp_path: Path) -> None:
    forward, backward, layers = run(mlp(16))
    devices = {"cpu": DeviceTimes("cpu", 1, forward, backward, 1e-9, 5e-10, step_s_by_threads={1: 0.2, 2: 0.12})}
    profile = Profile(
        batch_size=64,
        layers=layers,
        devices=devices,
        step_overhead_s=0.001,
        step_method_s_per_sample=1e-4,
        shared_cores={"shared": 1.8, "stages": 2.0},
    )
    loaded = Profile.load(profile.save(tmp_path / "profile.json"))
    assert loaded == profile
    assert isinstance(loaded.layers[0], LayerProfile)


def test_link_fit() -> None:
    link = time_link(lambda buffer: buffer.clone(), CPU, sizes=(1 << 12, 1 << 22))
    assert link.bytes_per_s > 1e8 and link.time(1 << 24) > link.time(1 << 10)


def _send_along(rank: int, world: int, out: Path) -> None:
    store = dist.FileStore(str(out / "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        transfer = send_along(dist.group.WORLD)
        received = transfer(torch.full((8,), float(rank)))
        assert torch.equal(received, torch.full((8,), float((rank - 1) % world)))
        link = time_link(transfer, CPU, sizes=(1 << 10, 1 << 16), repeats=2)
        action = time_pipeline_action(CPU, dist.group.WORLD, repeats=2, micro_batches=4)
        assert 0 < action < 1.0
        (out / f"ok{rank}").write_text(str(link.latency))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_the_pipeline_link_is_one_message_to_the_next_stage(tmp_path: Path, world: int) -> None:
    """What the analyzer times as the pipeline's link: each stage process sends to the next and
    receives from the one before, at once, as a schedule's sends go; and what one action of a
    schedule costs on the path it waits on (a pipeline of a tiny layer per process)."""
    mp.start_processes(_send_along, args=(world, tmp_path), nprocs=world, start_method="fork")
    assert all((tmp_path / f"ok{r}").exists() for r in range(world))  # each rank's checks passed


def test_the_loss_is_profiled_and_costed_where_the_last_layer_is() -> None:
    """A loss over many classes costs time of its own: on the last stage (and once more in its
    replay of the step) and on a CPU worker, never on a stage without the last layer."""
    torch.manual_seed(0)
    layers = [nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4000)]
    inputs, targets = torch.randn(256, 32), torch.randint(0, 4000, (256,))
    *_, (forward, backward) = profile_layers(layers, ["a", "b", "c"], inputs, CPU, (32, 256), 3, None, (F.cross_entropy, targets))
    assert forward[1] > 0 and backward[1] > 0
    times = DeviceTimes("cpu", 1, [(0.0, 1e-6)] * 3, [(0.0, 1e-6)] * 3, loss_forward=forward, loss_backward=backward)
    loss_at_64 = sum(a + b * 64 for a, b in (forward, backward))
    assert times.layer_time(range(2, 3), 64) == pytest.approx(2 * 64e-6 + loss_at_64)
    assert times.layer_time(range(0, 2), 64) == pytest.approx(4 * 64e-6)
    assert times.loss_forward_time(64) == pytest.approx(forward[0] + forward[1] * 64) and times.loss_forward_time(0) == 0.0
    # Saved and loaded with the rest of the profile.
    profile = Profile(batch_size=256, layers=[], devices={"stage0": times})
    assert Profile._from_dict(json.loads(json.dumps(asdict(profile)))).devices["stage0"] == times


def test_a_loss_with_structured_targets_is_timed_and_a_failing_one_counts_as_free() -> None:
    outputs, targets = torch.randn(64, 10), {"label": torch.randint(0, 10, (64,)), "weight": torch.rand(64)}

    def weighted(output: torch.Tensor, target: dict) -> torch.Tensor:
        return (F.cross_entropy(output, target["label"], reduction="none") * target["weight"]).mean()

    forward, backward = profile_loss(weighted, outputs, targets, CPU, (8, 64))
    assert forward[0] + forward[1] * 64 > 0 and backward[0] + backward[1] * 64 > 0

    def broken(output: torch.Tensor, target: dict) -> torch.Tensor:
        raise KeyError("label")

    with pytest.warns(UserWarning, match="could not time `pipeline_loss`"):
        assert profile_loss(broken, outputs, targets, CPU, (8, 64)) == ((0.0, 0.0), (0.0, 0.0))
