"""Every way of starting the processes trains the same model: fork (the rest of the suite), spawn,
torchrun, and SLURM's srun (simulated: one process per task with srun's environment)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from tests.conftest import hetero, max_param_diff, trainer
from tests.models import Net, regression_data

TOL = 1e-10
SCRIPT = Path(__file__).with_name("external_launch.py")


def reference() -> Net:
    model = Net()
    trainer(None, max_steps=8).fit(model, regression_data())
    return model


def test_spawn() -> None:
    model = Net()
    trainer(hetero(cpu_fraction=0.5, start_method="spawn"), max_steps=8).fit(model, regression_data())
    assert max_param_diff(reference(), model) < TOL


def clean_env() -> dict[str, str]:
    drop = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("SLURM_", "TORCHELASTIC_"))}


def test_torchrun(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3", str(SCRIPT)]
    subprocess.run([*command, str(tmp_path)], check=True, env=clean_env(), timeout=240)
    assert (tmp_path / "environment.txt").read_text() == "TorchElasticEnvironment"
    assert max_param_diff(reference().state_dict(), torch.load(tmp_path / "state.pt")) < TOL


def test_slurm(tmp_path: Path) -> None:
    env = clean_env()
    env.update(
        SLURM_NTASKS="3",
        SLURM_NTASKS_PER_NODE="3",
        SLURM_NNODES="1",
        SLURM_NODEID="0",
        SLURM_JOB_NAME="hetero",
        SLURM_JOB_ID="1",
        SLURM_NODELIST="127.0.0.1",
        MASTER_PORT=str(find_free_network_port()),
    )
    tasks = [
        subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path)], env={**env, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)})
        for i in range(3)
    ]
    assert [task.wait(timeout=240) for task in tasks] == [0, 0, 0]
    assert (tmp_path / "environment.txt").read_text() == "SLURMEnvironment"
    assert max_param_diff(reference().state_dict(), torch.load(tmp_path / "state.pt")) < TOL
