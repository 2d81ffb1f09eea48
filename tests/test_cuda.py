"""The CUDA paths, on a machine with a GPU: a GPU stage beside a CPU worker trains the model one
device trains; fine mode's pinned staging, side streams and offloaded steps; two CPU workers
splitting their optimizer beside a GPU stage; two stages per process across a GPU and a CPU
process; bf16 on the GPU; the memory the offload saves; checkpoints; NVML stats and CUDA-event
spans; a killed GPU rank; a step's waits for the GPU; a CPU worker that never starts CUDA.

Marked ``cuda`` and skipped where there is no CUDA device (``.gpu/run`` runs them on a GPU
machine). The reference runs on the CPU in float64, a plain fit that starts CUDA in this process:
the ranks start from a forkserver (``START_METHOD``), and the fork cases run in processes of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hetero.callbacks import UtilizationMonitor
from lightning_hetero.offload import OffloadStep
from tests.conftest import Fault, max_param_diff, trainer
from tests.conftest import hetero as _hetero
from tests.models import Net, read_metrics, regression_data

pytestmark = [
    pytest.mark.cuda,
    # device_count asks NVML and starts nothing in this process.
    pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA device"),
]

STEPS = 8
TOL = {"64-true": 1e-10, "32-true": 1e-5}
"""float64 matches one device to rounding; float32 to the last bits of a float32 product summed in
another order on the GPU (TF32 is off for matrix products by default)."""
COPIES_TOL = 1e-13
"""How far a parameter's copy on the GPU may be from its copy on a CPU worker in float64 (the
optimizer's kernels on each round differently; the gradients they step with are the same)."""


START_METHOD = os.environ.get("HETERO_CUDA_TESTS_START_METHOD", "forkserver")
"""How the tests start their ranks: not fork, since the reference's plain fit starts CUDA in this process
(Lightning saves the CUDA random state around its sanity check), and forked ranks then cannot use it.
A forkserver is a new interpreter, as spawn's children are, and it imports the package once
for every rank of every test (spawn: seconds a rank)."""


def hetero(**kwargs: Any) -> Any:
    kwargs.setdefault("start_method", START_METHOD)
    return _hetero(**kwargs)


def gpu(**kwargs: Any) -> Any:
    """One GPU stage beside a CPU worker, half of every batch each (unless told otherwise)."""
    kwargs.setdefault("stages", ["cuda:0"])
    kwargs.setdefault("cpu_fraction", 0.5)
    return hetero(**kwargs)


@pytest.fixture(scope="module")
def reference() -> dict:
    model = Net().double()
    trainer(None, max_steps=STEPS).fit(model, regression_data())
    return model.state_dict()


def fit(strategy: Any, precision: str = "64-true", log_dir: Path | None = None, **kwargs: Any) -> Net:
    model = Net()
    trainer(strategy, log_dir, max_steps=STEPS, precision=precision, **kwargs).fit(model, regression_data())
    return model


@pytest.mark.parametrize("precision", ["64-true", "32-true"])
@pytest.mark.parametrize("mode", ["coarse", "fine"])
def test_a_gpu_stage_beside_a_cpu_worker_trains_the_model_one_device_trains(
    reference: dict, precision: str, mode: str
) -> None:
    model = fit(gpu(mode=mode), precision)
    assert max_param_diff(reference, model) < TOL[precision]


@pytest.mark.parametrize("cpu_workers", [1, 0])
@pytest.mark.parametrize("mode", ["coarse", "fine"])
def test_a_gpu_replica_trains_the_model_one_device_trains(reference: dict, mode: str, cpu_workers: int) -> None:
    """The whole model on the GPU (`parallelism="replicas"`), beside a CPU worker with half of every
    batch, or alone."""
    strategy = gpu(mode=mode, parallelism="replicas", cpu_workers=cpu_workers, cpu_fraction=0.5 if cpu_workers else 0.0)
    model = fit(strategy)
    assert max_param_diff(reference, model) < TOL["64-true"]


@pytest.mark.parametrize("offload", ["none", "all", [0]])
def test_fine_mode_offloads_with_pinned_staging_and_side_streams(reference: dict, offload: Any, tmp_path: Path) -> None:
    strategy = gpu(mode="fine", offload=offload, bucket_size_mb=0.0005)  # several buckets per stage
    model = fit(strategy, callbacks=[OptimizerStateOnGpu(tmp_path)])
    assert max_param_diff(reference, model) < TOL["64-true"]
    report = json.loads((tmp_path / "stage.json").read_text())
    assert report["offloaded"] == (offload != "none")
    if offload == "all":
        assert report["state_on_gpu"] == 0 and report["pinned_masters"]


