"""The producer's epochs listed in full: each epoch's order as its sampler draws it, kept
for the consumers that ask for it before they read (tensorsocket.data.listings says why),
and the next epoch's drawn ahead when one asks before that epoch begins.

The loader's thread draws an epoch's order in full at the epoch's first draw, or takes
the one drawn ahead; the control thread draws ahead. One lock keeps the two from drawing
from the sampler at once, and keeps set_epoch() and the draw of an epoch together."""

from __future__ import annotations

import threading
from itertools import chain, islice
from typing import Any, Iterator

from ..data.listings import MAX_LISTED_IDS, EpochListing, listing_of
from ..loader.loader_info import set_sampler_epoch

KEPT_EPOCHS = 2  # listings kept: the running epoch and the next


class EpochPlanner:
    """The listings of the producer's epochs (see the module docstring).

    The loader's thread calls ``begin()`` with the lock held (``lock``) around the
    epoch's set_epoch, ``items(sampler)`` where the epoch draws from its sampler, and
    ``published()`` at the epoch's first batch out; the control thread calls
    ``epoch_at(seq, aligned)`` as a consumer starts and ``listing(epoch)``. Every field is
    read and written under the lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # held while drawing from the sampler or setting its epoch
        self._listings: dict[int, EpochListing] = {}  # by epoch number; KEPT_EPOCHS at most
        # Epoch -> the sampler a listing was drawn ahead from, until that epoch uses it.
        self._ahead: dict[int, Any] = {}
        self._source: Any = None  # the loader of the running epoch
        self._sampler: Any = None  # ... the sampler it draws from (None: not listed)
        self._batched = True  # ... which yields index lists (else indices)
        self._next_too = False  # ... and the next epoch's loader is the same one
        self._epoch = 0  # the epoch running, or next
        self._drawn = False  # its order was drawn (listed, or not: _failed says why)
        self._out = False  # its first batch was published
        self._starts: dict[int, int] = {}  # epoch -> its first entry, of the last few
        self._unlisted = "the producer's first epoch has not begun"  # why none, if none
        self._failed: dict[int, str] = {}  # epoch -> why its listing failed (not tried again)

    # -- the loader's thread ------------------------------------------------------------

    def begin(self, source: Any, epoch: int, sampler: tuple[Any, bool] | None,
              next_too: bool) -> None:
        """Epoch `epoch` of `source` begins (its sampler's epoch set). sampler: (the
        sampler its order is drawn from, whether it yields index lists), None where the
        order is not listed (not a DataLoader over a map-style dataset drawing in order);
        next_too: the next epoch is drawn from the same loader. A listing of this epoch
        number kept from before is dropped unless it was drawn ahead from this sampler (an
        epoch that yielded nothing runs again under its number; a loader replaced since
        draws another order). Called with the lock held."""
        self._source = source
        self._sampler, self._batched = sampler if sampler is not None else (None, True)
        self._next_too = next_too
        self._epoch = epoch
        self._drawn = self._out = False
        if self._sampler is None or self._ahead.get(epoch) is not self._sampler:
            self._listings.pop(epoch, None)
            self._failed.pop(epoch, None)
        self._ahead.pop(epoch, None)
        if sampler is None:
            self._unlisted = ("the producer's loader is not a DataLoader over a map-style "
                              "dataset that yields its batches in the order it draws them")

    def items(self, sampler: Any) -> Iterator[Any]:
        """What `sampler`, the running epoch's, yields for it (index lists or indices, as
        begin() said): the listing drawn ahead if there is one, else drawn now in full
        (at the first item asked for, where a lazy draw draws from the RNG too)."""
        with self.lock:
            self._drawn = True
            listing = self._listings.get(self._epoch)
            if listing is None:
                listing, rest = self._draw(sampler, self._epoch, ahead=False)
                if listing is None:
                    return rest
        return listing.items(self._batched)

    def published(self, seq: int) -> None:
        """The running epoch's first batch is out, as entry `seq` of the ring."""
        with self.lock:
            self._starts = {e: first for e, first in self._starts.items()
                            if e > self._epoch - KEPT_EPOCHS}
            self._starts[self._epoch] = seq
            self._out = True

    # -- the control thread -------------------------------------------------------------

    def epoch_at(self, seq: int, aligned: bool) -> int | None:
        """The epoch that a consumer which started at entry `seq` reads first: the first
        one whose first batch is that entry or a later one (an aligned consumer that
        starts within an epoch skips to the next one), told from the epochs' first
        entries, so that the answer does not depend on how far the producer went since
        (the ranks of a group, started at one entry, are told one by one). None for a
        consumer that is not aligned and started within an epoch: it reads on from there."""
        with self.lock:
            later = [epoch for epoch, first in self._starts.items() if first >= seq]
            if later:
                first = min(later)
                return first if aligned or self._starts[first] == seq else None
            if not aligned and self._out:
                return None
            return self._epoch + (1 if self._out else 0)

    def listing(self, epoch: int) -> EpochListing | str:
        """The listing of `epoch` (kept, or drawn ahead if it is the next one and the
        running one was drawn), or why not."""
        with self.lock:
            found = self._listings.get(epoch)
            if found is not None:
                return found
            if epoch in self._failed:
                return self._failed[epoch]
            if self._sampler is None:
                return self._unlisted
            if epoch == self._epoch and not self._drawn:
                listing = self._draw_ahead(epoch)
            elif epoch == self._epoch + 1 and self._next_too and self._drawn and \
                    self._epoch in self._listings:
                set_sampler_epoch(self._source, epoch)
                try:
                    listing = self._draw_ahead(epoch)
                finally:
                    set_sampler_epoch(self._source, self._epoch)
            elif epoch == self._epoch + 1 and not self._next_too:
                return ("the producer's loader is a callable that makes each epoch's loader "
                        "when that epoch begins")
            elif epoch == self._epoch + 1:
                return self._failed.get(self._epoch, "the producer's running epoch was not "
                                        "listed, so the next one is not drawn ahead")
            else:
                return (f"epoch {epoch} is not listed (the producer is at epoch "
                        f"{self._epoch})")
            return listing

    def _draw_ahead(self, epoch: int) -> EpochListing | str:
        """Draw `epoch` now, on the control thread, from the running epoch's sampler (its
        epoch set for it by the caller); why not, if not, kept so that it is not tried
        again: a sampler that raises here is the loader thread's to report, when its own
        draw comes. Called with the lock held."""
        try:
            listing, _ = self._draw(self._sampler, epoch, ahead=True)
        except Exception as e:  # (the sampler's own error: the loader thread meets it too)
            listing = None
            self._unlisted = f"drawing the producer's epoch {epoch} raised " \
                             f"{type(e).__name__}: {e}"
        if listing is None:
            self._failed[epoch] = self._unlisted
            return self._unlisted
        self._ahead[epoch] = self._sampler
        return listing

    def _draw(self, sampler: Any, epoch: int,
              ahead: bool) -> tuple[EpochListing | None, Iterator[Any]]:
        """(the listing of one pass of `sampler` for `epoch`, kept; or None, and what the
        pass yields instead, as drawn, unless `ahead`: for another time than the epoch's
        own first draw). None: the sampler has no len(), is its own iterator (drawing ahead
        would take from the epoch running), yields more than len() or keys that are not
        integer indices, or its epoch is too long to hold. Called with the lock held."""
        none: Iterator[Any] = iter(())
        try:
            length = len(sampler)
        except TypeError:
            return self._not_listed(epoch, "the producer's sampler has no len()"), \
                none if ahead else iter(sampler)
        per_item = getattr(sampler, "batch_size", 1) if self._batched else 1
        if length * (per_item if isinstance(per_item, int) and per_item > 0 else 1) > \
                MAX_LISTED_IDS:
            return self._not_listed(epoch, f"an epoch of the producer's loader is longer "
                                           f"than {MAX_LISTED_IDS} samples"), \
                none if ahead else iter(sampler)
        it = iter(sampler)
        if ahead and it is sampler:
            return self._not_listed(epoch, "the producer's sampler is its own iterator"), none
        drawn = list(islice(it, length + 1))
        try:
            if len(drawn) > length:
                raise ValueError(f"the producer's sampler yields more than its len() {length}")
            listing = listing_of(epoch, drawn, self._batched)
            if listing.samples > MAX_LISTED_IDS:
                raise ValueError(f"an epoch of more than {MAX_LISTED_IDS} samples")
        except (TypeError, ValueError) as e:
            return self._not_listed(epoch, f"the producer's epoch could not be listed: {e}"), \
                none if ahead else chain(drawn, it)
        self._listings[epoch] = listing
        for old in sorted(self._listings)[:-KEPT_EPOCHS]:
            del self._listings[old]
        return listing, none

    def _not_listed(self, epoch: int, why: str) -> None:
        """Note why `epoch` is not listed (kept: not tried again)."""
        self._unlisted = self._failed[epoch] = why
        for old in sorted(self._failed)[:-KEPT_EPOCHS]:
            del self._failed[old]
