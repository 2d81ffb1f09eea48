"""Small models and data for the tests: float64-friendly, dropout-free, and importable by spawned processes."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_hetero import MultimodalModule, PipelineModule

IMPORTED_BY = os.getpid()
"""The process that imported this module: a rank forked from a forkserver that preloaded it names the server."""


class Net(PipelineModule, L.LightningModule):
    """An MLP of six blocks (so up to six stages), regression loss, optimizer chosen by name."""

    def __init__(self, optimizer: str = "adamw", scheduler: bool = True, width: int = 16, seed: int | None = 0) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        self.optimizer_name = optimizer
        self.scheduler = scheduler
        self.layers = nn.ModuleList(
            [nn.Linear(6, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3), nn.Identity()]
        )

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        elif self.optimizer_name == "nadam":  # computes in its step count's dtype
            optimizer = torch.optim.NAdam(self.parameters(), lr=0.01)
        elif self.optimizer_name == "adagrad":  # makes its state in its constructor
            optimizer = torch.optim.Adagrad(self.parameters(), lr=0.05)
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
        if not self.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Classifier(PipelineModule, L.LightningModule):
    """A classifier that logs torchmetrics accuracy from its own steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 4)])
        self.train_acc = MulticlassAccuracy(num_classes=4, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=4, average="micro")

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        loss = self.pipeline_loss(out, y)
        self.train_acc(out, y)
        self.log("train_loss", loss)
        # The whole batch's size, as a single-process run passes it; its epoch mean weighs by it.
        self.log("train_loss_sized", loss, batch_size=12, on_step=False, on_epoch=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("seen", float(len(y)), reduce_fx="sum", on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        out = self(x)
        self.val_acc(out, y)
        self.log("val_loss", self.pipeline_loss(out, y))
        self.log("val_acc", self.val_acc)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class LazyNet(Net):
    """`Net` whose layers are built in `configure_model`, Lightning's hook for large models."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.optimizer_name, self.scheduler = "adamw", True
        self.layers: nn.ModuleList | None = None

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = Net().layers


class Predictor(Net):
    """`Net` whose predictions are a dict holding a tensor and one string per sample."""

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Any]:
        out = self(batch[0])
        return {"out": out, "labels": [f"{v:.6f}" for v in out[:, 0].tolist()]}


def regression_data(n: int = 44, batch_size: int = 12, seed: int = 1) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def classification_data(n: int = 60, batch_size: int = 12, seed: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def read_metrics(log_dir: str | Path) -> list[dict[str, float]]:
    """The rows of a CSVLogger's metrics.csv, empty cells dropped."""
    (path,) = Path(log_dir).rglob("metrics.csv")
    with open(path) as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def column(rows: list[dict[str, float]], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), r[key]) for r in rows if key in r]


class Twice(nn.Module):
    """A layer that applies its Linear twice (one parameter, two uses in the same layer)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.tanh(self.linear(x)))


class WithSpare(nn.Module):
    """A Linear with a parameter the forward never uses."""

    def __init__(self, features: int, out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, out)
        self.spare = nn.Parameter(torch.ones(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class OddNet(Net):
    """`Net` with a parameter used twice in its layer and one never used: the unused one keeps
    `grad=None` and is never stepped, as in one process."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(1)
        self.layers[2] = Twice(16)
        self.layers[4] = WithSpare(16, 3)


