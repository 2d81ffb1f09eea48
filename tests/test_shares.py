"""How a batch is divided between the CPU workers and the pipeline."""

from __future__ import annotations

import pytest

from lightning_hetero.shares import split_batch


@pytest.mark.parametrize("batch_size", range(1, 40))
@pytest.mark.parametrize("cpu_fraction", [0.0, 0.13, 0.5, 0.77, 1.0])
@pytest.mark.parametrize("cpu_workers", [0, 1, 3])
@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_every_sample_is_computed_exactly_once(
    batch_size: int, cpu_fraction: float, cpu_workers: int, micro_batches: int
) -> None:
    if cpu_workers == 0:
        cpu_fraction = 0.0
    shares = split_batch(batch_size, cpu_fraction, cpu_workers, micro_batches)
    ranges = [*shares.cpu, shares.pipeline]
    covered = [i for start, stop in ranges for i in range(start, stop)]
    assert covered == list(range(batch_size))
    assert len(shares.cpu) == cpu_workers
    if shares.pipeline_size:
        assert shares.pipeline_size % shares.micro_batches == 0  # equal micro-batches
        assert 1 <= shares.micro_batches <= micro_batches
    sizes = [stop - start for start, stop in shares.cpu]
    assert not sizes or max(sizes) - min(sizes) <= 1  # CPU workers share evenly


def test_pipeline_share_is_rounded_to_whole_micro_batches() -> None:
    shares = split_batch(100, 0.3, 1, 4)
    assert shares.pipeline == (28, 100) and shares.micro_batches == 4  # 70 rounds to 72
    assert split_batch(100, 0.31, 1, 4).pipeline_size == 68
    assert split_batch(10, 0.5, 1, 4).pipeline_size == 4


def test_extreme_fractions() -> None:
    assert split_batch(12, 0.0, 1, 4).pipeline == (0, 12)
    assert split_batch(12, 1.0, 1, 4).pipeline == (12, 12)
    assert split_batch(12, 1.0, 1, 4).micro_batches == 0
    assert split_batch(12, 0.99, 1, 4).pipeline_size == 0  # not enough for one micro-batch each


def test_pipeline_alone_with_an_uneven_batch_uses_fewer_micro_batches() -> None:
    shares = split_batch(10, 0.0, 1, 4)
    assert shares.pipeline_size == 10 and shares.micro_batches == 2
    assert split_batch(7, 0.0, 0, 4).micro_batches == 1


def test_empty_batch_is_an_error() -> None:
    with pytest.raises(ValueError, match="empty batch"):
        split_batch(0, 0.5, 1, 2)
