"""Loaders that are not DataLoaders: re-iterable objects without len(), generators, and
callables that return a fresh iterable for each epoch. The producer runs in a thread of
the test process; consumers are role processes (tests/roles.py) or this process."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch

from roles import SampleDataset, collate_with_tag, make_batch
from tensorsocket import TensorConsumer, TensorProducer, TensorSocketError, TensorSocketWarning


def _tuples(epoch: int, batches: int):
    """The role consumer's `--kind tuple` batches of one epoch (values epoch*1000+b)."""
    for b in range(batches):
        yield make_batch("tuple", epoch * 1000 + b)


def _values(epoch: int, batches: int) -> list[int]:
    return [epoch * 1000 + b for b in range(batches)]


class Producing:
    """Run `epochs` epochs of a producer in a thread, then join(); errors are kept."""

    def __init__(self, producer: TensorProducer, epochs: int) -> None:
        self.producer = producer
        self.published: list[int] = []  # batches per epoch, as the producer yielded them
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(epochs,), daemon=True)
        self.thread.start()

    def _run(self, epochs: int) -> None:
        try:
            for _ in range(epochs):
                self.published.append(sum(1 for _ in self.producer))
            self.producer.join(timeout=30)
        except TensorSocketError as e:  # closed by the test while waiting
            self.error = e
        except Exception as e:
            self.error = e
            self.producer.close()  # consumers see the producer finished

    def finish(self) -> None:
        self.thread.join(30)
        assert not self.thread.is_alive(), "the producer thread did not finish"
        self.producer.close()


def test_generator_gives_one_epoch_then_a_clear_error(procs, name):
    """A generator is published once, in full; asking it for a second epoch raises a
    TypeError naming the problem and the fix, and the consumer is told the producer
    failed with that error (ProducerFailed), instead of waiting for an epoch that would
    never come."""
    producer = TensorProducer(_tuples(0, 7), name=name, start_timeout=30)
    run = Producing(producer, epochs=2)
    try:
        r = procs.result(procs.start("consumer", "--name", name, "--kind", "tuple",
                                     "--epochs", "2"))
    finally:
        run.finish()
    assert r["errors"] == [] and r["epochs"] == [_values(0, 7)]
    assert r["outcome"].startswith("ProducerFailed: "), r["outcome"]
    assert "TypeError" in r["outcome"] and "'generator'" in r["outcome"], r["outcome"]
    assert "no len()" in r["len"]
    assert run.published == [7]
    assert isinstance(run.error, TypeError)
    msg = str(run.error)
    assert "iterator" in msg and "'generator'" in msg and "epoch 0 used up" in msg
    assert "TensorProducer(lambda: make_batches())" in msg and "lambda epoch" in msg


