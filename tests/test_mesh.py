"""Messages between the processes of one host over Unix sockets (``lightning_hetero.mesh``)."""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_hetero.mesh import SHARED_FROM, LocalMesh
from lightning_hetero.pipeline import available_schedules

from tests.conftest import hetero, max_param_diff, trainer
from tests.models import Net, regression_data


def _rank(rank: int, world: int, tmp: Path, body: Callable[[int, LocalMesh | None, dist.Store], Any], timeout: float) -> None:
    store = dist.FileStore(str(tmp / "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    mesh = LocalMesh.connect(None, timedelta(seconds=timeout))
    try:
        result = body(rank, mesh, store)
    except Exception as error:  # what the rank raised is the result
        result = error
    (tmp / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def _run(tmp: Path, world: int, body: Callable, timeout: float = 30.0) -> list[Any]:
    mp.start_processes(_rank, args=(world, tmp, body, timeout), nprocs=world, start_method="fork")
    found = [tmp / f"rank{r}.pkl" for r in range(world)]
    return [pickle.loads(f.read_bytes()) if f.exists() else None for f in found]  # (none from a rank that ended)


def _exchange_big(rank: int, mesh: LocalMesh, store: dist.Store) -> Any:
    # Far more than a socket's buffer, both ways at once: each side must read while it sends.
    mine = bytes([rank]) * (8 << 20)
    got = mesh.exchange(1, mine, [1 - rank])
    small = mesh.exchange(1, b"after", [1 - rank])  # the stream goes on, frame after frame
    return got[1 - rank] == bytes([1 - rank]) * (8 << 20), small[1 - rank]


def test_messages_larger_than_a_sockets_buffer_cross_both_ways_at_once(tmp_path: Path) -> None:
    assert _run(tmp_path, 2, _exchange_big) == [(True, b"after")] * 2


def _ahead(rank: int, mesh: LocalMesh, store: dist.Store) -> Any:
    if rank == 1:
        for step in range(5):
            mesh.send(2, f"step {step}".encode(), [0])
        mesh.send(1, b"now both ways", [0])
        store.set("sent", "1")
        return mesh.exchange(1, b"from 1", [0])
    store.wait(["sent"])  # everything is sent before the first is read
    posts = [mesh.receive(2, 1) for _ in range(5)]
    return posts, mesh.receive(1, 1), mesh.exchange(1, b"from 0", [1])


def test_frames_sent_ahead_are_read_in_order_of_sending(tmp_path: Path) -> None:
    zero, one = _run(tmp_path, 2, _ahead)
    assert zero == ([f"step {s}".encode() for s in range(5)], b"now both ways", {1: b"from 1"})
    assert one == {0: b"from 0"}


def _one_ends(rank: int, mesh: LocalMesh, store: dist.Store) -> Any:
    if rank == 1:
        os._exit(0)  # no reply, no goodbye
    start = time.monotonic()
    try:
        mesh.exchange(1, b"hello", [1])
    except ConnectionError as error:
        return str(error), time.monotonic() - start


def test_a_peer_that_ends_fails_the_wait_at_once_with_its_name(tmp_path: Path) -> None:
    message, waited = _run(tmp_path, 2, _one_ends)[0]
    assert "Connection closed by peer: global rank 1 closed its connection" in message
    assert waited < 10  # not the 30 s timeout


def _one_leaves_early(rank: int, mesh: LocalMesh, store: dist.Store) -> Any:
    if rank == 1:  # tells both, hears from both, and goes
        got = mesh.exchange(1, b"one", [0, 2])
        mesh.close()
        store.set("closed", "1")
        return got
    if rank == 2:  # answers rank 1 first, and rank 0 only once rank 1 has gone
        got = mesh.exchange(1, b"two", [1])
        store.wait(["closed"])
        mesh.send(1, b"two", [0])
        store.wait(["heard"])  # (ending before rank 0's frame to it is sent would make that send fail)
        return got
    got = mesh.exchange(1, b"zero", [1, 2])
    store.set("heard", "1")
    return got


def test_a_peer_that_ends_after_its_part_is_no_error(tmp_path: Path) -> None:
    """Rank 0 waits for rank 2 while rank 1, whose message it has, closes its end."""
    assert _run(tmp_path, 3, _one_leaves_early) == [{1: b"one", 2: b"two"}, {0: b"zero", 2: b"two"}, {1: b"one"}]


def _one_hangs(rank: int, mesh: LocalMesh, store: dist.Store) -> Any:
    if rank == 1:
        store.wait(["failed"])  # alive, and silent, until the other gave up
        return None
    try:
        mesh.receive(1, 1)
    except TimeoutError as error:
        return str(error)
    finally:
        store.set("failed", "1")


def test_a_peer_that_neither_answers_nor_ends_fails_the_wait_after_the_timeout(tmp_path: Path) -> None:
    message = _run(tmp_path, 2, _one_hangs, timeout=0.5)[0]
    assert message is not None and "Waited 0.5 s" in message and "global rank(s) 1" in message


def _out_of_step(rank: int, mesh: LocalMesh, store: dist.Store) -> Any:
    if rank == 1:
        mesh.send(2, b"a post", [0])
        store.wait(["done"])
        return None
    try:
        return mesh.exchange(1, b"a gather", [1])
    finally:
        store.set("done", "1")


def test_a_message_of_another_kind_than_is_due_is_an_error(tmp_path: Path) -> None:
    error = _run(tmp_path, 2, _out_of_step)[0]
    assert isinstance(error, RuntimeError) and "out of step" in str(error)


def _connected(rank: int, mesh: LocalMesh | None, store: dist.Store) -> Any:
    return mesh is not None


def test_processes_on_several_hosts_make_no_mesh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    assert _run(one, 3, _connected) == [True] * 3
    monkeypatch.setattr("lightning_hetero.mesh._host", lambda: f"host{dist.get_rank() % 2}")
    assert _run(two, 3, _connected) == [False] * 3  # every rank alike


def _objects(rank: int, mesh: LocalMesh, store: dist.Store) -> Any:
    mine = {"rank": rank, "blob": bytes([rank]) * (100_000 if rank == 1 else 10)}
    return mesh.all_gather_object(mine), mesh.gather_object(mine, dst=2), mesh.broadcast_object(("from", rank), src=1)


def test_objects_are_gathered_and_broadcast_as_torchs_object_collectives_do(tmp_path: Path) -> None:
    ranks = _run(tmp_path, 3, _objects)
    every = [{"rank": r, "blob": bytes([r]) * (100_000 if r == 1 else 10)} for r in range(3)]
    assert [r[0] for r in ranks] == [every] * 3
    assert [r[1] for r in ranks] == [None, None, every]
    assert [r[2] for r in ranks] == [("from", 1)] * 3


class _Collects(L.Callback):
    def __init__(self, out: Path, gloo: bool) -> None:
        self.out, self.gloo = out, gloo

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        strategy, rank, step = trainer.strategy, trainer.global_rank, trainer.global_step
        with pytest.MonkeyPatch.context() as patch:
            if not self.gloo:  # then gloo's object collectives are not to be used
                for name in ("broadcast_object_list", "all_gather_object", "gather_object"):
                    patch.setattr(dist, name, _refused)
            seen = (
                strategy.local_mesh is not None,  # type: ignore[attr-defined]
                strategy.broadcast({"step": step, "from": rank}, src=1),
                strategy.gather(rank * 10),  # type: ignore[attr-defined]
                strategy.gather(rank, dst=0),  # type: ignore[attr-defined]
            )
        (self.out / f"{rank}-{step}.pkl").write_bytes(pickle.dumps(seen))


def _refused(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("an object collective over gloo")


@pytest.mark.parametrize("cpu_fraction", [0.0, 0.5], ids=["idle CPU worker", "CPU worker"])
@pytest.mark.parametrize("hosts", [1, 3], ids=["one host", "hosts of their own"])
def test_the_strategys_object_collectives_go_over_the_mesh_on_one_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hosts: int, cpu_fraction: float
) -> None:
    """``broadcast`` and ``gather`` (Lightning's, the rebalancer's) give the same either way, beside
    reports sent both ways or one way."""
    if hosts > 1:
        monkeypatch.setattr("lightning_hetero.mesh._host", lambda: f"host{dist.get_rank()}")
    collects = _Collects(tmp_path, gloo=hosts > 1)
    trainer(hetero(cpu_workers=1, cpu_fraction=cpu_fraction), max_steps=2, callbacks=[collects]).fit(Net(), regression_data())
    for rank in range(3):
        for step in (1, 2):
            seen = pickle.loads((tmp_path / f"{rank}-{step}.pkl").read_bytes())
            assert seen == (hosts == 1, {"step": step, "from": 1}, [0, 10, 20], [0, 1, 2] if rank == 0 else []), (rank, step)


def _claims_another_pid(rank: int, world: int, tmp: Path) -> None:
    store = dist.FileStore(str(tmp / "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    if rank == 1:  # it says it is another process than the one that connects
        os.getpid = lambda: 1  # type: ignore[assignment]  (this child only)
    try:
        LocalMesh.connect(None, timedelta(seconds=30))
        result: Any = None
    except ConnectionError as error:
        result = str(error)
    (tmp / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def test_only_the_runs_own_processes_may_connect(tmp_path: Path) -> None:
    mp.start_processes(_claims_another_pid, args=(2, tmp_path), nprocs=2, start_method="fork")
    message = pickle.loads((tmp_path / "rank0.pkl").read_bytes())
    assert message is not None and "that is not global rank 1 of this run connected" in message


def _sums(rank: int, mesh: LocalMesh, store: dist.Store) -> Any:
    """Sums of several sizes and dtypes over every rank and over ranks 0 and 2 alone, with frames of
    other kinds before and after them on the same sockets; each rank's part made from its rank."""
    results = []
    for numel, dtype in [(0, torch.float32), (1, torch.float64), (2, torch.float32), (1000, torch.float64), (3_000_001, torch.float32)]:
        tensor = torch.arange(numel, dtype=dtype) * (rank + 1) + 0.1 * rank
        mesh.all_reduce_sum(tensor, range(3))
        results.append(tensor)
    if rank != 1:  # rank 1 sends a report to both meanwhile, read after the sums
        part = torch.full((5,), float(rank + 1), dtype=torch.float64)
        mesh.all_reduce_sum(part, [0, 2])
        big = torch.full((SHARED_FROM,), float(rank + 1))  # in shared memory, as the 12 MB above
        mesh.all_reduce_sum(big, [0, 2])
        results.append(part)
        results.append(mesh.receive(1, 1))
        results[-2] = (part, bool(torch.all(big == 4.0)))
    else:
        mesh.send(1, b"meanwhile", [0, 2])
    results.append(mesh.exchange(1, f"after {rank}".encode(), [r for r in range(3) if r != rank]))
    results.append(sorted(shared.nbytes for shared in mesh._shared.values() if shared is not None))
    return results


def test_a_sum_over_the_mesh_is_torchs_sum_alike_on_every_rank_and_keeps_the_stream_in_order(tmp_path: Path) -> None:
    """Parts bigger than a socket's buffer (12 MB) cross at once; an empty tensor and one shorter than
    the members are summed too; a subset of the ranks sums while another sends them something else."""
    results = _run(tmp_path, 3, _sums)
    assert not any(isinstance(r, Exception) for r in results), results
    sizes = [(0, torch.float32), (1, torch.float64), (2, torch.float32), (1000, torch.float64), (3_000_001, torch.float32)]
    for i, (numel, dtype) in enumerate(sizes):
        expected = sum(torch.arange(numel, dtype=dtype) * (r + 1) + 0.1 * r for r in range(3))
        for r in range(3):
            assert results[r][i].dtype == dtype
            torch.testing.assert_close(results[r][i], expected, rtol=1e-6, atol=1e-6)
            assert torch.equal(results[r][i], results[0][i])  # to the last bit, on every rank
    assert torch.equal(results[0][5][0], torch.full((5,), 4.0, dtype=torch.float64)) and torch.equal(results[2][5][0], results[0][5][0])
    assert results[0][5][1] and results[2][5][1]
    assert results[0][6] == results[2][6] == b"meanwhile"
    assert results[1][5] == {0: b"after 0", 2: b"after 2"} and results[0][7] == {1: b"after 1", 2: b"after 2"}
    # The sums of SHARED_FROM bytes or more went through shared memory; the others through the sockets.
    assert results[1][6] == [12_000_004] and results[0][8] == results[2][8] == [4 * SHARED_FROM, 12_000_004]


def _sums_without_shared_memory(rank: int, mesh: LocalMesh, store: dist.Store) -> Any:
    import lightning_hetero.mesh as m

    if rank == 1:  # this one cannot map the others' memory: none of them sums in it
        def refuse(*args: Any) -> Any:
            raise OSError("no access to /proc")

        m._map_peer = refuse  # type: ignore[assignment]  (this child only)
    tensor = torch.arange(SHARED_FROM, dtype=torch.float32) * (rank + 1)
    mesh.all_reduce_sum(tensor, range(3))
    mesh.all_reduce_sum(tensor, range(3))  # and not at a second sum of the size either
    return torch.equal(tensor, torch.arange(SHARED_FROM, dtype=torch.float32) * 18), list(mesh._shared.values())


def _sums_of_growing_sizes(rank: int, mesh: LocalMesh, store: dist.Store) -> Any:
    found = []
    for numel in (SHARED_FROM // 4, SHARED_FROM // 2, SHARED_FROM // 4, SHARED_FROM):
        tensor = torch.full((numel,), float(rank + 1))
        mesh.all_reduce_sum(tensor, [0, 1])
        found.append((bool(torch.all(tensor == 3.0)), [shared.nbytes for shared in mesh._shared.values() if shared is not None]))
    kept = mesh._shared[(0, 1)].segments[rank][:16].view(torch.float32)  # type: ignore[union-attr]
    mesh.close()
    return found, kept.tolist()  # a view that outlives the mesh still reads its memory


def test_the_members_share_one_segment_each_made_anew_only_when_a_sum_outgrows_it(tmp_path: Path) -> None:
    found, kept = _run(tmp_path, 2, _sums_of_growing_sizes)[0]
    assert found == [(True, [SHARED_FROM]), (True, [2 * SHARED_FROM]), (True, [2 * SHARED_FROM]), (True, [4 * SHARED_FROM])]
    assert kept == [3.0] * 4  # rank 0 sums the first part, in its own segment


def test_where_one_member_cannot_share_memory_every_member_sums_over_the_sockets(tmp_path: Path) -> None:
    assert _run(tmp_path, 3, _sums_without_shared_memory) == [(True, [None])] * 3


def _sum_to_one_that_ends(rank: int, mesh: LocalMesh, store: dist.Store) -> Any:
    if rank == 1:
        os._exit(0)
    try:
        mesh.all_reduce_sum(torch.ones(1 << 20), [0, 1])
    except ConnectionError as error:
        return str(error)


def _shared_sum_with_one_that_ends(rank: int, mesh: LocalMesh, store: dist.Store) -> Any:
    tensor = torch.ones(SHARED_FROM)
    mesh.all_reduce_sum(tensor, [0, 1])  # the segments are made and mapped
    if rank == 1:
        os._exit(0)
    try:
        mesh.all_reduce_sum(tensor, [0, 1])
    except ConnectionError as error:
        return str(error)


@pytest.mark.parametrize("body", [_sum_to_one_that_ends, _shared_sum_with_one_that_ends], ids=["sockets", "shared memory"])
def test_a_sum_with_a_peer_that_ends_fails_at_once_with_its_name(tmp_path: Path, body: Callable) -> None:
    message = _run(tmp_path, 2, body)[0]
    assert message is not None and "Connection closed by peer: global rank 1" in message


def _sum_against_a_report(rank: int, mesh: LocalMesh, store: dist.Store) -> Any:
    if rank == 1:
        return mesh.exchange(1, b"a report", [0])
    try:
        mesh.all_reduce_sum(torch.ones(4), [0, 1])
    except RuntimeError as error:
        return str(error)


def test_a_sum_where_the_peer_sends_something_else_is_an_error(tmp_path: Path) -> None:
    message = _run(tmp_path, 2, _sum_against_a_report, timeout=2.0)[0]
    assert message is not None and "where a part of a sum of 8 bytes was due" in message


def _all_reduce_of_one_value_only(real: Callable) -> Callable:
    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if tensor.numel() > 1:  # a bucket of gradients, or the stages' squared norms (one value is Lightning's)
            raise AssertionError("a sum of gradients over gloo")
        return real(tensor, *args, **kwargs)

    return all_reduce


@pytest.mark.parametrize("shared_from", [SHARED_FROM, 1], ids=["sockets", "shared memory"])
def test_coarse_modes_gradient_sums_go_over_the_mesh_on_one_host(monkeypatch: pytest.MonkeyPatch, shared_from: int) -> None:
    """With a CPU worker and two stages on one host, coarse mode sums the gradients, and the stages'
    squared norms for clipping, over the mesh (gloo's ``all_reduce`` is refused for them), and trains
    the model it trains over gloo on "hosts of their own", to the last bit: each sum of gradients is
    of two ranks' parts, and each norm's of one part and zeros. The model's sums are small: a
    threshold of one byte sends every one of them through shared memory."""
    monkeypatch.setattr("lightning_hetero.mesh.SHARED_FROM", shared_from)
    over_gloo = Net()
    with monkeypatch.context() as patch:
        patch.setattr("lightning_hetero.mesh._host", lambda: f"host{dist.get_rank()}")
        fit = trainer(hetero(cpu_workers=1, cpu_fraction=0.5, mode="coarse"), max_steps=4, gradient_clip_val=0.05)
        fit.fit(over_gloo, regression_data())
    over_mesh = Net()
    monkeypatch.setattr(dist, "all_reduce", _all_reduce_of_one_value_only(dist.all_reduce))
    fit = trainer(hetero(cpu_workers=1, cpu_fraction=0.5, mode="coarse"), max_steps=4, gradient_clip_val=0.05)
    fit.fit(over_mesh, regression_data())
    assert max_param_diff(over_mesh, over_gloo) == 0.0
    assert max_param_diff(over_mesh, Net()) > 0  # it trained


@pytest.mark.parametrize(
    "arguments,clip",
    [
        (dict(offload=[0, 2]), None),
        (dict(offload="none"), 0.05),
        (dict(offload=[1], schedule="ZBVZeroBubble", micro_batches=4), None),
    ],
    ids=["steps during the backward", "clipping by norm", "zero-bubble V"],
)
@pytest.mark.parametrize("shared_from", [SHARED_FROM, 1], ids=["sockets", "shared memory"])
def test_fine_modes_bucket_sums_go_over_the_mesh_on_one_host(
    monkeypatch: pytest.MonkeyPatch, shared_from: int, arguments: dict, clip: float | None
) -> None:
    """Fine mode's thread that sums the buckets during the backward sums them over the mesh on one
    host, in bucket order on every rank, and trains the model it trains over gloo to the last bit:
    with every bucket's step in the backward, with the steps after it (clipping by norm), and with a
    zero-bubble V whose stages' buckets complete in another order than the CPU worker's."""
    if "schedule" in arguments and arguments["schedule"] not in available_schedules():
        pytest.skip(f"this torch has no {arguments['schedule']}")
    monkeypatch.setattr("lightning_hetero.mesh.SHARED_FROM", shared_from)
    arguments = dict(mode="fine", bucket_size_mb=1e-5, cpu_workers=1, cpu_fraction=0.4, **arguments)
    over_gloo = Net()
    with monkeypatch.context() as patch:
        patch.setattr("lightning_hetero.mesh._host", lambda: f"host{dist.get_rank()}")
        trainer(hetero(**arguments), max_steps=4, gradient_clip_val=clip).fit(over_gloo, regression_data())
    over_mesh = Net()
    monkeypatch.setattr(dist, "all_reduce", _all_reduce_of_one_value_only(dist.all_reduce))
    trainer(hetero(**arguments), max_steps=4, gradient_clip_val=clip).fit(over_mesh, regression_data())
    assert max_param_diff(over_mesh, over_gloo) == 0.0
    assert max_param_diff(over_mesh, Net()) > 0  # it trained


class _FrozenHead(Net):
    """Its last layer frozen: its bucket has no gradient to wait for. Its step method notes whether
    the run's sockets are lent to fine mode's sums while it runs (before the backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[4].requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        mesh = self.trainer.strategy.local_mesh  # type: ignore[attr-defined]
        assert mesh is not None and mesh._lent_to is None, "the sums hold the sockets before the forward"
        return super().training_step(batch, batch_idx)


def test_fine_mode_lends_the_mesh_to_its_sums_from_the_first_gradient_on() -> None:
    """A bucket with nothing to wait for (a frozen head) is summed from the first gradient on, not
    before the forward: the step method runs with the sockets the steps' thread's."""
    plain = trainer(None, max_steps=4)
    expected = Net()
    expected.layers[4].requires_grad_(False)
    plain.fit(expected, regression_data())
    model = _FrozenHead()
    strategy = hetero(mode="fine", bucket_size_mb=1e-5, cpu_workers=1, cpu_fraction=0.5, stages=["cpu"])
    trainer(strategy, max_steps=4).fit(model, regression_data())
    assert max_param_diff(model, expected) < 1e-10


def _lent(rank: int, mesh: LocalMesh, store: dist.Store) -> Any:
    if rank == 1:
        return [mesh.receive(1, 0), mesh.receive(1, 0)]
    summer = threading.Thread(target=lambda: mesh.send(1, b"from the thread", [1]), name="summer")
    mesh.lend(summer)
    try:
        mesh.send(1, b"refused", [1])
        refused = None
    except RuntimeError as error:
        refused = str(error)
    summer.start()
    summer.join()
    mesh.lend(None)
    mesh.send(1, b"back", [1])
    return refused


def test_a_mesh_lent_to_a_thread_refuses_every_other(tmp_path: Path) -> None:
    refused, received = _run(tmp_path, 2, _lent)
    assert refused is not None and "Thread 'MainThread' sent or received" in refused and "lent to 'summer'" in refused
    assert received == [b"from the thread", b"back"]


def test_the_analyzer_times_the_gradient_sums_over_the_mesh_where_the_run_sums_over_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The link the planner weighs the sums by is the one they take: on one host, the mesh (gloo's
    ``all_reduce`` of more than one value refused), timed at sizes that go through shared memory, as
    a stage's gradients and fine mode's buckets nearly always do (even this model's smaller ones)."""
    import lightning_hetero.callbacks.analyzer as analyzer_module
    from lightning_hetero.callbacks import WorkloadAnalyzer
    from lightning_hetero.profiling import Profile

    timed = tmp_path / "timed.txt"
    time_link = analyzer_module.time_link

    def noting_sizes(transfer: Callable, device: torch.device, sizes: tuple[int, int] = (1 << 14, 1 << 22), repeats: int = 3) -> Any:
        with timed.open("a") as out:
            out.write(f"{transfer.__qualname__.split('.')[0]} {sizes[0]} {sizes[1]}\n")
        return time_link(transfer, device, sizes, repeats)

    monkeypatch.setattr(analyzer_module, "time_link", noting_sizes)
    monkeypatch.setattr(dist, "all_reduce", _all_reduce_of_one_value_only(dist.all_reduce))
    analyzer = WorkloadAnalyzer(repeats=1, max_micro_batches=2, warmup_steps=3, measure_steps=1, save_dir=str(tmp_path / "plan"))
    trainer(hetero(cpu_workers=1, mode="coarse"), max_steps=6, callbacks=[analyzer]).fit(Net(), regression_data())
    sync = Profile.load(tmp_path / "plan" / "profile.json").links["sync"]
    assert sync.bytes_per_s > 0 and sync.latency >= 0
    sums = [line.split()[1:] for line in timed.read_text().splitlines() if line.startswith("gradient_sum_over")]
    assert sums and all(4 * int(small) >= SHARED_FROM and int(large) > int(small) for small, large in sums), sums
