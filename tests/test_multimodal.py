"""Multimodal models: each modality's encoder computed on the process it is placed on, for every
worker's share, while the others compute theirs; the model is the one a single process trains
(float64, 1e-10), whatever the placement, in coarse and fine mode, when the placement changes
mid-run, across a resume, and with samples that lack a modality."""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_hetero.pipeline import available_schedules
from lightning_hetero import HeteroPlan, HeteroStrategy
from tests.conftest import hetero, max_param_diff, trainer
from tests.models import Multimodal, TwoPass, multimodal_data, phased_data
from tests.test_replicas import assert_same_run

TOL = 1e-10


def same_run(tmp_path: Path, strategy: HeteroStrategy, data: Any = multimodal_data, **kwargs: Any) -> None:
    assert_same_run(tmp_path, strategy, Multimodal, data, **kwargs)


@pytest.mark.parametrize(
    "layout",
    [
        dict(encoders={"image": "device0", "text": "cpu0"}, cpu_fraction=0.3),
        dict(encoders={"image": "device1", "text": "device0"}, cpu_fraction=0.3),
        dict(encoders={"image": "cpu0"}, cpu_fraction=0.0),
        dict(encoders={"text": "cpu1"}, cpu_workers=2, stages=["cpu"], cpu_fraction=0.5),
        dict(encoders={"image": "device0", "text": "cpu"}, stages=["cpu"], cpu_fraction=0.0),
        dict(cpu_fraction=0.3),
    ],
    ids=["image-on-device-text-on-cpu", "each-on-a-device", "cpu-without-a-share", "second-cpu-worker", "one-stage", "split"],
)
def test_placed_encoders_train_the_one_process_model(tmp_path: Path, layout: dict) -> None:
    same_run(tmp_path, hetero(**layout))


