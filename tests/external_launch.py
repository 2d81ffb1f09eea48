"""Trains `Net` with the hetero strategy where the processes do not come from fork or spawn.

Run by tests/test_launchers.py under torchrun, under a simulated SLURM srun, and with the
strategy's own "popen" launch (which runs this script again for every other rank). Usage:

    python tests/external_launch.py OUT_DIR [--popen | --string] [--unseeded]

Rank 0 writes OUT_DIR/state.pt (the trained weights) and OUT_DIR/environment.txt; every rank
writes OUT_DIR/rank{N}.pt with the parameters it holds. `--unseeded` builds the model without a
seed, so every process starts from different weights unless the strategy aligns them.
`--string` uses plain `Trainer(strategy="hetero")` with all its defaults.
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
    args = parser.parse_args()
    model = Net(seed=None if args.unseeded else 0)
    strategy = "hetero" if args.string else hetero(cpu_fraction=0.5, start_method="popen" if args.popen else "fork")
    t = trainer(strategy, max_steps=8)
    t.fit(model, regression_data())
    held = {k: v for k, v in model.state_dict().items() if not v.is_meta}
    torch.save(held, args.out_dir / f"rank{t.global_rank}.pt")
    if t.global_rank == 0:
        torch.save(model.state_dict(), args.out_dir / "state.pt")
        (args.out_dir / "environment.txt").write_text(type(t.strategy.cluster_environment).__name__)


if __name__ == "__main__":
    main()