class FinetunedNet(Net):
    """`Net` whose optimizer starts without the frozen first layer (Lightning's fine-tuning pattern)."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


class TwoPass(L.LightningModule):
    """A LightningModule as people write them, with no blocks: its step calls the model twice and
    adds an auxiliary loss, and it logs more than its loss."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        aux = self.head(self(0.5 * x)).pow(2).mean()
        loss = nn.functional.mse_loss(out, y) + 0.1 * aux
        self.log("train_loss", loss)
        self.log("aux", aux, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Captioned(TwoPass):
    """Batches are dicts with a caption per sample; the loss weighs each sample by its caption."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        weights = torch.tensor([len(c) for c in batch["captions"]], dtype=batch["x"].dtype)
        per_sample = (self(batch["x"]) - batch["y"]).pow(2).mean(dim=1)
        loss = (per_sample * weights).mean() * batch["scale"]
        self.log("train_loss", loss)
        return loss


class CaptionedData(torch.utils.data.Dataset):
    def __init__(self, n: int = 44, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i], "caption": "a" * (1 + i % 5)}


def captioned_data(n: int = 44, batch_size: int = 12) -> DataLoader:
    """Dict batches: tensors, a caption per sample (a list of strings), and a per-batch number."""

    def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "x": torch.stack([i["x"] for i in items]),
            "y": torch.stack([i["y"] for i in items]),
            "captions": [i["caption"] for i in items],
            "scale": 0.5,
        }

    return DataLoader(CaptionedData(n), batch_size=batch_size, collate_fn=collate)


class SampleList(TwoPass):
    """Batches are lists of samples, each a (sequence, target) pair as its dataset gives it: a
    DataLoader with `collate_fn=list`, as for inputs of different sizes."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        pooled = torch.stack([sequence.mean(dim=0) for sequence, _ in batch])
        loss = nn.functional.mse_loss(self(pooled), torch.stack([target for _, target in batch]))
        self.log("train_loss", loss)
        return loss


def sample_list_data(n: int = 44, batch_size: int = 12) -> DataLoader:
    """Sequences of 3 steps with a target of 3 values: every tensor of a sample has 3 rows, as
    many as a batch could have."""
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(n, 3, 6, generator=g), torch.randn(n, 3, generator=g))
    return DataLoader(data, batch_size=batch_size, collate_fn=list)


class TinyGPT2(L.LightningModule):
    """A Hugging Face GPT-2 built from a config (no download), trained through its own loss on dict
    batches, its input and output embeddings tied."""

    def __init__(self, vocab: int = 64, context: int = 8, layers: int = 2, attention: str = "eager") -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=vocab, n_positions=context, n_embd=16, n_layer=layers, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attention,
        )
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class GPT2Embedding(nn.Module):
    """The first step of a Hugging Face GPT-2, as a block: token and position embeddings (a thin
    wrapper: the model owns the embeddings)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class GPT2Head(nn.Module):
    """The last step of a Hugging Face GPT-2, as a block: the final norm and the output head, whose
    weight is the input embedding's (tied)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


class PipelinedGPT2(PipelineModule, TinyGPT2):
    """`TinyGPT2` offered as blocks without changing the model: its embedding, its transformer blocks
    (SDPA attention, causal without a mask) and its head, the head's weight tied to the embedding's,
    so a pipeline puts the two uses on different stages. Its loss is the model's own loss function."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__(layers=layers, attention="sdpa")
        # A plain list: the blocks wrap the model's own modules, which it registers already.
        self.blocks = [GPT2Embedding(self.model.transformer), *self.model.transformer.h, GPT2Head(self.model)]

    def pipeline_layers(self) -> list[nn.Module]:
        return self.blocks

    def pipeline_inputs(self, batch: Any) -> tuple[Any, Any]:
        return batch["input_ids"], batch.get("labels")

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.model.loss_function(output, target, vocab_size=self.model.config.vocab_size)


class BatchNormNet(Net):
    """`Net` with a BatchNorm layer after its first block (it trains as replicas, not in a pipeline)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layers[1] = nn.Sequential(nn.BatchNorm1d(16), nn.Tanh())


class TiedNet(Net):
    """`Net` whose output head reuses the first layer's weight (transposed), so the two uses of one
    parameter are four blocks apart: on different stages with two or three of them."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        first = self.layers[0]
        self.layers[4] = TiedHead(first.weight)
        self.layers[5] = nn.Linear(6, 3)


class TiedHead(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight
        self.bias = nn.Parameter(torch.zeros(weight.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight.t(), self.bias)


def token_data(n: int = 44, batch_size: int = 12, vocab: int = 64, context: int = 8) -> DataLoader:
    """Dict batches of token windows, as a tokenizer's collator makes them."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (n, context), generator=g)
    items = [{"input_ids": row, "labels": row.clone()} for row in ids]
    return DataLoader(items, batch_size=batch_size)


