"""Every way of starting the processes trains the same model: fork (the rest of the suite), spawn,
popen, torchrun, and SLURM's srun (simulated: one process per task with srun's environment)."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from tests.conftest import TIMEOUT, RecordCopies, assert_copies_identical, hetero, max_param_diff, trainer
from tests.models import BatchNormNet, Net, TiedNet, regression_data
from tests.external_launch import ANOTHER

TOL = 1e-10
SCRIPT = Path(__file__).with_name("external_launch.py")


@pytest.fixture(scope="module")
def reference() -> dict:
    model = Net()
    trainer(None, max_steps=8).fit(model, regression_data())
    return model.state_dict()


UNGUARDED = """
import sys
sys.path.insert(0, {root!r})
from tests.conftest import hetero, trainer
from tests.models import Net, regression_data
{guard}trainer(hetero(start_method={method!r})).fit(Net(), regression_data())
print("trained")
"""


def run_script(path: Path, text: str) -> subprocess.CompletedProcess:
    path.write_text(text)
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=240, env=environment)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_a_script_that_starts_the_trainer_at_its_top_level_is_told_of_the_guard(tmp_path: Path, start_method: str) -> None:
    """Each spawned process imports the script again: a fit at its top level is refused before any
    process starts, with the line."""
    script = tmp_path / "train.py"
    done = run_script(script, UNGUARDED.format(root=str(Path(__file__).parent.parent), guard="", method=start_method))
    assert done.returncode != 0
    assert f"started at its top level ({script}, line 6)" in done.stderr and '`if __name__ == "__main__":`' in done.stderr
    assert "exited with code" not in done.stderr and "Initializing distributed" not in done.stderr


def test_a_script_that_starts_the_trainer_under_the_guard_is_not_refused(tmp_path: Path) -> None:
    """The check on its own (a spawned fit under the guard trains: the spawn tests above and below)."""
    text = (
        "from lightning_hetero.launcher import _check_main_guard\n"
        "def main():\n    _check_main_guard('spawn')\n"
        "if __name__ == '__main__':\n    _check_main_guard('spawn')\n    main()\n    print('accepted')\n"
        "for _ in range(1):\n    _check_main_guard('spawn')\n"
    )
    done = run_script(tmp_path / "train.py", text)
    assert "accepted" in done.stdout and "line 9)" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("start_method,precision", [("spawn", "32-true"), ("forkserver", "32-true")])
def test_spawned_processes_own_their_parameters(tmp_path: Path, start_method: str, precision: str) -> None:
    """spawn/forkserver children receive the model's tensors in shared memory; each must copy them."""
    plain = Net()
    trainer(None, max_steps=8, precision=precision).fit(plain, regression_data())
    model = Net()
    strategy = hetero(cpu_fraction=0.5, start_method=start_method)
    t = trainer(strategy, max_steps=8, precision=precision, callbacks=[RecordCopies(tmp_path)])
    t.fit(model, regression_data())
    assert_copies_identical(tmp_path)
    assert max_param_diff(plain, model) < (TOL if precision == "64-true" else 1e-5)


class ImportedWhere(L.Callback):
    """Each rank writes whether the models' module was imported before the rank's process began."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from tests import models

        (self.out / f"rank{trainer.global_rank}").write_text("inherited" if models.IMPORTED_BY != os.getpid() else "imported")


def test_forkserver_ranks_start_with_the_package_and_the_model_imported(tmp_path: Path) -> None:
    """The forkserver imports the package and the model's module once, as it starts; every rank it
    forks has them already (a spawned rank imports them itself, seconds of every start)."""
    t = trainer(hetero(cpu_fraction=0.5, start_method="forkserver"), max_steps=2, callbacks=[ImportedWhere(tmp_path)])
    t.fit(Net(), regression_data())
    assert sorted(p.read_text() for p in tmp_path.glob("rank*")) == ["inherited"] * 3


def clean_env() -> dict[str, str]:
    drop = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "NODE_RANK")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("SLURM_", "TORCHELASTIC_"))}


def torchrun(out: Path, *flags: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3", str(SCRIPT)]
    subprocess.run([*command, str(out), *flags], check=True, env=clean_env(), timeout=240)


def slurm_tasks(args: list[str], tasks: int = 3, cwd: Path | None = None, timeout: int = 240) -> list[int]:
    """Run ``python *args`` once per task with srun's environment (one node); their exit codes."""
    env = clean_env()
    env.update(
        SLURM_NTASKS=str(tasks),
        SLURM_NTASKS_PER_NODE=str(tasks),
        SLURM_NNODES="1",
        SLURM_NODEID="0",
        SLURM_JOB_NAME="hetero",
        SLURM_JOB_ID="1",
        SLURM_NODELIST="127.0.0.1",
        MASTER_PORT=str(find_free_network_port()),
    )
    processes = [
        subprocess.Popen([sys.executable, *args], env={**env, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)}, cwd=cwd)
        for i in range(tasks)
    ]
    return [process.wait(timeout=timeout) for process in processes]


