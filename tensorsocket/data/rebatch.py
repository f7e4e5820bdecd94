"""Re-batching: cut the producer's batches into batches of the consumer's size.

A batch is a nest of tuples, lists, dicts and namedtuples over tensors and
plain values, as the loader made it. Its sample count n is known from the
loader (its batch_size, and for the last batch of a DataLoader epoch its
sampler's length) or else taken from dimension 0 of its first tensor (depth
first) with at least one dimension. Cutting follows these rules:

- torch tensors and numpy arrays with a batch dimension are sliced along it
  (a view: zero-copy) or, when a consumer batch spans two loader batches,
  concatenated (one copy of just those samples). Every such tensor must have
  n as its first dimension, or the batch is refused with an error naming it.
- A list or tuple (not a namedtuple) of n items that are not all n-sample
  tensors is per-sample data: a list of strings from ``default_collate``, or
  the tuple of images or of target dicts of a detection-style
  ``collate_fn=lambda b: tuple(zip(*b))``. It is sliced and concatenated like
  a tensor. (Ambiguous, and read as n batched fields: a tuple of n items that
  each hold n rows themselves.)
- Anything else - plain values, 0-d tensors, numpy scalars - is per-batch
  data: it is passed through as is, and a consumer batch that spans two
  loader batches carries the value of the first.
"""

from __future__ import annotations

from typing import Any, Callable, cast

import numpy as np
import torch

from .epoch_cursor import InFlight

_PLAIN = (type(None), bool, int, float, str, bytes)


class EpochEnd(Exception):
    """Raised by a batch source when the consumer's epoch has no more batches."""


def batch_samples(batch: Any) -> int:
    """Sample count of a batch: dim 0 of its first tensor with a dimension."""
    n = _first_len(batch)
    if n is None:
        raise ValueError(
            "batch_size= needs batches with a batch dimension, but this batch holds no "
            "tensor or array with at least one dimension; use batch_size=None"
        )
    return n


def _first_len(obj: Any) -> int | None:
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return int(obj.shape[0]) if obj.ndim >= 1 else None
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for item in obj:
            n = _first_len(item)
            if n is not None:
                return n
    return None


def _is_sample_seq(obj: Any, n: int) -> bool:
    """A list or tuple of the batch's n samples (not a structure of batched fields)."""
    if not isinstance(obj, (list, tuple)) or hasattr(type(obj), "_fields"):
        return False
    if len(obj) != n or n == 0:
        return False
    fields = [v for v in obj if not isinstance(v, _PLAIN)]
    return not fields or not all(_looks_batched(v, n) for v in fields)


