"""Train an MLP on handwritten digits with `Trainer(strategy="hetero")`.

The CPU worker and a two-stage pipeline (emulated on CPU processes where there is no GPU) each
compute their share of every batch. The data is scikit-learn's bundled digits (no download);
metrics go to wandb in offline mode under ./outputs.

    python examples/digits.py [--max-epochs N] [--cpu-fraction F]
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split
from torchmetrics.classification import MulticlassAccuracy

from lightning_hetero import HeteroStrategy, PipelineModule


class DigitsMLP(PipelineModule, L.LightningModule):
    """A multilayer perceptron written as an ordered list of blocks (the hetero model contract)."""

    def __init__(self, hidden: int = 128, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layers = nn.ModuleList(
            [nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)]
        )
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, targets = batch
        logits = self(inputs)
        self.val_acc(logits, targets)
        self.log("val_loss", self.pipeline_loss(logits, targets), prog_bar=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def digits_loaders(batch_size: int = 100) -> tuple[DataLoader, DataLoader]:
    digits = load_digits()
    inputs = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    data = TensorDataset(inputs, torch.tensor(digits.target))
    train, val = random_split(data, [1497, 300], generator=torch.Generator().manual_seed(0))
    return DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(val, batch_size=batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-epochs", type=int, default=20)
    parser.add_argument("--cpu-fraction", type=float, default=0.3)
    args = parser.parse_args()
    L.seed_everything(0)
    train, val = digits_loaders()
    trainer = L.Trainer(
        strategy=HeteroStrategy(stages="auto", cpu_fraction=args.cpu_fraction, micro_batches=2),
        max_epochs=args.max_epochs,
        logger=WandbLogger(project="lightning-hetero", save_dir="outputs", offline=True),
        default_root_dir="outputs",
    )
    trainer.fit(DigitsMLP(), train, val)
    if trainer.is_global_zero:
        print(f"validation accuracy: {trainer.callback_metrics['val_acc']:.3f}")


if __name__ == "__main__":
    main()