def torchrun_nodes(
    args: list[str],
    nodes: int = 2,
    per_node: int = 3,
    cwd: Path | None = None,
    timeout: int = 240,
    flags: Sequence[str] = (),
) -> list[int]:
    """Run ``torchrun [flags] ... *args`` as ``nodes`` nodes on this machine; their exit codes."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", *flags, f"--nnodes={nodes}", f"--nproc-per-node={per_node}"]
    torchrun += ["--master-addr=127.0.0.1", f"--master-port={find_free_network_port()}"]
    processes = [
        subprocess.Popen([*torchrun, f"--node-rank={n}", *args], env=clean_env(), cwd=cwd) for n in range(nodes)
    ]
    return [process.wait(timeout=timeout) for process in processes]


def slurm(out: Path) -> None:
    assert slurm_tasks([str(SCRIPT), str(out)]) == [0, 0, 0]


def popen(out: Path, *flags: str) -> None:
    subprocess.run([sys.executable, str(SCRIPT), str(out), "--popen", *flags], check=True, env=clean_env(), timeout=240)


def string_strategy(out: Path) -> None:
    """`Trainer(strategy="hetero")` with every default: popen launch, two emulated stages, auto fraction."""
    subprocess.run([sys.executable, str(SCRIPT), str(out), "--string"], check=True, env=clean_env(), timeout=240)


@pytest.mark.parametrize(
    "launch,environment",
    [
        (torchrun, "TorchElasticEnvironment"),
        (slurm, "SLURMEnvironment"),
        (popen, "LightningEnvironment"),
        (string_strategy, "LightningEnvironment"),
    ],
    ids=["torchrun", "slurm", "popen", "string-strategy"],
)
def test_external_processes(tmp_path: Path, reference: dict, launch, environment: str) -> None:
    launch(tmp_path)
    assert (tmp_path / "environment.txt").read_text() == environment
    assert [(tmp_path / f"quieted{r}.txt").read_text() for r in range(3)] == ["0"] * 3
    assert max_param_diff(reference, torch.load(tmp_path / "state.pt")) < TOL
    assert_every_rank_holds_the_model(tmp_path, ranks=3)


@pytest.mark.parametrize("launch", [torchrun, popen], ids=["torchrun", "popen"])
def test_replicas_under_external_launchers(tmp_path: Path, reference: dict, launch) -> None:
    """Whole replicas on every process (a CPU worker and two device replicas) train as one process."""
    launch(tmp_path, "--model=replicas")
    assert max_param_diff(reference, torch.load(tmp_path / "state.pt")) < TOL
    assert_every_rank_holds_the_model(tmp_path, ranks=3)


@pytest.mark.parametrize(
    "flags", [["--fine"], ["--cpu-workers=2"], ["--fine", "--cpu-workers=2"]], ids=["offloaded", "split", "offloaded-split"]
)
def test_a_checkpoint_saved_after_fit_holds_the_whole_optimizer_state(tmp_path: Path, flags: list[str]) -> None:
    """`trainer.save_checkpoint` after fit, where the processes live on (popen): the optimizer state of an
    offloaded bucket, and the parts the CPU workers split, are in it, as in one process's."""
    plain = Net()
    run = trainer(None, max_steps=8, precision="32-true")
    run.fit(plain, regression_data(n=44))
    expected = run.optimizers[0].state_dict()["state"]
    popen(tmp_path, *flags)
    saved = torch.load(tmp_path / "after_fit.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    assert sorted(saved) == sorted(expected)
    for position, state in expected.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(saved[position][key].float(), state[key], rtol=1e-4, atol=1e-7), (position, key)


def test_the_tuners_learning_rate_finder_under_popen(tmp_path: Path, reference: dict) -> None:
    """`Tuner(trainer).lr_find` ends its fit in every process at once (an orderly end, not a failure
    that stops the others): every rank finds what one process finds, and the fit after it in the same
    processes starts from where the finder started, as in one process."""
    from lightning.pytorch.tuner import Tuner

    from tests.external_launch import LR_FIND

    plain = Tuner(trainer(None, max_steps=8)).lr_find(Net(), regression_data(n=44), **LR_FIND).results
    popen(tmp_path, "--lr-find")
    for rank in range(3):
        found = json.loads((tmp_path / f"lr_find{rank}.json").read_text())
        assert found["lr"] == plain["lr"] and len(found["loss"]) == len(plain["loss"]) == LR_FIND["num_training"]
        assert max(abs(a - b) for a, b in zip(found["loss"], plain["loss"])) < TOL
    assert max_param_diff(reference, torch.load(tmp_path / "state.pt")) < TOL


def test_tied_weights_under_popen(tmp_path: Path) -> None:
    plain = TiedNet()
    trainer(None, max_steps=8).fit(plain, regression_data())
    popen(tmp_path, "--model=tied")
    assert max_param_diff(plain.state_dict(), torch.load(tmp_path / "state.pt")) < TOL
    assert_every_rank_holds_the_model(tmp_path, ranks=3)


def assert_every_rank_holds_the_model(out: Path, ranks: int) -> None:
    """After fit, every rank's module was the whole trained model, and computed with it."""
    held = [torch.load(out / f"rank{r}.pt") for r in range(ranks)]
    outputs = [torch.load(out / f"output{r}.pt") for r in range(ranks)]
    for rank in range(1, ranks):
        assert set(held[rank]) == set(held[0])
        assert max_param_diff(held[0], held[rank]) == 0
        assert torch.equal(outputs[rank], outputs[0])


@pytest.mark.parametrize("mode,model", [("coarse", "net"), ("fine", "net"), ("fine", "tied")])
def test_two_nodes_match_ddp_on_two_processes(tmp_path: Path, mode: str, model: str) -> None:
    """Two hetero groups (torchrun nodes on this machine) are data-parallel replicas: they train as
    DDP does with one process per node, on the same per-node batches (with tied weights too, summed
    between the stages of each node, then averaged between the nodes)."""
    ddp = (TiedNet if model == "tied" else Net)().double()  # the fork launcher loads the trained weights into it
    t = trainer("ddp_fork", accelerator="cpu", devices=2, max_steps=6)
    t.fit(ddp, regression_data(n=48))
    script = [str(SCRIPT), str(tmp_path), "--num-nodes=2", f"--model={model}", *(["--fine"] if mode == "fine" else [])]
    assert torchrun_nodes(script) == [0, 0]
    assert max_param_diff(ddp.state_dict(), torch.load(tmp_path / "state.pt")) < TOL
    assert_every_rank_holds_the_model(tmp_path, ranks=6)  # on both nodes
    assert (tmp_path / "predicted.txt").read_text() == "13"  # node 0's share of 25 samples


def test_two_nodes_of_the_strategys_own_fork_launch_start_from_one_model(tmp_path: Path) -> None:
    """`start_method="fork"` on every node (`NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT` set): each node's
    main process builds its own model, unseeded here; every rank starts from global rank 0's and
    ends with the same trained model."""
    env = {**clean_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_network_port())}
    script = [sys.executable, str(SCRIPT), str(tmp_path), "--num-nodes=2", "--unseeded"]
    processes = [subprocess.Popen(script, env={**env, "NODE_RANK": str(n)}) for n in range(2)]
    assert [process.wait(timeout=240) for process in processes] == [0, 0]
    # Each node's main process holds what its first rank (global rank 0, 3) handed back.
    held = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 3)]
    assert max_param_diff(held[0], held[1]) == 0


