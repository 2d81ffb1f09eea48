"""Fine-tune a Hugging Face causal language model with ``strategy="hetero"``, as the library builds it.

The LightningModule holds ``transformers.AutoModelForCausalLM`` and trains it through the model's
own loss (``model(**batch).loss``) on dict batches, as a tokenizer's collator gives them. Nothing of
the model is rewritten: it offers no blocks, so every device and every CPU worker holds a replica
and trains its share of each batch (``parallelism="replicas"``, which ``"auto"`` picks for it).

The model is a pretrained one from a directory on disk (``pretrained=``: ``save_pretrained``'s
output, or a hub snapshot already downloaded; nothing is downloaded at run time), tokenizing the
text with its own tokenizer (the data's ``tokenizer=``, usually the same directory); or, by
default, a small model of the library's architecture built from its config, on the GPT recipe's
text and BPE, so that the recipe runs anywhere.

    python -m recipes.causal_lm fit --config configs/causal_lm.yaml
    python -m recipes.causal_lm fit --config configs/causal_lm.yaml \\
        --model.pretrained ~/models/gpt2 --data.tokenizer ~/models/gpt2 --data.vocab_size 50257
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

from lightning_hetero.cli import HeteroCLI
from recipes.gpt import TextData

__all__ = ["CausalLM", "CausalLMData", "lm_batch"]


class CausalLM(L.LightningModule):
    """A Hugging Face causal LM, trained through its own loss.

    Args:
        pretrained: a directory with a saved model (``save_pretrained``) to fine-tune; ``None`` builds
            a new one from ``model_type`` and ``config``.
        model_type: a model type ``transformers.AutoConfig`` knows ("gpt2", "llama", ...).
        config: the config's values (``vocab_size``, sizes, dropouts) where the model is built anew.
        lr: AdamW's learning rate.
        weight_decay: AdamW's weight decay.
    """

    def __init__(
        self,
        pretrained: Optional[str] = None,
        model_type: str = "gpt2",
        config: Optional[dict[str, Any]] = None,
        lr: float = 5e-4,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        self.save_hyperparameters()
        if pretrained is not None:
            path = Path(pretrained).expanduser()
            if not path.is_dir():
                raise FileNotFoundError(f"`pretrained={pretrained}` is not a directory holding a saved model.")
            self.model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
            self.model.train()  # `from_pretrained` leaves it in eval mode: dropout off
        else:
            self.model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **(config or {})))

    def forward(self, **batch: Any) -> Any:
        return self.model(**batch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self(**batch).loss, prog_bar=True)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self(**batch).loss, prog_bar=True)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The most likely next token after every position of each window."""
        return self(input_ids=batch["input_ids"]).logits.argmax(-1)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


def lm_batch(windows: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Token windows as a causal LM's batch: the model shifts ``labels`` against ``input_ids`` itself."""
    ids = torch.stack([inputs for inputs, _ in windows])
    return {"input_ids": ids, "labels": ids.clone()}


class CausalLMData(TextData):
    """``TextData``'s windows as dict batches, ``{"input_ids", "labels"}`` (its arguments are the same)."""

    collate_fn = staticmethod(lm_batch)


def main(args: Any = None) -> None:
    HeteroCLI(CausalLM, CausalLMData, args=args)


if __name__ == "__main__":
    main()
