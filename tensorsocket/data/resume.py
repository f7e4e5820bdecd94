"""What a consumer took of its current epoch, for state_dict(), and what a resumed
epoch still owes it, for load_state_dict() (docs/usage.md, "Checkpoints and restarts").

The producer tells the dataset indices of each batch (sample_ids). A consumer
records the samples of each batch it delivers; its state holds the set of
samples its epoch delivered so far. In a group of ranks the state is the
group's: the samples of the group's first ``k * world_size`` batches, ``k``
being the batches each rank delivered (the ranks of a data-parallel job step
together, and frameworks save the loader state of rank 0 only, so any rank's
state must resume every rank).

A resumed epoch reads the producer's batches and keeps only the samples not
yet taken, cut into batches of the consumer's batch size; in a group the
rank keeps every ``world_size``-th of those batches (its deal), so every rank
gets the same number of batches and no sample goes to two ranks.

A state holds what it depends on (``EpochShape``: the consumer's and the loader's
batch size, its batches per epoch, the dataset's length, the group's size) and the
counts that tie its fields together (the samples its batches held, the samples its
bitmap names); ``decode`` refuses a state that does not fit the consumer loading it,
or whose counts disagree, with a ValueError naming the field (docs/usage.md, "Errors").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sample_ids import IdMask

# Of the dict state_dict() returns. 1: batch counts only; 2: the samples taken; 3: what
# the state depends on (EpochShape) and the counts that tie its fields together.
STATE_VERSION = 3


@dataclass(frozen=True)
class SavedPlace:
    """Where a consumer was: `epoch` epochs completed, `batches` delivered of the next
    (by each rank, in a group), and `taken`, the samples of it taken (by the group), when
    known (None: the producer does not tell the samples of its batches). `samples`: the
    samples those batches held, every rank's, a sample that came twice counted twice (the
    whole dataset's when `taken` is the whole epoch); None: unknown (an older state)."""

    epoch: int
    batches: int
    taken: IdMask | None
    dataset_len: int | None
    samples: int | None = None
    version: int = STATE_VERSION  # of the state it was read from


def place_of(epoch: int, batches: int, part: tuple[IdMask, int | None] | None,
             dataset_len: int | None) -> SavedPlace:
    """The place of `batches` delivered of epoch `epoch`, with `part` (EpochTaken.part():
    the samples taken and the samples their batches held; None: unknown)."""
    if part is None:
        return SavedPlace(epoch, batches, None, dataset_len)
    return SavedPlace(epoch, batches, part[0], dataset_len, part[1])


@dataclass(frozen=True)
class EpochShape:
    """What a consumer's epochs are made of, which its state depends on: batch_size= (None:
    the loader's batches as they are), world_size, the producer's loader's batch size,
    the consumer's batches per epoch (len(); in a group the most any rank has, the same
    for every rank; None: unknown) and the dataset's length (None: unknown)."""

    batch_size: int | None = None
    world_size: int = 1
    loader_batch_size: int | None = None
    epoch_batches: int | None = None
    dataset_len: int | None = None

    @property
    def batch(self) -> int | None:
        """Samples per batch of the consumer: its own batch size, else the loader's."""
        return self.batch_size or self.loader_batch_size