@pytest.mark.parametrize(
    ("mode", "cpu_workers", "across"),
    [("fine", 1, True), ("coarse", 2, True), ("fine", 2, False)],
    ids=["fine-1-across", "coarse-2-across", "fine-2-per-node"],
)
def test_two_nodes_split_the_cpu_workers_optimizer(tmp_path: Path, mode: str, cpu_workers: int, across: bool) -> None:
    """ZeRO across the data-parallel nodes (`shard_across_nodes=True`): the CPU workers of both nodes
    split the optimizer state they hold (coarse mode: every parameter's; fine mode: the offloaded
    bucket's), each holding its part, together once; or each node's CPU workers split it. The run is
    DDP's on two processes."""
    ddp = Net().double()
    trainer("ddp_fork", accelerator="cpu", devices=2, max_steps=6).fit(ddp, regression_data(n=48))
    script = [str(SCRIPT), str(tmp_path), "--num-nodes=2", f"--cpu-workers={cpu_workers}"]
    script += [*(["--fine"] if mode == "fine" else []), *(["--shard-across-nodes"] if across else [])]
    per_node = cpu_workers + 2
    assert torchrun_nodes(script, per_node=per_node) == [0, 0]
    assert max_param_diff(ddp.state_dict(), torch.load(tmp_path / "state.pt")) < TOL
    assert_every_rank_holds_the_model(tmp_path, ranks=2 * per_node)
    # Adam's two moments: of every parameter (coarse), of the last layer's, its offloaded bucket (fine).
    held_params = list(Net().parameters()) if mode == "coarse" else list(Net().layers[4].parameters())
    whole = 2 * sum(p.numel() for p in held_params)
    key = "user" if mode == "coarse" else "offloaded"
    held = [[torch.load(tmp_path / f"optimizer{n * per_node + i}.pt")[key] for i in range(cpu_workers)] for n in (0, 1)]
    parts = [h for node in held for h in node] if across else held[0]
    assert sum(parts) == whole and 0 < min(parts) and max(parts) < whole, held
    if not across:
        assert held[1] == held[0]


