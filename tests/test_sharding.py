"""The CPU workers' optimizer split between them (ZeRO-style, `sharding.py`): with 2 or 3 CPU workers
each owns about a half or a third of the state they hold (fine mode: every offloaded bucket's, which
they step for everyone; coarse mode: their replicas') and steps it; the model is the one a single
process trains (float64, 1e-10); no CPU worker holds a whole copy; checkpoints hold the whole state and
resume with any number of CPU workers. Across nodes: tests/test_launchers.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hetero import HeteroStrategy
from lightning_hetero.sharding import owners
from tests.conftest import OptimizerMemory, RecordCopies, assert_copies_identical, hetero, max_param_diff, trainer
from tests.models import Net, regression_data

TOL = 1e-10
TINY_BUCKETS = 1e-5  # a bucket per layer with parameters (see test_fine.py)


def fine(**kwargs: Any) -> HeteroStrategy:
    kwargs.setdefault("bucket_size_mb", TINY_BUCKETS)
    kwargs.setdefault("stages", ["cpu"])
    return hetero(mode="fine", **kwargs)


def coarse(**kwargs: Any) -> HeteroStrategy:
    kwargs.setdefault("stages", ["cpu"])
    return hetero(**kwargs)


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


@pytest.mark.parametrize("offload", ["all", [0, 2], "none"], ids=["all", "mixed", "none"])
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


class OwnerSumCounts(L.Callback):
    """Every rank writes, per step, how many of its buckets had their gradients reduced to their owners only."""

    def __init__(self, out: Path) -> None:
        self.out, self.counts = out, []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.counts.append(trainer.strategy.engine.sync.reduced_to_owners)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save(self.counts, self.out / f"owners{trainer.global_rank}.pt")


@pytest.mark.parametrize("clip", [None, 0.05], ids=["reduced-to-owners", "clipped-by-norm"])
def test_a_split_buckets_gradients_go_to_its_owners_only(tmp_path: Path, clip: Any) -> None:
    """ZeRO stage 2's reduce: each owner receives the sums of its parameters, and nobody else any
    (every rank's every bucket, every step but the first); where the steps wait for the global norm,
    which is taken from the stage's summed gradients, the buckets are summed everywhere instead, as
    in the first step under `64-true`, which steps after the backward (`sync._Overlap.begin`)."""
    strategy = fine(cpu_workers=2, offload="all", cpu_fraction=0.5, stages=["cpu", "cpu"])
    model = fit(strategy, callbacks=[OwnerSumCounts(tmp_path)], gradient_clip_val=clip)
    assert max_param_diff(fit(None, gradient_clip_val=clip), model) < TOL
    counts = [torch.load(tmp_path / f"owners{r}.pt") for r in range(4)]
    buckets = [3, 3, 1, 2]  # the CPU workers hold every bucket; stage 0 layers 0-1, stage 1 layers 2-5
    assert counts == [[0] + [0 if clip else n] * 7 for n in buckets]


@pytest.mark.parametrize("cpu_workers", [2, 3])
@pytest.mark.parametrize(
    "layout",
    [
        dict(cpu_fraction=0.0),
        dict(cpu_fraction=0.5),
        dict(stages=["cpu", "cpu"], cpu_fraction=0.4),
        dict(stages=["cpu", "cpu"], parallelism="replicas", cpu_fraction=0.3),
    ],
    ids=["cpu-without-a-share", "shared", "pipeline", "replicas"],
)
def test_coarse_mode_splits_the_cpu_workers_step_and_trains_the_one_process_model(
    tmp_path: Path, plain: Net, cpu_workers: int, layout: dict
) -> None:
    model = fit(coarse(cpu_workers=cpu_workers, **layout), callbacks=[RecordCopies(tmp_path)])
    assert_copies_identical(tmp_path)
    assert max_param_diff(plain, model) < TOL


def test_coarse_mode_with_clipping_accumulation_and_a_share_that_comes_and_goes(tmp_path: Path) -> None:
    """Clipping by norm and by value see every gradient; a CPU worker kept out of some steps (no
    share) is brought up to date, the whole state, and drops the others' part at its next step."""
    from tests.test_replicas import assert_same_run

    assert_same_run(tmp_path, coarse(cpu_workers=2, cpu_fraction=0.3), accumulate_grad_batches=2, gradient_clip_val=0.05)
    clipped = dict(gradient_clip_val=0.02, gradient_clip_algorithm="value")
    assert max_param_diff(fit(None, **clipped), fit(coarse(cpu_workers=3, cpu_fraction=0.4), **clipped)) < TOL
    model = fit(coarse(cpu_workers=2, cpu_fraction=0.5), callbacks=[ShareComesAndGoes()])
    assert max_param_diff(fit(None), model) < TOL


class ShareComesAndGoes(L.Callback):
    """The CPU workers' share: none in steps 2-4, half again from step 5 on."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        trainer.strategy.set_cpu_fraction(0.0 if 2 <= trainer.global_step <= 4 else 0.5)


@pytest.mark.parametrize("clip", [None, 0.05], ids=["reduced-to-owners", "clipped-by-norm"])
def test_with_clipping_accumulation_and_replicas(tmp_path: Path, clip: Any) -> None:
    from tests.test_replicas import assert_same_run

    strategy = fine(cpu_workers=2, offload="all", stages=["cpu", "cpu"], parallelism="replicas", cpu_fraction=0.3)
    assert_same_run(tmp_path, strategy, accumulate_grad_batches=2, gradient_clip_val=clip)
    if clip is None:
        return
    assert max_param_diff(fit(None, gradient_clip_val=0.05), fit(fine(cpu_workers=3, offload="all", cpu_fraction=0.3), gradient_clip_val=0.05)) < TOL


@pytest.mark.parametrize("cpu_workers", [1, 2, 3])
def test_each_cpu_worker_holds_its_part_of_the_offloaded_state(tmp_path: Path, cpu_workers: int) -> None:
    """Adam's two moments of every parameter, offloaded: with N CPU workers, each holds its owned part
    (about 1/N), together once; the stage holds none. With one CPU worker, the stage and it each step
    every offloaded bucket (the layout of fine mode before sharding)."""
    strategy = fine(cpu_workers=cpu_workers, offload="all", cpu_fraction=0.5, bucket_size_mb=25)  # one bucket
    fit(strategy, callbacks=[OptimizerMemory(tmp_path)])
    ranks = [torch.load(tmp_path / f"optimizer{r}.pt") for r in range(cpu_workers + 1)]
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


@pytest.mark.parametrize("cpu_workers", [1, 2, 3])
def test_in_coarse_mode_each_cpu_worker_holds_its_part_of_its_replicas_state(tmp_path: Path, cpu_workers: int) -> None:
    """Adam's two moments of every parameter: each CPU worker holds its owned part, together once; the
    stage steps its own blocks on its device and holds their whole state."""
    fit(coarse(cpu_workers=cpu_workers, cpu_fraction=0.5), callbacks=[OptimizerMemory(tmp_path)])
    ranks = [torch.load(tmp_path / f"optimizer{r}.pt")["user"] for r in range(cpu_workers + 1)]
    whole, largest = 2 * sum(p.numel() for p in Net().parameters()), 2 * max(p.numel() for p in Net().parameters())
    workers, stage = ranks[:cpu_workers], ranks[cpu_workers]
    assert stage == whole
    if cpu_workers == 1:
        assert workers == [whole]
        return
    assert sum(workers) == whole and max(workers) - min(workers) <= largest and 0 < min(workers) and max(workers) < whole


@pytest.mark.parametrize("mode", ["fine", "coarse"])
def test_checkpoints_hold_the_whole_state_and_resume_with_any_number_of_cpu_workers(tmp_path: Path, mode: str) -> None:
    def strategy(workers: int) -> HeteroStrategy:
        return fine(cpu_workers=workers, offload="all", cpu_fraction=0.5) if mode == "fine" else coarse(cpu_workers=workers, cpu_fraction=0.5)

    saving = ModelCheckpoint(tmp_path / "ckpt", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    fit(strategy(2), steps=4, callbacks=[saving], enable_checkpointing=True)
    checkpoint = tmp_path / "ckpt" / "step=4.ckpt"
    state = torch.load(checkpoint, weights_only=False)["optimizer_states"][0]["state"]
    assert len(state) == len(list(Net().parameters()))  # every parameter's, gathered from both owners
    reference = fit(None, ckpt=checkpoint)  # an ordinary checkpoint: a plain Trainer resumes it
    for workers in (3, 1):
        resumed = fit(strategy(workers), ckpt=checkpoint)
        assert max_param_diff(reference, resumed) < TOL, workers


@pytest.mark.parametrize("mode", ["fine", "coarse"])
def test_sharding_can_be_turned_off(tmp_path: Path, plain: Net, mode: str) -> None:
    """`shard_cpu_optimizer=False`: every CPU worker steps the whole state it holds, as before."""
    strategy = hetero(mode=mode, stages=["cpu"], cpu_workers=2, cpu_fraction=0.5, shard_cpu_optimizer=False)
    if mode == "fine":
        strategy = fine(cpu_workers=2, offload="all", cpu_fraction=0.5, bucket_size_mb=25, shard_cpu_optimizer=False)
    model = fit(strategy, callbacks=[OptimizerMemory(tmp_path)])
    assert max_param_diff(plain, model) < TOL
    whole = 2 * sum(p.numel() for p in Net().parameters())
    held = [torch.load(tmp_path / f"optimizer{r}.pt") for r in range(3)]
    assert [r["offloaded" if mode == "fine" else "user"] for r in held] == [whole] * 3


def test_bad_sharding_options_are_refused_before_any_process_starts(no_processes: None) -> None:
    with pytest.raises(ValueError, match="must be True or False"):
        HeteroStrategy(shard_cpu_optimizer="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="drop one of them"):
        HeteroStrategy(shard_cpu_optimizer=False, shard_across_nodes=True)


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


@pytest.mark.parametrize("case", ["skipped-step", "tied-weights", "unfrozen-while-training"])
def test_coarse_mode_split_with_a_skipped_step_tied_weights_and_a_layer_unfrozen(tmp_path: Path, case: str) -> None:
    """A step skipped on every rank (NaN in the second CPU worker's gradients, `nonfinite="skip"`)
    leaves every owner's parameters as they were; a weight two stages share is stepped by its owner
    alone; a layer frozen, then unfrozen and added to the optimizer, is broadcast once it trains."""
    from tests.models import FinetunedNet, TiedNet
    from tests.test_fine import UnfreezeFirstLayer
    from tests.test_nonfinite import STEP, Poison, SkipStep

    model: Any
    strategy = coarse(cpu_workers=2, cpu_fraction=0.5, stages=["cpu", "cpu"])
    if case == "skipped-step":
        plain, model = Net(), Net()
        trainer(None, max_steps=6, callbacks=[SkipStep(STEP)]).fit(plain, regression_data())
        strategy = coarse(cpu_workers=2, cpu_fraction=0.5, stages=["cpu", "cpu"], nonfinite="skip")
        callbacks: list = [Poison(1, STEP, "gradients"), RecordCopies(tmp_path)]
        trainer(strategy, max_steps=6, callbacks=callbacks).fit(model, regression_data())
    else:
        kind, more = (TiedNet, []) if case == "tied-weights" else (FinetunedNet, [UnfreezeFirstLayer()])
        plain, model = kind(), kind()
        trainer(None, max_steps=8, callbacks=list(more)).fit(plain, regression_data())
        more = [UnfreezeFirstLayer()] if case != "tied-weights" else []
        trainer(strategy, max_steps=8, callbacks=[*more, RecordCopies(tmp_path)]).fit(model, regression_data())
    assert_copies_identical(tmp_path)
    assert max_param_diff(plain, model) < TOL
