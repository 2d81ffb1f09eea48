"""Text for the GPT recipe: a corpus, a byte-level BPE tokenizer trained on it, and token windows.

The default corpus is real text on every machine without a download: the Python standard
library's own source files. The tokenizer (the ``tokenizers`` library's byte-level BPE) is
trained on the corpus at the requested vocabulary size, and both it and the encoded tokens are
cached, keyed by the corpus's content and the vocabulary size.
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import Dataset

from lightning_hetero.files import atomic_write

__all__ = ["stdlib_corpus", "load_text", "tokenize", "tokenize_with", "TokenWindows", "unigram_loss"]


def stdlib_corpus(max_chars: int) -> str:
    """Up to ``max_chars`` characters of the standard library's Python sources (sorted by path,
    tests left out), joined by blank lines."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parts[-2:][0] or path.name.startswith("test"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        total += len(text) + 2
        if total >= max_chars:
            break
    return "\n\n".join(parts)[:max_chars]


def load_text(text_file: Optional[str], max_chars: int) -> str:
    """The text of ``text_file`` (up to ``max_chars``), or the standard library corpus."""
    if text_file is None:
        return stdlib_corpus(max_chars)
    path = Path(text_file).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"`text_file={text_file}` does not exist; name a UTF-8 text file, or leave it unset.")
    return path.read_text(encoding="utf-8", errors="replace")[:max_chars]


def _batches(text: str, size: int = 1 << 16) -> Iterator[str]:
    for start in range(0, len(text), size):
        yield text[start : start + size]


def tokenize(text: str, vocab_size: int, cache_dir: str | Path) -> tuple[torch.Tensor, int]:
    """``text`` as token ids of a byte-level BPE trained on it, and the vocabulary's real size;
    the tokenizer and the ids are cached in ``cache_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    key = hashlib.sha256(f"{vocab_size}\0{text}".encode()).hexdigest()[:16]
    cache = Path(cache_dir).expanduser()
    tokenizer_path, ids_path = cache / f"bpe-{key}.json", cache / f"ids-{key}.pt"
    if tokenizer_path.exists() and ids_path.exists():
        return torch.load(ids_path), Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=True, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_batches(text), trainer=trainer, length=math.ceil(len(text) / (1 << 16)))
    ids = torch.tensor([i for chunk in _batches(text) for i in tokenizer.encode(chunk).ids], dtype=torch.int32)
    with atomic_write(tokenizer_path, "w") as f:  # never half a cache
        f.write(tokenizer.to_str())
    with atomic_write(ids_path) as f:
        torch.save(ids, f)
    return ids, tokenizer.get_vocab_size()


def tokenize_with(text: str, tokenizer_dir: str | Path) -> tuple[torch.Tensor, int]:
    """``text`` as the token ids of a Hugging Face tokenizer saved in ``tokenizer_dir`` (a pretrained
    model's own, from ``save_pretrained`` or a hub snapshot on disk; nothing is downloaded), and
    its vocabulary's size."""
    from transformers import AutoTokenizer

    path = Path(tokenizer_dir).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"`tokenizer={tokenizer_dir}` is not a directory holding a saved tokenizer.")
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    ids = [i for chunk in _batches(text) for i in tokenizer(chunk, add_special_tokens=False)["input_ids"]]
    return torch.tensor(ids, dtype=torch.int32), len(tokenizer)


class TokenWindows(Dataset):
    """Consecutive, non-overlapping windows of ``context`` tokens: inputs, and the next tokens as targets."""

    def __init__(self, ids: torch.Tensor, context: int) -> None:
        if len(ids) < context + 1:
            raise ValueError(f"{len(ids)} tokens cannot fill one window of {context} (+1) tokens; use more text.")
        self.ids, self.context = ids.long(), context

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.context

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.context
        return self.ids[start : start + self.context], self.ids[start + 1 : start + self.context + 1]


def unigram_loss(train: torch.Tensor, val: torch.Tensor, vocab_size: int) -> float:
    """The cross-entropy on ``val`` of predicting every token by its frequency in ``train``
    (add-one smoothed): the baseline a language model must beat."""
    counts = torch.bincount(train.long(), minlength=vocab_size).double() + 1.0
    log_p = counts.log() - counts.sum().log()
    return float(-log_p[val.long()].mean())
