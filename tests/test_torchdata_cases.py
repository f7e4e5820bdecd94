"""torchdata's StatefulDataLoader resume cases, on tensorsocket consumers (issue 36).

torchdata's ``test/stateful_dataloader/test_state_dict.py`` interrupts a loader after k
batches, saves ``state_dict()``, reads the rest of the epoch (``exp``), and checks that a
new loader given the state yields exactly ``exp``. The same here, for what a shared
producer can honour: map-style and iterable loaders, 0 and 2 loader workers, shuffled or
not; the state taken before the first ``next()``, after 1 and 5 batches, at the last
batch, and after ``break``; the resumed consumer on a fresh producer, or on one that has
moved on (the interrupted job reads on into later epochs while the resumed one starts);
chains of interruptions; ``load_state_dict()`` in the middle of an epoch.

Where tensorsocket differs from torchdata, and why (docs/usage.md, "Checkpoints and
restarts"): a shuffled map-style epoch resumes with exactly the samples not yet taken,
but in the order of the producer's epoch it reads them from, not the interrupted epoch's
order (that epoch is gone: other jobs read it); so those are compared as sets, each
sample once. An iterable loader has no sample ids: its epoch resumes by count, from the
first batch of a producer epoch, and is compared batch for batch. Real producer
processes; the consumers run in the test process."""

from __future__ import annotations

import subprocess
import threading
import warnings
from collections import Counter

import pytest

from tensorsocket import TensorConsumer

SAMPLES, BATCH = 60, 6  # 10 batches an epoch
LAST = SAMPLES // BATCH

PRODUCER = r"""
import sys, torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from tensorsocket import TensorProducer

name, kind, workers, shuffle = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
samples, batch = int(sys.argv[5]), int(sys.argv[6])

class Ids(Dataset):
    def __len__(self):
        return samples
    def __getitem__(self, i):
        return torch.tensor(i)

class Stream(IterableDataset):  # no __len__; each worker yields its own part, in order
    def __iter__(self):
        info = get_worker_info()
        part = samples // (info.num_workers if info else 1)
        first = (info.id if info else 0) * part
        return iter(torch.arange(first, first + part))

dataset = Ids() if kind == "map" else Stream()
loader = DataLoader(dataset, batch_size=batch, shuffle=shuffle, num_workers=workers,
                    persistent_workers=workers > 0)
producer = TensorProducer(loader, name=name, min_consumers=1, start_grace=0,
                          start_timeout=120)
print("ready", flush=True)
for epoch in range(40):
    for _ in producer:
        pass
"""


class Loader:
    """One loader kind of the matrix: its producers, and how its epochs compare."""

    def __init__(self, procs, name: str, kind: str, workers: int, shuffle: bool) -> None:
        self.procs, self.name = procs, name
        self.kind, self.workers, self.shuffle = kind, workers, shuffle
        self.producer: subprocess.Popen | None = None

    def start(self) -> None:
        """A producer of the loader (a fresh one: the last one, if any, is ended first)."""
        if self.producer is not None:
            self.producer.terminate()
            self.producer.wait(60)
        self.producer = self.procs.script(PRODUCER, self.name, self.kind, str(self.workers),
                                          "1" if self.shuffle else "0", str(SAMPLES),
                                          str(BATCH))
        assert self.producer.stdout.readline() == "ready\n", \
            self.producer.communicate(timeout=30)

    def consumer(self) -> TensorConsumer:
        return TensorConsumer(name=self.name, timeout=60, batch_timeout=60)

    def same_rest(self, resumed: list[list[int]], exp: list[list[int]], moved: bool) -> None:
        """The resumed epoch gives what the interrupted one had left (see the docstring;
        on a producer that moved on, an unshuffled map epoch resumes in the order of the
        producer's epoch from where it is: the rest of it, then the start of the next)."""
        if self.kind == "iterable" or not self.shuffle and not moved:
            assert resumed == exp
        else:
            assert Counter(ids(resumed)) == Counter(ids(exp))
            assert all(len(b) == BATCH for b in resumed)
            assert len(resumed) == len(exp)

    def whole(self, epoch: list[list[int]]) -> None:
        """A whole epoch: every sample once (in order where the loader does not shuffle)."""
        if self.kind == "iterable" and self.workers:
            assert sorted(ids(epoch)) == list(range(SAMPLES))
        elif self.shuffle:
            assert sorted(ids(epoch)) == list(range(SAMPLES))
        else:
            assert ids(epoch) == list(range(SAMPLES))


