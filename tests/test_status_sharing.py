"""What `tensorsocket status` says sharing does for a producer, against real producer and
consumer processes: which side is the bottleneck (a consumer that holds a batch, a loader
that burns CPU), and the loading CPU sharing saved, from the ring header's counters
(batches_delivered, publish_cpu_ns; docs/cli.md, "What sharing saves").

Nothing is ordered by a sleep: the tests wait for conditions the ring shows (a consumer
holding its batch, the producer stuck on its slot, every consumer through its epoch) and
for the children's JSON lines; the producers wait on a FIFO the test writes to.
"""

from __future__ import annotations

import os
import time

import pytest

from tensorsocket.cli import sharing_report
from tensorsocket.cli.status import ConsumerStatus, ProducerStatus, as_json, render, survey

SLOTS = 4  # ring slots of every producer here

# A producer over a loader of `batches` int64[16] batches, each after burning `burn_ms` ms
# of the thread's CPU (a loader's decoding, say; the CPU it provably burned is reported).
# It prints {"event": "epoch", "loader_cpu": s} after one epoch, then waits for a byte on
# the FIFO before it closes.
_PRODUCER = r"""
import os, sys, time
import torch
from tensorsocket import TensorProducer
from tools.harness import emit
name, batches, burn_ms, min_consumers, fifo = sys.argv[1:6]
batches, burn_ns, min_consumers = int(batches), int(float(burn_ms) * 1e6), int(min_consumers)
burned = [0]

class Loader:
    def __len__(self):
        return batches

    def __iter__(self):
        for i in range(batches):
            t0 = time.thread_time_ns()
            while time.thread_time_ns() - t0 < burn_ns:
                pass
            batch = torch.full((16,), i, dtype=torch.int64)
            burned[0] += time.thread_time_ns() - t0
            yield batch

producer = TensorProducer(Loader(), name=name, ring_slots=%d, min_consumers=min_consumers,
                          start_grace=0)
emit({"event": "ready"})
for _ in producer:
    pass
emit({"event": "epoch", "loader_cpu": burned[0] / 1e9})
with open(fifo, "rb") as f:
    f.read(1)
producer.close()
""" % SLOTS

# A consumer that reads one epoch as fast as it can, then prints how many batches it got.
_READER = r"""
import sys
from tensorsocket import TensorConsumer
from tools.harness import emit
consumer = TensorConsumer(name=sys.argv[1], timeout=120, batch_timeout=120)
emit({"event": "ready"})
n = sum(1 for _ in consumer)
emit({"event": "done", "batches": n})
"""

# A consumer that takes one batch and keeps it, blocked on a FIFO (the GIL released: its
# heartbeats go on), until the test ends it.
_HOLDER = r"""
import os, sys
from tensorsocket import TensorConsumer
from tools.harness import emit
consumer = TensorConsumer(name=sys.argv[1], timeout=120, batch_timeout=120)
held = next(iter(consumer))
emit({"event": "holding", "value": int(held[0])})
os.read(os.open(sys.argv[2], os.O_RDWR), 1)
"""


def _fifo(directory, name: str) -> str:
    path = os.path.join(directory, name)
    os.mkfifo(path)
    return path


def _producer(procs, name: str, batches: int, burn_ms: float, min_consumers: int,
              fifo: str):
    p = procs.script(_PRODUCER, name, str(batches), str(burn_ms), str(min_consumers), fifo)
    assert p.wait_ready(60)["event"] == "ready"
    return p


def _reading(name: str) -> ProducerStatus:
    """One reading (no rates) of producer `name`."""
    (p,) = survey(0, name)
    return p


def _wait_for(name: str, predicate, what: str, timeout: float = 60) -> ProducerStatus:
    """Poll readings of producer `name` until predicate(reading) holds; the reading."""
    deadline = time.monotonic() + timeout
    while True:
        found = survey(0, name)
        p = next((s for s in found if s.state == "running"), None)
        if p is not None and predicate(p):
            return p
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {found}")
        time.sleep(0.05)


def _release(fifo: str) -> None:
    """Let a producer blocked on its FIFO go on (it closes)."""
    with open(fifo, "wb") as f:
        f.write(b"x")


