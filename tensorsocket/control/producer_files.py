"""What a producer owns outside its process: the lock of its name, and the files it
removes as it ends (its ring segment, the name's secret, socket and lock files), at
close() or, in a plain script, on SIGTERM; and the segments of earlier producers of its
name that died without removing theirs.

The name lock is an exclusive flock on ``<runtime dir>/<name>.lock`` that a producer
holds for its whole life (the kernel drops it if the process dies): it is what makes a
producer live for share(), ``tensorsocket status`` and ``tensorsocket clean``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import threading
import time
from typing import Any, Callable

from ..ring import Ring
from . import auth
from .endpoints import Endpoint, file_is_at, open_lock_file
from ..errors import TensorSocketError
from ..data.segments import stale_segments

log = logging.getLogger("tensorsocket")

NAME_LOCK_TRIES = 5  # flock attempts 20 ms apart before "already running"


class OwnedFiles:
    """What a producer removes as it ends: its ring segment (once it created one), and the
    secret, socket and lock files of its name, which are its own while it holds the name
    lock."""

    def __init__(self, endpoint: Endpoint) -> None:
        """Set up; see the class docstring."""
        self.pid = os.getpid()  # a forked child (a loader worker) owns none of them
        self.segment: str | None = None
        self.paths = [p for p in (auth.secret_path(endpoint), endpoint.lock_path,
                                  endpoint.socket_path) if p is not None]
        self.held = True  # the name lock is still ours
        # Called with the signal's number as SIGTERM ends the process, before the files go
        # (the producer's lifecycle writes why in the ring's header for its consumers).
        self.on_signal: Callable[[int], None] | None = None

    def remove(self) -> None:
        """Unlink the segment, the secret, socket and lock files (missing ones are fine)."""
        if os.getpid() != self.pid or not self.held:
            return
        if self.segment is not None:
            Ring.unlink_name(self.segment)
        for path in self.paths:
            path.unlink(missing_ok=True)


# The files of this process's live producers, removed by SIGTERM (see on_sigterm).
_LIVE: dict[int, OwnedFiles] = {}


def remove_on_sigterm(files: OwnedFiles) -> None:
    """Have SIGTERM remove these files, then end the process as its default action does.
    The handler is installed only by the main thread, and only over the default action: a
    handler the program installed (share()'s producer process has one, a training framework
    may) is left in place and SIGTERM does what it says; a handler that raises SystemExit
    still has the producer torn down as the interpreter exits."""
    _LIVE[id(files)] = files
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, on_sigterm)
    except (ValueError, OSError):  # an interpreter without signals here: nothing to do
        pass


def forget_on_sigterm(files: OwnedFiles) -> None:
    """The producer has removed its files and is about to drop its name lock; with the
    last producer gone, the default SIGTERM action comes back (from the main thread)."""
    files.held = False
    _LIVE.pop(id(files), None)
    if _LIVE or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError, TypeError):  # at interpreter exit, say
        pass


def on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM: tell the consumers of this process's producers why in their rings'
    headers (OwnedFiles.on_signal), remove their files (not one of their forked
    children's), then die of the signal, with the status the default action gives."""
    for files in list(_LIVE.values()):
        try:
            if files.on_signal is not None and os.getpid() == files.pid:
                files.on_signal(signum)
        except Exception:  # the signal must still end the process
            pass
        try:
            files.remove()
        except Exception:  # the signal must still end the process
            pass
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def take_name_lock(endpoint: Endpoint) -> int:
    """flock the name's lock file; the kernel drops it if we die. A lock taken on a file
    that its holder removed meanwhile (a producer that ends, or fails to bind, unlinks it
    while it still holds it) is no lock of the name: the file now at the path is opened
    and locked instead, or two producers would both hold "the" name."""
    for attempt in range(NAME_LOCK_TRIES):
        fd = open_lock_file(endpoint.lock_path)
        try:
            # `tensorsocket status/clean` and share() probe the lock with a shared flock
            # that lasts an instant; only a holder that stays is a producer.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if attempt < NAME_LOCK_TRIES - 1:
                os.close(fd)
                time.sleep(0.02)
                continue
            try:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            finally:
                os.close(fd)
            raise TensorSocketError(
                f"a producer named {endpoint.name!r} is already running (pid {owner}); "
                "give this one another name= or port="
            ) from None
        if file_is_at(fd, endpoint.lock_path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            return fd
        os.close(fd)  # (removed under us: the next try opens the file there now)
    raise TensorSocketError(
        f"the lock file {endpoint.lock_path} of the name {endpoint.name!r} was removed "
        f"{NAME_LOCK_TRIES} times as this producer locked it: another process removes it "
        "(tensorsocket clean, or producers of the name starting and failing); try again")


def sweep_stale_segments(name: str) -> None:
    """Remove segments of earlier producers of this name whose process is gone. Holding
    the name lock is not enough to know that: a producer of the same name under another
    runtime directory holds another lock, and its live segment must stay."""
    for item in stale_segments(name):
        log.info("removing stale segment %s (%s)", item.path, item.reason)
        Ring.unlink_name("/" + item.path.rsplit("/", 1)[-1])
