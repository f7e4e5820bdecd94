"""How much memory this process may still take: the machine's and its memory cgroups'.

The one place that reads /proc/meminfo, /proc/self/cgroup, /proc/self/mountinfo and the
cgroup files (v2 ``memory.max``, ``memory.current``, ``memory.stat``; v1
``memory.limit_in_bytes``, ``memory.usage_in_bytes``, ``memory.stat``). The decoded-sample
cache asks before it allocates (sample_cache.SampleCache): shmem is not refused when it
does not fit. ``posix_fallocate`` on a memfd charges its pages one by one until the
cgroup's OOM killer SIGKILLs the process (without a cgroup the global one may pick
another process: a training job).

``memory_room()`` gives one ``Bound`` per limit found:

- the machine: MemTotal, with MemAvailable left;
- each memory cgroup of this process and each of its ancestors up to the root of the
  hierarchy as mounted here (a cgroup's limit bounds its descendants too, so the
  tightest counts) that has a limit: the limit, with the limit less the cgroup's working
  set left. The working set is its usage less its inactive file pages (the page cache it
  can drop without swap: the kubelet's and docker's rule), since usage counts page cache
  that reading the dataset fills and that the kernel reclaims before it OOM-kills.

``MemoryRoom.usable`` is the least, over the bounds, of what is left less a margin of
1/8 of that bound's total plus 64 MiB (``margin``): what the producer takes beside the
cache (its loader's workers, the ring), the other processes of the cgroup or machine (the
training jobs), and whatever they allocate between this reading and the allocation.
Swap is not counted: with none (the usual case for training machines) shmem pages can only
be freed by the OOM killer.

Every path is read under ``root`` (default "/"), so tests give a tree of fake files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

MIB = 1 << 20
MARGIN_FIXED = 64 * MIB  # bytes kept free beside the 1/8 of each bound's total
MARGIN_SHARE = 8  # ... that is, total // MARGIN_SHARE
UNLIMITED = 1 << 60  # a cgroup v1 limit at or above this is no limit (LONG_MAX rounded)
_ANCESTORS = 64  # cgroup levels walked up at most


def margin(total: int) -> int:
    """Bytes kept free under a limit of `total` bytes (see the module docstring)."""
    return total // MARGIN_SHARE + MARGIN_FIXED


@dataclass(frozen=True)
class Bound:
    """One limit on this process's memory: `what` it is (in words), its `total` bytes, and
    the bytes `left` under it now."""

    what: str
    total: int
    left: int

    @property
    def usable(self) -> int:
        """Bytes that may still be taken under this bound: left less the margin (>= 0)."""
        return max(0, self.left - margin(self.total))

    def describe(self) -> str:
        """The bound in words, with its numbers."""
        return (f"{self.what}: {_size(self.left)} of {_size(self.total)} left, "
                f"{_size(self.usable)} after a margin of {_size(margin(self.total))}")


@dataclass(frozen=True)
class MemoryRoom:
    """The bounds found (none: nothing could be read, no limit known)."""

    bounds: tuple[Bound, ...]

    @property
    def tightest(self) -> Bound | None:
        """The bound with the least usable bytes (None without bounds)."""
        return min(self.bounds, key=lambda b: b.usable, default=None)

    @property
    def usable(self) -> int | None:
        """Bytes that may still be taken (None: no bound known)."""
        bound = self.tightest
        return None if bound is None else bound.usable

    def refusal(self, nbytes: int) -> str | None:
        """Why `nbytes` more cannot be taken (None if they can), naming the tightest
        bound and its numbers."""
        bound = self.tightest
        if bound is None or nbytes <= bound.usable:
            return None
        return f"more than this process may take: {bound.describe()}"


def memory_room(root: str = "/") -> MemoryRoom:
    """The machine's bound and those of this process's memory cgroups (module docstring),
    read from the files under `root`; what cannot be read is left out."""
    bounds = []
    machine = _machine(root)
    if machine is not None:
        bounds.append(machine)
    bounds.extend(_cgroup_bounds(root))
    return MemoryRoom(tuple(bounds))


# -- the machine -------------------------------------------------------------------------


def _machine(root: str) -> Bound | None:
    """MemTotal and MemAvailable of /proc/meminfo (None if unreadable)."""
    fields = {}
    for line in _lines(_under(root, "/proc/meminfo")):
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            fields[key.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    if "MemTotal" not in fields or "MemAvailable" not in fields:
        return None
    return Bound("the machine (MemAvailable of MemTotal)", fields["MemTotal"],
                 fields["MemAvailable"])


# -- the cgroups -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Version:
    """A cgroup version's memory files."""

    limit: str
    usage: str
    inactive_file: str  # its key in memory.stat (with the descendants' pages)


