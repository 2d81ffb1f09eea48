"""Fine mode: gradient sync and optimizer steps bucket by bucket during the backward, optionally on
the CPU, train the same model as coarse mode and as one process (float64, 1e-10)."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hetero import HeteroStrategy
from lightning_hetero.offload import OffloadStep
from tests.conftest import RecordCopies, assert_copies_identical, hetero, max_param_diff, trainer
from lightning_hetero.offload import DeviceStep
from tests.models import FinetunedNet, Net, OddNet, regression_data

TOL = 1e-10
# A bucket per layer with parameters: on one or two stages, Net's three Linear layers (4, 2 and 0,
# with the parameter-free layers above them) are buckets 0, 1 and 2. On three stages the middle
# stage begins with a Tanh, which makes a parameter-free bucket of its own (4 buckets).
TINY_BUCKETS = 1e-5


def fine(**kwargs: Any) -> HeteroStrategy:
    kwargs.setdefault("bucket_size_mb", TINY_BUCKETS)
    return hetero(mode="fine", **kwargs)


def fit(strategy: Any, optimizer: str = "adamw", callbacks: list | None = None, **kwargs: Any) -> Net:
    model = Net(optimizer=optimizer)
    kwargs.setdefault("max_steps", 8)
    trainer(strategy, callbacks=callbacks or [], **kwargs).fit(model, regression_data())
    return model


@pytest.fixture(scope="module")
def plain() -> Net:
    return fit(None)


@pytest.mark.parametrize("offload", ["none", "all", [0, 2]], ids=["none", "all", "mixed"])
@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("cpu_fraction", [0.0, 0.5, 1.0])
def test_matches_single_process(tmp_path: Path, plain: Net, offload: Any, num_stages: int, cpu_fraction: float) -> None:
    strategy = fine(stages=["cpu"] * num_stages, cpu_fraction=cpu_fraction, offload=offload)
    model = fit(strategy, callbacks=[RecordCopies(tmp_path)])
    assert_copies_identical(tmp_path)
    assert max_param_diff(plain, model) < TOL


def test_matches_coarse_mode() -> None:
    coarse = fit(hetero(stages=["cpu"] * 3, cpu_fraction=0.4, micro_batches=3, schedule="1F1B"))
    het = fit(fine(stages=["cpu"] * 3, cpu_fraction=0.4, micro_batches=3, schedule="1F1B", offload=[1, 3]))
    assert max_param_diff(coarse, het) < TOL


@pytest.mark.parametrize(
    "trainer_kwargs",
    [
        {"accumulate_grad_batches": 2},
        {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"},
        {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
        {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
    ],
    ids=["accumulate-2", "clip-norm", "clip-value", "accumulate-and-clip"],
)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_trainer_features_match(tmp_path: Path, trainer_kwargs: dict, optimizer: str) -> None:
    reference = fit(None, optimizer, **trainer_kwargs)
    strategy = fine(stages=["cpu"] * 2, cpu_fraction=0.5, offload=[0, 2])
    model = fit(strategy, optimizer, callbacks=[RecordCopies(tmp_path)], **trainer_kwargs)
    assert_copies_identical(tmp_path)
    assert max_param_diff(reference, model) < TOL


@pytest.mark.parametrize(
    "parallelism, clip, cpu_workers",
    [("pipeline", None, 1), ("replicas", None, 1), ("pipeline", 0.05, 1), ("pipeline", None, 2), ("replicas", None, 2)],
    ids=["pipeline", "replicas", "pipeline-clipped", "pipeline-sharded", "replicas-sharded"],
)
def test_optimizer_state_made_under_the_dtype_one_process_steps_under(
    tmp_path: Path, parallelism: str, clip: float | None, cpu_workers: int
) -> None:
    """Under `64-true` the backward (where fine mode steps) runs with float64 as torch's default
    dtype, and one process's optimizer steps without it: the first step of each bucket comes after
    the backward, so NAdam's step count and `mu_product` are float32 as there (in float64 its
    weights drifted 4e-10 from one process's in 8 steps). Two CPU workers split the offloaded
    buckets' state (a sharded step is a collective): the whole first step comes after the backward."""
    clipping = {"gradient_clip_val": clip, "gradient_clip_algorithm": "norm"} if clip else {}
    reference = fit(None, "nadam", **clipping)
    strategy = fine(cpu_fraction=0.5, offload="all" if cpu_workers > 1 else [0], parallelism=parallelism, cpu_workers=cpu_workers)
    checkpoint = tmp_path / "last.ckpt"
    model = fit(strategy, "nadam", callbacks=[SaveAtEnd(checkpoint)], **clipping)
    assert max_param_diff(reference, model) < TOL
    states = torch.load(checkpoint, weights_only=False)["optimizer_states"][0]["state"]
    assert {(k, v.dtype) for s in states.values() for k, v in s.items() if v.dim() == 0} == {("step", torch.float32), ("mu_product", torch.float32)}


