"""Files are written whole or not at all (a process killed while saving: tests/test_faults.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

from lightning_hetero import HeteroPlan
from lightning_hetero.files import PARTIAL_SUFFIX, AtomicCheckpointIO, atomic_write, partial_path
from tests.conftest import hetero, trainer
from tests.models import Net, regression_data


def test_a_failed_write_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="interrupted"):
        with atomic_write(path, "w") as f:
            f.write("new, half")
            raise RuntimeError("interrupted")
    assert path.read_text() == "old"
    assert list(tmp_path.iterdir()) == [path]  # the partial file is gone too


def test_a_written_file_is_an_ordinary_file(tmp_path: Path) -> None:
    (tmp_path / "plain").write_bytes(b"")
    with atomic_write(tmp_path / "deep" / "x.ckpt") as f:
        torch.save({"a": torch.ones(2)}, f)
    assert torch.equal(torch.load(tmp_path / "deep" / "x.ckpt")["a"], torch.ones(2))
    assert os.stat(tmp_path / "deep" / "x.ckpt").st_mode == os.stat(tmp_path / "plain").st_mode
    assert not list(tmp_path.rglob(f"*{PARTIAL_SUFFIX}"))


def test_a_partial_file_left_beside_hpc_checkpoints_is_not_taken_for_one(tmp_path: Path) -> None:
    """A killed process's partial `hpc_ckpt_2.ckpt` beside a whole `hpc_ckpt_1.ckpt`: a SLURM
    requeue's `ckpt_path="hpc"` resumes from the whole one (Lightning reads the digits of every name
    holding `hpc_ckpt_`)."""
    first = trainer(None, max_steps=2)
    first.fit(Net(), regression_data())
    first.save_checkpoint(tmp_path / "hpc_ckpt_1.ckpt")
    partial_path(tmp_path / "hpc_ckpt_2.ckpt").write_bytes(b"half a checkpoint")
    resumed = trainer(None, max_steps=3, default_root_dir=tmp_path)
    resumed.fit(Net(), regression_data(), ckpt_path="hpc")
    assert resumed.global_step == 3


def test_only_new_files_are_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"`atomic_write\(mode='a'\)` writes a new file: use 'wb' or 'w'"):
        with atomic_write(tmp_path / "x", "a"):
            pass


def test_plans_are_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = HeteroPlan().save(tmp_path / "plan.yaml")
    monkeypatch.setattr(HeteroPlan, "to_yaml", lambda self: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        HeteroPlan(micro_batches=8).save(path)
    assert HeteroPlan.load(path) == HeteroPlan()


def test_the_strategy_saves_checkpoints_atomically() -> None:
    assert type(trainer(hetero()).strategy.checkpoint_io) is AtomicCheckpointIO
    wrapped = trainer(hetero(), plugins=[AsyncCheckpointIO()]).strategy.checkpoint_io
    assert isinstance(wrapped, AsyncCheckpointIO) and type(wrapped.checkpoint_io) is AtomicCheckpointIO
    chosen = TorchCheckpointIO()
    assert trainer(hetero(), plugins=[chosen]).strategy.checkpoint_io is chosen  # the user's choice stands


def test_storage_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="`storage_options` is not supported by `AtomicCheckpointIO`"):
        AtomicCheckpointIO().save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"a": 1})
