"""HeteroPrecision: whatever precision Lightning chose, as the hetero plugin of the same kind (so its
casts and autocast are Lightning's own), clipping through the run's gradient sync; float16 mixed
precision refused with the reason."""

from __future__ import annotations

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
