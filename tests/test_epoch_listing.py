"""consumer.batch_sampler before the consumer's first epoch (issue 36, item 1).

accelerate's skip_first_batches builds a DataLoader of its own from a loader's
``batch_sampler``. Before a consumer has read anything, that listing must be the order
the producer will deliver for the epoch the consumer reads first, and in a rank group
each rank's part of that one order: before issue 36 each rank listed its own loader's
sampling, drawn from its own RNG, and two ranks of a shuffled loader overlapped. Real
producer processes; the consumers run in the test process (the ranks of a group in
threads, as they start together)."""

from __future__ import annotations

import subprocess
import threading

import torch
from torch.utils.data import DataLoader

from tensorsocket import TensorConsumer

SAMPLES, BATCH = 96, 8  # 12 batches an epoch

# A producer of a shuffling DataLoader (torch seeded) over samples that are their ids.
PRODUCER = r"""
import sys, torch
from torch.utils.data import DataLoader
from tensorsocket import TensorProducer

name, samples, batch, slots = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
slot_bytes = 1 << 20
torch.manual_seed(0)
loader = DataLoader(torch.arange(samples), batch_size=batch, shuffle=True)
producer = TensorProducer(loader, name=name, min_consumers=1, start_grace=0,
                          start_timeout=60, ring_slots=slots, rubber_band=1,
                          slot_bytes=slot_bytes)
print("ready", flush=True)
for epoch in range(5):
    for _ in producer:
        pass
producer.join(timeout=60)
producer.close()
"""


def _producer(procs, name: str, slots: int = 16, samples: int = SAMPLES,
              batch: int = BATCH) -> subprocess.Popen:
    """A producer process of the shuffling loader, once it has its name."""
    p = procs.script(PRODUCER, name, str(samples), str(batch), str(slots))
    line = p.stdout.readline()
    assert line == "ready\n", p.communicate(timeout=30)
    return p


def _epoch(consumer: TensorConsumer) -> list[list[int]]:
    """One epoch of `consumer`: each batch's ids."""
    return [batch.tolist() for batch in consumer]


def _plain_orders(epochs: int) -> list[list[list[int]]]:
    """The batches of `epochs` epochs of the producer's loader run as a plain DataLoader,
    torch seeded as the producer seeds it."""
    torch.manual_seed(0)
    loader = DataLoader(torch.arange(SAMPLES), batch_size=BATCH, shuffle=True)
    return [[batch.tolist() for batch in loader] for _ in range(epochs)]


def test_the_listing_is_the_epoch_the_producer_delivers(procs, name):
    """Alone, before reading: batch_sampler lists the producer's order of the consumer's
    first epoch (the sampler view the same indices), then the consumer reads exactly that;
    listing each epoch in full draws from torch's RNG as the plain DataLoader does, so the
    producer's epochs are the plain loader's, epoch for epoch."""
    _producer(procs, name)
    with TensorConsumer(name=name, timeout=30, batch_timeout=30) as consumer:
        listed = list(consumer.batch_sampler)
        assert list(consumer.sampler) == [i for batch in listed for i in batch]
        assert list(consumer.batch_sampler) == listed  # the same order, however often asked
        assert len(consumer.batch_sampler) == len(listed) == SAMPLES // BATCH
        epochs = [_epoch(consumer) for _ in range(3)]
    assert epochs[0] == listed
    assert sorted(i for batch in listed for i in batch) == list(range(SAMPLES))
    assert epochs == _plain_orders(3)


def test_a_late_consumer_lists_the_next_epoch_drawn_ahead(procs, name):
    """A consumer that attaches after the epoch running has moved past its first batches
    reads the next epoch first: the producer draws that epoch's order ahead when the
    consumer asks, and delivers that same order when the epoch comes (to both consumers)."""
    _producer(procs, name, slots=4)
    with TensorConsumer(name=name, timeout=30, batch_timeout=30) as first:
        it = iter(first)
        early = [next(it).tolist() for _ in range(6)]  # past the ring and its window
        with TensorConsumer(name=name, timeout=30, batch_timeout=30) as late:
            listed = list(late.batch_sampler)
            got: list[list[list[int]]] = []
            reader = threading.Thread(target=lambda: got.append(_epoch(late)))
            reader.start()  # (attached, it holds the entries from its start on: it reads)
            rest = [batch.tolist() for batch in it]
            first_next = _epoch(first)
            reader.join(60)
            late_epoch = got[0] if got else None
    assert sorted(i for batch in early + rest for i in batch) == list(range(SAMPLES))
    assert late_epoch == listed
    assert first_next == listed, "the late consumer's first epoch is the producer's next"
    assert listed != early + rest


