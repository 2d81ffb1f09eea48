"""Trains `Net` with the hetero strategy where the processes do not come from fork or spawn.

Run by tests/test_launchers.py under torchrun, under a simulated SLURM srun, and with the
strategy's own "popen" launch (which runs this script again for every other rank). Usage:

    python tests/external_launch.py OUT_DIR [--popen | --string] [--unseeded] [--num-nodes N] [--fine]
        [--cpu-workers N] [--shard-across-nodes] [--fault RANK:STEP:HOW] [--resume CKPT_DIR] [--analyzer]

Rank 0 writes OUT_DIR/state.pt (the trained weights) and OUT_DIR/environment.txt; every rank
writes OUT_DIR/rank{N}.pt with the model it holds after fit and OUT_DIR/output{N}.pt with the
model's outputs on 5 samples, computed there after fit. `--unseeded` builds the model without a
seed, so every process starts from different weights unless the strategy aligns them.
`--string` uses plain `Trainer(strategy="hetero")` with all its defaults. With `--num-nodes 2`
(under torchrun) it trains 6 steps on 48 samples, then predicts 25 samples and rank 0 writes
how many it got to OUT_DIR/predicted.txt. After fit, every run also validates and predicts.
Every rank writes its process id to OUT_DIR/pid{N}.txt when it starts.

`--fault 2:6:kill` makes global rank 2 kill itself in training step 6 (`tests.conftest.Fault`;
"raise" raises), on the first attempt only (a marker file in OUT_DIR). `--resume DIR` checkpoints
into DIR at every epoch's last batch (4 steps) with `save_last=True` and fits with `ckpt_path="last"`: a restarted
run (torchrun's `--max-restarts`) continues from the last checkpoint; rank 0 writes torchrun's
restart count to OUT_DIR/restarts.txt. `--analyzer` validates first (which lays the model out in
each process), then fits with a `WorkloadAnalyzer`: the layout stays as validation laid it out.
`--exit-after-fit RANK` makes that global rank leave the script (code 3) right after fit; otherwise
the script saves OUT_DIR/after_fit.ckpt with `trainer.save_checkpoint` right after fit (the other
ranks also do with `--checkpoint-after-exit`); `--new-trainer` validates and predicts after fit with a new Trainer and
strategy, made as the first ones were. `--fail-before-fit LOCAL_RANK` makes that rank raise
before it makes its Trainer. `--lr-find` runs `Tuner(trainer).lr_find` (`LR_FIND`) before fit, and
every rank writes what it found to OUT_DIR/lr_find{N}.json. `--another-model` then validates and
predicts with another model object (`Net(seed=7)`, as one loaded from a checkpoint to predict with
would be) on the same Trainer, and predicts with a third loaded from the checkpoint saved after fit
(`ckpt_path`); rank 0 writes their predictions to OUT_DIR/another.pt and another_from_checkpoint.pt. `--strict` then
validates from a checkpoint that lacks a weight of the last block (strict loading must refuse it
on every rank, as in one process); every rank writes what it raised to OUT_DIR/strict{N}.txt.
`--signal NAME:STEP[:RANK]` makes every rank (or the one given) send itself that signal in training
step STEP, each at its own point of the step (`tests.conftest.SelfSignal`); each rank writes its
global step after every batch to OUT_DIR/step{N}.txt; an `OnExceptionCheckpoint` writes OUT_DIR/on_exception.ckpt.
`--model tied` trains `TiedNet` (its first layer's weight also used by its head, a stage apart);
`--model replicas` trains `Net` as replicas (`parallelism="replicas"`); `--model batchnorm` trains
`BatchNormNet` as replicas with whole-batch statistics (`sync_batchnorm=True`). `--cpu-workers N`
runs N CPU workers per node; `--shard-across-nodes` splits their optimizer state between every
node's (`shard_across_nodes=True`); every rank writes the optimizer state it held to
OUT_DIR/optimizer{N}.pt (`tests.conftest.OptimizerMemory`).
"""

import argparse
import os
import signal
import warnings
import sys
from pathlib import Path

import json

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.tuner import Tuner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_hetero.callbacks import WorkloadAnalyzer  # noqa: E402
from tests.conftest import Fault, OptimizerMemory, SelfSignal, hetero, trainer  # noqa: E402
from tests.models import BatchNormNet, Net, TiedNet, regression_data  # noqa: E402


