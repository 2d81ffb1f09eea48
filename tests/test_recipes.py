"""The recipes and the command line: every config runs `fit` for a few steps on emulated stages,
`--print_config` round-trips, the `hetero` command runs a recipe, and the IDX reader reads the
files it writes."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_hetero.cli import HeteroCLI
from recipes.data import read_idx, write_idx
from recipes.mlp import DigitsData, main

CONFIGS = sorted(Path(__file__).resolve().parent.parent.joinpath("configs").glob("mlp*.yaml"))


def fake_mnist(directory: Path, train: int = 40, test: int = 20, gz: bool = True) -> Path:
    """Small MNIST-shaped IDX files (random pixels, labels 0-9)."""
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    suffix = ".gz" if gz else ""
    for prefix, n in (("train", train), ("t10k", test)):
        write_idx(directory / f"{prefix}-images-idx3-ubyte{suffix}", torch.randint(0, 256, (n, 28, 28), generator=g))
        write_idx(directory / f"{prefix}-labels-idx1-ubyte{suffix}", torch.randint(0, 10, (n,), generator=g))
    return directory


def quick(config: Path, tmp_path: Path, *extra: str) -> list[str]:
    """Arguments that run ``config`` for a few steps on emulated stages, forked, writing under tmp_path."""
    return [
        "fit", "--config", str(config),
        "--trainer.strategy.init_args.stages", "[cpu, cpu]",
        "--trainer.strategy.init_args.start_method", "fork",
        "--trainer.strategy.init_args.timeout", "60",
        "--trainer.max_steps", "3", "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path),
        "--trainer.logger.init_args.save_dir", str(tmp_path),
        "--data.init_args.batch_size", "20",
        *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_config_fits_a_few_steps(config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MNIST_DIR", str(fake_mnist(tmp_path / "mnist")))
    main(quick(config, tmp_path))
    assert list(tmp_path.glob("wandb/offline-run-*"))  # the run was logged
    assert list(tmp_path.rglob("*.ckpt"))  # and checkpointed
    assert (tmp_path / "trace.json").exists()  # the monitor's trace


def printed(args: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        HeteroCLI(args=[*args, "--print_config"])
    return out.getvalue()


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_print_config_round_trips(config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MNIST_DIR", "data/mnist")
    first = printed(["fit", "--config", str(config)])
    saved = tmp_path / "printed.yaml"
    saved.write_text(first)
    assert printed(["fit", "--config", str(saved)]) == first  # the printed config is the same run


def test_printed_config_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    saved = tmp_path / "printed.yaml"
    saved.write_text(printed(["fit", "--config", str(CONFIGS[0])]))
    main(quick(saved, tmp_path))
    assert list(tmp_path.rglob("*.ckpt"))


def test_hetero_command_runs_a_recipe(tmp_path: Path) -> None:
    config = Path(__file__).resolve().parent.parent / "configs" / "mlp.yaml"
    args = quick(config, tmp_path, "--trainer.logger", "false")
    result = subprocess.run(
        [sys.executable, "-c", "from lightning_hetero.cli import main; main()", *args],
        capture_output=True, text=True, env={"WANDB_SILENT": "true", "PATH": "", "HOME": str(tmp_path)},
        cwd=str(config.parent.parent), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(tmp_path.rglob("*.ckpt"))


@pytest.mark.parametrize(
    "args,message",
    [
        (["--trainer.max_epochs", "many"], "max_epochs"),
        (["--trainer.strategy.init_args.cpu_fraction", "1.5"], "cpu_fraction"),
        (["--model.init_args.no_such_option", "1"], "no_such_option"),
    ],
)
def test_bad_values_are_reported_before_anything_starts(args: list[str], message: str, no_processes: None) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises((SystemExit, ValueError)) as error:
        main(["fit", "--config", str(CONFIGS[0]), *args])
    assert message in err.getvalue() + str(error.value)


@pytest.mark.parametrize("gz", [True, False])
def test_idx_files_round_trip(tmp_path: Path, gz: bool) -> None:
    images = torch.randint(0, 256, (5, 28, 28), dtype=torch.uint8)
    path = tmp_path / ("images.idx.gz" if gz else "images.idx")
    write_idx(path, images)
    assert torch.equal(read_idx(path), images)


def test_a_file_that_is_not_idx_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04abc")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "bad")
    write_idx(tmp_path / "short", torch.zeros(4, 4, dtype=torch.uint8))
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-3])
    with pytest.raises(ValueError, match="bytes follow"):
        read_idx(tmp_path / "short")


def test_mnist_data_from_idx_files(tmp_path: Path) -> None:
    data = DigitsData(data_dir=str(fake_mnist(tmp_path, train=30, test=12, gz=False)), batch_size=10)
    data.setup("fit")
    inputs, labels = next(iter(data.train_dataloader()))
    assert inputs.shape == (10, 784) and 0.0 <= inputs.min() and inputs.max() <= 1.0 and labels.dtype == torch.long
    assert len(data.val) == 12
    with pytest.raises(FileNotFoundError, match="IDX files"):
        missing = DigitsData(data_dir=str(tmp_path / "empty"))
        missing.setup("fit")
