"""A decoder-only transformer language model, trained with ``strategy="hetero"``.

The model is a sequence of blocks, the hetero model contract: token and position embedding,
``layers`` transformer blocks (pre-norm causal self-attention and an MLP), a final norm and the
output head (no weights tied across blocks, so any cut into stages works). The data is any text
file, or by default the Python standard library's own sources, tokenized with a byte-level BPE
trained on it (see ``recipes/text.py``).

    python -m recipes.gpt fit --config configs/gpt.yaml
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics.text import Perplexity

from lightning_hetero import PipelineModule
from lightning_hetero.cli import HeteroCLI
from recipes.data import EpochShuffle
from recipes.text import TokenWindows, load_text, tokenize, tokenize_with, unigram_loss

__all__ = ["GPT", "TextData"]


class Embedding(nn.Module):
    """Token and learned position embeddings."""

    def __init__(self, vocab_size: int, context: int, width: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(context, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.dropout(self.tokens(ids) + self.positions(positions))


class Block(nn.Module):
    """Pre-norm causal self-attention, then a pre-norm MLP, each with a residual connection."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.heads, self.dropout = heads, dropout
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(attended.transpose(1, 2).reshape(batch, length, width)))
        return x + self.drop(self.mlp(self.norm2(x)))


class GPT(PipelineModule, L.LightningModule):
    """A decoder-only transformer as an ordered list of blocks.

    Args:
        vocab_size: tokens in the vocabulary (the data's tokenizer must not exceed it).
        context: the longest sequence, in tokens.
        width: the embedding width.
        layers: transformer blocks.
        heads: attention heads per block.
        dropout: dropout probability (0 keeps a hetero run exactly equal to a single-device one).
        lr: AdamW's learning rate.
        weight_decay: AdamW's weight decay.
    """

    def __init__(
        self,
        vocab_size: int = 2000,
        context: int = 64,
        width: int = 128,
        layers: int = 4,
        heads: int = 4,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"`width={width}` must be a multiple of `heads={heads}`.")
        self.save_hyperparameters()
        self.layers = nn.ModuleList(
            [
                Embedding(vocab_size, context, width, dropout),
                *(Block(width, heads, dropout) for _ in range(layers)),
                nn.LayerNorm(width),
                nn.Linear(width, vocab_size),
            ]
        )
        self.train_ppl, self.val_ppl, self.test_ppl = Perplexity(), Perplexity(), Perplexity()

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        logits = self(ids)
        loss = self.pipeline_loss(logits, targets)
        self.train_ppl(logits, targets)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_ppl", self.train_ppl, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_ppl)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_ppl)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The most likely next token after every position of each window."""
        ids, _ = batch
        return self(ids).argmax(-1)

    def _evaluate(self, batch: Any, stage: str, perplexity: Perplexity) -> None:
        ids, targets = batch
        logits = self(ids)
        perplexity(logits, targets)
        self.log(f"{stage}_loss", self.pipeline_loss(logits, targets), prog_bar=True)
        self.log(f"{stage}_ppl", perplexity)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class TextData(L.LightningDataModule):
    """Windows of tokens from a text: the last ``val_fraction`` of it for validation.

    Args:
        text_file: a UTF-8 text file; ``None`` uses the Python standard library's sources.
        max_chars: read at most this many characters.
        vocab_size: the BPE vocabulary to train (set the model's ``vocab_size`` to the same).
        context: tokens per window (the model's ``context``).
        batch_size: windows per training batch.
        val_fraction: the share of the tokens held out for validation.
        cache_dir: where the tokenizer and the token ids are cached.
        seed: the seed of the shuffling.
        tokenizer: a directory holding a saved Hugging Face tokenizer (a pretrained model's own) to
            encode the text with, instead of training a BPE on it (``vocab_size`` must hold it).
    """

    collate_fn: Optional[Any] = None
    """How the loaders collate windows (``None``: ``(inputs, targets)`` tensors)."""

    def __init__(
        self,
        text_file: Optional[str] = None,
        max_chars: int = 2_000_000,
        vocab_size: int = 2000,
        context: int = 64,
        batch_size: int = 32,
        val_fraction: float = 0.05,
        cache_dir: str = "~/.cache/lightning-hetero",
        seed: int = 0,
        tokenizer: Optional[str] = None,
    ) -> None:
        super().__init__()
        if not 0 < val_fraction < 1:
            raise ValueError(f"`val_fraction={val_fraction}` must be between 0 and 1.")
        self.text_file, self.max_chars, self.vocab_size = text_file, max_chars, vocab_size
        self.context, self.batch_size, self.val_fraction = context, batch_size, val_fraction
        self.cache_dir, self.seed, self.tokenizer = cache_dir, seed, tokenizer
        self.unigram_loss: Optional[float] = None

    def prepare_data(self) -> None:
        # Once per node, before the processes that share the batches start: train (or find) the tokenizer.
        if self.tokenizer is None:
            tokenize(load_text(self.text_file, self.max_chars), self.vocab_size, self.cache_dir)

    def _ids(self) -> tuple[torch.Tensor, int]:
        text = load_text(self.text_file, self.max_chars)
        if self.tokenizer is not None:
            return tokenize_with(text, self.tokenizer)
        return tokenize(text, self.vocab_size, self.cache_dir)

    def setup(self, stage: str) -> None:
        ids, vocab = self._ids()
        if vocab > self.vocab_size:
            raise ValueError(f"The tokenizer has {vocab} tokens, more than `vocab_size={self.vocab_size}`.")
        cut = int(len(ids) * (1 - self.val_fraction))
        self.train_ids, self.val_ids = ids[:cut], ids[cut:]
        self.train, self.val = TokenWindows(self.train_ids, self.context), TokenWindows(self.val_ids, self.context)
        self.unigram_loss = unigram_loss(self.train_ids, self.val_ids, self.vocab_size)
        rank_zero_info(
            f"{len(ids)} tokens ({len(self.train)} training windows of {self.context}); a unigram model's"
            f" validation loss is {self.unigram_loss:.3f}"
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train,
            batch_size=self.batch_size,
            sampler=EpochShuffle(len(self.train), self.seed),  # every process, and a resumed run, alike
            drop_last=True,
            collate_fn=self.collate_fn,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size, collate_fn=self.collate_fn)

    def test_dataloader(self) -> DataLoader:
        """The held-out end of the text (``validate``'s): ``python -m recipes.gpt test --ckpt_path ...``."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """The held-out windows, whose next tokens ``python -m recipes.gpt predict --ckpt_path ...`` predicts."""
        return self.val_dataloader()


def main(args: Any = None) -> None:
    HeteroCLI(GPT, TextData, args=args)


if __name__ == "__main__":
    main()
