"""Combining what several workers logged into the value one process would have logged."""

from __future__ import annotations

import gc
import pickle
import re
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch import LightningModule

from lightning_hetero.mesh import LocalMesh
from lightning_hetero.results import (
    LogCapture,
    LoggedValue,
    ReportExchange,
    WorkerReport,
    combine_logs,
    combine_loss,
    merge_outputs,
)


def report(samples: int, loss: float | None, **logs: tuple) -> WorkerReport:
    items = [LoggedValue(name, value, weight, torch.float64, options) for name, (value, weight, options) in logs.items()]
    return WorkerReport(samples=samples, loss=loss, loss_dtype=torch.float64, logs=items)


def test_loss_is_weighted_by_samples() -> None:
    value, dtype = combine_loss([report(3, 1.0), report(0, None), report(9, 2.0)])
    assert value == pytest.approx((3 * 1.0 + 9 * 2.0) / 12) and dtype == torch.float64


def test_values_combine_the_way_lightning_reduces_them() -> None:
    reports = [
        report(4, 1.0, mean=(1.0, 4, {}), total=(4.0, 4, {"reduce_fx": "sum"}), top=(3.0, 4, {"reduce_fx": "max"})),
        report(0, None),
        report(12, 1.0, mean=(2.0, 12, {}), total=(12.0, 12, {"reduce_fx": "sum"}), top=(5.0, 12, {"reduce_fx": "max"})),
    ]
    combined = {item.name: item for item in combine_logs(reports)}
    assert list(combined) == ["mean", "total", "top"]
    assert combined["mean"].value == pytest.approx(1.75) and combined["mean"].weight == 16
    assert combined["total"].value == 16.0
    assert combined["top"].value == 5.0


def test_batch_size_passed_to_log_is_the_weight() -> None:
    combined = combine_logs([report(4, 1.0, tokens=(1.0, 100, {})), report(4, 1.0, tokens=(3.0, 300, {}))])
    assert combined[0].value == pytest.approx(2.5) and combined[0].weight == 400


@pytest.mark.parametrize(
    "split, logged, value, weight",
    [
        # The last batch of 8 (the loader's batch size is 12), split 3 + 5, losses 1 and 3:
        ((3, 5), lambda share: 12, (3 * 1.0 + 5 * 3.0) / 8, 12),  # a fixed batch_size: one process's weight
        ((3, 5), lambda share: share, (3 * 1.0 + 5 * 3.0) / 8, 8),  # `len(batch)`: each worker's share
        ((3, 5), lambda share: 8, (3 * 1.0 + 5 * 3.0) / 8, 8),  # the whole batch's size
        ((3, 5), lambda share: 100 * share + 1, (301 * 1.0 + 501 * 3.0) / 802, 802),  # a count of its own
        ((4, 4), lambda share: 40, 2.0, 80),  # counts of their own that happen to agree (40 tokens each)
        ((12, 4), lambda share: 12, (12 * 1.0 + 4 * 3.0) / 16, 12),  # a share that happens to be the batch size
    ],
)
def test_a_batch_size_passed_to_log_weighs_as_in_one_process(
    split: tuple[int, int], logged: Callable[[int], int], value: float, weight: float
) -> None:
    """Every worker logs with the `batch_size` it computes from its share."""
    reports = []
    for share, loss in zip(split, (1.0, 3.0)):
        module = LightningModule()
        with LogCapture(module, samples=share, batch_size=sum(split), nominal=12) as capture:
            module.log("loss", torch.tensor(loss, dtype=torch.float64), batch_size=logged(share))
        reports.append(WorkerReport(samples=share, logs=capture.logs))
    (combined,) = combine_logs(reports)
    assert combined.value == pytest.approx(value) and combined.weight == pytest.approx(weight)


def test_different_arguments_on_different_workers_are_an_error() -> None:
    with pytest.raises(ValueError, match="different arguments by different workers"):
        combine_logs([report(1, 1.0, a=(1.0, 1, {"prog_bar": True})), report(1, 1.0, a=(1.0, 1, {}))])


