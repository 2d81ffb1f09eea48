"""Trains `Net` with the hetero strategy in processes started by an external launcher.

Run by tests/test_launchers.py under torchrun, and under a simulated SLURM srun. Usage:
    python tests/external_launch.py OUT_DIR
Rank 0 writes OUT_DIR/state.pt (the trained weights) and OUT_DIR/environment.txt.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import hetero, trainer  # noqa: E402
from tests.models import Net, regression_data  # noqa: E402


def main(out_dir: Path) -> None:
    model = Net()
    t = trainer(hetero(cpu_fraction=0.5), max_steps=8)
    t.fit(model, regression_data())
    if t.global_rank == 0:
        torch.save(model.state_dict(), out_dir / "state.pt")
        (out_dir / "environment.txt").write_text(type(t.strategy.cluster_environment).__name__)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
