"""A ``ModelCheckpoint`` or ``EarlyStopping`` monitoring a value that only some processes logged.

A value logged outside the step methods (``on_train_epoch_end``, ``on_validation_epoch_end``) is
each process's own, from what its step methods saw, and the step methods do not run on a
pipeline's stages before the last, nor on a CPU worker without a share of the batches
(``cpu_fraction=0``). Where only some processes logged the monitored value, their checkpoint
callbacks save, a collective, while the others' skip it: the first would wait for the run's
timeout (or stop with Lightning's "could not find the monitored key", on the others). Early stopping
alike: its decision is a collective that only the processes with the value reach. So before a
``ModelCheckpoint`` with a ``monitor`` may save, and before ``EarlyStopping`` decides, every process
says whether it has the value, and where some do and some do not, every process stops at once with
an error that says why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

__all__ = ["guard_monitored_values"]

_HOOKS = ("on_train_epoch_end", "on_validation_end")
"""Where a ``ModelCheckpoint`` saves on its monitor, and ``EarlyStopping`` decides."""


def guard_monitored_values(
    callbacks: Sequence[Any], gather: Callable[[Any], list[Any]], names: Callable[[int], str]
) -> Callable[[], None]:
    """Put the check before the saving hooks of every ``ModelCheckpoint`` with a monitor and the
    deciding hooks of every ``EarlyStopping`` (on this process's callbacks; every process does the
    same, so each check is a collective they all reach). ``gather``: every global rank's object;
    ``names``: a global rank, for the message. Returns what takes the checks away again."""
    guarded = []
    for callback in callbacks:
        if not isinstance(callback, (ModelCheckpoint, EarlyStopping)) or callback.monitor is None:
            continue
        for hook in _HOOKS:
            setattr(callback, hook, _checked(callback, getattr(callback, hook), gather, names))
            guarded.append((callback, hook))

    def remove() -> None:
        for callback, hook in guarded:
            if hook in vars(callback):
                delattr(callback, hook)

    return remove


def _checked(callback: ModelCheckpoint | EarlyStopping, hook: Callable[..., Any], gather: Callable[[Any], list[Any]], names: Callable[[int], str]) -> Callable[..., Any]:
    def checked(trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> Any:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            has = gather(callback.monitor in trainer.callback_metrics)
            if any(has) and not all(has):
                checkpoint = isinstance(callback, ModelCheckpoint)
                what, which = ("checkpoint callbacks", "save") if checkpoint else ("early stopping", "decision")
                missing = [names(rank) for rank, logged in enumerate(has) if not logged]
                raise RuntimeError(
                    f"`{type(callback).__name__}(monitor={callback.monitor!r})`: {callback.monitor!r} was logged on"
                    f" {sum(has)} of {len(has)} processes, not on {', '.join(missing)}, so their {what} would skip the"
                    f" {which} the others wait on. A value logged outside the step methods (in `on_train_epoch_end` or"
                    " `on_validation_epoch_end`) is each process's own, from what its step methods saw, and they do"
                    " not run on a pipeline's stages before the last, nor on a CPU worker without a share"
                    " (`cpu_fraction=0`). Log it from the step methods (`self.log(..., on_epoch=True)` is combined"
                    " over the workers, as for one process), or from a torchmetrics metric they update (its"
                    " `compute()` gathers every process's state)."
                )
        return hook(trainer, pl_module, *args, **kwargs)

    return checked