class CountEncoded(L.Callback):
    """Each rank writes how many images and texts its copy of each encoder encoded."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        counts = {"image": pl_module.image.samples, "text": pl_module.text.samples}
        torch.save(counts, self.out_dir / f"encoded{trainer.global_rank}.pt")


@pytest.mark.parametrize("cpu_fraction", [0.0, 0.5])
def test_each_encoder_runs_where_it_is_placed(tmp_path: Path, cpu_fraction: float) -> None:
    """Images are encoded on the first device's process only, texts on the CPU worker only, split
    encoders where each share is computed: every sample once."""
    steps, encoders = 4, {"image": "device0", "text": "cpu0"}
    t = trainer(hetero(encoders=encoders, cpu_fraction=cpu_fraction), max_steps=steps, callbacks=[CountEncoded(tmp_path)])
    t.fit(Multimodal(), multimodal_data())
    encoded = [torch.load(tmp_path / f"encoded{rank}.pt") for rank in range(3)]  # cpu0, device0, device1
    batches = list(multimodal_data())[:steps]
    images, texts = (sum(int(b[key].sum()) for b in batches) for key in ("has_image", "has_text"))
    assert [e["image"] for e in encoded] == [0, images, 0]
    assert [e["text"] for e in encoded] == [texts, 0, 0]


@pytest.mark.parametrize("offload", ["none", "all"])
def test_placed_encoders_in_fine_mode(tmp_path: Path, offload: str) -> None:
    """Fine mode counts each encoder parameter's gradients where they arrive: every share's on its
    host, none where it runs elsewhere (small buckets: several per encoder)."""
    strategy = hetero(mode="fine", offload=offload, bucket_size_mb=0.001, encoders={"image": "device0", "text": "cpu0"}, cpu_fraction=0.3)
    same_run(tmp_path, strategy)


def test_placed_encoders_accumulate_and_clip_as_one_process(tmp_path: Path) -> None:
    strategy = hetero(encoders={"image": "cpu0", "text": "device1"}, cpu_fraction=0.3)
    same_run(tmp_path, strategy, accumulate_grad_batches=2, gradient_clip_val=0.05)


def test_a_modality_missing_from_whole_batches(tmp_path: Path) -> None:
    """From the second batch on no sample has an image: the image encoder's host computes nothing,
    and its parameters receive no gradient."""
    data = partial(multimodal_data, text_only_from=12)
    same_run(tmp_path, hetero(encoders={"image": "cpu0", "text": "device1"}, cpu_fraction=0.3), data)
    same_run(tmp_path / "fine", hetero(mode="fine", encoders={"image": "cpu0"}, cpu_fraction=0.3), data)


class Replace(L.Callback):
    """Places the encoders so from batch ``at`` on, on every rank."""

    def __init__(self, at: int, placement: dict[str, str]) -> None:
        self.at, self.placement = at, placement

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.at and isinstance(trainer.strategy, HeteroStrategy):
            trainer.strategy.set_encoder_placement(self.placement)
            assert trainer.strategy.encoder_placement == self.placement


@pytest.mark.parametrize("mode", ["coarse", "fine"])
def test_placement_changes_mid_run(tmp_path: Path, mode: str) -> None:
    strategy = hetero(mode=mode, encoders={"image": "cpu0"}, cpu_fraction=0.3)
    same_run(tmp_path, strategy, callbacks=[Replace(3, {"image": "device0", "text": "cpu0"}), Replace(5, {})])


@pytest.mark.parametrize("mode", ["coarse", "fine"])
def test_resume_with_placed_encoders(tmp_path: Path, mode: str) -> None:
    """A run with placed encoders saves an ordinary checkpoint, which a run with another placement resumes."""

    def fit(strategy: Any, steps: int, ckpt: Path | None = None, save: bool = False) -> L.LightningModule:
        model = Multimodal().double()  # a checkpoint loads before the precision plugin converts the model
        saving = ModelCheckpoint(tmp_path / "ckpt", filename="{step}", every_n_train_steps=1, save_top_k=-1)
        trainer(strategy, max_steps=steps, callbacks=[saving] if save else [], enable_checkpointing=save).fit(
            model, multimodal_data(), ckpt_path=ckpt
        )
        return model

    fit(hetero(mode=mode, encoders={"image": "device0", "text": "cpu0"}, cpu_fraction=0.3), 3, save=True)
    checkpoint = tmp_path / "ckpt" / "step=3.ckpt"
    resumed = fit(hetero(mode=mode, encoders={"text": "device1"}, cpu_fraction=0.5), 8, ckpt=checkpoint)
    assert max_param_diff(fit(None, 8, ckpt=checkpoint), resumed) < TOL


def test_the_placement_is_part_of_the_plan(tmp_path: Path) -> None:
    strategy = HeteroStrategy(stages=["cpu", "cpu"], encoders={"image": "device", "text": "cpu"})
    assert strategy.plan.encoders == {"image": "device0", "text": "cpu0"}
    named = HeteroStrategy(stages=["cpu", "cpu"], encoders={"image": "replica1", "text": "stage0"})  # as the logs name them
    assert named.plan.encoders == {"image": "device1", "text": "device0"}
    path = strategy.plan.save(tmp_path / "plan.yaml")
    assert HeteroPlan.load(path).encoders == {"image": "device0", "text": "cpu0"}
    assert HeteroStrategy(plan=path).encoder_placement == {"image": "device0", "text": "cpu0"}  # replays
    assert "image: device0" in strategy.plan.table()
    assert HeteroStrategy(stages=["cpu", "cpu"], encoders={"image": "split"}).plan.encoders == {}


@pytest.mark.parametrize(
    ("kwargs", "model", "message"),
    [
        (dict(encoders={"image": "gpu"}), Multimodal, "is not a place"),
        (dict(encoders=["image"]), Multimodal, "must map modality names"),
        (dict(encoders={"audio": "cpu0"}), Multimodal, "has encoders \\['image', 'text'\\] only"),
        (dict(encoders={"image": "cpu1"}), Multimodal, "has 1 CPU worker process"),
        (dict(encoders={"image": "device2"}), Multimodal, "has 2 device process"),
        (dict(encoders={"image": "cpu0"}, cpu_workers=0), Multimodal, "has no CPU worker"),
        (dict(encoders={"image": "cpu0"}), TwoPass, "names none"),
        (dict(encoders={"image": "cpu0"}), partial(Multimodal, norm=True), "BatchNorm2d with running statistics"),
    ],
    ids=["bad-place", "not-a-mapping", "unknown-modality", "no-such-cpu-worker", "no-such-device", "no-cpu-workers", "not-multimodal", "batch-norm"],
)
def test_a_placement_that_cannot_run_is_refused_before_any_process_starts(
    tmp_path: Path, no_processes: None, kwargs: dict, model: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        trainer(hetero(**kwargs), max_steps=1).fit(model(), multimodal_data())


class CallsWithOtherInput(Multimodal):
    def forward(self, batch: dict) -> torch.Tensor:
        features = {"image": self.image(batch["image"]), "text": self.text(batch["tokens"])}  # every sample's
        fused = features["image"] * batch["has_image"][:, None] + features["text"] * batch["has_text"][:, None]
        return self.backbone(fused).squeeze(1)


def test_an_encoder_called_on_another_input_than_its_modality_inputs_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="with another input than `modality_inputs"):
        trainer(hetero(encoders={"image": "cpu0"}, cpu_fraction=0.3), max_steps=2).fit(CallsWithOtherInput(), multimodal_data())


def test_the_analyzer_places_the_encoders_where_its_measurements_say(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """It times each encoder and the rest of the step on every process, places the encoders as the
    cost model says for those measurements, explains it, and the run stays the one-process model."""
    from lightning_hetero.callbacks import WorkloadAnalyzer
    from lightning_hetero.encoder_planner import EncoderProfile, best_placement, samples_by_place
    from lightning_hetero.planner import main as planner_main

    analyzer = WorkloadAnalyzer(repeats=1, measure_steps=1, save_dir=str(tmp_path / "plans"))
    same_run(tmp_path, hetero(cpu_fraction=0.3), callbacks=[analyzer])
    profile = EncoderProfile.load(tmp_path / "plans" / "encoders.json")
    assert set(profile.places) == {"cpu0", "device0", "device1"} and set(profile.carrying) == {"image", "text"}
    assert all(t.forward["image"] > 0 and t.backward["image"] >= 0 and t.rest >= 0 for t in profile.places.values())
    samples = samples_by_place(12, 0.3, 1, 2)
    chosen = best_placement(profile.costs(), samples, profile.carrying).placement
    assert HeteroPlan.load(tmp_path / "plans" / "plan.yaml").encoders == chosen
    explained = (tmp_path / "plans" / "explain.txt").read_text()
    assert "Encoders: forward + backward per sample" in explained and "every encoder split" in explained
    # What if: one device 20 times as fast as the profiled one and a CPU worker with no share.
    planner_main([str(tmp_path / "plans" / "encoders.json"), "--gpus", "1", "--gpu-speed", "20", "--cpu-workers", "1"])
    printed = capsys.readouterr().out
    expected = best_placement(profile.on(1, 20.0, 1).costs(), {"cpu0": 0.0, "device0": 12.0}, profile.carrying)
    assert f"HeteroStrategy(encoders={expected.placement})" in printed and "device0 12" in printed


def test_the_analyzer_times_an_encoder_the_first_batch_does_not_use(tmp_path: Path) -> None:
    """No sample of the first batch has a text: the analyzer times the encoders on a later batch that
    carries both modalities, so the text encoder is timed on every process and can be placed."""
    from lightning_hetero.callbacks import WorkloadAnalyzer
    from lightning_hetero.encoder_planner import EncoderProfile

    analyzer = WorkloadAnalyzer(repeats=1, measure_steps=1, save_dir=str(tmp_path / "plans"))
    same_run(tmp_path, hetero(cpu_fraction=0.3), partial(multimodal_data, text_from=12), callbacks=[analyzer])
    profile = EncoderProfile.load(tmp_path / "plans" / "encoders.json")
    assert all(set(t.forward) == {"image", "text"} and t.forward["text"] > 0 for t in profile.places.values())
    assert 0 < profile.carrying["text"] < 1


def test_the_monitor_shows_each_encoders_time_and_the_waits_it_caused(tmp_path: Path) -> None:
    """With the images encoded on the first device for everyone: its time on them is logged and drawn in
    the trace, and so is the others' wait for them; a wait is no compute."""
    import json

    from lightning_hetero.callbacks import UtilizationMonitor
    from tests.models import read_metrics

    speeds = {"image@device": 100.0}  # 10 ms per image, far above the rest of a step: the others wait for them
    monitor = UtilizationMonitor(every_n_steps=2, trace_steps=4, save_dir=str(tmp_path), summary=False)
    strategy = hetero(encoders={"image": "device0"}, cpu_fraction=0.3, emulated_speed=speeds)
    trainer(strategy, tmp_path / "logs", max_steps=4, callbacks=[monitor]).fit(Multimodal(), multimodal_data())
    logged = [row for row in read_metrics(tmp_path / "logs") if "util/cpu0/busy" in row][-1]
    assert logged["util/replica0/encoder_image"] > 0.1 and "util/cpu0/encoder_image" not in logged
    assert logged["util/cpu0/encoder_wait"] > 0.05 and logged["util/replica1/encoder_wait"] > 0.05
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {(e["pid"], e["name"]) for e in events if e["ph"] == "X"}
    assert (1, "encoder image") in names and (0, "wait for an encoder placed elsewhere") in names