def test_two_nodes_of_replicas_take_batchnorm_statistics_over_the_global_batch(tmp_path: Path) -> None:
    """With `sync_batchnorm=True`, the statistics span both nodes' batches, as DDP's SyncBatchNorm
    takes them: the run is one process's on batches of both nodes' samples together."""
    data = regression_data(n=48).dataset
    batches = []
    for epoch in range(3):  # each node's batches of 12 as its DistributedSampler gives them, both in one batch
        nodes = [DistributedSampler(data, num_replicas=2, rank=node, shuffle=True, seed=0) for node in (0, 1)]
        for sampler in nodes:
            sampler.set_epoch(epoch)
        order = [list(sampler) for sampler in nodes]
        batches += [order[0][k : k + 12] + order[1][k : k + 12] for k in (0, 12)]
    plain = BatchNormNet()
    trainer(None, max_steps=6).fit(plain, DataLoader(data, batch_sampler=batches))
    assert torchrun_nodes([str(SCRIPT), str(tmp_path), "--num-nodes=2", "--model=batchnorm"]) == [0, 0]
    assert max_param_diff(plain.state_dict(), torch.load(tmp_path / "state.pt")) < TOL  # running statistics too
    assert_every_rank_holds_the_model(tmp_path, ranks=6)


def test_a_fit_after_a_validate_in_the_same_processes_keeps_their_layout(tmp_path: Path, reference: dict) -> None:
    """popen keeps its processes between trainer calls: a validate lays the model out, and the
    workload analyzer of the fit after it leaves that layout as it is (and says so)."""
    popen(tmp_path, "--analyzer")
    assert max_param_diff(reference, torch.load(tmp_path / "state.pt")) < TOL


def test_processes_that_build_their_own_model_start_from_rank_zero(tmp_path: Path) -> None:
    """With no seed, each process initializes differently; the strategy must align them first."""
    popen(tmp_path, "--unseeded")
    assert_every_rank_holds_the_model(tmp_path, ranks=3)


