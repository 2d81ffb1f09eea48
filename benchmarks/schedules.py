"""Pipeline schedules with several stages per process, against GPipe and 1F1B and against torch's own
pipelining run by hand with the same schedule, in one run.

Every configuration trains the same MLP (``benchmarks.common.MLP``) on the same batches, on two
emulated stage processes (two processes on this machine's cores, gloo between them), with the same
micro-batch count and the same AdamW step, and no CPU worker: the strategy under a Lightning
``Trainer`` with ``cpu_workers=0`` and ``schedule=...`` (a multi-stage schedule: two stages per
process, the blocks cut into four), and the same schedule written by hand with
``torch.distributed.pipelining`` (build the stages where the strategy puts them, run
``schedule.step`` and ``optimizer.step`` per batch). Configurations alternate in one run; medians of
the per-step times after a warm-up are reported, and each schedule's ratio to its loop by hand is
taken repeat by repeat (the two run next to each other), its median and range shown. Each process
of either side runs on a core of its own (``benchmarks.common.pin_rank``), where the machine has one
for each: left to the OS, they run slower and vary more from run to run. Emulated
stages on shared cores leave little bubble to remove (see DESIGN.md, "Measuring speed"): the
schedules' gains over GPipe and 1F1B are for a machine with a device per stage.

With ``--device cuda`` (``python -m benchmarks`` adds these rows wherever there is CUDA) the same
runs on one GPU: one process holds both of a multi-stage schedule's stages on ``cuda:0`` (under the
strategy, ``stages=["cuda:0"]``; by hand, two ``PipelineStage``s on the GPU in a process of its
own), and GPipe and 1F1B are the whole model as one stage; the MLP is wider and its batch larger
(``CUDA_SIZES``). There is no bubble to remove on one
device: the rows measure what the strategy costs around each schedule against torch's own loop.
The loop by hand waits for the GPU at the end of each step (as reading its loss would), the
strategy once in each (its one wait, for the step's results); both processes start from a
forkserver, as a GPU rank must.

    python -m benchmarks.schedules [--steps N] [--repeats R] [--micro-batches M] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.utils.data import DataLoader

from benchmarks.common import MLP, OneCorePerRank, Row, interleave_runs, paired_ratio, pin_rank, step_times, synthetic_loader
from lightning_hetero import HeteroPlan, HeteroStrategy
from lightning_hetero.callbacks import WorkloadAnalyzer
from lightning_hetero.launcher import _preload_forkserver
from lightning_hetero.pipeline import V_SHAPED, available_schedules, is_multi_stage, partition_layers, stages_of
from lightning_hetero.planner import Machine, predict_plan
from lightning_hetero.profiling import Profile

PROCESSES = 2
WARMUP = 3
DEFAULTS = dict(steps=30, repeats=5, micro_batches=4, width=512, batch_size=256)
CUDA_SIZES = dict(width=4096, batch_size=1024)
"""On a GPU, a model that keeps it busy: at the emulated stages' size a step is the host's Python alone."""


def _plain_rank(
    rank: int, model: MLP, loader: DataLoader, schedule: str, micro_batches: int, out: Path, processes: int = PROCESSES, device: str = "cpu"
) -> None:
    """One process of the hand-written loop, with any schedule (``benchmarks.pipelining`` runs it too)."""
    torch.set_num_threads(1)  # as the strategy gives each of two emulated stages on two cores, and a GPU stage
    if _pinned(processes, device):
        pin_rank(rank, processes)  # as `OneCorePerRank` pins the strategy's, before gloo starts its threads
    store = dist.FileStore(str(out / "store"), processes)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=processes, timeout=timedelta(seconds=60))
    where = torch.device(device)
    cls = get_schedule_class(schedule)
    per_process = 2 if is_multi_stage(cls) else 1
    count = processes * per_process
    bounds = partition_layers(model.pipeline_layers(), count)
    mine = stages_of(rank, processes, per_process, schedule in V_SHAPED) if per_process > 1 else [rank]
    parts = [nn.Sequential(*model.pipeline_layers()[slice(*bounds[s])]).to(where) for s in mine]
    stages = [PipelineStage(part, s, count, where) for part, s in zip(parts, mine)]
    runner = cls(stages if per_process > 1 else stages[0], micro_batches, loss_fn=model.pipeline_loss)
    optimizer = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=1e-3)
    times, last = [], time.perf_counter()
    for x, y in loader:
        optimizer.zero_grad()
        args = (x.to(where),) if 0 in mine else ()
        kwargs = {"target": y.to(where)} if count - 1 in mine else {}
        runner.step(*args, **kwargs)
        optimizer.step()
        if where.type == "cuda":
            torch.cuda.synchronize(where)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    if rank == 0:
        (out / "times.json").write_text(json.dumps(times[WARMUP:]))
    dist.destroy_process_group()


def _pinned(processes: int, device: str) -> bool:
    """Whether each process runs on a core of its own: processes of one torch thread each, the emulated
    stages of two or more processes and a GPU's (one emulated stage alone takes every core the
    strategy gives it)."""
    return processes > 1 or device == "cuda"


def plain_pipelining(
    model: MLP,
    loader: DataLoader,
    schedule: str,
    micro_batches: int,
    processes: int = PROCESSES,
    device: str = "cpu",
    start_method: str = "fork",
) -> list[float]:
    """Per-step times of the hand-written loop, its processes started as the strategy's are: forked
    for emulated stages, from the forkserver for a GPU."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        mp.start_processes(
            _plain_rank,
            args=(model, loader, schedule, micro_batches, out, processes, device),
            nprocs=processes,
            start_method=start_method,
        )
        return json.loads((out / "times.json").read_text())


