"""Callbacks of a hetero run: the workload analyzer (plan the layout from measurements), the
adaptive rebalancer (keep the CPU fraction right while training), the mix rebalancer (re-place a
multimodal model's encoders as the mix of modalities changes) and the utilization monitor (what
every device did)."""

from lightning_hetero.callbacks.analyzer import WorkloadAnalyzer
from lightning_hetero.callbacks.mix import MixRebalancer
from lightning_hetero.callbacks.monitor import UtilizationMonitor
from lightning_hetero.rebalancer import AdaptiveRebalancer

__all__ = ["AdaptiveRebalancer", "MixRebalancer", "UtilizationMonitor", "WorkloadAnalyzer"]