def _looks_batched(obj: Any, n: int) -> bool:
    """obj holds n samples: an n-row tensor, an n-long sequence, or a structure of them."""
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return obj.ndim >= 1 and obj.shape[0] == n
    if isinstance(obj, dict):
        return any(_looks_batched(v, n) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        if len(obj) == n and not hasattr(type(obj), "_fields"):
            return True
        return any(_looks_batched(v, n) for v in obj)
    return False


# A piece of a consumer batch: samples [start, stop) of a loader batch of n samples.
Piece = tuple[Any, int, int, int]


def combine(pieces: list[Piece]) -> Any:
    """The consumer batch made of these pieces, in order."""
    obj, start, stop, n = pieces[0]
    if len(pieces) == 1 and start == 0 and stop == n:
        return obj  # a whole loader batch: hand it over untouched
    return _combine(pieces, "batch")


def _combine(pieces: list[Piece], path: str) -> Any:
    first = pieces[0][0]
    if isinstance(first, (torch.Tensor, np.ndarray)):
        if first.ndim == 0:
            return first
        parts = []
        for obj, start, stop, n in pieces:
            if not isinstance(obj, type(first)) or obj.ndim == 0 or obj.shape[0] != n:
                shape = tuple(getattr(obj, "shape", ()))
                raise ValueError(
                    f"cannot cut {path} (shape {shape}) into batch_size= batches: the batch has "
                    f"{n} samples, and every tensor with a dimension must have them along "
                    "dimension 0; use batch_size=None for this loader"
                )
            parts.append(obj[start:stop])
        if len(parts) == 1:
            return parts[0]
        if isinstance(first, torch.Tensor):
            return torch.cat(cast("list[torch.Tensor]", parts))
        return np.concatenate(parts)
    if _is_sample_seq(first, pieces[0][3]):
        out: list = []
        for obj, start, stop, n in pieces:
            if not _is_sample_seq(obj, n):
                raise ValueError(f"{path} is per-sample in one batch but not in the next")
            out.extend(obj[start:stop])
        return out if isinstance(first, list) else tuple(out)
    if isinstance(first, (list, tuple)):
        width = len(first)
        for obj, *_ in pieces[1:]:
            if type(obj) is not type(first) or len(obj) != width:
                raise ValueError(f"{path} changes structure between loader batches")
        items = [_combine([(obj[j], s, e, n) for obj, s, e, n in pieces], f"{path}[{j}]")
                 for j in range(width)]
        if isinstance(first, list):
            return items
        if hasattr(type(first), "_fields"):
            return type(first)(*items)
        return tuple(items)
    if isinstance(first, dict):
        keys = list(first.keys())
        for obj, *_ in pieces[1:]:
            if not isinstance(obj, dict) or list(obj.keys()) != keys:
                raise ValueError(f"{path} changes keys between loader batches")
        return {k: _combine([(obj[k], s, e, n) for obj, s, e, n in pieces], f"{path}[{k!r}]")
                for k in keys}
    return first  # per-batch value: the first loader batch's


class Rebatcher:
    """Cuts a stream of loader batches into batches of batch_size samples.

    next_batch(pull, flow) makes the next consumer batch (into flow.ready);
    pull() gives the next loader batch of the consumer's epoch with its sample
    count if known (else None), or raises EpochEnd. At the end of an
    epoch the last, partial batch is returned unless drop_last; then EpochEnd
    propagates. Samples never cross an epoch boundary.
    """

    def __init__(self, batch_size: int, drop_last: bool = False) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
        self.batch_size = batch_size
        self.drop_last = drop_last
        self._current: list | None = None  # [loader batch, n, offset, sample ids or None]
        # The pieces of the batch being made. They are state, not a local of next_batch:
        # when pull() raises (batch_timeout's TimeoutError, a KeyboardInterrupt while it
        # waits) and the caller goes on, the next batch starts with them.
        self._pieces: list[Piece] = []
        self._piece_ids: list = []  # the sample ids of each piece (None: unknown)
        self.dropped_samples = 0
        self.handed_over = 0  # batches made so far (their count names each one)

    def reset(self) -> None:
        """Forget a partly used loader batch and a partly made batch (the epoch was cut
        short)."""
        self._current = None
        self._pieces, self._piece_ids = [], []

    def held_ids(self) -> list:
        """The sample ids of the samples taken from loader batches and not yet handed
        over, in order (None for those of a batch without ids)."""
        held = list(self._piece_ids)
        if self._current is not None:
            _, n, offset, ids = self._current
            held.append(None if ids is None else ids[offset:n])
        return held

    def holding(self) -> bool:
        """Whether samples taken from the loader's batches are not yet returned."""
        return self._current is not None or bool(self._pieces)

    def next_batch(self, pull: Callable[[], Any], flow: InFlight) -> None:
        """Make the next consumer batch of the loader batches pull() gives (see the class
        docstring), into ``flow.ready`` as (batch, samples, sample ids or None). pull()
        makes the next loader batch into ``flow.loaded`` ((batch, samples or None, sample
        ids or None)), unless one is there, and
        returns it; it leaves there in the step that puts it here. If pull() raises
        anything but EpochEnd (batch_timeout's TimeoutError, a KeyboardInterrupt), or an
        interrupt lands anywhere here, the samples taken so far stay for the next call:
        every change is one step with no call in it."""
        while (need := self.batch_size - _samples_of(self._pieces)) > 0:
            if self._current is None:
                try:
                    batch, n, ids = pull()
                except EpochEnd:
                    if self._pieces and not self.drop_last:
                        self._hand_over(flow, self.batch_size - need)
                        return
                    dropped = self.dropped_samples + _samples_of(self._pieces)
                    self.dropped_samples, self._pieces, self._piece_ids = dropped, [], []
                    raise
                if n is None:
                    n = batch_samples(batch)
                self._current, flow.loaded = ([batch, n, 0, ids] if n else None), None
                continue
            batch, n, offset, ids = self._current
            take = min(need, n - offset)
            piece = (batch, offset, offset + take, n)
            rest = None if offset + take == n else [batch, n, offset + take, ids]
            piece_ids = None if ids is None else ids[offset:offset + take]
            # In one step: the samples are never both in the batch being made and still
            # in _current, nor in neither.
            self._pieces, self._piece_ids, self._current = \
                self._pieces + [piece], self._piece_ids + [piece_ids], rest
        self._hand_over(flow, self.batch_size)

    def _hand_over(self, flow: InFlight, samples: int) -> None:
        """The batch of the pieces taken, into flow.ready: they leave in the same step
        (an exception while it is made leaves them here)."""
        batch = combine(self._pieces)
        ids = self._piece_ids
        joined = None if any(i is None for i in ids) else np.concatenate(ids)
        flow.ready, self._pieces, self._piece_ids, self.handed_over = \
            (batch, samples, joined), [], [], self.handed_over + 1


def _samples_of(pieces: list[Piece]) -> int:
    return sum(stop - start for _, start, stop, _ in pieces)


def consumer_len(samples: int, batch_size: int, drop_last: bool) -> int:
    """Batches per epoch for `samples` samples."""
    return samples // batch_size if drop_last else -(-samples // batch_size)
