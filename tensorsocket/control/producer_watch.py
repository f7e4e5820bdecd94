"""While a consumer waits for its producer's first answer: tell a producer that
registered its name and then died (killed, crashed) from one not started yet.

A producer holds an exclusive flock on ``<runtime dir>/<name>.lock`` for its whole
life and writes its pid into the file. A clean end removes the file (and answers the
consumers that wait with the reason, over the control socket); a producer that is
killed, or crashes in C, leaves it behind, unlocked, naming a dead pid.

A dead producer's lock file can be a leftover of an earlier run, and the user may be
about to start the next producer of the name: waiting for it is right then. So the
watch reports a dead producer at once only when that producer belongs to this wait:
the consumer saw it alive while it waited, or it took the name after this process
started (and within the consumer's timeout). Otherwise the timeout's ProducerNotFound
names the dead producer (note()).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ..ring import process_alive, process_start_time
from .endpoints import Endpoint, lock_held
from ..errors import ProducerFailed, ProducerGone

CHECK_EVERY = 0.25  # seconds between looks at the lock file


@dataclass(frozen=True)
class _Holder:
    """What the lock file says: the pid it names, whether that process lives, and how
    long ago the file was written (seconds)."""

    pid: int
    alive: bool
    age: float


class ProducerWatch:
    """Looks at the name's lock file while a consumer waits for its welcome."""

    def __init__(self, endpoint: Endpoint, timeout: float | None) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._seen: int | None = None  # pid of a live producer seen during this wait
        self._next = 0.0

    def check(self) -> None:
        """Raise if the producer of the name died during this wait (see the module
        docstring); cheap when called often (it looks every CHECK_EVERY seconds)."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + CHECK_EVERY
        holder = self._holder()
        if holder is not None and holder.alive:
            self._seen = holder.pid
            return
        where = f"{self.endpoint.name!r} at {self.endpoint.address}"
        again = "start it again, then create the TensorConsumer again"
        if holder is not None and (holder.pid == self._seen or self._recent(holder.age)):
            raise ProducerFailed(
                f"the producer {where} (pid {holder.pid}) died before publishing its first "
                "batch, without closing: it was killed by a signal it cannot catch "
                "(SIGKILL: kill -9, or the kernel's out-of-memory killer, which the kernel "
                f"log names) or it crashed; its own output says which. {again}")
        if holder is None and self._seen is not None and not _alive(self._seen):
            # It removed its lock file: it closed, yet this consumer had no answer.
            raise ProducerGone(
                f"the producer {where} (pid {self._seen}) exited before publishing its first "
                f"batch; its own output says why. {again}")

    def note(self) -> str:
        """For ProducerNotFound: a sentence on a dead producer that left its lock file
        (an earlier run, killed or crashed), else ''."""
        holder = self._holder()
        if holder is None or holder.alive:
            return ""
        return (f" A producer of the name {self.endpoint.name!r} (pid {holder.pid}) took "
                f"it {holder.age:.0f} s ago and is no longer running: it was killed or "
                "crashed, and this consumer waited for a new one.")

    def _holder(self) -> _Holder | None:
        """The lock file's producer, or None (no file, no pid in it yet, or its holder
        not known dead while a new producer is taking the name)."""
        path = self.endpoint.lock_path
        try:
            with open(path, "rb") as f:
                text = f.read(32)
                written = os.fstat(f.fileno()).st_mtime
        except OSError:
            return None
        try:
            pid = int(text.decode("ascii", "replace").strip())
        except ValueError:
            return None
        if pid <= 0:
            return None
        alive = _alive(pid)
        if not alive and lock_held(path):
            return None  # a new producer holds the lock and is writing its pid
        return _Holder(pid, alive, max(0.0, time.time() - written))

    def _recent(self, age: float) -> bool:
        """Whether a lock file written `age` seconds ago is of this run: written after
        this process started, and within the consumer's timeout."""
        limit = _process_age()
        if self.timeout is not None:
            limit = min(limit, self.timeout)
        return age < limit


def _alive(pid: int) -> bool:
    """Whether process pid runs (a zombie does not). Where its start time cannot be read
    (this process out of fds: EMFILE), the kernel's kill(pid, 0) says: an error is no
    death."""
    start = process_start_time(pid)
    if start != 0:
        return process_alive(pid, start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _process_age() -> float:
    """Seconds since this process started."""
    started = process_start_time(os.getpid()) / os.sysconf("SC_CLK_TCK")
    return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
