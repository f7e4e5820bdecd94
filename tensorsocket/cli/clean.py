"""Find and remove what dead producers left behind: ring segments, sockets, locks, logs;
and the stores of decoded samples of jobs that were all killed.

A producer removes its segment, socket and lock file when it stops; one that
was killed (SIGKILL, OOM killer, a crashed node agent) cannot. Its segment is
removed by its last consumer, or by the next producer of the same name, but a
name that is never used again keeps its files. ``leftovers()`` finds them
without touching anything live:

- a segment is stale when the producer recorded in its header (pid and start
  time, so a reused pid does not count) is gone; a segment whose header cannot
  be read counts as stale only if the pid in its name is gone;
- a socket or lock file is stale when nobody holds the name's lock (a live
  producer keeps an exclusive flock on ``<name>.lock`` for its whole life);
- the log of a producer that share() started (``<name>.producer.log`` and its older
  part ``.1``; a producer that ends cleanly removes its own, one that failed or was
  killed leaves it for the user) is stale when nobody holds the name's lock nor its
  share() election lock (held while a producer of the name starts, before it takes
  the name's lock, and while one ends). The next producer of the name moves such a log
  to a failed log's names (``<name>.producer.log.failed-<time>`` and ``.1`` after it),
  which no producer writes: those are always stale. A log is removed while holding
  the name's election lock, so no producer of the name can start (and move or prune
  logs) meanwhile. Only regular files of this user count: a link or anything else
  under such a name is not ours to remove.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from ..ring import Ring
from ..sharing.election import (SHARE_LOCK_SUFFIX, failed_log_owner, log_owner, release_lock,
                        share_lock_file, take_lock)
from ..control.endpoints import lock_held, runtime_dir
from ..data.segments import SHM_DIR, Leftover, stale_segments
from ..errors import TensorSocketError
from ..store.segment import segment_name
from ..store.survey import remove_unused, unused_stores

LOG_REASON = "no producer of this name runs"
FAILED_LOG_REASON = "a failed producer's log"


def _stale_files(rdir: Path) -> list[Leftover]:
    """Sockets and lock files of names no live producer holds."""
    out: list[Leftover] = []
    try:
        entries = sorted(rdir.iterdir())
    except OSError:
        return out
    names = {p.name[: -len(".lock")] for p in entries if p.name.endswith(".lock")}
    names |= {p.name[: -len(".sock")] for p in entries if p.name.endswith(".sock")}
    for name in sorted(names):
        lock, sock = _name_lock(rdir, name), rdir / f"{name}.sock"
        if lock.exists() and lock_held(lock):
            continue  # a live producer holds the name
        if sock.exists():
            out.append(Leftover("socket", name, str(sock), "no producer holds the name"))
        if lock.exists():
            out.append(Leftover("lock", name, str(lock), "no producer holds it"))
    for share_lock in (p for p in entries if p.name.endswith(SHARE_LOCK_SUFFIX)):
        name = share_lock.name[: -len(SHARE_LOCK_SUFFIX)]
        if not lock_held(share_lock) and not _name_lock(rdir, name).exists():
            out.append(Leftover("lock", name, str(share_lock), "no share() election holds it"))
    return out


def _stale_logs(rdir: Path) -> list[Leftover]:
    """Logs of share() producers of names that no producer runs or starts under, and
    the logs of failed producers (whatever runs)."""
    out: list[Leftover] = []
    try:
        entries = sorted(rdir.iterdir())
    except OSError:
        return out
    for path in entries:
        name = log_owner(path.name)
        if name is None or not _own_regular_file(path):
            continue
        if failed_log_owner(path.name) is not None:
            out.append(Leftover("log", name, str(path), FAILED_LOG_REASON))
        elif not _name_in_use(rdir, name):
            out.append(Leftover("log", name, str(path), LOG_REASON))
    return out


def _name_lock(rdir: Path, name: str) -> Path:
    """The lock file a live producer of `name` holds (as Endpoint.lock_path)."""
    return rdir / f"{name}.lock"


def _own_regular_file(path: Path) -> bool:
    """True for a regular file of this user (not a link, not another user's file)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def _name_in_use(rdir: Path, name: str) -> bool:
    """True while a producer of `name` runs (its name lock) or a share() election of it
    is under way (starting or ending one)."""
    return lock_held(_name_lock(rdir, name)) or lock_held(share_lock_file(rdir, name))


def _remove_log(item: Leftover) -> str | None:
    """Remove a stale log under the name's election lock; None on success, else why not."""
    path = Path(item.path)
    election = share_lock_file(path.parent, item.name)
    fd = take_lock(election, time.monotonic())  # one try: a share() may be at work
    if fd is None:
        return "a share() of this name is starting or ending its producer; left alone"
    try:
        if failed_log_owner(path.name) is None and \
                lock_held(_name_lock(path.parent, item.name)):
            return "a producer of this name started meanwhile; left alone"
        if not _own_regular_file(path):
            return "no longer a regular file of this user; left alone"
        path.unlink(missing_ok=True)
        return None
    finally:
        release_lock(fd, election)


def _stale_stores() -> list[Leftover]:
    """Stores of decoded samples that no live process uses (jobs killed together)."""
    return [Leftover("store", key, f"{SHM_DIR}{segment_name(key)}", "no live job uses it")
            for key in unused_stores()]


def leftovers(rdir: Path | None = None) -> list[Leftover]:
    """Everything dead producers and jobs of this user left (nothing of a live one)."""
    rdir = rdir if rdir is not None else runtime_dir()
    return stale_segments() + _stale_stores() + _stale_files(rdir) + _stale_logs(rdir)


def remove(item: Leftover) -> str | None:
    """Remove one leftover; None on success, else why not. A lock or socket is
    checked again right before, in case a producer of that name started since."""
    try:
        if item.kind == "segment":
            Ring.unlink_name("/" + Path(item.path).name)
            return None
        if item.kind == "log":
            return _remove_log(item)
        if item.kind == "store":
            return None if remove_unused(item.name) else \
                "a job attached to it meanwhile; left alone"
        if item.kind in ("socket", "lock"):
            lock = Path(item.path) if item.kind == "lock" else \
                Path(item.path).with_suffix(".lock")
            if lock.exists() and lock_held(lock):
                return "a producer of this name started meanwhile; left alone"
            Path(item.path).unlink(missing_ok=True)
            return None
    except (OSError, TensorSocketError) as e:  # (a store's flock held too long, say)
        return str(e)
    return f"unknown kind {item.kind!r}"


def remove_leftovers(name: str, rdir: Path | None = None) -> list[Leftover]:
    """Remove what producers named `name` left (for a program that has just stopped its
    own producer of that name: the demo, the benchmarks); what was removed. A live
    producer of the name keeps its files, as with ``tensorsocket clean --name``."""
    try:
        found = [item for item in leftovers(rdir) if item.name == name]
    except OSError:  # no runtime directory: nothing of ours there
        found = stale_segments(name)
    return [item for item in found if remove(item) is None]
