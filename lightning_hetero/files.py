"""Files written whole or not at all: checkpoints, plans, profiles, traces.

``atomic_write`` writes into a temporary file beside the target, flushes it to disk, then renames
it over the target (``os.replace``, atomic on POSIX and Windows), so a process killed while
writing leaves the previous file as it was. ``AtomicCheckpointIO`` saves Lightning checkpoints
that way; it is the hetero strategy's default checkpoint IO.

Lightning's own ``TorchCheckpointIO`` writes through an fsspec transaction whose temporary file
lies in the system's temporary directory; where that is another filesystem (often a tmpfs), the
final move is a copy, and a process killed during the copy leaves half a checkpoint under the
checkpoint's name, which ``ckpt_path="last"`` would then pick.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any, Optional, Union

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

__all__ = ["atomic_write", "AtomicCheckpointIO", "PARTIAL_SUFFIX"]

PARTIAL_SUFFIX = ".partial"
"""How a file being written is named (``partial_path``); one left behind by a killed process is
never read, and may be deleted."""


def partial_path(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place: ``.NAME.<pid>.<token>.partial``,
    hidden, beside it, with NAME's underscores made dashes. Lightning finds the newest of a folder's
    ``hpc_ckpt_<n>.ckpt`` by the digits of every name that holds ``hpc_ckpt_``, and so would take one
    left by a killed process for a checkpoint (and fail to resume from it)."""
    return path.with_name(f".{path.name.replace('_', '-')}.{os.getpid()}.{secrets.token_hex(4)}{PARTIAL_SUFFIX}")


@contextmanager
def atomic_write(path: Union[str, Path], mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path`` for writing (``mode`` "wb" or "w"); when the block
    ends without an error, it is flushed to disk and renamed to ``path``. On an error it is
    removed and ``path`` is left as it was."""
    if mode not in ("wb", "w"):
        raise ValueError(f"`atomic_write(mode={mode!r})` writes a new file: use 'wb' or 'w'.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of our own (not `tempfile.mkstemp`, which creates it readable by its owner only): the
    # file gets the permissions any new file gets here.
    partial = partial_path(path)
    try:
        with open(partial, mode.replace("w", "x"), **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        with suppress(FileNotFoundError):
            partial.unlink()
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened (Windows)."""
    with suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local checkpoints are written whole or not at all (``atomic_write``):
    a process killed while saving leaves the previous checkpoint intact and loadable. Remote paths
    (``s3://``, ...) are written as Lightning writes them; object stores publish an upload whole."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        if not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)`: `storage_options` is not supported by"
                " `AtomicCheckpointIO`; pass a `CheckpointIO` plugin of your own that uses them."
            )
        with atomic_write(path) as f:
            torch.save(checkpoint, f)


def _is_local(path: _PATH) -> bool:
    return "file" in get_filesystem(path).protocol