_V2 = _Version("memory.max", "memory.current", "inactive_file")
_V1 = _Version("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def _cgroup_bounds(root: str) -> Iterator[Bound]:
    """A Bound per limited memory cgroup of this process or of an ancestor, v2 and v1."""
    paths = _cgroup_paths(root)
    for version, (mount, mount_root) in _memory_mounts(root).items():
        path = paths.get(version)
        if path is None:
            continue
        files = _V2 if version == "v2" else _V1
        top = os.path.normpath(_under(root, mount))
        relative = os.path.relpath(os.path.normpath(path), os.path.normpath(mount_root))
        directory = os.path.normpath(os.path.join(top, relative))
        if os.path.commonpath([top, directory]) != top:
            directory = top  # the cgroup lies outside what is mounted here: its root
        for _ in range(_ANCESTORS):
            name = os.path.normpath(os.path.join(mount_root, os.path.relpath(directory, top)))
            bound = _cgroup_bound(directory, files, f"{version} {name}")
            if bound is not None:
                yield bound
            if directory == top:
                break
            directory = os.path.dirname(directory)


def _cgroup_bound(directory: str, files: _Version, name: str) -> Bound | None:
    """The bound of the cgroup in `directory` (`name`: its version and path in the
    hierarchy): None without a limit (or unreadable)."""
    limit = _number(os.path.join(directory, files.limit))
    usage = _number(os.path.join(directory, files.usage))
    if limit is None or usage is None or limit >= UNLIMITED:
        return None
    inactive = 0
    for line in _lines(os.path.join(directory, "memory.stat")):
        key, _, value = line.partition(" ")
        if key == files.inactive_file and value.strip().isdigit():
            inactive = int(value)
            break
    working_set = max(0, usage - inactive)
    return Bound(f"memory cgroup {name} ({files.limit} less the working set)",
                 limit, max(0, limit - working_set))


def _cgroup_paths(root: str) -> dict[str, str]:
    """This process's cgroup path per version: "v2" (the 0:: line) and "v1" (the line of
    the memory controller), from /proc/self/cgroup."""
    found: dict[str, str] = {}
    for line in _lines(_under(root, "/proc/self/cgroup")):
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            found["v2"] = path
        elif "memory" in controllers.split(","):
            found["v1"] = path
    return found


def _memory_mounts(root: str) -> dict[str, tuple[str, str]]:
    """(mount point, cgroup path at the mount's root) of the cgroup v2 hierarchy and of
    the v1 memory controller's, from /proc/self/mountinfo (the usual places where it
    cannot be read)."""
    found: dict[str, tuple[str, str]] = {}
    for line in _lines(_under(root, "/proc/self/mountinfo")):
        mine, _, theirs = line.partition(" - ")
        fields, tail = mine.split(), theirs.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        mount_root, point = _unescape(fields[3]), _unescape(fields[4])
        if tail[0] == "cgroup2":
            found.setdefault("v2", (point, mount_root))
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            found.setdefault("v1", (point, mount_root))
    if not found:
        for version, point in (("v2", "/sys/fs/cgroup"), ("v1", "/sys/fs/cgroup/memory")):
            if os.path.isdir(_under(root, point)):
                found[version] = (point, "/")
    return found


# -- reading -----------------------------------------------------------------------------


def _under(root: str, path: str) -> str:
    """`path` (absolute) under `root`."""
    return os.path.join(root, path.lstrip("/"))


def _lines(path: str) -> list[str]:
    """The lines of a small file ([] if it cannot be read)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(1 << 20).splitlines()
    except OSError:
        return []


def _number(path: str) -> int | None:
    """The number a cgroup file holds; UNLIMITED for "max"; None if unreadable."""
    lines = _lines(path)
    text = lines[0].strip() if lines else ""
    if text == "max":
        return UNLIMITED
    return int(text) if text.isdigit() else None


def _unescape(field: str) -> str:
    """A mountinfo path field with its octal escapes (\\040 for a space) undone."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _size(n: int) -> str:
    """Bytes in words: exact below a MiB, else MiB or GiB with one decimal."""
    if n < MIB:
        return f"{n} bytes"
    if n < 1 << 30:
        return f"{n / MIB:.1f} MiB"
    return f"{n / (1 << 30):.1f} GiB"
