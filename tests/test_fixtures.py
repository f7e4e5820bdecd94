"""The test fixtures themselves: the `procs` teardown leaves no ring of a producer it
killed, whatever the order of the kills, and the `name` fixture's leak check still sees
a segment that a producer which ended by itself left behind."""

from __future__ import annotations

import os
import signal
import time

from conftest import shm_segments
from tensorsocket import _core
from tensorsocket.control.endpoints import resolve


def _wait_for_delivery(name: str, producer_pid: int, consumer_pid: int) -> None:
    """Until the consumer process took a batch from the producer's ring."""
    segment = resolve(name, None, None).segment_name(producer_pid)
    deadline = time.monotonic() + 60
    ring = None
    while ring is None:
        try:
            ring = _core.Ring.open(segment)
        except FileNotFoundError:
            assert time.monotonic() < deadline, "no ring"
            time.sleep(0.02)
    try:
        while not any(c["pid"] == consumer_pid and c["delivered"] >= 1
                      for c in ring.consumers()):
            assert time.monotonic() < deadline, "the consumer took nothing"
            time.sleep(0.02)
    finally:
        ring.close()


def test_teardown_removes_the_ring_of_a_producer_it_kills(procs, name):
    """The consumer cannot notice the producer's death (it is stopped), as when it is
    killed right after the producer: the teardown removes the ring all the same."""
    prod = procs.start("producer", "--name", name, "--batches", "50", "--delay", "3600")
    pid = procs.wait_ready(prod)["pid"]
    cons = procs.start("consumer", "--name", name)
    _wait_for_delivery(name, pid, cons.pid)
    os.kill(cons.pid, signal.SIGSTOP)
    procs.kill_all()  # as the teardown does (it does again, with nothing left to do)
    assert shm_segments(name) == []


def test_teardown_leaves_the_segment_of_a_producer_that_ended_by_itself(procs, name):
    """A segment named for a process that exited by itself is no business of the
    teardown: the `name` fixture is to find it (here the test removes it itself)."""
    done = procs.script("pass")
    done.wait(60)
    leak = f"/dev/shm/{resolve(name, None, None).segment_name(done.pid)[1:]}"
    fd = os.open(leak, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    try:
        procs.kill_all()
        assert os.path.exists(leak)
    finally:
        os.unlink(leak)


def test_procs_runs_scripts(procs):
    p = procs.script("import sys; print(sys.argv[1:])", "a", "b")
    assert p.communicate(timeout=60)[0].strip() == "['a', 'b']"