class EpochTaken:
    """The samples of the current epoch taken by this consumer (or its group), and in a
    resumed epoch the samples it may still take."""

    def __init__(self, world_size: int, batch_size: int | None = None) -> None:
        """Nothing taken yet. batch_size: the consumer's own (None: the loader's batches
        as they are)."""
        self.world_size = world_size
        self.batch_size = batch_size
        self.begin(None)

    def begin(self, resumed: SavedPlace | None) -> None:
        """A new epoch: `resumed` is the place it resumes from (None: a whole epoch)."""
        self.resumed = resumed
        self.base = resumed.taken if resumed is not None and resumed.taken is not None \
            else IdMask()
        # The samples the batches of `base` held (None: unknown, an older state's).
        self.base_samples: int | None = resumed.samples \
            if resumed is not None and resumed.taken is not None else 0
        self.mine = IdMask()  # delivered by this consumer in this epoch
        self.mine_samples = 0  # ... and the samples of those batches (twice: twice)
        self._last_ids: np.ndarray | None = None  # the ids of the last batch counted
        self.known = True  # every batch delivered had its sample ids
        # In a group: the sample ids of the group's batches passed so far, by their index
        # in the producer epoch (a whole epoch) or in the deal (a resumed one).
        self.group: dict[int, np.ndarray] = {}
        # A resumed epoch: the samples taken before or read since (those are not kept).
        self.claimed = self.base.copy() if resumed is not None else None
        self.dealt = 0  # batches dealt in a resumed group epoch (every rank's)
        self.dealt_samples = 0  # ... and their samples
        self.deal_base = 0  # the re-batcher's count of batches made when the deal began
        self.deal_total = 0  # samples the deal hands out in all (set by the consumer)
        self.round_size = 0  # samples per batch in the current round of the deal

    # -- recording -------------------------------------------------------------------

    def delivered(self, ids: np.ndarray | None) -> None:
        """A batch with samples `ids` (None: unknown) was delivered. Called again with the
        same `ids` (next() interrupted after it, before the batch was returned: it is
        delivered at the next next()), it changes nothing."""
        if ids is None:
            self.known = False
        elif ids is not self._last_ids:
            self.mine.add(ids)  # (again after an interrupt here: no change)
            # One statement of plain stores: counted once.
            self.mine_samples, self._last_ids = self.mine_samples + ids.size, ids

    def group_batch(self, index: int, ids: np.ndarray | None) -> None:
        """The group's batch `index` (any rank's) holds samples `ids`."""
        if ids is None:
            self.known = False
        elif self.world_size > 1:
            self.group[index] = ids

    # -- a resumed epoch ---------------------------------------------------------------

    def keep(self, ids: np.ndarray) -> np.ndarray:
        """Which of the samples `ids` of a batch read in a resumed epoch are kept (not taken
        before, not read already); they count as read from now on."""
        assert self.claimed is not None
        fresh = ~self.claimed.contains(ids)
        self.claimed.add(ids[fresh])
        return fresh

    def claim(self, ids: np.ndarray) -> None:
        """The samples `ids`, kept of a batch read in a resumed epoch (none of them read
        before), count as read from now on."""
        assert self.claimed is not None
        self.claimed.add(ids)

    def unclaimed(self, dataset_len: int | None) -> int | None:
        """Samples of a resumed epoch not read yet (None: the dataset size is unknown)."""
        if self.claimed is None or dataset_len is None:
            return None
        return dataset_len - self.claimed.count()

    def deal_batch_size(self, batch_size: int) -> int:
        """The size of the next batch of the deal: `batch_size`, but in the last round
        (fewer than world_size batches of it left) an even split of what is left, so that
        every rank gets the same number of batches."""
        if self.dealt % self.world_size == 0:  # a round begins: its batches' size
            left = self.deal_total - self.dealt_samples
            self.round_size = batch_size if left >= self.world_size * batch_size or \
                left <= 0 else -(-left // self.world_size)
        return self.round_size

    def deal(self, index: int, ids: np.ndarray | None) -> None:
        """Batch `index` of the deal of a resumed group epoch was made, of samples `ids`
        (it goes to rank index % world_size). Once per batch: noting it again (after an
        interrupt) changes nothing."""
        if ids is None:
            self.known = False
        elif index not in self.group:
            # One statement of plain stores: an interrupt cannot split it.
            self.group[index], self.dealt, self.dealt_samples = \
                ids, index + 1, self.dealt_samples + ids.size

    # -- the state ---------------------------------------------------------------------

    def taken(self, batches: int) -> IdMask | None:
        """The samples of this epoch taken when each rank delivered `batches` batches
        (None: unknown, or in a group the group's batches were not all seen)."""
        part = self.part(batches)
        return None if part is None else part[0]

    def part(self, batches: int) -> tuple[IdMask, int | None] | None:
        """(the samples taken, as taken(), and the samples their batches held, a sample
        taken twice counted twice, None if unknown) when each rank delivered `batches`
        batches; None as taken()."""
        if not self.known:
            return None
        base = self.base_samples
        if self.world_size == 1:
            return self.base.union(self.mine), \
                None if base is None else base + self.mine_samples
        resumed = self.resumed
        out, samples = self.base.copy(), 0
        if resumed is not None or self.batch_size is None:
            # Whole group batches: the loader's (a whole epoch), or the deal's (a resumed
            # one), `batches` of each rank's since the epoch (or the resume) began.
            first = batches - (resumed.batches if resumed is not None else 0)
            for index in range(first * self.world_size):
                ids = self.group.get(index)
                if ids is None:
                    return None
                out.add(ids)
                samples += ids.size
            return out, None if base is None else base + samples
        # Own batch sizes over a whole epoch: each rank took the first `batches *
        # batch_size` samples of its loader batches (rank r: r, r + world_size, ...).
        for rank in range(self.world_size):
            need, index = batches * self.batch_size, rank
            while need > 0:
                ids = self.group.get(index)
                if ids is None:
                    return None
                out.add(ids[:need])
                samples += min(need, ids.size)
                need -= ids.size
                index += self.world_size
        return out, None if base is None else base + samples


def encode(place: SavedPlace, shape: EpochShape) -> dict:
    """The state dict of `place`, saved by a consumer of `shape` (JSON-serialisable)."""
    size = place.dataset_len
    if place.taken is not None and size is None:
        size = place.taken.bits.size
    taken = place.taken if size is not None else None
    return {
        "tensorsocket_state": STATE_VERSION,
        "epoch": place.epoch,
        "batches_in_epoch": place.batches,
        "batch_size": shape.batch_size,
        "world_size": shape.world_size,
        "loader_batch_size": shape.loader_batch_size,
        "epoch_batches": shape.epoch_batches,
        "dataset_len": size,
        "samples_in_epoch": None if taken is None else place.samples,
        "taken_count": None if taken is None else int(np.count_nonzero(taken.bits[:size])),
        "taken": None if taken is None else taken.to_text(size),  # type: ignore[arg-type]
    }


def decode(state: object, shape: EpochShape) -> SavedPlace:
    """The place of a state dict from encode() (or an older version's), to be loaded by a
    consumer of `shape`; ValueError naming the field, the value found and what it must be,
    when the state does not fit that consumer or its counts disagree. Fields an older
    state lacks are not checked (see unchecked())."""
    version = state.get("tensorsocket_state") if isinstance(state, dict) else None
    if not _is_count(version) or version not in (1, 2, STATE_VERSION):
        raise ValueError(
            f"not a tensorsocket consumer state (from TensorConsumer.state_dict(), "
            f"version {STATE_VERSION}): {state!r:.200}")
    assert isinstance(state, dict)
    epoch, batches = state.get("epoch"), state.get("batches_in_epoch")
    for field, value in (("epoch", epoch), ("batches_in_epoch", batches)):
        if not _is_count(value):
            raise ValueError(f"the state's {field} is {value!r}: it must be an integer 0 or "
                             f"more")
    # What the state depends on, against this consumer.
    if state.get("batch_size") != shape.batch_size:
        raise ValueError(
            f"the state was saved by a consumer with batch_size={state.get('batch_size')}, "
            f"this one has batch_size={shape.batch_size}: batches taken would not match")
    saved_world = state.get("world_size", 1)
    if saved_world != shape.world_size:
        raise ValueError(
            f"the state was saved by a group of world_size={saved_world} ranks, this "
            f"consumer is one of {shape.world_size}: each rank's part would not match")
    if version >= 3:
        if shape.batch_size is None:  # (else the consumer's batches are its own)
            _same_loader(state, "loader_batch_size", shape.loader_batch_size,
                         "the producer's loader made batches of {saved} samples, this "
                         "one's makes batches of {now}")
        _same_loader(state, "epoch_batches", shape.epoch_batches,
                     "an epoch of the consumer that saved it had {saved} batches, this "
                     "one's has {now}")
    size, text = state.get("dataset_len"), state.get("taken")
    if _is_count(size) and shape.dataset_len is not None and size != shape.dataset_len:
        raise ValueError(
            f"the state's dataset_len is {size}: it was saved over a dataset of {size} "
            f"samples, the producer's has {shape.dataset_len} (dataset_len must be "
            f"{shape.dataset_len}): the samples taken would not match")
    length = shape.epoch_batches
    if length is not None and batches > length:  # type: ignore[operator]
        raise ValueError(
            f"the state's batches_in_epoch is {batches}: an epoch of this consumer has "
            f"{length} batches (len()), so it must be 0 to {length}")
    taken, samples = None, None
    if text is not None:
        if not _is_count(size) or not isinstance(text, str):
            raise ValueError(f"bad dataset_len or taken in the state: {state!r:.200}")
        taken = IdMask.from_text(text, size)  # type: ignore[arg-type]
        count = taken.count()
        if version >= 3:
            stated = state.get("taken_count")
            if stated != count or not _is_count(stated):
                raise ValueError(
                    f"the state's taken names {count} samples, its taken_count is "
                    f"{stated!r}: they must be equal (one of them was changed)")
            samples = state.get("samples_in_epoch")
            if samples is not None and not _is_count(samples):
                raise ValueError(f"the state's samples_in_epoch is {samples!r}: it must be "
                                 f"an integer 0 or more, or null")
        _check_counts(batches, count, samples, size, shape)  # type: ignore[arg-type]
    return SavedPlace(epoch, batches, taken,  # type: ignore[arg-type]
                      size if _is_count(size) else None, samples, version)


def unchecked(place: SavedPlace, shape: EpochShape) -> str | None:
    """What load_state_dict() could not check of `place` (an older state: it does not say
    which loader it was saved over, nor how many samples its batches held), for a warning;
    None when the state says all that, or nothing was taken of its epoch yet."""
    if place.taken is None or place.batches == 0 or (
            place.version >= 3 and place.samples is not None):
        return None
    if place.version < 3:
        message = (
            f"this state is from an older tensorsocket (state version {place.version}): "
            "it does not say which loader it was saved over (its batch size, its batches "
            "per epoch) nor how many samples its batches held, so only batches_in_epoch "
            "against len() and taken against the batches taken could be checked")
    else:
        message = (
            "this state goes back to one from an older tensorsocket (its samples_in_epoch "
            "is null): it does not say how many samples its batches held, so taken could "
            "be checked only against the batches taken")
    expected = _samples_range(place.batches, shape)
    count = place.taken.count()
    if expected is not None and not expected[0] <= count <= expected[1] and \
            count != place.dataset_len:
        message += (
            f"; its {place.batches} batches of {shape.batch} samples would hold "
            f"{_range_text(expected)} samples, its taken names {count}: if it was saved over "
            "another loader (another batch size), samples of the resumed epoch will be "
            "lost or come twice")
    return message


def _check_counts(batches: int, count: int, samples: int | None, size: int,
                  shape: EpochShape) -> None:
    """ValueError unless `batches` per rank, holding `samples` (None: unknown) of which
    `count` distinct ones are taken, over a dataset of `size`, fit together (and `shape`'s
    batch size and group)."""
    whole = size > 0 and count == size  # the whole epoch taken: nothing is owed
    if batches == 0 and count > 0 and shape.epoch_batches != 0:
        raise ValueError(
            f"the state's taken names {count} samples, its batches_in_epoch is 0: at the "
            f"start of an epoch no sample is taken (taken must name none)")
    expected = None if whole else _samples_range(batches, shape)
    if samples is None:  # an older state: its taken is not more than its batches hold
        if expected is not None and count > expected[1]:
            raise ValueError(
                f"the state's taken names {count} samples, more than its batches_in_epoch="
                f"{batches} batches of {shape.batch} samples hold: it must name at most "
                f"{expected[1]}")
        return
    if count > samples:
        raise ValueError(
            f"the state's samples_in_epoch is {samples} and its taken names {count} "
            f"samples: the batches taken held {samples}, so taken must name {samples} or "
            f"fewer (one of them was changed)")
    if expected is not None and not expected[0] <= samples <= expected[1]:
        per = shape.world_size * shape.batch  # type: ignore[operator]
        ranks = f" on each of {shape.world_size} ranks" if shape.world_size > 1 else ""
        raise ValueError(
            f"the state's batches_in_epoch is {batches} and its samples_in_epoch is "
            f"{samples}: {batches} batches of {shape.batch} samples{ranks} hold "
            f"{_range_text(expected)}, so batches_in_epoch must be {-(-samples // per)} "
            f"for samples_in_epoch={samples} (one of them was changed, or the state is "
            f"from another loader)")


def _samples_range(batches: int, shape: EpochShape) -> tuple[int, int] | None:
    """(fewest, most) samples `batches` batches of each rank hold (all but an epoch's
    last one are whole: only that one, or the loader's last in a window over two
    producer epochs, may be short); None when the batch size is unknown."""
    size = shape.batch
    if not size:
        return None
    per = shape.world_size * size
    return ((batches - 1) * per + 1 if batches else 0), batches * per


def _range_text(expected: tuple[int, int]) -> str:
    low, high = expected
    return str(high) if low == high else f"{low} to {high}"


def _same_loader(state: dict, field: str, now: int | None, what: str) -> None:
    """ValueError naming `field` unless the state's value of it is `now` (both known)."""
    saved = state.get(field)
    if saved is not None and now is not None and saved != now:
        raise ValueError(
            f"the state's {field} is {saved!r}, this consumer's is {now}: "
            f"{what.format(saved=saved, now=now)}, so the batches taken and those owed "
            f"would not match ({field} must be {now})")


def _is_count(value: object) -> bool:
    """An int 0 or more (not a bool: a JSON true is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