def test_a_rank_gone_after_fit_is_reported_at_the_next_trainer_call(tmp_path: Path) -> None:
    """popen: a rank that left the script after one fit fails the next trainer call at its start,
    naming the rank, instead of leaving rank 0 in a collective until the timeout."""
    command = [sys.executable, str(SCRIPT), str(tmp_path), "--popen", "--exit-after-fit=2"]
    started = time.perf_counter()
    done = subprocess.run(command, env=clean_env(), timeout=240, capture_output=True, text=True)
    assert done.returncode != 0
    assert "since the previous one global rank 2 (stage1" in done.stderr and "exited with code 3." in done.stderr
    assert time.perf_counter() - started < TIMEOUT


def test_a_later_call_with_another_model_object_runs_that_model(tmp_path: Path) -> None:
    """popen: each process keeps its strategy between trainer calls; a call with another model object
    (one loaded from a checkpoint to predict with) places and runs that one, not the first call's,
    and a `ckpt_path` given with it loads into it."""
    popen(tmp_path, "--another-model")
    inputs = ANOTHER.dataset.tensors[0]
    assert torch.allclose(torch.load(tmp_path / "another.pt").float(), Net(seed=7)(inputs).detach(), atol=1e-6)
    trained = Net()
    trained.load_state_dict(torch.load(tmp_path / "state.pt"))
    assert torch.allclose(torch.load(tmp_path / "another_from_checkpoint.pt").float(), trained(inputs).detach(), atol=1e-6)


def test_strict_loading_in_a_later_call_holds_every_rank_to_the_whole_model(tmp_path: Path) -> None:
    """popen: in a later call a stage takes only its own blocks' entries of a checkpoint, and strict
    loading still refuses one that lacks a weight, on every rank, as one process does."""
    popen(tmp_path, "--strict")
    for rank in range(3):
        assert 'Missing key(s) in state_dict: "layers.4.weight"' in (tmp_path / f"strict{rank}.txt").read_text(), rank


def test_a_new_trainer_after_fit_runs_in_the_same_processes(tmp_path: Path, reference: dict) -> None:
    """popen: a new Trainer and strategy after fit validate and predict in the processes the fit ran in."""
    popen(tmp_path, "--new-trainer")
    assert max_param_diff(reference, torch.load(tmp_path / "state.pt")) < TOL
    assert (tmp_path / "predicted.txt").read_text() == "25"
    assert_every_rank_holds_the_model(tmp_path, ranks=3)


def test_a_rank_gone_after_fit_is_reported_at_a_new_trainers_first_call(tmp_path: Path) -> None:
    """popen: the calls after fit may come through a new Trainer and strategy, which run in the same
    processes; a rank that left the script fails that Trainer's first call at its start, named, as
    it fails the same Trainer's next call."""
    command = [sys.executable, str(SCRIPT), str(tmp_path), "--popen", "--exit-after-fit=2", "--new-trainer"]
    started = time.perf_counter()
    done = subprocess.run(command, env=clean_env(), timeout=240, capture_output=True, text=True)
    assert done.returncode != 0
    assert "since the previous one global rank 2 (stage1" in done.stderr and "exited with code 3." in done.stderr
    assert time.perf_counter() - started < TIMEOUT


def test_a_rank_that_fails_before_joining_ends_the_run_at_once(tmp_path: Path) -> None:
    """popen: a rank whose script fails before `fit` (a file only it lacks) ends the run as soon as it
    exits, named, instead of leaving rank 0 in torch's rendezvous until the timeout."""
    command = [sys.executable, str(SCRIPT), str(tmp_path), "--popen", "--fail-before-fit=1"]
    started = time.perf_counter()
    done = subprocess.run(command, env=clean_env(), timeout=240, capture_output=True, text=True)
    assert done.returncode != 0 and time.perf_counter() - started < TIMEOUT
    assert "Before joining the run, global rank 1 (stage0" in done.stderr and "exited with code 1" in done.stderr
    assert "this rank's data is missing" in done.stderr


