"""HeteroPlan: one description of a run's layout, validated, round-tripped through YAML, replayed."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from lightning_hetero import HeteroPlan, HeteroStrategy
from tests.conftest import trainer
from tests.models import Net, regression_data

NAMES = [f"layers.{i}" for i in range(6)]


def a_plan(**changes) -> HeteroPlan:
    fields = dict(mode="fine", stages=["cpu", "cpu", "cpu"], boundaries=[2, "layers.4"], micro_batches=3,
                  schedule="1F1B", cpu_workers=2, cpu_threads=1, cpu_fraction=0.25, offload=[0, 2],
                  bucket_size_mb=1.5, dataloader_workers=1, predicted_step_s=0.012)
    fields.update(changes)
    return HeteroPlan(**fields)


def test_yaml_round_trip(tmp_path: Path) -> None:
    plan = a_plan()
    assert HeteroPlan.load(plan.save(tmp_path / "plan.yaml")) == plan


def test_cut_by_index_or_module_name() -> None:
    assert a_plan().cut(NAMES) == [(0, 2), (2, 4), (4, 6)]
    assert a_plan(boundaries=[]).cut(NAMES) is None


def test_table_is_readable() -> None:
    table = a_plan().table()
    assert "\ncpu_fraction         0.25\n" in table and "\nboundaries           2, layers.4\n" in table  # aligned


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"boundaries": [2]}, "3 stages need 2 boundaries"),
        ({"boundaries": [3, 2]}, "layer-index boundaries must increase"),
        ({"schedule": "Foo"}, "Schedule 'Foo' is not one of torch's pipeline schedules"),
        ({"cpu_fraction": 1.5}, "`cpu_fraction=1.5` must be between 0 and 1"),
        ({"cpu_workers": 0}, "gives the CPU a share, but `cpu_workers=0`"),
        ({"stages": ["cpu", "tpu", "cpu"]}, "Stage device 'tpu' is not a device name"),
        ({"mode": "coarse"}, "offloaded buckets need `mode: fine`"),
        ({"offload": None}, "`offload=None` must be 'auto', 'none', 'all' or a list of bucket indices"),
        ({"offload": [0, -2]}, "`offload=[0, -2]` must be 'auto', 'none', 'all' or a list of bucket indices"),
        ({"micro_batches": 0}, "`micro_batches=0` must be >= 1"),
    ],
)
def test_invalid_plans(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        a_plan(**changes)


def test_invalid_plan_files(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(a_plan().to_yaml().replace("micro_batches: 3", "micro_batches: three"))
    with pytest.raises(ValueError, match="could not be converted to Integer"):
        HeteroPlan.load(path)
    path.write_text(a_plan().to_yaml() + "pipeline_depth: 2\n")
    with pytest.raises(ValueError, match="Key 'pipeline_depth' not in 'HeteroPlan'"):
        HeteroPlan.load(path)


def test_boundaries_must_fit_the_model(no_processes: None) -> None:
    with pytest.raises(ValueError, match=re.escape("boundary 'blocks.3' is not one of the model's layers")):
        trainer(HeteroStrategy(plan=a_plan(boundaries=[2, "blocks.3"])), max_steps=1).fit(Net(), regression_data())
    with pytest.raises(ValueError, match=re.escape("do not cut the model's 6 layers into 3 non-empty stages")):
        trainer(HeteroStrategy(plan=a_plan(boundaries=[2, 6])), max_steps=1).fit(Net(), regression_data())


def test_plan_or_arguments_not_both(no_processes: None, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape("['micro_batches'] are given beside the plan")):
        HeteroStrategy(plan=a_plan(), micro_batches=2)
    with pytest.raises(FileNotFoundError):  # a missing file is that, whatever else is given
        HeteroStrategy(plan=tmp_path / "missing.yaml", micro_batches=2)


def test_a_plan_on_the_command_line_leaves_out_the_configs_layout(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`hetero fit --config configs/mlp.yaml --trainer.strategy.init_args.plan plan.yaml`: the
    config's stages, fraction and micro-batches are left to the plan (they used to be refused as
    given twice); a plan file that is missing is said to be so."""
    from lightning_hetero.cli import HeteroCLI
    from recipes.mlp import DigitsData, DigitsMLP

    saved = a_plan(mode="coarse", stages=["cpu", "cpu"], boundaries=["layers.2"], cpu_workers=1, offload=[]).save(
        tmp_path / "plan.yaml"
    )
    config = Path(__file__).parents[1] / "configs" / "mlp.yaml"
    with caplog.at_level(logging.INFO):
        cli = HeteroCLI(DigitsMLP, DigitsData, run=False, args=["--config", str(config), "--trainer.strategy.init_args.plan", str(saved)])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, HeteroStrategy) and strategy.plan.boundaries == ["layers.2"]
    assert (strategy.cpu_fraction, strategy.plan.micro_batches) == (0.25, 3)
    assert "the config's ['cpu_fraction', 'micro_batches', 'stages'] are left to it" in caplog.text
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        HeteroCLI(DigitsMLP, DigitsData, run=False, args=["--config", str(config), "--trainer.strategy.init_args.plan", str(tmp_path / "missing.yaml")])


def test_a_plan_for_another_machine_names_its_missing_device() -> None:
    plan = a_plan(stages=["cuda:0", "cuda:1", "cuda:2"])  # a valid plan ...
    with pytest.raises(ValueError, match="is a GPU, but CUDA is not available"):
        HeteroStrategy(plan=plan)  # ... that this machine cannot run


def test_replayed_plan_lays_out_the_run_exactly(tmp_path: Path) -> None:
    plan = a_plan(mode="coarse", offload=[], dataloader_workers=None)
    strategy = HeteroStrategy(plan=plan.save(tmp_path / "plan.yaml"), start_method="fork", timeout=60)
    assert (strategy.cpu_fraction, strategy.mode, strategy.topology.cpu_workers) == (0.25, "coarse", 2)
    from tests.test_registration import RecordLayout

    trainer(strategy, max_steps=2, callbacks=[RecordLayout(tmp_path)]).fit(Net(), regression_data())
    import json

    held = [json.loads((tmp_path / f"rank{r}.json").read_text())["params"] for r in range(2, 5)]
    assert held == [
        ["layers.0.bias", "layers.0.weight"],  # layers 0-1
        ["layers.2.bias", "layers.2.weight"],  # layers 2-3
        ["layers.4.bias", "layers.4.weight"],  # layers 4-5
    ]


def test_a_plan_written_with_the_earlier_name_of_the_split_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    written = HeteroPlan(cpu_workers=2).save(tmp_path / "new.yaml").read_text()
    path.write_text(written.replace("shard_cpu_optimizer: true", "shard_offloaded: false"))
    with pytest.warns(UserWarning, match="`shard_offloaded` is now `shard_cpu_optimizer`"):
        assert HeteroPlan.load(path) == HeteroPlan(cpu_workers=2, shard_cpu_optimizer=False)
