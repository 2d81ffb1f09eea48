"""Callbacks of a hetero run: the workload analyzer (plan the layout from measurements)."""

from lightning_hetero.callbacks.analyzer import WorkloadAnalyzer

__all__ = ["WorkloadAnalyzer"]
