"""What ``tensorsocket status`` and ``tensorsocket clean`` see of this user's stores of
decoded samples: each store's figures and its jobs (store.segment finds them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ring import Store, VersionMismatch, process_stat
from .segment import remove_unused, segment_name, store_keys


@dataclass
class StoreJob:
    """A job attached to a store: its process, where it is, its DataLoader workers."""

    pid: int
    epoch: int
    position: int  # batches its loader was handed of the epoch
    length: int  # of the epoch (0: not started)
    workers: int = 0  # its processes attached besides it (its DataLoader workers)


@dataclass
class StoreStatus:
    """One store: its segment, budget and occupancy, counters and jobs."""

    key: str
    segment: str
    samples: int  # of the dataset
    budget: int  # bytes of its arena
    used_bytes: int
    stored: int  # samples in it
    hits: int  # samples read from it: decodes saved
    misses: int
    commits: int  # samples put in (decodes shared)
    evictions: int
    races: int  # decodes that came second (the sample stored, or being stored, already)
    busy: int  # calls refused for a busy lock (a process holding it was stopped)
    dropped: str | None  # why it was dropped (its dataset found not deterministic)
    jobs: list[StoreJob] = field(default_factory=list)

    @property
    def hit_rate(self) -> float | None:
        """Hits of all lookups (None before any)."""
        looked = self.hits + self.misses
        return self.hits / looked if looked else None


def survey_stores() -> list[StoreStatus]:
    """Every store of this user that can be read."""
    out = []
    for key in store_keys():
        try:
            store = Store.open(segment_name(key))
        except (OSError, VersionMismatch):
            continue
        try:
            out.append(_status(key, store))
        finally:
            store.close()
    return out


def _status(key: str, store: Store) -> StoreStatus:
    """The status of one open store."""
    info = store.info()
    rows = store.jobs()
    pids = {row[1] for row in rows}
    jobs: dict[int, StoreJob] = {}
    workers: dict[int, int] = {}
    for _slot, pid, epoch, position, length in rows:
        stat = process_stat(pid)
        if stat is None:
            continue  # dead: the next job's reap frees its slot
        if stat["ppid"] in pids:  # a worker of another attached process
            workers[stat["ppid"]] = workers.get(stat["ppid"], 0) + 1
            continue
        jobs[pid] = StoreJob(pid, epoch, position, length)
    for pid, count in workers.items():
        if pid in jobs:
            jobs[pid].workers = count
    return StoreStatus(key, segment_name(key), info["samples"], info["budget"],
                       info["used_bytes"], info["stored"], info["hits"], info["misses"],
                       info["commits"], info["evictions"], info["races"], info["busy"],
                       store.dropped,
                       sorted(jobs.values(), key=lambda j: j.pid))


def unused_stores() -> list[str]:
    """The keys of this user's stores that no live process uses (what `clean` removes)."""
    out = []
    for status in survey_stores():
        if not status.jobs:
            out.append(status.key)
    return out


__all__ = ["StoreJob", "StoreStatus", "remove_unused", "survey_stores", "unused_stores"]
