"""The workload analyzer measures, plans and applies a layout; the layout never changes the maths.

With the analyzer on, training is still equivalent to one process; the plan it chose is written
beside the logs, logged as hyperparameters with its predicted step time, and explained; the
measured step time is logged beside the prediction; and replaying the written plan lays the run
out exactly as the analyzer did.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from torch import nn

from lightning_hetero import HeteroPlan, HeteroStrategy
from lightning_hetero.callbacks import WorkloadAnalyzer
from lightning_hetero.callbacks.analyzer import _machine, _shared_cores, fixed_cost, profile_role
from lightning_hetero.planner import main as planner_main
from lightning_hetero.planner import predict_plan
from lightning_hetero.profiling import Profile
from tests.conftest import TIMEOUT, hetero, max_param_diff, trainer
from tests.models import BatchNormNet, Net, column, read_metrics, regression_data
from tests.test_equivalence import STEPS, assert_same_run
from tests.test_replicas import assert_same_run as assert_same_replicas_run


WARMUP = 5  # the analyzer's warm-up steps in these tests (the equivalence runs take STEPS)


class RecordPlan(L.Callback):
    """Every rank writes the plan its strategy follows and the parameters it holds."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, HeteroStrategy):
            return  # the plain reference
        record = {
            "plan": strategy.plan.as_dict() if strategy.plan is not None else None,
            "params": sorted(n for n, p in pl_module.named_parameters() if not p.is_meta),
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Every rank's optimizer steps, and on rank 0 how the analyzer plays them out."""
        strategy = trainer.strategy
        if not isinstance(strategy, HeteroStrategy):
            return
        role = profile_role(strategy.role)
        warmup = [r for r in strategy.step_records if 1 <= r.step < WARMUP]
        record: dict[str, Any] = {"role": role, "optimizer": [r.optimizer for r in warmup]}
        analyzer = next((cb for cb in trainer.callbacks if isinstance(cb, WorkloadAnalyzer)), None)
        if warmup and analyzer is not None and analyzer.profile is not None and analyzer.plan is not None:
            # The calibrated profile played out in the layout the warm-up ran.
            (fraction,) = {r.cpu_fraction for r in warmup}
            layout = replace(analyzer.plan, cpu_fraction=fraction)
            played = predict_plan(analyzer.profile, _machine(strategy, analyzer.profile), layout)
            record.update(fraction=fraction, played=played.optimizer_by_role)
        (self.out / f"steps{trainer.global_rank}.json").write_text(json.dumps(record))


def assert_optimizer_steps_play_out_as_timed(out: Path) -> dict[str, Any]:
    """Each process's optimizer step plays out, in the warm-up's layout, as long as it took there
    (the median of its warm-up steps); returns rank 0's record. (A stage process whose stages hold no
    parameters, as a planned cut into several stages per process may leave one, has no step to play.)"""
    steps = [json.loads(path.read_text()) for path in sorted(out.glob("steps*.json"))]
    played = steps[0]["played"]
    assert {"stage0", "stage1"} <= set(played) and any(played[role] > 0 for role in ("stage0", "stage1"))
    for rank in steps:
        if played.get(rank["role"], 0.0) > 0:
            stepped = [seconds for seconds in rank["optimizer"] if seconds > 0]  # batches that accumulate have none
            assert played[rank["role"]] == pytest.approx(statistics.median(stepped), rel=0.01)
    return steps[0]


def layouts(out: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]


@pytest.mark.parametrize("mode", ["coarse", "fine"])
def test_analyzer_plans_and_training_stays_equivalent(tmp_path: Path, mode: str) -> None:
    analyzer = WorkloadAnalyzer(repeats=1, max_micro_batches=4, warmup_steps=WARMUP, measure_steps=2)
    layout = tmp_path / "layout"
    layout.mkdir()
    strategy = hetero(mode=mode, stages=["cpu", "cpu"], micro_batches=1)
    assert_same_run(tmp_path, strategy, callbacks=[analyzer, RecordPlan(layout)])

    ranks = layouts(layout)
    assert len(ranks) == 3 and all(r["plan"] == ranks[0]["plan"] for r in ranks)  # one plan, on every rank
    plan = HeteroPlan(**ranks[0]["plan"])
    assert (plan.mode, plan.stages, plan.cpu_workers) == (mode, ["cpu", "cpu"], 1)
    assert plan.predicted_step_s is not None and plan.predicted_step_s > 0

    logs = tmp_path / "hetero"
    assert HeteroPlan.load(logs / "plan.yaml") == plan  # written beside the logs
    profile = Profile.load(logs / "profile.json")
    assert [layer.name for layer in profile.layers] == [f"layers.{i}" for i in range(len(profile.layers))]
    assert {"cpu", "stage0"} <= set(profile.devices)
    # How the processes on the CPU's cores share them, measured in both kinds of layout.
    assert set(profile.shared_cores) == {"shared", "stages"}
    assert all(0 < cores <= profile.cpu_cores for cores in profile.shared_cores.values())
    assert all(profile.devices[role].step_s_by_threads for role in ("cpu", "stage0", "stage1"))
    assert profile.step_method_s_per_sample >= 0
    explanation = (logs / "explain.txt").read_text()
    assert "layers.0" in explanation and "predicted" in explanation and "measured" in explanation
    # The machine's NUMA nodes, as numa.py reads them, and what the CPU workers make of them.
    from lightning_hetero.numa import numa_nodes

    assert profile.numa_nodes == [list(node.cpus) for node in numa_nodes()]
    assert f"CPU: {len(profile.numa_nodes)} NUMA node(s)" in explanation

    hparams = yaml.safe_load((logs / "hparams.yaml").read_text())
    assert hparams["hetero_plan"]["mode"] == mode and hparams["hetero_predicted_step_s"] == plan.predicted_step_s
    rows = read_metrics(logs)
    (step, predicted), = column(rows, "analyzer/predicted_step_s")
    (_, measured), = column(rows, "analyzer/measured_step_s")
    (_, error), = column(rows, "analyzer/prediction_error")
    (_, fixed), = column(rows, "analyzer/fixed_step_s")
    assert WARMUP + 2 <= step <= STEPS  # after the warm-up and the measured steps
    assert measured > 0 and error == pytest.approx(measured / predicted - 1)
    # The fixed cost per step measured in the warm-up replaced the estimate, in the prediction and the profile.
    assert 0 < fixed < predicted and fixed == pytest.approx(Profile.load(logs / "profile.json").step_overhead_s)
    if mode == "coarse":
        assert_optimizer_steps_play_out_as_timed(layout)


class ElsewhereUntil(L.Callback):
    """Runs the first ``steps`` at another CPU fraction than the plan's, as the rebalancer does
    when it measures its baseline (every rank alike), then goes back to the plan's."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.planned: float | None = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        if trainer.global_step == 0 and self.planned is None:
            self.planned = strategy.cpu_fraction
            strategy.set_cpu_fraction(0.0 if self.planned else 0.5)
        elif trainer.global_step == self.steps and self.planned is not None:
            strategy.set_cpu_fraction(self.planned)


def test_where_the_run_leaves_the_plans_fraction_the_analyzer_follows(tmp_path: Path) -> None:
    """The optimizer steps timed in a warm-up at another fraction are played out at that fraction,
    and the step time is measured only where the run is at the plan's fraction."""
    elsewhere, measure = WARMUP + 3, 2
    analyzer = WorkloadAnalyzer(repeats=1, max_micro_batches=2, warmup_steps=WARMUP, measure_steps=measure)
    out = tmp_path / "layout"
    out.mkdir()
    strategy = hetero(stages=["cpu", "cpu"], micro_batches=1)
    callbacks = [analyzer, ElsewhereUntil(elsewhere), RecordPlan(out)]
    trainer(strategy, tmp_path / "logs", max_steps=elsewhere + measure + 1, callbacks=callbacks).fit(
        _net(), regression_data(240)
    )
    plan = HeteroPlan.load(tmp_path / "logs" / "plan.yaml")
    assert assert_optimizer_steps_play_out_as_timed(out)["fraction"] == (0.0 if plan.cpu_fraction else 0.5)
    (step, _), = column(read_metrics(tmp_path / "logs"), "analyzer/measured_step_s")
    assert step == elsewhere + measure  # logged after the measured steps' end


def test_the_replicas_best_layout_is_weighed_beside_the_pipeline_and_replays(tmp_path: Path) -> None:
    """The analyzer plans the pipeline the run is, and predicts the best layout of replicas for the
    same devices beside it (explain.txt, plan_replicas.yaml); that plan replays as replicas and
    trains the model one process trains."""
    analyzer = WorkloadAnalyzer(repeats=1, max_micro_batches=2, warmup_steps=WARMUP, measure_steps=1)
    logs = tmp_path / "logs"
    trainer(hetero(stages=["cpu", "cpu"], micro_batches=1), logs, max_steps=WARMUP + 1, callbacks=[analyzer]).fit(
        _net(), regression_data()
    )
    explained = (logs / "explain.txt").read_text()
    assert "parallelism='replicas' (the whole model on every device): predicted step" in explained
    replicas = HeteroPlan.load(logs / "plan_replicas.yaml")
    assert (replicas.parallelism, replicas.stages, replicas.micro_batches) == ("replicas", ["cpu", "cpu"], 1)
    assert replicas.predicted_step_s is not None and replicas.predicted_step_s > 0
    # Once measured, both layouts are predicted again with the warm-up's measurements, and compared so.
    from lightning_hetero.planner import Machine, predict_plan

    profile, plan = Profile.load(logs / "profile.json"), HeteroPlan.load(logs / "plan.yaml")
    machine = Machine.as_profiled(profile, ["cpu", "cpu"], 1)
    machine.cpu_threads = plan.cpu_threads
    ours, theirs = predict_plan(profile, machine, plan).step_s, predict_plan(profile, machine, replicas).step_s
    assert f"predicted step {theirs * 1e3:.2f} ms, {theirs / ours:.2f}x this plan's" in explained
    plain = _net()
    trainer(None, max_steps=8).fit(plain, regression_data())
    replayed = _net()
    strategy = HeteroStrategy(plan=logs / "plan_replicas.yaml", start_method="fork", timeout=TIMEOUT)
    trainer(strategy, max_steps=8).fit(replayed, regression_data())
    assert max_param_diff(plain, replayed) < 1e-10


@pytest.mark.parametrize("mode", ["coarse", "fine"])
def test_a_run_of_replicas_is_planned_from_its_blocks(tmp_path: Path, mode: str) -> None:
    """A model that offers blocks, trained as replicas: the analyzer profiles its blocks, sizes the
    CPU's share for replicas, weighs the pipeline beside it, and the run is one process's."""
    analyzer = WorkloadAnalyzer(repeats=1, max_micro_batches=2, warmup_steps=WARMUP, measure_steps=1)
    layout = tmp_path / "layout"
    layout.mkdir()
    strategy = hetero(mode=mode, stages=["cpu", "cpu"], parallelism="replicas")
    assert_same_run(tmp_path, strategy, callbacks=[analyzer, RecordPlan(layout)])
    plan = HeteroPlan(**layouts(layout)[0]["plan"])
    assert (plan.parallelism, plan.micro_batches, plan.boundaries) == ("replicas", 1, [])
    assert all(r["plan"] == layouts(layout)[0]["plan"] for r in layouts(layout))
    assert HeteroPlan.load(tmp_path / "hetero" / "plan.yaml") == plan
    assert HeteroPlan.load(tmp_path / "hetero" / "plan_pipeline.yaml").parallelism == "pipeline"
    explained = (tmp_path / "hetero" / "explain.txt").read_text()
    assert "every device" in explained and "parallelism='pipeline' (the blocks cut into stages)" in explained


def test_replicas_of_a_model_that_cannot_be_a_pipeline_are_planned(tmp_path: Path) -> None:
    """A model that offers blocks but has BatchNorm (whole-batch statistics): its replicas are planned
    from its blocks, no pipeline is weighed beside them, and the run is one process's."""
    analyzer = WorkloadAnalyzer(repeats=1, warmup_steps=WARMUP, measure_steps=1)
    strategy = hetero(stages=["cpu", "cpu"], parallelism="replicas", cpu_fraction=0.5)
    assert_same_replicas_run(tmp_path, strategy, BatchNormNet, callbacks=[analyzer], sync_batchnorm=True)
    assert HeteroPlan.load(tmp_path / "hetero" / "plan.yaml").parallelism == "replicas"
    assert not (tmp_path / "hetero" / "plan_pipeline.yaml").exists()
    assert "parallelism='pipeline'" not in (tmp_path / "hetero" / "explain.txt").read_text()


def test_explain_says_the_split_of_the_cores_plan_yaml_has(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up's check of the cores' split (here: one DataLoader worker where the plan had none)
    rewrites plan.yaml and explain.txt alike, also where the run ends before its steps are measured."""
    from dataclasses import replace

    import lightning_hetero.callbacks.analyzer as analyzer_module

    split_cores = analyzer_module.split_cores

    def one_worker_at_the_check(*args: Any, **kwargs: Any) -> Any:
        split = split_cores(*args, **kwargs)
        return split if "fixed_workers" in kwargs else replace(split, dataloader_workers=1)  # the plan's, then the check's

    monkeypatch.setattr(analyzer_module, "split_cores", one_worker_at_the_check)  # the forked ranks' too
    analyzer = WorkloadAnalyzer(repeats=1, warmup_steps=WARMUP, measure_steps=50, save_dir=str(tmp_path))
    trainer(hetero(cpu_fraction=0.5), max_steps=WARMUP + 2, callbacks=[analyzer]).fit(Net(), regression_data())
    assert HeteroPlan.load(tmp_path / "plan.yaml").dataloader_workers == 1
    assert "chosen: 1 DataLoader worker(s) per rank" in (tmp_path / "explain.txt").read_text()


def test_a_model_without_blocks_keeps_its_layout(tmp_path: Path) -> None:
    from tests.models import TwoPass

    analyzer = WorkloadAnalyzer(repeats=1, warmup_steps=WARMUP, measure_steps=1, save_dir=str(tmp_path))
    run = trainer(hetero(cpu_fraction=0.5, parallelism="replicas"), max_steps=2, callbacks=[analyzer])
    with pytest.warns(UserWarning, match="offers none: it trains as its layout sets"):
        analyzer.setup(run, TwoPass(), "fit")  # as each process calls it
    run.fit(TwoPass(), regression_data())
    assert not list(tmp_path.iterdir())  # no plan


def test_batches_that_accumulate_are_not_timed_as_optimizer_steps(tmp_path: Path) -> None:
    analyzer = WorkloadAnalyzer(repeats=1, max_micro_batches=2, warmup_steps=WARMUP, measure_steps=1)
    out = tmp_path / "layout"
    out.mkdir()
    strategy = hetero(stages=["cpu", "cpu"], micro_batches=1)
    run = trainer(strategy, tmp_path / "logs", max_steps=WARMUP + 1, accumulate_grad_batches=2, callbacks=[analyzer, RecordPlan(out)])
    run.fit(_net(), regression_data())
    assert_optimizer_steps_play_out_as_timed(out)


def test_the_warm_up_needs_a_step_after_the_first() -> None:
    with pytest.raises(ValueError, match="`warmup_steps=1`"):
        WorkloadAnalyzer(warmup_steps=1)
    with pytest.raises(ValueError, match="`measure_steps=0`"):
        WorkloadAnalyzer(measure_steps=0)


def test_replayed_plan_reproduces_the_analyzers_layout(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    analyzer = WorkloadAnalyzer(repeats=1, measure_steps=1)
    strategy = hetero(stages=["cpu", "cpu", "cpu"])
    trainer(strategy, tmp_path / "logs", max_steps=2, callbacks=[analyzer, RecordPlan(first)]).fit(
        _net(), regression_data()
    )
    replay = HeteroStrategy(plan=tmp_path / "logs" / "plan.yaml", start_method="fork", timeout=TIMEOUT)
    trainer(replay, max_steps=2, callbacks=[RecordPlan(second)]).fit(_net(), regression_data())
    assert layouts(first) == layouts(second)  # the same plan, and every rank holds the same layers


def test_analyzer_is_quiet_without_the_hetero_strategy(tmp_path: Path) -> None:
    """On a plain Trainer it has nothing to plan: it neither fails nor writes anything."""
    analyzer = WorkloadAnalyzer(save_dir=str(tmp_path / "plans"))
    trainer(None, max_steps=2, callbacks=[analyzer]).fit(_net(), regression_data())
    assert analyzer.plan is None and not (tmp_path / "plans").exists()


def test_command_line_planner_sizes_a_hypothetical_machine(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    analyzer = WorkloadAnalyzer(repeats=1, measure_steps=1)
    trainer(hetero(stages=["cpu", "cpu"]), tmp_path / "logs", max_steps=1, callbacks=[analyzer]).fit(
        _net(), regression_data()
    )
    profile = tmp_path / "logs" / "profile.json"
    saved = tmp_path / "four.yaml"
    args = [str(profile), "--gpus", "4", "--gpu-speed", "8", "--cpu-cores", "32", "--save", str(saved)]
    planner_main(args)
    printed = capsys.readouterr().out
    plan = HeteroPlan.load(saved)
    assert plan.stages == [f"cuda:{i}" for i in range(4)] and len(plan.boundaries) == 3
    assert "predicted step" in printed and "bubble" in printed and "cuda:3" in printed
    assert "parallelism='replicas' (the whole model on every device)" in printed  # weighed beside it
    assert "CPU: 32 cores (as given); 1 CPU worker(s) of 28 thread(s) each" in printed  # not the profile's cores
    planner_main([*args[:-2], "--parallelism", "auto", "--save", str(tmp_path / "best.yaml")])
    best = HeteroPlan.load(tmp_path / "best.yaml")
    assert plan.parallelism == "pipeline" and best.predicted_step_s <= plan.predicted_step_s  # the faster one
    with pytest.raises(SystemExit):
        planner_main([str(tmp_path / "missing.json")])
    assert "missing.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # more GPUs than blocks: not a question of memory
        planner_main([str(profile), "--gpus", "8"])
    assert "A pipeline of 8 stage processes needs a block each, and the model has 6" in capsys.readouterr().err
    for option, value, error in [
        ("--gpus", "0", "argument --gpus: must be at least 1, not 0"),
        ("--gpu-speed", "-1", "argument --gpu-speed: must be more than 0, not -1"),
        ("--sync-gbps", "0", "argument --sync-gbps: must be more than 0, not 0"),
        ("--batch-size", "0", "argument --batch-size: must be at least 1, not 0"),
        ("--cpu-fraction", "1.5", "argument --cpu-fraction: must be at least 0 and at most 1, not 1.5"),
        ("--max-micro-batches", "two", "argument --max-micro-batches: must be an integer, not 'two'"),
        ("--gpu-speed", "nan", "argument --gpu-speed: must be a finite number, not nan"),
        ("--cpu-fraction", "nan", "argument --cpu-fraction: must be a finite number, not nan"),
        ("--sync-gbps", "inf", "argument --sync-gbps: must be a finite number, not inf"),
    ]:
        with pytest.raises(SystemExit):
            planner_main([str(profile), option, value])
        assert error in capsys.readouterr().err


def _net() -> L.LightningModule:
    from tests.models import Net

    return Net(width=32)


def test_the_fixed_cost_leaves_out_what_the_model_predicts() -> None:
    """Per rank ``(data, wait, optimizer)``: a busy step, then one where an idle CPU worker (rank 0)
    spends the stage's 40 ms optimizer step waiting between steps, which is not a fixed cost."""
    assert fixed_cost([(0.003, 0.010, 0.005), (0.002, 0.001, 0.004)]) == pytest.approx(0.003 + 0.001)
    assert fixed_cost([(0.042, 0.050, 0.0), (0.002, 0.0, 0.040)]) == pytest.approx(0.002)


def test_a_probe_that_cannot_run_leaves_the_cores_as_they_are() -> None:
    """A layout some rank could not measure keeps the nominal cores; a model whose loss the probe
    cannot run this way warns instead of failing the fit."""
    parts = [
        {"node": 0, "sharing": {"shared": (1, 0.1, 0.15), "stages": (1, 0.1, None)}},
        {"node": 0, "sharing": {"shared": (1, 0.1, 0.15), "stages": (1, 0.1, 0.12)}},
        {"node": 1, "sharing": {"shared": (1, 0.1, 0.5)}},  # another node's cores
    ]
    assert _shared_cores(parts, 2) == {"shared": pytest.approx(2 / 1.5)}
    assert _shared_cores([{"node": 0, "sharing": {"shared": (2, 0.1, 0.09)}}], 2) == {"shared": 2}  # never more

    class Unmeasurable(nn.Module):
        def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("needs the trainer")

    with pytest.warns(UserWarning, match="could not run a training step"):
        step = WorkloadAnalyzer()._step_work(Unmeasurable(), [nn.Linear(4, 4)], torch.randn(2, 4), torch.randn(2, 4))
    assert step is None


def test_the_cores_are_probed_only_where_processes_share_them() -> None:
    """With GPU stages and one CPU worker, nothing else computes on the CPU's cores: no probe (it
    would run the whole batch on the CPU at start-up for nothing). Emulated stages probe both."""
    from types import SimpleNamespace

    from lightning_hetero.topology import Topology

    def sharing(stages: tuple[str, ...], cpu_workers: int, local_rank: int) -> dict[str, int]:
        topology = Topology(cpu_workers=cpu_workers, stage_devices=tuple(torch.device(s) for s in stages))
        role = topology.role(local_rank)
        device = topology.local_devices[local_rank]
        return WorkloadAnalyzer._sharing(SimpleNamespace(root_device=device, role=role, topology=topology, plan=SimpleNamespace(cpu_threads=None)))

    assert sharing(("cuda:0", "cuda:1"), 1, 0) == {}  # the one CPU worker
    assert sharing(("cuda:0", "cuda:1"), 1, 1) == {}  # a GPU stage
    assert set(sharing(("cuda:0",), 2, 0)) == {"shared"}  # two CPU workers share the cores
    assert set(sharing(("cpu", "cpu"), 1, 0)) == {"shared"}
    assert set(sharing(("cpu", "cpu"), 1, 2)) == {"shared", "stages"}


class DataInSetup(L.LightningModule):
    """Builds its dataset in `setup` (a common Lightning pattern) and its blocks in `configure_model`."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: nn.ModuleList | None = None

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(1)
        self.data = torch.utils.data.TensorDataset(torch.randn(48, 6, generator=g), torch.randn(48, 3, generator=g))

    def configure_model(self) -> None:
        if self.layers is None:
            torch.manual_seed(0)
            self.layers = nn.ModuleList([nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)])

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self.data, batch_size=12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:  # type: ignore[union-attr]
            x = layer(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.pipeline_loss(self(batch[0]), batch[1])

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)  # type: ignore[arg-type]

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_analyzer_plans_after_the_modules_own_setup(tmp_path: Path) -> None:
    """The plan is made when the strategy is about to cut the model: after the module's `setup` (its
    data) and `configure_model` (its blocks)."""
    analyzer = WorkloadAnalyzer(warmup_steps=2, measure_steps=1, repeats=1, contention_s=0.05, save_dir=str(tmp_path))
    trainer(hetero(timeout=TIMEOUT), max_steps=4, callbacks=[analyzer]).fit(DataInSetup())
    assert HeteroPlan.load(tmp_path / "plan.yaml").stages == ["cpu", "cpu"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_planned_layout_keeps_the_cpu_workers_cores_and_their_split(tmp_path: Path) -> None:
    """What the layout planner does not choose stays as the run sets it: the CPU workers' cores and
    how they hold the optimizer. Global rank 0 (a CPU worker pinned to one core here) plans, and the
    profile still sees the machine's every core, as its node's processes together do."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    analyzer = WorkloadAnalyzer(repeats=1, max_micro_batches=2, warmup_steps=WARMUP, measure_steps=1, save_dir=str(tmp_path))
    strategy = hetero(stages=["cpu"], cpu_workers=[[first], [second]], cpu_fraction=0.5, shard_cpu_optimizer=False)
    trainer(strategy, max_steps=WARMUP + 2, callbacks=[analyzer]).fit(Net(), regression_data())
    plan = HeteroPlan.load(tmp_path / "plan.yaml")
    assert plan.cpu_cores == [[first], [second]] and plan.shard_cpu_optimizer is False
    profile = Profile.load(tmp_path / "profile.json")
    assert profile.cpu_cores == len(os.sched_getaffinity(0))
    assert sum(len(node) for node in profile.numa_nodes) == len(os.sched_getaffinity(0))
    assert "a whole copy in each (shard_cpu_optimizer=False)" in (tmp_path / "explain.txt").read_text()


def test_a_plan_that_replaces_values_given_says_so(no_processes: None) -> None:
    """The workload analyzer plans the CPU fraction, micro-batches and offload: where its plan replaces
    values the strategy was given, a warning names them; values left at their defaults change silently."""
    import warnings

    strategy = HeteroStrategy(stages=["cpu", "cpu"], cpu_fraction=0.3, micro_batches=2)
    with pytest.warns(UserWarning, match=r"replaces cpu_fraction=0.3 with 1.0, micro_batches=2 with 1"):
        strategy.apply_plan(replace(strategy.plan, cpu_fraction=1.0, micro_batches=1))
    placed = HeteroStrategy(stages=["cpu"], cpu_fraction=0.3, parallelism="replicas", encoders={"image": "cpu0"})
    with pytest.warns(UserWarning, match=re.escape("replaces encoders={'image': 'cpu0'} with {}")):
        placed.apply_plan(replace(placed.plan, encoders={}))
    quiet = HeteroStrategy(stages=["cpu", "cpu"], cpu_fraction=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet.apply_plan(replace(quiet.plan, micro_batches=1))  # the default, 4, was not given
        quiet.apply_plan(replace(quiet.plan, cpu_fraction=0.3))
