"""BatchNorm in replicas: whole-batch statistics (`Trainer(sync_batchnorm=True)`) train exactly as
one device; per-share statistics (the default) keep every replica's running buffers equal, their
running mean one device's."""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_hetero.batchnorm import StatsGroup, WholeBatchNorm, average_running_stats, convert, revert
from tests.conftest import RecordCopies, assert_copies_identical, hetero, max_param_diff, trainer
from tests.models import BatchNormNet, TinyResNet, image_data, regression_data
from tests.test_replicas import assert_same_run

TOL = 1e-10


def _two_shares(rank: int, store_path: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2, timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    x = torch.randn(10, 4, 3, 3, dtype=torch.float64)
    dy = torch.randn(10, 4, 3, 3, dtype=torch.float64)
    layer = nn.BatchNorm2d(4).double()
    nn.init.uniform_(layer.weight)
    nn.init.uniform_(layer.bias)
    stats = StatsGroup()
    stats.group = dist.group.WORLD
    whole = convert(nn.Sequential(layer), stats)[0]
    assert isinstance(whole, WholeBatchNorm)
    share = slice(0, 3) if rank == 0 else slice(3, 10)  # unequal shares
    mine = x[share].clone().requires_grad_(True)
    whole(mine).backward(dy[share])
    torch.save(
        {
            "dx": mine.grad,
            "dw": whole.weight.grad,
            "db": whole.bias.grad,
            "mean": whole.running_mean.clone(),
            "var": whole.running_var.clone(),
        },
        f"{out}/rank{rank}.pt",
    )
    dist.destroy_process_group()


def test_whole_batch_norm_over_two_unequal_shares_is_one_batch_norm(tmp_path: Path) -> None:
    """Forward, backward and running statistics of two shares (3 and 7 samples) summed over gloo
    equal one BatchNorm2d on the whole batch: the input's gradient per share, the parameters'
    gradients summed, the running buffers on both."""
    store = tempfile.mktemp(dir=tmp_path)
    mp.start_processes(_two_shares, args=(store, str(tmp_path)), nprocs=2, start_method="fork")
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    torch.manual_seed(0)
    x = torch.randn(10, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(10, 4, 3, 3, dtype=torch.float64)
    layer = nn.BatchNorm2d(4).double()
    nn.init.uniform_(layer.weight)
    nn.init.uniform_(layer.bias)
    layer(x).backward(dy)
    assert torch.allclose(torch.cat([parts[0]["dx"], parts[1]["dx"]]), x.grad, atol=1e-12)
    assert torch.allclose(parts[0]["dw"] + parts[1]["dw"], layer.weight.grad, atol=1e-12)
    assert torch.allclose(parts[0]["db"] + parts[1]["db"], layer.bias.grad, atol=1e-12)
    for part in parts:
        assert torch.allclose(part["mean"], layer.running_mean, atol=1e-12)
        assert torch.allclose(part["var"], layer.running_var, atol=1e-12)


def test_convert_and_revert_keep_the_tensors_and_their_names() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm1d(4, momentum=None)))
    keys = {k: v for k, v in model.state_dict().items()}
    convert(model, StatsGroup())
    assert isinstance(model[1], WholeBatchNorm) and isinstance(model[2][0], WholeBatchNorm)
    assert {k: v for k, v in model.state_dict().items()}.keys() == keys.keys()
    assert all(model.state_dict()[k] is v or torch.equal(model.state_dict()[k], v) for k, v in keys.items())
    revert(model)
    assert type(model[1]) is nn.BatchNorm2d and type(model[2][0]) is nn.BatchNorm1d and model[2][0].momentum is None
    assert model.state_dict().keys() == keys.keys()


def test_a_lone_replica_normalizes_as_batch_norm_does() -> None:
    """Alone with its batch (no group), a WholeBatchNorm is BatchNorm, in training and in eval."""
    torch.manual_seed(0)
    plain = nn.BatchNorm1d(5).double()
    whole = WholeBatchNorm(nn.BatchNorm1d(5).double(), StatsGroup())
    x = torch.randn(8, 5, dtype=torch.float64)
    assert torch.equal(plain(x), whole(x)) and torch.equal(plain.running_var, whole.running_var)
    plain.eval(), whole.eval()
    assert torch.equal(plain(x), whole(x))


def _average(rank: int, store_path: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2, timeout=timedelta(seconds=30))
    layer = nn.BatchNorm1d(2).double()
    with torch.no_grad():
        layer.running_mean.fill_(1.0 if rank == 0 else 3.0)
        layer.running_var.fill_(2.0 if rank == 0 else 6.0)
        layer.num_batches_tracked.fill_(4 if rank == 0 else 5)
    average_running_stats(layer, 0.25 if rank == 0 else 0.75, dist.group.WORLD)
    torch.save(layer.state_dict(), f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_running_statistics_are_averaged_by_share() -> None:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_average, args=(os.path.join(out, "store"), out), nprocs=2, start_method="fork")
        for rank in range(2):
            state = torch.load(f"{out}/rank{rank}.pt")
            assert state["running_mean"].tolist() == [2.5, 2.5] and state["running_var"].tolist() == [5.0, 5.0]
            assert int(state["num_batches_tracked"]) == 5


