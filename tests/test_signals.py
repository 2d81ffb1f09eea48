"""A signal reaches each process at its own point of a step; every rank acts on it at the same step
(`lightning_hetero/signals.py`): SIGTERM ends training on every rank after one step, and SLURM's
requeue signal saves one whole checkpoint and requeues the job once, while training goes on."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from tests.conftest import SelfSignal, hetero, max_param_diff, trainer, worker_processes
from tests.models import Net, regression_data
from tests.test_launchers import SCRIPT, clean_env, slurm_tasks

TOL = 1e-10


def last_steps(out: Path, ranks: int = 3) -> list[int]:
    return [int((out / f"step{rank}.txt").read_text()) for rank in range(ranks)]


@pytest.mark.parametrize(
    "cpu_fraction,rank,last_step",
    [
        # Global rank 1 notes it after its backward in step 3, when the step's results have been
        # exchanged: every rank learns of it in step 4 and ends after that step.
        (0.5, 1, 5),
        # At `cpu_fraction=0` the CPU worker (rank 0) does not report to the stages, and passes the
        # signal on to them; it was idle throughout, and is brought up to date before the end.
        (0.0, 0, 4),
    ],
    ids=["noted-after-the-exchange", "cpu-worker-without-a-share"],
)
def test_sigterm_under_fork_ends_every_rank_after_the_same_step(
    tmp_path: Path, cpu_fraction: float, rank: int, last_step: int
) -> None:
    """The main process then raises Lightning's `SIGTERMException`, as a single process does, and
    holds what the ranks trained."""
    strategy = hetero(cpu_fraction=cpu_fraction, timeout=20)
    t = trainer(strategy, max_steps=12, callbacks=[SelfSignal(signal.SIGTERM, 3, tmp_path, ranks=[rank])])
    model, plain = Net(), Net()
    with pytest.raises(SIGTERMException):
        t.fit(model, regression_data())
    assert last_steps(tmp_path) == [last_step] * 3
    trainer(None, max_steps=last_step).fit(plain, regression_data())
    assert max_param_diff(plain, model) < TOL


def test_sigterm_to_the_main_process_of_a_fork_run_ends_every_rank_after_the_same_step(tmp_path: Path) -> None:
    """`kill PID` of a script that forked its ranks: the main process passes it on to them."""
    callback = SelfSignal(signal.SIGTERM, 3, tmp_path, ranks=[2], parent=True)
    with pytest.raises(SIGTERMException):
        trainer(hetero(cpu_fraction=0.5, timeout=20), max_steps=12, callbacks=[callback]).fit(Net(), regression_data())
    assert len(set(last_steps(tmp_path))) == 1 and last_steps(tmp_path)[0] < 12


def test_sigterm_to_the_main_process_of_a_popen_run_ends_every_rank_after_the_same_step(tmp_path: Path) -> None:
    """`kill PID` of a popen run: rank 0 notes it before step 3 and passes it on to the processes it
    started, which get it wherever they are; every rank ends after step 3, as in one process."""
    command = [sys.executable, str(SCRIPT), str(tmp_path), "--popen", "--signal", "SIGTERM:3:0"]
    done = subprocess.run(command, env=clean_env(), timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr  # Lightning's SIGTERMException is a SystemExit
    assert last_steps(tmp_path) == [4, 4, 4]
    assert not (tmp_path / "state.pt").exists()  # the script ended in `fit`
    # Every rank ran its `on_exception` hooks, and `OnExceptionCheckpoint` wrote the whole state of step 4.
    checkpoint = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)
    plain = Net()
    trainer(None, max_steps=4).fit(plain, regression_data())
    assert checkpoint["global_step"] == 4 and max_param_diff(plain.state_dict(), checkpoint["state_dict"]) < TOL
    assert checkpoint["optimizer_states"][0]["state"]


def test_slurm_requeue_signal_checkpoints_and_requeues_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SLURM signals every task of a job (`#SBATCH --signal=SIGUSR1@90`) and each gets it at its own
    point of step 5. Lightning's handler would save its checkpoint (a collective here) right there;
    instead every rank saves it at the start of step 6, and rank 0 asks `scontrol` once."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.txt"}\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin")
    out = tmp_path / "out"
    out.mkdir()
    assert slurm_tasks([str(SCRIPT), str(out), "--signal", "SIGUSR1:5"], cwd=tmp_path) == [0, 0, 0]
    assert (tmp_path / "scontrol.txt").read_text() == "requeue 1\n"
    assert [p.name for p in tmp_path.glob("hpc_ckpt_*.ckpt")] == ["hpc_ckpt_1.ckpt"]
    checkpoint = torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 6
    at_six, at_eight = Net(), Net()
    trainer(None, max_steps=6).fit(at_six, regression_data())
    trainer(None, max_steps=8).fit(at_eight, regression_data())
    assert max_param_diff(at_six.state_dict(), checkpoint["state_dict"]) < TOL
    assert max_param_diff(at_eight.state_dict(), torch.load(out / "state.pt")) < TOL  # training went on


def test_ctrl_c_to_the_main_process_of_a_fork_run_stops_its_ranks(tmp_path: Path) -> None:
    """A notebook's "interrupt kernel" signals the main process alone: its ranks must not train on
    (they held the run's port, and the next `fit` in the session failed). The main process answers
    SIGINT as Python does by default, as under a terminal or a kernel (a pytest that a shell without
    job control started in the background inherits SIGINT ignored, and would train on)."""
    callback = SelfSignal(signal.SIGINT, 3, tmp_path, ranks=[2], parent=True)
    before = {p.pid for p in worker_processes()}  # (an earlier test's wandb service may live on)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(SystemExit):  # Lightning's answer to a KeyboardInterrupt
            trainer(hetero(cpu_fraction=0.5, timeout=20), max_steps=200, callbacks=[callback]).fit(Net(), regression_data())
    finally:
        signal.signal(signal.SIGINT, previous)
    assert [p for p in worker_processes() if p.pid not in before] == []
    assert max(last_steps(tmp_path)) < 200
