"""Bad input gets a clear error naming the problem and the knob, and loses nothing."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from tensorsocket import (
    BatchTooLarge,
    ProducerFinished,
    SharedMemoryTooSmall,
    TensorConsumer,
    TensorProducer,
)

from conftest import run as run_python


def test_unsupported_leaf_raises_in_producer_with_path(name):
    loader = [(torch.zeros(2), {"meta": object()})]
    with TensorProducer(loader, name=name, min_consumers=0) as p:
        with pytest.raises(TypeError, match=r"batch\[1\]\['meta'\]"):
            for _ in p:
                pass


@pytest.mark.parametrize("dtype", ["longdouble", "clongdouble"])
def test_a_leaf_dtype_torch_cannot_import_is_refused_by_the_producer(name, dtype):
    """numpy's longdouble (float128 here) was published, and every consumer then failed in
    torch ("Unsupported dtype in DLTensor"): the producer refuses it, naming the leaf."""
    import numpy as np
    leaf = np.zeros(3, dtype=getattr(np, dtype))
    if leaf.dtype in (np.float64, np.complex128):
        pytest.skip(f"{dtype} is {leaf.dtype} on this platform: torch carries it")
    loader = [{"x": torch.zeros(2), "stat": leaf}]
    with TensorProducer(loader, name=name, min_consumers=0) as p:
        with pytest.raises(TypeError, match=rf"batch\['stat'\].*{leaf.dtype}.*astype"):
            for _ in p:
                pass
        assert p.stats()["batches"] == 0


def test_batch_bigger_than_slot_is_refused_and_loses_nothing(name):
    loader = [torch.zeros(1000), torch.zeros(10), torch.zeros(100_000)]
    got = []
    p = TensorProducer(loader, name=name, min_consumers=1, start_timeout=30)

    def consume():
        with TensorConsumer(name=name, timeout=10) as c:
            try:
                for b in c:
                    got.append(b.numel())
            except Exception as e:  # the producer closes after its error
                got.append(type(e).__name__)

    t = threading.Thread(target=consume)
    t.start()
    try:
        with pytest.raises(BatchTooLarge, match="slot_bytes=") as ei:
            for _ in p:
                pass
        assert "Nothing was published" in str(ei.value)
        assert p.ring.info()["published"] == 2
    finally:
        p.close()
        t.join(10)
    assert got[:2] == [1000, 10]


def test_explicit_slot_bytes_carries_large_batches(name):
    loader = [torch.zeros(10), torch.ones(100_000)]
    p = TensorProducer(loader, name=name, min_consumers=0, slot_bytes=1 << 20)
    for _ in p:
        pass
    assert p.stats()["batches"] == 2
    p.close()


def test_shm_too_small_fails_early_naming_the_knobs(name):
    huge = 1 << 40  # more than /dev/shm holds on any test machine
    p = TensorProducer([torch.zeros(4)], name=name, min_consumers=0, slot_bytes=huge)
    with pytest.raises(SharedMemoryTooSmall) as ei:
        for _ in p:
            pass
    msg = str(ei.value)
    assert "/dev/shm" in msg and "ring_slots=" in msg and "slot_bytes=" in msg
    p.close()


def test_argument_errors():
    with pytest.raises(ValueError, match="ring_slots"):
        TensorProducer([], ring_slots=1)
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="batch_size"):
            TensorConsumer(batch_size=bad)
    with pytest.raises(ValueError, match="lag_policy"):
        TensorProducer([], lag_policy="drop")
    with pytest.raises(ValueError, match="max_lag=3 must exceed the late-joiner window of 5"):
        TensorProducer([], rubber_band=5, max_lag=3)
    with pytest.raises(ValueError, match="ring_slots=4 cannot keep a late-joiner window of 4"):
        TensorProducer([], rubber_band=4, ring_slots=4)
    with pytest.raises(ValueError, match=r"max_lag=6 needs ring_slots >= max_lag \+ 2"):
        TensorProducer([], max_lag=6, ring_slots=7)
    with pytest.raises(ValueError, match=r"max_lag=5000 is not valid: .*1\.\.4094"):
        TensorProducer([], max_lag=5000)
    with pytest.raises(ValueError, match="rubber_band_pct"):
        TensorProducer([], rubber_band_pct=1.5)


def test_a_name_ending_in_a_newline_is_refused(name):
    """The name check matches the whole name: "x\\n" made files named "x\\n.lock" and
    "x\\n.sock" (a regex's $ matches before a final newline)."""
    from tensorsocket.validation import check_name

    for bad in (f"{name}\n", f"{name}\n\n", "\n", f"{name}\nx"):
        with pytest.raises(ValueError, match="invalid producer name"):
            check_name(bad)
        with pytest.raises(ValueError, match="invalid producer name"):
            TensorProducer([torch.zeros(2)], name=bad, min_consumers=0)
        with pytest.raises(ValueError, match="invalid producer name"):
            TensorConsumer(name=bad, timeout=1)
    assert check_name(name) == name


@pytest.mark.parametrize("target_exists", [True, False])
def test_a_symlink_at_the_lock_path_is_not_followed(name, tmp_path, target_exists):
    """A symbolic link planted where a producer's name lock or share()'s election lock
    goes is refused, naming the file and the fix; the file it points to is neither
    written nor created."""
    from tensorsocket.sharing.election import share_lock_path, take_lock
    from tensorsocket.control.endpoints import resolve, runtime_dir

    target = tmp_path / "precious"
    if target_exists:
        target.write_text("keep me")
    endpoint = resolve(name)
    for link in (runtime_dir() / f"{name}.lock", share_lock_path(endpoint)):
        link.symlink_to(target)
        try:
            with pytest.raises(PermissionError, match=rf"{link} is a symbolic link.*rm {link}"):
                if link == endpoint.lock_path:
                    TensorProducer([torch.zeros(2)], name=name, min_consumers=0)
                else:
                    take_lock(link, None)
            assert link.is_symlink()
            assert target.read_text() == "keep me" if target_exists else not target.exists()
        finally:
            link.unlink()


def test_close_from_another_thread_interrupts_a_waiting_call(name):
    """close() while another thread waits in the ring: that call raises, nothing crashes."""
    loader = [torch.zeros(4)] * 3
    p = TensorProducer(loader, name=name, min_consumers=2, start_timeout=30)
    raised: list = []

    def drain_in_thread(iterable) -> threading.Thread:
        def run():
            try:
                for _ in iterable:
                    pass
            except Exception as e:
                raised.append(e)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    t = drain_in_thread(p)
    c = TensorConsumer(name=name, timeout=10)  # one of two: the producer keeps waiting
    t2 = drain_in_thread(c)
    _wait_until_in_call(t, "ring.wait_consumers(want, s.start_timeout)")
    _wait_until_in_call(t2, "return place.ring.acquire(timeout, box)")
    c.close()
    p.close()
    t.join(10)
    t2.join(10)
    assert not t.is_alive() and not t2.is_alive()
    assert len(raised) == 2
    assert all("closed by another thread" in str(e) for e in raised), raised


def _wait_until_in_call(thread: threading.Thread, call: str, timeout: float = 30) -> None:
    """Until `thread` waits in the C call made by the source line that contains `call`
    (its innermost Python frame is at that line: the call has not returned)."""
    import linecache
    import sys

    deadline = time.monotonic() + timeout
    while True:
        frame = sys._current_frames().get(thread.ident)
        if frame is not None and call in linecache.getline(frame.f_code.co_filename,
                                                            frame.f_lineno):
            return
        assert time.monotonic() < deadline, f"the thread never reached {call}"
        time.sleep(0.01)


def test_segment_of_another_user_or_open_to_others_is_refused(name):
    """A consumer maps only a segment owned by its own user and closed to others (0600)."""
    from tensorsocket import _core

    p = TensorProducer([torch.zeros(4)], name=name, min_consumers=0)
    try:
        for _ in p:
            pass
        seg = p.ring.info()["name"]
        path = "/dev/shm" + seg
        assert os.stat(path).st_mode & 0o777 == 0o600
        os.chmod(path, 0o644)
        with pytest.raises(PermissionError, match="mode 644 \\(must be 600\\)"):
            _core.Ring.open(seg)
        os.chmod(path, 0o600)
        if os.geteuid() == 0:  # only root can give a file away
            os.chown(path, 4242, -1)
            with pytest.raises(PermissionError, match="owner uid 4242"):
                _core.Ring.open(seg)
            os.chown(path, 0, -1)
        _core.Ring.open(seg).close()  # its own, 0600: fine
    finally:
        p.close()


def test_segment_still_being_created_reads_as_not_there_yet(name):
    """Between shm_open and the header's magic, a watcher sees "not there yet" (it retries),
    not "not a ring"; bytes that are not a ring are still refused as such; `clean` leaves a
    live process's half-created segment alone."""
    from tensorsocket import VersionMismatch, _core
    from tensorsocket.cli.clean import stale_segments
    from tensorsocket.control.endpoints import segment_prefix

    seg = f"{segment_prefix(name)}{os.getpid()}"
    path = f"/dev/shm/{seg}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        with pytest.raises(FileNotFoundError, match="still being created"):
            _core.Ring.open("/" + seg)  # created, not sized yet
        os.ftruncate(fd, 1 << 20)
        with pytest.raises(FileNotFoundError, match="still being created"):
            _core.Ring.open("/" + seg)  # sized, header not written yet
        assert [s for s in stale_segments(name)] == []  # this process is alive
        os.pwrite(fd, b"\x7fELF garbage", 0)
        with pytest.raises(VersionMismatch, match="is not a tensorsocket ring"):
            _core.Ring.open("/" + seg)
    finally:
        os.close(fd)
        os.unlink(path)


IN_PLACE = r"""
import sys
from tensorsocket import TensorConsumer
c = TensorConsumer(name=sys.argv[1], timeout=30)
x, y = next(iter(c))
print("received", flush=True)
before = x.clone()
x.div_(255)
x += 1
y[0] = -5
print("written", flush=True)
assert (x == before / 255 + 1).all() and int(y[0]) == -5, (x, y)
print("changed", flush=True)
"""


@pytest.mark.filterwarnings("ignore:the producer finished in the middle")  # a late joiner
@pytest.mark.parametrize("faulthandler", [False, True])
def test_in_place_write_to_a_batch_is_private(procs, name, faulthandler):
    """An in-place op on a batch tensor works, like on a DataLoader's batch: the written
    pages become private to the process (copy on write), with or without Python's
    faulthandler installed first. The other consumers lose nothing and see no change."""
    import sys

    p = procs.start("producer", "--name", name, "--kind", "tuple", "--batches", "6")
    procs.wait_ready(p)
    flags = ["-X", "faulthandler"] if faulthandler else []
    r = run_python([sys.executable, *flags, "-c", IN_PLACE, name], capture_output=True,
                   text=True, timeout=60)
    assert r.stdout.split() == ["received", "written", "changed"], r.stderr
    assert r.returncode == 0, r.stderr
    assert "tensorsocket:" not in r.stderr, r.stderr
    # The batch is intact for the next consumer, which reads the whole epoch.
    with TensorConsumer(name=name, timeout=30, align_epochs=False) as c:
        values = [(int(x[0, 0]), bool((x == x[0, 0]).all()), int(y[0])) for x, y in c]
    assert values[-1][0] == 5 and all(v == (i + (6 - len(values)), True, i + (6 - len(values)))
                                      for i, v in enumerate(values))
    procs.result(p)


RELEASED = r"""
import ctypes, gc, sys
from tensorsocket import TensorConsumer
c = TensorConsumer(name=sys.argv[1], timeout=30)
x, y = next(iter(c))
print("received", flush=True)
ptr = x.data_ptr()
del x, y
gc.collect()
ctypes.memset(ptr, 0, 4)
print("written", flush=True)
"""


@pytest.mark.filterwarnings("ignore:the producer finished in the middle")  # a late joiner
@pytest.mark.parametrize("faulthandler", [False, True])
def test_write_into_a_released_batch_names_the_cause(procs, name, faulthandler):
    """A write into the memory of a batch the process no longer holds (a raw pointer kept
    past its tensors) is not made private: it stops the process with SIGSEGV, with one line
    on stderr saying why; Python's faulthandler, when on, still prints its traceback after
    it. The other consumers lose nothing."""
    import signal
    import sys

    # The producer still runs when the second consumer comes: with 3 slots it cannot
    # publish the epoch's 6 batches for the first consumer, which reads one and dies, and
    # with none attached it waits for the next before its next batch (however slow the
    # machine is).
    p = procs.start("producer", "--name", name, "--kind", "tuple", "--batches", "6",
                    "--delay", "0.5", "--slots", "3")
    procs.wait_ready(p)
    flags = ["-X", "faulthandler"] if faulthandler else []
    r = run_python([sys.executable, *flags, "-c", RELEASED, name], capture_output=True,
                   text=True, timeout=60)
    assert r.stdout.split() == ["received"]
    if os.environ.get("TENSORSOCKET_SANITIZE") != "1":  # ASan reports the fault its own way
        assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stderr)
    else:
        assert r.returncode != 0
    assert "tensorsocket: this process wrote into a batch tensor" in r.stderr, r.stderr
    assert "no longer holds" in r.stderr and "TensorConsumer(copy=True)" in r.stderr
    if faulthandler:
        assert r.stderr.index("tensorsocket: this process") < r.stderr.index("Fatal Python")
        assert "line 10 in <module>" in r.stderr
    # The batch is intact for the next consumer, which reads the whole epoch.
    with TensorConsumer(name=name, timeout=30, align_epochs=False) as c:
        values = [int(x[0, 0]) for x, _ in c]
    assert values[-1] == 5 and all(v == i + (6 - len(values)) for i, v in enumerate(values))
    procs.result(p)