class OptimizerStateOnGpu(L.Callback):
    """The GPU stage writes how many optimizer-state bytes it holds on the GPU, whether any bucket is
    offloaded, and whether the offloaded buckets' CPU tensors are pinned."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.strategy.root_device.type != "cuda":
            return
        optimizer = trainer.strategy.optimizers[0]
        on_gpu = sum(
            t.numel() * t.element_size()
            for state in optimizer.state.values()
            for t in state.values()
            if torch.is_tensor(t) and t.is_cuda
        )
        steps = [s for s in trainer.strategy.bucket_steps if isinstance(s, OffloadStep)]
        pinned = [g.is_pinned() for s in steps for g in s.grads if g is not None]
        report = {"state_on_gpu": on_gpu, "offloaded": bool(steps), "pinned_masters": bool(pinned) and all(pinned)}
        (self.out / "stage.json").write_text(json.dumps(report))


class AllocatedAfterStep(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.strategy.root_device.type == "cuda":
            (self.out / "allocated.json").write_text(json.dumps(torch.cuda.memory_allocated()))


@pytest.mark.parametrize("cpu_fraction", [0.0, 0.5])
def test_offloaded_buckets_clip_and_step_from_weights_set_between_steps(cpu_fraction: float) -> None:
    """On a GPU stage every offloaded bucket keeps its master in CPU memory: clipping by norm reaches a
    gradient no CPU worker's share was summed with (fraction 0), and a weight set in place between
    steps is what its master steps from."""
    from tests.test_fine import EditsWeights

    clip = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}
    plain = Net()
    trainer(None, max_steps=STEPS, callbacks=[EditsWeights()], **clip).fit(plain, regression_data())
    strategy = gpu(mode="fine", offload="all", bucket_size_mb=1e-5, cpu_fraction=cpu_fraction)
    assert max_param_diff(plain, fit(strategy, callbacks=[EditsWeights()], **clip)) < TOL["64-true"]


def test_offloading_every_bucket_takes_adams_state_off_the_gpu(tmp_path: Path) -> None:
    """Adam keeps two tensors per parameter: offloaded, the GPU holds about two parameters' worth less."""
    allocated = {}
    for offload in ("none", "all"):
        out = tmp_path / offload
        out.mkdir()
        fit(gpu(mode="fine", offload=offload, cpu_fraction=0.0), "32-true", callbacks=[AllocatedAfterStep(out)])
        allocated[offload] = json.loads((out / "allocated.json").read_text())
    params = sum(p.numel() * 4 for p in Net().parameters())
    assert allocated["none"] - allocated["all"] >= 1.5 * params


@pytest.mark.parametrize("mode", ["coarse", "fine"])
def test_two_cpu_workers_split_their_optimizer_beside_a_gpu_stage(reference: dict, mode: str) -> None:
    """`sharding.py` with a GPU stage: fine mode reduces each offloaded bucket's gradients to its
    owning CPU worker from the GPU's pinned staging and broadcasts the stepped parameters back to the
    GPU; coarse mode splits the CPU workers' replicas' step."""
    layout = dict(mode="fine", offload="all", bucket_size_mb=1e-5) if mode == "fine" else {}
    model = fit(gpu(cpu_workers=2, **layout))
    assert max_param_diff(reference, model) < TOL["64-true"]


def test_bf16_mixed_on_the_gpu_beside_a_bf16_cpu_worker(reference: dict) -> None:
    """Both compute under autocast in bfloat16 on their own device (the CPU worker on the CPU), with
    float32 weights: close to the float64 model, as bf16's 8-bit mantissa allows."""
    model = fit(gpu(), "bf16-mixed")
    assert max_param_diff(reference, model) < 2e-2


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_two_stages_on_the_gpu_beside_a_cpu_worker(reference: dict, schedule: str) -> None:
    """Several stages per process (`docs/schedules.md`) on the one GPU, beside a CPU worker, with their
    validation. (A pipeline of a GPU and a CPU stage is refused: `test_errors.py`.)"""
    layout = dict(stages=["cuda:0"], schedule=schedule, micro_batches=2)
    model = fit(hetero(cpu_fraction=0.25, **layout))
    assert max_param_diff(reference, model) < TOL["64-true"]
    validated = trainer(hetero(**layout)).validate(model, regression_data(n=20, seed=3))
    assert validated and all(v == v for v in validated[0].values())  # finite, computed


