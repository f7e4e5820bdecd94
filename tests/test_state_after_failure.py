"""The state a job had is kept through a failure of its producer (issue 36, item 3).

A checkpoint is usually written in the error handler: ``except ProducerFailed:
save(consumer.state_dict())``. That state must say what the consumer had taken before
the failure (its batches and which samples), so that a new consumer of a new producer of
the same dataset, loaded with it, takes exactly the rest of the epoch: every sample of
the epoch once across the two runs, asserted by id. Real producer processes: one whose
loader raises after some batches, one SIGKILLed while the consumer holds its place, one
that finishes in the middle of the consumer's epoch; the consumer runs in the test
process."""

from __future__ import annotations

import json
import subprocess

import pytest

from tensorsocket import ProducerFailed, ProducerFinished, ProducerGone, TensorConsumer

SAMPLES, BATCH = 48, 4  # 12 batches an epoch

# The producer script: a shuffling DataLoader over a dataset whose samples are their ids.
# Modes:
#   whole     every epoch whole (the second run's producer)
#   fail      a sample's __getitem__ raises once 5 batches were loaded (ProducerFailed)
#   stall     the loader never yields after 5 batches (the test SIGKILLs the process)
#   stop      the producer is closed after 5 batches of its first epoch, in its loop
#             (ProducerFinished in the middle of the consumer's epoch)
PRODUCER = r"""
import sys, time, torch
from torch.utils.data import DataLoader, Dataset
from tensorsocket import TensorProducer

name, mode, samples, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
CUT = 5 * batch  # samples loaded before the failure

class Ids(Dataset):
    loaded = 0
    def __len__(self):
        return samples
    def __getitem__(self, i):
        Ids.loaded += 1
        if Ids.loaded > CUT and mode == "fail":
            raise RuntimeError("corrupt record")
        if Ids.loaded > CUT and mode == "stall":
            time.sleep(3600)
        return torch.tensor(i)

loader = DataLoader(Ids(), batch_size=batch, shuffle=True)
producer = TensorProducer(loader, name=name, min_consumers=1, start_timeout=60)
print("ready", flush=True)
for i, _ in enumerate(producer):
    if mode == "stop" and i == 4:
        producer.close()
        break
producer.join(timeout=60)
producer.close()
"""


def _start(procs, name: str, mode: str) -> subprocess.Popen:
    """A producer process of the dataset in `mode`, once it has its name."""
    p = procs.script(PRODUCER, name, mode, str(SAMPLES), str(BATCH))
    line = p.stdout.readline()
    assert line == "ready\n", p.communicate(timeout=30)
    return p


def _ids(batch) -> list[int]:
    """The sample ids of a batch."""
    return [int(v) for v in batch]


def _take_until_failure(consumer: TensorConsumer, taken: list[int],
                        kill=None, failure=ProducerGone) -> dict:
    """Iterate one epoch of `consumer`, its ids into `taken`, until the producer's end
    raises `failure`; kill(): called after the third batch (a SIGKILL while the consumer
    holds its place). The state written in the error handler, through JSON as a
    checkpoint is."""
    try:
        for i, batch in enumerate(consumer):
            taken.extend(_ids(batch))
            if i == 2 and kill is not None:
                kill()
    except failure:
        return json.loads(json.dumps(consumer.state_dict()))
    raise AssertionError("the epoch ended without the producer's failure")


def _resume_and_check(procs, name: str, state: dict, first: list[int]) -> None:
    """A new producer of the dataset and a new consumer loaded with `state`: its resumed
    epoch holds exactly the samples `first` did not take, so that each sample of the
    epoch comes once across the two runs."""
    assert state["batches_in_epoch"] == len(first) // BATCH, state
    assert state["taken"] is not None, state
    producer = _start(procs, name, "whole")
    with TensorConsumer(name=name, timeout=60) as consumer:
        consumer.load_state_dict(state)
        second = [i for batch in consumer for i in _ids(batch)]
    producer.communicate(timeout=60)
    both = sorted(first + second)
    assert both == list(range(SAMPLES)), (sorted(first), sorted(second))


def test_state_written_after_a_loader_error_resumes_exactly(procs, name):
    """The producer's loader raises after 5 batches: the consumer took those 5, and the
    state written where ProducerFailed is caught says so (batches and samples)."""
    failing = _start(procs, name, "fail")
    first: list[int] = []
    with TensorConsumer(name=name, timeout=60) as consumer:
        state = _take_until_failure(consumer, first, failure=ProducerFailed)
        assert consumer.state_dict() == state  # (asked again: the same place)
    failing.communicate(timeout=60)
    assert len(first) == 5 * BATCH
    _resume_and_check(procs, name, state, first)


def test_state_written_after_a_sigkill_resumes_exactly(procs, name):
    """The producer is SIGKILLed after the consumer's third batch, while it holds its
    place in the ring: the consumer takes what was published, then ProducerFailed (the
    cause unknown); the state says what it took."""
    stalled = _start(procs, name, "stall")

    def kill() -> None:
        stalled.kill()
        stalled.wait(30)

    first: list[int] = []
    with TensorConsumer(name=name, timeout=60) as consumer:
        state = _take_until_failure(consumer, first, kill=kill, failure=ProducerFailed)
    assert 3 * BATCH <= len(first) <= 5 * BATCH
    _resume_and_check(procs, name, state, first)


def test_state_after_a_failure_survives_another_iteration(procs, name):
    """A loop that tries again (iter() after the failure, which raises again) keeps the
    place of the epoch the failure cut: the state is still the one it had."""
    failing = _start(procs, name, "fail")
    first: list[int] = []
    with TensorConsumer(name=name, timeout=60) as consumer:
        state = _take_until_failure(consumer, first, failure=ProducerFailed)
        with pytest.raises(ProducerFailed):
            for _ in consumer:
                pass
        assert consumer.state_dict() == state
    failing.communicate(timeout=60)
    _resume_and_check(procs, name, state, first)


def test_state_after_the_producer_stopped_mid_epoch_resumes_exactly(procs, name):
    """The producer stops after 5 batches of its epoch and closes (ProducerFinished in
    the middle of the consumer's epoch): the state says what the consumer took."""
    stopping = _start(procs, name, "stop")
    first: list[int] = []
    with TensorConsumer(name=name, timeout=60) as consumer:
        state = _take_until_failure(consumer, first, failure=ProducerFinished)
    stopping.communicate(timeout=60)
    _resume_and_check(procs, name, state, first)
