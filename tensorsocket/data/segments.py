"""The ring segments of this user's producers in /dev/shm: which there are, and which
a dead producer left.

Every producer keeps its ring in a POSIX shared-memory segment named
``tensorsocket-<uid>-<name>-<pid>`` (with ``.<tag>`` appended where a file already had
that name). Anyone may create files in /dev/shm, under any name, so only regular files
under a name a producer makes, named with this user's uid and owned by this user, count
as this user's segments. The producer (sweeping stale segments of its name), ``tensorsocket
status`` and ``tensorsocket clean`` all list them here.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from typing import Callable, TypeVar

from ..ring import Ring, RingInfo, process_alive
from ..validation import check_name

SHM_DIR = "/dev/shm"
T = TypeVar("T")

# tensorsocket-<uid>-<name>-<pid>, with ".<tag>" (hex) where a producer found that name taken.
_SEGMENT = re.compile(
    r"tensorsocket-(?P<uid>[0-9]{1,10})-(?P<name>.+)-(?P<pid>[0-9]{1,7})(?:\.[0-9a-f]{8})?")
PID_MAX = 1 << 22  # PID_MAX_LIMIT of 64-bit Linux: no process has a larger pid
UID_MAX = (1 << 32) - 2  # (uid_t)-1 means "no uid"


def parse_segment_name(entry: str) -> tuple[int, str, int] | None:
    """(owner uid from its name, producer name, pid) of a segment name, or None for a name
    no producer makes: anyone may create files in /dev/shm, under any name."""
    m = _SEGMENT.fullmatch(entry)
    if m is None:
        return None
    uid, name, pid = int(m.group("uid")), m.group("name"), int(m.group("pid"))
    if not (0 <= uid <= UID_MAX and 0 < pid <= PID_MAX):
        return None
    try:
        check_name(name)
    except ValueError:
        return None
    return uid, name, pid


def shm_files(parse: Callable[[str], T | None]) -> list[tuple[str, T, int]]:
    """(name, parse(name), owner uid) of the regular files in /dev/shm whose name `parse`
    takes (not None), sorted by name: the one reading of /dev/shm (ring segments here,
    the stores of decoded samples in store/segment.py). Links, directories and files gone
    meanwhile are left out."""
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except OSError:
        return []
    out = []
    for entry in entries:
        parsed = parse(entry)
        if parsed is None:
            continue
        try:
            st = os.lstat(f"{SHM_DIR}/{entry}")
        except OSError:  # gone meanwhile
            continue
        if stat.S_ISREG(st.st_mode):
            out.append((entry, parsed, st.st_uid))
    return out


def all_segments() -> list[tuple[str, int, str, int, int]]:
    """(segment, owner uid from its name, producer name, pid, owner uid of the file) of
    every tensorsocket segment in /dev/shm, whoever's: regular files under a name a
    producer makes (links, directories and names with an impossible pid or uid are left
    out)."""
    return [(entry, *parsed, uid) for entry, parsed, uid in shm_files(parse_segment_name)]


def segments() -> list[tuple[str, str, int]]:
    """(segment, producer name, pid) of every tensorsocket segment of this user: named
    with our uid and owned by us. A file another user created under such a name is not
    ours: it is never read, listed or removed as one of our producers' segments."""
    me = os.getuid()
    return [(entry, name, pid) for entry, uid, name, pid, owner in all_segments()
            if uid == me and owner == me]


def segment_producer(segment: str, pid: int) -> tuple[bool, int, str | None]:
    """(alive, producer pid, why unreadable) of a segment of this user. Judged by the
    pid and start time in its header, so that a reused pid does not count; where the
    header cannot be read, by the pid in its name (`why` then says what failed)."""
    try:
        ring = Ring.open("/" + segment)
    except Exception as e:
        return pid_alive(pid), pid, str(e)
    try:
        info = RingInfo.of(ring)
    finally:
        ring.close()
    producer = info.producer_pid
    return process_alive(producer, info.producer_start_time), producer, None


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (it may be another program after reuse)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Leftover:
    """One file a dead producer left."""

    kind: str  # "segment", "socket", "lock", "log", "store" (clean.py)
    name: str  # producer name (a store's: its key)
    path: str  # what to remove
    reason: str  # why it is stale

    def describe(self) -> str:
        """One line for the user."""
        return f"{self.kind:<7} {self.path}  ({self.reason})"


def stale_segments(only: str | None = None) -> list[Leftover]:
    """Segments whose producer is gone (of producer `only` if given)."""
    out = []
    for segment, name, pid in segments():
        if only is not None and name != only:
            continue
        path = f"{SHM_DIR}/{segment}"
        alive, producer, unreadable = segment_producer(segment, pid)
        if alive:
            continue
        if unreadable is not None:
            out.append(Leftover("segment", name, path,
                                f"unreadable ({unreadable}) and process {pid} is gone"))
            continue
        users = sum(1 for c in _consumers_alive(segment))
        reason = f"producer pid {producer} is gone"
        if users:
            reason += f"; {users} consumer process(es) still map it (their views stay valid)"
        out.append(Leftover("segment", name, path, reason))
    return out


def _consumers_alive(segment: str) -> list[int]:
    """Pids of live consumers in a segment's consumer table."""
    try:
        ring = Ring.open("/" + segment)
    except Exception:
        return []
    try:
        return [c["pid"] for c in ring.consumers()
                if process_alive(c["pid"], c["start_time"])]
    finally:
        ring.close()
