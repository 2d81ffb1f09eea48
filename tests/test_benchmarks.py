"""Every benchmark runs, at smoke size, through the one entry command (timings not asserted)."""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch

from benchmarks.__main__ import BENCHMARKS
from benchmarks.cuda import NAMES as CUDA_NAMES


def test_every_benchmark_runs_at_smoke_size(tmp_path: Path) -> None:
    out = tmp_path / "table.md"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parents[1],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    names = {line[0].lstrip("| ") for line in lines}
    assert names == {
        "overhead", "pipeline overhead", "schedules", "hetero vs Lightning", "CPU optimizer", "rebalancer", "loading",
        "multimodal", "sharding", "CUDA",
    }  # fmt: skip
    assert len(BENCHMARKS) == 11
    for benchmark, _, value, *_ in lines:
        if benchmark.lstrip("| ") == "CUDA":
            assert value == "n/a"  # no CUDA device here: reported, not measured
        else:
            assert 0 < float(value) < math.inf
    assert sum(line[0].lstrip("| ") == "CUDA" for line in lines) == len(CUDA_NAMES) + 2  # + the analyzer's, largest


def test_the_cuda_rows_are_those_of_the_configurations_run() -> None:
    """`python -m benchmarks.cuda --configs idle,alone` measures the GPU alone and those two only:
    their rows come out, and none for what did not run (no GPU is needed to make the rows). The
    ratios are of median steps; the means and the collections in the window stand in the note."""
    from benchmarks.cuda import model_rows

    def run(median: float, mean: float, threads: int = 15, gcs: int = 0) -> dict:
        facts = {"device": "cuda", "fraction": 0.0, "threads": threads, "peak_mb": 1.0, "cuda_started": True,
                 "full_gcs": gcs, "gc_ms": 250.0 * gcs}  # fmt: skip
        return {"median": median, "step": mean, "facts": [facts]}

    alone = run(0.005, 0.01, gcs=1)
    alone["facts"][0]["phases_ms"] = {"compute": 2.0, "optimizer": 1.0, "wait": 0.5, "data": 0.25, "total": 5.0}
    rows = model_rows({"model": "MLP", "gpu": [run(0.004, 0.004)], "idle": [run(0.008, 0.008)], "alone": [alone]})
    assert [(row.configuration, round(row.ratio, 3)) for row in rows] == [
        (f"MLP: {CUDA_NAMES['idle']}", 0.5),
        (f"MLP: {CUDA_NAMES['alone']}", 0.8),
    ]
    assert "CPU worker threads 15" in rows[0].note and "threads" not in rows[1].note
    assert "means over the window 10.00 vs 4.00 ms (0.400); 1 full GC(s), 250 ms of GC vs 0 full GC(s)" in rows[1].note
    assert rows[1].note.endswith("the GPU rank's step in ms: compute 2.00, optimizer 1.00, wait 0.50, data 0.25, total 5.00")
    assert "GPU rank's step" not in rows[0].note  # runs without the strategy's records


class CollectAt(L.Callback):
    """Runs a full garbage collection at the end of the given steps, and none other in the fit."""

    def __init__(self, *steps: int) -> None:
        self.steps = steps
        self._enabled = True

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._enabled = gc.isenabled()
        gc.disable()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._enabled:
            gc.enable()

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step in self.steps:
            gc.collect()


@pytest.mark.parametrize("where", ["this-process", "child", "hetero"])
def test_the_cuda_benchmarks_facts_time_the_second_half_and_its_collections(where: str) -> None:
    """`benchmarks.cuda`'s measurement, on the CPU (its GPU runs are the same code): the median and the
    mean step over the second half of the fit, and the full garbage collections in those steps, not
    before; `plain_in_child` runs in a process of its own with the one torch thread of a GPU stage
    (forked here: the forkserver it uses on a GPU machine would be this process's one, whose preload
    the launcher's tests set). Under hetero, the parts of the rank's step, from its records of the
    window's steps."""
    from benchmarks import cuda
    from lightning_hetero import HeteroStrategy

    collect = CollectAt(2, 9)  # one before the window (it opens at step 6), one in it
    _, build, loader = cuda.models(smoke=True)[0]
    if where == "this-process":
        run = cuda._run(None, build(), loader(12), 12, accelerator="cpu", callbacks=[collect])
    elif where == "child":
        run = cuda.plain_in_child(0, 12, smoke=True, accelerator="cpu", callbacks=[collect], start_method="fork")
    else:
        strategy = HeteroStrategy(stages=["cpu"], cpu_workers=0, start_method="fork", timeout=timedelta(seconds=60))
        run = cuda._run(strategy, build(), loader(12), 12, callbacks=[collect])
    [facts] = run["facts"]
    assert facts["device"] == "cpu" and facts["full_gcs"] == 1 and facts["gc_ms"] > 0
    if where != "hetero":
        assert facts["threads"] == (1 if where == "child" else torch.get_num_threads())
    assert 0 < run["median"] == facts["median_step"] and 0 < run["step"] == facts["step"]
    if where == "hetero":
        phases = facts["phases_ms"]
        assert list(phases) == list(cuda.PHASES) and 0 < phases["compute"] < phases["total"]
        # the median whole step of the records is the median step Facts times itself, within loading and the loop's hooks
        assert phases["total"] == pytest.approx(1e3 * run["median"], rel=0.5)
    else:
        assert facts["phases_ms"] is None


def test_the_schedules_benchmark_runs_two_stages_in_one_process_from_the_forkserver() -> None:
    """The layout `python -m benchmarks.schedules --device cuda` runs on one GPU, here on the CPU: one
    process holding both stages of each multi-stage schedule, under the strategy and by hand, each
    started from the forkserver (as a GPU's must be); every schedule gets its step and its ratio to
    the loop by hand, and the analyzer plans for that one process. In an interpreter of its own: a
    process has one forkserver, whose preload its first user sets."""
    script = (
        "import json, math\n"
        "from benchmarks.schedules import measure\n"
        "from lightning_hetero.pipeline import available_schedules\n"
        "if __name__ == '__main__':\n"
        "    r = measure(steps=6, repeats=1, micro_batches=2, width=32, batch_size=16, processes=1, start_method='forkserver')\n"
        "    print(json.dumps({'names': sorted(r), 'multi': available_schedules(), 'plan': r['planned']['plan'],\n"
        "        'rows': {k: [v['hetero'], v.get('plain'), v['hetero/plain'].median if 'plain' in v else None, v['predicted']]\n"
        "                 for k, v in r.items() if k != 'planned'}}))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1]
    )
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["names"] == sorted(["planned", "GPipe", "1F1B", *found["multi"]]) and found["multi"]
    for schedule in found["multi"]:
        hetero, plain, ratio, predicted = found["rows"][schedule]
        assert 0 < hetero < 1 and 0 < plain < 1 and 0 < ratio < math.inf and 0 < predicted < math.inf
    for schedule in ("GPipe", "1F1B"):  # one stage: nothing to write by hand
        assert found["rows"][schedule][1] is None
    assert " x1, " in found["plan"] or " x2, " in found["plan"]
