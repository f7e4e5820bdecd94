"""The share() election: one lock file per producer name, and whether a producer of
that name is alive.

``<runtime dir>/<name>.share-lock`` is held while a share() caller checks for a live
producer, starts one if there is none, and attaches; the producer process that share()
started takes it too before it retires, so a caller never attaches to a producer on its
way out. A live producer holds an exclusive flock on ``<name>.lock`` for its whole life.
The election lock does not end in ``.lock``, so that it is never the name lock of another
producer (``x.share.lock`` would be that of a producer named ``x.share``).
"""

from __future__ import annotations

import fcntl
import os
import re
import time
from pathlib import Path

from ..control.endpoints import Endpoint, file_is_at, lock_held, open_lock_file

SHARE_LOCK_SUFFIX = ".share-lock"  # no producer's file ends so: it ends in .lock or .sock
LOG_SUFFIX = ".producer.log"  # <name>.producer.log: the output of share()'s producer
OLDER_PART_SUFFIX = ".1"  # a log's earlier part is its name with this after
OLDER_LOG_SUFFIX = LOG_SUFFIX + OLDER_PART_SUFFIX  # its earlier part (see ProducerLog)
STAGED_SUFFIX = ".new"  # either, being made while the log is rotated
FAILED_LOG_INFIX = ".failed-"  # <log>.failed-<UTC time>: what a failed producer left
FAILED_LOGS_KEPT = 3  # the logs of this many failed producers of a name stay (docs/usage.md)
_FAILED_LOG = re.compile(
    rf"(?P<name>.+){re.escape(LOG_SUFFIX + FAILED_LOG_INFIX)}"
    rf"(?P<time>\d{{8}}T\d{{6}}Z)(?:-(?P<nth>\d+))?(?:{re.escape(OLDER_PART_SUFFIX)})?")


def share_lock_file(rdir: Path, name: str) -> Path:
    """The election lock file of producer `name` in runtime directory `rdir`."""
    return rdir / f"{name}{SHARE_LOCK_SUFFIX}"


def share_lock_path(endpoint: Endpoint) -> Path:
    """The election lock file of a producer name."""
    return share_lock_file(endpoint.runtime_dir, endpoint.name)


def producer_log_path(endpoint: Endpoint) -> Path:
    """Where the producer that share() starts writes its output and log."""
    return endpoint.runtime_dir / f"{endpoint.name}{LOG_SUFFIX}"


def older_log_path(log_path: Path) -> Path:
    """Where the earlier part of a producer log goes: ``<name>.producer.log.1``."""
    return log_path.with_name(log_path.name[: -len(LOG_SUFFIX)] + OLDER_LOG_SUFFIX)


def failed_log_path(log_path: Path, when: float, nth: int = 1) -> Path:
    """Where the log of a failed producer of the name goes, ``<log>.failed-<time>``, named
    after `when` (its last write, UTC, to the second); the `nth` (2, 3...) log of that
    second gets ``-<nth>`` after it. Its older part goes beside it with ``.1`` after."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when))
    return log_path.with_name(f"{log_path.name}{FAILED_LOG_INFIX}{stamp}"
                              + (f"-{nth}" if nth > 1 else ""))


def failed_older_path(failed_log: Path) -> Path:
    """Where the older part of a failed producer's log goes: beside it, ``.1`` after."""
    return failed_log.with_name(failed_log.name + OLDER_PART_SUFFIX)


def failed_log_owner(file_name: str) -> tuple[str, tuple[str, int]] | None:
    """The producer name of a failed producer's log (or older part of it) `file_name`,
    and when it was written as a key that sorts oldest first; else None."""
    m = _FAILED_LOG.fullmatch(file_name)
    if m is None:
        return None
    return m["name"], (m["time"], int(m["nth"] or 1))


def log_owner(file_name: str) -> str | None:
    """The producer name whose log (or older part of it) `file_name` is, else None; a
    failed producer's log counts (see failed_log_owner)."""
    failed = failed_log_owner(file_name)
    if failed is not None:
        return failed[0]
    for suffix in (LOG_SUFFIX, OLDER_LOG_SUFFIX, LOG_SUFFIX + STAGED_SUFFIX,
                   OLDER_LOG_SUFFIX + STAGED_SUFFIX):
        if file_name.endswith(suffix) and len(file_name) > len(suffix):
            return file_name[: -len(suffix)]
    return None


def take_lock(path: Path, deadline: float | None) -> int | None:
    """flock `path` exclusively, waiting until `deadline` (None: forever); the fd, or
    None on timeout. The file may be unlinked by a holder (who then holds it no more
    once closed): a lock on a file that is no longer at `path` is dropped and taken
    again on the new one."""
    while True:
        fd = open_lock_file(path)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline is not None and time.monotonic() >= deadline:
                        os.close(fd)
                        return None
                    time.sleep(0.02)
            same = file_is_at(fd, path)
        except BaseException:
            os.close(fd)
            raise
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            return fd
        os.close(fd)


def release_lock(fd: int, path: Path) -> None:
    """Release a lock from take_lock(), removing its file while still holding it (waiters
    that opened it notice and take the lock on a new file), so none is left behind."""
    try:
        path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def lock_holder(path: Path) -> str:
    """The pid written in a lock file, or "?"."""
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


def producer_live(endpoint: Endpoint) -> bool:
    """True while some process holds the producer's name lock (it is alive)."""
    return lock_held(endpoint.lock_path)