@pytest.mark.parametrize(
    "differ,message",
    [
        ("2:mode", "started with different `HeteroStrategy` arguments: global rank 2 \\(stage1 .*\\) has mode 'fine', global rank 0 'coarse'"),
        ("1:width", "started with different models: global rank 1 \\(stage0 .*\\) has layers.0.weight \\(\\(17, 6\\), 'torch.float32'\\)"),
        ("1:fraction", "started with different `HeteroStrategy` arguments: global rank 1 \\(stage0 .*\\) has cpu_fraction 0.25, global rank 0 0.5"),
        ("2:steps", "started with different Trainer settings: global rank 2 \\(stage1 .*\\) has `max_steps` 10, global rank 0 8"),
    ],
    ids=["strategy-arguments", "model", "cpu-fraction", "trainer-settings"],
)
def test_processes_started_differently_are_told_so_at_once(tmp_path: Path, differ: str, message: str) -> None:
    """popen, torchrun, SLURM and several nodes: every process builds its own strategy and model, from
    its own command; one that differs is named at the start, not by a gloo timeout or abort."""
    import re

    command = [sys.executable, str(SCRIPT), str(tmp_path), "--popen", f"--differ={differ}"]
    started = time.perf_counter()
    done = subprocess.run(command, env=clean_env(), timeout=240, capture_output=True, text=True)
    assert done.returncode != 0 and time.perf_counter() - started < TIMEOUT
    assert re.search(message, done.stderr), done.stderr[-3000:]


def test_a_rank_gone_after_fit_is_named_when_the_others_save_a_checkpoint(tmp_path: Path) -> None:
    """popen: `trainer.save_checkpoint` is a collective, as under DDP; a rank that left the script
    (or a call under `if trainer.is_global_zero:`) fails it with the rank named, not only gloo's
    "Connection closed by peer"."""
    command = [sys.executable, str(SCRIPT), str(tmp_path), "--popen", "--exit-after-fit=2", "--checkpoint-after-exit"]
    done = subprocess.run(command, env=clean_env(), timeout=240, capture_output=True, text=True)
    assert done.returncode != 0
    named = "needs every rank, but since the last trainer call global rank 2 (stage1"
    assert named in done.stderr and "left the script first" in done.stderr, done.stderr[-3000:]


class CompilesOnEveryRank(Net):
    """Hands work to `torch.compile`'s pool of compile threads on every rank, as compiling a kernel does."""

    def on_train_start(self) -> None:
        from torch._inductor.async_compile import AsyncCompile

        AsyncCompile.pool().submit(lambda: None).result(timeout=5)


def test_a_forked_rank_compiles_in_its_own_pool() -> None:
    """`torch.compile` in the parent made its pool of compile threads; a forked process has none of
    those threads, and a compilation there waited forever: each forked rank makes its own pool."""
    import threading

    from torch._inductor.async_compile import AsyncCompile

    pool = AsyncCompile.pool()
    started = threading.Barrier(pool._max_workers + 1)
    try:
        for _ in range(pool._max_workers):  # every thread of the pool started, as a compilation starts them
            pool.submit(started.wait)
        started.wait()
        trainer(hetero(cpu_fraction=0.5, timeout=20), max_steps=1).fit(CompilesOnEveryRank(), regression_data())
    finally:
        pool.shutdown()
        AsyncCompile.pool.cache_clear()


