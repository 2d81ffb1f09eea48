"""The offloaded optimizer split between the CPU workers (ZeRO-style, `sharding.py`): with 2 or 3 CPU
workers each owns about a third of every offloaded bucket's state and steps it for everyone; the model
is the one a single process trains (float64, 1e-10); no process holds a whole copy of the offloaded
state; checkpoints hold the whole state and resume with any number of CPU workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hetero import HeteroStrategy
from lightning_hetero.offload import OffloadStep
from lightning_hetero.sharding import ShardedStep, owners
from tests.conftest import RecordCopies, assert_copies_identical, hetero, max_param_diff, trainer
from tests.models import Net, regression_data

TOL = 1e-10
TINY_BUCKETS = 1e-5  # a bucket per layer with parameters (see test_fine.py)


def fine(**kwargs: Any) -> HeteroStrategy:
    kwargs.setdefault("bucket_size_mb", TINY_BUCKETS)
    kwargs.setdefault("stages", ["cpu"])
    return hetero(mode="fine", **kwargs)


def fit(strategy: Any, steps: int = 8, callbacks: list | None = None, ckpt: Path | None = None, **kwargs: Any) -> Net:
    model = Net(optimizer="adamw").double()  # a checkpoint loads before the precision plugin converts it
    trainer(strategy, max_steps=steps, callbacks=callbacks or [], **kwargs).fit(model, regression_data(), ckpt_path=ckpt)
    return model


@pytest.fixture(scope="module")
def plain() -> Net:
    return fit(None)


def test_owners_share_the_elements_out() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 10, 60, 50, 5)]
    assert owners(params, 2) == [0, 0, 1, 1, 0]  # 100 + 10 + 5 | 60 + 50
    assert owners(params, 3) == [0, 2, 1, 2, 1]  # 100 | 60 + 5 | 50 + 10
    assert owners(params, 1) == [0] * 5


@pytest.mark.parametrize("offload", ["all", [0, 2]], ids=["all", "mixed"])
@pytest.mark.parametrize("cpu_workers", [2, 3])
@pytest.mark.parametrize(
    "layout", [dict(cpu_fraction=0.0), dict(cpu_fraction=0.5), dict(stages=["cpu", "cpu"], cpu_fraction=0.4)],
    ids=["cpu-without-a-share", "shared", "pipeline"],
)
def test_split_between_cpu_workers_trains_the_one_process_model(
    tmp_path: Path, plain: Net, offload: Any, cpu_workers: int, layout: dict
) -> None:
    model = fit(fine(cpu_workers=cpu_workers, offload=offload, **layout), callbacks=[RecordCopies(tmp_path)])
    assert_copies_identical(tmp_path)
    assert max_param_diff(plain, model) < TOL


def test_with_clipping_accumulation_and_replicas(tmp_path: Path) -> None:
    from tests.test_replicas import assert_same_run

    strategy = fine(cpu_workers=2, offload="all", stages=["cpu", "cpu"], parallelism="replicas", cpu_fraction=0.3)
    assert_same_run(tmp_path, strategy, accumulate_grad_batches=2, gradient_clip_val=0.05)
    assert max_param_diff(fit(None, gradient_clip_val=0.05), fit(fine(cpu_workers=3, offload="all", cpu_fraction=0.3), gradient_clip_val=0.05)) < TOL


class OptimizerMemory(L.Callback):
    """Every rank writes the elements of optimizer state it holds: its bucket steps' and its optimizer's."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps = trainer.strategy.bucket_steps
        offloaded = [s for s in steps if isinstance(s, OffloadStep)]
        held = sum(
            t.numel() for s in offloaded if s.optimizer is not None for state in s.optimizer.state.values()
            for t in state.values() if torch.is_tensor(t) and t.dim() > 0
        )  # fmt: skip
        user = sum(t.numel() for state in trainer.optimizers[0].state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
        sharded = all(isinstance(s, ShardedStep) for s in offloaded)
        torch.save({"offloaded": held, "user": user, "sharded": sharded}, self.out / f"rank{trainer.global_rank}.pt")


@pytest.mark.parametrize("cpu_workers", [1, 2, 3])
def test_each_cpu_worker_holds_its_part_of_the_offloaded_state(tmp_path: Path, cpu_workers: int) -> None:
    """Adam's two moments of every parameter, offloaded: with N CPU workers, each holds its owned part
    (about 1/N), together once; the stage holds none. With one CPU worker, the stage and it each step
    every offloaded bucket (the layout of fine mode before sharding)."""
    strategy = fine(cpu_workers=cpu_workers, offload="all", cpu_fraction=0.5, bucket_size_mb=25)  # one bucket
    fit(strategy, callbacks=[OptimizerMemory(tmp_path)])
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(cpu_workers + 1)]
    whole = 2 * sum(p.numel() for p in Net().parameters())
    assert all(r["user"] == 0 for r in ranks)  # nothing offloaded is in the user's optimizer
    if cpu_workers == 1:
        assert [r["offloaded"] for r in ranks] == [whole, whole] and not ranks[0]["sharded"]
        return
    workers, stage = ranks[:cpu_workers], ranks[cpu_workers]
    assert all(r["sharded"] for r in ranks) and stage["offloaded"] == 0
    held, largest = [r["offloaded"] for r in workers], 2 * max(p.numel() for p in Net().parameters())
    # Whole parameters, the largest first to the least loaded (as torch's ZeroRedundancyOptimizer
    # splits them): the parts differ by at most the largest parameter's state, and sum to one copy.
    assert sum(held) == whole and max(held) - min(held) <= largest and 0 < min(held) and max(held) < whole


