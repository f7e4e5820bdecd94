"""producer.stats() and consumer.stats() report what happened."""

from __future__ import annotations

import threading
import time

import torch

from tensorsocket import TensorConsumer, TensorProducer


def test_stats_of_producer_and_consumers(name):
    loader = [{"x": torch.full((8, 16), float(i)), "i": i} for i in range(30)]
    producer = TensorProducer(loader, name=name, min_consumers=2, ring_slots=6,
                              start_timeout=30)
    published = threading.Event()
    last_out = threading.Event()  # the producer holds its end marker back until then
    errors: list = []

    def run():
        try:
            for i, _ in enumerate(producer):
                if i == len(loader) - 1:
                    last_out.wait(30)
            published.set()
        except Exception as e:  # reported by the assertion below
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    whole = TensorConsumer(name=name, timeout=10)
    halves = TensorConsumer(name=name, timeout=10, batch_size=4)
    try:
        it_whole, it_halves = iter(whole), iter(halves)
        for _ in range(5):
            next(it_whole)
        for _ in range(4):  # two loader batches
            next(it_halves)

        # The producer is blocked on a full ring: 6 entries ahead of the slower consumer.
        deadline = time.monotonic() + 10
        while producer.ring.info()["published"] < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = producer.stats()
        assert stats["consumers"] == 2 and stats["slots"] == 6
        table = {row["batch_size"]: row for row in stats["consumer_table"]}
        assert set(table) == {None, 4}
        assert table[None]["delivered"] == 5 and table[4]["delivered"] == 2
        assert table[None]["delivered_bytes"] >= 5 * 8 * 16 * 4
        assert all(row["state"] == "active" for row in table.values())
        published_now = producer.ring.info()["published"]  # ring entries, all batches here
        assert stats["batches"] in (published_now - 1, published_now)  # counted after publish
        assert table[None]["lag"] == published_now - 5
        assert table[4]["lag"] == published_now - 2
        assert 1 <= stats["occupied"] <= 6

        c = whole.stats()
        assert c["batches"] == 5 and c["samples"] == 40 and c["loader_batches"] == 5
        assert c["bytes"] == table[None]["delivered_bytes"]
        assert c["lag"] == published_now - 5
        h = halves.stats()
        assert h["batches"] == 4 and h["loader_batches"] == 2 and h["samples"] == 16

        # Both read on in step (one thread: each waits for the other to free slots).
        for _ in it_whole:
            next(it_halves)
            next(it_halves)
        assert len(list(it_halves)) == 6  # it started 3 loader batches behind
        # Both epochs ended with their last batches (len() is known), before the end marker
        # came; it is an entry of the ring, but no batch: the finished epoch has lag 0.
        last_out.set()
        assert published.wait(10) and errors == []
        assert producer.ring.info()["published"] == 31
        assert whole.stats()["batches"] == 30 and halves.stats()["batches"] == 60
        assert whole.stats()["lag"] == 0 and halves.stats()["lag"] == 0
        final = producer.stats()
        assert final["batches"] == 30 and final["wait_seconds"] > 0
    finally:
        whole.close()
        halves.close()
        producer.close()
        thread.join(10)


def test_samples_counted_from_the_first_tensor_with_a_dimension(name):
    """A loader that does not tell its batch size: each batch counts dim 0 of its first
    tensor or array with a dimension, in the batch's order (0-d leaves and plain values
    before it count for nothing; a batch with no such leaf counts 0)."""
    import numpy as np

    loader = [("tag", {"scale": torch.tensor(2.0), "x": np.zeros((3, 2), np.float32)},
               torch.zeros(7)) for _ in range(4)] + [(torch.tensor(1.0), 5)]
    producer = TensorProducer(loader, name=name, start_timeout=30)
    thread = threading.Thread(target=lambda: [None for _ in producer])
    thread.start()
    try:
        with TensorConsumer(name=name, timeout=10) as c:
            assert sum(1 for _ in c) == 5
            assert c.stats()["samples"] == 4 * 3
    finally:
        thread.join(30)
        producer.close()