def test_the_ranks_of_a_group_list_parts_of_one_order(procs, name):
    """Ranks 0 and 1 of a group, before reading: each lists its part (batches r, r + 2, ...)
    of the producer's one order, none in common, together every batch of the epoch but
    its last odd one out; then each reads exactly what it listed."""
    _producer(procs, name)
    consumers: dict[int, TensorConsumer] = {}
    errors: list[BaseException] = []

    def attach(rank: int) -> None:
        try:
            consumers[rank] = TensorConsumer(name=name, rank=rank, world_size=2, group="g",
                                             timeout=30, batch_timeout=30)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=attach, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    try:
        listed = {rank: list(c.batch_sampler) for rank, c in consumers.items()}

        read: dict[int, list[list[int]]] = {}
        readers = [threading.Thread(target=lambda r=r: read.__setitem__(r, _epoch(consumers[r])))
                   for r in range(2)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(60)
    finally:
        for c in consumers.values():
            c.close()
    ids = {rank: {i for batch in part for i in batch} for rank, part in listed.items()}
    assert not ids[0] & ids[1]
    assert len(ids[0]) == len(ids[1]) == SAMPLES // 2
    assert read == listed


def test_batches_larger_than_a_control_message_are_listed(procs, name):
    """Batches of 9,000 indices (72 KB each, over the 64 KiB a control message may hold):
    the listing comes in parts that split batches, and is the epoch then read (before the
    fix the answer broke the consumer's control connection: no listing, then evicted)."""
    samples, batch = 20000, 9000
    # 3 slots: the producer waits in epoch 0 (at its end marker) until the consumer reads,
    # so the listing asked for right after attaching is of the epoch it runs (with 16, on a
    # loaded machine it could publish two whole epochs of 3 batches before the control
    # thread answered: "epoch 0 is not listed (the producer is at epoch 2)").
    _producer(procs, name, slots=3, samples=samples, batch=batch)
    with TensorConsumer(name=name, timeout=30, batch_timeout=30) as consumer:
        listed = list(consumer.batch_sampler)
        assert [len(b) for b in listed] == [9000, 9000, 2000]
        assert _epoch(consumer) == listed
        assert sorted(i for b in listed for i in b) == list(range(samples))


# -- the producer's planner alone (its rules, without processes) ---------------------

class _Sampler:
    """A batch sampler over `items` (a list the test changes), counting its passes."""

    def __init__(self, items: list, fail: bool = False) -> None:
        self.items, self.fail, self.passes = items, fail, 0

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        self.passes += 1
        if self.fail:
            raise RuntimeError("a sampler that cannot draw ahead")
        return iter([list(b) for b in self.items])


def test_an_epoch_run_again_under_its_number_is_drawn_anew():
    """An epoch that yielded nothing runs again under the same number (the producer counts
    epochs that published): its listing is drawn anew, not the empty one kept."""
    from tensorsocket.producer.listings import EpochPlanner

    planner, sampler = EpochPlanner(), _Sampler([])
    with planner.lock:
        planner.begin(object(), 0, (sampler, True), next_too=True)
    assert list(planner.items(sampler)) == []
    sampler.items = [[3, 1], [2, 0]]
    with planner.lock:
        planner.begin(object(), 0, (sampler, True), next_too=True)
    assert list(planner.items(sampler)) == [[3, 1], [2, 0]]


def test_a_draw_ahead_that_fails_is_said_once_and_not_tried_again():
    """A sampler that raises when the control thread draws the next epoch ahead: the
    consumer is told why (not a refused request), and later asks are answered from what
    was noted, without drawing (each draw would take from the sampler's RNG again)."""
    from tensorsocket.producer.listings import EpochPlanner

    planner, sampler = EpochPlanner(), _Sampler([[0, 1]])
    with planner.lock:
        planner.begin(object(), 0, (sampler, True), next_too=True)
    assert list(planner.items(sampler)) == [[0, 1]]
    sampler.fail = True
    first = planner.listing(1)
    assert isinstance(first, str) and "RuntimeError" in first, first
    passes = sampler.passes
    assert planner.listing(1) == first and sampler.passes == passes


def test_a_consumer_that_reads_from_within_an_epoch_is_not_listed_one():
    """epoch_at: an aligned consumer that starts within epoch 0 reads epoch 1 first; one
    that is not aligned reads on from where it started, an epoch no listing describes."""
    from tensorsocket.producer.listings import EpochPlanner

    planner, sampler = EpochPlanner(), _Sampler([[0], [1], [2]])
    with planner.lock:
        planner.begin(object(), 0, (sampler, True), next_too=True)
    list(planner.items(sampler))
    planner.published(0)
    assert planner.epoch_at(0, True) == planner.epoch_at(0, False) == 0
    assert planner.epoch_at(2, True) == 1
    assert planner.epoch_at(2, False) is None
