"""The mix rebalancer: a multimodal model's encoders follow the mix of modalities in the data; a move
is kept only where it measured faster than where it came from; the model stays the one-process model."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_hetero import HeteroStrategy
from lightning_hetero.callbacks import MixRebalancer
from lightning_hetero.callbacks.mix import MixFollower
from lightning_hetero.encoder_planner import EncoderProfile
from lightning_hetero.profiling import EncoderTimes, LinkProfile
from tests.conftest import hetero
from tests.models import Multimodal, TwoPass, phased_data
from tests.test_replicas import assert_same_run

MS = 1e-3


def profile() -> EncoderProfile:
    """A CPU worker with no share and a device: the device encodes images fast and texts slowly, the
    CPU texts fast; every message costs 8 ms (see test_encoder_planner for the arithmetic)."""

    def times(image: float, text: float, rest: float) -> EncoderTimes:
        return EncoderTimes({"image": image, "text": text}, {"image": image, "text": text}, rest, {"image": 8.0, "text": 8.0}, {})

    places = {"cpu0": times(10 * MS, 1 * MS, 30 * MS), "device0": times(1 * MS, 3 * MS, 1 * MS)}
    return EncoderProfile(12, places, LinkProfile(latency=8 * MS, bytes_per_s=1e12))


SAMPLES = {"cpu0": 0.0, "device0": 12.0}
IMAGES = {"image": 1.0, "text": 0.1}
TEXTS = {"image": 0.1, "text": 1.0}


def test_the_placement_follows_the_mix_and_a_slower_move_is_undone() -> None:
    follower = MixFollower(profile(), {}, smoothing=1.0, min_gain=0.02)
    follower.observe(IMAGES)  # split: 43.2 ms; the texts on the CPU: 45.2 ms
    assert follower.decide(0.045, SAMPLES) == ("hold", pytest.approx(43.2 * MS))
    follower.observe(TEXTS)  # split: 86.4 ms; the texts on the CPU: 53.2 ms
    reason, predicted = follower.decide(0.090, SAMPLES)
    assert (reason, follower.placement) == ("try", {"text": "cpu0"}) and predicted == pytest.approx(53.2 * MS)
    assert follower.decide(0.050, SAMPLES)[0] == "keep"  # measured faster than the 90 ms it came from
    follower.observe(IMAGES)  # split is predicted 4% faster again
    assert follower.decide(0.046, SAMPLES)[0] == "try" and follower.placement == {}
    assert follower.decide(0.047, SAMPLES)[0] == "undo"  # it measured slower: back
    assert follower.placement == {"text": "cpu0"}
    assert [follower.decide(0.046, SAMPLES)[0] for _ in range(3)] == ["hold", "hold", "try"]  # after 3 decisions
    state = follower.state_dict()
    again = MixFollower(profile(), {})
    again.load_state_dict(state)
    assert again.state_dict() == state and "profile" not in state


def test_the_mix_is_smoothed() -> None:
    follower = MixFollower(profile(), {}, smoothing=0.5)
    follower.observe(IMAGES)
    follower.observe(TEXTS)
    assert follower.mix == pytest.approx({"image": 0.55, "text": 0.55})


# Emulated: the device encodes 4 ms per sample of either kind, the CPU worker 2 ms: it can take one
# encoder off the device, the one whose modality is the heavier.
SPEEDS = {"image@device": 250.0, "text@device": 250.0, "image@cpu": 500.0, "text@cpu": 500.0}


class SaveDecisions(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if isinstance(trainer.strategy, HeteroStrategy) and trainer.is_global_zero:
            mix = next(cb for cb in trainer.callbacks if isinstance(cb, MixRebalancer))
            torch.save(mix.decisions, self.out / "decisions.pt")


def test_the_encoders_follow_a_mix_that_changes_mid_run(tmp_path: Path) -> None:
    """Images first, texts after batch 12: the image encoder goes to the idle CPU worker, then the
    text encoder does (alone), within two decisions of the change; the model is the one-process model."""
    strategy = hetero(stages=["cpu"], cpu_fraction=0.0, emulated_speed=SPEEDS)
    mix = MixRebalancer(every_n_steps=3, warmup_steps=1, repeats=1)
    assert_same_run(tmp_path, strategy, Multimodal, phased_data, callbacks=[mix, SaveDecisions(tmp_path)], steps=24)
    decisions = torch.load(tmp_path / "decisions.pt")
    placed = [(d["step"], d["reason"], d["placement"]) for d in decisions]
    before = [p for s, r, p in placed if s <= 12 and r in ("try", "keep")]
    after = [(s, p) for s, r, p in placed if s > 12 and r == "keep"]
    # The image encoder goes first; the text encoder, rare then, may go too (next to nothing to weigh).
    assert before and before[-1].get("image") == "cpu0", placed
    assert after and after[0][1] == {"text": "cpu0"} and after[0][0] <= 12 + 2 * 3 + 3, placed


def test_it_does_nothing_for_a_model_without_encoders(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="MixRebalancer does nothing here"):
        assert_same_run(tmp_path, hetero(cpu_fraction=0.5), TwoPass, callbacks=[MixRebalancer()])


def test_its_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="every_n_steps"):
        MixRebalancer(every_n_steps=2, warmup_steps=2)


def test_a_resumed_run_keeps_the_placement_the_mix_rebalancer_had_reached(tmp_path: Path) -> None:
    """Its decisions and placement are saved with the checkpoint; the resumed run starts from them, not
    from the strategy's placement."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.conftest import trainer

    def fit(steps: int, out: Path, ckpt: Path | None = None) -> list:
        out.mkdir()
        saving = ModelCheckpoint(tmp_path / "ckpt", filename="{step}", every_n_train_steps=1, save_top_k=-1)
        callbacks = [MixRebalancer(every_n_steps=3, warmup_steps=1, repeats=1), SaveDecisions(out), saving]
        strategy = hetero(stages=["cpu"], cpu_fraction=0.0, emulated_speed=SPEEDS)
        run = trainer(strategy, max_steps=steps, callbacks=callbacks, enable_checkpointing=True)
        run.fit(Multimodal().double(), phased_data(), ckpt_path=ckpt)
        return torch.load(out / "decisions.pt")

    first = fit(9, tmp_path / "first")
    assert first[-1]["placement"] == {"image": "cpu0"}, first
    resumed = fit(12, tmp_path / "resumed", tmp_path / "ckpt" / "step=9.ckpt")
    assert resumed[: len(first)] == first and resumed[len(first)]["reason"] == "resume"
    assert resumed[len(first)]["placement"] == {"image": "cpu0"}
