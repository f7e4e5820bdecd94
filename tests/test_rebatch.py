"""Re-batching rules, in process (the end-to-end cases are in test_flexible.py)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorsocket.data.epoch_cursor import InFlight
from tensorsocket.data.rebatch import EpochEnd, Rebatcher, batch_samples, consumer_len

Pair = collections.namedtuple("Pair", "x y")


def loader_batch(start: int, n: int) -> dict:
    ids = torch.arange(start, start + n)
    return {
        "ids": ids,
        "np": np.arange(start, start + n, dtype=np.int32),
        "pair": Pair(ids.float().unsqueeze(1).repeat(1, 2),
                     [f"n{i}" for i in range(start, start + n)]),
        "scalar": torch.tensor(7),
        "tag": f"batch@{start}",
    }


def source(sizes: list[int]):
    """pull() over loader batches of these sizes, then EpochEnd forever."""
    batches = []
    start = 0
    for n in sizes:
        batches.append(loader_batch(start, n))
        start += n
    it = iter(batches)

    def pull():
        try:
            return next(it), None, None
        except StopIteration:
            raise EpochEnd from None

    return pull


def cut(rebatcher: Rebatcher, pull, counts: list | None = None):
    """The next batch, as TensorConsumer takes it (from flow.ready); its sample count
    goes to `counts` if given."""
    flow = InFlight()
    rebatcher.next_batch(pull, flow)
    assert flow.ready is not None
    if counts is not None:
        counts.append(flow.ready[1])
    return flow.ready[0]


def drain(rebatcher: Rebatcher, pull, counts: list | None = None) -> list:
    out = []
    while True:
        try:
            out.append(cut(rebatcher, pull, counts))
        except EpochEnd:
            return out


def test_divisor_gives_zero_copy_slices():
    r = Rebatcher(2)
    got = drain(r, source([8, 8]))
    assert [b["ids"].tolist() for b in got] == [[i, i + 1] for i in range(0, 16, 2)]
    # A slice shares its loader batch's storage.
    whole = loader_batch(0, 8)
    r2 = Rebatcher(4)
    half = cut(r2, lambda: (whole, None, None))
    assert half["ids"].untyped_storage().data_ptr() == whole["ids"].untyped_storage().data_ptr()
    assert np.shares_memory(half["np"], whole["np"])
    assert half["pair"].x.untyped_storage().data_ptr() == \
        whole["pair"].x.untyped_storage().data_ptr()


def test_whole_batch_is_handed_over_untouched():
    whole = loader_batch(0, 8)
    assert cut(Rebatcher(8), lambda: (whole, None, None)) is whole


def test_spanning_batches_are_concatenated_with_their_structure():
    got = drain(Rebatcher(3), source([4, 4]))
    assert [b["ids"].tolist() for b in got] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    b = got[1]
    assert b["np"].tolist() == [3, 4, 5] and b["np"].dtype == np.int32
    assert isinstance(b["pair"], Pair) and b["pair"].y == ["n3", "n4", "n5"]
    assert b["pair"].x[:, 0].tolist() == [3.0, 4.0, 5.0]
    # Per-batch values: 0-d tensors and plain values pass through from the first piece.
    assert b["scalar"].item() == 7 and b["tag"] == "batch@0"
    assert got[2]["tag"] == "batch@4"


def test_drop_last_drops_the_partial_batch_and_counts_it():
    r = Rebatcher(3, drop_last=True)
    got = drain(r, source([4, 4]))
    assert [b["ids"].tolist() for b in got] == [[0, 1, 2], [3, 4, 5]]
    assert r.dropped_samples == 2


def test_tensor_without_the_batch_dimension_is_named():
    bad = {"x": torch.zeros(8, 2), "w": torch.zeros(5)}
    with pytest.raises(ValueError, match=r"batch\['w'\] \(shape \(5,\)\).*8 samples"):
        cut(Rebatcher(3), lambda: (bad, None, None))


def test_structure_change_between_batches_is_named():
    batches = iter([{"x": torch.zeros(2)}, {"y": torch.zeros(2)}])
    with pytest.raises(ValueError, match="changes keys"):
        cut(Rebatcher(3), lambda: (next(batches), None, None))


def test_batch_without_batch_dimension_is_refused():
    with pytest.raises(ValueError, match="batch_size=None"):
        batch_samples({"a": 1, "b": torch.tensor(3)})


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 12), min_size=1, max_size=8),
       b=st.integers(1, 30), drop_last=st.booleans())
def test_every_sample_once_in_order(sizes, b, drop_last):
    r = Rebatcher(b, drop_last)
    got = drain(r, source(sizes))
    total = sum(sizes)
    ids = [i for batch in got for i in batch["ids"].tolist()]
    keep = total - total % b if drop_last else total
    assert ids == list(range(keep))
    assert all(len(batch["ids"]) == b for batch in got[:-1])
    assert len(got) == consumer_len(total, b, drop_last)
    assert all(batch["pair"].y == [f"n{i}" for i in batch["ids"].tolist()] for batch in got)


def test_detection_style_tuples_are_cut_per_sample():
    """collate_fn=lambda b: tuple(zip(*b)): a tuple of images and one of target dicts."""
    def det_batch(start: int, n: int):
        images = tuple(torch.full((3, 5 + i, 4), float(i)) for i in range(start, start + n))
        targets = tuple({"boxes": torch.zeros(i % 3, 4), "id": i} for i in range(start, start + n))
        return images, targets

    batches = iter([(det_batch(0, 4), 4, None), (det_batch(4, 4), 4, None)])
    r = Rebatcher(3)
    counts: list = []
    got = drain(r, lambda: _next_or_end(batches), counts)
    assert [len(images) for images, _ in got] == [3, 3, 2]
    ids = [t["id"] for _, targets in got for t in targets]
    assert ids == list(range(8))
    images = [img for imgs, _ in got for img in imgs]
    assert [int(img[0, 0, 0]) for img in images] == list(range(8))
    assert all(isinstance(imgs, tuple) for imgs, _ in got)
    assert counts == [3, 3, 2]  # the short last batch counted as such
    # The loader's count (4) matters: the first tensor's dimension 0 is an image's 3
    # channels, which is not the number of samples.
    assert batch_samples(det_batch(0, 4)) == 3


def _next_or_end(it):
    try:
        return next(it)
    except StopIteration:
        raise EpochEnd from None


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 12), min_size=1, max_size=8),
       b=st.integers(1, 30), drop_last=st.booleans(),
       raises=st.lists(st.integers(0, 10), max_size=6))
def test_an_exception_from_pull_keeps_the_samples_taken(sizes, b, drop_last, raises):
    """pull() raises (TimeoutError, KeyboardInterrupt) before some of its batches and the
    caller goes on: every sample still comes once, in order, in batches of b."""
    pull = source(sizes)
    calls = 0

    def flaky_pull():
        nonlocal calls
        calls += 1
        if calls in raises:
            raise TimeoutError if calls % 2 else KeyboardInterrupt
        return pull()

    r = Rebatcher(b, drop_last)
    got = []
    while True:
        try:
            got.append(cut(r, flaky_pull))
        except (TimeoutError, KeyboardInterrupt):
            continue
        except EpochEnd:
            break
    total = sum(sizes)
    ids = [i for batch in got for i in batch["ids"].tolist()]
    assert ids == list(range(total - total % b if drop_last else total))
    assert all(len(batch["ids"]) == b for batch in got[:-1])
    assert not r.holding()


def test_sample_ids_travel_with_the_samples():
    """The dataset indices of each loader batch (from the producer) come out with the
    consumer batch made of its samples, cut and joined the same way."""
    sizes = [5, 5, 5]
    batches = iter([(loader_batch(5 * k, 5), None, np.arange(100 + 5 * k, 105 + 5 * k))
                    for k in range(3)])

    def pull():
        try:
            return next(batches)
        except StopIteration:
            raise EpochEnd from None

    r = Rebatcher(4)
    flow = InFlight()
    got = []
    while True:
        try:
            r.next_batch(pull, flow)
        except EpochEnd:
            break
        got.append(flow.ready[2].tolist())
        flow.ready = None
    assert got == [list(range(100 + i, min(104 + i, 115))) for i in range(0, 15, 4)]
    assert sum(sizes) == 15
