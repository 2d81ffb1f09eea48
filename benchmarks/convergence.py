"""The MLP recipe trained to convergence with ``strategy="hetero"`` and with a plain single-device
Trainer, side by side: the same config, data and seed; their loss curves drawn in one picture.

    python -m benchmarks.convergence [--epochs N] [--out docs/mlp_convergence.png]
"""

from __future__ import annotations

import argparse
import csv
import tempfile
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from recipes.mlp import main as mlp

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "mlp.yaml"


def train(tmp: Path, epochs: int, plain: bool) -> dict[str, list[tuple[int, float]]]:
    """Run the recipe; each logged metric as (step, value) pairs."""
    args = [
        "fit", "--config", str(CONFIG), "--trainer.max_epochs", str(epochs),
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir", str(tmp), "--trainer.logger.name", "", "--trainer.logger.version", "",
        "--trainer.log_every_n_steps", "5", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp), "--trainer.callbacks", "[]",
    ]  # fmt: skip
    if plain:
        args += ["--trainer.strategy", "auto", "--trainer.accelerator", "cpu", "--trainer.devices", "1"]
    else:  # fork: this process runs nothing multi-threaded before (see launcher.py)
        args += ["--trainer.strategy.init_args.start_method", "fork"]
    mlp(args)
    series: dict[str, list[tuple[int, float]]] = {}
    with open(tmp / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key not in ("step", "epoch") and value:
                    series.setdefault(key, []).append((int(row["step"]), float(value)))
    return series


def draw(curves: dict[str, list[tuple[int, float]]], out: Path, width: int = 640, height: int = 360) -> None:
    """Loss against step, one polyline per run (hetero blue, plain orange, dashed on top)."""
    image = Image.new("RGB", (width, height), "white")
    pen = ImageDraw.Draw(image)
    margin = 40
    steps = max(s for points in curves.values() for s, _ in points)
    top = max(v for points in curves.values() for _, v in points)
    pen.rectangle([margin, 10, width - 10, height - margin], outline="black")
    colors = {"hetero": (31, 119, 180), "plain": (255, 127, 14)}
    for i, (name, points) in enumerate(curves.items()):
        xy = [(margin + s / steps * (width - margin - 10), height - margin - v / top * (height - margin - 10)) for s, v in points]
        if name == "plain":  # dashed, so the hetero curve beneath shows where they coincide
            for j in range(0, len(xy) - 1, 2):
                pen.line(xy[j : j + 2], fill=colors[name], width=2)
        else:
            pen.line(xy, fill=colors[name], width=3)
        pen.text((width - 200, 20 + 15 * i), f"{name}: train loss", fill=colors[name])
    pen.text((margin, height - margin + 8), f"step 0 .. {steps}; loss 0 .. {top:.2f}", fill="black")
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("docs/mlp_convergence.png"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for name in ("hetero", "plain"):
        with tempfile.TemporaryDirectory() as tmp:
            results[name] = train(Path(tmp), args.epochs, plain=name == "plain")
    draw({name: series["train_loss"] for name, series in results.items()}, args.out)
    hetero, plain = results["hetero"], results["plain"]
    gap = max(abs(a - b) for (_, a), (_, b) in zip(hetero["train_loss"], plain["train_loss"]))
    print(f"MLP recipe (configs/mlp.yaml), {args.epochs} epochs on scikit-learn's digits; curves in {args.out}")
    print(f"{'run':8s} {'final val_acc':>14s} {'final val_loss':>15s} {'final train_loss':>17s}")
    for name, series in results.items():
        print(f"{name:8s} {series['val_acc'][-1][1]:14.4f} {series['val_loss'][-1][1]:15.4f} {series['train_loss'][-1][1]:17.4f}")
    print(f"largest train-loss difference at a logged step: {gap:.2e}")


if __name__ == "__main__":
    main()