class SaveAtEnd(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("mode", ["coarse", "fine"])
def test_an_optimizer_that_makes_its_state_in_its_constructor(mode: str) -> None:
    """Adagrad makes its sums for every parameter when it is built, the other stages' (meta) layers
    included: each stage keeps its own layers' (it used to fail copying the others' to its device)."""
    strategy = fine(cpu_fraction=0.5, offload="all") if mode == "fine" else hetero(cpu_fraction=0.5)
    assert max_param_diff(fit(None, "adagrad"), fit(strategy, "adagrad")) < TOL


class ScaledSGD(torch.optim.SGD):
    """An optimizer whose constructor takes an argument its `defaults` do not keep."""

    def __init__(self, params: Any, scale: float, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr * scale, momentum=0.9)


class ScaledNet(Net):
    def configure_optimizers(self) -> Any:
        return ScaledSGD(self.parameters(), scale=0.5)


@pytest.mark.parametrize("offload", ["none", "all"])
def test_an_optimizer_class_of_the_users_own(offload: str) -> None:
    """Each bucket steps with an optimizer of the user's class: where its constructor needs more
    than its defaults, a copy of the user's optimizer over the bucket's parameters."""
    models = [ScaledNet(), ScaledNet()]
    for model, strategy in zip(models, (None, fine(cpu_fraction=0.5, offload=offload))):
        trainer(strategy, max_steps=6).fit(model, regression_data())
    assert max_param_diff(*models) < TOL


def test_clipping_by_norm_with_the_cpu_worker_kept_out() -> None:
    """At fraction 0 the CPU worker sits out the sum, but it joins the global norm the stages need
    before they step (it once waited elsewhere, and the run hung until the timeout)."""
    clip = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}
    assert max_param_diff(fit(None, "sgd", **clip), fit(fine(cpu_fraction=0.0), "sgd", **clip)) < TOL


@pytest.fixture
def separate_masters(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every offloaded bucket keeps masters of its own, as a GPU stage's does (on the CPU a float64
    weight is its own master); inherited by the forked ranks."""
    master = OffloadStep._master
    monkeypatch.setattr(OffloadStep, "_master", staticmethod(lambda param, pin, host_copies: master(param, pin, True)))


@pytest.mark.parametrize(
    "clip",
    [{"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}, {"gradient_clip_val": 0.005, "gradient_clip_algorithm": "value"}],
    ids=["norm", "value"],
)
@pytest.mark.parametrize(
    "layout", [{"stages": ["cpu"], "cpu_fraction": 0.0}, {"stages": ["cpu", "cpu"], "cpu_workers": 0}], ids=["fraction-0", "no-cpu-worker"]
)
def test_offloaded_gradients_summed_with_none_are_clipped(separate_masters: None, clip: dict, layout: dict) -> None:
    """A bucket's gradient that no CPU worker's share was summed with stays on its weight until the
    step moves it to the master: it is clipped there, and counts toward the global norm."""
    reference = fit(None, "sgd", **clip)
    assert max_param_diff(reference, fit(fine(offload="all", **layout), "sgd", **clip)) < TOL


class EditsWeights(L.Callback):
    """Sets weights in place between steps, the same on every rank, as a hook of the user's may: a
    value before training, a layer reset after step 3, a constraint after every later step (a
    layer a stage does not hold is on the meta device there, where each edit does nothing)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with torch.no_grad():
            pl_module.layers[0].bias.fill_(0.05)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            if batch_idx == 3:
                pl_module.layers[2].weight.zero_()
            elif batch_idx > 3:
                for p in pl_module.parameters():
                    p.clamp_(-0.2, 0.2)


