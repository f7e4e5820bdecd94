"""The store segments of this user in /dev/shm: making, joining and leaving one.

A store of decoded samples is one POSIX shared-memory segment (mode 0600) named
``tensorsocket-store-<uid>-<key>``, the key a digest of the share() name and the dataset's
identity with its shared transform (store.identity). Jobs open it (the first creates it,
with its budget), each process of a job (the job's own, each of its DataLoader workers)
attaches to it as a job slot, and the last job to leave unlinks it. Opening, creating and
unlinking go under an flock of ``store-<key>.store-lock`` in the private runtime
directory, so that a job arriving never maps a segment that the last one leaving is
unlinking. A segment whose every process died (SIGKILL) is reused by the next job of the
same key (its samples are still good: they are complete, or reaped) and removed by the
next job of any key, by ``tensorsocket clean``, or listed by ``tensorsocket status``.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..control.endpoints import runtime_dir
from ..data.segments import SHM_DIR, shm_files
from ..errors import TensorSocketError
from ..ring import Store, TooManyConsumers, VersionMismatch, process_stat
from ..sharing.election import release_lock, take_lock

log = logging.getLogger("tensorsocket")

LOCK_SECONDS = 30.0  # the longest wait for a store's flock (held for an open or an unlink)
# A store being made by a job whose flock is not this one's (the same runtime directory's
# path in another mount namespace sharing /dev/shm: a container) is waited for this long;
# one still half made then was left by a maker that died.
MAKING_SECONDS = 2.0
_SEGMENT = re.compile(r"tensorsocket-store-(?P<uid>[0-9]{1,10})-(?P<key>[0-9a-f]{16})")


def segment_name(key: str) -> str:
    """The POSIX shm name of the store of `key` (with its leading '/')."""
    return f"/tensorsocket-store-{os.getuid()}-{key}"


def lock_path(key: str) -> Path:
    """The flock file of the store of `key`."""
    return runtime_dir() / f"store-{key}.store-lock"


def store_keys() -> list[str]:
    """The keys of this user's store segments in /dev/shm (regular files of this user
    under a name a store takes; anyone may create files there)."""
    return [m.group("key") for _, m, owner in shm_files(_SEGMENT.fullmatch)
            if owner == os.getuid() and int(m.group("uid")) == os.getuid()]


class _Locked:
    """The flock of a store's key, held for a `with` block (TensorSocketError if another
    process holds it longer than LOCK_SECONDS)."""

    def __init__(self, key: str) -> None:
        self._path = lock_path(key)
        self._fd: int | None = None

    def __enter__(self) -> _Locked:
        self._fd = take_lock(self._path, time.monotonic() + LOCK_SECONDS)
        if self._fd is None:
            raise TensorSocketError(
                f"the sample store's lock {self._path} was held for more than {LOCK_SECONDS:g} s "
                "by another process (a job stopped while it opened or left the store?)")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            release_lock(self._fd, self._path)
            self._fd = None


def _live_jobs(store: Store, leaving: int | None = None, slot: int | None = None) -> int:
    """The processes attached to `store` once the dead were reaped, but the children of
    process `leaving` (a job's DataLoader workers end with it) and job slot `slot` (the
    leaving job's own, if its close could not take the lock to give it back)."""
    store.reap()
    count = 0
    for row_slot, pid, *_ in store.jobs():
        if slot is not None and row_slot == slot:
            continue
        stat = process_stat(pid) if leaving is not None else None
        if stat is None or stat["ppid"] != leaving:
            count += 1
    return count


@dataclass
class Joined:
    """What joining a store gave: the handle (attached; closed if its lock was held by a
    stopped process: the job then decodes its own samples), whether this call made the
    segment, and the budget it has (the first job's)."""

    store: Store
    created: bool
    budget: int


def join(key: str, samples: int, budget: Callable[[], int]) -> Joined:
    """Open the store of `key` (creating it for `samples` samples and budget() bytes if
    there is none, or replacing one no live process uses that cannot serve: another
    layout, another number of samples) and attach this process to it."""
    name = segment_name(key)
    with _Locked(key):
        store, created = _open_or_make(name, samples, budget)
        budget_now = int(store.info()["budget"])
        try:
            store.attach()
        except (TimeoutError, TooManyConsumers) as e:
            # (a stopped job holds its lock, or its job table is full: this job goes alone)
            log.warning("decoded-sample store %s: %s; this job decodes its own samples",
                        name, e)
            store.close()
        except BaseException:
            store.close()
            if created:
                _unlink(name)
            raise
        return Joined(store, created, budget_now)


def _open_or_make(name: str, samples: int, budget: Callable[[], int]) -> tuple[Store, bool]:
    """The store `name`, opened or made (whether made) for a dataset of `samples` (join).
    Under the key's flock a store half made was left by a maker that died; one whose flock
    is another (MAKING_SECONDS) may be making it meanwhile: a store being made reads as
    not there, and making it then finds it made, so both are tried again until it is
    made (a store half made for MAKING_SECONDS is replaced)."""
    deadline = time.monotonic() + MAKING_SECONDS
    while True:
        store = None
        try:
            store = Store.open(name)
        except FileNotFoundError:
            pass
        except VersionMismatch:
            _unlink(name)  # (a store of another tensorsocket's layout; its jobs use their own)
        held = None if store is None else store.info()["samples"]
        if store is not None and held != samples:
            if _live_jobs(store):
                store.close()
                raise TensorSocketError(
                    f"the sample store {name} holds a dataset of {held} samples, this job's "
                    f"has {samples}, and jobs still use it: give this job another share() "
                    "name")
            store.close()
            _unlink(name)
            store = None
        if store is not None:
            return store, False
        try:
            return Store.create(name, samples, budget()), True
        except FileExistsError:
            if time.monotonic() < deadline:
                time.sleep(0.01)  # (made meanwhile, or being made: open it)
                continue
            log.warning("decoded-sample store %s was left half made (its maker died?): "
                        "replaced", name)
            _unlink(name)
            deadline = time.monotonic() + MAKING_SECONDS


def attach_worker(key: str) -> Store | None:
    """The store of `key` opened and attached in a process of a job that joined it (a
    DataLoader worker); None if it is gone (the job decodes privately then)."""
    try:
        store = Store.open(segment_name(key))
    except (FileNotFoundError, VersionMismatch):
        return None
    try:
        store.attach()
    except BaseException:
        store.close()
        raise
    return store


def leave(key: str, store: Store) -> bool:
    """This job leaves the store of `key`; the segment is unlinked if no live process uses
    it any more (this job's own workers, ending with it, aside). Whether it was."""
    with _Locked(key):
        slot = None if store.closed else store.job
        store.close()
        try:
            probe = Store.open(segment_name(key))
        except (FileNotFoundError, VersionMismatch):
            return False
        try:
            alone = _live_jobs(probe, leaving=os.getpid(), slot=slot) == 0
        except TimeoutError:  # a stopped job holds its lock: it is not ours to remove
            alone = False
        finally:
            probe.close()
        if alone:
            _unlink(segment_name(key))
        return alone


def remove_unused(key: str) -> bool:
    """Unlink the store of `key` if no live process uses it (checked under its flock);
    whether it was."""
    with _Locked(key):
        try:
            store = Store.open(segment_name(key))
        except (FileNotFoundError, VersionMismatch):
            return False  # (gone; or another tensorsocket's: its own sweep decides)
        try:
            unused = _live_jobs(store) == 0
        finally:
            store.close()
        if unused:
            _unlink(segment_name(key))
        return unused


def sweep(keep: str | None = None) -> list[str]:
    """Unlink this user's stores (but `keep`) that no live process uses: what jobs killed
    together left. The keys removed."""
    removed = []
    for key in store_keys():
        if key == keep:
            continue
        try:
            if remove_unused(key):
                removed.append(key)
        except (OSError, TensorSocketError) as e:
            log.debug("sample store %s left alone: %s", key, e)
    return removed


def _unlink(name: str) -> None:
    """Remove a store's name (gone already: nothing)."""
    try:
        os.unlink(f"{SHM_DIR}{name}")
    except FileNotFoundError:
        pass
