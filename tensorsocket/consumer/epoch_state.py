"""What a consumer's epoch has reached: its cursor (which ring entries belong to it),
what next() has in flight, the samples taken (for state_dict()), and the re-batchers
that cut its batches. Plain state, shared by the parts of a consumer that read it."""

from __future__ import annotations

from ..data.epoch_cursor import EpochCursor, InFlight
from ..data.rebatch import Rebatcher
from ..data.resume import EpochTaken


class EpochState:
    """One consumer's epoch bookkeeping (see the module docstring).

    cursor: where it is in its epochs (tensorsocket.data.epoch_cursor). flow: what next()
    took and has not returned yet, and the counts of what it returned. taken: the samples
    of this epoch taken (tensorsocket.data.resume). rebatcher: batch_size='s (None: the
    loader's batches as they are). resume_batcher: a resumed epoch of a consumer without
    batch_size= cuts the samples it keeps into the loader's batch size (set at the
    epoch's start, see ResumeBook.begin)."""

    def __init__(self, cursor: EpochCursor, flow: InFlight, taken: EpochTaken,
                 rebatcher: Rebatcher | None) -> None:
        """The state of a consumer that has read nothing yet."""
        self.cursor = cursor
        self.flow = flow
        self.taken = taken
        self.rebatcher = rebatcher
        self.resume_batcher: Rebatcher | None = None

    @property
    def batcher(self) -> Rebatcher | None:
        """What cuts this epoch's batches: the resumed epoch's, else batch_size='s."""
        return self.resume_batcher or self.rebatcher

    def holding(self) -> bool:
        """Samples of the current epoch are held back, to be delivered (a partial batch
        of the re-batcher, unless drop_last drops it)."""
        rebatcher = self.batcher
        return rebatcher is not None and not rebatcher.drop_last and rebatcher.holding()

    def epoch_complete(self) -> bool:
        """Every batch of the current epoch was delivered (its end not yet reported)."""
        return self.cursor.complete(self.holding())

    def between_epochs(self) -> bool:
        """Never iterated, or every batch of its epoch delivered (EpochCursor.idle)."""
        return self.cursor.idle(self.holding())
