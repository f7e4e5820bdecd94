"""Taking a consumer's next ring entry: the waits (for its own kept batches, for the
idle consumers of its process, for the releases of a GPU consumer), and the ring's
errors turned into what the reader of an epoch needs."""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any

from ..data import diagnosis
from ..data.rebatch import EpochEnd
from ..errors import (
    ConsumerDetached,
    ProducerFinished,
    ProducerGone,
    TensorSocketError,
    TensorSocketWarning,
)
from ..ring import StopReason
from .epoch_state import EpochState
from .options import ConsumerOptions
from .place import RingPlace, producer_failed
from .siblings import SIBLINGS, ParkingMember

STALL_WARN_AFTER = 5.0  # seconds waiting for a batch the consumer's own held batches block
SIBLING_PARK_AFTER = 0.5  # seconds of waiting before this process's idle consumers park
SET_ASIDE_AFTER = 0.05  # seconds a wait lasts between checks for kept batches that block
FLUSH_EVERY = 0.05  # seconds a GPU consumer's wait lasts between flushes of its releases

log = logging.getLogger("tensorsocket")


class SlotAcquirer:
    """Takes the next ring entry of one consumer (acquire()), into flow.entry.

    wait_s: seconds spent waiting, for stats()."""

    def __init__(self, place: RingPlace, state: EpochState, member: ParkingMember,
                 options: ConsumerOptions) -> None:
        """The acquirer of the consumer with this place, state and parking member."""
        self._place = place
        self._state = state
        self._member = member
        self._options = options
        self.wait_s = 0.0

    def acquire(self) -> Any:
        """The next ring entry for us, with errors turned into what the caller needs."""
        place = self._place
        place.ensure_attached()
        try:  # published already (a consumer that keeps up): no wait, nothing to check
            slot = place.ring.try_acquire(self._state.flow.entry)
        except (ProducerFinished, ProducerGone, ConsumerDetached):
            slot = None  # the waiting acquire below raises it again, and says what it means
        if slot is not None:
            return slot
        while True:
            place.flush_releases()  # the wait may be for a slot our dropped views hold
            start = time.perf_counter()
            try:
                return self.acquire_slot()
            except ConsumerDetached as e:
                if self._detached(e):
                    raise EpochEnd from None
            except (ProducerFinished, ProducerGone, TimeoutError) as e:
                raise self._ended(e) from None
            finally:
                self.wait_s += time.perf_counter() - start

    def _ended(self, e: BaseException) -> BaseException:
        """What a wait that ended with `e` (ProducerFinished, ProducerGone, TimeoutError)
        raises: the error for the consumer's caller, or EpochEnd where the epoch ends
        with what came."""
        place, cursor = self._place, self._state.cursor
        address = self._options.endpoint.address
        if isinstance(e, TimeoutError):
            return TimeoutError(
                f"no batch within batch_timeout={self._options.batch_wait} s from {address}")
        if isinstance(e, ProducerGone):
            place.cut_short()
            return producer_failed(place.ring, address, None, str(e))
        failure = place.ring.failure()
        if failure is not None:
            place.cut_short()
            return producer_failed(place.ring, address, failure)
        in_epoch = cursor.in_epoch  # (finished_between_windows ends it, or goes on with it)
        if cursor.finished_between_windows():
            # A late joiner's epoch spans two producer epochs, and the producer
            # stopped after the first of them. End the epoch with what came.
            warnings.warn(
                f"the producer finished in the middle of this consumer's epoch "
                f"{cursor.epoch} (it joined late, so its epochs span two of the "
                f"producer's); the epoch ends after {cursor.pulled} loader batches",
                TensorSocketWarning, stacklevel=6)
            return EpochEnd()
        place.mark_cut(in_epoch)
        if cursor.pulled > 0:
            return ProducerFinished(
                f"the producer stopped in the middle of its epoch, after this "
                f"consumer's epoch {cursor.epoch} had received {cursor.pulled} "
                "of the loader's batches; no more batches will come")
        return ProducerFinished(
            f"the producer finished after {cursor.epoch} epoch(s) seen by this "
            "consumer; no more batches will come")

    def _detached(self, e: ConsumerDetached) -> bool:
        """The producer detached this consumer: attach again where that loses nothing
        (it had read nothing) or the lag policy says so, else raise. Whether the epoch
        ends here (a rejoin mid-epoch)."""
        place, cursor = self._place, self._state.cursor
        if place.closed:  # close() from another thread detached us first
            raise TensorSocketError(
                "the consumer was closed by another thread while this call waited"
            ) from None
        reason = diagnosis.detach_reason(place.ring, place.index, place.token)
        if reason == StopReason.UNREAD and cursor.pulled == 0:
            place.start_late()
            return False
        # The producer's lag policy (its welcome): one detached for lagging attaches again
        # under "rejoin".
        welcome = place.welcome
        if reason != StopReason.LAGGED or welcome.lag_policy != "rejoin":
            raise ConsumerDetached(
                f"{e}; create a new TensorConsumer to attach again") from None
        place.rejoin(welcome.max_lag or None)
        return cursor.rejoined()

    def acquire_slot(self) -> Any:
        """Ring.acquire within batch_timeout; warns once if the wait is this consumer's
        own doing (see RingPlace.held_slots_blocking). The slot is put in flow.entry."""
        place, box = self._place, self._state.flow.entry
        batch_wait = self._options.batch_wait
        deadline = None if batch_wait is None else time.monotonic() + batch_wait

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        # This process may be about to wait here while another of its consumers sits
        # between epochs holding its producer back (a validation loader during training):
        # if the wait lasts, that one parks, so no two jobs wait on each other through two
        # rings. A place kept while parked can close such a cycle too (the job we wait for
        # waits for that place): looked at again every SIBLING_PARK_AFTER of the wait, as
        # the other job may come to wait for it only later (see Siblings.park_idle). Our
        # own kept batches that block us are the loop below's to handle.
        while SIBLINGS.any_idle(self._member) and not place.held_slots_blocking():
            wait = left()
            if wait is not None and wait <= SIBLING_PARK_AFTER:
                break
            try:
                return self._wait_for_slot(SIBLING_PARK_AFTER, box)
            except TimeoutError:
                SIBLINGS.park_idle(self._member)

        # Batches this consumer keeps may come to hold the slot the producer must refill
        # next (as soon as it gets there): then they are copied privately rather than
        # waited for (see RingPlace.set_aside_held), at once (a list(consumer) waits for
        # nothing). Only while it keeps some: in short waits.
        while diagnosis.may_set_aside(place.ring, place.delivery.gpu_import):
            if place.held_slots_blocking():
                # The producer filled every other slot: our next entry is published
                # already, unless a kept batch older than the one just returned blocks.
                slot = place.ring.try_acquire(box)
                if slot is not None:
                    return slot
                if not place.set_aside_held(rebind=True):
                    break  # they cannot be copied here: wait for them (and say so below)
                continue
            wait = left()
            step = SET_ASIDE_AFTER if wait is None else min(SET_ASIDE_AFTER, wait)
            try:
                return self._wait_for_slot(step, box)
            except TimeoutError:
                if wait is not None and step >= wait:
                    raise
        wait = left()
        if wait is not None and wait <= STALL_WARN_AFTER:
            return self._wait_for_slot(wait, box)
        try:
            return self._wait_for_slot(STALL_WARN_AFTER, box)
        except TimeoutError:
            self._warn_held()
        return self._wait_for_slot(left(), box)

    def _warn_held(self) -> None:
        """After STALL_WARN_AFTER of waiting: if the wait is for a slot that this
        consumer's own kept batches hold, say so."""
        held = self._place.held_slots_blocking()
        if held:
            message = diagnosis.kept_batches_warning(
                STALL_WARN_AFTER, held, self._place.ring.slot_count)
            log.warning("%s", message)
            warnings.warn(message, TensorSocketWarning, stacklevel=7)

    def _wait_for_slot(self, timeout: float | None, box: Any) -> Any:
        """Ring.acquire(timeout, box). Where releases wait for a flush (GPU state, see
        Delivery.defers_releases), in FLUSH_EVERY steps with the releases of the views
        dropped meanwhile flushed between them: the slot waited for may be one that
        another thread of this process let go while this one waits (a prefetch thread
        in next() while the training loop drops its batch). Host-only consumers wait in
        one call (no wakeups: their releases are not deferred)."""
        place = self._place
        if not place.delivery.defers_releases:
            return place.ring.acquire(timeout, box)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            step = FLUSH_EVERY if left is None else min(FLUSH_EVERY, left)
            try:
                return place.ring.acquire(step, box)
            except TimeoutError:
                # Also after the last step: a caller waiting in steps of its own (the
                # may_set_aside loop of acquire_slot) flushes between them too.
                place.flush_releases()
                if left is not None and step >= left:
                    raise