def test_a_consumer_holding_a_batch_is_the_bottleneck(name, procs, short_tmp):
    """One consumer takes a batch and keeps it, another reads freely: once the producer is
    stuck on the held slot, survey() names the holder (table index and pid) as the
    bottleneck, with the producer waiting for its slots and the other consumer waiting."""
    _producer(procs, name, 100000, 0, 2, _fifo(short_tmp, "producer"))
    holder = procs.script(_HOLDER, name, _fifo(short_tmp, "holder"))
    reader = procs.script(_READER, name)
    assert reader.wait_ready(60)["event"] == "ready"
    assert holder.wait_ready(60) == {"event": "holding", "value": 0}

    def stuck(p: ProducerStatus) -> bool:
        # Every slot published, the reader through all of them: the producer's next slot
        # is the held one.
        free = [c for c in p.consumers if c.pid == reader.pid]
        return p.published >= SLOTS and len(free) == 1 and \
            free[0].cursor == p.published

    _wait_for(name, stuck, "the producer to be stuck on the held slot")
    (p,) = survey(1.0, name)
    assert p.published == SLOTS  # still stuck
    (held,) = [c for c in p.consumers if c.pid == holder.pid]
    assert p.bottleneck == "consumer", (p.bottleneck_detail, p.publish_wait_fraction)
    assert p.bottleneck_consumer == {"index": held.index, "pid": holder.pid}
    assert p.publish_wait_fraction >= sharing_report.CONSUMER_BOUND_PRODUCER_WAIT
    text = "\n".join(render([p], width=80))
    assert f"bottleneck: consumer {held.index} (pid {holder.pid}): the producer waits " \
           f"for its slots" in text, text
    doc = as_json([p], 1.0)["producers"][0]
    assert doc["bottleneck"] == "consumer" and doc["bottleneck_consumer"]["pid"] == holder.pid
    assert "bottleneck_detail" not in doc


def test_a_slow_loader_is_the_bottleneck(name, procs, short_tmp):
    """A loader that burns 30 ms of CPU per batch and two consumers that drop each batch at
    once: the bottleneck is the loader, every consumer waiting for batches."""
    _producer(procs, name, 100000, 30, 2, _fifo(short_tmp, "producer"))
    readers = [procs.script(_READER, name) for _ in range(2)]
    for r in readers:
        assert r.wait_ready(60)["event"] == "ready"
    _wait_for(name, lambda p: len(p.consumers) == 2 and
              all(c.delivered >= 3 for c in p.consumers), "both consumers to receive")
    (p,) = survey(1.5, name)
    assert p.bottleneck == "loader", (p.bottleneck_detail, p.publish_wait_fraction,
                                      [c.waiting for c in p.consumers])
    assert p.bottleneck_consumer is None
    assert p.publish_wait_fraction < sharing_report.LOADER_BOUND_PRODUCER_WAIT
    assert all(c.waiting >= sharing_report.LOADER_BOUND_CONSUMER_WAIT for c in p.consumers)
    assert "bottleneck: the loader (consumers wait for batches" in "\n".join(render([p]))
    # Each batch goes to both consumers: sharing saves about the loader's cores once.
    assert p.loader_cpu_rate is not None and p.loader_cpu_rate > 0
    assert p.cpu_saved_rate is not None and p.cpu_saved_rate > 0


