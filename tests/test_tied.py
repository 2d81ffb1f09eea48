"""Tied weights across pipeline stages: a parameter that blocks of several stages use (an input
embedding and the output head) gets the sum of every use's gradient on every stage that holds it,
counts once in the global norm, and is saved once; the model trains as one process trains it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_hetero import HeteroPlan, HeteroStrategy
from lightning_hetero.callbacks import WorkloadAnalyzer
from lightning_hetero.module import check_model_contract, tied_parameters
from lightning_hetero.pipeline import available_schedules
from lightning_hetero.state import drop_to_meta
from tests.conftest import TIMEOUT, RecordCopies, assert_copies_identical, hetero, max_param_diff, trainer
from tests.models import PipelinedGPT2, TiedNet, TinyGPT2, regression_data, token_data

TOL = 1e-10


def fit(
    model: L.LightningModule, strategy: Any, data: Any = None, copies: Path | None = None, **kwargs: Any
) -> L.LightningModule:
    kwargs.setdefault("max_steps", 8)
    callbacks = kwargs.pop("callbacks", []) + ([RecordCopies(copies)] if copies is not None else [])
    trainer(strategy, callbacks=callbacks, **kwargs).fit(model, data if data is not None else regression_data())
    return model


@pytest.fixture(scope="module")
def plain() -> TiedNet:
    return fit(TiedNet(), None, gradient_clip_val=0.05)


def test_the_tied_weight_lands_on_two_stages() -> None:
    model = TiedNet()
    layers = check_model_contract(model)
    tied = tied_parameters(layers, [(0, 3), (3, 6)])
    assert [(stages, [p is model.layers[0].weight for p in params]) for stages, params in tied] == [((0, 1), [True])]
    assert tied_parameters(layers, [(0, 6)]) == []
    assert [stages for stages, _ in tied_parameters(layers, [(0, 2), (2, 4), (4, 6)])] == [(0, 2)]


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("cpu_fraction", [0.0, 0.5, 1.0])
def test_matches_single_process(tmp_path: Path, plain: TiedNet, num_stages: int, cpu_fraction: float) -> None:
    # Clipping by norm: the tied gradient counts once in the global norm, or every step differs.
    strategy = hetero(stages=["cpu"] * num_stages, micro_batches=num_stages, cpu_fraction=cpu_fraction, schedule="1F1B")
    model = fit(TiedNet(), strategy, copies=tmp_path, gradient_clip_val=0.05)
    assert_copies_identical(tmp_path)
    assert max_param_diff(plain, model) < TOL
    assert model.layers[4].weight is model.layers[0].weight  # still one parameter on every rank after fit


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cpu_fraction": 0.5, "offload": "none"},
        {"cpu_fraction": 0.5, "offload": "all"},
        {"cpu_workers": 0, "offload": "all", "stages": ["cpu"] * 3},
        {"cpu_fraction": 0.5, "stages": ["cpu"]},
        {"cpu_fraction": 0.0, "offload": "all", "stages": ["cpu"]},
    ],
    ids=["cpu-worker", "offloaded", "stages-only", "both-uses-in-one-stage", "both-uses-in-one-stage-offloaded"],
)
def test_fine_mode_matches_single_process(tmp_path: Path, plain: TiedNet, kwargs: dict) -> None:
    """Also where one stage holds both uses of the tied weight in two of its buckets: the weight is in
    one of them, the earlier layer's, and is summed and stepped once."""
    strategy = hetero(mode="fine", bucket_size_mb=1e-5, **kwargs)
    model = fit(TiedNet(), strategy, copies=tmp_path, gradient_clip_val=0.05)
    assert_copies_identical(tmp_path)
    assert max_param_diff(plain, model) < TOL


def test_accumulation_and_steps_without_the_cpu_worker(plain: TiedNet) -> None:
    """With accumulation and a CPU fraction of 0, the stages sum the tied weight among themselves."""
    reference = fit(TiedNet(), None, accumulate_grad_batches=2)
    model = fit(TiedNet(), hetero(cpu_fraction=0.0), accumulate_grad_batches=2)
    assert max_param_diff(reference, model) < TOL