@pytest.mark.parametrize(
    "layout",
    [
        dict(encoders={"text": "cpu0"}, cpu_fraction=0.3),
        dict(encoders={"image": "cpu0", "text": "cpu0"}, cpu_fraction=0.0, stages=["cpu"] * 3, schedule="1F1B", micro_batches=3),
        dict(encoders={"image": "cpu0"}, cpu_fraction=0.3, mode="fine", offload="all", bucket_size_mb=0.001),
        dict(encoders={"text": "cpu0", "image": "cpu0"}, cpu_fraction=0.3, schedule="Interleaved1F1B", micro_batches=2),
        dict(encoders={"image": "cpu0"}, cpu_fraction=0.3, schedule="LoopedBFS", mode="fine", offload="all", bucket_size_mb=0.001),
        dict(encoders={"image": "cpu0", "text": "cpu0"}, cpu_fraction=0.3, schedule="ZBVZeroBubble", micro_batches=4),
        dict(encoders={"text": "cpu0"}, cpu_fraction=0.3, schedule="DualPipeV", micro_batches=4, mode="fine"),
        dict(cpu_fraction=0.3, schedule="InterleavedZeroBubble", micro_batches=2),
    ],
    ids=[
        "gpipe", "1f1b-three-stages-cpu-without-a-share", "fine-offloaded", "interleaved", "looped-fine", "zero-bubble-v",
        "dualpipev-fine", "split-encoders-interleaved-zero-bubble",
    ],
)
def test_a_pipelines_first_stage_takes_its_encoders_from_a_cpu_worker(tmp_path: Path, layout: dict) -> None:
    """The stage whose blocks hold a placed encoder answers each micro-batch with its rows of the
    output the CPU worker computed for the pipeline's share, and sends their gradient back; also with
    several stages per process, where the process of the first stage hands the dict of inputs to it
    alone (a multi-stage schedule gives it to all its stages)."""
    from tests.models import PipelinedMultimodal

    if layout.get("schedule", "GPipe") not in ("GPipe", "1F1B", *available_schedules()):
        pytest.skip(f"this torch has no {layout['schedule']}")

    assert_same_run(tmp_path, hetero(**layout), PipelinedMultimodal, multimodal_data, key="train_loss")