def _sent(rank: int, step: int) -> WorkerReport:
    """What ``rank`` shares at ``step``: rank 1's second report outgrows a 1 KiB buffer."""
    logs = {f"value{i}": (float(i), 1.0, {}) for i in range(100 if (rank, step) == (1, 1) else rank + 1)}
    return report(rank + 1, float(step), **logs)


def _on_hosts_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank of the forked processes says it runs on a host of its own (they talk over gloo)."""
    monkeypatch.setattr("lightning_hetero.mesh._host", lambda: f"host{dist.get_rank()}")


def _share(rank: int, world: int, tmp: Path) -> None:
    store = dist.FileStore(str(tmp / "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    share, seen = ReportExchange(capacity=1024, mesh=LocalMesh.connect(None, timedelta(seconds=30))), []
    for step in range(3):  # the third step fits the buffer grown in the second
        seen.append((share(_sent(rank, step)), share.capacity))
    (tmp / f"rank{rank}.pkl").write_bytes(pickle.dumps(seen))
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "hosts, pairwise_up_to", [(1, 16), (3, 16), (3, 1)], ids=["one host", "hosts pairwise", "hosts all-gather"]
)
def test_reports_are_shared_whole_whatever_their_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hosts: int, pairwise_up_to: int
) -> None:
    """On one host over Unix sockets; across hosts over gloo, sent between every pair in a small
    group, or all-gathered in a larger one, in buffers that grow with the largest report (``None``:
    over sockets, none)."""
    monkeypatch.setattr("lightning_hetero.results._PAIRWISE_UP_TO", pairwise_up_to)
    if hosts > 1:
        _on_hosts_of_their_own(monkeypatch)
    world = 3
    mp.start_processes(_share, args=(world, tmp_path), nprocs=world, start_method="fork")
    ranks = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(world)]
    for step in range(3):
        expected = [_sent(r, step) for r in range(world)]
        assert all(seen[step][0] == expected for seen in ranks)  # every report, in rank order, on every rank
    capacities = [[capacity for _, capacity in seen] for seen in ranks]
    big = len(pickle.dumps(_sent(1, 1), protocol=pickle.HIGHEST_PROTOCOL))
    assert all(c == ([None] * 3 if hosts == 1 else [1024, big, big]) for c in capacities)  # grown together, and kept


def _stage_report(rank: int, step: int, world: int) -> WorkerReport:
    """What a stage shares at ``step``: the last stage's report at step 2, sent one way, is larger
    than the others (100 logged values)."""
    if (rank, step) == (world - 1, 2):
        return report(rank + 1, float(step), **{f"value{i}": (float(i), 1.0, {}) for i in range(100)})
    return _sent(rank, step)


def _one_way(rank: int, world: int, cpu_workers: int, tmp: Path) -> None:
    store = dist.FileStore(str(tmp / "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    stages = dist.new_group(list(range(cpu_workers, world)), backend="gloo")
    mesh = LocalMesh.connect(None, timedelta(seconds=30))
    share = ReportExchange(mesh=mesh, cpu_workers=cpu_workers, stages=stages if rank >= cpu_workers else None)
    seen = []
    for step in range(4):  # one way, both ways, one way twice
        one_way = step != 1
        # A CPU worker's noted signal stays out of even its own copy: every rank must agree on them.
        mine = WorkerReport(signals=1) if one_way and rank < cpu_workers else _stage_report(rank, step, world)
        seen.append(share(mine, one_way=one_way))
    (tmp / f"rank{rank}.pkl").write_bytes(pickle.dumps(seen))
    dist.destroy_process_group()


@pytest.mark.parametrize("cpu_workers,stages", [(1, 1), (2, 2)])
def test_a_step_without_a_cpu_share_tells_the_cpu_workers_one_way(tmp_path: Path, cpu_workers: int, stages: int) -> None:
    """Where the CPU workers computed nothing, the stages share their reports and send them on:
    every rank still ends with every rank's report, the CPU workers' empty."""
    world = cpu_workers + stages
    mp.start_processes(_one_way, args=(world, cpu_workers, tmp_path), nprocs=world, start_method="fork")
    ranks = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(world)]
    for step in range(4):
        expected = [
            WorkerReport() if step != 1 and r < cpu_workers else _stage_report(r, step, world) for r in range(world)
        ]
        assert all(seen[step] == expected for seen in ranks), step


def test_across_hosts_every_exchange_goes_both_ways(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a host's own processes are sent reports one way: across hosts the CPU workers' reports
    (here their noted signals) travel too, as in a step they compute in."""
    _on_hosts_of_their_own(monkeypatch)
    mp.start_processes(_one_way, args=(3, 1, tmp_path), nprocs=3, start_method="fork")
    ranks = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(3)]
    for step in (0, 2, 3):
        expected = [WorkerReport(signals=1), _stage_report(1, step, 3), _stage_report(2, step, 3)]
        assert all(seen[step] == expected for seen in ranks), step


