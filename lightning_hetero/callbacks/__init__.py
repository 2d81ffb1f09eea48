"""Callbacks of a hetero run: the workload analyzer (plan the layout from measurements), the
adaptive rebalancer (keep the CPU fraction right while training) and the utilization monitor
(what every device did)."""

from lightning_hetero.callbacks.analyzer import WorkloadAnalyzer
from lightning_hetero.callbacks.monitor import UtilizationMonitor
from lightning_hetero.rebalancer import AdaptiveRebalancer

__all__ = ["AdaptiveRebalancer", "UtilizationMonitor", "WorkloadAnalyzer"]
