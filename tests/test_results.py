"""Combining what several workers logged into the value one process would have logged."""

from __future__ import annotations

import pytest
import torch

from lightning_hetero.results import LoggedValue, WorkerReport, combine_logs, combine_loss


def report(samples: int, loss: float | None, **logs: tuple) -> WorkerReport:
    items = [LoggedValue(name, value, weight, torch.float64, options) for name, (value, weight, options) in logs.items()]
    return WorkerReport(samples=samples, loss=loss, loss_dtype=torch.float64, logs=items)


def test_loss_is_weighted_by_samples() -> None:
    value, dtype = combine_loss([report(3, 1.0), report(0, None), report(9, 2.0)])
    assert value == pytest.approx((3 * 1.0 + 9 * 2.0) / 12) and dtype == torch.float64


def test_values_combine_the_way_lightning_reduces_them() -> None:
    reports = [
        report(4, 1.0, mean=(1.0, 4, {}), total=(4.0, 4, {"reduce_fx": "sum"}), top=(3.0, 4, {"reduce_fx": "max"})),
        report(0, None),
        report(12, 1.0, mean=(2.0, 12, {}), total=(12.0, 12, {"reduce_fx": "sum"}), top=(5.0, 12, {"reduce_fx": "max"})),
    ]
    combined = {item.name: item for item in combine_logs(reports)}
    assert list(combined) == ["mean", "total", "top"]
    assert combined["mean"].value == pytest.approx(1.75) and combined["mean"].weight == 16
    assert combined["total"].value == 16.0
    assert combined["top"].value == 5.0


def test_batch_size_passed_to_log_is_the_weight() -> None:
    combined = combine_logs([report(4, 1.0, tokens=(1.0, 100, {})), report(4, 1.0, tokens=(3.0, 300, {}))])
    assert combined[0].value == pytest.approx(2.5) and combined[0].weight == 400


def test_different_arguments_on_different_workers_are_an_error() -> None:
    with pytest.raises(ValueError, match="different arguments by different workers"):
        combine_logs([report(1, 1.0, a=(1.0, 1, {"prog_bar": True})), report(1, 1.0, a=(1.0, 1, {}))])
