"""DLPack export of slot views: capsule kinds, protocol arguments, slot release.

Producer and consumer handles of one ring live in this process here: what is
tested is the export protocol, not the processes (test_endtoend does those).
"""

from __future__ import annotations

import gc
import os
import threading
import uuid

import numpy as np
import pytest
import torch

from tensorsocket import _core


@pytest.fixture
def ring_pair():
    """(producer ring, consumer ring) with one batch of two tensors published."""
    seg = f"/tensorsocket-{os.getuid()}-dl{uuid.uuid4().hex[:8]}-{os.getpid()}"
    prod = _core.Ring.create(seg, 4, 1 << 16, 8)
    try:
        index, token = prod.reserve(os.getpid(), _core.process_start_time(os.getpid()))
        cons = _core.Ring.open(seg)
        cons.bind(index, token)
        prod.activate(index)
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        b = np.arange(6, dtype=np.int16)
        prod.publish([(a, (2, 32, 1)), (b, (0, 16, 1))], b"m")
        yield prod, cons
        cons.close()
    finally:
        prod.close()
        _core.Ring.unlink_name(seg)


def test_versioned_and_legacy_capsules(ring_pair):
    prod, cons = ring_pair
    slot = cons.acquire(1)
    v = slot.views()[0]
    assert v.__dlpack_device__() == (1, 0)
    legacy = v.__dlpack__()
    versioned = v.__dlpack__(max_version=(1, 0))
    assert "dltensor" in repr(legacy) and "versioned" not in repr(legacy)
    assert "dltensor_versioned" in repr(versioned)
    t1, t2 = torch.from_dlpack(legacy), torch.from_dlpack(versioned)
    assert torch.equal(t1, torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert t1.data_ptr() == t2.data_ptr() == v.data_ptr
    assert v.shape == (3, 4) and v.dtype == (2, 32, 1) and v.nbytes == 48


def test_protocol_arguments(ring_pair):
    _, cons = ring_pair
    v = cons.acquire(1).views()[1]
    v.__dlpack__(stream=None)
    v.__dlpack__(stream=-1)
    with pytest.raises(BufferError, match="stream"):
        v.__dlpack__(stream=5)
    v.__dlpack__(dl_device=(1, 0))
    with pytest.raises(BufferError, match="device"):
        v.__dlpack__(dl_device=(2, 0))
    with pytest.raises(TypeError):
        v.__dlpack__(1)  # keyword-only


def test_numpy_arrays_are_writable(ring_pair):
    """Versioned exports carry no read-only flag: a write makes the slot private to this
    process (copy on write), so numpy arrays are writable like torch tensors."""
    _, cons = ring_pair
    v = cons.acquire(1).views()[1]
    arr = np.from_dlpack(v)
    assert arr.tolist() == list(range(6)) and arr.flags.writeable
    arr[0] = 100
    assert arr.tolist() == [100, *range(1, 6)]


def test_copy_true_gives_private_memory(ring_pair):
    prod, cons = ring_pair
    slot = cons.acquire(1)
    v = slot.views()[0]
    t = torch.from_dlpack(v.__dlpack__(max_version=(1, 0), copy=True))
    slot.release()
    del v
    assert prod.slot_readers()[0] == 0, "a copy does not hold the slot"
    t += 1  # writable
    assert t[0, 0].item() == 1.0


def test_tensor_holds_slot_until_freed_even_on_another_thread(ring_pair):
    prod, cons = ring_pair
    slot = cons.acquire(1)
    me = 1 << cons.info()["consumer"]
    tensors = [torch.from_dlpack(c) for c in slot.capsules(versioned=True)]
    slot.release()
    assert prod.slot_readers()[0] == me
    view = tensors[0][1:]
    del tensors
    gc.collect()
    assert prod.slot_readers()[0] == me, "a slice keeps the slot"
    box = [view]
    del view
    t = threading.Thread(target=box.clear)  # the deleter runs on this other thread
    t.start()
    t.join()
    assert prod.slot_readers()[0] == 0


def test_unconsumed_capsule_releases_on_destruction(ring_pair):
    prod, cons = ring_pair
    slot = cons.acquire(1)
    caps = slot.capsules()
    slot.release()
    assert prod.slot_readers()[0] != 0
    del caps
    assert prod.slot_readers()[0] == 0


def test_views_outlive_ring_close(ring_pair):
    """Closing the consumer handle keeps the mapping while a tensor lives."""
    prod, cons = ring_pair
    slot = cons.acquire(1)
    t = torch.from_dlpack(slot.views()[0])
    slot.release()
    cons.close()
    assert t.sum().item() == sum(range(12))
    del t
    assert prod.slot_readers()[0] == 0


def _mapping_at(address: int) -> str:
    """The permissions of this process's mapping that holds address (e.g. 'r--s')."""
    for line in open(f"/proc/{os.getpid()}/maps").read().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= address < hi:
            return line.split()[1]
    raise AssertionError(f"nothing is mapped at {address:#x}")


def test_consumer_mapping_is_read_only(ring_pair):
    """The consumer's mapping of slot data is shared and cannot be written: a write goes to
    a private copy of the slot (see test_write_is_private_until_release)."""
    _, cons = ring_pair
    assert _mapping_at(cons.info()["data_address"]) == "r--s"


def test_write_is_private_until_release():
    """A write into a held batch maps its slot private and writable (copy on write): the
    producer and another consumer still read the published bytes. Its release maps the
    shared, read-only view back, and the next batch in that slot reads as published."""
    seg = f"/tensorsocket-{os.getuid()}-dl{uuid.uuid4().hex[:8]}-{os.getpid()}"
    prod = _core.Ring.create(seg, 2, 1 << 16, 8)
    try:
        pid, start = os.getpid(), _core.process_start_time(os.getpid())
        cons = []
        for _ in range(2):
            index, token = prod.reserve(pid, start)
            ring = _core.Ring.open(seg)
            ring.bind(index, token)
            prod.activate(index)
            cons.append(ring)
        writer, reader = cons
        assert writer.info()["host_writable"] == 1 and prod.info()["host_writable"] == 1
        for v in range(3):  # entry 2 lands in slot 0 again
            prod.publish([(np.full((2, 1024), v, dtype=np.float32), (2, 32, 1))], b"m")
            w, r = writer.acquire(1), reader.acquire(1)
            t = torch.from_dlpack(w.capsules(versioned=True)[0])
            base = writer.info()["data_address"] + w.slot * writer.info()["slot_bytes"]
            assert torch.equal(t, torch.full((2, 1024), float(v)))  # as published
            assert _mapping_at(base) == "r--s"
            t.mul_(2)
            t[0] = -1
            assert t[0].eq(-1).all() and t[1].eq(2 * v).all()
            assert writer.info()["private_slots"] == 1 and _mapping_at(base) == "rw-p"
            other = torch.from_dlpack(r.views()[0])
            assert torch.equal(other, torch.full((2, 1024), float(v)))  # untouched
            del t, other
            w.release()
            r.release()
            assert writer.info()["private_slots"] == 0 and _mapping_at(base) == "r--s"
        for ring in cons:
            ring.close()
    finally:
        prod.close()
        _core.Ring.unlink_name(seg)
