"""ProcessWatch (the core's liveness of a process by pidfd, ts_py_watch.c): the producer's
look at each consumer's process and a consumer's at its producer (Ring.producer_alive) go
through a pidfd taken once, not /proc. Real child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tensorsocket.ring import ProcessWatch, process_start_time


def _fds() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def test_a_watch_sees_its_process_end_and_not_another_with_its_pid():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = process_start_time(child.pid)
        watch = ProcessWatch.of(child.pid, start)
        assert watch.pidfd and watch.pid == child.pid and watch.alive()
        # The same pid with another start time is another process: never alive.
        assert not ProcessWatch.of(child.pid, start + 1).alive()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
        assert not watch.alive()
        watch.close()
        watch.close()  # (again: nothing)
        with pytest.raises(ValueError, match="closed"):
            watch.alive()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)


def test_watches_give_their_pidfds_back():
    """Each watch's fd is its own: closed when it goes, close() called or not."""
    me, start = os.getpid(), process_start_time(os.getpid())
    before = _fds()
    watches = [ProcessWatch.of(me, start) for _ in range(200)]
    assert all(w.alive() and w.pidfd for w in watches)
    assert _fds() == before + 200
    for w in watches[:100]:
        w.close()
    del watches
    assert _fds() == before
