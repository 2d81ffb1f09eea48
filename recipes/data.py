"""Readers for the recipes' data files."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import torch

__all__ = ["read_idx", "write_idx"]

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