@pytest.mark.parametrize(
    ("cpu_fraction", "schedule"), [(0.0, "GPipe"), (0.5, "GPipe"), (0.5, "ZBVZeroBubble"), (0.0, "Interleaved1F1B")]
)
def test_hugging_face_gpt2_as_a_pipeline(tmp_path: Path, cpu_fraction: float, schedule: str) -> None:
    """A transformers GPT-2 cut into blocks (its embedding on the first stage, its head, which uses
    the same weight, on the last) trains as the model's own `model(**batch).loss` in one process; also
    with two stages per process, in a V (the first process holds both) or a loop (two processes do)."""
    if schedule not in ("GPipe", *available_schedules()):
        pytest.skip(f"this torch has no {schedule}")
    reference = fit(TinyGPT2(attention="sdpa"), None, token_data())
    strategy = hetero(stages=["cpu"] * 2, cpu_fraction=cpu_fraction, micro_batches=2, schedule=schedule)
    model = fit(PipelinedGPT2(), strategy, token_data(), copies=tmp_path)
    assert_copies_identical(tmp_path)
    assert max_param_diff(reference, model) < TOL
    assert model.model.lm_head.weight is model.model.transformer.wte.weight


MULTI = available_schedules()


@pytest.mark.parametrize(
    ("schedule", "boundaries", "together"),
    [
        ("ZBVZeroBubble", [1, 2, 4], True),  # blocks 0 and 4 on stages 0 and 3: both on the first process
        ("ZBVZeroBubble", [1, 3, 5], False),  # block 4 on stage 2: the second process
        ("Interleaved1F1B", [1, 3, 5], True),  # block 4 on stage 2: the first process, as stage 0
        ("Interleaved1F1B", [1, 2, 4], False),
        ("DualPipeV", [1, 2, 4], True),
    ],
)
@pytest.mark.parametrize("mode", ["coarse", "fine"])
@pytest.mark.parametrize("cpu_fraction", [0.0, 0.5])
def test_several_stages_per_process_sum_the_tied_weight_between_their_processes(
    tmp_path: Path, plain: TiedNet, schedule: str, boundaries: list[int], together: bool, mode: str, cpu_fraction: float
) -> None:
    """Where one process holds every stage that uses the tied weight, its backward adds the uses up (in
    fine mode, its bucket waits for the gradients of both stages' micro-batches); where two do, they
    sum as with one stage per process. Clipping by norm: the tied gradient counts once."""
    if schedule not in MULTI:
        pytest.skip(f"this torch has no {schedule}")
    plan = HeteroPlan(
        stages=["cpu", "cpu"], schedule=schedule, stages_per_process=2, boundaries=boundaries, micro_batches=4,
        cpu_fraction=cpu_fraction, mode=mode, offload="all" if mode == "fine" else [], bucket_size_mb=1e-5,
    )  # fmt: skip
    layers = check_model_contract(TiedNet())
    [(stages, _)] = tied_parameters(layers, plan.cut([f"layers.{i}" for i in range(6)]))
    assert (len({plan.stage_holders()[s] for s in stages}) == 1) == together
    strategy = HeteroStrategy(plan=plan, start_method="fork", timeout=TIMEOUT)
    model = fit(TiedNet(), strategy, copies=tmp_path, gradient_clip_val=0.05)
    assert_copies_identical(tmp_path)
    assert max_param_diff(plain, model) < TOL
    assert model.layers[4].weight is model.layers[0].weight


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "Interleaved1F1B"])
def test_several_stages_per_process_checkpoint_the_tied_weight_once_and_resume(tmp_path: Path, schedule: str) -> None:
    """No CPU worker: rank 0 is the first stage process, which in a V holds both uses of the weight."""
    if schedule not in MULTI:
        pytest.skip(f"this torch has no {schedule}")
    saving = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    whole = fit(TiedNet(), hetero(cpu_workers=0, schedule=schedule), callbacks=[saving], enable_checkpointing=True)
    state = torch.load(tmp_path / "step=4.ckpt", weights_only=False)["state_dict"]
    assert state["layers.4.weight"].untyped_storage().data_ptr() == state["layers.0.weight"].untyped_storage().data_ptr()
    resumed = TiedNet().double()  # a checkpoint loads before the precision plugin converts the model
    trainer(hetero(cpu_fraction=0.5, schedule=schedule), max_steps=8).fit(resumed, regression_data(), ckpt_path=tmp_path / "step=4.ckpt")
    assert max_param_diff(whole, resumed) < TOL
    assert resumed.layers[4].weight is resumed.layers[0].weight


