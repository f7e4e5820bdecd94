"""What a job sees of its transform's errors, whatever transform_workers is (issue 36,
items 8 and 9): the exception it can catch, and what state_dict() counts after it. A real
producer process; the consumers here (with worker processes of their own).

The producer's DataLoader (no shuffle) yields dict batches {"x": int32 (8, 4), "id": int64
(8,)} of 40 samples: batch b holds the samples 8b .. 8b + 7, and every element of sample
i's row of "x" is i; so a transform can tell which sample it runs on.
"""

from __future__ import annotations

import pytest
import torch

from tensorsocket import TensorConsumer, TransformError

SAMPLES, BS = 40, 8

PRODUCER = r"""
import json, sys, torch
from torch.utils.data import DataLoader, Dataset
from tensorsocket import TensorProducer

name, epochs = sys.argv[1], int(sys.argv[2])

class Rows(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return {"x": torch.full((4,), i, dtype=torch.int32), "id": i}

p = TensorProducer(DataLoader(Rows(), batch_size=8), name=name, min_consumers=1,
                   start_timeout=60, ring_slots=6)
print(json.dumps({"ready": True}), flush=True)
for _ in range(epochs):
    for _ in p:
        pass
p.join(timeout=120)
print(json.dumps({"done": True}), flush=True)
"""


def _producer(procs, name, epochs: int = 3):
    """A producer process of `epochs` epochs, ready for consumers."""
    p = procs.script(PRODUCER, name, str(epochs))
    p.wait_ready()
    return p


def fails_on(sample: int):
    """A transform that raises KeyError on `sample` (here or in a worker), and makes every
    other row float."""
    def cursed(row: torch.Tensor) -> torch.Tensor:
        if int(row[0]) == sample:
            raise KeyError(f"sample {sample} is cursed")
        return row.float()
    return cursed


def as_float(row: torch.Tensor) -> torch.Tensor:
    """A transform that works on every sample."""
    return row.float()


def _consumer(name, transform, workers: int) -> TensorConsumer:
    """A consumer of the test's producer with `transform` run by `workers` workers."""
    return TensorConsumer(name=name, timeout=60, batch_timeout=60, transform=transform,
                          transform_workers=workers)


def _ids(batch: dict) -> list[int]:
    """The sample ids of a delivered batch, checked against its transformed rows."""
    assert torch.equal(batch["x"][:, 0], batch["id"].float())
    return batch["id"].tolist()


# -- item 8: one exception type, whatever transform_workers is ------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_a_later_batch_error_is_both_transform_error_and_the_transforms(procs, name,
                                                                        workers):
    """A transform that raises KeyError on sample 20 (batch 2, after the first sample's
    check passed): next() raises one exception that is a TransformError and a KeyError,
    with 0 workers (before: the bare KeyError) and with 2 (before: a TransformError only),
    naming the transform and its message; the loop goes on with batch 3."""
    _producer(procs, name)
    with _consumer(name, fails_on(20), workers) as c:
        it = iter(c)
        got = _ids(next(it)) + _ids(next(it))
        with pytest.raises(TransformError) as e:
            next(it)
        after = _ids(next(it))
    assert got == list(range(16)) and after == list(range(24, 32))
    assert isinstance(e.value, KeyError), type(e.value).__mro__
    assert "cursed" in str(e.value) and "transform=" in str(e.value), str(e.value)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_first_sample_check_error_is_both_transform_error_and_the_transforms(
        procs, name, workers):
    """A transform that raises KeyError on the first sample: the check's TransformError
    (naming the transform and the samples) is a KeyError too (before: not), and the
    transform's own error is its __cause__."""
    _producer(procs, name)
    with _consumer(name, fails_on(0), workers) as c:
        with pytest.raises(KeyError) as e:
            next(iter(c))
    assert isinstance(e.value, TransformError), type(e.value).__mro__
    assert "cannot run on the shared samples" in str(e.value), str(e.value)
    assert type(e.value.__cause__) is KeyError


# -- item 9: state_dict() counts what next() returned ---------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_right_after_a_first_batch_error_resumes_that_batch(procs, name, workers):
    """A transform that cannot run on the first sample: a state_dict() taken in the error
    handler counts nothing taken (before: the failed batch, whose samples a job resumed
    from it never got), and a job resumed from it, its transform fixed, gets every sample
    of the epoch exactly once. A loop that goes on instead passes the failed batch (as a
    DataLoader's lost batch): its state after the next batch counts both."""
    _producer(procs, name)
    with _consumer(name, fails_on(0), workers) as c:
        it = iter(c)
        with pytest.raises(TransformError):
            next(it)
        state = c.state_dict()
        went_on = _ids(next(it))
        later = c.state_dict()
    assert state["batches_in_epoch"] == 0, state
    assert went_on == list(range(8, 16)) and later["batches_in_epoch"] == 2, later
    with _consumer(name, as_float, workers) as c:
        c.load_state_dict(state)
        resumed = [i for batch in c for i in _ids(batch)]
    assert sorted(resumed) == list(range(SAMPLES)), resumed


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_after_break_counts_what_next_returned(procs, name, workers):
    """A loop left with break after 2 batches, its workers holding more in flight: the
    state counts the 2 batches returned and their samples (before: with workers, the
    batches in flight counted as delivered, their samples not, and state_dict() raised
    on counts that did not fit), and a job resumed from it gets the other 24 samples once;
    a first-batch error left by break is not counted either."""
    _producer(procs, name, epochs=8)
    with _consumer(name, as_float, workers) as c:
        got = []
        for batch in c:
            got += _ids(batch)
            if len(got) == 2 * BS:
                break
        state = c.state_dict()
    assert state["batches_in_epoch"] == 2, state
    with _consumer(name, as_float, workers) as c:
        c.load_state_dict(state)
        resumed = [i for batch in c for i in _ids(batch)]
    assert sorted(got + resumed) == list(range(SAMPLES)), (got, resumed)

    with _consumer(name, fails_on(0), workers) as c:
        try:
            for batch in c:
                pass
        except TransformError:
            pass
        state = c.state_dict()
    assert state["batches_in_epoch"] == 0, state