@pytest.mark.parametrize(
    "layout",
    [{"cpu_fraction": 0.5}, {"stages": ["cpu"], "cpu_fraction": 0.0}, {"cpu_workers": 2, "cpu_fraction": 0.5}],
    ids=["pipeline", "fraction-0", "split-between-cpu-workers"],
)
def test_weights_set_between_steps_are_what_offloaded_buckets_step_from(separate_masters: None, layout: dict) -> None:
    """An offloaded bucket's master takes a weight set in place since its last step, as one process
    steps from the weight as set."""
    reference = fit(None, "sgd", callbacks=[EditsWeights()])
    assert max_param_diff(reference, fit(fine(offload="all", **layout), "sgd", callbacks=[EditsWeights()])) < TOL


def test_pipeline_only_with_everything_offloaded(plain: Net) -> None:
    assert max_param_diff(plain, fit(fine(stages=["cpu"] * 3, cpu_workers=0, offload="all"))) < TOL


def test_registered_name() -> None:
    t = L.Trainer(strategy="hetero_fine", logger=False)
    assert isinstance(t.strategy, HeteroStrategy) and t.strategy.mode == "fine"


class RecordOverlap(L.Callback):
    """Each rank writes, per step, how many buckets it handed over while its backward still ran,
    and where the state of every optimizer that holds some lives."""

    def __init__(self, out: Path) -> None:
        self.out, self.early = out, []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.early.append(trainer.strategy.engine.sync.handed_early)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        names = {p: n for n, p in pl_module.named_parameters()}
        user = strategy.optimizers[0]
        offloaded = [names[p] for s in strategy.bucket_steps if isinstance(s, OffloadStep) for p in s.params]
        engine_devices = {
            str(t.device)
            for s in strategy.bucket_steps
            if isinstance(s, OffloadStep)
            for state in s.optimizer.state.values()
            for t in state.values()
        }
        record = {
            "early": self.early,
            "buckets": len(strategy.bucket_steps),
            "offloaded": sorted(offloaded),
            "user_state": sorted(names[p] for p in user.state if user.state[p]),
            "engine_devices": sorted(engine_devices),
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def test_buckets_sync_and_step_during_the_backward_and_offloaded_state_stays_on_the_cpu(tmp_path: Path) -> None:
    strategy = fine(stages=["cpu"] * 2, cpu_fraction=0.5, offload=[0, 2])
    fit(strategy, callbacks=[RecordOverlap(tmp_path)])
    cpu, stage0, stage1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3))
    # Stage 0 holds layers 0-1 (bucket 2), stage 1 layers 2-5 (buckets 1 and 0).
    assert (cpu["buckets"], stage0["buckets"], stage1["buckets"]) == (3, 1, 2)
    # All but possibly the first layers' bucket go while the backward still runs.
    for rank in (cpu, stage0, stage1):
        assert all(early >= rank["buckets"] - 1 for early in rank["early"]), rank["early"]
    assert stage1["offloaded"] == ["layers.4.bias", "layers.4.weight"]
    assert stage0["offloaded"] == ["layers.0.bias", "layers.0.weight"]
    # Memory accounting: no optimizer state of an offloaded bucket in the device-side optimizer.
    assert stage0["user_state"] == [] and stage1["user_state"] == ["layers.2.bias", "layers.2.weight"]
    assert cpu["user_state"] == ["layers.2.bias", "layers.2.weight"]
    assert all(rank["engine_devices"] == ["cpu"] for rank in (cpu, stage0, stage1))