def test_the_analyzer_weighs_every_schedule_for_a_pipeline_with_placed_encoders(tmp_path: Path) -> None:
    """A placed encoder's output needs its gradient from the stage that takes it in: the analyzer
    weighs every schedule, a zero-bubble one with the encoders' blocks in its first stage, and the
    run trains as one process does."""
    from lightning_hetero.callbacks import WorkloadAnalyzer
    from tests.models import PipelinedMultimodal

    analyzer = WorkloadAnalyzer(repeats=1, warmup_steps=2, measure_steps=1, save_dir=str(tmp_path / "plan"))
    strategy = hetero(encoders={"image": "cpu0"}, cpu_fraction=0.3)
    assert_same_run(tmp_path, strategy, PipelinedMultimodal, multimodal_data, key="train_loss", callbacks=[analyzer])
    explanation = (tmp_path / "plan" / "explain.txt").read_text()
    table = explanation.split("each schedule weighed")[1].split("\n\n")[0].splitlines()[2:]
    weighed = {line.split()[0] for line in table}
    assert weighed == {"GPipe", "1F1B", *available_schedules()}


@pytest.mark.skipif("ZBVZeroBubble" not in available_schedules(), reason="this torch has no ZBVZeroBubble")
def test_the_analyzer_keeps_a_placed_encoders_block_in_a_zero_bubble_schedules_first_stage(tmp_path: Path) -> None:
    """Left to itself the planner would give the heavy first block a stage of its own and the encoders'
    block to the next, whose split backward sends no gradient back to the encoder: with ZBVZeroBubble
    named, it keeps the encoders' block in the first stage, and the run trains as one process does."""
    from lightning_hetero.callbacks import WorkloadAnalyzer

    analyzer = WorkloadAnalyzer(repeats=1, warmup_steps=2, measure_steps=1, save_dir=str(tmp_path / "plan"))
    strategy = hetero(encoders={"image": "cpu0"}, cpu_fraction=0.3, schedule="ZBVZeroBubble")
    assert_same_run(tmp_path, strategy, HeavyFirstBlock, multimodal_data, key="train_loss", callbacks=[analyzer])
    plan = HeteroPlan.load(tmp_path / "plan" / "plan.yaml")
    assert plan.schedule == "ZBVZeroBubble" and plan.boundaries[0] >= 2


