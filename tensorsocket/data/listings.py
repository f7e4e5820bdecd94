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
# An epoch of more ids than this (8 bytes each) is not listed: the producer would hold a
# whole epoch of a loader whose len() is a stream's.
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
        return list(self.items(batched=True))

    def items(self, batched: bool) -> Iterator[Any]:
        """What the sampler yielded: the index lists (a batch sampler) or the indices (a
        sampler, whose batches are one index each); one batch at a time."""
        if not batched:
            return iter(self.ids.tolist())
        ends = self.ends.tolist()
        return (self.ids[a:b].tolist() for a, b in zip([0, *ends[:-1]], ends))

    @property
    def samples(self) -> int:
        """Indices in the epoch (all its batches')."""
        return int(self.ids.size)

    def part(self, first_batch: int, first_id: int, size_budget: int,
             id_budget: int) -> tuple[bytes, bytes]:
        """(sizes, ids): the sizes of the batches from `first_batch` on and the indices from
        `first_id` on, as many as fit in `size_budget` and `id_budget` bytes (little-endian
        int32 and int64). The two advance apart, so that a batch larger than a part is sent
        over several."""
        stop = first_batch + max(size_budget // _SIZES.itemsize, 1)
        start = self.ends[first_batch - 1:first_batch] if first_batch > 0 else [0]
        sizes = np.diff(np.concatenate((start, self.ends[first_batch:stop])))
        ids = self.ids[first_id:first_id + max(id_budget // _IDS.itemsize, 1)]
        return sizes.astype(_SIZES).tobytes(), ids.astype(_IDS).tobytes()


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
    """A listing received in parts (the consumer's side of ``EpochListing.part``): the
    batch sizes and the indices, each in order."""

    def __init__(self, epoch: int, batches: int, samples: int) -> None:
        """Nothing received yet of the `batches` batches (`samples` indices) of `epoch`."""
        self.epoch, self.batches, self.samples = epoch, batches, samples
        self._sizes: list[np.ndarray] = []
        self._ids: list[np.ndarray] = []
        self.received_batches = self.received_ids = 0

    def add(self, sizes: bytes, ids: bytes) -> None:
        """The next part; ValueError if it does not add up (a part of another listing)."""
        if len(sizes) % _SIZES.itemsize or len(ids) % _IDS.itemsize:
            raise ValueError("a part of a listing with a partial number")
        counts = np.frombuffer(sizes, _SIZES).astype(np.int64)
        values = np.frombuffer(ids, _IDS)
        if (counts < 0).any() or counts.size == values.size == 0 or \
                self.received_batches + counts.size > self.batches or \
                self.received_ids + values.size > self.samples:
            raise ValueError("a part of a listing that does not add up")
        self._sizes.append(counts)
        self._ids.append(values)
        self.received_batches += int(counts.size)
        self.received_ids += int(values.size)

    @property
    def complete(self) -> bool:
        """Whether every batch size and every index was received."""
        return self.received_batches == self.batches and self.received_ids == self.samples

    def listing(self) -> EpochListing:
        """The listing received (once complete); ValueError if its sizes do not add up to
        its indices."""
        sizes = np.concatenate(self._sizes) if self._sizes else np.empty(0, np.int64)
        ids = np.concatenate(self._ids) if self._ids else np.empty(0, np.int64)
        if int(sizes.sum()) != ids.size:
            raise ValueError("a listing whose batch sizes do not add up to its indices")
        return EpochListing(self.epoch, ids, np.cumsum(sizes))