@pytest.mark.parametrize("how", ["-c", "stdin"])
def test_python_c_forks_its_ranks(tmp_path: Path, how: str) -> None:
    """`python -c` (or `python -` reading the code from the standard input) has no script for popen
    to run again: the default start method forks there."""
    code = (
        "from tests.conftest import trainer; from tests.models import Net, regression_data;"
        "from lightning_hetero import HeteroStrategy;"
        "s = HeteroStrategy(stages=['cpu', 'cpu'], cpu_fraction=0.5, timeout=60);"
        "trainer(s, max_steps=2).fit(Net(), regression_data()); print('start method', s._start_method)"
    )
    root = Path(__file__).resolve().parents[1]
    command, given = ([sys.executable, "-c", code], None) if how == "-c" else ([sys.executable, "-"], code.replace("; ", ";").replace(";", "\n"))
    done = subprocess.run(command, input=given, cwd=root, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "start method fork" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("threads_used", [True, False], ids=["after-multi-threaded-work", "first"])
def test_a_fork_after_multi_threaded_work_is_refused_before_any_rank_starts(threads_used: bool) -> None:
    """torch's OpenMP keeps the threads of a multi-threaded operation, and a process forked after
    one hangs at its own first (the ranks would, on their first step's larger operations, until the
    timeout): the fit says so, and what to do, before it forks. In a process of its own, since this
    one must stay fit to fork the rest of the suite's ranks."""
    code = (
        "import torch; torch.set_num_threads(2);"
        + ("torch.ones(1 << 17).sum();" if threads_used else "")
        + "from tests.conftest import hetero, trainer; from tests.models import Net, regression_data;"
        "trainer(hetero(stages=['cpu', 'cpu'], cpu_fraction=0.5), max_steps=2).fit(Net(), regression_data()); print('fit')"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=clean_env(), capture_output=True, text=True, timeout=240)
    if threads_used:
        assert done.returncode != 0 and "already run multi-threaded torch work" in done.stderr, done.stderr[-2000:]
        assert "start_method='popen'" in done.stderr and "fit" not in done.stdout
    else:
        assert done.returncode == 0 and "fit" in done.stdout, done.stderr[-2000:]


def test_a_rank_forked_after_the_main_process_started_cuda_says_why_cuda_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch refuses CUDA to a process forked from one that had started it: the rank's error says
    what that means here and what to do. Other CUDA errors pass through as they are."""
    refusal = "Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, ..."
    from lightning_hetero.accelerator import HeteroAccelerator

    def fails(error: str) -> Callable[[torch.device], None]:
        def set_device(device: torch.device) -> None:
            raise RuntimeError(error)

        return set_device

    monkeypatch.setattr(torch.cuda, "set_device", fails(refusal))
    with pytest.raises(RuntimeError, match=r"forked .* had already started CUDA.*start_method='popen' or 'spawn'") as error:
        HeteroAccelerator().setup_device(torch.device("cuda", 0))
    assert str(error.value.__cause__) == refusal
    for other in ("CUDA error: invalid device ordinal", "CUDA error: initialization error"):  # not a fork's
        monkeypatch.setattr(torch.cuda, "set_device", fails(other))
        with pytest.raises(RuntimeError, match=f"^{other}$"):
            HeteroAccelerator().setup_device(torch.device("cuda", 7))
    HeteroAccelerator().setup_device(torch.device("cpu"))  # nothing to start


def test_a_fork_from_a_process_that_started_cuda_is_refused_before_any_rank_starts(
    monkeypatch: pytest.MonkeyPatch, no_processes: None, one_gpu: None
) -> None:
    """On a GPU machine any earlier fit starts CUDA in the process (Lightning saves the CUDA random
    state around its sanity check), and torch refuses CUDA to ranks forked after that, CPU-only ones
    too (their sanity check touches CUDA as well): the fit says so, and what to do, before it forks."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    for stages in (["cuda:0"], ["cpu", "cpu"]):
        strategy = hetero(stages=stages, cpu_fraction=0.5, start_method="fork")
        with pytest.raises(RuntimeError, match=r"already started CUDA.*start_method='popen'.*'forkserver' or 'spawn'"):
            trainer(strategy, max_steps=1).fit(Net(), regression_data())


def test_a_rank_on_the_cpu_of_a_gpu_machine_leaves_cuda_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine with a GPU (emulated here: a CUDA build that counts one device), Lightning's fit
    saves every GPU's random state around its sanity check, which starts CUDA: the ranks on the CPU
    leave it out (the GPU machine's CUDA test checks the whole fit with a real GPU stage beside a
    CPU worker), and a process's later plain fit saves it again."""
    import lightning.pytorch.trainer.trainer as trainer_module

    def refuse() -> list:
        raise RuntimeError("a rank on the CPU asked for every GPU's random state, which starts CUDA")

    fit = trainer(hetero(stages=["cpu", "cpu"], cpu_fraction=0.5), max_steps=2)
    isolate = trainer_module.isolate_rng
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 1, raising=False)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", refuse)
    assert torch.cuda.is_available()  # as on a GPU machine
    fit.fit(Net(), regression_data())
    from lightning_hetero.devices import leave_cuda_rng_alone

    back = leave_cuda_rng_alone()  # in this process, as in a rank's
    assert trainer_module.isolate_rng.keywords == {"include_cuda": False}
    back()
    assert trainer_module.isolate_rng is isolate


