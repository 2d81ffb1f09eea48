"""lightning-hetero: train one Lightning model on the idle CPU and the GPUs at the same time.

Importing the package registers ``strategy="hetero"`` and ``accelerator="hetero"`` with Lightning.
"""

from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry

from lightning_hetero.accelerator import HeteroAccelerator
from lightning_hetero.module import PipelineModule
from lightning_hetero.multimodal import MultimodalModule
from lightning_hetero.plan import HeteroPlan
from lightning_hetero.strategy import HeteroStrategy

__all__ = ["HeteroAccelerator", "HeteroPlan", "HeteroStrategy", "MultimodalModule", "PipelineModule"]
__version__ = "0.1.0"

if HeteroStrategy.strategy_name not in StrategyRegistry:
    HeteroStrategy.register_strategies(StrategyRegistry)
if HeteroAccelerator.name() not in AcceleratorRegistry:
    HeteroAccelerator.register_accelerators(AcceleratorRegistry)