def test_checkpoints_resume_exactly_on_the_gpu(reference: dict, tmp_path: Path) -> None:
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_last=True)
    model = Net()
    trainer(gpu(), max_steps=4, callbacks=[checkpoints], enable_checkpointing=True).fit(model, regression_data())
    resumed = Net().double()  # Lightning loads the checkpoint before the precision plugin converts the model
    trainer(gpu(), max_steps=STEPS).fit(resumed, regression_data(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert max_param_diff(reference, resumed) < TOL["64-true"]


def test_nvml_stats_and_cuda_event_spans_reach_the_monitor(tmp_path: Path) -> None:
    monitor = UtilizationMonitor(every_n_steps=2, trace_steps=4, save_dir=str(tmp_path / "trace"))
    fit(gpu(), log_dir=tmp_path, callbacks=[monitor])
    rows = [row for row in read_metrics(tmp_path) if row.get("util/stage0/gpu_util")]
    assert rows and all(float(row["util/stage0/gpu_mem_allocated_gb"]) > 0 for row in rows)
    trace = json.loads((tmp_path / "trace" / "trace.json").read_text())
    compute = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 1 and e["name"] == "compute"]
    assert len({e["args"]["step"] for e in compute}) == 4  # the GPU stage's layers, timed by CUDA events


def test_a_killed_gpu_rank_ends_the_run_and_is_named(tmp_path: Path) -> None:
    with pytest.raises(Exception) as error:
        fit(gpu(timeout=20), callbacks=[Fault(rank=1, step=2, how="kill")])
    text = "\n".join([str(error.value), *getattr(error.value, "__notes__", [])])
    assert "global rank 1 (stage0" in text and "SIGKILL" in text


@pytest.mark.parametrize("mode", ["coarse", "fine"])
def test_encoders_placed_between_a_gpu_replica_and_a_cpu_worker(mode: str, tmp_path: Path) -> None:
    """A multimodal model as replicas on the GPU and the CPU worker: the images encoded on the GPU for
    both shares, the captions on the CPU for both; outputs and gradients through pinned host memory."""
    from tests.models import Multimodal, multimodal_data
    from tests.test_replicas import assert_same_run

    strategy = gpu(mode=mode, encoders={"image": "device0", "text": "cpu0"}, cpu_fraction=0.3)
    # Each process steps its own copy: the GPU's Adam kernels round differently from the CPU's.
    assert_same_run(tmp_path, strategy, Multimodal, multimodal_data, copies_tol=COPIES_TOL)


def notebook(*cells: str) -> subprocess.CompletedProcess:
    """``cells`` run in a fresh Python process, as a notebook's kernel runs them."""
    setup = "from tests.conftest import hetero, trainer\nfrom tests.models import Net, regression_data\n"
    fork = "trainer(hetero(stages=['cuda:0'], cpu_fraction=0.5, start_method='fork', timeout=20), max_steps=2)"
    script = setup + "\n".join(cells).replace("FORKED_FIT", fork + ".fit(Net(), regression_data())")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[1])


def test_ranks_fork_after_the_main_process_asked_whether_there_is_cuda() -> None:
    """A notebook's first cell asks `torch.cuda.is_available()`; the fit after it forks its ranks,
    and the GPU stage trains."""
    run = notebook("import torch\nassert torch.cuda.is_available()", "FORKED_FIT")
    assert run.returncode == 0, run.stderr[-3000:]


def test_a_fork_after_a_plain_fit_is_refused_with_the_reason() -> None:
    """A plain Lightning fit, even on the CPU, starts CUDA (Lightning saves the CUDA random state around
    its sanity check): a forked fit after it is refused before any rank starts, saying why."""
    run = notebook("trainer(None, max_steps=2).fit(Net().double(), regression_data())", "FORKED_FIT")
    assert run.returncode != 0 and "This process has already started CUDA" in run.stderr, run.stderr[-3000:]