@pytest.mark.skipif("ZBVZeroBubble" not in available_schedules(), reason="this torch has no ZBVZeroBubble")
def test_the_analyzer_keeps_every_encoders_block_first_where_it_places_the_encoders_after_the_cut(tmp_path: Path) -> None:
    """One stage process holding a V's two stages: the analyzer places the encoders after it cuts the
    model, so the cut keeps every encoder's block in the first stage, wherever they go."""
    from lightning_hetero.callbacks import WorkloadAnalyzer

    analyzer = WorkloadAnalyzer(repeats=1, warmup_steps=2, measure_steps=1, save_dir=str(tmp_path / "plan"))
    strategy = hetero(stages=["cpu"], cpu_fraction=0.3, schedule="ZBVZeroBubble")
    assert_same_run(tmp_path, strategy, HeavyFirstBlock, multimodal_data, key="train_loss", callbacks=[analyzer])
    plan = HeteroPlan.load(tmp_path / "plan" / "plan.yaml")
    assert plan.schedule == "ZBVZeroBubble" and plan.boundaries == [2]  # left to itself: [1]


@pytest.mark.skipif("ZBVZeroBubble" not in available_schedules(), reason="this torch has no ZBVZeroBubble")
def test_a_planner_given_before_fit_gives_the_cut_the_launcher_would_refuse(tmp_path: Path) -> None:
    """The plan's cut puts the encoders' block in ZBVZeroBubble's second stage, which the launcher refuses
    before any process starts; a planner given to ``plan_with`` before ``fit`` cuts it again in the
    processes, so the launcher leaves the cut to it, and its plan trains as one process does."""
    from dataclasses import replace

    from tests.conftest import TIMEOUT

    plan = HeteroPlan(
        stages=["cpu", "cpu"], cpu_fraction=0.3, encoders={"image": "cpu0"}, schedule="ZBVZeroBubble",
        stages_per_process=2, micro_batches=2, boundaries=[1, 2, 3], parallelism="pipeline",
    )
    with pytest.raises(ValueError, match="splits the backward"):
        trainer(HeteroStrategy(plan=plan, start_method="fork"), max_steps=1).fit(HeavyFirstBlock(), multimodal_data())
    strategy = HeteroStrategy(plan=plan, start_method="fork", timeout=TIMEOUT)
    strategy.plan_with(lambda trainer, strategy, blocks: replace(strategy.plan, boundaries=[2, 3, 4]))
    assert_same_run(tmp_path, strategy, HeavyFirstBlock, multimodal_data, key="train_loss")


def test_a_pipeline_places_encoders_on_cpu_workers_only(no_processes: None) -> None:
    from tests.models import PipelinedMultimodal

    with pytest.raises(ValueError, match="a stage holds only its own blocks"):
        HeteroStrategy(stages=["cpu", "cpu"], encoders={"image": "device0"}).check_model(PipelinedMultimodal())
    with pytest.raises(ValueError, match="Encoder 'image' .* is in stages \\[0, 1\\]"):
        plan = HeteroPlan(stages=["cpu", "cpu"], boundaries=[1], encoders={"image": "cpu0"}, parallelism="pipeline")
        plan.place_blocks(SpreadEncoder())


class SpreadEncoder(Multimodal):
    """The image encoder's layers cut into two blocks: a pipeline spreads it over two stages."""

    def pipeline_layers(self) -> list:
        return [self.image.conv, self.image.out, self.text, self.backbone]

    def pipeline_loss(self, output: Any, target: Any) -> Any:
        return torch.nn.functional.mse_loss(output, target)


class FrozenText(Multimodal):
    """The text encoder frozen (a pretrained one, say), the rest trained."""

    def __init__(self) -> None:
        super().__init__()
        self.text.requires_grad_(False)