def _run_ahead(rank: int, tmp: Path, steps: int) -> None:
    store = dist.FileStore(str(tmp / "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=5))
    share, seen = ReportExchange(mesh=LocalMesh.connect(None, timedelta(seconds=5)), cpu_workers=1), []
    if rank == 0:
        store.wait(["posted"])  # the CPU worker gets to its receives only once the stage has sent them all
    for step in range(steps):
        seen.append(share(WorkerReport() if rank == 0 else _sent(rank, step), one_way=True))
    if rank == 1:
        store.set("posted", "1")
    (tmp / f"rank{rank}.pkl").write_bytes(pickle.dumps(seen))
    dist.destroy_process_group()  # the stage's process may end before the CPU worker has read what it sent


def test_the_stages_send_one_way_ahead_of_the_cpu_workers(tmp_path: Path) -> None:
    """The stage does not wait for a CPU worker to read what it sent: it goes on while the CPU
    worker is many steps behind (here held back until the stage has sent them all; a stage that
    waited would time out)."""
    steps = 20
    mp.start_processes(_run_ahead, args=(tmp_path, steps), nprocs=2, start_method="fork")
    ranks = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    assert ranks[0] == ranks[1] == [[WorkerReport(), _sent(1, step)] for step in range(steps)]


def _sync_metrics(rank: int, world: int, tmp: Path) -> None:
    from torchmetrics.aggregation import MaxMetric
    from torchmetrics.classification import BinaryAUROC, MulticlassAUROC

    from lightning_hetero.results import sync_metrics_over

    store = dist.FileStore(str(tmp / "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    auroc, largest, classes = BinaryAUROC(thresholds=None), MaxMetric(), MulticlassAUROC(num_classes=3, thresholds=None)
    sync_metrics_over(torch.nn.ModuleList([auroc, largest, classes]), dist.group.WORLD)
    if rank == 1:  # rank 0 updates none: its list states are empty (float32, shape (0,)), its max float32
        auroc.update(torch.tensor([0.1, 0.8, 0.6, 0.3]), torch.tensor([0, 1, 1, 0]))
        largest.update(torch.tensor([0.5, 2.5], dtype=torch.float64))
        classes.update(*_three_classes())  # predictions of shape (4, 3)
    values = (float(auroc.compute()), float(largest.compute()), float(classes.compute()))
    (tmp / f"rank{rank}.pkl").write_bytes(pickle.dumps(values))
    dist.destroy_process_group()


def _three_classes() -> tuple[torch.Tensor, torch.Tensor]:
    preds = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.5, 0.4], [0.3, 0.3, 0.4], [0.2, 0.6, 0.2]], dtype=torch.float64)
    return preds, torch.tensor([0, 2, 2, 1])


def test_metrics_sync_whatever_dtype_and_shape_each_rank_holds(tmp_path: Path) -> None:
    """A rank that never updated a metric holds its states as torchmetrics made them (float32, an
    empty list state of shape (0,)); the others' updates made them int64 (targets), float64, and of
    shape (n, classes): every rank still computes the value of one process."""
    from torchmetrics.classification import MulticlassAUROC

    one = MulticlassAUROC(num_classes=3, thresholds=None)
    one.update(*_three_classes())
    expected = (1.0, 2.5, float(one.compute()))
    mp.start_processes(_sync_metrics, args=(2, tmp_path), nprocs=2, start_method="fork")
    assert [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)] == [expected] * 2


