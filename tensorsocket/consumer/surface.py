"""What training code reads from a DataLoader, on a TensorConsumer.

Frameworks and training scripts do more with a loader than iterate it: they
read ``loader.dataset``, ``loader.batch_size`` and ``loader.sampler``, call
``loader.sampler.set_epoch(epoch)`` (DistributedSampler), save and restore
``state_dict()`` (torchdata's StatefulDataLoader convention), and read or set
attributes of their own loader types (timm's ``mixup_enabled``). ``LoaderSurface``
gives a TensorConsumer those, with the meaning each has for a shared loader: the
consumer holds one and hands these on to it.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from ..errors import TensorSocketError, TensorSocketWarning
from ..data.listings import EpochListing
from .book import ResumeBook
from .epoch_state import EpochState
from .options import ConsumerOptions, SharedLoader
from .place import RingPlace
from .reader import EpochReader

log = logging.getLogger("tensorsocket")


class SamplerView:
    """``consumer.sampler`` and ``consumer.batch_sampler``: the producer's sampling seen
    from a consumer. ``set_epoch(e)`` is what DistributedSampler users call before each
    epoch; the producer calls set_epoch on its own loader's sampler itself, so here it
    has nothing to do (it warns once if the caller goes back to an earlier epoch, whose
    order the shared producer cannot give again: see LoaderSurface.note_set_epoch).

    Iterating the view gives the dataset indices of this consumer's own batches of an
    epoch (the batch sampler) or those indices one by one (the sampler), as a
    DataLoader's would: code that builds a DataLoader of its own from a loader's
    ``dataset`` and ``batch_sampler`` (accelerate's ``skip_first_batches``) then loads
    what this consumer, this rank of a group, receives. Where the consumer knows the
    indices of its current epoch (the batches it delivered, and those still to come)
    the view gives those; else it gives the caller's own loader's sampling (share()),
    split and cut as the consumer splits and cuts the producer's batches (see
    _rank_batches), which with a shuffling loader is another permutation than the
    producer's."""

    def __init__(self, surface: LoaderSurface, batches: bool) -> None:
        """A view of the sampling of the consumer whose surface this is (of batches if
        `batches`, else of samples)."""
        self._surface = surface
        self._batches = batches

    @property
    def batch_size(self) -> int | None:
        """Samples per batch of this consumer (None: the producer's batches as they are)."""
        return self._surface.batch_size

    @property
    def drop_last(self) -> bool:
        """Whether this consumer drops a short last batch."""
        return self._surface.drop_last

    @property
    def sampler(self) -> "SamplerView":
        """The sample-level view (a BatchSampler's ``sampler``)."""
        return SamplerView(self._surface, batches=False)

    @property
    def epoch(self) -> int:
        """Epochs this consumer completed (DistributedSampler's attribute)."""
        return self._surface.epoch

    def set_epoch(self, epoch: int) -> None:
        """DistributedSampler.set_epoch: nothing to do here (see the class docstring).
        Frameworks reach it through both ``loader.sampler`` and
        ``loader.batch_sampler.sampler`` (new views each time), so one epoch may be set
        twice: that is fine (see LoaderSurface.note_set_epoch)."""
        self._surface.note_set_epoch(epoch)

    def __len__(self) -> int:
        """Batches (batch sampler) or samples (sampler) of one epoch of this consumer:
        as many as iterating the view gives."""
        known = self._known_batches()
        if known is not None:
            return len(known) if self._batches else sum(map(len, known))
        if self._batches:
            return self._surface.length()
        if self._surface.samples_per_epoch is None:
            raise TypeError("the number of samples per epoch of the producer's loader is "
                            "unknown")
        return self._surface.rank_samples()

    def __iter__(self) -> Any:
        """The dataset indices of this consumer's batches of an epoch (see the class
        docstring): lists of indices (batch sampler) or indices (sampler)."""
        batches = self._known_batches()
        if batches is None:
            batches = self._rank_batches()
        if self._batches:
            return iter(batches)
        return (index for batch in batches for index in batch)

    def _known_batches(self) -> list[list[int]] | None:
        """The indices of the consumer's batches of its current epoch, delivered and to
        come, where the consumer knows them; else None."""
        found = self._surface.known_batches()
        if found is None:
            return None
        delivered, pending = found
        return [list(batch) for batch in [*delivered, *pending]]

    def _rank_batches(self) -> list[list[int]]:
        """This consumer's batches of the epoch it reads first, before it reads it: its
        rank's part of the producer's order of that epoch (rank r of a group of W takes
        batches r, r + W, ... of the first len // W * W, as EpochCursor deals them), cut
        into batches of its own size if it has one (the last one short unless drop_last).
        Where the producer cannot list that epoch, the caller's own loader's batches (a
        rank of a group: only where they are the same in every rank, unshuffled)."""
        surface = self._surface
        listed = surface.first_epoch_listing()
        if isinstance(listed, str):
            batches = self._own_loader_batches(listed)
        else:
            batches = listed.batch_lists()
        world, rank = surface.world_size, surface.rank
        if world > 1:
            batches = batches[rank:len(batches) // world * world:world]
        size = surface.own_batch_size
        if size is None:
            return batches
        samples = [index for batch in batches for index in batch]
        cut = [samples[i:i + size] for i in range(0, len(samples), size)]
        if cut and len(cut[-1]) < size and surface.drop_last:
            cut.pop()
        return cut

    def _own_loader_batches(self, unlisted: str) -> list[list[int]]:
        """The caller's own loader's batches of indices, where the producer cannot list its
        epoch (unlisted: why); TypeError where they would not be this consumer's."""
        surface = self._surface
        local = surface.local_loader
        inner = getattr(local, "batch_sampler", None)
        if inner is None and getattr(local, "sampler", None) is not None:
            inner = ([index] for index in local.sampler)  # batch_size=None: one per batch
        if inner is None:
            raise TypeError(
                "the samples of a tensorsocket consumer are chosen by the shared producer's "
                f"loader, which cannot list them ahead ({unlisted}), and this consumer has no "
                "loader of its own to describe them (not made by share(), or its loader has "
                "no batch_sampler); iterate the consumer itself for its batches")
        if surface.world_size > 1 and not _same_in_every_rank(local):
            raise TypeError(
                f"rank {surface.rank} of {surface.world_size} cannot list its batches before "
                f"its first epoch: the shared producer cannot list that epoch ({unlisted}), "
                "and this rank's own loader draws its order from this process's RNG, so the "
                "ranks' parts would overlap. Iterate the consumer itself (each rank receives "
                "its own part), or list its batches once it has read a batch or loaded a "
                "state (load_state_dict)")
        return [list(batch) for batch in inner]

    def __repr__(self) -> str:
        """What this is, for logs."""
        kind = "batch_sampler" if self._batches else "sampler"
        return f"<tensorsocket {kind} view of consumer {self._surface.index}>"


def _same_in_every_rank(loader: Any) -> bool:
    """Whether `loader`'s sampling is the same in every process: a SequentialSampler,
    under a BatchSampler or not (another one may draw from the process's RNG)."""
    from torch.utils.data import BatchSampler, SequentialSampler

    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(loader, "sampler", None)
    if type(batch_sampler) is BatchSampler:
        sampler = batch_sampler.sampler
    elif batch_sampler is not None:
        return False
    return type(sampler) is SequentialSampler


class LoaderSurface:
    """What training code reads from a DataLoader besides its batches, for one consumer
    (see the module docstring): the sampler views, set_epoch, num_workers, the
    resumable state and the caller's own loader's attributes. The consumer holds one
    and hands these on to it."""

    def __init__(self, reader: EpochReader, book: ResumeBook, state: EpochState,
                 options: ConsumerOptions, place: RingPlace,
                 shared: SharedLoader | None, producer_sets_epoch: bool) -> None:
        """The surface of the consumer with this reader, book, state and place in the
        ring (its index, for logs; the producer's order of the epoch it reads first);
        shared: what share() knows of its caller's loader; producer_sets_epoch: the
        producer calls set_epoch on its loader's sampler itself."""
        self._reader = reader
        self._book = book
        self._state = state
        self._options = options
        self._place = place
        self.local_loader: Any = shared.loader if shared is not None else None
        self._loader_drop_last = shared.drop_last if shared is not None else False
        self._producer_sets_epoch = producer_sets_epoch
        self._last_set_epoch: int | None = None  # the number of the last set_epoch call
        self._set_epoch_warned = False
        # The producer's order of the consumer's first epoch, once asked (an epoch's
        # order does not change: the views of it all list the same batches).
        self._first_listing: EpochListing | None = None

    # -- what a sampler view reads -------------------------------------------------------

    @property
    def index(self) -> int:
        """The consumer's index in its ring."""
        return self._place.index

    @property
    def rank(self) -> int:
        """The consumer's rank in its group (0 alone)."""
        return self._options.rank

    @property
    def world_size(self) -> int:
        """The ranks of its group (1 alone)."""
        return self._options.world_size

    @property
    def own_batch_size(self) -> int | None:
        """batch_size= (None: the producer's batches as they are)."""
        return self._options.batch_size

    @property
    def epoch(self) -> int:
        """Epochs this consumer completed (the number of the one it iterates, or next)."""
        return self._state.cursor.epoch

    @property
    def batch_size(self) -> int | None:
        """Samples per batch, as DataLoader.batch_size: the batch_size= asked for, else
        the producer's loader's (None if it has none)."""
        return self._reader.batch_size

    @property
    def drop_last(self) -> bool:
        """Whether a short last batch is dropped: this consumer's drop_last= when it cuts
        its own batches, else the loader's (share() knows it from the caller's loader)."""
        if self._options.batch_size is not None:
            return self._options.drop_last
        return self._loader_drop_last

    @property
    def samples_per_epoch(self) -> int | None:
        """The producer's loader's samples per epoch (None: unknown)."""
        return self._reader.samples_per_epoch

    def length(self) -> int:
        """Batches in one epoch of the consumer (len(consumer))."""
        return self._reader.length()

    def rank_samples(self) -> int:
        """Samples one epoch brings the consumer (its rank's share in a group)."""
        return self._reader.rank_samples()

    def first_epoch_listing(self) -> EpochListing | str:
        """The producer's order of the epoch this consumer reads first, or why there is
        none (asked once, then kept)."""
        cursor = self._state.cursor
        if cursor.epoch > 0 or cursor.in_epoch:
            return "the consumer has begun reading"
        if self._first_listing is not None:
            return self._first_listing
        try:
            listed = self._place.list_epoch()
        except TensorSocketError as e:  # (a producer gone or refusing: unlisted, say why)
            return f"the producer did not list it: {e}"
        if not isinstance(listed, str):
            self._first_listing = listed
        return listed

    def known_batches(self) -> tuple[list[list[int]], list[list[int]]] | None:
        """The samples of the batches delivered of the current epoch and of those still
        owed, where known (ResumeBook.delivered_and_pending)."""
        return self._book.delivered_and_pending()

    # -- what the consumer hands on ------------------------------------------------------

    def sampler(self, batches: bool) -> SamplerView:
        """A view of the consumer's sampling: of batches (batch_sampler) or samples."""
        return SamplerView(self, batches=batches)

    @property
    def num_workers(self) -> int:
        """The caller's loader's ``num_workers`` (share()), else 0: this process runs no
        loader worker; the producer does the loading."""
        return int(getattr(self.local_loader, "num_workers", 0) or 0)

    def note_set_epoch(self, epoch: int) -> None:
        """set_epoch(epoch) from training code: warn once if it asks for what a shared
        producer cannot give.

        The number is the caller's own count of epochs, not the consumer's, and the two
        differ in normal use, so it is not compared with the consumer's epoch:

        - Lightning calls it on the train and the val loader with the fit loop's epoch
          (``lightning/fabric/utilities/data.py`` ``_set_sampler_epoch``, from
          ``loops/fit_loop.py`` and ``loops/evaluation_loop.py``): the val consumer gets
          the same epoch twice (at the sanity check, which takes the start of the val
          consumer's epoch 0, and at the first validation), and jumps of k with
          ``check_val_every_n_epoch=k``; a run resumed from a checkpoint starts at its
          checkpoint's epoch.
        - accelerate's DataLoaderShard sets its own iteration count before each pass,
          and training scripts call ``loader.sampler.set_epoch(epoch)`` with the epoch of
          their loop (DistributedSampler's convention), which starts where a resumed run
          starts.
        - Frameworks set it on ``loader.sampler`` and ``loader.batch_sampler.sampler``,
          which are two views here: the same number twice in a row.

        Each of these asks for a new pass over the data, which each consumer epoch is
        (reshuffled if the producer's loader shuffles), so a number equal to or above the
        last one passes silently, and so does the first call, whatever its number. A
        number below the last one asks to go back to an earlier epoch, to replay its
        order, which the shared producer, having moved on, cannot give: that warns, once
        per consumer, where the producer's loader orders its samples by epoch (its
        sampler has set_epoch, as DistributedSampler). Where it has none (a RandomSampler
        reshuffles each pass whatever the number), going back loses nothing: a second
        ``Trainer.fit`` on the same loader counts from 0 again, silently."""
        last, self._last_set_epoch = self._last_set_epoch, epoch
        if last is None or epoch >= last or self._set_epoch_warned or \
                not self._producer_sets_epoch:
            return
        self._set_epoch_warned = True
        upcoming = self.epoch
        if self._state.cursor.in_epoch and self._state.epoch_complete():
            upcoming += 1  # a loop that stopped at len(): that epoch is over
        who = "calls set_epoch on its loader's sampler itself" if self._producer_sets_epoch \
            else "reshuffles as its own loader does"
        message = (
            f"set_epoch({epoch}) after set_epoch({last}) cannot replay an earlier epoch on a "
            f"tensorsocket consumer: the shared producer orders the samples (it {who}) and "
            f"has moved on; this consumer's next epoch is its epoch {upcoming}, a whole new "
            "pass over the data")
        log.info("%s", message)
        warnings.warn(message, TensorSocketWarning, stacklevel=3)

    def state_dict(self) -> dict:
        """TensorConsumer.state_dict() (ResumeBook.state_dict)."""
        return self._book.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """TensorConsumer.load_state_dict(): the book resumes from `state`, and the epochs
        set_epoch counts start again from it."""
        if isinstance(state, dict) and not state:
            return
        self._book.load_state_dict(state)
        self._last_set_epoch = None

    def loader_attribute(self, owner: str, name: str) -> Any:
        """An attribute of the caller's own loader (share()) that a consumer lacks, e.g. a
        framework's loader flags; AttributeError naming both otherwise (owner: the
        consumer's type name)."""
        local = self.local_loader
        if local is not None and hasattr(local, name):
            return getattr(local, name)
        where = f" nor has this caller's {type(local).__name__}" if local is not None else ""
        raise AttributeError(f"{owner!r} object has no attribute {name!r}{where}")


class ForwardsLoaderAttributes:
    """Mixin of share()'s consumers: public attributes set on the consumer that only the
    caller's loader has are set on that loader (see __setattr__)."""

    def __setattr__(self, name: str, value: Any) -> None:
        """Setting an attribute that only the caller's loader has sets it there, with a
        warning: the shared producer runs its own copy of the loader, which it cannot
        reach (mixup switched off in this script stays on in the producer)."""
        if not name.startswith("_") and name not in self.__dict__ \
                and not hasattr(type(self), name):
            surface = self.__dict__.get("_surface")
            local = surface.local_loader if surface is not None else None
            if local is not None and hasattr(local, name):
                setattr(local, name, value)
                message = (
                    f"setting {name}= on a tensorsocket consumer sets it on this script's "
                    f"{type(local).__name__}, not on the shared producer's copy of it, which "
                    "keeps making batches as it was started; to change the batches, give "
                    "the changed loader another share() name")
                log.warning("%s", message)
                warnings.warn(message, TensorSocketWarning, stacklevel=2)
                return
        object.__setattr__(self, name, value)