class _FreezeCount(L.Callback):
    """Fails the fit where a rank's garbage collections would walk what it inherited from its parent."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert gc.get_freeze_count() > 0, "a forked rank's collections walk every object of its parent"


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_forked_ranks_leave_the_main_processs_objects_out_of_their_collections(start_method: str) -> None:
    """A forked rank's first full collection would walk (and copy the pages of) every object it
    inherited: 0.3 s in its first steps. They are frozen for the fork, and unfrozen after it in the
    main process, whose own collections go on as before; a forkserver freezes its own once it has
    imported the package and the model's module."""
    assert gc.get_freeze_count() == 0
    strategy = hetero(stages=["cpu", "cpu"], cpu_fraction=0.5, start_method=start_method)
    fit = trainer(strategy, max_steps=2, callbacks=[_FreezeCount()])
    fit.fit(Net(), regression_data())
    assert gc.get_freeze_count() == 0


class _Alarm:
    """Fails the block after ``seconds`` (SIGALRM) instead of letting a hang stall the suite."""

    def __init__(self, seconds: int) -> None:
        self.seconds = seconds

    def __enter__(self) -> None:
        def ring(*_: Any) -> None:
            raise TimeoutError(f"still running after {self.seconds} s")

        self._previous = signal.signal(signal.SIGALRM, ring)
        signal.alarm(self.seconds)

    def __exit__(self, *exc: Any) -> None:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, self._previous)


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_predictions_larger_than_a_pipe_come_back(start_method: str) -> None:
    """Rank 0 hands the main process its predictions through a file: through the queue, a put larger
    than the pipe's 64 KiB would wait for a reader that reads only once every rank has ended."""
    data = regression_data(n=6000, batch_size=500)  # 6000 x 3 float64 predictions: 141 KiB
    plain = torch.cat(trainer(None).predict(Net(), data))
    with _Alarm(120):
        predicted = trainer(hetero(cpu_fraction=0.5, start_method=start_method)).predict(Net(), data)
    assert torch.allclose(torch.cat(predicted), plain, atol=1e-12, rtol=0)



def _fails_after_the_other(index: int, read_end: int, write_end: int, how: str) -> None:
    """Process 0 fails as a collective does when a peer has gone (an error, or an abort as NCCL's
    watchdog's); process 1, the cause, ends (by SIGKILL, or by an error of its own) only once
    process 0 has (its pipe's end closed): a rank that failed first is heard of after the ranks its
    end broke, as through a forkserver."""
    if index == 0:
        if how == "abort":  # as NCCL's watchdog ends a process whose peer has gone
            import faulthandler

            faulthandler.disable()  # pytest's dump of every thread would only fill the log
            os.abort()
        error = RuntimeError("[gloo/transport/tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:54453")
        error.add_note("[hetero] raised on global rank 0.")  # as the strategy's own note
        raise error
    os.close(write_end)
    os.read(read_end, 1)  # EOF: process 0 and the main process closed their ends
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError("the cause")


@pytest.mark.parametrize("how", ["kill", "raise", "abort"])
def test_the_rank_that_caused_a_failure_is_named_though_heard_of_last(how: str) -> None:
    from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

    from lightning_hetero.launcher import _join

    read_end, write_end = os.pipe()
    context = torch.multiprocessing.start_processes(
        _fails_after_the_other, args=(read_end, write_end, how), nprocs=2, join=False, start_method="fork"
    )
    os.close(write_end)
    os.close(read_end)
    expected = ProcessExitedException if how == "kill" else ProcessRaisedException
    with pytest.raises(expected) as error:
        _join(context, rank_name=lambda i: f"rank {i}")
    assert error.value.error_index == 1
    assert error.value.exit_code == -signal.SIGKILL if how == "kill" else "ValueError: the cause" in str(error.value)
    failed_too = "rank 0: was killed by SIGABRT" if how == "abort" else "rank 0: RuntimeError: [gloo"
    assert f"Failed too, after it: {failed_too}" in "\n".join(error.value.__notes__)
