"""Which dataset samples make each batch, and which of an epoch a consumer took.

Exact resume (docs/usage.md, "Checkpoints and restarts") needs to know the
samples of every batch. The producer knows them: a DataLoader over a
map-style dataset draws the indices of each batch from its batch sampler (or
sampler), in order, and yields the batches in that order (with workers too,
unless ``in_order=False``). ``SampleIdRecorder`` puts a recording wrapper in
front of that sampler for the epoch, and hands out the indices drawn, one batch
at a time, as the batches come out.

The indices travel in the slot's meta blob, after the structure blob, never
as a leaf the user sees (``with_ids`` / ``split``): a msgpack blob never
starts with the byte 0xc1, so a meta that does is ours.

``IdMask`` is a set of sample ids held as a bitmap (one bit per sample of
the dataset), and its compact text form for ``state_dict()``: zlib over the
packed bits, base64 (at most ``ceil(N / 8)`` bytes before base64, and far
less when the samples taken are runs, as unshuffled ones are).
"""

from __future__ import annotations

import base64
import collections
import logging
import struct
import zlib
from typing import Any, Callable, Iterator

import numpy as np

log = logging.getLogger("tensorsocket")

_MARK = b"\xc1"  # never the first byte of a msgpack object
_HEADER = struct.Struct("<I")  # bytes of the structure blob that follows the mark
_ID_DTYPE = np.dtype("<i8")


# -- the ids in a slot's meta ----------------------------------------------------------

def with_ids(structure: bytes, ids: np.ndarray | None) -> bytes:
    """The meta blob of a batch: its structure blob, followed by its sample ids if known."""
    if ids is None:
        return structure
    return b"".join((_MARK, _HEADER.pack(len(structure)), structure,
                     ids.astype(_ID_DTYPE, copy=False).tobytes()))


def split(meta: bytes) -> tuple[bytes, np.ndarray | None]:
    """(structure blob, sample ids or None) of a slot's meta blob (see with_ids)."""
    if meta[:1] != _MARK:
        return meta, None
    (length,) = _HEADER.unpack_from(meta, 1)
    start = 1 + _HEADER.size
    return meta[start:start + length], np.frombuffer(meta, _ID_DTYPE, offset=start + length)


# -- the producer's side: the indices each batch was made of ----------------------------

class SampleIdRecorder:
    """The dataset indices of the batches a DataLoader yields, in order (see the module
    docstring). ``recording(source)`` wraps the iter() call of each epoch; ``next_ids()``
    gives the indices of the batch just yielded (None when they are not known: not a
    DataLoader over a map-style dataset, workers out of order, keys that are not ints)."""

    def __init__(self, order: Callable[[Any], Iterator[Any]] | None = None) -> None:
        """order(sampler): what the sampler yields for the running epoch, if not a pass of
        it (the producer's EpochPlanner.items, which lists the epoch in full)."""
        self._order = order
        self._drawn: collections.deque = collections.deque()  # drawn, oldest first
        self._recording = False  # this epoch's indices are recorded
        self._off_reason: str | None = None  # why ids are off for good (said once)
        # The wrapper, one per loader for all its epochs: a DataLoader with
        # persistent_workers keeps the sampler its first iterator took and draws each
        # later epoch from it (_BaseDataLoaderIter._index_sampler).
        self._wrapper: _RecordingSampler | None = None
        self._wrapped_loader: Any = None

    def recording(self, source: Any) -> "_Recording":
        """A context manager around an epoch of `source`: its iterator draws its indices
        through a recording wrapper."""
        attribute = self._sampler_attribute(source)
        self._drawn.clear()  # (indices drawn ahead for an epoch cut short)
        self._recording = attribute is not None
        if attribute is None:
            return _Recording(source, None, None)
        inner = recorded_sampler(getattr(source, attribute))
        wrapper = self._wrapper
        if wrapper is None or self._wrapped_loader is not source or wrapper.wrapped is not inner:
            wrapper = _RecordingSampler(inner, self._drawn, attribute == "batch_sampler",
                                        self._order)
            self._wrapper, self._wrapped_loader = wrapper, source
        return _Recording(source, attribute, wrapper)

    def sampler_of(self, source: Any) -> tuple[Any, bool] | None:
        """(the sampler that draws the indices of `source`'s batches, whether it draws
        index lists), or None where ids are not known for it (see next_ids)."""
        attribute = self._sampler_attribute(source)
        if attribute is None:
            return None
        return recorded_sampler(getattr(source, attribute)), attribute == "batch_sampler"

    def next_ids(self) -> np.ndarray | None:
        """The indices of the batch the loader just yielded (its collate_fn was given the
        samples of these, in this order)."""
        drawn = self._drawn
        if not self._recording or self._off_reason is not None:
            return None
        if not drawn:
            self._off("the loader yielded a batch its sampler did not draw indices for")
            return None
        try:
            ids = np.asarray(drawn.popleft(), dtype=np.int64).reshape(-1)
        except (TypeError, ValueError, OverflowError):
            self._off("its sampler draws keys that are not integer indices")
            return None
        return ids

    def _sampler_attribute(self, source: Any) -> str | None:
        """The DataLoader attribute that draws the indices of `source`'s batches, or None
        (ids are not known for it)."""
        from torch.utils.data import DataLoader, IterableDataset

        if self._off_reason is not None or not isinstance(source, DataLoader):
            return None
        if isinstance(source.dataset, IterableDataset):
            return None
        if source.num_workers > 0 and getattr(source, "in_order", True) is False:
            self._off("it runs workers with in_order=False, so batches may come out of the "
                      "order their indices were drawn in")
            return None
        return "batch_sampler" if source.batch_sampler is not None else "sampler"

    def _off(self, reason: str) -> None:
        """Stop carrying ids for the rest of this producer's run, saying why once."""
        if self._off_reason is None:
            self._off_reason = reason
            log.warning("the producer does not tell consumers which samples make each batch "
                        "from now on: %s. A consumer resumed from a checkpoint then skips "
                        "batches by count instead (docs/usage.md)", reason)