@pytest.mark.parametrize("writer", ["fine", "fine-no-cpu-worker", "plain"])
def test_resume_and_ordinary_checkpoints(tmp_path: Path, writer: str) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    strategies = {
        "fine": fine(cpu_fraction=0.5, offload="all"),
        "fine-no-cpu-worker": fine(cpu_workers=0, offload=[0, 2]),
        "plain": None,
    }
    fit(strategies[writer], "adamw", [checkpoint], max_steps=4, enable_checkpointing=True)
    path = tmp_path / "step=4.ckpt"
    reference = Net().double()
    trainer(None, max_steps=8).fit(reference, regression_data(), ckpt_path=path)
    resumed = Net().double()
    trainer(fine(stages=["cpu"] * 3, cpu_fraction=0.3, offload=[0, 2]), max_steps=8).fit(resumed, regression_data(), ckpt_path=path)
    assert max_param_diff(reference, resumed) < TOL
    if writer != "plain":
        state = torch.load(path, weights_only=False)["optimizer_states"][0]
        assert sorted(state["state"]) == list(range(6))  # every parameter's Adam state, in torch's format
        assert {"step", "exp_avg", "exp_avg_sq"} == set(state["state"][0])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"offload": "all"}, "`offload='all'` offloads fine mode's bucket steps; it needs `mode='fine'`"),
        ({"offload": [1]}, "`offload=[...]` offloads fine mode's bucket steps; it needs `mode='fine'`"),
        ({"mode": "fine", "offload": "some"}, "must be 'auto', 'none', 'all' or a list of bucket indices"),
        ({"mode": "fine", "offload": [-1]}, "or a list of bucket indices (integers >= 0)"),
        ({"mode": "fine", "offload": None}, "`offload=None` must be 'auto', 'none', 'all' or a list of bucket indices"),
        ({"mode": "fine", "offload": 2}, "`offload=2` must be 'auto', 'none', 'all' or a list of bucket indices"),
        ({"mode": "fine", "bucket_size_mb": 0}, "`bucket_size_mb=0` must be a positive number of megabytes"),
    ],
)
def test_bad_arguments(no_processes: None, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        HeteroStrategy(**kwargs)


def test_offloading_a_bucket_that_does_not_exist(no_processes: None) -> None:
    with pytest.raises(ValueError, match=re.escape("names bucket 9, but the model has 3 buckets (0 to 2)")):
        fit(fine(offload=[1, 9]))


class CustomClipping(Net):
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None) -> None:
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


def test_custom_clipping_hook_needs_coarse_mode(no_processes: None) -> None:
    with pytest.raises(ValueError, match="overrides `configure_gradient_clipping`, which fine mode cannot call"):
        trainer(fine(), max_steps=1).fit(CustomClipping(), regression_data())


@pytest.mark.parametrize("mode,offload", [("coarse", "none"), ("fine", "none"), ("fine", "all")])
def test_bf16_mixed_precision(tmp_path: Path, mode: str, offload: str) -> None:
    """bf16 compute (autocast on every worker's own device), float32 weights and optimizer."""
    reference = fit(None, precision="bf16-mixed")
    strategy = hetero(mode=mode, offload=offload, cpu_fraction=0.5, bucket_size_mb=TINY_BUCKETS)
    model = fit(strategy, callbacks=[RecordCopies(tmp_path)], precision="bf16-mixed")
    assert_copies_identical(tmp_path)
    assert next(model.parameters()).dtype == torch.float32
    # Shares round their bf16 products differently from the whole batch: close, not equal.
    assert max_param_diff(reference, model) < 1e-3


