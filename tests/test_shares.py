"""How a batch is divided between the CPU workers and the pipeline."""

from __future__ import annotations

import re
from collections import defaultdict, namedtuple
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import transformers

from lightning_hetero.shares import batch_size_of, no_single_samples, slice_batch, split_batch


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
    # Fewer samples than micro-batches: micro-batches of one sample, not a share left to the CPU.
    few = split_batch(16, 0.25, 1, 32)
    assert few.pipeline_size == 12 and few.micro_batches == 12


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


@dataclass
class Sample:
    pixels: torch.Tensor
    captions: list
    temperature: float


Pair = namedtuple("Pair", "inputs targets")


def test_a_batch_of_any_structure_is_split_by_samples() -> None:
    """Tensors with a row per sample and lists with a value per sample are sliced, wherever they
    sit; what is not per sample goes to every worker whole."""
    batch = {
        "input_ids": torch.arange(12).view(6, 2),
        "extra": {"texts": list("abcdef"), "lookup": [7, 8], "scale": torch.tensor(2.0), "steps": 3},
        "pair": Pair(torch.ones(6, 3), torch.zeros(6)),
        "sample": Sample(torch.zeros(6, 4), [f"c{i}" for i in range(6)], 0.5),
        "by_default": defaultdict(list, {"ids": list(range(6))}),
    }
    assert batch_size_of(batch) == 6
    part = slice_batch(batch, 2, 5)
    assert part["input_ids"].tolist() == [[4, 5], [6, 7], [8, 9]]
    assert part["extra"] == {"texts": ["c", "d", "e"], "lookup": [7, 8], "scale": torch.tensor(2.0), "steps": 3}
    assert isinstance(part["pair"], Pair) and part["pair"].inputs.shape == (3, 3) and part["pair"].targets.shape == (3,)
    assert isinstance(part["sample"], Sample) and part["sample"].captions == ["c2", "c3", "c4"]
    assert part["sample"].pixels.shape == (3, 4) and part["sample"].temperature == 0.5
    assert isinstance(part["by_default"], defaultdict) and part["by_default"]["ids"] == [2, 3, 4]
    assert batch["extra"]["texts"] == list("abcdef")  # the batch itself is left as it was


def test_a_batch_of_only_per_sample_lists_counts_their_items() -> None:
    batch = {"prompts": ["a b", "c", "d e f"], "ids": [11, 12, 13]}
    assert batch_size_of(batch) == 3
    assert slice_batch(batch, 1, 3) == {"prompts": ["c", "d e f"], "ids": [12, 13]}


def test_a_list_of_samples_is_split_by_its_items() -> None:
    """`collate_fn=list` (inputs of different sizes) gives a list of the dataset's samples: the list
    is divided, not the samples' own tensors, even where those happen to share a first dimension."""
    sequences = [torch.full((12, 3), float(i)) for i in range(10)]
    tuples = list(zip(sequences, torch.arange(10)))  # a TensorDataset's (input, 0-dim label) samples
    assert batch_size_of(tuples) == 10
    assert [int(label) for _, label in slice_batch(tuples, 7, 10)] == [7, 8, 9]
    assert slice_batch(tuples, 7, 10)[0][0].shape == (12, 3)
    varied = [(torch.zeros(n, 3), torch.ones(n)) for n in (4, 2, 7)]  # no 0-dim values: tuples still
    assert batch_size_of(varied) == 3 and slice_batch(varied, 1, 2)[0][0].shape == (2, 3)
    records = [{"tokens": torch.zeros(n), "label": n % 2} for n in (5, 5, 6, 5)]
    assert batch_size_of({"items": records, "ids": [1, 2, 3, 4]}) == 4
    assert slice_batch({"items": records, "ids": [1, 2, 3, 4]}, 2, 4) == {"items": records[2:], "ids": [3, 4]}
    with_rows = {"samples": tuples, "weights": torch.ones(10)}  # a list of samples beside rows agrees with them
    assert batch_size_of(with_rows) == 10 and slice_batch(with_rows, 0, 4)["weights"].shape == (4,)


