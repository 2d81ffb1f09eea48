"""A multimodal model's encoders, placed: the analyzer's placement vs every encoder on the device vs
every encoder on the CPU worker, and the re-placement that follows a mix of modalities that changes.

The multimodal recipe (``recipes.multimodal``: a CNN encodes the images, word embeddings the
captions, an MLP classifies their sum) on one emulated device beside one CPU worker, as replicas:
the device takes every batch (``cpu_fraction=0``), and the CPU worker computes only the encoders
placed on it. The heterogeneity is emulated (``emulated_speed``: an encoder's forward sleeps out the
time a device of that speed takes, as a process driving a GPU waits for it): the device encodes
``DEVICE`` samples per second of each modality, the CPU worker ``CPU``. In one run, alternating,
repeated:

- on image-heavy batches (every sample has an image, about one in seven a caption): the workload
  analyzer's placement, every encoder on the device (``"split"``: the device has the whole batch),
  every encoder on the CPU worker; each as a ratio of the *ideal*: the emulated encoders' work per
  step, placed as well as any placement can (the slower of the two processes), with nothing else
  costing time;
- on batches whose mix turns from image-heavy to caption-heavy halfway (the recipe's ``phases``):
  the analyzer's placement kept for the whole run vs the same start with ``MixRebalancer`` moving
  the encoders, in the second half, and each against that half's ideal.

    python -m benchmarks.multimodal [--steps S] [--batch B] [--repeats R]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

from benchmarks.common import Row
from lightning_hetero import HeteroStrategy
from lightning_hetero.callbacks import MixRebalancer, WorkloadAnalyzer
from recipes.multimodal import CaptionedDigits, DigitCaptioner

DEVICE = {"image": 1000.0, "text": 400.0}
CPU = {"image": 40.0, "text": 200.0}
SPEEDS = {f"{m}@device": s for m, s in DEVICE.items()} | {f"{m}@cpu": s for m, s in CPU.items()}
DEFAULTS = dict(steps=40, batch=30, repeats=2)
IMAGES, MIXED = [[1.0, 0.15]], [[1.0, 0.15], [0.15, 1.0]]


def ideal(images: int, texts: int) -> float:
    """The emulated encoders' seconds of one step, placed as well as any placement can: the busier
    of the device and the CPU worker (each encoder on one of them)."""
    best = float("inf")
    for image_on, text_on in itertools.product(("device", "cpu"), repeat=2):
        load = {"device": 0.0, "cpu": 0.0}
        load[image_on] += images / (DEVICE if image_on == "device" else CPU)["image"]
        load[text_on] += texts / (DEVICE if text_on == "device" else CPU)["text"]
        best = min(best, max(load.values()))
    return best


class StepLog(L.Callback):
    """Global rank 0 writes each training step's wall time, its images and captions, and the placement."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.steps: list[dict[str, Any]] = []
        self._last: Optional[float] = None
        self._counts = (0, 0)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._counts = (int(batch["has_image"].sum()), int(batch["has_text"].sum()))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        if self._last is not None:
            placement = dict(trainer.strategy.encoder_placement)
            self.steps.append({"seconds": now - self._last, "counts": self._counts, "placement": placement})
        self._last = now

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            follower = [cb for cb in trainer.callbacks if isinstance(cb, MixRebalancer)]
            decisions = follower[0].decisions if follower else []
            self.out.write_text(json.dumps({"steps": self.steps, "decisions": decisions}))