def test_callable_gives_a_fresh_iterable_each_epoch(procs, name):
    """A one-argument callable is called at the start of each epoch with its number;
    a zero-argument one with none. Every epoch reaches the consumer whole."""
    calls: list = []

    def batches(epoch):
        calls.append(epoch)
        return _tuples(epoch, 5)

    producer = TensorProducer(batches, name=name, start_timeout=30)
    with pytest.raises(TypeError, match="first epoch has not started"):
        len(producer)
    run = Producing(producer, epochs=3)
    try:
        r = procs.result(procs.start("consumer", "--name", name, "--kind", "tuple",
                                     "--epochs", "3"))
    finally:
        run.finish()
    assert run.error is None and calls == [0, 1, 2]
    assert r["errors"] == [] and r["epochs"] == [_values(e, 5) for e in range(3)]
    assert "no len()" in r["len"]

    # Zero arguments: called bare, every epoch (in-process, no consumer needed).
    counter = iter(range(100))
    bare = TensorProducer(lambda: (torch.full((2,), float(next(counter))) for _ in range(3)),
                          name=name, min_consumers=0)
    try:
        seen = [[int(b[0]) for b in bare] for _ in range(3)]
    finally:
        bare.close()
    assert seen == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_callable_returning_a_dataloader_counts_like_the_dataloader(procs, name):
    """`lambda epoch: DataLoader(...)`: the epoch's loader gives len(), the exact sample
    count (re-batching, drop_last) and the default late-joiner window."""

    def loader(epoch):
        ds = SampleDataset(50)
        ds.epoch = epoch
        return torch.utils.data.DataLoader(ds, batch_size=8, collate_fn=collate_with_tag)

    producer = TensorProducer(loader, name=name, start_timeout=30, min_consumers=2)
    assert producer.window == 0  # unknown until the first epoch's loader exists
    run = Producing(producer, epochs=2)
    try:
        plain = procs.start("consumer", "--name", name, "--kind", "samples", "--epochs", "2")
        cut = procs.start("consumer", "--name", name, "--kind", "samples", "--epochs", "2",
                          "--batch-size", "3", "--drop-last")
        plain, cut = procs.result(plain), procs.result(cut)
    finally:
        run.finish()
    assert run.error is None and run.published == [7, 7]
    ids = [[e * 100000 + i for i in range(50)] for e in range(2)]
    assert plain["errors"] == [] and plain["epochs"] == ids and plain["len"] == 7
    assert plain["sizes"] == [[8] * 6 + [2]] * 2
    assert cut["errors"] == [] and cut["epochs"] == [e[:48] for e in ids]
    assert cut["len"] == 16 and cut["sizes"] == [[3] * 16] * 2
    assert producer.window == 1  # ceil(0.5% of 7 batches), as for the DataLoader itself
    assert len(producer) == 7


class StreamingDataset:
    """Like a Hugging Face datasets.IterableDataset: re-iterable, no len(), yields dicts of
    numpy arrays and tensors (here already batched: 4 rows each)."""

    def __init__(self, batches: int) -> None:
        self.batches = batches
        self.passes = 0

    def __iter__(self):
        epoch, self.passes = self.passes, self.passes + 1
        for b in range(self.batches):
            v = epoch * 1000 + b
            yield {"input_ids": np.arange(12, dtype=np.int64).reshape(4, 3) + v,
                   "attention_mask": torch.ones(4, 3, dtype=torch.bool),
                   "label": torch.full((4,), v)}


def test_reiterable_without_len_streams_every_epoch(name):
    """A re-iterable without len() runs one pass per epoch; len(consumer) raises the
    TypeError a DataLoader over an IterableDataset without __len__ raises, which tqdm
    and list() handle; re-batching still cuts its batches along dimension 0."""
    tqdm = pytest.importorskip("tqdm").tqdm
    producer = TensorProducer(StreamingDataset(6), name=name, start_timeout=30)
    run = Producing(producer, epochs=2)
    try:
        with TensorConsumer(name=name, timeout=10, batch_timeout=20) as c:
            with pytest.raises(TypeError, match="no len\\(\\)"):
                len(c)
            bar = tqdm(c, file=io.StringIO())
            assert bar.total is None
            first = []
            for batch in bar:
                assert isinstance(batch["input_ids"], np.ndarray)
                assert batch["attention_mask"].dtype == torch.bool
                v = int(batch["label"][0])
                assert (batch["input_ids"] == np.arange(12).reshape(4, 3) + v).all()
                first.append(v)
            del batch  # a batch held pins its slot (see docs/usage.md)
            second = [int(b["label"][0]) for b in c]
        assert first == _values(0, 6) and second == _values(1, 6)
    finally:
        run.finish()
    assert run.error is None and run.published == [6, 6]


def test_rebatching_a_loader_without_sample_count(name):
    """batch_size= over a loader that tells no sample count: every sample comes once, and
    len() says why it is unknown."""
    producer = TensorProducer(StreamingDataset(5), name=name, start_timeout=30)
    run = Producing(producer, epochs=1)
    try:
        with TensorConsumer(name=name, timeout=10, batch_timeout=20, batch_size=3) as c:
            with pytest.raises(TypeError, match="no len"):
                len(c)
            labels = [v for b in c for v in b["label"].tolist()]
    finally:
        run.finish()
    assert labels == [v for v in _values(0, 5) for _ in range(4)]


