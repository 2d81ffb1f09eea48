"""``HeteroPrecision``: the precision plugin of a hetero run.

Lightning's precision plugins clip a process's own gradients. In a hetero run a stage holds only
its slice of the model, so clipping by norm needs the norm over every stage (a collective), and in
fine mode every bucket has been clipped and stepped during the backward already: the run's
gradient sync knows both (``sync.py``), and this plugin clips through it. After Lightning's
``on_before_optimizer_step`` hooks and the clipping it hands the gradients to the sync once more
(``before_update``), which may drop those this rank does not step (``sharding.py``). As ``FSDPStrategy`` has
``FSDPPrecision``, the strategy turns whatever precision Lightning chose into this plugin, of the
same kind: Lightning's double, half and mixed plugins still do the casts and the autocast, so code
that looks at the plugin's type (``ThroughputMonitor``) sees what it expects.

float16 mixed precision (``"16-mixed"``) is refused: its loss scale would have to be agreed
between all workers every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Optional, Protocol, Union

import torch
from lightning.fabric.utilities.types import Steppable
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["HeteroPrecision", "StepSync"]

SUPPORTED = ("32-true", "64-true", "bf16-mixed", "bf16-true", "16-true")


class StepSync(Protocol):
    """What clips a hetero run's gradients and readies them for the update (its gradient sync)."""

    def clip_by_norm(self, params: Sequence[Tensor], max_norm: float) -> None: ...

    def clip_by_value(self, params: Sequence[Tensor], value: float) -> None: ...

    def before_update(self, optimizer: Optimizer) -> None: ...


class HeteroPrecision(Precision):
    """Lightning's precision plugin of the same kind, clipping through the run's gradient sync.

    Make one with ``HeteroPrecision.of(plugin)``; ``HeteroPrecision()`` is ``"32-true"``.
    """

    sync: Optional[StepSync] = None
    """The run's gradient sync, once the strategy has built it."""

    @staticmethod
    def of(plugin: Precision) -> HeteroPrecision:
        """The hetero plugin for Lightning's ``plugin`` (itself if it is one already)."""
        if isinstance(plugin, HeteroPrecision):
            return plugin
        precision = getattr(plugin, "precision", type(plugin).__name__)
        if type(plugin) not in _KINDS:
            raise ValueError(
                f"The hetero strategy runs precision plugins of its own, one for each of Lightning's"
                f" ({', '.join(k.__name__ for k in _KINDS)}), and `{type(plugin).__name__}` is none of them: what it"
                f" changes would be lost. Pass `Trainer(precision=...)` one of {', '.join(map(repr, SUPPORTED))} instead."
            )
        if precision not in SUPPORTED:
            raise ValueError(
                f"The hetero strategy does not support {precision!r} precision: float16 mixed precision needs a"
                f" loss scale agreed between all workers. Use {', '.join(map(repr, SUPPORTED))}."
            )
        return _KINDS[type(plugin)](precision)

    def use_device(self, device: torch.device) -> None:
        """Compute on ``device``: each process of a hetero run has its own (autocast follows it)."""

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        if self.sync is None:
            return super().clip_grad_by_norm(optimizer, clip_val)
        self.sync.clip_by_norm(_params(optimizer), float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        if self.sync is None:
            return super().clip_grad_by_value(optimizer, clip_val)
        self.sync.clip_by_value(_params(optimizer), float(clip_val))

    @override
    def _after_closure(self, model: pl.LightningModule, optimizer: Steppable) -> None:
        # Lightning's hooks and clipping see every gradient; then the sync may drop those this rank
        # does not step (a CPU worker's share of a split optimizer, `sharding.py`).
        super()._after_closure(model, optimizer)
        if self.sync is not None and isinstance(optimizer, Optimizer):
            self.sync.before_update(optimizer)


class _Double(HeteroPrecision, DoublePrecision):
    pass


class _Half(HeteroPrecision, HalfPrecision):
    pass


class _Mixed(HeteroPrecision, MixedPrecision):
    def __init__(self, precision: str) -> None:
        MixedPrecision.__init__(self, precision, device="cpu")  # type: ignore[arg-type]

    @override
    def use_device(self, device: torch.device) -> None:
        # Lightning picks one autocast device for the run; each hetero process computes on its own.
        self.device = device.type


_KINDS: dict[type, Callable[[str], HeteroPrecision]] = {
    Precision: lambda _: HeteroPrecision(),
    DoublePrecision: lambda _: _Double(),
    HalfPrecision: _Half,
    MixedPrecision: _Mixed,
}


def _params(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
