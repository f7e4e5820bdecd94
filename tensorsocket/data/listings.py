"""The batches of a whole epoch, as index lists, listed before the epoch is read.

``consumer.batch_sampler`` lists the dataset indices of a consumer's batches of an epoch,
as a DataLoader's does; accelerate's ``skip_first_batches`` builds a DataLoader of its
own from it. Before a consumer's first epoch, that listing must be the order the
producer will deliver, the same for every rank of a group: each rank's own sampler
would draw another permutation from its own RNG, and the ranks' parts would overlap.

So the producer draws each epoch's order in full at the epoch's first draw (when a
sampler drawn lazily draws its RNG too, so the order is the one the loader gives
without tensorsocket), keeps it as an ``EpochListing``, and can draw the next epoch's
ahead when a consumer asks for it (producer/listings.py); consumers fetch it over the
control plane in parts (``part``, ``Assembly``) that fit a control message.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any, Iterator

import numpy as np

_IDS = np.dtype("<i8")
_SIZES = np.dtype("<i4")
# A listing is not drawn ahead for an epoch of more ids than this (8 bytes each): the
# sampler would be made to hold a whole epoch of a loader whose len() is a stream's.
MAX_LISTED_IDS = 1 << 25


@dataclass(frozen=True)
class EpochListing:
    """The index lists of one epoch's batches, in order: batch i is
    ``ids[ends[i - 1]:ends[i]]``."""

    epoch: int
    ids: np.ndarray  # int64, every batch's indices, one after the other
    ends: np.ndarray  # int64, where each batch ends in ids

    @property
    def batches(self) -> int:
        """Batches in the epoch."""
        return int(self.ends.size)

    def batch_lists(self) -> list[list[int]]:
        """The index list of each batch."""
        values = self.ids.tolist()
        starts = [0, *self.ends[:-1].tolist()]
        return [values[a:b] for a, b in zip(starts, self.ends.tolist())]

    def items(self, batched: bool) -> Iterator[Any]:
        """What the sampler yielded: the index lists (a batch sampler) or the indices (a
        sampler, whose batches are one index each)."""
        if not batched:
            return iter(self.ids.tolist())
        return (self.ids[a:b].tolist() for a, b in zip([0, *self.ends[:-1].tolist()],
                                                        self.ends.tolist()))

    def part(self, first: int, budget: int) -> tuple[bytes, bytes]:
        """(sizes, ids) of the batches from `first` on that fit in `budget` bytes (4 bytes
        a batch, 8 an index; at least one batch, whatever its size), as little-endian
        int32 and int64 bytes."""
        ends = self.ends
        start = int(ends[first - 1]) if first > 0 else 0
        cost = (ends[first:] - start) * _IDS.itemsize + \
            np.arange(1, ends.size - first + 1) * _SIZES.itemsize
        count = max(int(np.searchsorted(cost, budget, side="right")), 1)
        stop = first + min(count, ends.size - first)
        sizes = np.diff(np.concatenate(([start], ends[first:stop])))
        return (sizes.astype(_SIZES).tobytes(),
                self.ids[start:int(ends[stop - 1])].astype(_IDS, copy=False).tobytes())


def listing_of(epoch: int, items: list[Any], batched: bool) -> EpochListing:
    """The listing of what a sampler yielded for an epoch (index lists if `batched`, else
    indices); TypeError or ValueError for keys that are not integer indices."""
    if batched:
        sizes = np.fromiter((len(batch) for batch in items), np.int64, len(items))
        flat = list(chain.from_iterable(items))
    else:
        sizes, flat = np.ones(len(items), np.int64), items
    ids = np.asarray(flat)
    if ids.size and ids.dtype.kind not in "iu":
        raise TypeError(f"sampler keys of type {ids.dtype}, not integer indices")
    ids = ids.astype(np.int64).reshape(-1)
    if ids.size != int(sizes.sum()):
        raise ValueError("sampler keys that are not one index each")
    ids.setflags(write=False)
    ends = np.cumsum(sizes)
    ends.setflags(write=False)
    return EpochListing(epoch, ids, ends)


class Assembly:
    """A listing received in parts (the consumer's side of ``EpochListing.part``)."""

    def __init__(self, epoch: int, batches: int) -> None:
        """Nothing received yet of the `batches` batches of `epoch`."""
        self.epoch = epoch
        self.batches = batches
        self._sizes: list[np.ndarray] = []
        self._ids: list[np.ndarray] = []
        self.received = 0  # batches received

    def add(self, sizes: bytes, ids: bytes) -> None:
        """The next part; ValueError if it does not add up (a part of another listing)."""
        if len(sizes) % _SIZES.itemsize or len(ids) % _IDS.itemsize:
            raise ValueError("a part of a listing with a partial number")
        counts = np.frombuffer(sizes, _SIZES).astype(np.int64)
        values = np.frombuffer(ids, _IDS)
        if counts.size == 0 or (counts < 0).any() or int(counts.sum()) != values.size or \
                self.received + counts.size > self.batches:
            raise ValueError("a part of a listing that does not add up")
        self._sizes.append(counts)
        self._ids.append(values)
        self.received += int(counts.size)

    @property
    def complete(self) -> bool:
        """Whether every batch was received."""
        return self.received == self.batches

    def listing(self) -> EpochListing:
        """The listing received (once complete)."""
        ends = np.cumsum(np.concatenate(self._sizes)) if self._sizes else np.empty(0, np.int64)
        ids = np.concatenate(self._ids) if self._ids else np.empty(0, np.int64)
        return EpochListing(self.epoch, ids, ends)
