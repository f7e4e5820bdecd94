"""Steady malloc heaps for the DataLoader workers a producer starts.

A DataLoader worker is forked from the producer's process and inherits its malloc
heap. Decoding an image takes a block of about a megabyte, close to glibc's dynamic
mmap threshold; freeing it can leave more than the trim threshold free at the top of
the heap, which glibc then hands back to the kernel, and the next image faults the same
memory in again, page by page, for every sample. Whether that happens depends only on
what the parent had allocated when it forked (importing one more module can flip it):
measured on the development machine, a producer's worker took 930k minor faults and
50% more CPU per 60 batches of 512x512 JPEGs than the same worker forked before the
import (benchmarks/README.md, "The allocator").

The producer therefore has each worker of a torch DataLoader fix two glibc settings
before it loads anything: blocks under 32 MiB come from the heap
(``M_MMAP_THRESHOLD``), and ``worker_heap_pad`` bytes stay at the top of the heap when
it is trimmed (``M_TOP_PAD``). Only the workers are changed, never the producer's
process or the user's; the loader's ``worker_init_fn`` is wrapped only while ``iter()``
starts the workers, and then put back.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
from typing import Any, Callable, Iterator

log = logging.getLogger("tensorsocket")

M_TOP_PAD = -2  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest mmap threshold glibc accepts on 64-bit
DEFAULT_PAD = 16 << 20


def glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None where the C library is not glibc (musl's is a stub)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)
    try:
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
    except AttributeError:
        return None
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt


def pad_heap(top_pad: int) -> bool:
    """In this process: serve blocks under 32 MiB from the heap and keep ``top_pad``
    bytes at its top. False (and nothing changed) where glibc's mallopt is missing or
    refuses."""
    mallopt = glibc_mallopt()
    if mallopt is None:
        return False
    return (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and mallopt(M_TOP_PAD, int(top_pad)) == 1)


class PaddedWorkerInit:
    """A DataLoader ``worker_init_fn``: ``pad_heap(top_pad)``, then the loader's own
    ``worker_init_fn`` (if any). Picklable, for the spawn and forkserver start methods."""

    def __init__(self, top_pad: int, inner: Callable[[int], Any] | None) -> None:
        self.top_pad = int(top_pad)
        self.inner = inner  # the user's worker_init_fn (borrowed, called after the padding)

    def __call__(self, worker_id: int) -> None:
        """Pad this worker's heap, then run the loader's own worker_init_fn."""
        if not pad_heap(self.top_pad):
            log.debug("DataLoader worker %d: glibc mallopt unavailable; heap left as is",
                      worker_id)
        if self.inner is not None:
            self.inner(worker_id)


def _forks_workers(loader: Any) -> bool:
    """True for a torch DataLoader whose iter() starts worker processes."""
    try:
        from torch.utils.data import DataLoader
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(loader, DataLoader) and loader.num_workers > 0


@contextlib.contextmanager
def padded_workers(loader: Any, top_pad: int) -> Iterator[bool]:
    """While the block runs (``iter(loader)``), workers the loader starts pad their heaps.

    Yields whether the loader's worker_init_fn was wrapped: not for top_pad 0, for a
    loader that is not a DataLoader with workers, or where glibc's mallopt is missing.
    The loader's own worker_init_fn is put back when the block ends.
    """
    if top_pad <= 0 or not _forks_workers(loader) or glibc_mallopt() is None:
        yield False
        return
    original = loader.worker_init_fn
    if isinstance(original, PaddedWorkerInit):  # wrapped by an enclosing block already
        yield True
        return
    loader.worker_init_fn = PaddedWorkerInit(top_pad, original)
    try:
        yield True
    finally:
        loader.worker_init_fn = original
