"""Trains `Net` with the hetero strategy where the processes do not come from fork or spawn.

Run by tests/test_launchers.py under torchrun, under a simulated SLURM srun, and with the
strategy's own "popen" launch (which runs this script again for every other rank). Usage:

    python tests/external_launch.py OUT_DIR [--popen | --string] [--unseeded] [--num-nodes N] [--fine]

Rank 0 writes OUT_DIR/state.pt (the trained weights) and OUT_DIR/environment.txt; every rank
writes OUT_DIR/rank{N}.pt with the parameters it holds. `--unseeded` builds the model without a
seed, so every process starts from different weights unless the strategy aligns them.
`--string` uses plain `Trainer(strategy="hetero")` with all its defaults. With `--num-nodes 2`
(under torchrun) it trains 6 steps on 48 samples, then predicts 25 samples and rank 0 writes
how many it got to OUT_DIR/predicted.txt. After fit, every run also validates and predicts.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import hetero, trainer  # noqa: E402
from tests.models import Net, regression_data  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--popen", action="store_true")
    parser.add_argument("--string", action="store_true")
    parser.add_argument("--unseeded", action="store_true")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--fine", action="store_true", help="fine mode, the last layers' bucket offloaded")
    args = parser.parse_args()
    model = Net(seed=None if args.unseeded else 0)
    layout = {"mode": "fine", "offload": [0], "bucket_size_mb": 1e-5} if args.fine else {}
    start_method = "popen" if args.popen else "fork"
    strategy = "hetero" if args.string else hetero(cpu_fraction=0.5, start_method=start_method, **layout)
    t = trainer(strategy, max_steps=8 if args.num_nodes == 1 else 6, num_nodes=args.num_nodes)
    t.fit(model, regression_data(n=44 if args.num_nodes == 1 else 48))
    held = {k: v.clone() for k, v in model.state_dict().items() if not v.is_meta}
    t.validate(model, regression_data(n=20, seed=3), verbose=False)
    predicted = t.predict(model, regression_data(n=25, batch_size=6, seed=4))
    torch.save(held, args.out_dir / f"rank{t.global_rank}.pt")
    if t.global_rank == 0:
        torch.save({k: held[k] for k in model.state_dict()}, args.out_dir / "state.pt")
        (args.out_dir / "environment.txt").write_text(type(t.strategy.cluster_environment).__name__)
        (args.out_dir / "predicted.txt").write_text(str(sum(len(p) for p in predicted)))


if __name__ == "__main__":
    main()