def test_checkpoints_hold_the_whole_state_and_resume_with_any_number_of_cpu_workers(tmp_path: Path) -> None:
    saving = ModelCheckpoint(tmp_path / "ckpt", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    fit(fine(cpu_workers=2, offload="all", cpu_fraction=0.5), steps=4, callbacks=[saving], enable_checkpointing=True)
    checkpoint = tmp_path / "ckpt" / "step=4.ckpt"
    state = torch.load(checkpoint, weights_only=False)["optimizer_states"][0]["state"]
    assert len(state) == len(list(Net().parameters()))  # every parameter's, gathered from both owners
    reference = fit(None, ckpt=checkpoint)  # an ordinary checkpoint: a plain Trainer resumes it
    for workers in (3, 1):
        resumed = fit(fine(cpu_workers=workers, offload="all", cpu_fraction=0.5), ckpt=checkpoint)
        assert max_param_diff(reference, resumed) < TOL, workers


def test_sharding_can_be_turned_off(tmp_path: Path, plain: Net) -> None:
    """`shard_offloaded=False`: every CPU worker and the stage step the whole offloaded state, as before."""
    strategy = fine(cpu_workers=2, offload="all", cpu_fraction=0.5, bucket_size_mb=25, shard_offloaded=False)
    model = fit(strategy, callbacks=[OptimizerMemory(tmp_path)])
    assert max_param_diff(plain, model) < TOL
    whole = 2 * sum(p.numel() for p in Net().parameters())
    assert [torch.load(tmp_path / f"rank{r}.pt")["offloaded"] for r in range(3)] == [whole] * 3
    with pytest.raises(ValueError, match="must be True or False"):
        HeteroStrategy(shard_offloaded="yes")


def test_layers_added_to_the_optimizer_while_training_keep_their_owners() -> None:
    """A parameter group added in the second epoch rebuilds the bucket steps: no parameter moves to
    another owner, so none loses its optimizer state (one bucket: every parameter in it)."""
    from tests.models import FinetunedNet
    from tests.test_fine import UnfreezeFirstLayer

    plain = FinetunedNet()
    trainer(None, max_steps=8, callbacks=[UnfreezeFirstLayer()]).fit(plain, regression_data())
    model = FinetunedNet()
    strategy = fine(cpu_workers=2, cpu_fraction=0.5, offload="all", bucket_size_mb=25)
    trainer(strategy, max_steps=8, callbacks=[UnfreezeFirstLayer()]).fit(model, regression_data())
    assert max_param_diff(plain, model) < TOL
