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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sample_ids import IdMask

STATE_VERSION = 2  # of the dict state_dict() returns (1: batch counts only)


@dataclass(frozen=True)
class SavedPlace:
    """Where a consumer was: `epoch` epochs completed, `batches` delivered of the next
    (by each rank, in a group), and `taken`, the samples of it taken (by the group), when
    known (None: the producer does not tell the samples of its batches)."""

    epoch: int
    batches: int
    taken: IdMask | None
    dataset_len: int | None


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
        self.mine = IdMask()  # delivered by this consumer in this epoch
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
        """A batch with samples `ids` (None: unknown) was delivered."""
        if ids is None:
            self.known = False
        else:
            self.mine.add(ids)

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
        if not self.known:
            return None
        if self.world_size == 1:
            return self.base.union(self.mine)
        resumed = self.resumed
        out = self.base.copy()
        if resumed is not None or self.batch_size is None:
            # Whole group batches: the loader's (a whole epoch), or the deal's (a resumed
            # one), `batches` of each rank's since the epoch (or the resume) began.
            first = batches - (resumed.batches if resumed is not None else 0)
            for index in range(first * self.world_size):
                ids = self.group.get(index)
                if ids is None:
                    return None
                out.add(ids)
            return out
        # Own batch sizes over a whole epoch: each rank took the first `batches *
        # batch_size` samples of its loader batches (rank r: r, r + world_size, ...).
        for rank in range(self.world_size):
            need, index = batches * self.batch_size, rank
            while need > 0:
                ids = self.group.get(index)
                if ids is None:
                    return None
                out.add(ids[:need])
                need -= ids.size
                index += self.world_size
        return out


def encode(place: SavedPlace, batch_size: int | None, world_size: int) -> dict:
    """The state dict of `place` (JSON-serialisable)."""
    size = place.dataset_len
    if place.taken is not None and size is None:
        size = place.taken.bits.size
    return {
        "tensorsocket_state": STATE_VERSION,
        "epoch": place.epoch,
        "batches_in_epoch": place.batches,
        "batch_size": batch_size,
        "world_size": world_size,
        "dataset_len": size,
        "taken": None if place.taken is None or size is None else place.taken.to_text(size),
    }


def decode(state: object, batch_size: int | None, world_size: int) -> SavedPlace:
    """The place of a state dict from encode() (or version 1's batch counts); ValueError
    naming what does not fit."""
    if not isinstance(state, dict) or state.get("tensorsocket_state") not in (1, STATE_VERSION):
        raise ValueError(
            f"not a tensorsocket consumer state (from TensorConsumer.state_dict(), "
            f"version {STATE_VERSION}): {state!r:.200}")
    epoch, batches = state.get("epoch"), state.get("batches_in_epoch")
    if not isinstance(epoch, int) or not isinstance(batches, int) or epoch < 0 or batches < 0:
        raise ValueError(f"bad epoch or batches_in_epoch in the state: {state!r:.200}")
    if state.get("batch_size") != batch_size:
        raise ValueError(
            f"the state was saved by a consumer with batch_size={state.get('batch_size')}, "
            f"this one has batch_size={batch_size}: batches taken would not match")
    saved_world = state.get("world_size", 1)
    if saved_world != world_size:
        raise ValueError(
            f"the state was saved by a group of world_size={saved_world} ranks, this "
            f"consumer is one of {world_size}: each rank's part would not match")
    size, text = state.get("dataset_len"), state.get("taken")
    taken = None
    if text is not None:
        if not isinstance(size, int) or size < 0 or not isinstance(text, str):
            raise ValueError(f"bad dataset_len or taken in the state: {state!r:.200}")
        taken = IdMask.from_text(text, size)
    return SavedPlace(epoch, batches, taken, size if isinstance(size, int) else None)
