"""A multimodal classifier of handwritten digits from images and captions, with ``strategy="hetero"``.

Each sample may carry an image (an 8x8 digit), a caption ("a seven written by hand"), or both; an
image encoder (a small CNN) and a text encoder (word embeddings averaged, projected) each encode
their modality, their outputs are summed into one vector per sample, and an MLP backbone
classifies it. The model names its encoders by modality (``MultimodalModule``), so the strategy
can place each where it runs best (``encoders=``), the workload analyzer can choose that, and
``MixRebalancer`` can move them as the mix of modalities changes.

By default the data is scikit-learn's bundled digits (no download) with captions generated from
their labels (some of them wrong, so neither modality alone is perfect), and the mix changes
within every epoch: ``phases`` gives, for each part of the epoch in order, the share of samples
carrying an image and the share carrying a caption (the default: images first, captions after).
Point ``manifest`` at a JSON-lines file of your own samples instead, one per line:
``{"image": "path/to/image.png", "text": "a caption", "label": 3}`` (either ``image`` or ``text``
may be missing; image paths are relative to the manifest; any format Pillow reads, made grayscale
and resized to ``image_size``).

    python -m recipes.multimodal fit --config configs/multimodal.yaml
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_hetero import MultimodalModule
from lightning_hetero.cli import HeteroCLI

__all__ = ["DigitCaptioner", "CaptionedDigits", "WordTokenizer", "captions_for", "ModalitySamples"]

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
TEMPLATES = ("a handwritten {}", "the digit {}", "{} written by hand", "someone wrote a {}", "a {} in ink")


class DigitCaptioner(MultimodalModule, L.LightningModule):
    """Two encoders, fused by a sum, and an MLP backbone.

    Args:
        vocab_size: words of the captions' vocabulary (the data module's tokenizer says).
        image_size: pixels per side of the images.
        width: the encoders' output width, the backbone's input.
        hidden: the backbone's hidden width.
        channels: the image encoder's convolution channels.
        classes: the number of classes.
        lr: Adam's learning rate.
    """

    def __init__(
        self,
        vocab_size: int = 64,
        image_size: int = 8,
        width: int = 64,
        hidden: int = 128,
        channels: int = 16,
        classes: int = 10,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        pooled = image_size // 2
        self.image = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(channels * pooled * pooled, width),
        )
        self.text = TextEncoder(vocab_size, width)
        self.backbone = nn.Sequential(nn.ReLU(), nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, classes))
        self.train_acc = MulticlassAccuracy(num_classes=classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=classes, average="micro")

    def modality_encoders(self) -> dict[str, nn.Module]:
        return {"image": self.image, "text": self.text}

    def modality_inputs(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        inputs = {}
        if batch["has_image"].any():
            inputs["image"] = batch["image"][batch["has_image"]]
        if batch["has_text"].any():
            inputs["text"] = batch["tokens"][batch["has_text"]]
        return inputs

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        features = self.encode(batch)
        fused = torch.zeros(len(batch["label"]), self.hparams.width, dtype=self.dtype, device=self.device)
        for name, present in (("image", batch["has_image"]), ("text", batch["has_text"])):
            if name in features:
                fused = fused.index_add(0, present.nonzero().squeeze(1), features[name])
        return self.backbone(fused)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        logits = self(batch)
        loss = nn.functional.cross_entropy(logits, batch["label"])
        self.train_acc(logits, batch["label"])
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_acc)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_acc)

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        """Each sample's most likely digit, from its image, its caption, or both."""
        return self(batch).argmax(-1)

    def _evaluate(self, batch: dict[str, Any], stage: str, accuracy: MulticlassAccuracy) -> None:
        logits = self(batch)
        accuracy(logits, batch["label"])
        self.log(f"{stage}_loss", nn.functional.cross_entropy(logits, batch["label"]), prog_bar=True)
        self.log(f"{stage}_acc", accuracy, prog_bar=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class TextEncoder(nn.Module):
    """Word embeddings averaged over a caption's words (padding left out), projected."""

    def __init__(self, vocab_size: int, width: int, embedding: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embedding, padding_idx=0)
        self.out = nn.Linear(embedding, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        words = (tokens != 0).sum(1, keepdim=True).clamp(min=1)
        return self.out(self.embed(tokens).sum(1) / words)


class WordTokenizer:
    """Lower-case words to ids, ``0`` padding and ``1`` for a word it does not know; captions are cut
    or padded to ``length`` words."""

    def __init__(self, words: Sequence[str], length: int = 8) -> None:
        self.vocab = {"<pad>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(dict.fromkeys(words))}}
        self.length = length

    @classmethod
    def from_texts(cls, texts: Sequence[str], size: int, length: int = 8) -> WordTokenizer:
        """The ``size - 2`` most frequent words of ``texts``."""
        counts = Counter(word for text in texts for word in _words(text))
        return cls([w for w, _ in counts.most_common(size - 2)], length)

    def __len__(self) -> int:
        return len(self.vocab)

    def __call__(self, text: str) -> torch.Tensor:
        ids = [self.vocab.get(w, 1) for w in _words(text)][: self.length]
        return torch.tensor(ids + [0] * (self.length - len(ids)))


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def captions_for(labels: torch.Tensor, seed: int, wrong: float = 0.2) -> list[str]:
    """A caption per label from ``TEMPLATES``; a ``wrong`` share of them names another digit."""
    g = torch.Generator().manual_seed(seed)
    captions = []
    for label in labels.tolist():
        if torch.rand(1, generator=g).item() < wrong:
            label = (label + 1 + int(torch.randint(0, 9, (1,), generator=g))) % 10
        template = TEMPLATES[int(torch.randint(0, len(TEMPLATES), (1,), generator=g))]
        captions.append(template.format(WORDS[label]))
    return captions


class ModalitySamples(Dataset):
    """Samples that carry an image, a caption or both, as dicts of tensors (a missing modality is
    zeros, with its ``has_*`` flag false): what ``DigitCaptioner`` reads."""

    def __init__(
        self,
        images: torch.Tensor,
        captions: Sequence[Optional[str]],
        labels: torch.Tensor,
        has_image: torch.Tensor,
        tokenizer: WordTokenizer,
    ) -> None:
        self.images, self.captions, self.labels, self.has_image, self.tokenizer = images, captions, labels, has_image, tokenizer

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        caption = self.captions[index]
        return {
            "image": self.images[index],
            "tokens": self.tokenizer(caption or ""),
            "has_image": self.has_image[index],
            "has_text": torch.tensor(caption is not None),
            "label": self.labels[index],
        }


class CaptionedDigits(L.LightningDataModule):
    """Digits with captions, whose mix of modalities changes within each epoch; or your own files.

    Args:
        manifest: a JSON-lines file of samples (see the module's doc); ``None``: scikit-learn's digits
            with generated captions.
        batch_size: samples per training batch (the whole batch, which the strategy splits).
        val_size: samples held out for validation.
        phases: for each part of an epoch, in order, ``[image share, caption share]``: the fraction of
            its samples that carry each (every sample carries at least one). The validation samples
            carry both.
        image_size: pixels per side (files are resized to it; the digits are 8).
        vocab_size: the captions' vocabulary, padding and unknown words included.
        seed: the seed of the split, the captions and the modality draws.
    """

    def __init__(
        self,
        manifest: Optional[str] = None,
        batch_size: int = 60,
        val_size: int = 300,
        phases: Sequence[Sequence[float]] = ((1.0, 0.15), (0.15, 1.0)),
        image_size: int = 8,
        vocab_size: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for phase in phases:
            if len(phase) != 2 or not all(0 <= share <= 1 for share in phase):
                raise ValueError(f"`phases={list(map(list, phases))}`: each phase is [image share, caption share] in [0, 1].")
        self.manifest, self.batch_size, self.val_size = manifest, batch_size, val_size
        self.phases, self.image_size, self.vocab_size, self.seed = [tuple(p) for p in phases], image_size, vocab_size, seed
        self.tokenizer: Optional[WordTokenizer] = None

    def setup(self, stage: str) -> None:
        images, captions, labels, present = self._files() if self.manifest else self._digits()
        g = torch.Generator().manual_seed(self.seed)
        order = torch.randperm(len(labels), generator=g)
        images, labels, present = images[order], labels[order], present[order]
        captions = [captions[i] for i in order.tolist()]
        self.tokenizer = WordTokenizer.from_texts([c for c in captions if c is not None], self.vocab_size)
        train = len(labels) - self.val_size
        if train < 1:
            raise ValueError(f"`val_size={self.val_size}` leaves no training samples of {len(labels)}.")
        has_image, has_text = self._draw(train, g)
        # A phase takes a modality away from a sample, never gives it one it lacks (your files).
        has_image, has_text = has_image & present[:train], has_text & torch.tensor([c is not None for c in captions[:train]])
        lacking = ~(has_image | has_text)
        has_image, has_text = has_image | (lacking & present[:train]), has_text | (lacking & ~present[:train])
        texts = [c if t else None for c, t in zip(captions[:train], has_text.tolist())]
        self.train = ModalitySamples(images[:train], texts, labels[:train], has_image, self.tokenizer)
        self.val = ModalitySamples(images[train:], captions[train:], labels[train:], present[train:], self.tokenizer)

    def _draw(self, count: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of ``count`` training samples, in order, carry an image and a caption: by phase."""
        phase = torch.arange(count) * len(self.phases) // max(count, 1)
        shares = torch.tensor(self.phases, dtype=torch.float64)[phase]
        has_image = torch.rand(count, generator=g, dtype=torch.float64) < shares[:, 0]
        has_text = torch.rand(count, generator=g, dtype=torch.float64) < shares[:, 1]
        neither = ~(has_image | has_text)
        has_image |= neither & (shares[:, 0] >= shares[:, 1])
        has_text |= neither & (shares[:, 0] < shares[:, 1])
        return has_image, has_text

    def _digits(self) -> tuple[torch.Tensor, list[Optional[str]], torch.Tensor, torch.Tensor]:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        labels = torch.tensor(digits.target)
        if self.image_size != 8:
            images = nn.functional.interpolate(images, size=self.image_size, mode="bilinear", align_corners=False)
        return images, list(captions_for(labels, self.seed)), labels, torch.ones(len(labels), dtype=torch.bool)

    def _files(self) -> tuple[torch.Tensor, list[Optional[str]], torch.Tensor, torch.Tensor]:
        from PIL import Image

        path = Path(self.manifest or "")
        if not path.exists():
            raise FileNotFoundError(f"`manifest={self.manifest}` does not exist: give a JSON-lines file of samples.")
        images, captions, labels, present = [], [], [], []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                sample = json.loads(line)
                labels.append(int(sample["label"]))
            except (ValueError, KeyError) as error:
                raise ValueError(f"{path}:{number}: a sample is a JSON object with a 'label' ({error!r}).") from None
            if "image" not in sample and "text" not in sample:
                raise ValueError(f"{path}:{number}: a sample needs an 'image' or a 'text'.")
            pixels = torch.zeros(1, self.image_size, self.image_size)
            if "image" in sample:
                with Image.open(path.parent / sample["image"]) as image:
                    gray = image.convert("L").resize((self.image_size, self.image_size))
                    pixels = torch.tensor(list(gray.getdata()), dtype=torch.float32).reshape(1, self.image_size, self.image_size) / 255.0
            images.append(pixels)
            present.append("image" in sample)
            captions.append(sample.get("text"))
        return torch.stack(images), captions, torch.tensor(labels), torch.tensor(present)

    def train_dataloader(self) -> DataLoader:
        # In order: the phases follow each other within the epoch, on every process alike.
        return DataLoader(self.train, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        """The held-out samples (``validate``'s): ``python -m recipes.multimodal test --ckpt_path ...``."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """The held-out samples, whose digits ``python -m recipes.multimodal predict --ckpt_path ...`` predicts."""
        return self.val_dataloader()


def main(args: Any = None) -> None:
    HeteroCLI(DigitCaptioner, CaptionedDigits, args=args)


if __name__ == "__main__":
    main()