def test_predictions_of_the_shares_join_into_the_batchs() -> None:
    """What `predict_step` returns for each share, joined as one process returns it for the batch."""
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    whole = torch.cat([a, b])
    assert torch.equal(merge_outputs([(2, a), (2, b)]), whole)
    # A list of batched tensors whose length happens to be the share's: joined entry by entry.
    joined = merge_outputs([(2, [a, a.softmax(1)]), (2, [b, b.softmax(1)])])
    assert len(joined) == 2 and torch.equal(joined[0], whole) and torch.equal(joined[1], whole.softmax(1))
    # Per-sample lists (strings, sequences of their own lengths) are extended.
    assert merge_outputs([(2, ["a", "b"]), (1, ["c"])]) == ["a", "b", "c"]
    seqs = merge_outputs([(2, [torch.ones(5), torch.ones(7)]), (1, [torch.ones(3)])])
    assert [len(t) for t in seqs] == [5, 7, 3]
    # The same value from every share (the batch index) is kept as it is.
    out = merge_outputs([(2, {"out": a, "batch_idx": 0}), (2, {"out": b, "batch_idx": 0})])
    assert out["batch_idx"] == 0 and torch.equal(out["out"], whole)


class DynamicCache:
    """A model's key/value cache, as a causal language model's output carries one (a long repr)."""

    def __init__(self, rows: int) -> None:
        self.layers = [torch.zeros(rows, 64) for _ in range(4)]

    def __repr__(self) -> str:
        return f"DynamicCache(layers={self.layers})"


@pytest.mark.parametrize(
    "shares,shown",
    [
        ([(2, torch.tensor(1.0)), (2, torch.tensor(2.0))], "the output as a tensor of shape ()"),  # a share's mean
        ([(2, torch.randn(3)), (2, torch.randn(3))], "the output as a tensor of shape (3,)"),  # a sum over samples
        ([(2, {"n": 2}), (1, {"n": 1})], "the output['n'] as the int 2"),
        ([(2, {"past": DynamicCache(2)}), (1, {"past": DynamicCache(1)})], "the output['past'] as a DynamicCache"),
    ],
)
def test_a_prediction_that_is_not_per_sample_and_differs_between_shares_is_an_error(shares: list, shown: str) -> None:
    with pytest.raises(ValueError, match=rf"`predict_step` returned {re.escape(shown)}, not one row per sample") as error:
        merge_outputs(shares)
    assert ("call the model with `use_cache=False`" in str(error.value)) == ("Cache" in shown)


def test_a_metrics_batch_value_is_computed_on_one_copy_of_it_for_the_whole_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torchmetrics metric's hash changes with its state (its tensors' identities), which every
    forward replaces: the copy that computes a batch's value from the shares' states is made once per
    metric, not once a step (a deep copy each, and each one kept for as long as the metric lives)."""
    from torchmetrics.classification import MulticlassAccuracy

    from lightning_hetero import results

    copies: list[object] = []
    empty_copy = results._empty_copy
    monkeypatch.setattr(results, "_empty_copy", lambda metric: copies.append(metric) or empty_copy(metric))
    metric = MulticlassAccuracy(num_classes=3, average="micro")
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        preds, target = torch.randint(3, (8,), generator=generator), torch.randint(3, (8,), generator=generator)
        halves = []
        for part in (slice(0, 3), slice(3, 8)):  # two workers' shares of the batch
            share = MulticlassAccuracy(num_classes=3, average="micro")
            share.update(preds[part], target[part])
            halves.append(share.metric_state)
        metric(preds, target)  # the running metric's forward gives its state new tensors
        assert results._batch_value(metric, tuple(halves)) == (preds == target).double().mean().float()
    assert len(copies) == 1 and copies[0] is metric  # (`==` on metrics makes a metric)
    key = id(metric)
    del metric, copies[:]
    gc.collect()  # a metric's own references to itself
    assert key not in results._SCRATCH  # gone with its metric


def test_one_workers_value_is_the_batchs_as_it_is() -> None:
    """A weighted mean of one value can differ from it in the last bit ((3 * 0.1) / 3 is not 0.1):
    where one worker logged, its value is the batch's, as one process logs it."""
    (combined,) = combine_logs([report(3, 0.1, value=(0.1, 3, {})), report(0, None)])
    assert combined.value == 0.1 and combined.weight == 3