def measure(
    steps: int,
    repeats: int,
    micro_batches: int,
    width: int,
    batch_size: int,
    device: str = "cpu",
    processes: int | None = None,
    start_method: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Per schedule: the strategy's median step, and for the multi-stage ones the hand-written loop's
    and the ratio of the two taken repeat by repeat (``"hetero/plain"``, ``paired_ratio``);
    the workload analyzer's choice (``"planned"``: ``schedule="auto"``, its plan, its step), and each
    schedule's step as its cost model predicts it from the analyzer's profile (``"predicted"``).
    ``device="cuda"``: one process on ``cuda:0``, started from the forkserver (see the module's note);
    otherwise ``processes`` emulated stages (``PROCESSES``), forked unless ``start_method`` says."""
    if device == "cuda" and processes not in (None, 1):
        raise ValueError("On CUDA the benchmark runs one process on cuda:0 (two stages there).")
    torch.set_num_threads(1)  # this process only launches workers; keep forking safe
    processes = processes or (1 if device == "cuda" else PROCESSES)
    stages = ["cuda:0"] if device == "cuda" else ["cpu"] * processes
    start_method = start_method or ("forkserver" if device == "cuda" else "fork")
    pinned = [OneCorePerRank(processes)] if _pinned(processes, device) else []
    if start_method == "forkserver":
        _preload_forkserver(MLP())  # the server imports torch, the package and the benchmarks once
    loader = synthetic_loader(batch_size * steps, batch_size)
    analyzed = Path(tempfile.mkdtemp())

    def planned() -> list[float]:
        analyzer = WorkloadAnalyzer(save_dir=str(analyzed), warmup_steps=WARMUP + 2, measure_steps=3)
        hetero = HeteroStrategy(stages=stages, cpu_workers=0, micro_batches=micro_batches, start_method=start_method)
        return step_times(hetero, MLP(width=width), loader, steps, callbacks=[analyzer, *pinned])

    configs: dict[str, Any] = {"planned/hetero": planned}
    for schedule in ["GPipe", "1F1B", *available_schedules()]:

        def strategy(schedule: str = schedule) -> list[float]:
            hetero = HeteroStrategy(
                stages=stages, cpu_workers=0, micro_batches=micro_batches, schedule=schedule, start_method=start_method
            )
            return step_times(hetero, MLP(width=width), loader, steps, callbacks=pinned)

        configs[f"{schedule}/hetero"] = strategy
        if schedule not in ("GPipe", "1F1B"):
            configs[f"{schedule}/plain"] = lambda schedule=schedule: plain_pipelining(
                MLP(width=width), loader, schedule, micro_batches, processes, device, start_method
            )
    runs = interleave_runs(configs, repeats)
    results: dict[str, dict[str, Any]] = {}
    for name, steps_by_run in runs.items():
        schedule, side = name.split("/")
        results.setdefault(schedule, {})[side] = statistics.median(t for run in steps_by_run for t in run)
    for schedule, r in results.items():
        if "plain" in r:
            r["hetero/plain"] = paired_ratio(runs[f"{schedule}/hetero"], runs[f"{schedule}/plain"])
    plan, profile = HeteroPlan.load(analyzed / "plan.yaml"), Profile.load(analyzed / "profile.json")
    machine = Machine.as_profiled(profile, stages, cpu_workers=0)
    for schedule, r in results.items():
        if schedule != "planned":
            r["predicted"] = predict_plan(profile, machine, _layout_of(schedule, micro_batches, width, stages)).step_s
    results["planned"]["predicted"] = predict_plan(profile, machine, plan).step_s
    results["planned"]["plan"] = f"{plan.schedule} x{plan.stages_per_process}, {plan.micro_batches} micro-batches"  # type: ignore[assignment]
    return results


def _layout_of(schedule: str, micro_batches: int, width: int, stages: list[str]) -> HeteroPlan:
    """The plan the strategy runs for ``schedule`` on ``stages``: its stages cut by parameter count, as the strategy cuts them."""
    per_process = 2 if is_multi_stage(get_schedule_class(schedule)) else 1
    bounds = partition_layers(MLP(width=width).pipeline_layers(), len(stages) * per_process)
    return HeteroPlan(
        stages=stages, cpu_workers=0, micro_batches=micro_batches, schedule=schedule,
        stages_per_process=per_process, boundaries=[start for start, _ in bounds[1:]],
    )  # fmt: skip


def rows(smoke: bool = False) -> list[Row]:
    """The rows on emulated stages, then, where there is CUDA, on one GPU (``device="cuda"``)."""
    sizes = dict(steps=6, repeats=1, width=32, batch_size=16) if smoke else {}
    out = _rows("schedules", measure(**{**DEFAULTS, **sizes}), "2 processes x 2 stages", "< 1 with a device per stage")
    if torch.cuda.is_available():
        results = measure(**{**DEFAULTS, **CUDA_SIZES, **sizes}, device="cuda")
        out += _rows("schedules (CUDA)", results, "1 process x 2 stages on cuda:0", "none on one device")
    return out


def _rows(benchmark: str, results: dict[str, dict[str, Any]], layout: str, gain: str) -> list[Row]:
    gpipe, one_f_one_b = results["GPipe"]["hetero"], results["1F1B"]["hetero"]
    planned = results.pop("planned")
    fastest = min(r["hetero"] for r in results.values())
    out = [
        Row(benchmark, f"the analyzer's choice ({planned['plan']}) / the fastest schedule measured", planned["hetero"] / fastest, "<= 1.05", "schedule='auto'"),
        *[Row(benchmark, f"{schedule}: predicted / measured step", r["predicted"] / r["hetero"], "", "the analyzer's profile") for schedule, r in results.items()],
    ]  # fmt: skip
    for schedule, r in results.items():
        if schedule in ("GPipe", "1F1B"):
            continue
        out += [
            Row(benchmark, f"{schedule}: hetero / plain torch pipelining, same schedule (step time)", r["hetero/plain"].median, "<= 1.05", f"{layout}; repeats {r['hetero/plain'].low:.3f}-{r['hetero/plain'].high:.3f}"),
            Row(benchmark, f"{schedule} / GPipe (hetero, step time)", r["hetero"] / gpipe, gain, ""),
            Row(benchmark, f"{schedule} / 1F1B (hetero, step time)", r["hetero"] / one_f_one_b, gain, ""),
        ]  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for key, value in DEFAULTS.items():
        on_cuda = f" ({CUDA_SIZES[key]} with --device cuda)" if key in CUDA_SIZES else ""
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"default {value}{on_cuda}")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one process on cuda:0")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device, and this machine has none.")
    sizes = {**DEFAULTS, **(CUDA_SIZES if args.device == "cuda" else {})}
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    results = measure(args.steps, args.repeats, args.micro_batches, args.width, args.batch_size, args.device)
    where = "1 process on cuda:0" if args.device == "cuda" else f"{PROCESSES} emulated stage processes"
    print(f"MLP 6x{args.width}, batch {args.batch_size}, {where}, {args.micro_batches} micro-batches; median step (ms)")
    gpipe, one_f_one_b = results["GPipe"]["hetero"], results["1F1B"]["hetero"]
    planned = results.pop("planned")
    for schedule, r in results.items():
        plain = f"plain {r['plain'] * 1e3:8.2f} (hetero/plain {r['hetero/plain']})" if "plain" in r else ""
        print(
            f"{schedule:>22s}: hetero {r['hetero'] * 1e3:8.2f}, / GPipe {r['hetero'] / gpipe:.3f}, / 1F1B"
            f" {r['hetero'] / one_f_one_b:.3f}, predicted {r['predicted'] * 1e3:8.2f}  {plain}"
        )
    fastest = min(results, key=lambda schedule: results[schedule]["hetero"])
    print(
        f"the analyzer's choice (schedule='auto'): {planned['plan']}, step {planned['hetero'] * 1e3:.2f} ms (predicted"
        f" {planned['predicted'] * 1e3:.2f}), {planned['hetero'] / results[fastest]['hetero']:.3f}x the fastest measured ({fastest})"
    )


if __name__ == "__main__":
    main()
