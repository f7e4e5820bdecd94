"""What training code reads from a DataLoader, on a TensorConsumer.

Frameworks and training scripts do more with a loader than iterate it: they
read ``loader.dataset``, ``loader.batch_size`` and ``loader.sampler``, call
``loader.sampler.set_epoch(epoch)`` (DistributedSampler), save and restore
``state_dict()`` (torchdata's StatefulDataLoader convention), and read or set
attributes of their own loader types (timm's ``mixup_enabled``). ``LoaderSurface``
gives a TensorConsumer those, with the meaning each has for a shared loader.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from .data import resume
from .data.epoch_cursor import EpochCursor
from .errors import TensorSocketWarning
from .data.resume import SavedPlace

log = logging.getLogger("tensorsocket")

class SamplerView:
    """``consumer.sampler`` and ``consumer.batch_sampler``: the producer's sampling seen
    from a consumer. ``set_epoch(e)`` is what DistributedSampler users call before each
    epoch; the producer calls set_epoch on its own loader's sampler itself, so here it
    has nothing to do (it warns once if the caller goes back to an earlier epoch, whose
    order the shared producer cannot give again: see LoaderSurface._note_set_epoch).

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

    def __init__(self, consumer: Any, batches: bool) -> None:
        """A view of `consumer`'s sampling (of batches if `batches`, else of samples)."""
        self._consumer = consumer
        self._batches = batches

    @property
    def batch_size(self) -> int | None:
        """Samples per batch of this consumer (None: the producer's batches as they are)."""
        return self._consumer.batch_size

    @property
    def drop_last(self) -> bool:
        """Whether this consumer drops a short last batch."""
        return self._consumer.drop_last

    @property
    def sampler(self) -> "SamplerView":
        """The sample-level view (a BatchSampler's ``sampler``)."""
        return SamplerView(self._consumer, batches=False)

    @property
    def epoch(self) -> int:
        """Epochs this consumer completed (DistributedSampler's attribute)."""
        return self._consumer.epoch

    def set_epoch(self, epoch: int) -> None:
        """DistributedSampler.set_epoch: nothing to do here (see the class docstring).
        Frameworks reach it through both ``loader.sampler`` and
        ``loader.batch_sampler.sampler`` (new views each time), so one epoch may be set
        twice: that is fine (see LoaderSurface._note_set_epoch)."""
        self._consumer._note_set_epoch(epoch)

    def __len__(self) -> int:
        """Batches (batch sampler) or samples (sampler) of one epoch of this consumer:
        as many as iterating the view gives."""
        known = self._known_batches()
        if known is not None:
            return len(known) if self._batches else sum(map(len, known))
        if self._batches:
            return len(self._consumer)
        consumer = self._consumer
        if consumer.samples_per_epoch is None:
            raise TypeError("the number of samples per epoch of the producer's loader is "
                            "unknown")
        return consumer._rank_samples()

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
        known = getattr(self._consumer, "_delivered_and_pending", None)
        found = known() if callable(known) else None
        if found is None:
            return None
        delivered, pending = found
        return [list(batch) for batch in [*delivered, *pending]]

    def _rank_batches(self) -> list[list[int]]:
        """The caller's own loader's batches of indices as this consumer receives them:
        rank r of a group of W takes batches r, r + W, ... of the first len // W * W
        (EpochCursor), and a consumer with its own batch_size cuts the samples of those
        into batches of that size (the last one short unless drop_last)."""
        consumer = self._consumer
        local = consumer._local_loader
        inner = getattr(local, "batch_sampler", None)
        if inner is None and getattr(local, "sampler", None) is not None:
            inner = ([index] for index in local.sampler)  # batch_size=None: one per batch
        if inner is None:
            raise TypeError(
                "the samples of a tensorsocket consumer are chosen by the shared producer's "
                "loader, and this consumer has no loader of its own to describe them (not "
                "made by share(), or its loader has no batch_sampler); iterate the consumer "
                "itself for its batches")
        batches = [list(batch) for batch in inner]
        world, rank = consumer.world_size, consumer.rank
        if world > 1:
            batches = batches[rank:len(batches) // world * world:world]
        size = consumer._own_batch_size
        if size is None:
            return batches
        samples = [index for batch in batches for index in batch]
        cut = [samples[i:i + size] for i in range(0, len(samples), size)]
        if cut and len(cut[-1]) < size and consumer.drop_last:
            cut.pop()
        return cut

    def __repr__(self) -> str:
        """What this is, for logs."""
        kind = "batch_sampler" if self._batches else "sampler"
        return f"<tensorsocket {kind} view of consumer {self._consumer._index}>"


class LoaderSurface:
    """Mixin of TensorConsumer: DataLoader attributes, resumable state and the caller's
    loader's own attributes (see the module docstring)."""

    # Set by the consumer; declared for type checkers.
    _cursor: EpochCursor
    _local_loader: Any
    _set_epoch_warned: bool
    _last_set_epoch: int | None = None  # the number of the last set_epoch call, if any
    _producer_sets_epoch: bool
    _own_batch_size: int | None
    _resume_place: SavedPlace | None
    _left_place: SavedPlace | None
    world_size: int
    producer_dataset_len: int | None

    @property
    def epoch(self) -> int:
        """Epochs this consumer completed (the number of the one it iterates, or next)."""
        return self._cursor.epoch

    @property
    def sampler(self) -> SamplerView:
        """The sampling of this consumer's batches; ``set_epoch`` is accepted (see
        SamplerView)."""
        return SamplerView(self, batches=False)

    @property
    def batch_sampler(self) -> SamplerView:
        """The batch-level view of the sampling, with ``batch_size`` and ``drop_last``."""
        return SamplerView(self, batches=True)

    @property
    def num_workers(self) -> int:
        """The caller's loader's ``num_workers`` (share()), else 0: this process runs no
        loader worker; the producer does the loading."""
        return int(getattr(self._local_loader, "num_workers", 0) or 0)

    def set_epoch(self, epoch: int) -> None:
        """As ``loader.sampler.set_epoch``: the shared producer orders the samples."""
        self._note_set_epoch(epoch)

    def _note_set_epoch(self, epoch: int) -> None:
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
        if self._cursor.in_epoch and self._epoch_complete():  # type: ignore[attr-defined]
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
        """Where this consumer is, for resuming (torchdata StatefulDataLoader convention):
        epochs completed, batches delivered of the current one and which samples of it were
        taken (in a group: by the group). After a ``break``, the epoch left, until the next
        begins; right after load_state_dict(), the place loaded. JSON-serialisable
        (docs/usage.md, "Checkpoints and restarts")."""
        if self._resume_place is not None and not self._cursor.in_epoch:
            place = self._resume_place
        elif self._left_place is not None:
            place = self._left_place_now()  # type: ignore[attr-defined]
        else:
            place = self._place_now(look_ahead=True)  # type: ignore[attr-defined]
        return resume.encode(place, self._own_batch_size, self.world_size)

    def load_state_dict(self, state: dict) -> None:
        """Resume from state_dict(): the epoch counter is restored and the next epoch
        yields exactly the samples of the interrupted one not taken yet, cut into batches of
        this consumer's batch size (in a group, each rank its part, the same number of
        batches on every rank), then whole epochs. Its samples come from the producer's
        batches as they are published: it may read up to one producer epoch to find them
        all. A producer that does not tell the samples of its batches (a loader without a
        sampler) resumes by count instead: the next epoch skips the batches taken, with a
        warning. An empty dict is ignored, as StatefulDataLoader ignores it."""
        if isinstance(state, dict) and not state:
            return
        place = resume.decode(state, self._own_batch_size, self.world_size)
        exact = place.taken is not None
        if exact and place.dataset_len != self.producer_dataset_len and \
                self.producer_dataset_len is not None:
            raise ValueError(
                f"the state was saved over a dataset of {place.dataset_len} samples, the "
                f"producer's has {self.producer_dataset_len}: the samples taken would not "
                "match")
        if not exact and place.batches:
            message = (
                "this state does not say which samples were taken (the producer's loader "
                "does not tell the samples of its batches: it has no sampler, or the state "
                "is from an older tensorsocket), so the resumed epoch skips its first "
                f"{place.batches} batches by count; with a shuffling loader some samples "
                "of the epoch may come twice and others not at all")
            log.warning("%s", message)
            warnings.warn(message, TensorSocketWarning, stacklevel=2)
        self._cursor.resume(place.epoch, place.batches, exact)
        self._resume_place = place  # (what state_dict() says until the epoch begins)
        self._left_place = None
        self._last_set_epoch = None  # the epochs it counts start again from the state

    def __getattr__(self, name: str) -> Any:
        """Attributes of the caller's own loader (share()) that a consumer lacks, e.g. a
        framework's loader flags; AttributeError naming both otherwise."""
        if name.startswith("_"):
            raise AttributeError(name)
        local = self.__dict__.get("_local_loader")
        if local is not None and hasattr(local, name):
            return getattr(local, name)
        where = f" nor has this caller's {type(local).__name__}" if local is not None else ""
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute {name!r}{where}")


class ForwardsLoaderAttributes:
    """Mixin of share()'s consumers: public attributes set on the consumer that only the
    caller's loader has are set on that loader (see __setattr__)."""

    def __setattr__(self, name: str, value: Any) -> None:
        """Setting an attribute that only the caller's loader has sets it there, with a
        warning: the shared producer runs its own copy of the loader, which it cannot
        reach (mixup switched off in this script stays on in the producer)."""
        if not name.startswith("_") and name not in self.__dict__ \
                and not hasattr(type(self), name):
            local = self.__dict__.get("_local_loader")
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
