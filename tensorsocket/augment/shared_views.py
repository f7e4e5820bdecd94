"""A worker process's zero-copy view of a tensor that lies in a ring segment.

A consumer's batch tensors are views of the ring segment it maps (``/dev/shm/<segment>``).
For a worker process to read one without a copy, the consumer asks its ring handle which
file and offset the tensor's memory comes from (``Ring.locate``: the core knows its
mapping, and checks that the name still names that file) and sends that;
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

@dataclass(frozen=True)
class SharedTensorRef:
    """Where a tensor's data lies in a shared file: what a worker needs to view it."""

    path: str
    offset: int  # bytes from the file's start to the tensor's storage offset 0 element
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def shared_ref(tensor: torch.Tensor, ring: Any) -> SharedTensorRef | None:
    """Where `tensor`, a view of a slot of `ring` (the consumer's handle), lies in the
    ring's file, or None (not in a slot seen through the shared mapping, or the file lost
    its name: send the tensor). The tensor's memory stays mapped while it lives."""
    if tensor.device.type != "cpu":
        return None
    found = ring.locate(tensor.data_ptr())
    if found is None:
        return None
    path, offset = found
    return SharedTensorRef(path, offset, tuple(tensor.shape), tuple(tensor.stride()),
                           tensor.dtype)


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
