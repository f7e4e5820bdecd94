"""One producer and several consumers in real processes over real shm and zmq."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch

from conftest import shm_segments
from roles import check_batch
from tensorsocket import ProducerNotFound, TensorConsumer, TensorProducer


def test_one_producer_three_consumers_three_epochs(procs, name):
    """Every consumer gets every batch of every epoch, in order, content checked."""
    prod = procs.start("producer", "--name", name, "--epochs", "3", "--batches", "12",
                       "--min-consumers", "3")
    procs.wait_ready(prod)
    cons = [procs.start("consumer", "--name", name, "--epochs", "3") for _ in range(3)]
    results = [procs.result(c) for c in cons]
    pres = procs.result(prod)
    for r in results:
        assert r["errors"] == []
        assert r["len"] == 12
        assert r["epochs"] == [[e * 1000 + b for b in range(12)] for e in range(3)]
        assert r["zero_copy"], "consumer tensors must point into the shared mapping"
    assert pres["drained"] is True
    assert pres["stats"]["batches"] == 36
    # One copy per batch in total, whatever the number of consumers: the bytes the
    # producer copied are the batches' bytes (tensor data and the structure blob).
    per_batch = pres["stats"]["bytes_copied"] / 36
    assert 4 * 8 * 4 <= per_batch < 4096, per_batch


def test_zero_copy_and_single_copy_in_process(procs, name):
    """The consumer's tensors lie inside the mapping; bytes copied = one copy per batch."""
    prod = procs.start("producer", "--name", name, "--kind", "big", "--batches", "6")
    procs.wait_ready(prod)
    with TensorConsumer(name=name, timeout=30) as c:
        info = c.ring.info()
        lo, hi = info["data_address"], info["data_address"] + info["data_bytes"]
        n = 0
        for batch in c:
            check_batch("big", batch, n)
            assert lo <= batch.data_ptr() and batch.data_ptr() + batch.nbytes <= hi
            n += 1
        assert n == 6
    pres = procs.result(prod)
    assert pres["stats"]["bytes_copied"] < 6 * (256 * 1024 + 4096)
    assert pres["stats"]["bytes_copied"] >= 6 * 256 * 1024


def test_held_batch_pins_exactly_its_slot(procs, name):
    """A consumer holding batch 0 blocks reuse of slot 0 and of nothing else."""
    prod = procs.start("producer", "--name", name, "--kind", "tuple", "--batches", "30",
                       "--slots", "4")
    procs.wait_ready(prod)
    c = TensorConsumer(name=name, timeout=30)
    ring = c.ring
    me = 1 << ring.info()["consumer"]
    it = iter(c)
    held = next(it)  # batch 0 in slot 0: keep it
    sliced = held[0][1:3]  # a view of a view also pins the slot
    del held
    for _ in range(3):  # batches 1..3 in slots 1..3, released at once
        next(it)
    deadline = time.monotonic() + 5
    while ring.info()["published"] < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # give the producer every chance to (wrongly) overwrite slot 0
    info = ring.info()
    assert info["published"] == 4, "the producer must wait for slot 0"
    readers = ring.slot_readers()
    assert readers[0] == me and readers[1:] == (0, 0, 0)
    assert torch.equal(sliced, torch.zeros(2, 8)), "held data must be untouched"
    del sliced
    deadline = time.monotonic() + 5
    while ring.info()["published"] < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ring.info()["published"] >= 5, "releasing the batch must free slot 0"
    rest = sum(1 for _ in it)
    assert rest == 30 - 4
    c.close()
    procs.result(prod)


def _cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _second_consumer_releases_the_producer(procs, prod, name, c, it) -> None:
    """The producer waits for min_consumers=2 with 3 batches: a second consumer lets it
    publish, and both read all 3 (c's iterator `it` after its timeout too)."""
    c2 = TensorConsumer(name=name, timeout=30)
    assert sum(1 for _ in c2) == 3
    assert sum(1 for _ in it) == 3
    c.close()
    c2.close()
    procs.result(prod)


def test_idle_waiting_uses_no_cpu(procs, name):
    """A producer waiting for consumers and a consumer waiting for batches sleep."""
    prod = procs.start("producer", "--name", name, "--min-consumers", "2", "--batches", "3")
    procs.wait_ready(prod)
    c = TensorConsumer(name=name, timeout=30, batch_timeout=3.0)
    it = iter(c)
    me = psutil.Process(os.getpid())
    p0, c0, t0 = _cpu_seconds(prod.pid), sum(me.cpu_times()[:2]), time.monotonic()
    with pytest.raises(TimeoutError, match="batch_timeout"):
        next(it)  # the producer waits for a second consumer: nothing comes
    wall = time.monotonic() - t0
    p1, c1 = _cpu_seconds(prod.pid), sum(me.cpu_times()[:2])
    assert wall >= 2.9
    assert (p1 - p0) / wall < 0.05, f"producer used {p1 - p0:.3f} s CPU in {wall:.1f} s"
    assert (c1 - c0) / wall < 0.05, f"consumer used {c1 - c0:.3f} s CPU in {wall:.1f} s"
    _second_consumer_releases_the_producer(procs, prod, name, c, it)