def test_loading_cpu_saved_is_counted_per_delivered_batch(name, procs, short_tmp):
    """Three consumers each take every batch of a 20-batch epoch (its end marker too):
    batches_delivered is exactly 60, publishing cost some CPU, the loader's CPU is at least
    what the loader provably burned, and the saving is loader x (60 / 20 - 1).

    Fails before the ring counted deliveries: batches_delivered reads 0, not 60 (a
    consumer's table entry count includes the end marker: 21)."""
    batches = 20
    fifo = _fifo(short_tmp, "producer")
    prod = _producer(procs, name, batches, 20, 3, fifo)
    readers = [procs.script(_READER, name) for _ in range(3)]
    for r in readers:
        assert r.wait_ready(60)["event"] == "ready"
    for r in readers:
        assert r.read_json(120) == {"event": "done", "batches": batches}
    burned = prod.read_json(120)
    assert burned["event"] == "epoch" and burned["loader_cpu"] >= batches * 0.020
    p = _reading(name)
    assert p.batches_published == batches and p.epochs_ended == 1
    assert p.batches_delivered == 3 * batches
    assert p.publish_cpu_seconds is not None and p.publish_cpu_seconds > 0
    # /proc/<pid>/stat gives utime and stime in whole clock ticks, each cut down: the
    # process's CPU reads up to 2 ticks short (seen: 6 ms short on a loaded machine).
    short = 2 / os.sysconf("SC_CLK_TCK")
    assert p.loader_cpu_seconds is not None and \
        p.loader_cpu_seconds >= burned["loader_cpu"] - short, (p.loader_cpu_seconds, burned)
    assert p.loader_cpu_saved_seconds == pytest.approx(p.loader_cpu_seconds * (3 - 1))
    text = "\n".join(render([p]))
    assert f"for {batches} batches, delivered {3 * batches} times" in text, text
    doc = as_json([p], 0)["producers"][0]
    for key in ("loader_cpu_seconds", "publish_cpu_seconds", "batches_delivered",
                "loader_cpu_saved_seconds", "loader_cpu_rate", "cpu_saved_rate",
                "bottleneck", "bottleneck_consumer"):
        assert key in doc, key
    assert doc["bottleneck"] is None  # one reading: no interval to judge
    _release(fifo)
    prod.wait(60)
    assert prod.returncode == 0, prod.stderr.read() if prod.stderr else ""


# A producer that burns `setup_ms` of CPU before its loader begins (an expensive set-up),
# then runs 2 epochs of a DataLoader whose 2 workers (started anew each epoch: not
# persistent) burn `burn_ms` of CPU per sample; it waits on the FIFO before it closes.
_WORKER_PRODUCER = r"""
import sys, time
import torch
from tensorsocket import TensorProducer
from tools.harness import emit
name, samples, burn_ms, setup_ms, fifo = sys.argv[1:6]
samples, burn_ns = int(samples), int(float(burn_ms) * 1e6)

class Burning(torch.utils.data.Dataset):
    def __len__(self):
        return samples

    def __getitem__(self, i):
        t0 = time.thread_time_ns()
        while time.thread_time_ns() - t0 < burn_ns:
            pass
        return torch.tensor(i)

loader = torch.utils.data.DataLoader(Burning(), batch_size=4, num_workers=2)
producer = TensorProducer(loader, name=name, min_consumers=1, start_grace=0)
t0 = time.process_time()
while time.process_time() - t0 < float(setup_ms) / 1e3:
    pass
emit({"event": "ready"})
for epoch in range(2):
    for _ in producer:
        pass
emit({"event": "epochs"})
with open(fifo, "rb") as f:
    f.read(1)
producer.close()
"""


