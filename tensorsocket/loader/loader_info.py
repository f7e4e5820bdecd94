"""What a data loader tells about itself, read without running it.

The producer reads its loader's length, batch size, sample count and dataset
(for the consumers' ``len()`` and re-batching, and share()'s stale-producer
check), calls ``set_epoch`` on its samplers and finds out how to get each
epoch's iterable; share() reads the same of the caller's own loader, which it
never runs. Everything here only looks at attributes: ``iter()`` on a
DataLoader would start its workers.

``LoaderShape`` is the consumer's side of it: what the producer said of its
loader (the ``welcome`` and ``loader_info`` control messages), and the sample
counts that follow from it.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..data.rebatch import consumer_len

if TYPE_CHECKING:
    from ..control.protocol import LoaderInfo, Welcome

log = logging.getLogger("tensorsocket")

def length_of(loader: Any) -> int | None:
    """``len(loader)`` if it has one, else None (a generator, an iterable without
    ``__len__``, an IterableDataset's DataLoader, None)."""
    if loader is None:
        return None
    try:
        return len(loader)
    except (TypeError, NotImplementedError):
        return None


def epoch_limit(loader: Any) -> int | None:
    """Batches after which an epoch of `loader` ends: its positive ``len()``, else None
    (the loader's own end)."""
    n = length_of(loader)
    return n if isinstance(n, int) and n > 0 else None


def batch_size_of(loader: Any) -> int | None:
    """The loader's ``batch_size`` if it is an int (not a bool), else None."""
    bs = getattr(loader, "batch_size", None)
    return bs if isinstance(bs, int) and not isinstance(bs, bool) else None


def drop_last_of(loader: Any) -> bool:
    """The loader's ``drop_last`` (False where it has none)."""
    return bool(getattr(loader, "drop_last", False))


def samples_per_epoch(loader: Any) -> tuple[int | None, bool]:
    """(samples one epoch of the loader yields, whether that count is exact).

    Exact for a torch DataLoader (its sampler's length, or full batches with
    drop_last); for another loader with a batch_size and a len(), full batches
    are assumed."""
    bs = batch_size_of(loader)
    if bs is None:
        return None, False
    try:
        batches = len(loader)
    except TypeError:
        return None, False
    if getattr(loader, "batch_sampler", None) is not None:
        if getattr(loader, "drop_last", False):
            return batches * bs, True
        try:
            return min(len(loader.sampler), batches * bs), True
        except (AttributeError, TypeError):
            pass
    return batches * bs, False


def data_identity(loader: Any) -> tuple[str | None, int | None]:
    """(type name, length) of what a loader reads: its ``dataset`` when it has one (a
    DataLoader), else the loader itself; None where unknown (a callable's loader before
    its first epoch, an object without ``len()``)."""
    if loader is None:
        return None, None
    data = getattr(loader, "dataset", loader)
    kind = type(data)
    try:
        size = len(data)
    except Exception:  # no len(), or an IterableDataset's TypeError
        size = None
    return f"{kind.__module__}.{kind.__qualname__}", size


def fingerprint_of(loader: Any) -> str | None:
    """The loader's pipeline description for share()'s stale-producer check
    (tensorsocket.loader.fingerprint); None if it cannot be told."""
    from .fingerprint import describe

    try:
        return describe(loader)
    except Exception:  # a loader that resists description is simply not compared
        log.debug("cannot fingerprint the loader", exc_info=True)
        return None


def describe_loader(loader: Any) -> dict[str, Any]:
    """What a welcome and a loader_info tell of the producer's loader (their fields
    from length to fingerprint), of a loader (None: a callable's, before its first
    epoch)."""
    samples, exact = samples_per_epoch(loader)
    dataset, dataset_len = data_identity(loader)
    return {
        "length": length_of(loader),
        "loader_batch_size": batch_size_of(loader),
        "samples": samples,
        "samples_exact": exact,
        "dataset": dataset,
        "dataset_len": dataset_len,
        "fingerprint": fingerprint_of(loader),
    }


def set_sampler_epoch(loader: Any, epoch: int) -> bool:
    """Call set_epoch(epoch) on the loader's sampler and batch sampler where they have one
    (a DistributedSampler, say), as a training loop does before each epoch; True if any
    did. The consumers' ``sampler.set_epoch`` then has nothing left to do."""
    called = False
    seen: set[int] = set()
    batch_sampler = getattr(loader, "batch_sampler", None)
    for obj in (getattr(loader, "sampler", None), batch_sampler,
                getattr(batch_sampler, "sampler", None)):
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        set_epoch = getattr(obj, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
            called = True
    return called


def is_iterable(obj: Any) -> bool:
    """True if iter(obj) works, told without calling it (iter() on a DataLoader
    would start its workers)."""
    return hasattr(type(obj), "__iter__") or hasattr(type(obj), "__getitem__")


def epoch_factory(loader: Any) -> Callable[[int], Any] | None:
    """None for an iterable loader; for a callable, a function epoch -> its result
    (called with the epoch number if it has a required positional parameter)."""
    if is_iterable(loader):
        return None
    if not callable(loader):
        raise TypeError(
            f"data_loader must be an iterable of batches (a DataLoader, a list, a generator, "
            f"...) or a callable that returns one for each epoch, not "
            f"{type(loader).__name__!r}"
        )
    try:
        params = inspect.signature(loader).parameters.values()
    except (TypeError, ValueError):  # no signature (some builtins): call it bare
        return lambda epoch: loader()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p.name for p in params if p.default is p.empty and p.kind in positional]
    keyword_only = [p.name for p in params
                    if p.default is p.empty and p.kind == inspect.Parameter.KEYWORD_ONLY]
    if len(required) > 1 or keyword_only:
        raise TypeError(
            f"a callable data_loader is called with no argument, or with the epoch number if "
            f"it has a required positional parameter; {loader!r} requires "
            f"{', '.join(required + keyword_only)}"
        )
    if required:
        return lambda epoch: loader(epoch)
    return lambda epoch: loader()


@dataclass(frozen=True)
class LoaderShape:
    """The producer's loader as a consumer knows it (from the producer's reply):
    batches per epoch (None: no len()), samples per loader batch (None: not an int
    batch_size), samples per epoch (None: unknown) and whether that count is exact
    (else full batches are assumed)."""

    length: int | None
    batch_size: int | None
    samples: int | None
    samples_exact: bool

    @classmethod
    def of_reply(cls, reply: Welcome | LoaderInfo) -> "LoaderShape":
        """The shape a welcome or loader_info reply describes."""
        return cls(reply.length, reply.loader_batch_size, reply.samples, reply.samples_exact)

    def samples_in(self, index: int) -> int | None:
        """Samples in loader batch `index` of an epoch, when the loader tells."""
        size, length = self.batch_size, self.length
        if size is None or length is None:
            return None
        if index < length - 1:
            return size
        if self.samples_exact and self.samples is not None:
            return self.samples - (length - 1) * size
        return None

    def rank_samples(self, rank: int, world_size: int) -> int:
        """Samples one epoch brings rank `rank` of a group of `world_size` (the loader
        batches rank, rank + world_size, ... of the first len // world_size * world_size;
        the whole epoch for a lone consumer). Needs the sample count."""
        assert self.samples is not None
        if world_size == 1:
            return self.samples
        assert self.length is not None
        total = 0
        for i in range(rank, self.length // world_size * world_size, world_size):
            n = self.samples_in(i)
            total += n if n is not None else (self.batch_size or 0)
        return total

    def same_batches(self, batch_size: int, drop_last: bool) -> bool:
        """Whether the loader's batches are those of `batch_size` samples with
        `drop_last` (a consumer asking for them can take the loader's as they are)."""
        if self.batch_size != batch_size:
            return False
        if self.length is None or self.samples is None:
            return not drop_last
        return consumer_len(self.samples, batch_size, drop_last) == self.length
