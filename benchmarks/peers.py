"""Hetero against Lightning's own best setups on the same cores, for the recipes' models.

Three ways to train each recipe's model on this machine, alternating in one run:

- plain Lightning, one process with all the cores' threads (``accelerator="cpu", devices=1``);
- Lightning's ``strategy="ddp"`` on the CPU, one process per core, each with its part of the batch
  (the same global batch);
- ``strategy="hetero"`` as the recipe's default config lays it out: 1 CPU worker + 2 emulated
  stages, with the config's CPU fraction; for a model without blocks (a Hugging Face GPT-2, the
  causal LM recipe's), replicas: 1 CPU worker + 1 emulated device, half of each batch each, which
  is DDP's split on the same two processes (what hetero costs over DDP where the devices are equal).

Reported: samples per second of hetero over each of the others. With no GPU, hetero's stages are
processes on the same cores, so this compares three ways of sharing two cores, not hetero's
purpose (putting an idle CPU beside GPUs); it shows what the strategy costs where it cannot help.

    python -m benchmarks.peers [--steps N] [--repeats R]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from benchmarks.common import Row, interleave, step_times
from benchmarks.planner import digits_loader, token_loader
from lightning_hetero import HeteroStrategy
from lightning_hetero.launcher import preload_forkserver

DEFAULTS = dict(steps=30, repeats=2)


def recipes(steps: int, smoke: bool) -> list[tuple[str, Callable[[], L.LightningModule], int, Callable[[int], DataLoader], dict]]:
    """(name, model, batch size, loader of a given batch size, the hetero layout of the recipe's config)."""
    from recipes.causal_lm import CausalLM, lm_batch
    from recipes.gpt import GPT
    from recipes.mlp import DigitsMLP

    gpt = (lambda: GPT(width=32, heads=2, layers=2)) if smoke else (lambda: GPT())
    size = dict(n_embd=32, n_layer=1, n_head=2) if smoke else dict(n_embd=128, n_layer=4, n_head=4)
    config = dict(vocab_size=2000, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **size)

    def lm_loader(batch: int) -> DataLoader:
        windows = token_loader(batch * steps, batch).dataset
        return DataLoader(windows, batch_size=batch, collate_fn=lm_batch, drop_last=True)

    pipeline = dict(stages=["cpu", "cpu"])
    return [
        ("MLP recipe (digits)", DigitsMLP, 100, lambda b: digits_loader(b * steps, b), dict(pipeline, cpu_fraction=0.3)),
        ("GPT recipe (small)", gpt, 32, lambda b: token_loader(b * steps, b), dict(pipeline, cpu_fraction=0.25)),
        (
            "HF GPT-2, replicas",
            lambda: CausalLM(config=config),
            32,
            lm_loader,
            dict(stages=["cpu"], parallelism="replicas", cpu_fraction=0.5),
        ),
    ]


def measure(steps: int, repeats: int, smoke: bool = False) -> list[dict]:
    cores = torch.get_num_threads()
    # The forkserver that DDP's runs start first is the one hetero's use too: have it import once what
    # every rank of either needs (the recipes' models, and the package as hetero's launcher would).
    preload_forkserver(["recipes.mlp", "recipes.gpt", "recipes.causal_lm"])
    results = []
    for name, model, batch, loader, layout in recipes(steps, smoke):
        # forkserver: the workers must not fork from this process, which runs torch with threads.
        configs = {
            "plain": lambda: step_times(None, model(), loader(batch), steps),
            "ddp": lambda: step_times(
                DDPStrategy(process_group_backend="gloo", start_method="forkserver"),
                model(),
                loader(batch // cores),
                steps,
                accelerator="cpu",
                devices=cores,
            ),
            "hetero": lambda: step_times(
                HeteroStrategy(**layout, start_method="forkserver"),
                model(),
                loader(batch),
                steps,
            ),
        }
        times = interleave(configs, repeats)
        results.append({"model": name, "batch": batch, **{k: batch / statistics.median(t) for k, t in times.items()}})
    return results


def rows(smoke: bool = False) -> list[Row]:
    sizes = dict(steps=6, repeats=1) if smoke else DEFAULTS
    out = []
    for r in measure(**sizes, smoke=smoke):
        for peer, label in (("plain", "one process, all threads"), ("ddp", 'strategy="ddp" on the CPU')):
            out.append(
                Row(
                    "hetero vs Lightning",
                    f"{r['model']}, batch {r['batch']}: hetero / {label} (samples/s)",
                    r["hetero"] / r[peer],
                    "",
                    f"{r[peer]:.0f} vs {r['hetero']:.0f} samples/s",
                )
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    parser.add_argument("--repeats", type=int, default=DEFAULTS["repeats"])
    args = parser.parse_args()
    results = measure(args.steps, args.repeats)
    print(f"samples/s on {torch.get_num_threads()} cores")
    print(f"{'model':24s} {'plain':>8s} {'ddp':>8s} {'hetero':>8s} {'vs plain':>9s} {'vs ddp':>7s}")
    for r in results:
        print(
            f"{r['model']:24s} {r['plain']:8.0f} {r['ddp']:8.0f} {r['hetero']:8.0f}"
            f" {r['hetero'] / r['plain']:9.3f} {r['hetero'] / r['ddp']:7.3f}"
        )


if __name__ == "__main__":
    main()