class _Metered(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from torchmetrics.classification import MulticlassAccuracy

        self.acc = MulticlassAccuracy(num_classes=3, average="micro")


@pytest.mark.parametrize("samples, noted", [(8, False), (3, True)], ids=["whole batch", "a share"])
def test_only_a_share_of_the_batch_notes_its_metrics_state(samples: int, noted: bool) -> None:
    """Each share's metric state lets every rank compute the batch's value from all of them; a worker
    whose share is the whole batch is the only one to log, so it notes nothing (no copy of the
    state each step, none sent): its metric's own value is the batch's."""
    module = _Metered()
    preds, target = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1][:samples]), torch.tensor([0, 1, 1, 0, 2, 2, 0, 0][:samples])
    compute = module.acc.compute
    with LogCapture(module, samples=samples, batch_size=8) as capture:
        assert (module.acc.compute is not compute) is noted  # wrapped to note the state it computes from
        module.acc(preds, target)
        module.log("acc", module.acc)
    (item,) = capture.logs
    assert bool(item.states) is noted and module.acc.compute is compute
    assert item.value == (preds == target).float().mean()


def test_a_metric_logged_by_one_worker_is_relogged_with_its_own_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where one worker's state is all the batch's, its forward's value is the batch's: no rank
    computes it again from that state."""
    from lightning_hetero import results

    def refuse(*args: object) -> None:
        raise AssertionError("computed again")

    monkeypatch.setattr(results, "_batch_value", refuse)
    module, logged = _Metered(), []
    state = {"tp": torch.tensor([2]), "fp": torch.tensor([1]), "tn": torch.tensor([0]), "fn": torch.tensor([1])}
    item = LoggedValue("acc", 2 / 3, 3.0, torch.float32, {}, metric="acc", states=(state,))
    module.log = lambda name, value, **kwargs: logged.append((name, value._forward_cache))  # type: ignore[method-assign]
    results.relog(module, combine_logs([WorkerReport(samples=3, logs=[item])]), torch.device("cpu"))
    assert logged == [("acc", torch.tensor(2 / 3, dtype=torch.float32))]


def test_log_options_are_captured_alike_however_they_are_passed() -> None:
    module, captured = LightningModule(), []
    for args, kwargs in [(("x", 1.0, True), {"batch_size": 2}), (("x", 1.0), {"prog_bar": True, "batch_size": 2}), ((), {"name": "x", "value": 1.0, "prog_bar": True, "batch_size": 2})]:
        with LogCapture(module, samples=2, batch_size=4) as capture:
            module.log(*args, **kwargs)
        captured.append(capture.logs[0])
    assert all(item == captured[0] for item in captured) and captured[0].options == {"prog_bar": True}
    with LogCapture(module, samples=2, batch_size=4), pytest.raises(TypeError):
        module.log("x", 1.0, name="y")


def test_a_logged_metric_is_found_in_its_module_once_and_again_where_it_moved() -> None:
    module, walks = _Metered(), []
    named_modules = module.named_modules
    module.named_modules = lambda *a, **k: walks.append(1) or named_modules(*a, **k)  # type: ignore[method-assign]
    paths = []
    for step in range(4):
        if step == 2:  # the same metric, now under another name
            module.renamed = module.acc
            del module.acc
        with LogCapture(module, samples=3, batch_size=3) as capture:
            metric = module.get_submodule("acc" if step < 2 else "renamed")
            metric(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1]))
            module.log("acc", metric)
        paths.append(capture.logs[0].metric)
    assert paths == ["acc", "acc", "renamed", "renamed"] and len(walks) == 2