class Quantizer(torch.nn.Module):
    """An image encoder that outputs codes (a frozen tokenizer, say): integers, no gradient."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return (images.flatten(1)[:, :4] > 0).long() + torch.arange(4, device=images.device) * 2


class Coded(Multimodal):
    def __init__(self) -> None:
        super().__init__()
        self.image = Quantizer()
        self.codes = torch.nn.Embedding(8, self.backbone[0].in_features)

    def forward(self, batch: dict) -> torch.Tensor:
        encoded = self.encode(batch)
        fused = torch.zeros(len(batch["y"]), self.backbone[0].in_features, dtype=self.dtype, device=self.device)
        if "image" in encoded:
            fused = fused.index_add(0, batch["has_image"].nonzero().squeeze(1), self.codes(encoded["image"]).mean(1))
        if "text" in encoded:
            fused = fused.index_add(0, batch["has_text"].nonzero().squeeze(1), encoded["text"])
        return self.backbone(fused).squeeze(1)


def test_a_placed_encoder_that_outputs_integers(tmp_path: Path) -> None:
    """Its output travels as integers and takes no gradient (it used to fail asking for one)."""
    assert_same_run(tmp_path, hetero(encoders={"image": "cpu0"}, cpu_fraction=0.3), Coded, multimodal_data)


def test_a_checkpoints_placement_this_layout_cannot_run_is_dropped() -> None:
    """MixRebalancer resumed on a layout without the place its checkpoint chose (a CPU worker it no
    longer has) starts from this run's placement, with a warning, instead of failing in every rank."""
    from lightning_hetero.callbacks.mix import _cannot_place

    strategy = HeteroStrategy(stages=["cpu", "cpu"], cpu_workers=0, cpu_fraction=0.0)
    assert "this layout has no CPU worker" in (_cannot_place(strategy, Multimodal(), {"image": "cpu0"}) or "")
    assert _cannot_place(strategy, Multimodal(), {"image": "device1"}) is None


def test_an_encoder_input_holding_a_nan_is_the_same_input() -> None:
    """A NaN in a placed encoder's input is reported by the step's check of non-finite values (or
    skipped with `nonfinite="skip"`), not as a call on another input (NaN != NaN)."""
    from lightning_hetero.multimodal import _same

    images = torch.ones(3, 4)
    images[1, 2] = float("nan")
    assert _same({"x": images}, {"x": images.clone()})
    moved = images.clone()
    moved[1, 2], moved[2, 2] = 1.0, float("nan")
    assert not _same(images, moved) and not _same(images, images.nan_to_num())


@pytest.mark.parametrize("mode", ["coarse", "fine"])
def test_a_frozen_encoder_can_be_placed(tmp_path: Path, mode: str) -> None:
    same_run(tmp_path, hetero(mode=mode, encoders={"text": "cpu0", "image": "device1"}, cpu_fraction=0.3))


class TiedText(Multimodal):
    """A head outside the text encoder that shares its projection's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(12, 8, bias=False)
        self.head.weight = self.text.out.weight


class TwoArguments(Multimodal):
    def forward(self, batch: dict) -> torch.Tensor:
        inputs = self.modality_inputs(batch)
        features = {"image": self.image(inputs["image"], None) if "image" in inputs else None}  # type: ignore[call-arg]
        return features["image"].sum() * torch.ones(len(batch["y"]), dtype=self.dtype)


class Checkpointed(Multimodal):
    """Activation checkpointing around the encoders: they are computed again in the backward."""

    def forward(self, batch: dict) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(super().forward, batch, use_reentrant=False)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (TwoArguments, "with 2 positional and 0 keyword argument"),
        (Checkpointed, "again during the backward \\(activation checkpointing"),
    ],
    ids=["two-arguments", "activation-checkpointing"],
)
def test_a_placed_encoder_called_in_a_way_its_host_cannot_answer_is_an_error(tmp_path: Path, model: Any, message: str) -> None:
    with pytest.raises(Exception, match=message):
        trainer(hetero(encoders={"image": "cpu0"}, cpu_fraction=0.3), max_steps=2).fit(model(), multimodal_data())


def test_an_encoder_tied_to_the_rest_of_the_model_stays_split(no_processes: None) -> None:
    with pytest.raises(ValueError, match="shares parameter 'head.weight'"):
        HeteroStrategy(stages=["cpu", "cpu"], encoders={"text": "cpu0"}).check_model(TiedText())


class Busy(torch.nn.Module):
    """A block without parameters that takes long in its forward and hands the inputs on unchanged."""

    def forward(self, inputs: dict) -> dict:
        work = torch.ones(48, 48, dtype=torch.float64)
        for _ in range(60):
            work = torch.tanh(work @ work / 48)
        return inputs


def HeavyFirstBlock() -> Any:
    """`PipelinedMultimodal` behind a heavy block without parameters: the encoders' block is the second."""
    from tests.models import PipelinedMultimodal

    class HeavyFirst(PipelinedMultimodal):
        def __init__(self) -> None:
            super().__init__()
            self.busy = Busy()

        def pipeline_layers(self) -> list:
            return [self.busy, self.fuse, *self.backbone]

    return HeavyFirst()


