"""NaN or Inf in any worker's loss or gradients is found on every rank at the same step: by default
an error that names the step and the worker; with `nonfinite="skip"`, a step skipped on every rank,
the same model as one process that skipped that step."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

import lightning as L
import pytest
import torch
from torch.multiprocessing.spawn import ProcessRaisedException

from lightning_hetero import HeteroStrategy
from lightning_hetero.finite import _finite_by_max_abs, finite_flag
from tests.conftest import RecordCopies, assert_copies_identical, hetero, max_param_diff, trainer
from tests.models import Net, column, read_metrics, regression_data

TOL = 1e-10
STEP = 3  # the poisoned step: mid-epoch, after the LR schedule's first change
LAYOUT = "1 CPU worker(s) + 2 stage(s) [cpu, cpu] x 1 node(s)"


class Poison(L.Callback):
    """At training step ``step``, global rank ``rank`` (``None``: one process) computes NaN: in the
    output of its first layer with parameters (``"loss"``: its loss and gradients), or only in the
    gradient of that layer's weight (``"gradients"``); in the first batch of that step only."""

    def __init__(self, rank: int | None, step: int, where: Literal["loss", "gradients"]) -> None:
        self.rank, self.step, self.where = rank, step, where

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step != self.step or self.rank not in (None, trainer.global_rank) or hasattr(self, "handles"):
            return  # once: the first batch of the step
        layer = next(m for m in pl_module.pipeline_layers() if any(not p.is_meta for p in m.parameters()))
        if self.where == "loss":
            handle = layer.register_forward_hook(lambda module, args, out: out * float("nan"))
        else:
            handle = layer.weight.register_hook(lambda grad: grad * float("nan"))
        self.handles = [handle]

    def on_train_batch_end(self, *args: Any) -> None:
        for handle in getattr(self, "handles", []):
            handle.remove()


class SkipStep(L.Callback):
    """The reference: one process that skips optimizer step ``step`` (its gradients dropped)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == self.step:
            optimizer.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def reference() -> dict:
    model = Net()
    trainer(None, max_steps=6, callbacks=[SkipStep(STEP)]).fit(model, regression_data())
    return model.state_dict()


@pytest.mark.parametrize(
    "rank,where,mode",
    [(0, "loss", "coarse"), (2, "gradients", "coarse"), (1, "loss", "fine"), (0, "gradients", "fine")],
    ids=["cpu-worker-loss", "stage-gradients", "stage-loss-fine", "cpu-worker-gradients-fine"],
)
def test_skip_skips_the_step_on_every_rank(tmp_path: Path, reference: dict, rank: int, where: str, mode: str) -> None:
    model = Net()
    callbacks = [Poison(rank, STEP, where), RecordCopies(tmp_path)]
    strategy = hetero(mode=mode, cpu_fraction=0.5, nonfinite="skip")
    trainer(strategy, tmp_path, max_steps=6, callbacks=callbacks).fit(model, regression_data())
    assert max_param_diff(reference, model) < TOL
    assert_copies_identical(tmp_path)
    assert column(read_metrics(tmp_path), "hetero/skipped_steps") == [(STEP, 1.0)]


@pytest.mark.parametrize(
    "rank,where,mode,found",
    [
        (0, "loss", "coarse", "loss and gradients on cpu0 (global rank 0)"),
        (2, "gradients", "coarse", "gradients on stage1 (global rank 2)"),
        (1, "loss", "fine", "gradients on stage0 (global rank 1); loss and gradients on stage1 (global rank 2)"),
    ],
    ids=["cpu-worker-loss", "stage-gradients", "stage-loss-fine"],
)
def test_error_names_the_step_and_the_workers(rank: int, where: str, mode: str, found: str) -> None:
    strategy = hetero(mode=mode, cpu_fraction=0.5)
    with pytest.raises(ProcessRaisedException) as error:
        trainer(strategy, max_steps=6, callbacks=[Poison(rank, STEP, where)]).fit(Net(), regression_data())
    text = str(error.value)
    assert f"FloatingPointError: Non-finite values (NaN or Inf) in training step {STEP} (epoch 0, batch {STEP}): {found}." in text
    assert "`HeteroStrategy(nonfinite='skip')`" in text
    assert ("Fine mode had stepped this step's buckets" in text) == (mode == "fine")


def test_a_nan_loss_is_not_mistaken_for_a_different_loss() -> None:
    """The last stage compares `training_step`'s loss with `pipeline_loss`'s: NaN equals nothing, and
    must be reported as what it is."""
    with pytest.raises(ProcessRaisedException, match=re.escape("loss and gradients on stage1 (global rank 2)")):
        trainer(hetero(cpu_fraction=0.0), max_steps=6, callbacks=[Poison(2, STEP, "loss")]).fit(Net(), regression_data())


def test_skip_with_accumulation_and_clipping_in_fine_mode(tmp_path: Path) -> None:
    """A NaN in the first batch of a two-batch window skips the window's step; with clipping by
    norm (which defers fine mode's steps too) and a CPU worker kept out (fraction 0) on other steps."""
    plain = Net()
    kwargs: dict = dict(max_steps=4, accumulate_grad_batches=2, gradient_clip_val=0.05)
    trainer(None, **kwargs, callbacks=[SkipStep(1)]).fit(plain, regression_data(n=96))
    model = Net()
    strategy = hetero(mode="fine", cpu_fraction=0.0, nonfinite="skip")
    trainer(strategy, **kwargs, callbacks=[Poison(1, 1, "gradients")]).fit(model, regression_data(n=96))
    assert max_param_diff(plain, model) < TOL


def test_policy_argument() -> None:
    with pytest.raises(ValueError, match=re.escape("`nonfinite='ignore'` must be 'error' (end the run) or 'skip'")):
        HeteroStrategy(nonfinite="ignore")  # type: ignore[arg-type]


@pytest.mark.parametrize("check", [finite_flag, _finite_by_max_abs], ids=["cpu", "the-gpus-check"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [None, math.nan, math.inf, -math.inf, "inf-and-minus-inf"])
def test_finite_flag_finds_any_nan_or_inf(check: Any, dtype: torch.dtype, bad: object) -> None:
    """Both checks, the CPU's sum and a GPU's largest absolute value (run here on CPU tensors), on
    tensors of every kind, an empty one among them (a parameter with no elements)."""
    tensors = [torch.randn(7, 5, dtype=dtype), torch.randn(300, dtype=dtype), torch.zeros(0, dtype=dtype)]
    # The largest finite values of a half-precision type sum far beyond it: not mistaken for Inf.
    tensors.append(torch.full((1000,), torch.finfo(dtype).max if dtype.itemsize < 4 else 1.0, dtype=dtype))
    if bad == "inf-and-minus-inf":  # a sum of infinities that cancels is NaN, not finite
        tensors[1][3], tensors[1][9] = math.inf, -math.inf
    elif bad is not None:
        tensors[0][4, 2] = bad
    assert bool(check(tensors)) is (bad is None)
    assert bool(check([torch.zeros(0, dtype=dtype)])) is True
    assert bool(check([torch.ones(3, dtype=torch.float32), torch.tensor([1.0, math.nan], dtype=dtype)])) is False
    assert bool(finite_flag([])) is True