def test_checkpoint_holds_the_tied_weight_once_and_resumes(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    # No CPU worker: rank 0 is the first stage, and the checkpoint is gathered from the stages.
    fit(PipelinedGPT2(), hetero(cpu_workers=0), token_data(), max_steps=4, callbacks=[checkpoint], enable_checkpointing=True)
    path = tmp_path / "step=4.ckpt"
    state = torch.load(path, weights_only=False)["state_dict"]
    head, embedding = state["model.lm_head.weight"], state["model.transformer.wte.weight"]
    assert head.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()  # stored once
    reference = TinyGPT2(attention="sdpa").double()
    trainer(None, max_steps=8).fit(reference, token_data(), ckpt_path=path)
    resumed = PipelinedGPT2().double()
    trainer(hetero(cpu_fraction=0.5), max_steps=8).fit(resumed, token_data(), ckpt_path=path)
    assert max_param_diff(reference, resumed) < TOL


def test_drop_to_meta_keeps_this_stages_tied_weights_and_one_tensor_per_parameter() -> None:
    model = TiedNet()
    count = len(list(model.parameters()))
    first = model.layers[0].weight
    drop_to_meta(list(model.layers[2:]), keep=list(model.layers[0].parameters()))
    assert model.layers[4].weight is first and not first.is_meta
    assert model.layers[2].weight.is_meta and model.layers[5].bias.is_meta
    assert len(list(model.parameters())) == count
    other = TiedNet()
    drop_to_meta(list(other.layers))
    assert other.layers[4].weight is other.layers[0].weight and other.layers[0].weight.is_meta
    assert len(list(other.parameters())) == count


class Wrapped(nn.Module):
    def __init__(self, inner: nn.Module, extra: bool) -> None:
        super().__init__()
        self.inner = inner
        self.scale = nn.Parameter(torch.ones(())) if extra else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_a_block_may_wrap_the_models_own_modules_but_not_bring_parameters() -> None:
    model = TiedNet()
    model.pipeline_layers = lambda: [Wrapped(model.layers[0], False), *model.layers[1:]]  # type: ignore[method-assign]
    assert len(check_model_contract(model)) == 6
    model.pipeline_layers = lambda: [Wrapped(model.layers[0], True), *model.layers[1:]]  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"\[0\]` \(Wrapped\) is not a submodule of the model, nor a wrapper"):
        check_model_contract(model)


@pytest.mark.parametrize("mode", ["coarse", "fine"])
def test_the_analyzer_plans_a_model_with_tied_weights(tmp_path: Path, mode: str) -> None:
    """Profiled block by block (the head's weight is the embedding's), planned, and still one process's model."""
    reference = fit(TinyGPT2(attention="sdpa"), None, token_data())
    analyzer = WorkloadAnalyzer(repeats=1, max_micro_batches=2, warmup_steps=2, measure_steps=1)
    strategy = hetero(mode=mode, micro_batches=1)
    model = fit(PipelinedGPT2(), strategy, token_data(), callbacks=[analyzer], default_root_dir=tmp_path)
    assert max_param_diff(reference, model) < TOL


@pytest.mark.parametrize("bounds", [[(0, 6)], [(0, 5), (5, 6)], [(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 6)]])
@pytest.mark.parametrize("bucket_bytes", [1, 200, 2**20])
def test_the_planner_sizes_fine_modes_buckets_as_the_run_fills_them(bounds: list, bucket_bytes: int) -> None:
    """The planner's buckets (which it offloads by index, for the optimizer state they free) are the
    run's: a weight tied across stages in a bucket of its own, one tied within a stage once."""
    from lightning_hetero.planner import _buckets
    from lightning_hetero.profiling import LayerProfile, Profile, tied_layers
    from lightning_hetero.workers import Placement, Tied

    layers = check_model_contract(TiedNet())
    counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    profile = Profile(
        batch_size=1,
        layers=[LayerProfile(f"layers.{i}", n, 8 * n, 0.0, 0.0, 0.0) for i, n in enumerate(counts)],
        devices={},
        tied=tied_layers(layers),
    )
    tied = [Tied(stages, params, None, None) for stages, params in tied_parameters(layers, bounds)]
    place = Placement(layers, bounds, [None] * len(bounds), list(range(len(bounds))), tied)
    run = [(b.index, b.stages, sum(p.numel() for p in params)) for b, params in place.buckets(bucket_bytes)]
    planned = [(b.index, b.stages, n) for b, n, _ in _buckets(profile, bounds, bucket_bytes)]
    assert planned == run
    assert sum(n for *_, n in run) == sum(p.numel() for p in TiedNet().parameters())
