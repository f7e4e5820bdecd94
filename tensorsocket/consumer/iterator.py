"""One epoch of a TensorConsumer: the iterator that iter(consumer) returns."""

from __future__ import annotations

from typing import Any

from ..ring import Lane
from .flow import BatchFlow


class EpochIterator(Lane):
    """One epoch of a TensorConsumer. Keeps no reference to the batches it returned,
    so a batch's ring slot is released as soon as the caller drops it.

    Its next() is the core's (tensorsocket._core.Lane): in the common case one C call
    takes the next entry, builds the batch and counts it; otherwise, and for the first and
    last batch of an epoch, _next_slow() asks the consumer's BatchFlow. It reads nothing
    of the consumer but its flow; for a transform stage it is the EpochSource."""

    __slots__ = ("_flow", "_serial")

    def __init__(self, flow: BatchFlow, epoch: int, serial: int) -> None:
        """An iterator of `epoch`, made by the consumer's `serial`-th iter()."""
        self.bind_lane(**flow.lane_setup(epoch))
        self._flow = flow
        self._serial = serial

    @property
    def serial(self) -> int:
        """Which iter() of the consumer made this iterator."""
        return self._serial

    def __iter__(self) -> "EpochIterator":
        """The iterator itself."""
        return self

    def __len__(self) -> int:
        """Batches in the whole epoch (as ``len(consumer)``)."""
        return self._flow.epoch_length()

    # -- called by the core's next() ------------------------------------------------------

    def _next_slow(self) -> Any:
        """The next batch of this epoch where the common path does not apply;
        StopIteration at its end."""
        return self._flow.next(self)

    def _wait_entry(self) -> bool:
        """Nothing was published for the common path: wait (BatchFlow.wait_entry)."""
        return self._flow.wait_entry()

    # -- for a TransformStage (augment.stage.EpochSource) --------------------------------

    def take(self, end_epoch: bool = True) -> tuple[Any, Any, int]:
        """The next batch of this epoch, taken from the ring but not yet delivered (see
        BatchFlow.take)."""
        return self._flow.take(self.epoch, end_epoch)

    def delivered(self, ids: Any) -> None:
        """A batch taken is delivered now: its samples count as taken (state_dict())."""
        self._flow.delivered(ids)

    def deadline(self) -> float | None:
        """When a transformed batch must be there (batch_timeout), or None."""
        return self._flow.deadline()

    def length(self) -> int | None:
        """Batches in this epoch (len(consumer)), or None if unknown."""
        return self._flow.length()

    # -- leaving ---------------------------------------------------------------------------

    def close(self) -> None:
        """Leave this epoch now (as when the iterator is dropped mid-epoch)."""
        self._flow.leave(self.epoch, self._serial)

    def __del__(self) -> None:
        """Dropped mid-epoch: leave the ring (see TensorConsumer)."""
        try:
            self._flow.leave(self.epoch, self._serial)
        except Exception:  # never raise from a finalizer
            pass
