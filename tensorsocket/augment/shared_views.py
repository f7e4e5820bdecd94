"""A worker process's zero-copy view of a tensor that lies in a ring segment.

A consumer's batch tensors are views of the ring segment it maps (``/dev/shm/<segment>``).
For a worker process to read one without a copy, the consumer finds which file and offset
the tensor's memory comes from (``/proc/self/maps``, read in this one place) and sends that;
the worker maps the same file (read-only, copy-on-write: a transform that writes into its
input changes only the worker's pages) and views the tensor at that offset. A tensor not in
a shared file mapping (a private copy, a re-batched batch) travels through the worker queue
instead, as a DataLoader worker's tensors do (torch's shared-memory pickling).
"""

from __future__ import annotations

import bisect
import mmap
import os
from dataclasses import dataclass
from typing import Any

import torch

_SHARED_PREFIX = "/dev/shm/"


@dataclass(frozen=True)
class SharedTensorRef:
    """Where a tensor's data lies in a shared file: what a worker needs to view it."""

    path: str
    offset: int  # bytes from the file's start to the tensor's storage offset 0 element
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class SharedMappings:
    """This process's file mappings under /dev/shm, read from /proc/self/maps when a tensor
    lies outside the ones known (a ring mapped since)."""

    def __init__(self) -> None:
        """None known yet."""
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._where: list[tuple[str, int]] = []  # (path, file offset of the start)

    def ref(self, tensor: torch.Tensor) -> SharedTensorRef | None:
        """Where `tensor` lies in a shared file, or None (not in one: send the tensor)."""
        if tensor.device.type != "cpu":
            return None
        first = tensor.data_ptr()
        found = self._find(first) or (self._read() and self._find(first))
        if not found:
            return None
        path, offset = found
        return SharedTensorRef(path, offset, tuple(tensor.shape), tuple(tensor.stride()),
                               tensor.dtype)

    def _find(self, address: int) -> tuple[str, int] | None:
        """(path, file offset) of `address` in a known mapping, else None."""
        k = bisect.bisect_right(self._starts, address) - 1
        if k < 0 or address >= self._ends[k]:
            return None
        path, file_offset = self._where[k]
        return path, file_offset + address - self._starts[k]

    def _read(self) -> bool:
        """Read the mappings of files under /dev/shm that still have their name; True."""
        rows = []
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) < 6:
                    continue
                path = parts[5].rstrip("\n")
                if not path.startswith(_SHARED_PREFIX) or path.endswith(" (deleted)"):
                    continue
                start, end = (int(x, 16) for x in parts[0].split("-"))
                rows.append((start, end, path, int(parts[2], 16)))
        rows.sort()
        self._starts = [r[0] for r in rows]
        self._ends = [r[1] for r in rows]
        self._where = [(r[2], r[3]) for r in rows]
        return True


class WorkerMappings:
    """A worker's own mappings of the shared files it was sent tensors of, kept while the
    file has the same identity (a ring made again under the same name is mapped again)."""

    def __init__(self) -> None:
        """None mapped yet."""
        self._maps: dict[str, tuple[tuple[int, int], mmap.mmap]] = {}

    def view(self, ref: SharedTensorRef) -> torch.Tensor:
        """The tensor `ref` describes, viewed in this process's mapping of its file."""
        mapped = self._map(ref.path)
        item = torch.empty((), dtype=ref.dtype).element_size()
        if ref.offset % item:
            raise ValueError(f"a {ref.dtype} tensor at byte {ref.offset} of {ref.path} is "
                             "not aligned to its element size")
        base = torch.frombuffer(mapped, dtype=ref.dtype)  # type: ignore[arg-type]
        return base.as_strided(ref.shape, ref.stride, ref.offset // item)

    def _map(self, path: str) -> mmap.mmap:
        """This process's copy-on-write mapping of the whole file at `path`."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            identity = (st.st_dev, st.st_ino)
            known = self._maps.get(path)
            if known is not None and known[0] == identity and len(known[1]) >= st.st_size:
                return known[1]
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        self._maps[path] = (identity, mapped)  # an older one is unmapped once unused
        return mapped

    def close(self) -> None:
        """Forget the mappings (each is unmapped once no tensor views it)."""
        self._maps.clear()


def materialise(source: Any, mappings: WorkerMappings) -> torch.Tensor:
    """The tensor a worker was sent: viewed in place (a SharedTensorRef) or as it came."""
    if isinstance(source, SharedTensorRef):
        return mappings.view(source)
    return source
