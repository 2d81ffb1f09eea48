"""Every benchmark runs, at smoke size, through the one entry command (timings not asserted)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

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
    their rows come out, and none for what did not run (no GPU is needed to make the rows)."""
    from benchmarks.cuda import model_rows

    def run(step: float, threads: int = 15) -> dict:
        return {"step": step, "facts": [{"fraction": 0.0, "threads": threads, "peak_mb": None, "cuda_started": False}]}

    rows = model_rows({"model": "MLP", "gpu": [run(0.004)], "idle": [run(0.008)], "alone": [run(0.005)]})
    assert [(row.configuration, round(row.ratio, 3)) for row in rows] == [
        (f"MLP: {CUDA_NAMES['idle']}", 0.5),
        (f"MLP: {CUDA_NAMES['alone']}", 0.8),
    ]
    assert "CPU worker threads 15" in rows[0].note and "threads" not in rows[1].note