class RecordMasters(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps = [s for s in trainer.strategy.bucket_steps if isinstance(s, OffloadStep)]
        pairs = [(p, m) for s in steps for p, m in zip(s.params, s.masters)]
        record = {
            "master_dtypes": sorted({str(m.dtype) for _, m in pairs}),
            "master_devices": sorted({str(m.device) for _, m in pairs}),
            "param_dtypes": sorted({str(p.dtype) for p, _ in pairs}),
            "params_are_rounded_masters": all(torch.equal(p.detach(), m.detach().to(p.dtype)) for p, m in pairs),
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def test_bf16_weights_with_fp32_masters_on_the_cpu(tmp_path: Path) -> None:
    """bf16-true computes and stores the model in bf16; offloaded buckets keep fp32 master weights
    on the CPU and step those, so the bf16 weights are the rounded masters."""
    copies = tmp_path / "copies"
    copies.mkdir()
    strategy = fine(cpu_fraction=0.5, offload="all")
    model = fit(strategy, callbacks=[RecordMasters(tmp_path), RecordCopies(copies)], precision="bf16-true")
    assert_copies_identical(copies)
    assert next(model.parameters()).dtype == torch.bfloat16
    for rank in range(3):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record == {
            "master_dtypes": ["torch.float32"],
            "master_devices": ["cpu"],
            "param_dtypes": ["torch.bfloat16"],
            "params_are_rounded_masters": True,
        }


STEPPED = threading.Event()
GATED = threading.Event()


class Gate(torch.autograd.Function):
    """Identity whose backward, once armed, waits until some bucket has been stepped: it sits in
    front of the first layer, so it runs last in the backward, and returns only if a step
    happened meanwhile."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        STEPPED.clear()
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if GATED.is_set() and not STEPPED.wait(timeout=30):
            raise RuntimeError("no bucket was stepped while the backward was running")
        return grad


class GateLayer(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Gate.apply(x if x.requires_grad else x.requires_grad_())


class GatedStages(Net):
    """`Net` with a gate in front of its layers, on every path (CPU worker and pipeline)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = GateLayer()

    def pipeline_layers(self) -> list:
        return [self.gate, *self.layers]


class ArmGate(L.Callback):
    """From the second step on: a new pipeline layout's first step runs an extra backward to infer
    shapes (torch's PipelineStage), in which no gradient reaches a parameter."""

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step >= 1:
            GATED.set()


def test_buckets_are_stepped_while_the_backward_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic evidence of the overlap: the backward cannot finish until a bucket's step has
    run in the step thread; stepping only after the backward would fail the gate."""
    step = DeviceStep.step

    def step_and_signal(self: DeviceStep) -> None:
        step(self)
        STEPPED.set()

    monkeypatch.setattr(DeviceStep, "step", step_and_signal)  # the forked workers inherit it
    model = GatedStages()
    # One micro-batch: the gate waits in the only (so the last) backward of each step.
    strategy = fine(stages=["cpu"], cpu_fraction=0.5, micro_batches=1)
    trainer(strategy, max_steps=3, callbacks=[ArmGate()]).fit(model, regression_data())
    plain = GatedStages()
    trainer(None, max_steps=3).fit(plain, regression_data())  # not armed in this process
    assert max_param_diff(plain, model) < TOL


@pytest.mark.parametrize("mode", ["coarse", "fine"])
def test_parameters_used_twice_or_never(mode: str) -> None:
    plain = OddNet()
    trainer(None, max_steps=8).fit(plain, regression_data())
    model = OddNet()
    strategy = hetero(mode=mode, stages=["cpu"] * 3, cpu_fraction=0.4, bucket_size_mb=TINY_BUCKETS, micro_batches=3)
    trainer(strategy, max_steps=8).fit(model, regression_data())
    assert max_param_diff(plain, model) < TOL
    assert torch.equal(model.layers[4].spare, torch.ones(3, dtype=model.layers[4].spare.dtype))  # never stepped


class UnfreezeFirstLayer(L.Callback):
    """Lightning's fine-tuning pattern: the first layer starts frozen and outside the optimizer,
    and joins it as a new parameter group in the second epoch. (``BaseFinetuning``'s own
    ``unfreeze_and_add_param_group`` compares parameter values, which the meta copies of other
    stages' layers cannot be compared by; adding the group directly works everywhere.)"""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        pl_module.layers[0].requires_grad_(False)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 1:
            pl_module.layers[0].requires_grad_(True)
            trainer.optimizers[0].add_param_group({"params": list(pl_module.layers[0].parameters()), "lr": 0.05})


@pytest.mark.parametrize("offload", ["none", [2]])
def test_layers_added_to_the_optimizer_while_training(offload: Any) -> None:
    plain = FinetunedNet()
    trainer(None, max_steps=8, callbacks=[UnfreezeFirstLayer()]).fit(plain, regression_data())
    model = FinetunedNet()
    strategy = fine(cpu_fraction=0.5, offload=offload)
    trainer(strategy, max_steps=8, callbacks=[UnfreezeFirstLayer()]).fit(model, regression_data())
    assert max_param_diff(plain, model) < TOL
    assert not torch.equal(plain.layers[0].weight, Net().layers[0].weight.double())  # it did train


class PlainSGDNet(Net):
    """An optimizer that keeps no state: only the masters hold what bf16 weights round away."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("model_class", [Net, PlainSGDNet], ids=["adam", "sgd-without-state"])
def test_bf16_resume_keeps_the_fp32_masters(tmp_path: Path, model_class: type[Net]) -> None:
    def run(steps: int, ckpt: Path | None = None, callbacks: list | None = None) -> Net:
        model = model_class().bfloat16()
        t = trainer(fine(cpu_fraction=0.5, offload="all"), max_steps=steps, precision="bf16-true",
                    callbacks=callbacks or [], enable_checkpointing=bool(callbacks))
        t.fit(model, regression_data(), ckpt_path=ckpt)
        return model

    straight = run(8)
    run(4, callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=4)])
    resumed = run(8, ckpt=tmp_path / "step=4.ckpt")
    assert max_param_diff(straight, resumed) == 0
