"""The data loader's passes, one per epoch: the iterable of each epoch (the loader, or
what the callable returns for it), its len(), the sampler's set_epoch, and the loader
mistakes said in words (an iterator used up, a len() shorter than what it yields)."""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Iterable, Iterator

from ..errors import TensorSocketWarning
from ..loader.loader_info import epoch_factory, epoch_limit, is_iterable, length_of, \
    set_sampler_epoch
from ..loader.worker_heap import padded_workers

log = logging.getLogger("tensorsocket")


class LoaderEpochs:
    """The epochs of a data loader (see TensorProducer's docstring for what it may be).

    ``epoch`` is the number of the epoch running or next; ``current`` the loader of the
    current epoch (the iterable itself, or what the callable returned for it; None before
    a callable's first epoch); ``sets_epoch`` whether its sampler has set_epoch, which is
    called."""

    def __init__(self, data_loader: Iterable | Callable[..., Iterable]) -> None:
        """TypeError for something that is neither iterable nor callable."""
        self._factory = epoch_factory(data_loader)
        self._loader = data_loader
        self.current: Any = data_loader if self._factory is None else None
        self.epoch = 0
        self.sets_epoch = False
        self._used_up: Any = None  # the last iterator that yielded batches
        self._warned_cut = False  # said once that len() cut an epoch of a longer loader

    @property
    def loader(self) -> Iterable | Callable[..., Iterable]:
        """The data loader as given (an iterable, or a callable of the epoch number)."""
        return self._loader

    @loader.setter
    def loader(self, loader: Iterable | Callable[..., Iterable]) -> None:
        """Another iterable for the next epochs (a callable's epochs come from the
        callable given first, as before the producer was split into parts)."""
        self._loader = loader
        if self._factory is None:
            self.current = loader

    def length(self) -> int | None:
        """Batches per epoch: len() of the current epoch's loader, if it has one."""
        return length_of(self.current)

    def known_length(self) -> int:
        """Batches per epoch; TypeError if the loader has no len() (a generator, an
        iterable without ``__len__``, or a callable before its first epoch)."""
        n = self.length()
        if n is None:
            what = "the data loader has no len()" if self._factory is None else \
                "the iterable the data loader callable returned has no len()" \
                if self.current is not None else \
                "the data loader is a callable, and its first epoch has not started"
            raise TypeError(f"{what}: the number of batches per epoch is unknown")
        return n

    def start(self) -> tuple[Any, int | None]:
        """The iterable of this epoch, with set_epoch called on its sampler, and the
        batches it may yield (its len(), None without one)."""
        source = self._source()
        self.sets_epoch = set_sampler_epoch(source, self.epoch) or self.sets_epoch
        return source, epoch_limit(source)

    def _source(self) -> Any:
        """The iterable of this epoch: the loader, or what the callable returns."""
        if self._factory is None:
            return self._loader
        source = self._factory(self.epoch)
        if not is_iterable(source):
            raise TypeError(
                f"the data loader callable returned {type(source).__name__!r} for epoch "
                f"{self.epoch}, which is not iterable: it must return an iterable of batches"
            )
        self.current = source
        return source

    def iterate(self, source: Any, heap_pad: int) -> Iterator[Any]:
        """iter(source), its DataLoader workers (if any) started with `heap_pad` bytes
        kept at the top of their heaps."""
        with padded_workers(source, heap_pad) as padded:
            it = iter(source)
        if padded:
            log.debug("epoch %d: the loader's workers keep %d bytes at the top of their heaps",
                      self.epoch, heap_pad)
        return it

    def yielded(self, source: Any) -> None:
        """An iterator (a one-shot source) yielded a batch: if it yields nothing next
        epoch, it is used up."""
        self._used_up = source

    def ended_empty(self, source: Any, one_shot: bool) -> None:
        """The epoch of `source` yielded no batch: TypeError for an iterator that an
        earlier epoch used up, else a warning in the log."""
        if one_shot and source is self._used_up:
            raise TypeError(self._used_up_message(source))
        log.warning("epoch %d of the data loader yielded no batch; nothing was published",
                    self.epoch)

    def warn_cut(self, source: Any, limit: int) -> None:
        """Say once that epochs of `source` end at its len() while it yields more."""
        if self._warned_cut:
            return
        self._warned_cut = True
        message = (
            f"the data loader (a {type(source).__qualname__!r} object) has len() {limit} but "
            f"yields more batches (a batch {limit + 1} came in epoch {self.epoch}): each "
            f"epoch is cut at len() = {limit} batches, and the rest of what it yields is "
            "never published. "
            "Make __len__ return the number of batches one pass yields, or drop __len__ "
            "for a loader that ends by itself (this is said once)")
        log.warning("%s", message)
        warnings.warn(message, TensorSocketWarning, stacklevel=4)

    def _used_up_message(self, source: Any) -> str:
        """Why an iterator cannot give a second epoch, and what to pass instead."""
        what = f"{type(source).__name__!r} object"
        if self._factory is None:
            problem = (f"the data loader is an iterator (a {what}) that epoch "
                       f"{self.epoch - 1} used up: iterating it again yields nothing, so "
                       f"epoch {self.epoch} would publish nothing")
        else:
            problem = (f"the data loader callable returned the same {what} for epoch "
                       f"{self.epoch} as for epoch {self.epoch - 1}, an iterator that epoch "
                       f"{self.epoch - 1} used up, so epoch {self.epoch} would publish nothing")
        return (
            f"{problem}. Pass an object that can be iterated again (a DataLoader, a list, a "
            "class whose __iter__ starts a new pass), or a callable that returns a fresh "
            "iterable for each epoch: TensorProducer(lambda: make_batches()), or "
            "TensorProducer(lambda epoch: make_batches(epoch)) to receive the epoch number"
        )