def test_loader_cpu_counts_exited_workers_and_leaves_out_the_set_up(name, procs, short_tmp):
    """The loader's CPU is what its workers burned, those of the first epoch too (they
    exited: a DataLoader without persistent workers starts new ones each epoch), and not
    the producer's own set-up before its loader began.

    Fails before status added the reaped children's CPU (cutime, cstime): the first
    epoch's workers' CPU was lost, the loader's CPU came out below what they burned; and
    before the producer noted its set-up CPU: the 2 s of set-up counted as loading."""
    samples, burn_s, setup_s = 24, 0.025, 2.0
    fifo = _fifo(short_tmp, "producer")
    prod = procs.script(_WORKER_PRODUCER, name, str(samples), str(burn_s * 1e3),
                        str(setup_s * 1e3), fifo)
    assert prod.wait_ready(60)["event"] == "ready"
    reader = procs.script(_READER2, name)
    assert reader.wait_ready(60)["event"] == "ready"
    assert prod.read_json(120) == {"event": "epochs"}
    assert reader.read_json(120) == {"event": "done", "batches": 2 * samples // 4}
    p = _reading(name)
    burned = 2 * samples * burn_s  # both epochs' workers
    assert p.loader_cpu_seconds is not None
    assert burned <= p.loader_cpu_seconds < burned + setup_s * 0.75, \
        (p.loader_cpu_seconds, burned, p.cpu_seconds)
    _release(fifo)
    prod.wait(60)
    assert prod.returncode == 0, prod.stderr.read() if prod.stderr else ""


# A consumer that reads two epochs, then prints how many batches it got.
_READER2 = _READER.replace("n = sum(1 for _ in consumer)",
                           "n = sum(1 for _ in consumer) + sum(1 for _ in consumer)")


# -- the derivations and the text, on their own ---------------------------------------


def test_bottleneck_rules():
    """The thresholds as documented: loader, consumer (the holder of the next slot that
    waits least), balanced; None without a measured interval."""
    a = sharing_report.ConsumerWait(0, 100, 0.9, False)
    b = sharing_report.ConsumerWait(1, 101, 0.05, True)
    c = sharing_report.ConsumerWait(2, 102, 0.01, False)
    assert sharing_report.bottleneck(None, [a]) is None
    assert sharing_report.bottleneck(0.0, []) is None
    assert sharing_report.bottleneck(0.05, [a]).side == "loader"
    assert sharing_report.bottleneck(0.05, [a, b]).side == "balanced"
    stuck = sharing_report.bottleneck(0.9, [a, b, c])
    # c waits least, but the producer waits for b's slot.
    assert stuck.side == "consumer" and stuck.consumer == b and stuck.others_waiting == 0.01
    assert sharing_report.bottleneck(0.9, [a, c]).consumer == c  # nobody holds it: least
    # Nothing published in the interval: idle, unless the producer is stuck on a slot.
    assert sharing_report.bottleneck(0.0, [a, b], published=0).side == "idle"
    assert sharing_report.bottleneck(0.9, [a, b], published=0).side == "consumer"
    assert sharing_report.bottleneck(0.05, [a], published=3).side == "loader"
    assert sharing_report.loader_cpu_saved_seconds(2.0, 30, 10) == 4.0
    assert sharing_report.loader_cpu_saved_seconds(2.0, 5, 10) == 0.0  # never below 0
    assert sharing_report.loader_cpu_saved_seconds(2.0, 5, 0) is None
    assert sharing_report.loader_cpu_seconds(3.0, 1.0, 0.5) == 1.5


def test_sharing_lines_wrap_at_80_columns():
    """The bottleneck and saving lines of a producer with wide values wrap at 80 columns."""
    waits = sharing_report.ConsumerWait(2, 4194302, 0.02, True)
    consumers = [ConsumerStatus(index=i, pid=4194300 + i, alive=True, state="active",
                                reason="", batch_size=None, cursor=5, lag=0, delivered=5,
                                delivered_bytes=1, waiting=w)
                 for i, w in enumerate([0.75, 0.8, 0.02])]
    p = ProducerStatus(
        name="imagenet-train-shared-loader", segment="s", pid=4194300, alive=True,
        state="running", cpu_seconds=123456.7, publish_cpu_seconds=1234.5,
        loader_cpu_seconds=122222.2, batches_published=1234567, batches_delivered=3703701,
        loader_cpu_saved_seconds=244444.4, consumers=consumers,
        bottleneck_detail=sharing_report.bottleneck(0.8, [
            sharing_report.ConsumerWait(0, 4194300, 0.75, False),
            sharing_report.ConsumerWait(1, 4194301, 0.8, False), waits]))
    lines = render([p], width=80)
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    text = " ".join(line.strip() for line in lines)
    assert "bottleneck: consumer 2 (pid 4194302): the producer waits for its slots 80%, " \
           "the others wait 75%" in text, text
    assert "loading CPU saved so far: 244444.4 s (loader 122222.2 s for 1234567 batches, " \
           "delivered 3703701 times; publishing cost 1234.5 s)" in text, text


def test_a_segment_of_an_older_layout_is_unreadable(name):
    """A segment of another ring layout (an older tensorsocket: no delivery counters) is
    shown as unreadable with the layouts named, never read with this build's offsets."""
    from tensorsocket import _core

    segment = f"tensorsocket-{os.getuid()}-{name}-{os.getpid()}"
    ring = _core.Ring.create("/" + segment, 2, 4096, 1)
    try:
        with open(f"/dev/shm/{segment}", "r+b") as f:  # layout_version follows the magic
            f.seek(8)
            f.write((_core.LAYOUT_VERSION - 1).to_bytes(4, "little"))
        (p,) = survey(0, name)
        assert p.state == "unreadable" and p.batches_delivered is None
        assert f"has ring layout {_core.LAYOUT_VERSION - 1}, this build reads layout " \
               f"{_core.LAYOUT_VERSION}" in p.error, p.error
    finally:
        ring.close()
        _core.Ring.unlink_name("/" + segment)
