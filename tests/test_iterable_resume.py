"""Resume of a loader over an IterableDataset without __len__ (issue 36, item 2).

Such a loader's batches carry no sample ids, so a state says how many batches of the
epoch were taken, and the resumed epoch skips that many. On a producer that has moved on
(another job reads it, mid-epoch), the count must be taken from the start of one of its
epochs: before issue 36 the resumed job counted from wherever the producer was (ids
10-29 twice and 80-99 never in a 100-sample epoch, the next epoch misaligned too).
A real producer process; the consumers run in the test process."""

from __future__ import annotations

import threading
import warnings

from tensorsocket import TensorConsumer

SAMPLES, BATCH = 100, 10

# A producer of an IterableDataset with no __len__: each pass yields ids 0..SAMPLES-1.
PRODUCER = r"""
import sys, torch
from torch.utils.data import DataLoader, IterableDataset
from tensorsocket import TensorProducer

name, samples, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(samples))

producer = TensorProducer(DataLoader(Stream(), batch_size=batch), name=name,
                          min_consumers=2, start_grace=0, start_timeout=60)
print("ready", flush=True)
for epoch in range(6):
    for _ in producer:
        pass
producer.join(timeout=60)
producer.close()
"""


def _ids(batches) -> list[int]:
    return [int(i) for batch in batches for i in batch]


def test_a_resumed_iterable_epoch_counts_from_a_producer_epoch_start(procs, name):
    """Jobs A and B read; A takes 2 batches, saves its state and stops; B reads on to
    the middle of the epoch; A's restart loads the state: its epoch is ids 20..99 (the
    producer's next pass, its first 2 batches skipped), and its next epoch 0..99."""
    p = procs.script(PRODUCER, name, str(SAMPLES), str(BATCH))
    assert p.stdout.readline() == "ready\n", p.communicate(timeout=30)
    kw = dict(name=name, timeout=30, batch_timeout=30)
    attached: dict[str, TensorConsumer] = {}
    threads = [threading.Thread(target=lambda k=k: attached.__setitem__(k, TensorConsumer(**kw)))
               for k in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    a, b = attached["a"], attached["b"]
    b_epoch = iter(b)
    with a:
        a_epoch = iter(a)
        taken = [next(a_epoch).tolist() for _ in range(2)]
        state = a.state_dict()
        b_seen = [next(b_epoch).tolist() for _ in range(5)]  # (the ring holds A's share)
    assert _ids(taken) == list(range(20))
    assert state["batches_in_epoch"] == 2 and state["taken"] is None

    resumed: list[list[int]] = []
    with TensorConsumer(**kw) as again, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (by count: said for shuffling loaders)
        again.load_state_dict(state)
        reader = threading.Thread(target=lambda: resumed.extend(
            _ids(e) for e in ([t.tolist() for t in again], [t.tolist() for t in again])))
        reader.start()
        with b:
            b_seen += [t.tolist() for t in b_epoch]
            for _ in range(2):
                b_seen += [t.tolist() for t in b]
        reader.join(60)
    assert _ids(b_seen) == list(range(SAMPLES)) * 3
    assert resumed[0] == list(range(20, SAMPLES)), "the resumed epoch"
    assert resumed[1] == list(range(SAMPLES)), "the epoch after it"