def test_reiterable_with_len_but_no_batch_size(name):
    """len() of a plain re-iterable is the consumer's len(); with batch_size= its sample
    count is unknown, and len() says so."""

    class Sized(StreamingDataset):
        def __len__(self) -> int:
            return self.batches

    producer = TensorProducer(Sized(4), name=name, start_timeout=30, min_consumers=2)
    run = Producing(producer, epochs=1)
    try:
        with TensorConsumer(name=name, timeout=10) as whole, \
                TensorConsumer(name=name, timeout=10, batch_size=2) as cut:
            assert len(whole) == 4
            with pytest.raises(TypeError, match="sample count"):
                len(cut)
            its = iter(whole), iter(cut)
            got = [next(its[0]) for _ in range(4)], [next(its[1]) for _ in range(8)]
            assert [int(b["label"][0]) for b in got[0]] == _values(0, 4)
            assert [int(b["label"][0]) for b in got[1]] == [v for v in _values(0, 4)
                                                             for _ in range(2)]
            del got
            assert next(its[0], None) is None and next(its[1], None) is None
    finally:
        run.finish()


def test_a_loader_yielding_more_than_its_len_is_cut_with_a_warning(name):
    """len() 4 of a loader that yields 8: each epoch is cut at len() (a loader that never
    ends, as the original TensorSocket's examples have, must end its epochs), and the
    producer says so once, naming the loader and both counts (it cut half the data
    silently before)."""

    class Short(StreamingDataset):
        def __len__(self) -> int:
            return self.batches // 2

    producer = TensorProducer(Short(8), name=name, min_consumers=0)
    try:
        with pytest.warns(TensorSocketWarning) as caught:
            published = [sum(1 for _ in producer) for _epoch in range(2)]
    finally:
        producer.close()
    assert published == [4, 4]
    (warning,) = [w for w in caught if "len()" in str(w.message)]
    text = str(warning.message)
    assert "'test_a_loader_yielding_more_than_its_len_is_cut_with_a_warning.<locals>.Short'" \
        in text
    assert "has len() 4 but yields more batches (a batch 5 came in epoch 0)" in text
    assert "each epoch is cut at len() = 4 batches" in text


def test_one_shot_iterator_cut_short_continues_then_fails_clearly(name):
    """An epoch cut short by break leaves an iterator where it stopped: the next epoch
    continues it; once used up, the next epoch raises instead of publishing nothing."""
    producer = TensorProducer(iter([torch.full((2,), float(i)) for i in range(6)]),
                              name=name, min_consumers=0)
    try:
        first = []
        for batch in producer:
            first.append(int(batch[0]))
            if len(first) == 2:
                break
        assert first == [0, 1]
        assert [int(b[0]) for b in producer] == [2, 3, 4, 5]
        with pytest.raises(TypeError, match="'list_iterator' object\\) that epoch 1 used up"):
            list(producer)
    finally:
        producer.close()


def test_callable_returning_the_same_iterator_fails_clearly(name):
    gen = (torch.zeros(2) for _ in range(3))
    producer = TensorProducer(lambda: gen, name=name, min_consumers=0)
    try:
        assert len(list(producer)) == 3
        with pytest.raises(TypeError, match="callable returned the same 'generator' object"):
            list(producer)
    finally:
        producer.close()


def test_bad_loaders_are_refused_with_the_reason(name):
    with pytest.raises(TypeError, match="iterable of batches .* or a callable"):
        TensorProducer(42, name=name)
    with pytest.raises(TypeError, match="requires epoch, shard"):
        TensorProducer(lambda epoch, shard: [], name=name)
    producer = TensorProducer(lambda: 7, name=name, min_consumers=0)
    try:
        with pytest.raises(TypeError, match="returned 'int' for epoch 0, which is not iterable"):
            list(producer)
    finally:
        producer.close()