@pytest.mark.parametrize(
    "layout",
    [
        dict(cpu_fraction=0.5),
        dict(stages=["cpu", "cpu"], cpu_fraction=0.3),
        dict(stages=["cpu", "cpu"], cpu_fraction=0.0),
        dict(cpu_workers=2, stages=["cpu"], cpu_fraction=1.0),
        dict(mode="fine", offload="all", bucket_size_mb=0.001, cpu_fraction=0.5),
    ],
    ids=["cpu+device", "cpu+2-devices", "2-devices-alone", "2-cpu-workers-alone", "fine-offloaded"],
)
def test_whole_batch_statistics_train_a_resnet_as_one_device(tmp_path: Path, layout: dict) -> None:
    """A transformers ResNet (BatchNorm after every convolution) with `sync_batchnorm=True`:
    parameters, running statistics and losses are one device's, every replica's copies equal."""
    strategy = hetero(**layout)
    assert_same_run(tmp_path, strategy, TinyResNet, image_data, sync_batchnorm=True)


def test_per_share_statistics_keep_the_replicas_equal(tmp_path: Path) -> None:
    """The default: each share normalized by its own statistics; after every batch the running
    buffers are the shares' average by samples, the same on every replica, and after the first
    batch the first layer's running mean is one device's (its input is the same there)."""
    plain = TinyResNet()
    trainer(None, max_steps=1).fit(plain, image_data())
    model, copies = TinyResNet(), tmp_path / "copies"
    copies.mkdir()
    trainer(hetero(stages=["cpu", "cpu"], cpu_fraction=0.3), max_steps=1, callbacks=[RecordCopies(copies)]).fit(model, image_data())
    assert_copies_identical(copies)
    first = "model.resnet.embedder.embedder.normalization"
    assert torch.allclose(model.state_dict()[f"{first}.running_mean"], plain.state_dict()[f"{first}.running_mean"], atol=1e-12)
    # The variance leaves out the spread between the shares' means: close, not equal.
    assert not torch.allclose(model.state_dict()[f"{first}.running_var"], plain.state_dict()[f"{first}.running_var"], atol=1e-12)
    assert int(model.state_dict()[f"{first}.num_batches_tracked"]) == 1


def test_per_share_statistics_never_normalize_a_lone_sample(tmp_path: Path) -> None:
    """BatchNorm1d cannot normalize one sample by its own statistics (torch refuses it in training),
    and one process normalizes the whole batch: a last batch of 2 split half and half, or a batch
    of 4 over a CPU worker and two devices, is split without single-sample shares instead. The
    replicas stay equal."""
    for stages, samples, batch_size in ((["cpu"], 26, 8), (["cpu", "cpu"], 8, 4)):
        copies = tmp_path / f"copies{len(stages)}"
        copies.mkdir()
        strategy = hetero(stages=stages, cpu_fraction=0.5, parallelism="replicas")
        trainer(strategy, max_epochs=1, callbacks=[RecordCopies(copies)]).fit(BatchNormNet(), regression_data(samples, batch_size))
        assert_copies_identical(copies)


def test_a_resnet_resumes_exactly_with_whole_batch_statistics(tmp_path: Path) -> None:
    plain = TinyResNet()
    trainer(None, max_steps=8).fit(plain, image_data())
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    first = TinyResNet().double()
    trainer(hetero(cpu_fraction=0.5), max_steps=4, callbacks=[checkpoint], enable_checkpointing=True, sync_batchnorm=True).fit(
        first, image_data()
    )
    resumed = TinyResNet().double()
    trainer(hetero(cpu_fraction=0.5), max_steps=8, sync_batchnorm=True).fit(
        resumed, image_data(), ckpt_path=str(tmp_path / "step=4.ckpt")
    )
    assert max_param_diff(plain, resumed) < TOL


class NoRunningStats(BatchNormNet):
    """`BatchNormNet` whose BatchNorm keeps no running statistics: it normalizes with the batch's own,
    in evaluation too."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layers[1][0] = nn.BatchNorm1d(16, track_running_stats=False)


@pytest.mark.parametrize("model", [BatchNormNet, NoRunningStats], ids=["running-stats", "no-running-stats"])
def test_whole_batch_statistics_of_a_batch_too_small_for_every_replica(tmp_path: Path, model: type) -> None:
    """Batches of 5 and a last one of 2, for three replicas (a CPU worker and two devices): the last
    leaves a device without a share, and the statistics are summed over the two that have one
    (their group made when such a batch first comes). Training, and validation (which normalizes
    with the batch's own statistics where a layer keeps none), as one device. (With SGD: a batch of
    two normalized by its own statistics gives gradients near zero, whose rounding AdamW's step
    scales up to 2e-10 in the parameters, in either order of summing.)"""
    strategy = hetero(stages=["cpu", "cpu"], cpu_fraction=0.5, parallelism="replicas")
    def data() -> L.LightningDataModule:
        data = L.LightningDataModule()
        data.train_dataloader = data.val_dataloader = lambda: regression_data(12, 5)
        return data

    assert_same_run(tmp_path, strategy, lambda: model(optimizer="sgd"), data, key="val_loss", steps=6, sync_batchnorm=True)


