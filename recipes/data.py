"""Readers for the recipes' data files, and their shuffle."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import torch

__all__ = ["EpochShuffle", "read_idx", "write_idx"]

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