class HookedText(Multimodal):
    """Hooks on the text encoder: a pre-hook that changes its input, a hook that scales its output."""

    def __init__(self) -> None:
        super().__init__()
        self.text.register_forward_pre_hook(lambda module, args: (args[0].flip(1),))
        self.text.register_forward_hook(lambda module, args, output: output * 0.5)


class WrappedText(Multimodal):
    """A `forward` set on the encoder instance, as wrappers (accelerate's hooks) set it."""

    def __init__(self) -> None:
        super().__init__()
        inner = self.text.forward
        self.text.forward = lambda tokens: inner(tokens) * 0.5  # type: ignore[method-assign]


@pytest.mark.parametrize("model", [HookedText, WrappedText], ids=["hooks", "instance-forward"])
@pytest.mark.parametrize("host", ["cpu0", "device0"])
def test_a_placed_encoder_computes_as_the_user_set_it_up(tmp_path: Path, model: Any, host: str) -> None:
    """Its hooks run once on each share's output (on its host), and a forward of the instance's own
    stays the encoder's after every step."""
    assert_same_run(tmp_path, hetero(encoders={"text": host}, cpu_fraction=0.3), model, multimodal_data)


class AutocastProbe(torch.autograd.Function):
    """Scales by a weight; its backward, as a custom kernel's may, computes differently under autocast
    (where plain Lightning never runs a backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        factor = 2.0 if torch.is_autocast_enabled("cpu") else 1.0
        return grad * w * factor, (grad * x).sum(0) * factor


def test_a_placed_encoders_backward_for_the_others_runs_outside_autocast(tmp_path: Path) -> None:
    """bf16-mixed: the host's backward of the other workers' shares, as its own and as Lightning's."""

    class Probed(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner, self.w = inner, torch.nn.Parameter(torch.ones(8, dtype=torch.float64))

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return AutocastProbe.apply(self.inner(tokens), self.w)

    class Model(Multimodal):
        def __init__(self) -> None:
            super().__init__()
            self.text = Probed(self.text)

        def encode(self, batch: dict) -> dict[str, torch.Tensor]:
            return {name: features.float() for name, features in super().encode(batch).items()}

    def data() -> DataLoader:
        samples = [{k: v.float() if v.is_floating_point() else v for k, v in s.items()} for s in multimodal_data().dataset]
        return DataLoader(samples, batch_size=12)

    weights = {}
    for name, encoders in (("plain", None), ("split", {}), ("placed", {"text": "cpu0"})):
        m = Model().float()
        strategy = hetero(encoders=encoders, cpu_fraction=0.3) if encoders is not None else None
        trainer(strategy, max_steps=3, precision="bf16-mixed").fit(m, data())
        weights[name] = m.text.w.detach().clone()
    assert torch.equal(weights["split"], weights["placed"])
    assert torch.allclose(weights["plain"], weights["placed"], atol=1e-2, rtol=0)  # bf16's rounding, not twice the step


class StatelessNormImage(Multimodal):
    """Its image encoder normalizes with the batch's statistics and keeps none."""

    def __init__(self) -> None:
        super().__init__(norm=True)
        self.image.norm = torch.nn.BatchNorm2d(4, track_running_stats=False, dtype=torch.float64)


def test_a_placed_encoder_with_whole_batch_statistics_is_refused_before_any_process_starts(no_processes: None) -> None:
    """`sync_batchnorm=True` makes its statistics a collective of every worker, which its host cannot join alone."""
    with pytest.raises(ValueError, match="has BatchNorm2d, whose statistics `Trainer\\(sync_batchnorm=True\\)` computes"):
        trainer(hetero(encoders={"image": "cpu0"}), max_steps=1, sync_batchnorm=True).fit(StatelessNormImage(), multimodal_data())


@pytest.mark.parametrize("encoders", [{}, {"text": "cpu0"}], ids=["split", "text-placed"])
def test_whole_batch_statistics_in_an_encoder_some_shares_do_not_call(tmp_path: Path, encoders: dict) -> None:
    """`sync_batchnorm=True`: the image encoder's BatchNorm sums over the workers whose share of the
    batch carries images (a share of captions alone never calls it), as one device normalizes."""
    data = partial(phased_data, n=72, switch=36)  # image-heavy, then caption-heavy: some shares hold no image
    assert_same_run(tmp_path, hetero(cpu_fraction=0.3, encoders=encoders), partial(Multimodal, norm=True), data, sync_batchnorm=True)


@pytest.mark.parametrize("searcher", ["analyzer", "mix"])
@pytest.mark.parametrize("model", [partial(Multimodal, norm=True), StatelessNormImage], ids=["running-stats", "whole-batch-stats"])
def test_the_analyzer_and_the_mix_rebalancer_leave_an_encoder_that_cannot_be_placed_split(
    tmp_path: Path, model: Any, searcher: str
) -> None:
    """Both search every place for every encoder: one with BatchNorm stays split (its statistics would
    be one process's), and the run stays the one-process model; the analyzer's table ranks only
    placements the run can take."""
    from lightning_hetero.callbacks import MixRebalancer, WorkloadAnalyzer
    from lightning_hetero.encoder_planner import EncoderProfile

    plans = tmp_path / "plans"
    callback = WorkloadAnalyzer(repeats=1, measure_steps=1, save_dir=str(plans)) if searcher == "analyzer" else MixRebalancer(every_n_steps=3, repeats=1)
    # Emulated speeds that make the image encoder pay to place on a device, as the mix turns to images.
    speeds = {"image@cpu": 300.0, "image@device": 20000.0, "text@cpu": 20000.0, "text@device": 300.0}
    strategy = hetero(cpu_fraction=0.3, emulated_speed=speeds)
    data = partial(phased_data, n=240, switch=120)
    assert_same_run(tmp_path, strategy, model, data, callbacks=[callback], steps=12, sync_batchnorm=True)
    if searcher == "analyzer":
        assert "image" not in HeteroPlan.load(plans / "plan.yaml").encoders
        assert EncoderProfile.load(plans / "encoders.json").split_only == ["image"]
        assert "image: " not in (plans / "explain.txt").read_text()


class OneEncoderForTwo(Multimodal):
    def modality_encoders(self) -> dict[str, torch.nn.Module]:
        return {"image": self.image, "text": self.text, "title": self.text}


def test_encoders_that_break_the_contract_are_refused_before_any_process_starts_placed_or_not(no_processes: None) -> None:
    with pytest.raises(ValueError, match="Encoders 'text' and 'title' of `OneEncoderForTwo` share a parameter"):
        trainer(hetero(cpu_fraction=0.3), max_steps=1).fit(OneEncoderForTwo(), multimodal_data())


def test_whole_batch_statistics_of_an_encoder_over_several_nodes_are_warned_of() -> None:
    """Over several nodes the encoders' statistics sum over every worker with a share, which a share
    without the modality does not join: said before start (the launch calls this with num_nodes > 1)."""
    from lightning_hetero.launcher import _warn_of_encoder_norms_over_nodes

    with pytest.warns(UserWarning, match="BatchNorm of encoder 'image' takes its statistics over every worker"):
        _warn_of_encoder_norms_over_nodes(Multimodal(norm=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_of_encoder_norms_over_nodes(Multimodal())


def test_hooks_taken_off_a_received_encoder_keep_their_handles() -> None:
    """A hook registered while the encoder's are off (during a step) comes back after them, and every
    handle, earlier or later, still removes its hook."""
    from lightning_hetero.multimodal import _put_back_hooks, _take_hooks

    module, calls = torch.nn.Linear(2, 2), []
    first = module.register_forward_hook(lambda *_: calls.append("first"))
    taken = _take_hooks(module)
    module(torch.zeros(1, 2))
    assert calls == []
    later = module.register_forward_hook(lambda *_: calls.append("later"))
    _put_back_hooks(module, taken)
    module(torch.zeros(1, 2))
    assert calls == ["first", "later"]
    first.remove()
    later.remove()
    module(torch.zeros(1, 2))
    assert calls == ["first", "later"]
    # A hook removed while taken off stays removed.
    gone = module.register_forward_hook(lambda *_: calls.append("gone"))
    taken = _take_hooks(module)
    gone.remove()
    _put_back_hooks(module, taken)
    module(torch.zeros(1, 2))
    assert calls == ["first", "later"]
