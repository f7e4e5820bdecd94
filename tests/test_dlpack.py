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


def test_numpy_arrays_are_read_only(ring_pair):
    _, cons = ring_pair
    v = cons.acquire(1).views()[1]
    arr = np.from_dlpack(v)
    assert arr.tolist() == list(range(6)) and not arr.flags.writeable
    with pytest.raises(ValueError):
        arr[0] = 1


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


def test_consumer_mapping_is_read_only(ring_pair):
    """The consumer's mapping of slot data cannot be written (it is shared)."""
    _, cons = ring_pair
    info = cons.info()
    maps = open(f"/proc/{os.getpid()}/maps").read().splitlines()
    start = info["data_address"]
    line = next(m for m in maps if int(m.split("-")[0], 16) == start)
    assert line.split()[1].startswith("r-"), line