def test_consumer_without_producer_fails_clearly(name):
    """No producer: a clear error naming the endpoint and the knob, within the timeout."""
    t0 = time.monotonic()
    with pytest.raises(ProducerNotFound) as ei:
        TensorConsumer(name=name, timeout=1.0)
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < 3.0
    msg = str(ei.value)
    assert name in msg and "timeout=" in msg


def test_consumer_started_before_producer(procs, name):
    """Start order does not matter: a consumer waits for its producer."""
    cons = procs.start("consumer", "--name", name, "--epochs", "1", "--timeout", "60")
    time.sleep(1.0)
    prod = procs.start("producer", "--name", name, "--batches", "5")
    r = procs.result(cons)
    procs.result(prod)
    assert r["epochs"] == [[0, 1, 2, 3, 4]] and r["errors"] == []


def test_nothing_left_behind(procs, name):
    """After producer and consumers exit, no segment, socket or lock holder remains."""
    prod = procs.start("producer", "--name", name, "--batches", "4")
    procs.wait_ready(prod)
    cons = procs.start("consumer", "--name", name)
    assert procs.result(cons)["errors"] == []
    procs.result(prod)
    assert shm_segments(name) == []
    from tensorsocket.control.endpoints import runtime_dir

    assert sorted(p.name for p in runtime_dir().glob(name + ".*")) == []
    # The name is free again at once.
    prod2 = procs.start("producer", "--name", name, "--batches", "2")
    procs.wait_ready(prod2)
    with TensorConsumer(name=name, timeout=30) as c:
        assert sum(1 for _ in c) == 2
    procs.result(prod2)


def test_killed_consumer_does_not_block_the_others(procs, name):
    """A SIGKILLed consumer holding batches is evicted; the survivor gets everything."""
    prod = procs.start("producer", "--name", name, "--batches", "40", "--kind", "tuple",
                       "--min-consumers", "2")
    procs.wait_ready(prod)
    victim = procs.start("consumer", "--name", name, "--kind", "tuple", "--stall-after", "3")
    survivor = procs.start("consumer", "--name", name, "--kind", "tuple")
    procs.wait_ready(victim)  # it holds batch 2 and hangs
    t0 = time.monotonic()
    victim.kill()
    r = procs.result(survivor, timeout=60)
    assert time.monotonic() - t0 < 10
    assert r["errors"] == [] and r["epochs"] == [list(range(40))]
    assert procs.result(prod)["drained"] is True


def test_dead_producer_makes_waiting_consumer_raise(procs, name):
    """SIGKILL the producer: a consumer waiting for a batch raises ProducerGone promptly."""
    from tensorsocket import ProducerGone

    prod = procs.start("producer", "--name", name, "--batches", "5", "--delay", "3600")
    procs.wait_ready(prod)
    c = TensorConsumer(name=name, timeout=30)
    it = iter(c)
    first = next(it)  # the producer now sleeps after publishing batch 0
    prod.kill()
    prod.wait()
    t0 = time.monotonic()
    with pytest.raises(ProducerGone, match="gone"):
        next(it)
    assert time.monotonic() - t0 < 2.0
    assert first["label"] == 0  # the batch in hand stays valid
    del first
    c.close()  # the last party out removes the dead producer's segment


def test_batch_timeout_set_after_construction_takes_effect(procs, name):
    """consumer.batch_timeout is the limit of the next waits, also when set after the
    consumer was made (as before the consumer was split into parts)."""
    prod = procs.start("producer", "--name", name, "--min-consumers", "2", "--batches", "3")
    procs.wait_ready(prod)
    c = TensorConsumer(name=name, timeout=30, batch_timeout=600)
    c.batch_timeout = 0.5
    assert c.batch_timeout == 0.5
    it = iter(c)
    with pytest.raises(TimeoutError, match=r"batch_timeout=0\.5 s"):
        next(it)  # the producer waits for a second consumer: nothing comes
    _second_consumer_releases_the_producer(procs, prod, name, c, it)


class _SamplerEpochs:
    """A sampler's set_epoch, recorded."""

    def __init__(self) -> None:
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class _ConstantLoader:
    """Two batches of `value` per epoch, with a sampler that has set_epoch."""

    def __init__(self, value: int) -> None:
        self.value, self.sampler = value, _SamplerEpochs()

    def __len__(self) -> int:
        return 2

    def __iter__(self):
        return iter([torch.full((3,), self.value)] * 2)


def test_producer_epoch_and_data_loader_set_between_epochs(name):
    """producer.epoch and producer.data_loader, set between epochs, are what the next epoch
    runs: its number (the sampler's set_epoch) and its source, as before the producer was
    split into parts."""
    first, second = _ConstantLoader(1), _ConstantLoader(2)
    with TensorProducer(first, name=name, min_consumers=0) as p:
        p.epoch = 5
        p.data_loader = second
        assert p.data_loader is second
        assert [int(batch[0]) for batch in p] == [2, 2]
        assert p.epoch == 6
        assert second.sampler.epochs == [5] and first.sampler.epochs == []