def run(placement: Optional[dict[str, str]], phases: list, steps: int, batch: int, follow: bool) -> list[dict[str, Any]]:
    """One run: ``placement`` as given, or the analyzer's (``None``); ``follow``: with ``MixRebalancer``."""
    strategy = HeteroStrategy(
        stages=["cpu"], cpu_workers=1, parallelism="replicas", cpu_fraction=0.0, start_method="fork",
        emulated_speed=SPEEDS, encoders=placement,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.json"
        callbacks: list[L.Callback] = [StepLog(out)]
        if placement is None:
            callbacks.append(WorkloadAnalyzer(repeats=1, warmup_steps=2, measure_steps=1, save_dir=tmp))
        if follow:
            callbacks.append(MixRebalancer(every_n_steps=3, warmup_steps=1, repeats=1, verbose=False))
        trainer = L.Trainer(
            strategy=strategy, max_steps=steps, limit_val_batches=0, callbacks=callbacks, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        data = CaptionedDigits(batch_size=batch, phases=phases, val_size=len_for(steps, batch))
        trainer.fit(DigitCaptioner(), data)
        return json.loads(out.read_text())["steps"]


def len_for(steps: int, batch: int) -> int:
    """The validation samples that leave one epoch of ``steps`` batches for training (1797 digits)."""
    return max(1, 1797 - steps * batch)


KINDS = {
    "analyzer": (None, IMAGES, False),
    "device": ({}, IMAGES, False),
    "cpu": ({"image": "cpu0", "text": "cpu0"}, IMAGES, False),
    "fixed": (None, MIXED, False),
    "follow": (None, MIXED, True),
}


def measure(steps: int, batch: int, repeats: int) -> dict[str, dict[str, Any]]:
    """Each configuration's median step over the measured steps, that of the ideal over the same steps,
    and the placements it ran."""
    torch.set_num_threads(1)  # this process only launches; keep it fork-safe (see launcher.py)
    found: dict[str, dict[str, Any]] = {k: {"seconds": [], "ideal": [], "placements": []} for k in KINDS}
    for _ in range(repeats):
        for kind, (placement, phases, follow) in KINDS.items():
            logged = run(placement, phases, steps if kind != "cpu" else max(6, steps // 4), batch, follow)
            measured = logged[2:] if len(phases) == 1 else logged[len(logged) // 2 :]  # the second half
            found[kind]["seconds"] += [s["seconds"] for s in measured]
            found[kind]["ideal"] += [ideal(*s["counts"]) for s in measured]
            placements = [json.dumps(s["placement"], sort_keys=True) for s in logged]
            found[kind]["placements"].append(" -> ".join(k for k, _ in itertools.groupby(placements)))
    return {
        k: {"step": statistics.median(v["seconds"]), "ideal": statistics.median(v["ideal"]), "placements": v["placements"]}
        for k, v in found.items()
    }


def rows(smoke: bool = False) -> list[Row]:
    sizes = dict(steps=8, batch=30, repeats=1) if smoke else {}
    m = measure(**{**DEFAULTS, **sizes})
    placed = lambda kind: "placements: " + "; ".join(m[kind]["placements"])  # noqa: E731
    return [
        Row("multimodal", "image-heavy: the analyzer's placement / ideal (step time)", m["analyzer"]["step"] / m["analyzer"]["ideal"], "close to 1", placed("analyzer")),
        Row("multimodal", "image-heavy: every encoder on the device / ideal", m["device"]["step"] / m["device"]["ideal"], "> analyzer's"),
        Row("multimodal", "image-heavy: every encoder on the CPU worker / ideal", m["cpu"]["step"] / m["cpu"]["ideal"], "> analyzer's"),
        Row("multimodal", "mix turns caption-heavy, second half: MixRebalancer / the start's placement kept", m["follow"]["step"] / m["fixed"]["step"], "<= 1", placed("follow")),
        Row("multimodal", "mix turns caption-heavy, second half: MixRebalancer / ideal", m["follow"]["step"] / m["follow"]["ideal"], "close to 1"),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="training steps per run (one epoch)")
    parser.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="samples per batch")
    parser.add_argument("--repeats", type=int, default=DEFAULTS["repeats"])
    args = parser.parse_args()
    results = measure(**vars(args))
    print(f"emulated device {DEVICE} samples/s, CPU worker {CPU}; batch {args.batch}, {args.steps} steps")
    print(f"{'configuration':>10s} {'step (ms)':>10s} {'ideal (ms)':>11s} {'/ ideal':>8s}  placements")
    for kind, result in results.items():
        ratio = result["step"] / result["ideal"]
        print(f"{kind:>10s} {result['step'] * 1e3:10.2f} {result['ideal'] * 1e3:11.2f} {ratio:8.2f}  {'; '.join(result['placements'])}")


if __name__ == "__main__":
    main()