def demo_transformer(vocab: int = 50) -> L.LightningModule:
    """Lightning's own demo transformer as it ships, its dropout off (for exact equivalence) and its
    dataset's download skipped (the tests bring their own tokens)."""
    from lightning.pytorch.demos.transformer import LightningTransformer

    class Demo(LightningTransformer):
        def prepare_data(self) -> None:
            pass

    torch.manual_seed(0)
    model = Demo(vocab_size=vocab)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(module, nn.MultiheadAttention):
            module.dropout = 0.0  # the attention's own dropout, a number rather than a module
    return model


def demo_data(n: int = 8, vocab: int = 50, block: int = 12, batch_size: int = 1) -> DataLoader:
    """Token blocks shaped as the demo's own dataset gives them, one per batch as its loader does unless
    told (its `nn.Transformer` is batch-first: the samples of a batch are independent)."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, vocab, (n, block + 1), generator=g)
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=batch_size)


class TinyResNet(L.LightningModule):
    """A Hugging Face ResNet built from a config (no download), BatchNorm after every convolution,
    trained through its own loss on dict batches."""

    def __init__(self, labels: int = 3) -> None:
        super().__init__()
        from transformers import ResNetConfig, ResNetForImageClassification

        torch.manual_seed(0)
        config = ResNetConfig(
            num_channels=3, embedding_size=8, hidden_sizes=[8, 12], depths=[1, 1], layer_type="basic", num_labels=labels
        )
        self.model = ResNetForImageClassification(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def image_data(n: int = 44, batch_size: int = 12, labels: int = 3, size: int = 12) -> DataLoader:
    """Dict batches of small random images and labels, as an image processor's collator makes them."""
    g = torch.Generator().manual_seed(6)
    images, targets = torch.randn(n, 3, size, size, generator=g), torch.randint(0, labels, (n,), generator=g)
    return DataLoader([{"pixel_values": x, "labels": y} for x, y in zip(images, targets)], batch_size=batch_size)


class Keyed(nn.Module):
    """A first block that takes a dict: ``{"x": features, "scale": per-sample scale}``."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.linear = nn.Linear(6, width)

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.linear(inputs["x"]) * inputs["scale"]


class DictNet(Net):
    """`Net` fed from dict batches through `pipeline_inputs`: ``{"x", "y", "scale", "id"}``; with
    ``keyed``, its first block takes a dict of two tensors."""

    def __init__(self, keyed: bool = False) -> None:
        super().__init__()
        self.keyed = keyed
        if keyed:
            self.layers[0] = Keyed()

    def pipeline_inputs(self, batch: Any) -> tuple[Any, Any]:
        inputs = {"x": batch["x"], "scale": batch["scale"]} if self.keyed else batch["x"]
        return inputs, batch.get("y")


def dict_data(n: int = 44, batch_size: int = 12) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x, y, scale = torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g), torch.rand(n, 1, generator=g) + 0.5
    items = [{"x": x[i], "y": y[i], "scale": scale[i], "id": f"sample-{i}"} for i in range(n)]
    return DataLoader(items, batch_size=batch_size)


class ImageEncoder(nn.Module):
    """A small convolutional encoder of 1x6x6 images."""

    def __init__(self, width: int = 8, norm: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.norm = nn.BatchNorm2d(4) if norm else nn.Identity()
        self.out = nn.Linear(4 * 4 * 4, width)

    samples = 0
    """Images this process's copy has encoded (training and evaluation)."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.samples += len(images)
        return torch.tanh(self.out(self.norm(torch.relu(self.conv(images))).flatten(1)))