ANOTHER = regression_data(n=10, batch_size=5, seed=4)
"""What ``--another-model`` predicts on."""

LR_FIND = dict(num_training=6, early_stop_threshold=None, update_attr=False)
"""The learning rate finder's arguments (``--lr-find``): a few steps, every one of them kept."""


class WritePid(L.Callback):
    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        (self.out_dir / f"pid{trainer.global_rank}.txt").write_text(str(os.getpid()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--popen", action="store_true")
    parser.add_argument("--string", action="store_true")
    parser.add_argument("--unseeded", action="store_true")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--fine", action="store_true", help="fine mode, the last layers' bucket offloaded")
    parser.add_argument("--fault", help="RANK:STEP:HOW, e.g. 2:6:kill")
    parser.add_argument("--on-exception", action="store_true", help="an OnExceptionCheckpoint writes OUT_DIR/on_exception.ckpt")
    parser.add_argument("--resume", type=Path, help="checkpoint directory; fit with ckpt_path='last'")
    parser.add_argument("--analyzer", action="store_true", help="validate first, then fit with a WorkloadAnalyzer")
    parser.add_argument("--exit-after-fit", type=int, help="this global rank exits (code 3) right after fit")
    parser.add_argument("--fail-before-fit", type=int, help="this local rank raises before the Trainer is made")
    parser.add_argument("--checkpoint-after-exit", action="store_true", help="the others save a checkpoint anyway")
    parser.add_argument("--new-trainer", action="store_true", help="validate and predict with a new Trainer after fit")
    parser.add_argument("--another-model", action="store_true", help="validate and predict with another model after it all")
    parser.add_argument("--strict", action="store_true", help="validate from a checkpoint that lacks a weight")
    parser.add_argument("--model", choices=["net", "tied", "replicas", "batchnorm"], default="net")
    parser.add_argument("--cpu-workers", type=int, default=1)
    parser.add_argument("--shard-across-nodes", action="store_true")
    parser.add_argument("--lr-find", action="store_true", help="run Tuner(trainer).lr_find before fit")
    parser.add_argument("--signal", help="NAME:STEP[:RANK], e.g. SIGUSR1:5 (every rank) or SIGTERM:3:0")
    parser.add_argument(
        "--differ",
        help="RANK:WHAT: this local rank builds a fine-mode strategy (mode), a wider model (width),"
        " a Trainer with more steps (steps) or another fixed CPU share (fraction)",
    )
    args = parser.parse_args()
    if args.fail_before_fit is not None and int(os.environ.get("LOCAL_RANK", 0)) == args.fail_before_fit:
        raise FileNotFoundError("this rank's data is missing")
    # float64 from the start where a checkpoint may load into it (it would be rounded to float32).
    model = {"tied": TiedNet, "batchnorm": BatchNormNet}.get(args.model, Net)(seed=None if args.unseeded else 0)
    model = model.to(torch.float64 if args.resume else torch.float32)
    differ = args.differ.split(":") if args.differ and int(os.environ.get("LOCAL_RANK", 0)) == int(args.differ.split(":")[0]) else []
    if differ[1:] == ["width"]:  # the model a differing configuration would build
        model = Net(width=17, seed=0)
    layout: dict = {"mode": "fine", "offload": [0], "bucket_size_mb": 1e-5} if args.fine or differ[1:] == ["mode"] else {}
    if args.cpu_workers != 1 or args.shard_across_nodes:
        layout.update(cpu_workers=args.cpu_workers, shard_across_nodes=args.shard_across_nodes)
    if args.model in ("replicas", "batchnorm"):
        layout["parallelism"] = "replicas"
    start_method = "popen" if args.popen else "fork"
    fraction = 0.25 if differ[1:] == ["fraction"] else 0.5
    strategy = "hetero" if args.string else hetero(cpu_fraction=fraction, start_method=start_method, **layout)
    callbacks: list = [WritePid(args.out_dir), OptimizerMemory(args.out_dir)]
    if args.fault:
        rank, step, how = args.fault.split(":")
        callbacks.append(Fault(int(rank), int(step), how, once=args.out_dir / "fault.done"))
    if args.signal:
        name, step, *rank = args.signal.split(":")
        ranks = [int(r) for r in rank] or None
        callbacks.append(SelfSignal(getattr(signal, name), int(step), args.out_dir, ranks))
    if args.signal or args.on_exception:
        callbacks.append(OnExceptionCheckpoint(args.out_dir))
    if args.resume:
        callbacks.append(ModelCheckpoint(dirpath=args.resume, filename="{step}", every_n_train_steps=4, save_last=True))
    if args.analyzer:
        callbacks.append(WorkloadAnalyzer(warmup_steps=2, measure_steps=1, repeats=1, contention_s=0.05))
    t = trainer(
        strategy,
        max_steps=(8 if args.num_nodes == 1 else 6) + (2 if differ[1:] == ["steps"] else 0),
        num_nodes=args.num_nodes,
        sync_batchnorm=args.model == "batchnorm",
        callbacks=callbacks,
        enable_checkpointing=bool(args.resume or args.signal or args.on_exception),
    )
    if args.analyzer:
        t.validate(model, regression_data(n=20, seed=3), verbose=False)
    if args.lr_find:
        found = Tuner(t).lr_find(model, regression_data(n=44), **LR_FIND)
        (args.out_dir / f"lr_find{t.global_rank}.json").write_text(json.dumps(found.results))
    t.fit(model, regression_data(n=44 if args.num_nodes == 1 else 48), ckpt_path="last" if args.resume else None)
    if args.resume and t.global_rank == 0:
        (args.out_dir / "restarts.txt").write_text(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if t.global_rank == args.exit_after_fit:
        sys.exit(3)
    if args.exit_after_fit is None or args.checkpoint_after_exit:  # every rank takes part in writing a checkpoint
        t.save_checkpoint(args.out_dir / "after_fit.ckpt")  # the whole optimizer state, as a plain fit leaves it
    if args.new_trainer:  # the calls after fit through a new Trainer and strategy, made as the first ones were
        t = trainer(hetero(cpu_fraction=0.5, start_method=start_method, **layout), max_steps=8)
    # Code after fit reads the whole trained model on every rank, as under DDP.
    held = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = regression_data(n=5, seed=5).dataset.tensors[0].to(next(model.parameters()).dtype)
    with torch.no_grad():
        torch.save(model(inputs), args.out_dir / f"output{t.global_rank}.pt")
    t.validate(model, regression_data(n=20, seed=3), verbose=False)
    predicted = t.predict(model, regression_data(n=25, batch_size=6, seed=4))
    assert not any(v.is_meta for v in model.state_dict().values()), "a trainer call left part of the model on meta"
    torch.save(held, args.out_dir / f"rank{t.global_rank}.pt")
    # The warnings the strategy quiets during a call are shown again after it (this is the user's process).
    quieted = [f for f in warnings.filters if f[0] == "ignore" and f[1] and "``update`` method" in f[1].pattern]
    (args.out_dir / f"quieted{t.global_rank}.txt").write_text(str(len(quieted)))
    if t.global_rank == 0:
        torch.save(held, args.out_dir / "state.pt")
        (args.out_dir / "environment.txt").write_text(type(t.strategy.cluster_environment).__name__)
        (args.out_dir / "predicted.txt").write_text(str(sum(len(p) for p in predicted)))
    if args.another_model:
        other = Net(seed=7).to(next(model.parameters()).dtype)
        t.validate(other, regression_data(n=20, seed=3), verbose=False)
        predicted = t.predict(other, ANOTHER)
        loaded = t.predict(Net(seed=7).to(other.layers[0].weight.dtype), ANOTHER, ckpt_path=args.out_dir / "after_fit.ckpt")
        if t.global_rank == 0:
            torch.save(torch.cat(predicted), args.out_dir / "another.pt")
            torch.save(torch.cat(loaded), args.out_dir / "another_from_checkpoint.pt")
    if args.strict:
        lacking = torch.load(args.out_dir / "after_fit.ckpt", weights_only=False)
        del lacking["state_dict"]["layers.4.weight"]
        torch.save(lacking, args.out_dir / f"lacking{t.global_rank}.ckpt")
        try:
            t.validate(model, regression_data(n=20, seed=3), ckpt_path=args.out_dir / f"lacking{t.global_rank}.ckpt", verbose=False)
            raised = "nothing"
        except RuntimeError as error:
            raised = str(error)
        (args.out_dir / f"strict{t.global_rank}.txt").write_text(raised)


if __name__ == "__main__":
    main()