ONE_EPOCH_PRODUCER = r"""
import sys, torch
from tensorsocket import TensorProducer
from tools.harness import emit

batches = [(torch.full((4, 8), float(i)), torch.full((4,), i)) for i in range(4)]
p = TensorProducer(batches, name=sys.argv[1], min_consumers=1, start_timeout=60)
emit({"ready": True})
for _ in p:
    pass
p.join(timeout=0.5)  # its consumer stays attached: finish without waiting for it
p.close()
emit({"closed": True})
"""


def test_a_place_lost_to_a_finished_producer_says_it_finished(procs, name):
    """A consumer parked between epochs with its place kept asks the producer for it again
    (unpark) at its next batch. A producer that finished and closed meanwhile sends no
    answer: the consumer says the producer finished, not that it stopped answering
    (ProducerNotFound, after 10 s), as an attach after the end does."""
    from tensorsocket import ProducerNotFound

    p = procs.script(ONE_EPOCH_PRODUCER, name)
    procs.wait_ready(p)
    with TensorConsumer(name=name, timeout=30) as c:
        assert len(list(c)) == 4
        procs.result(p)  # it finished and closed its control socket
        place = c._place
        place.attached, place.held_place = False, True  # as park(hold=True) leaves it

        def lost_reply() -> bool:
            raise ProducerNotFound("the producer stopped answering")

        place.client.unpark = lost_reply
        with pytest.raises(ProducerFinished):
            next(iter(c))
