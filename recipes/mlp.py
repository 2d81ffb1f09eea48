"""A multilayer perceptron on handwritten digits, trained with ``strategy="hetero"``.

The model of the original experiments: an MLP trained with Adam (learning rate 0.001) on
mini-batches of 100. By default the data is scikit-learn's bundled 8x8 digits (1797 images, no
download); point ``data_dir`` at a directory with the MNIST IDX files
(``train-images-idx3-ubyte[.gz]``, ``train-labels-idx1-ubyte[.gz]``, ``t10k-...``) to train on
MNIST (then ``in_features: 784``). ``augment: true`` makes the training images new on every read:
each is resampled to ``image_size`` pixels a side under a random rotation, shift and scale, with
noise (``configs/mlp_augmented.yaml``: real preprocessing work for the DataLoader).

    python -m recipes.mlp fit --config configs/mlp.yaml
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset, random_split
from torchmetrics.classification import MulticlassAccuracy

from lightning_hetero import PipelineModule
from lightning_hetero.cli import HeteroCLI
from recipes.data import EpochShuffle, read_idx

__all__ = ["DigitsMLP", "DigitsData", "AugmentedImages"]


class DigitsMLP(PipelineModule, L.LightningModule):
    """An MLP as an ordered list of blocks (Linear, ReLU, ..., Linear), the hetero model contract.

    Args:
        in_features: pixels per image (64 for scikit-learn's digits, 784 for MNIST).
        hidden: the widths of the hidden layers.
        classes: the number of classes.
        lr: Adam's learning rate.
    """

    def __init__(self, in_features: int = 64, hidden: tuple[int, ...] = (128, 128), classes: int = 10, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        widths = [in_features, *hidden]
        blocks: list[nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            blocks += [nn.Linear(a, b), nn.ReLU()]
        blocks.append(nn.Linear(widths[-1], classes))
        self.layers = nn.ModuleList(blocks)
        self.train_acc = MulticlassAccuracy(num_classes=classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=classes, average="micro")

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        logits = self(inputs)
        loss = self.pipeline_loss(logits, targets)
        self.train_acc(logits, targets)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_acc)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_acc)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Each image's most likely digit."""
        inputs, _ = batch
        return self(inputs).argmax(-1)

    def _evaluate(self, batch: Any, stage: str, accuracy: MulticlassAccuracy) -> None:
        inputs, targets = batch
        logits = self(inputs)
        accuracy(logits, targets)
        self.log(f"{stage}_loss", self.pipeline_loss(logits, targets), prog_bar=True)
        self.log(f"{stage}_acc", accuracy, prog_bar=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class AugmentedImages(Dataset):
    """Images under a random affine transform and noise, resampled to ``size`` pixels a side and
    flattened: real preprocessing for a DataLoader's workers.

    The randomness of sample ``i`` comes from its own generator, seeded from ``seed`` and ``i``, so
    every process of a hetero run and a single-device run see the same images whatever process
    loads them. ``passes``: the transform is applied that many times (a heavier augmentation
    phase, as the loading benchmark sets halfway through a run).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, size: int, seed: int = 0, passes: int = 1) -> None:
        self.images, self.labels, self.size, self.seed, self.passes = images, labels, size, seed, passes

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + int(index))
        image = self.images[index].reshape(1, 1, *self.images.shape[-2:]).float()
        for _ in range(self.passes):
            angle, shift, scale = (torch.rand(4, generator=generator) * 2 - 1).split([1, 2, 1])
            angle, scale = angle * math.pi / 12, 1 + 0.1 * scale
            cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
            theta = torch.stack([torch.cat([cos, -sin, shift[:1] * 0.15]), torch.cat([sin, cos, shift[1:] * 0.15])])
            grid = nn.functional.affine_grid(theta.unsqueeze(0), [1, 1, self.size, self.size], align_corners=False)
            out = nn.functional.grid_sample(image, grid, align_corners=False)
        noisy = out + 0.05 * torch.randn(out.shape, generator=generator)
        return noisy.reshape(-1), self.labels[index]


class DigitsData(L.LightningDataModule):
    """Handwritten digits: scikit-learn's bundled 8x8 images, or MNIST from IDX files.

    Args:
        data_dir: a directory with the four MNIST IDX files; ``None`` uses scikit-learn's digits.
        batch_size: samples per training batch (the whole batch, which the strategy splits).
        val_size: images held out for validation (scikit-learn's digits; MNIST uses its test set).
        num_workers: DataLoader worker processes (0, the default, lets ``strategy="hetero"`` choose
            them with the cores: its ``dataloader_workers``).
        seed: the seed of the train/validation split, of the shuffling and of the augmentation.
        augment: transform every training image anew on every read (``AugmentedImages``); the
            validation images are resampled to the same size without it.
        image_size: the side, in pixels, of the images the model sees when augmenting (then
            ``in_features`` is its square).
    """

    def __init__(
        self,
        data_dir: Optional[str] = None,
        batch_size: int = 100,
        val_size: int = 300,
        num_workers: int = 0,
        seed: int = 0,
        augment: bool = False,
        image_size: int = 8,
    ) -> None:
        super().__init__()
        self.data_dir, self.batch_size, self.val_size = data_dir, batch_size, val_size
        self.num_workers, self.seed, self.augment, self.image_size = num_workers, seed, augment, image_size

    def setup(self, stage: str) -> None:
        if self.data_dir is None:
            from sklearn.datasets import load_digits

            digits = load_digits()
            data = TensorDataset(torch.tensor(digits.data, dtype=torch.float32) / 16.0, torch.tensor(digits.target))
            split = [len(data) - self.val_size, self.val_size]
            self.train, self.val = random_split(data, split, generator=torch.Generator().manual_seed(self.seed))
        else:
            self.train = self._mnist("train")
            self.val = self._mnist("t10k")
        if self.augment:
            self.train, self.val = self._augmented(self.train, True), self._augmented(self.val, False)

    def _augmented(self, data: Any, augment: bool) -> Dataset:
        images, labels = torch.stack([data[i][0] for i in range(len(data))]), torch.stack([data[i][1] for i in range(len(data))])
        side = math.isqrt(images.shape[-1])
        images = images.reshape(len(images), side, side)
        if augment:
            return AugmentedImages(images, labels, self.image_size, self.seed)
        resized = nn.functional.interpolate(images.unsqueeze(1), size=self.image_size, mode="bilinear", align_corners=False)
        return TensorDataset(resized.reshape(len(images), -1), labels)

    def _mnist(self, prefix: str) -> TensorDataset:
        directory = Path(self.data_dir or ".")

        def find(name: str) -> Path:
            for candidate in (directory / name, directory / f"{name}.gz"):
                if candidate.exists():
                    return candidate
            raise FileNotFoundError(f"`data_dir={self.data_dir}` has no {name} (or {name}.gz): download MNIST's IDX files there.")

        images = read_idx(find(f"{prefix}-images-idx3-ubyte"))
        labels = read_idx(find(f"{prefix}-labels-idx1-ubyte"))
        return TensorDataset(images.reshape(len(images), -1).float() / 255.0, labels.long())

    def train_dataloader(self) -> DataLoader:
        # Every process of a hetero run, a single-device run, and a resumed run shuffle alike.
        sampler = EpochShuffle(len(self.train), self.seed)
        return DataLoader(self.train, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        """The held-out images (``validate``'s): ``python -m recipes.mlp test --ckpt_path ...``."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """The held-out images, whose digits ``python -m recipes.mlp predict --ckpt_path ...`` predicts."""
        return self.val_dataloader()


def main(args: Any = None) -> None:
    HeteroCLI(DigitsMLP, DigitsData, args=args)


if __name__ == "__main__":
    main()