class _Recording:
    """``with recorder.recording(loader): <one epoch of loader>`` (see SampleIdRecorder)."""

    def __init__(self, source: Any, attribute: str | None,
                 wrapper: "_RecordingSampler | None") -> None:
        self._source, self._attribute, self._wrapper = source, attribute, wrapper
        self._inner: Any = None

    def __enter__(self) -> None:
        if self._attribute is None:
            return
        self._inner = getattr(self._source, self._attribute)
        # DataLoader refuses to set its samplers after __init__ (its __setattr__): the
        # wrapper stands in for the epoch (descriptions see through it: recorded_sampler).
        object.__setattr__(self._source, self._attribute, self._wrapper)

    def __exit__(self, *exc: object) -> None:
        if self._attribute is not None:
            object.__setattr__(self._source, self._attribute, self._inner)


def recorded_sampler(sampler: Any) -> Any:
    """The loader's own sampler behind a recording wrapper (the sampler itself if it is
    not one): what a description of the loader names."""
    return sampler.wrapped if isinstance(sampler, _RecordingSampler) else sampler


class _RecordingSampler:
    """A sampler that draws from `inner` and notes each batch of indices it draws."""

    def __init__(self, inner: Any, drawn: Any, batched: bool,
                 order: Callable[[Any], Iterator[Any]] | None) -> None:
        self._inner, self._drawn, self._batched = inner, drawn, batched
        self._order = order  # see SampleIdRecorder

    @property
    def wrapped(self) -> Any:
        """The loader's own sampler."""
        return self._inner

    def __iter__(self) -> Iterator[Any]:
        drawn, batched = self._drawn, self._batched
        for item in self._inner if self._order is None else self._order(self._inner):
            drawn.append(item if batched else (item,))
            yield item

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


# -- the consumer's side: the samples of an epoch taken ---------------------------------

class IdMask:
    """A set of sample ids in [0, size), as one bool per sample; grows for a larger id."""

    __slots__ = ("bits",)

    def __init__(self, size: int = 0) -> None:
        self.bits = np.zeros(max(size, 0), dtype=bool)

    @classmethod
    def whole(cls, size: int) -> "IdMask":
        """The set of every id in [0, size)."""
        mask = cls()
        mask.bits = np.ones(size, dtype=bool)
        return mask

    def add(self, ids: np.ndarray) -> None:
        """Put `ids` in the set."""
        if ids.size == 0:
            return
        self.grow(int(ids.max()) + 1)
        self.bits[ids] = True

    def grow(self, size: int) -> None:
        """Make room for the ids below `size` (the consumer's common path marks ids in
        place, in C: tensorsocket._core.Lane)."""
        if size > self.bits.size:
            self.bits = np.concatenate([self.bits, np.zeros(size - self.bits.size, bool)])

    def copy(self) -> "IdMask":
        """A new set of the same ids."""
        out = IdMask()
        out.bits = self.bits.copy()
        return out

    def union(self, other: "IdMask") -> "IdMask":
        """A new set: this one and `other`."""
        out = IdMask(max(self.bits.size, other.bits.size))
        out.bits[:self.bits.size] |= self.bits
        out.bits[:other.bits.size] |= other.bits
        return out

    def count(self) -> int:
        """Ids in the set."""
        return int(np.count_nonzero(self.bits))

    def contains(self, ids: np.ndarray) -> np.ndarray:
        """A bool per id of `ids`: whether it is in the set."""
        inside = ids < self.bits.size
        out = np.zeros(ids.shape, dtype=bool)
        out[inside] = self.bits[ids[inside]]
        return out

    def to_text(self, size: int) -> str:
        """The set of ids in [0, size) as ASCII text (zlib over the packed bits, base64),
        for JSON."""
        bits = self.bits[:size]
        if bits.size < size:
            bits = np.concatenate([bits, np.zeros(size - bits.size, bool)])
        packed = np.packbits(bits).tobytes()
        return base64.b64encode(zlib.compress(packed, 6)).decode("ascii")

    @classmethod
    def from_text(cls, text: str, size: int) -> "IdMask":
        """The set of to_text() for ids in [0, size); ValueError if it is not one."""
        try:
            packed = zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True))
        except (ValueError, zlib.error, UnicodeEncodeError) as e:
            raise ValueError(f"the 'taken' field of the state is not a set of sample ids "
                             f"({e})") from None
        if len(packed) != (size + 7) // 8:
            raise ValueError(f"the 'taken' field of the state holds {len(packed) * 8} bits, "
                             f"for a dataset of {size} samples it must hold {size}")
        mask = cls()
        mask.bits = np.unpackbits(np.frombuffer(packed, np.uint8), count=size).astype(bool)
        return mask
