"""A worker process's zero-copy view of a tensor that lies in a ring segment.

A consumer's batch tensors are views of the ring segment it maps (``/dev/shm/<segment>``).
For a worker process to read one without a copy, the consumer finds which file and offset
the tensor's memory comes from (``/proc/self/maps``, read in this one place) and sends that;
the worker maps those bytes of the same file for the task (copy-on-write: a transform that
writes into its input changes only that mapping, which goes with the task) and views the
tensor there. A tensor not in a shared file mapping (a private copy, a re-batched batch),
or whose file lost its name (the producer ended), travels through the worker queue
instead, as a DataLoader worker's tensors do (torch's shared-memory pickling).
"""

from __future__ import annotations

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


def shared_ref(tensor: torch.Tensor) -> SharedTensorRef | None:
    """Where `tensor` lies in a shared file that still has its name, or None (not in one:
    send the tensor). /proc/self/maps is read afresh for every call: a ring mapped again,
    or a private allocation at an address a ring had, must never be taken for what was
    there before (one read is ~0.1 ms). The tensor's memory stays mapped while it lives."""
    if tensor.device.type != "cpu":
        return None
    found = _shared_file_at(tensor.data_ptr())
    if found is None:
        return None
    path, offset = found
    return SharedTensorRef(path, offset, tuple(tensor.shape), tuple(tensor.stride()),
                           tensor.dtype)


def _shared_file_at(address: int) -> tuple[str, int] | None:
    """(path, file offset) of `address` if this process maps it from a file under
    /dev/shm whose name still exists; else None."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, _, offset, _ = line.split(maxsplit=3)
            start, end = (int(x, 16) for x in span.split("-"))
            if not start <= address < end:
                continue
            parts = line.split(maxsplit=5)
            path = parts[5].rstrip("\n") if len(parts) == 6 else ""
            if not path.startswith(_SHARED_PREFIX) or path.endswith(" (deleted)"):
                return None
            return path, int(offset, 16) + address - start
    return None


def view_in_place(ref: SharedTensorRef) -> torch.Tensor:
    """The tensor `ref` describes, viewed in a mapping of just its bytes made for it (and
    gone with the tensor): copy-on-write, so a transform that writes into its input
    changes this worker's copy of those pages, and the next task maps the file afresh.
    OSError if the file is gone (the producer ended): the caller sends the tensor."""
    item = torch.empty((), dtype=ref.dtype).element_size()
    if ref.offset % item:
        raise ValueError(f"a {ref.dtype} tensor at byte {ref.offset} of {ref.path} is not "
                         "aligned to its element size")
    span = item * (1 + sum((n - 1) * st for n, st in zip(ref.shape, ref.stride) if n > 0))
    if any(n == 0 for n in ref.shape):
        return torch.empty(ref.shape, dtype=ref.dtype)
    first = ref.offset - ref.offset % mmap.ALLOCATIONGRANULARITY
    fd = os.open(ref.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        mapped = mmap.mmap(fd, ref.offset - first + span, offset=first,
                           access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    base = torch.frombuffer(mapped, dtype=ref.dtype)  # type: ignore[arg-type]
    return base.as_strided(ref.shape, ref.stride, (ref.offset - first) // item)


def materialise(source: Any) -> torch.Tensor:
    """The tensor a worker was sent: viewed in place (a SharedTensorRef) or as it came."""
    if isinstance(source, SharedTensorRef):
        return view_in_place(source)
    return source
