"""Callbacks of a hetero run: the workload analyzer (plan the layout from measurements) and the
adaptive rebalancer (keep the CPU fraction right while training)."""

from lightning_hetero.callbacks.analyzer import WorkloadAnalyzer
from lightning_hetero.callbacks.rebalancer import AdaptiveRebalancer

__all__ = ["AdaptiveRebalancer", "WorkloadAnalyzer"]
