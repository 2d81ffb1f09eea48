"""A failure on any rank (killed, an exception, a hang, killed while saving) ends every rank
promptly with an error that names the rank, its role and the cause; no process is left; the last
complete checkpoint loads, and a run resumed from it trains the model an uninterrupted run trains."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.multiprocessing.spawn import ProcessException

from lightning_hetero import files
from lightning_hetero.launcher import GRACE_S
from tests.conftest import Fault, hetero, max_param_diff, trainer, worker_processes
from tests.models import Net, regression_data
from tests.test_launchers import SCRIPT, clean_env, torchrun_nodes

TOL = 1e-10
TIMEOUT_S = 20
"""The collective timeout of these runs: a failure must end them well within it."""
PROMPT_S = TIMEOUT_S / 2
"""What a failed run may take in all (start, steps, the launcher's grace), where no collective has to time out."""
LAYOUT = "1 CPU worker(s) + 2 stage(s) [cpu, cpu] x 1 node(s)"


@pytest.fixture(scope="module")
def reference() -> dict:
    model = Net().double()
    trainer(None, max_steps=8).fit(model, regression_data())
    return model.state_dict()


def fit(
    ckpt_dir: Path, mode: str = "coarse", fault: Fault | None = None, timeout: float = TIMEOUT_S, resume: bool = False, cpu_fraction: float = 0.5
) -> Net:
    """8 steps (2 epochs of 4 batches), a checkpoint after each epoch's last batch, and `last.ckpt`.
    (Lightning resumes exactly from a checkpoint written there; from one written mid-epoch, or in
    `on_train_epoch_end`, even a plain Trainer does not continue exactly with a loader that cannot resume.)"""
    model = Net().double()  # float64 before a checkpoint loads into it (see test_checkpoint.py)
    checkpoints = ModelCheckpoint(
        dirpath=ckpt_dir, filename="{step}", every_n_train_steps=4, save_top_k=-1, save_last=True
    )
    callbacks = [checkpoints] + ([fault] if fault else [])
    strategy = hetero(mode=mode, cpu_fraction=cpu_fraction, timeout=timeout)
    t = trainer(strategy, max_steps=8, callbacks=callbacks, enable_checkpointing=True)
    t.fit(model, regression_data(), ckpt_path="last" if resume else None)
    return model


def failed_run(ckpt_dir: Path, **kwargs: Any) -> tuple[str, float]:
    """Run ``fit`` that must fail; the error's text with its notes, and the seconds it took."""
    start = time.monotonic()
    with pytest.raises(ProcessException) as error:
        fit(ckpt_dir, **kwargs)
    elapsed = time.monotonic() - start
    assert worker_processes() == [], "a worker process was left running"
    return "\n".join([str(error.value), *getattr(error.value, "__notes__", [])]), elapsed


def assert_resumes_exactly(ckpt_dir: Path, reference: dict, at_step: int, mode: str = "coarse") -> None:
    last = torch.load(ckpt_dir / "last.ckpt", weights_only=False)
    assert last["global_step"] == at_step
    assert max_param_diff(reference, fit(ckpt_dir, mode=mode, resume=True)) < TOL


@pytest.mark.parametrize(
    "rank,how,mode,cause,fraction",
    [
        (0, "kill", "coarse", "was killed by SIGKILL", 0.5),
        (0, "kill", "coarse", "was killed by SIGKILL", 0.0),  # the stages send it their reports one way, a few steps ahead
        (1, "kill", "fine", "was killed by SIGKILL", 0.5),
        (2, "raise", "coarse", "RuntimeError: injected fault", 0.5),
        (0, "raise", "fine", "RuntimeError: injected fault", 0.5),
        (1, "interrupt", "coarse", "This rank was interrupted (KeyboardInterrupt)", 0.5),
        (1, "exit", "coarse", "This rank left the trainer call by `sys.exit(0)`", 0.5),
    ],
    ids=[
        "cpu-worker-killed", "idle-cpu-worker-killed", "stage-killed-fine", "exception-on-stage", "exception-on-cpu-worker-fine",
        "interrupted-stage", "stage-left-by-sys-exit",
    ],
)
def test_a_failed_rank_ends_the_run_promptly_and_the_run_resumes_exactly(
    tmp_path: Path, reference: dict, rank: int, how: str, mode: str, cause: str, fraction: float
) -> None:
    fault = Fault(rank, step=6, how=how, at_start=fraction == 0)  # in the second epoch
    text, elapsed = failed_run(tmp_path, mode=mode, fault=fault, cpu_fraction=fraction)
    assert elapsed < PROMPT_S
    role = ["cpu0", "stage0", "stage1"][rank]
    assert f"global rank {rank} ({role} of {LAYOUT})" in text
    assert cause in text
    assert_resumes_exactly(tmp_path, reference, at_step=4, mode=mode)


def test_a_hung_rank_ends_the_run_after_the_timeout(tmp_path: Path) -> None:
    """A rank that stops taking part without failing: its peers' collectives give up after the
    timeout, and the launcher kills it and names it."""
    text, elapsed = failed_run(tmp_path, fault=Fault(2, step=6, how="hang"), timeout=3)
    assert elapsed < 3 + GRACE_S + PROMPT_S
    assert re.search(r"Timed out waiting 3000ms", text)
    assert f"and killed: global rank 2 (stage1 of {LAYOUT})" in text


class SavesOnRankZeroOnly(L.Callback):
    """A DDP mistake: `trainer.save_checkpoint` (a collective) under `if trainer.is_global_zero:`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("cpu_fraction", [0.5, 0.0])
def test_a_checkpoint_saved_on_rank_zero_alone_is_named_at_once(tmp_path: Path, cpu_fraction: float) -> None:
    """The other ranks would train on while rank 0 waits for them in the save's collectives: every
    rank answers a roll call first, and both sides are told at once what every rank must call."""
    saves = SavesOnRankZeroOnly(tmp_path / "a.ckpt")
    start = time.monotonic()
    with pytest.raises(ProcessException) as error:
        trainer(hetero(cpu_fraction=cpu_fraction, timeout=TIMEOUT_S), max_steps=8, callbacks=[saves]).fit(
            Net().double(), regression_data()
        )
    text = "\n".join([str(error.value), *getattr(error.value, "__notes__", [])])
    assert "out of step" in text and "`trainer.save_checkpoint` under `if trainer.is_global_zero:`" in text, text[-3000:]
    assert time.monotonic() - start < PROMPT_S and worker_processes() == []
    assert not saves.path.exists()


def test_a_checkpoint_saved_on_rank_zero_alone_is_named_when_it_times_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the ranks share no local mesh (as on several hosts), the save's collective times out: its
    error says what every rank must call."""
    import torch.distributed as dist

    monkeypatch.setattr("lightning_hetero.mesh._host", lambda: f"host{dist.get_rank() % 2}")
    with pytest.raises(ProcessException) as error:
        trainer(hetero(cpu_fraction=0.5, timeout=3), max_steps=8, callbacks=[SavesOnRankZeroOnly(tmp_path / "a.ckpt")]).fit(
            Net().double(), regression_data()
        )
    text = "\n".join([str(error.value), *getattr(error.value, "__notes__", [])])
    # Whichever waited first: rank 0 in the save's barrier, or the others for its report of the next step.
    waited = ("did not travel between the ranks within the timeout", "needs every rank, and not every rank came to it")
    assert any(w in text for w in waited) and "`trainer.save_checkpoint` under `if trainer.is_global_zero:`" in text, text[-3000:]
    assert worker_processes() == []


def test_a_rank_killed_while_saving_leaves_the_last_checkpoint_intact(
    tmp_path: Path, reference: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 is killed after writing half of the step-8 checkpoint: the step-4 checkpoint and
    `last.ckpt` are untouched, no file carries the step-8 checkpoint's name, and resuming works."""
    save = torch.save

    def killed_halfway(obj: Any, f: Any) -> None:
        if isinstance(obj, dict) and obj.get("global_step") == 8:
            whole = io.BytesIO()
            save(obj, whole)
            f.write(whole.getvalue()[: whole.tell() // 2])
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        save(obj, f)

    monkeypatch.setattr(files.torch, "save", killed_halfway)  # inherited by the forked workers
    text, elapsed = failed_run(tmp_path)
    assert elapsed < PROMPT_S
    assert f"global rank 0 (cpu0 of {LAYOUT}) was killed by SIGKILL" in text
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["last.ckpt", "step=4.ckpt"]
    assert len(list(tmp_path.glob(f".step=8.ckpt.*{files.PARTIAL_SUFFIX}"))) == 1  # what the kill left
    monkeypatch.undo()
    assert_resumes_exactly(tmp_path, reference, at_step=4)


def popen_with_fault(out: Path, fault: str, *more: str) -> subprocess.CompletedProcess:
    """The external script under popen with ``--fault`` (``RANK:STEP:HOW``); it must fail."""
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--popen", "--fault", fault, *more],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode != 0
    return run


def test_a_killed_stage_ends_a_popen_run_and_names_it(tmp_path: Path) -> None:
    """popen: rank 0 is the main process; it stops the other ranks' processes and names the one that died."""
    start = time.monotonic()
    run = popen_with_fault(tmp_path, "2:6:kill")
    assert f"[hetero] global rank 2 (stage1 of {LAYOUT}) was killed by SIGKILL" in run.stderr
    pids = [int((tmp_path / f"pid{r}.txt").read_text()) for r in range(3)]
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids)
    assert time.monotonic() - start < 120  # three interpreters start on one core; no collective timed out


def test_a_popen_run_names_the_rank_that_raised_first(tmp_path: Path) -> None:
    """popen: the other ranks are other programs, so rank 0 cannot raise their exception; its error says
    which rank failed first and with what (the ranks that failed after it only lost their peer)."""
    run = popen_with_fault(tmp_path, "2:6:raise")
    assert f"[hetero] The first failure: global rank 2 (stage1 of {LAYOUT}) raised RuntimeError: injected fault" in run.stderr


@pytest.mark.parametrize("rank", [0, 2])
def test_on_exception_rank_zero_writes_the_whole_model_it_holds(tmp_path: Path, rank: int) -> None:
    """popen: after an error the other ranks are stopped; global rank 0, a CPU worker holding the whole
    model and its optimizer state, still writes `OnExceptionCheckpoint`'s checkpoint on its own."""
    start = time.monotonic()
    run = popen_with_fault(tmp_path, f"{rank}:3:raise", "--on-exception")
    assert time.monotonic() - start < 60, "a rank waited out the timeout in its own `on_exception` save"
    if rank:
        assert f"[hetero] The first failure: global rank {rank} (stage1 of {LAYOUT}) raised RuntimeError: injected fault" in run.stderr
    else:  # rank 0's own error, not the save's barrier's, after the rest of Lightning's handling
        raised = [line for line in run.stderr.splitlines() if re.match(r"(\[rank0\]: )?\w+(Error|Exception): ", line)]
        assert raised[-1].endswith("RuntimeError: injected fault"), raised
    assert "not under `if trainer.is_global_zero:`" not in run.stderr
    written = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)
    assert written["global_step"] == 3 and written["optimizer_states"][0]["state"]


class _Layout:
    """What `_Script.launch` asks of its strategy, for two local ranks besides this process."""

    world_size = num_processes = 3
    num_nodes = 1

    def rank_name(self, local_rank: int) -> str:
        return f"global rank {local_rank}"


class _Environment:
    def validate_settings(self, **kwargs: Any) -> None:
        pass


def test_a_rank_killed_by_a_signal_comes_before_the_error_another_rank_raised_at_its_death(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """popen: a rank killed by a signal records no error, so the first error recorded (rank 2's, at
    losing its peer) is not called the first failure: the death is named first, then that error."""
    from lightning_hetero import launcher

    script = object.__new__(launcher._Script)
    dies = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    answers = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    script.procs, script._strategy, script.cluster_environment = [dies, answers], _Layout(), _Environment()
    script.num_processes, script.num_nodes, script.in_call = 3, 1, False
    recorded = [(0, "global rank 2", "ConnectionError: global rank 1 closed its connection")]
    monkeypatch.setattr(launcher, "recorded_failures", lambda ranks: recorded)

    def lost_a_peer() -> None:
        dies.wait(), answers.wait()
        raise ConnectionError("a peer closed its connection")

    with pytest.raises(ConnectionError) as failed:
        script.launch(lost_a_peer)
    notes = failed.value.__notes__
    assert notes[0] == "[hetero] global rank 1 was killed by SIGKILL (sent by a user, a scheduler, or the kernel when memory runs out)."
    assert notes[1].startswith("[hetero] The first error raised: global rank 2 raised ConnectionError")
    assert not any("The first failure" in note for note in notes)


def test_torchrun_restarts_resume_from_the_last_checkpoint(tmp_path: Path, reference: dict) -> None:
    """`ModelCheckpoint(save_last=True)` and `fit(ckpt_path="last")`: a stage killed in step 6 of the
    first attempt, torchrun restarts every process, and the run continues from step 4 to the same model."""
    script = [str(SCRIPT), str(tmp_path), "--fault", "2:6:kill", "--resume", str(tmp_path / "ckpt")]
    assert torchrun_nodes(script, nodes=1, flags=["--max-restarts=1"]) == [0]
    assert (tmp_path / "fault.done").exists() and (tmp_path / "restarts.txt").read_text() == "1"
    assert max_param_diff(reference, torch.load(tmp_path / "state.pt")) < TOL