class GpuWaits(L.Callback):
    """On a rank on the GPU, in steps 2 to 4, every wait for the GPU (torch's sync debug mode) from
    the step's start until its results are in (Lightning's `on_before_backward`, which follows the
    strategy's `training_step`), each as the package's and Lightning's frames that made it; written
    to ``waits<rank>.json``. The wait that switching the mode on makes (at its first switch) is not the step's."""

    def __init__(self, out: Path) -> None:
        self.out, self.steps, self._saved = out, [], None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.strategy.root_device.type == "cuda" and 2 <= trainer.global_step <= 4:
            self.steps.append([])
            self._saved = (warnings.showwarning, warnings.filters[:])
            warnings.simplefilter("always")
            warnings.showwarning = self._note
            torch.cuda.set_sync_debug_mode("warn")

    def on_before_backward(self, *args: Any) -> None:
        if self._saved is not None:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning, warnings.filters[:] = self._saved
            self._saved = None

    def _note(self, message: Any, *rest: Any) -> None:
        stack = traceback.extract_stack()[:-1]
        if "synchroniz" in str(message) and not any(f.name == "set_sync_debug_mode" for f in stack):  # not the switch's own
            frames = [f for f in stack if "lightning" in f.filename and "test_" not in f.filename]
            self.steps[-1].append(" <- ".join(f"{Path(f.filename).name}:{f.name}" for f in reversed(frames[-6:])))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.steps:
            (self.out / f"waits{trainer.global_rank}.json").write_text(json.dumps(self.steps))


@pytest.mark.parametrize("parallelism", ["pipeline", "replicas"])
def test_a_gpu_step_waits_for_the_gpu_once_before_its_results_are_in(parallelism: str, tmp_path: Path) -> None:
    """Before its results are exchanged, a GPU rank's step waits for the GPU only where Lightning
    moves the batch onto it and where the step's results are read on the host together (`_read`):
    not at each `self.log`, nor for the loss or the gradients' finite flag."""
    fit(gpu(parallelism=parallelism), callbacks=[GpuWaits(tmp_path)])
    (path,) = tmp_path.glob("waits*.json")
    steps = json.loads(path.read_text())
    print("waits for the GPU per step before the results are in:", json.dumps(steps, indent=1))
    assert len(steps) == 3
    for waits in steps:
        reads = [i for i, site in enumerate(waits) if site.startswith("results.py:_read")]
        assert len(reads) == 1, waits
        assert all("move_data_to_device" in site or "batch_to" in site for site in waits[: reads[0]]), waits


class CudaOnCpuWorker(L.Callback):
    """On a CPU worker: whether CUDA had started by Lightning's ``setup`` hook, the Python frames
    that first started it after that (``torch.cuda._lazy_init``, which torch's Python paths to CUDA
    go through), and whether it had started by the end; written to ``cuda<rank>.json``."""

    def __init__(self, out: Path) -> None:
        self.out, self.at_setup = out, False
        self.first: list[str] | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.strategy.root_device.type != "cpu":
            return
        self.at_setup = torch.cuda.is_initialized()
        lazy_init = torch.cuda._lazy_init

        def noting() -> None:
            if self.first is None and not torch.cuda.is_initialized():
                self.first = [f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in traceback.extract_stack()[:-1]][-12:]
            lazy_init()

        torch.cuda._lazy_init = torch.cuda.random._lazy_init = noting  # (random.py holds its own name for it)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.strategy.root_device.type == "cpu":
            seen = {"at_setup": self.at_setup, "first": self.first, "at_end": torch.cuda.is_initialized()}
            (self.out / f"cuda{trainer.global_rank}.json").write_text(json.dumps(seen))


@pytest.mark.parametrize("mode", ["coarse", "fine"])
def test_a_cpu_worker_beside_a_gpu_stage_never_starts_cuda(mode: str, tmp_path: Path) -> None:
    """A CUDA context on a CPU worker holds GPU memory for nothing; where one starts, the test names
    the frames that started it (none: a path outside Python, such as NCCL's)."""
    fit(gpu(mode=mode), callbacks=[CudaOnCpuWorker(tmp_path)])
    seen = {path.stem: json.loads(path.read_text()) for path in sorted(tmp_path.glob("cuda*.json"))}
    print("CUDA on the CPU workers:", json.dumps(seen, indent=1))
    assert seen and all(s == {"at_setup": False, "first": None, "at_end": False} for s in seen.values()), seen
