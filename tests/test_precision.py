"""HeteroPrecision: whatever precision Lightning chose, as the hetero plugin of the same kind (so its
casts and autocast are Lightning's own), clipping through the run's gradient sync; float16 mixed
precision refused with the reason."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

from lightning_hetero import HeteroStrategy
from lightning_hetero.precision import HeteroPrecision


@pytest.mark.parametrize(
    "precision,kind,dtype",
    [
        ("32-true", Precision, torch.float32),
        ("64-true", DoublePrecision, torch.float64),
        ("bf16-true", HalfPrecision, torch.bfloat16),
        ("16-true", HalfPrecision, torch.float16),
        ("bf16-mixed", MixedPrecision, torch.float32),
    ],
)
def test_the_trainers_precision_becomes_the_hetero_plugin_of_its_kind(precision: str, kind: type, dtype: torch.dtype) -> None:
    trainer = L.Trainer(strategy=HeteroStrategy(stages=["cpu"]), precision=precision, logger=False)  # type: ignore[arg-type]
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, HeteroPrecision) and isinstance(plugin, kind) and plugin.precision == precision
    assert plugin.convert_module(torch.nn.Linear(2, 2)).weight.dtype == dtype


def test_float16_mixed_precision_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="float16 mixed precision needs a loss scale agreed between all workers"):
        L.Trainer(strategy="hetero", precision="16-mixed", accelerator="hetero")


def test_autocast_follows_each_process_device() -> None:
    plugin = HeteroPrecision.of(MixedPrecision("bf16-mixed", device="cuda"))
    plugin.use_device(torch.device("cpu"))
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu")


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def clip_by_norm(self, params: Any, max_norm: float) -> None:
        self.calls.append(("norm", max_norm))

    def clip_by_value(self, params: Any, value: float) -> None:
        self.calls.append(("value", value))


def test_clipping_goes_through_the_runs_gradient_sync() -> None:
    plugin = HeteroPrecision.of(DoublePrecision())
    plugin.sync = clipping = Recorder()  # type: ignore[assignment]
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    plugin.clip_gradients(optimizer, 0.5, "norm")  # type: ignore[arg-type]
    plugin.clip_gradients(optimizer, 0.25, "value")  # type: ignore[arg-type]
    assert clipping.calls == [("norm", 0.5), ("value", 0.25)]


class RecordsAutocastInBackward(torch.nn.Module):
    """Passes its input through, writing whether autocast is on when the backward reaches it, from the
    second step on (the first has torch's pipelining run a trial backward to learn its shapes)."""

    def __init__(self, out: Any) -> None:
        super().__init__()
        self.out = out
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and self.armed:
            x.register_hook(self._note)
        return x

    def _note(self, grad: torch.Tensor) -> None:
        with open(self.out / f"{os.getpid()}.txt", "a") as f:
            f.write("on" if torch.is_autocast_enabled("cpu") else "off")


class ArmFromTheSecondStep(L.Callback):
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        pl_module.layers[5].armed = trainer.global_step >= 1


@pytest.mark.parametrize("parallelism", ["pipeline", "replicas"])
def test_the_backward_runs_outside_autocast_as_lightnings_does(tmp_path: Any, parallelism: str) -> None:
    """bf16-mixed autocasts the forward; Lightning runs the backward outside it (a layer the model
    keeps in float32 with autocast off would otherwise have its backward recomputed in bf16)."""
    from tests.conftest import hetero, trainer
    from tests.models import Net, regression_data

    for name, strategy in (("plain", None), ("hetero", hetero(cpu_fraction=0.5, parallelism=parallelism))):
        out = tmp_path / name
        out.mkdir()
        model = Net()
        model.layers[5] = RecordsAutocastInBackward(out)
        trainer(strategy, max_steps=3, precision="bf16-mixed", callbacks=[ArmFromTheSecondStep()]).fit(model, regression_data())
        seen = "".join(p.read_text() for p in out.glob("*.txt"))
        assert seen and "on" not in seen.replace("off", ""), (name, seen)


class KeepsANormInFloat32(L.LightningModule):
    """A model that keeps a layer (and a buffer) in float32 under `bf16-true`, cast once the precision
    has converted it, as a plain run leaves them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.register_buffer("scale", torch.ones(6))

    def on_train_start(self) -> None:
        self.norm.float()
        self.scale = self.scale.float()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = self.norm(self.inner(x).float()) * self.scale
        return torch.nn.functional.mse_loss(hidden[:, :3], y.float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_layer_kept_in_float32_comes_back_to_the_main_process_in_float32() -> None:
    """fork and spawn hand the trained weights back to the calling process's model: each in the dtype
    it trained in, as a plain run leaves it, not rounded into the precision's converted copy."""
    from tests.conftest import hetero, max_param_diff, trainer
    from tests.models import regression_data

    models = {}
    for name, strategy in (("plain", None), ("hetero", hetero(cpu_fraction=0.5, parallelism="replicas", stages=["cpu"]))):
        models[name] = KeepsANormInFloat32()
        trainer(strategy, max_steps=3, precision="bf16-true").fit(models[name], regression_data())
    plain, hetero_ = (dict(m.state_dict()) for m in models.values())
    assert {k: v.dtype for k, v in hetero_.items()} == {k: v.dtype for k, v in plain.items()}
    assert plain["norm.weight"].dtype == torch.float32 and plain["inner.weight"].dtype == torch.bfloat16
    assert max_param_diff(models["plain"], models["hetero"]) < 4e-3  # bf16's rounding of the shares' gradients
