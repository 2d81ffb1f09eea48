"""Readers for the recipes' data files, their shuffle, and a writer of their predictions."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path
from typing import Any, Optional

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import BasePredictionWriter

__all__ = ["EpochShuffle", "SavePredictions", "read_idx", "write_idx"]

_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path: str | Path) -> torch.Tensor:
    """An IDX file (the MNIST format; gzipped or not) as a tensor of its shape and type."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _TYPES:
        raise ValueError(f"{path} is not an IDX file: it must start with two zero bytes, a type code and a rank.")
    dtype, rank = np.dtype(_TYPES[data[2]]), data[3]
    shape = struct.unpack(f">{rank}I", data[4 : 4 + 4 * rank])
    body = data[4 + 4 * rank :]
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(body) != expected:
        raise ValueError(f"{path}: the header gives shape {shape} ({expected} bytes), but {len(body)} bytes follow.")
    array = np.frombuffer(body, dtype=dtype).reshape(shape)
    return torch.from_numpy(array.astype(array.dtype.newbyteorder("=")).copy())


def write_idx(path: str | Path, tensor: torch.Tensor) -> None:
    """Write an unsigned-byte tensor as an IDX file (gzipped if the name ends in ``.gz``)."""
    array = tensor.numpy().astype(np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())


class EpochShuffle(torch.utils.data.Sampler[int]):
    """A shuffle drawn from the seed and the epoch alone: Lightning gives the sampler each epoch
    (``set_epoch``), so every process of a run draws the same order, each epoch another, and a run
    resumed from a checkpoint draws what the uninterrupted run drew."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self):  # type: ignore[no-untyped-def]
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())


class SavePredictions(BasePredictionWriter):
    """Writes what ``predict`` returns, every batch's predictions in order, to one file for
    ``torch.load``: ``python -m recipes.mlp predict --config configs/mlp.yaml --ckpt_path ...
    --trainer.callbacks+=recipes.data.SavePredictions``.

    Args:
        path: the file; ``None`` writes ``predictions.pt`` in the Trainer's ``default_root_dir``.
    """

    def __init__(self, path: Optional[str] = None) -> None:
        super().__init__("epoch")
        self.path = path

    def write_on_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, predictions: Any, batch_indices: Any) -> None:
        # strategy="hetero" assembles each node's predictions on its first rank (on one node: global rank 0,
        # the one file); a rank with a part of its own (another node's first, or each rank under DDP) writes
        # a file named after it.
        path = Path(self.path or Path(trainer.default_root_dir) / "predictions.pt")
        if trainer.global_rank:
            path = path.with_name(f"{path.stem}_{trainer.global_rank}{path.suffix}")
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(predictions, path)