def test_per_sample_lists_of_different_lengths_and_arrays_are_split_by_sample() -> None:
    ids = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
    batch = {"ids": ids, "y": torch.arange(4), "rows": np.arange(8).reshape(4, 2), "table": np.zeros(3)}
    part = slice_batch(batch, 1, 3)
    assert batch_size_of({"ids": ids}) == 4 and part["ids"] == [[4], [5, 6]]
    assert part["rows"].tolist() == [[2, 3], [4, 5]] and part["table"].shape == (3,)  # not per sample: whole
    same_length = {"ids": [[1, 2], [3, 4], [5, 6]], "y": torch.arange(3)}  # numbers: never `default_collate`'s
    assert slice_batch(same_length, 1, 3)["ids"] == [[3, 4], [5, 6]] and batch_size_of({"ids": [[1, 2, 3]]}) == 1
    # Collated lists of strings (a sample's list of them, through `default_collate`) have the
    # batch's length each: they are fields, divided item by item.
    fields = {"pair": [["q0", "q1", "q2"], ["a0", "a1", "a2"]], "y": torch.arange(3)}
    assert slice_batch(fields, 1, 3)["pair"] == [["q1", "q2"], ["a1", "a2"]]


def test_collated_fields_that_are_records_are_not_taken_for_samples() -> None:
    """`default_collate` turns a sample `((a, b), (c, d))` into `[[A, B], [C, D]]`, and a sample of
    two dicts into a list of two dicts of rows: those are divided row by row."""
    nested = [[torch.zeros(6, 2), torch.ones(6)], [torch.zeros(6), torch.ones(6, 4)]]
    assert batch_size_of(nested) == 6 and slice_batch(nested, 0, 2)[1][1].shape == (2, 4)
    dicts = [{"x": torch.zeros(6, 2)}, {"x": torch.ones(6, 5)}]
    assert batch_size_of(dicts) == 6 and slice_batch(dicts, 0, 2)[1]["x"].shape == (2, 5)
    named = [{"image": torch.zeros(6, 3), "name": list("abcdef")}, {"image": torch.ones(6, 3), "name": list("ghijkl")}]
    assert batch_size_of(named) == 6 and slice_batch(named, 1, 3)[1]["name"] == ["h", "i"]
    # A custom collate's tuple of fields, or `tuple(zip(*samples))`: not a list of samples.
    fields = ((torch.zeros(8, 2), torch.ones(8)), (torch.zeros(8, 3), torch.ones(8)))
    assert batch_size_of(fields) == 8 and slice_batch(fields, 0, 3)[1][0].shape == (3, 3)


def test_a_tokenizers_batch_encoding_keeps_its_type() -> None:
    batch = transformers.BatchEncoding({"input_ids": torch.arange(8).view(4, 2), "attention_mask": torch.ones(4, 2)})
    part = slice_batch(batch, 1, 3)
    assert isinstance(part, transformers.BatchEncoding) and part["input_ids"].tolist() == [[2, 3], [4, 5]]


@pytest.mark.parametrize(
    "batch,error",
    [
        ((torch.zeros(4, 2), torch.zeros(3)), "this batch holds tensors of shapes (4, 2), (3,)"),
        ({"a": ["x", "y"], "b": ["z"]}, "Cannot tell the batch size of a dict"),
        (3.0, "Cannot tell the batch size of a float"),
    ],
)
def test_a_batch_whose_samples_cannot_be_told_apart_is_an_error(batch: object, error: str) -> None:
    with pytest.raises((TypeError, ValueError), match=re.escape(error)):
        batch_size_of(batch)


@pytest.mark.parametrize(
    "batch_size,fraction,cpu_workers,devices,cpu,pipeline",
    [
        (2, 0.5, 1, 1, ((0, 0),), (0, 2)),  # 1 + 1: the devices take both
        (4, 0.5, 1, 2, ((0, 0),), (0, 4)),  # 2 + (1, 1)
        (3, 0.5, 1, 1, ((0, 0),), (0, 3)),
        (5, 0.5, 2, 1, ((0, 0), (0, 0)), (0, 5)),  # (1, 1) + 3
        (8, 0.3, 1, 1, ((0, 2),), (2, 8)),  # no share of one: unchanged
        (1, 0.5, 1, 1, ((0, 0),), (0, 1)),  # a batch of one stays one, as in one process
    ],
)
def test_replicas_with_per_share_batch_norm_get_no_single_sample_share(
    batch_size: int, fraction: float, cpu_workers: int, devices: int, cpu: tuple, pipeline: tuple
) -> None:
    shares = no_single_samples(split_batch(batch_size, fraction, cpu_workers, 1), devices)
    assert (shares.cpu, shares.pipeline) == (cpu, pipeline)