def ids(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def take(it, k: int) -> list[list[int]]:
    return [next(it).tolist() for _ in range(k)]


def read_on(consumer: TensorConsumer, stop: threading.Event, errors: list) -> threading.Thread:
    """A thread that reads `consumer` epoch after epoch until `stop` (the interrupted job
    going on, so that the producer moves on under the resumed one)."""
    def run() -> None:
        try:
            while not stop.is_set():
                for _ in consumer:
                    if stop.is_set():
                        break
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def interrupted_and_resumed(loader: Loader, position, producer: str) -> None:
    """One case: k batches (position k; "break": 3 then break), the state, the rest of the
    epoch (exp); then a new consumer loads the state on a fresh producer or on the same
    one moved on: its epoch is exp, its next one whole."""
    loader.start()
    job = loader.consumer()
    it = iter(job)
    k = 3 if position == "break" else position
    taken = take(it, k)
    exp = None  # the rest of the epoch (not read by a job that left with break)
    if position == "break":
        del it  # the loop left with break: the state is the place left
    state = job.state_dict()
    if position != "break":
        exp = [b.tolist() for b in it]
        assert loader.kind == "iterable" or len(taken) + len(exp) == LAST
        if loader.kind == "map":
            assert Counter(ids(taken) + ids(exp)) == Counter(range(SAMPLES))
    stop, errors = threading.Event(), []
    reader = None
    if producer == "fresh":
        job.close()
        loader.start()
    else:
        reader = read_on(job, stop, errors)
    try:
        with loader.consumer() as again, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (an iterable's state is by count: it says so)
            again.load_state_dict(state)
            resumed = [b.tolist() for b in again]
            following = [b.tolist() for b in again]
    finally:
        stop.set()
        if reader is not None:
            reader.join(60)
            job.close()
    assert not errors, errors
    loader.whole(following)
    if exp is not None:
        loader.same_rest(resumed, exp, moved=producer != "fresh")
    elif loader.kind == "map":  # after break: the samples not taken, each once
        assert Counter(ids(taken) + ids(resumed)) == Counter(range(SAMPLES))
    else:  # an iterable's epochs are all alike: the resumed one is a whole one's rest
        assert resumed == following[3:]


KINDS = {
    "map-shuffle": ("map", 0, True),
    "map-in-order": ("map", 0, False),
    "map-shuffle-2-workers": ("map", 2, True),
    "iterable": ("iterable", 0, False),
    "iterable-2-workers": ("iterable", 2, False),
}
DEFAULT_KINDS = ("map-shuffle", "iterable")  # the others: -m slow
POSITIONS = [0, 1, 5, LAST, "break"]


def _cases() -> list:
    """(kind, position, producer) of test_interrupted_and_resumed: every position on both
    producers for the default kinds; for the others (slow), every position on a producer
    that moved on, and positions 1 and last on a fresh one."""
    cases = []
    for kind in KINDS:
        marks = () if kind in DEFAULT_KINDS else (pytest.mark.slow,)
        for position in POSITIONS:
            for producer in ("fresh", "moved-on"):
                if producer == "fresh" and position not in (1, LAST) and marks:
                    continue
                cases.append(pytest.param(kind, position, producer, marks=marks,
                                          id=f"{kind}-at-{position}-{producer}"))
    return cases


@pytest.mark.parametrize("kind, position, producer", _cases())
def test_interrupted_and_resumed(procs, name, kind, position, producer):
    """torchdata's _run_and_checkpoint, for each loader kind, position and producer."""
    interrupted_and_resumed(Loader(procs, name, *KINDS[kind]), position, producer)


@pytest.mark.parametrize("kind", ["map-shuffle", "iterable"])
def test_a_chain_of_interruptions(procs, name, kind):
    """State after 2 batches, resumed and interrupted again after 3 more, resumed: the
    three runs read the epoch once (a map epoch by id; an iterable one batch for batch)."""
    loader = Loader(procs, name, *KINDS[kind])
    loader.start()
    read: list[list[int]] = []
    state = None
    for k in (2, 3, None):
        with loader.consumer() as job, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if state is not None:
                job.load_state_dict(state)
            it = iter(job)
            read += take(it, k) if k is not None else [b.tolist() for b in it]
            state = job.state_dict()
    if kind == "iterable":
        assert ids(read) == list(range(SAMPLES))
    else:
        assert Counter(ids(read)) == Counter(range(SAMPLES))


def test_load_state_dict_in_the_middle_of_an_epoch(procs, name):
    """torchdata loads a state for the next iterator: loaded after 5 batches of an epoch,
    the state is what state_dict() says, the epoch being read goes on to its end, and the
    next iter() resumes from the state (the samples after its first 2 batches)."""
    loader = Loader(procs, name, *KINDS["map-shuffle"])
    loader.start()
    with loader.consumer() as job:
        it = iter(job)
        first = take(it, 2)
        state = job.state_dict()
        take(it, 3)
        job.load_state_dict(state)
        assert job.state_dict() == state
        rest = [b.tolist() for b in it]
        assert len(rest) == LAST - 5, "the epoch being read goes on"
        resumed = [b.tolist() for b in job]
        following = [b.tolist() for b in job]
    assert Counter(ids(first) + ids(resumed)) == Counter(range(SAMPLES))
    assert sorted(ids(following)) == list(range(SAMPLES))
