"""The placement cost model on machines where the answer is known by hand (milliseconds per sample)."""

from __future__ import annotations

import pytest

from lightning_hetero.encoder_planner import EncoderCosts, best_placement, predict_placement

MS = 1e-3


def costs(transfer_text: float = 0.0) -> EncoderCosts:
    """A CPU worker and a GPU: images encode 10x faster on the GPU, texts as fast on either."""
    return EncoderCosts(
        forward={"image": {"cpu0": 10 * MS, "device0": 1 * MS}, "text": {"cpu0": 1 * MS, "device0": 1 * MS}},
        backward={"image": {"cpu0": 20 * MS, "device0": 2 * MS}, "text": {"cpu0": 1 * MS, "device0": 1 * MS}},
        backbone={"cpu0": 30 * MS, "device0": 3 * MS},
        transfer={"text": transfer_text * MS},
    )


GPU_ONLY = {"cpu0": 0, "device0": 10}  # the CPU worker has no share of the batch
BOTH = {"image": 1.0, "text": 1.0}


def test_everything_on_the_gpu() -> None:
    # encoders 10 x (1 + 1); backbone 10 x 3 and the encoders' backward 10 x (2 + 1)
    assert predict_placement(costs(), GPU_ONLY, BOTH, {}).step_s == pytest.approx(80 * MS)


def test_the_text_encoder_on_the_idle_cpu_saves_its_forward_and_backward() -> None:
    prediction = predict_placement(costs(), GPU_ONLY, BOTH, {"text": "cpu0"})
    # GPU: images 10 while the CPU encodes the texts (10), backbone and images' backward 30 + 20 -> 60;
    # then the CPU: the texts' backward, 10 -> 70.
    assert prediction.finish_s == pytest.approx({"device0": 60 * MS, "cpu0": 70 * MS})
    best = best_placement(costs(), GPU_ONLY, BOTH)
    assert best.placement == {"text": "cpu0"} and best.step_s == pytest.approx(70 * MS)


def test_a_slow_link_keeps_the_text_encoder_on_the_gpu() -> None:
    # The texts' outputs arrive at 10 + 10 x 2 = 30; the GPU ends at 30 + 50 = 80, the CPU at 80 + 20 + 10 = 110.
    assert predict_placement(costs(2.0), GPU_ONLY, BOTH, {"text": "cpu0"}).step_s == pytest.approx(110 * MS)
    assert best_placement(costs(2.0), GPU_ONLY, BOTH).placement == {}


def test_a_modality_no_sample_carries_is_left_split() -> None:
    best = best_placement(costs(), GPU_ONLY, {"image": 1.0, "text": 0.0})
    assert best.placement == {} and best.step_s == pytest.approx((10 + 30 + 20) * MS)


def test_shares_on_both_sides() -> None:
    """The CPU worker has 2 samples of 12 and the GPU 10, half of them with an image."""
    samples, mix = {"cpu0": 2, "device0": 10}, {"image": 0.5, "text": 1.0}
    split = predict_placement(costs(), samples, mix, {})
    # CPU: 1 image x 10 + 2 texts x 1 = 12; 2 x 30 + 1 x 20 + 2 x 1 = 82 -> 94.
    # GPU: 5 x 1 + 10 x 1 = 15; 10 x 3 + 5 x 2 + 10 x 1 = 50 -> 65.
    assert split.finish_s == pytest.approx({"cpu0": 94 * MS, "device0": 65 * MS})
    # The GPU encoding the CPU worker's image: it spends 1 first; the CPU waits for it (ready at 1,
    # texts take 2), ends at 2 + 62 = 64; the GPU ends its own at 1 + 15 + 50 = 66, then the image's
    # backward: max(66, 64) + 2 = 68.
    placed = predict_placement(costs(), samples, mix, {"image": "device0"})
    assert placed.finish_s == pytest.approx({"cpu0": 64 * MS, "device0": 68 * MS})
    assert best_placement(costs(), samples, mix).step_s <= placed.step_s
