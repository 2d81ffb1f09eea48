"""On a machine with a GPU: the largest GPT (parameters) that trains on the one GPU with every
bucket offloaded, and without offload, under the same cap on the GPU's memory.

- **Without offload**: plain Lightning on the GPU (``accelerator="gpu"``), AdamW's state on the GPU.
- **Every bucket offloaded**: ``HeteroStrategy(stages=["cuda:0"], cpu_workers=0, mode="fine",
  offload="all")``: AdamW's state and step in CPU memory, the GPU holding the weights and the
  gradients being computed.

The GPT is the recipe's (``recipes.gpt.GPT``: blocks of width ``--width``, context 256, batch 4), and
only its block count grows. For each way, two small probes give the GPU's peak memory per block,
the block count that fills the cap is tried, then a tenth fewer at a time until three steps train.
Every try runs in a process of its own, so an out-of-memory leaves nothing behind in the next.
The cap (``torch.cuda.set_per_process_memory_fraction``, in the process that holds the GPU) keeps
the models, and the time to build them and step them on the CPU, small; the ratio is what
carries over to the whole GPU (the CPU memory the offloaded state needs grows with it).

    python -m benchmarks.largest [--cap-gib G] [--width W]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

from benchmarks.common import Row, step_times
from benchmarks.planner import token_loader

DEFAULTS = dict(cap_gib=8, width=1024)
CONTEXT, VOCAB, BATCH, STEPS = 256, 8000, 4, 3
WAYS = {"without": "plain Lightning on the GPU", "offloaded": "fine mode, every bucket offloaded"}
NAME = "largest GPT that trains on the GPU: every bucket offloaded / without offload (parameters)"
NO_CUDA = "not run: no CUDA device on this machine"


class Capped(L.Callback):
    """On the rank that holds the GPU: cap its memory before the model moves there, and write its
    peak at the end."""

    def __init__(self, cap_gib: float, out: Path) -> None:
        self.cap_gib, self.out = cap_gib, out

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.cap_gib * 2**30 / total), device)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.strategy.root_device.type == "cuda":
            self.out.write_text(json.dumps({"peak_mb": torch.cuda.max_memory_allocated() / 2**20}))


def gpt(layers: int, width: int) -> L.LightningModule:
    from recipes.gpt import GPT

    return GPT(vocab_size=VOCAB, context=CONTEXT, width=width, layers=layers, heads=max(1, width // 64))


def parameters(layers: int, width: int) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in gpt(layers, width).parameters())


def _try(way: str, layers: int, width: int, cap_gib: float) -> None:
    """One try, in this process: train ``STEPS`` steps; the peak is written where ``Capped`` says."""
    from lightning_hetero import HeteroStrategy

    out = Path(sys.argv[-1])
    strategy: Any = None
    kwargs: dict[str, Any] = {"accelerator": "gpu", "devices": 1}
    if way == "offloaded":
        # Forked: this process has not started CUDA, and a fork hands the rank the model without copying it.
        strategy = HeteroStrategy(stages=["cuda:0"], cpu_workers=0, mode="fine", offload="all", start_method="fork")
        kwargs = {}
    step_times(strategy, gpt(layers, width), token_loader(BATCH * STEPS, BATCH, vocab=VOCAB, context=CONTEXT), STEPS,
               callbacks=[Capped(cap_gib, out)], num_sanity_val_steps=0, **kwargs)  # fmt: skip


def attempt(way: str, layers: int, width: int, cap_gib: float) -> Optional[float]:
    """The GPU's peak memory (MB) when ``layers`` blocks train, or ``None`` where they do not."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peak.json"
        command = [sys.executable, "-m", "benchmarks.largest", "--try", way, str(layers), str(width), str(cap_gib), str(out)]
        run = subprocess.run(command, capture_output=True, text=True, timeout=600)
        trained = run.returncode == 0 and out.exists()
        why = "" if trained else (run.stderr.strip().splitlines() or ["no output"])[-1][:200]
        print(f"  {way}, {layers} blocks: {'trains' if trained else 'does not train'} {why}", flush=True)
        return json.loads(out.read_text())["peak_mb"] if trained else None


def largest(way: str, width: int, cap_gib: float) -> dict[str, Any]:
    """The most blocks that train: probes at 1 and 3 blocks, then down from the count that fills the cap."""
    small, larger = attempt(way, 1, width, cap_gib), attempt(way, 3, width, cap_gib)
    if small is None or larger is None:
        return {"layers": 0, "parameters": 0, "per_block_mb": math.nan}
    per_block = (larger - small) / 2
    layers = max(1, int((cap_gib * 1024 - (small - per_block)) / per_block))
    for _ in range(5):
        if layers <= 3 or attempt(way, layers, width, cap_gib) is not None:
            break
        layers = max(3, int(layers * 0.9))
    return {"layers": layers, "parameters": parameters(layers, width), "per_block_mb": per_block}


def measure(cap_gib: float, width: int) -> dict[str, dict[str, Any]]:
    return {way: largest(way, width, cap_gib) for way in WAYS}


def rows(smoke: bool = False, **sizes: Any) -> list[Row]:
    if not torch.cuda.is_available():
        return [Row("CUDA", NAME, math.nan, "", NO_CUDA)]
    sizes = {**DEFAULTS, **(dict(cap_gib=1, width=256) if smoke else {}), **sizes}
    r = measure(**sizes)
    without, offloaded = r["without"], r["offloaded"]
    note = (
        f"under a {sizes['cap_gib']} GiB cap, blocks of width {sizes['width']}: {offloaded['parameters'] / 1e6:.0f} M"
        f" parameters ({offloaded['layers']} blocks) offloaded vs {without['parameters'] / 1e6:.0f} M ({without['layers']})"
    )
    return [Row("CUDA", NAME, offloaded["parameters"] / without["parameters"] if without["parameters"] else math.nan, "", note)]


def main() -> None:
    if "--try" in sys.argv:
        way, layers, width, cap_gib = sys.argv[sys.argv.index("--try") + 1 : sys.argv.index("--try") + 5]
        _try(way, int(layers), int(width), float(cap_gib))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap-gib", type=float, default=DEFAULTS["cap_gib"])
    parser.add_argument("--width", type=int, default=DEFAULTS["width"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return
    for row in rows(cap_gib=args.cap_gib, width=args.width):
        print(f"{row.configuration}: {row.ratio:.3f}  {row.note}")


if __name__ == "__main__":
    main()