class TextEncoder(nn.Module):
    """Token embeddings averaged over each sequence, projected."""

    def __init__(self, vocab: int = 30, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 12)
        self.out = nn.Linear(12, width)

    samples = 0
    """Texts this process's copy has encoded (training and evaluation)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.samples += len(tokens)
        return self.out(self.embed(tokens).mean(1))


class Multimodal(MultimodalModule, L.LightningModule):
    """Two encoders (image, text) fused by sum into an MLP backbone. A sample may lack either modality
    (``has_image``, ``has_text``); a batch none of whose samples carries one leaves it out."""

    def __init__(self, width: int = 8, norm: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.image = ImageEncoder(width, norm)
        self.text = TextEncoder(width=width)
        self.backbone = nn.Sequential(nn.Linear(width, 16), nn.Tanh(), nn.Linear(16, 1))

    def modality_encoders(self) -> dict[str, nn.Module]:
        return {"image": self.image, "text": self.text}

    def modality_inputs(self, batch: dict) -> dict[str, torch.Tensor]:
        inputs = {}
        if batch["has_image"].any():
            inputs["image"] = batch["image"][batch["has_image"]]
        if batch["has_text"].any():
            inputs["text"] = batch["tokens"][batch["has_text"]]
        return inputs

    def forward(self, batch: dict) -> torch.Tensor:
        features = self.encode(batch)
        fused = torch.zeros(len(batch["y"]), self.backbone[0].in_features, dtype=self.dtype, device=self.device)
        for name, mask in (("image", batch["has_image"]), ("text", batch["has_text"])):
            if name in features:
                fused = fused.index_add(0, mask.nonzero().squeeze(1), features[name])
        return self.backbone(fused).squeeze(1)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self(batch), batch["y"])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self(batch), batch["y"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def multimodal_data(
    n: int = 48, batch_size: int = 12, text_only_from: int | None = None, text_from: int | None = None
) -> DataLoader:
    """Samples with an image, a text or both (about a third each); from sample ``text_only_from`` on,
    none has an image; before sample ``text_from``, none has a text."""
    g = torch.Generator().manual_seed(3)
    images, tokens = torch.randn(n, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 30, (n, 5), generator=g)
    kind = torch.randint(0, 3, (n,), generator=g)
    has_image, has_text = kind != 1, kind != 0
    if text_only_from is not None:
        has_image[text_only_from:], has_text[text_only_from:] = False, True
    if text_from is not None:
        has_image[:text_from], has_text[:text_from] = True, False
    y = torch.randn(n, generator=g, dtype=torch.float64)
    items = [
        {"image": images[i], "tokens": tokens[i], "has_image": has_image[i], "has_text": has_text[i], "y": y[i]}
        for i in range(n)
    ]
    return DataLoader(items, batch_size=batch_size)


def phased_data(n: int = 288, batch_size: int = 12, switch: int = 144) -> DataLoader:
    """Multimodal samples whose mix changes at sample ``switch``: before it every sample has an image
    and one in six a text; after it the other way round."""
    g = torch.Generator().manual_seed(4)
    images, tokens = torch.randn(n, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 30, (n, 5), generator=g)
    rare = torch.arange(n) % 6 == 0
    first = torch.arange(n) < switch
    has_image, has_text = first | rare, ~first | rare
    y = torch.randn(n, generator=g, dtype=torch.float64)
    items = [
        {"image": images[i], "tokens": tokens[i], "has_image": has_image[i], "has_text": has_text[i], "y": y[i]}
        for i in range(n)
    ]
    return DataLoader(items, batch_size=batch_size)


class FuseEncoders(nn.Module):
    """A first block over the model's encoders: each sample's image and text features, summed."""

    def __init__(self, image: nn.Module, text: nn.Module, width: int) -> None:
        super().__init__()
        self.image, self.text, self.width = image, text, width

    def forward(self, inputs: dict) -> torch.Tensor:
        fused = torch.zeros(len(inputs["has_image"]), self.width, dtype=inputs["image"].dtype, device=inputs["image"].device)
        for name, key, mask in (("image", "image", inputs["has_image"]), ("text", "tokens", inputs["has_text"])):
            if mask.any():
                fused = fused.index_add(0, mask.nonzero().squeeze(1), getattr(self, name)(inputs[key][mask]))
        return fused


class PipelinedMultimodal(PipelineModule, Multimodal):
    """`Multimodal` offering blocks: the fused encoders, then the backbone's layers."""

    def __init__(self, width: int = 8) -> None:
        super().__init__(width)
        self.fuse = FuseEncoders(self.image, self.text, width)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.fuse, *self.backbone]

    def pipeline_inputs(self, batch: dict) -> tuple[dict, torch.Tensor]:
        return {k: batch[k] for k in ("image", "tokens", "has_image", "has_text")}, batch["y"]

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output.squeeze(1), target)
