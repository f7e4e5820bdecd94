"""A consumer's place in the producer's ring: attaching through the ControlClient,
parking and unparking, attaching again (a late joiner: after a park, a lag, an unread
start), setting kept batches aside, and the teardown."""

from __future__ import annotations

import errno
import logging
import os
import threading
import warnings
import weakref
from typing import Any, Callable

import zmq

from ..control.producer_watch import ProducerWatch
from ..control.client import ControlClient
from ..data import diagnosis
from ..data.delivery import Delivery
from ..data.epoch_cursor import EpochCursor, InFlight
from ..data.listings import EpochListing
from ..errors import ConsumerDetached, LagWarning, ProducerFailed, ProducerFinished, \
    ProducerNotFound, TensorSocketError
from ..ring import Ring, RingInfo, RingState, fork_child, fork_parent, fork_prepare
from .options import ConsumerOptions

log = logging.getLogger("tensorsocket")

RELEASE_DRAIN_MS = 10000  # at close: longest wait for the GPU work before dropped batches

# A child forked while this process holds batches (multiprocessing's fork, os.fork) gets
# private copies of them: a DataLoader's batches are private memory that a fork copies, and
# the parent dropping its views (the producer then refills their slots) must not change
# what the child reads.
# _SELF_PID: this process's pid, for the per-batch check that a consumer reads in the
# process that made it (os.getpid() is a system call); a forked child sets its own.
_SELF_PID = [os.getpid()]


def _after_fork_in_child() -> None:
    fork_child()
    _SELF_PID[0] = os.getpid()


os.register_at_fork(before=fork_prepare, after_in_parent=fork_parent,
                    after_in_child=_after_fork_in_child)


class RingPlace:
    """Where one consumer reads in its producer's ring, and the ControlClient that holds
    it there. Made attached (hello, the ring opened and bound); ready() then says so.

    Public state: ``attached`` (False after a park, until the next read attaches
    again), ``held_place`` (parked between epochs, the producer keeping the place),
    ``closed``, ``lock`` (iter() against parking from another thread), ``cursor`` (the
    epoch cursor, made on attach: whole epochs need the loader's length), ``cut_epoch``
    (the epoch the producer's end cut short, see cut_short), and the counters
    ``rejoins``, ``skipped``, ``set_aside_batches``."""

    def __init__(self, options: ConsumerOptions, flow: InFlight) -> None:
        """Attach to the producer at options.endpoint (hello, then the ring); not ready
        yet. Anything opened is closed again if this raises."""
        self._options = options
        self.flow = flow  # flow.entry: the ring entry taken and not yet used
        self.delivery: Delivery = options.delivery
        self.pid = os.getpid()  # the process this consumer reads in (a fork's child may not)
        self.closed = False
        self.attached = True  # False after leaving mid-epoch, until the next batch
        self.held_place = False  # parked between epochs, asking to keep the place
        self.lock = threading.Lock()
        self.rejoins = self.skipped = 0
        self.set_aside_batches = 0  # kept batches copied privately (see set_aside_held)
        self.start_seq = -1
        self.cut_epoch: int | None = None  # the epoch the producer's end cut (cut_short)
        context = zmq.Context()
        self.client = ControlClient(context, options.endpoint.address, options.answer_wait,
                                    options.secret)
        # The current ring handle, in a box: a set-aside puts its successor there itself
        # (see set_aside_held), and the teardown closes whatever handle is there then
        # (set-aside ones go with their views).
        self._ring_box: list = [None]
        self._finalizer = weakref.finalize(self, _teardown, self.client, context,
                                           self._ring_box, self.delivery, self.pid)
        watch = ProducerWatch(options.endpoint, options.answer_wait) if options.watch \
            else None
        try:
            welcome = self.client.hello(options.batch_size, options.group, options.rank,
                                        options.world_size, watch=watch)
            self._ring_box[0] = ring = Ring.open(welcome.segment)
            ring.bind(welcome.consumer, welcome.token)
        except BaseException:
            self._finalizer()
            raise
        self.welcome = welcome
        self.segment: str = welcome.segment
        self.index: int = welcome.consumer
        # Whole epochs need an epoch length: a loader without len() may be an endless
        # stream, whose next epoch never starts; a late joiner reads on from where it is.
        self.aligned = options.align_epochs and welcome.length is not None
        self.cursor = EpochCursor(self.aligned, welcome.length, options.rank,
                                  options.world_size)

    @property
    def ring(self) -> Any:
        """The ring handle this consumer reads through now."""
        return self._ring_box[0]

    def lane_parts(self) -> dict:
        """What the consumer's common path (tensorsocket._core.Lane) reads of this place:
        the place itself (attached, closed), the box of the ring handle read through now,
        the box of the entry taken and not used, and the process the consumer reads in
        with the box of this process's pid (a forked child sets its own)."""
        return {"place": self, "ring_box": self._ring_box, "entry_box": self.flow.entry,
                "pid_box": _SELF_PID, "pid": self.pid}

    @property
    def token(self) -> int:
        """The token of this consumer's place (the producer's name for it)."""
        return self.client.token

    def ready(self, before: Callable[[], None] | None = None) -> None:
        """Say ready: the producer counts this consumer from its start entry
        (start_seq); decide where tensors are delivered, and start the heartbeats. A rank
        of a group that share() makes (`before`: what it does just before it says ready,
        SharedLoader.before_ready) decides the delivery first: its group starts at one
        entry once every rank said ready, so a rank maps the ring to its device (a CUDA
        context, page-locking) before, not while it counts as reading. A failure closes
        the place."""
        grouped = self._options.world_size > 1
        try:
            if before is not None:
                self.delivery.attach(self.ring)
                before()
                self.start_seq = self.client.ready(self.aligned, grouped)
            else:
                self.start_seq = self.client.ready(self.aligned, grouped)
                self.delivery.attach(self.ring)
        except BaseException:
            self.close()
            raise
        self.client.start_heartbeats()

    def check_process(self) -> None:
        """Raise if this is not the process the consumer was made in (a fork of it)."""
        if _SELF_PID[0] != self.pid:
            raise TensorSocketError(
                f"this TensorConsumer was created in process {self.pid} and cannot read in "
                f"process {os.getpid()}, a fork of it (its place in the producer's ring and its "
                "socket belong to the parent). Create a TensorConsumer in the child instead; "
                "batches the parent had received when it forked stay valid in the child")

    def list_epoch(self) -> EpochListing | str:
        """The order of the epoch this consumer reads first, as the producer will deliver
        it, or why the producer has none (ControlClient.list_epoch)."""
        if self.closed or self.in_forked_child():
            return "the consumer is closed" if self.closed else \
                "the consumer was made in another process (this is a fork of it)"
        return self.client.list_epoch()

    def in_forked_child(self) -> bool:
        """Whether this process is a fork of the one the consumer was made in."""
        return os.getpid() != self.pid

    def close(self) -> None:
        """Leave (see _teardown); in a fork's child, nothing (the parent's to close)."""
        if self.closed:
            return
        self.closed = True
        if self.in_forked_child():
            self._finalizer.detach()
            return
        self._finalizer()

    def flush_releases(self) -> None:
        """Release the slots of the batches dropped since the last call, after the GPU work
        queued on them (Delivery.flush_releases); a failed release raises here."""
        ring = self._ring_box[0]
        if ring is not None and not ring.closed:
            self.delivery.flush_releases(ring)

    def held_slots_blocking(self) -> int:
        """Slots this consumer holds, if one is the slot the producer must reuse next."""
        return self.ring.held_blocking()  # (the core counts them: ts_ring_held_blocking)

    # -- parking ------------------------------------------------------------------------

    def park(self, hold: bool = False, skip_epoch: bool = False) -> None:
        """Stop holding the producer back until the next batch is asked for (the
        producer still counts this consumer; the next batch attaches it again). hold:
        this consumer sits between epochs and its process reads another loader for a
        while; the producer keeps its place (and the entry it took ahead) for
        park_hold seconds once others read, so that it reads the same next epoch as
        the jobs it started with."""
        if not hold:
            self.drop_entry()
        self.cursor.parked()
        if self.attached and not self.closed:
            self.attached = False
            if self.aligned:
                self.held_place = hold
                self.client.request_park(hold, skip_epoch)
            else:
                self.client.request_leave()
        elif not hold and self.held_place and not self.closed:
            # Parked keeping its place, which now holds back a job that this process waits
            # for (see siblings): the place is given up (the entry kept with it was
            # released above), and the next batch attaches again at an epoch start.
            self.held_place = False
            self.client.request_park(False)

    def ensure_attached(self) -> None:
        """Before reading after a park: go on from the place the producer kept, or
        attach again (at an epoch start)."""
        if self.attached or self.closed:
            return
        if self.held_place:
            self.held_place = False
            if self._unpark():
                self.attached = True
                return
        self.attach_again()

    def _unpark(self) -> bool:
        """Whether the producer kept our place (ControlClient.unpark). A producer that
        finished, failed or died meanwhile may close without answering: then the place is
        gone, and attach_again() says why (ProducerFinished or ProducerFailed), instead of
        the lost reply's ProducerNotFound."""
        try:
            return self.client.unpark()
        except ProducerNotFound:
            ring = self.ring
            info = RingInfo.of(ring)
            if info.state == RingState.FINISHED or ring.failure() is not None or \
                    not ring.producer_alive():
                return False
            raise

    def cut_short(self) -> None:
        """The producer ended (failed, died, finished) before this consumer's epoch did:
        no more of it is read (its iterator raises). See mark_cut for what is kept."""
        self.mark_cut(self.cursor.in_epoch)
        self.cursor.in_epoch = False

    def mark_cut(self, in_epoch: bool) -> None:
        """The epoch being read, if `in_epoch`, is over because the producer ended. It is
        not counted as done, and its batches and samples taken stay where they are (the
        cursor and the samples taken are reset only when the next epoch begins): keeping
        its number here lets state_dict() still say what it took (ResumeBook.cut_place),
        since a checkpoint is usually written where the producer's error is caught, and
        one that forgot the epoch would train its samples again."""
        if in_epoch:
            self.cut_epoch = self.cursor.epoch

    def drop_entry(self) -> None:
        """Release the ring entry taken and not used (kept for the next epoch)."""
        entry = self.flow.entry
        slot, entry[0] = entry[0], None
        if slot is not None:
            slot.release()

    # -- attaching again ------------------------------------------------------------------

    def attach_again(self) -> int:
        """Take a new place in the same producer's ring (a late joiner); its first seq."""
        ring, options = self.ring, self._options
        info = RingInfo.of(ring)
        failure = ring.failure()
        # A producer that finished (whether its process has ended since or not) has no
        # more batches for a new place; one that failed, or died before it finished, says
        # so.
        if failure is None and info.state == RingState.FINISHED:
            self.cut_short()
            raise ProducerFinished(
                "the producer finished while this consumer was away from the ring (it had "
                "left its epoch, or was detached); no more batches will come")
        if failure is not None or not ring.producer_alive():
            self.cut_short()
            raise producer_failed(ring, options.endpoint.address, failure)
        # An entry kept from the place given up (also when an interrupt cut unpark short:
        # a new place may start at that very entry, which would then come twice).
        self.drop_entry()
        self.set_aside_held()
        self.client.stop_heartbeats()
        welcome = self.client.hello(options.batch_size, options.group, options.rank,
                                    options.world_size)
        if welcome.segment != self.segment:
            raise ConsumerDetached(
                "the producer that answered is a new one, not the one this consumer was "
                "attached to; create a new TensorConsumer to attach to it")
        self.ring.bind(welcome.consumer, welcome.token)
        self.index = welcome.consumer
        start = self.client.ready(self.aligned, self._options.world_size > 1)
        self.client.start_heartbeats()
        self.attached = True
        self.cursor.attached_again()
        log.info("consumer attached again as %d at entry %d", self.index, start)
        return start

    def rejoin(self, max_lag: int | None) -> None:
        """Attach again as a late joiner after the producer detached us for lagging."""
        old_cursor = self.ring.consumer(self.index)["cursor"] or 0  # set: it was reading
        start = self.attach_again()
        skipped = max(0, start - old_cursor)
        self.rejoins += 1
        self.skipped += skipped
        ended = " The current epoch ends here." if self.cursor.pulled > 0 else ""
        message = (
            f"this consumer fell more than max_lag={max_lag} batches behind the fastest "
            f"consumer, was detached and attached again as a late joiner; it skipped {skipped} "
            f"ring entries.{ended}")
        log.warning("%s", message)
        warnings.warn(message, LagWarning, stacklevel=7)

    def start_late(self) -> None:
        """Attach again after the producer detached us for reading nothing while the
        others waited (a consumer made long before its loop starts: share() at the top of
        a script, then minutes of model set-up). It had read nothing, so nothing is lost:
        as a DataLoader made early starts when it is iterated, it starts now, a late
        joiner with whole epochs from the next epoch start."""
        start = self.attach_again()
        log.info("consumer %d read nothing for longer than the others would wait, so the "
                 "producer went on without it; it starts now, at entry %d", self.index,
                 start)

    def set_aside_held(self, rebind: bool = False) -> bool:
        """Batches of this consumer still alive (the loop variable of a loop left with
        break, batches the script keeps) hold their ring slots; when the producer must
        refill one of them before this consumer's next batch can come, the consumer would
        wait for itself. Instead those batches become private copies here (as a
        DataLoader's batches are private memory), their slots go back to the producer, and
        the consumer reads on through a new mapping of the ring: before it attaches again,
        or (rebind) at once, in the same place. Whether that happened (not on a GPU ring,
        nor with pin_memory=True: there the slots stay held)."""
        ring = self.ring
        held = ring.held_slots()
        if held == 0 or self.delivery.gpu_import:
            return False
        fresh = None
        try:
            fresh = Ring.open(self.segment)  # first: a failure leaves all as it was
            if rebind:
                fresh.bind(self.index, self.client.token)
            # Done, it puts fresh in the box itself: an interrupt as it returns cannot
            # leave this consumer reading through the handle set aside.
            ring.set_aside(self._ring_box, fresh)
        except (ValueError, OSError) as e:
            if fresh is not None:
                fresh.close()
            if getattr(e, "errno", None) == errno.ENOMEM:  # nothing was handed back
                raise MemoryError(diagnosis.kept_batches_no_memory(
                    held, self.set_aside_batches)) from e
            log.info("consumer %d keeps %d ring slots held by batches still alive: %s",
                     self.index, held, e)
            return False
        ring.close()  # the views of its batches keep that mapping until they go
        self.set_aside_batches += held
        log.info("consumer %d: %d batches still alive were copied privately, so that it "
                 "never waits for their ring slots", self.index, held)
        return True


def _teardown(client: ControlClient, context: zmq.Context, ring_box: list, delivery: Delivery,
              pid: int) -> None:
    """Say bye, close the socket and drop our ring handle. If the producer died,
    the last one out removes its segment name (nobody else will). Nothing in a forked
    child (the consumer, its socket and its place are the parent's). Also what an attach
    that failed half-way undoes (no ring yet: nothing to say bye for)."""
    if os.getpid() != pid:
        return
    ring = ring_box[0]
    if ring is None:
        client.close(say_bye=False, wait=0.2)
        context.term()
        return
    if ring.closed:  # the handle was closed under us (c.ring.close()): say bye, no more
        client.close(say_bye=True)
        context.term()
        return
    try:  # releases of dropped views go before the ring handle, and before exit
        delivery.flush_releases(ring, RELEASE_DRAIN_MS)
    except Exception as e:  # a failed release: its slot stays held until we leave
        log.warning("GPU releases at close: %s", e)
    info = RingInfo.of(ring)
    producer_alive = ring.producer_alive()
    client.close(say_bye=producer_alive and info.state == RingState.OPEN)
    context.term()
    ring.close()
    if not producer_alive:
        Ring.unlink_name(info.name)


def producer_failed(ring: Any, address: str, cause: str | None,
                    gone: str | None = None) -> ProducerFailed:
    """The error for a producer that failed (cause: its error, from the ring; a producer
    that SIGTERM ended writes that there too) or whose process is gone without finishing
    the ring (cause None), or, with the ring's own words (gone), whose process exited after
    finishing it while batches of its GPU memory were still unread here. A process gone
    without a word was killed by a signal it cannot catch or crashed: which one is not
    known here, so none is guessed."""
    info = RingInfo.of(ring)
    pid = info.producer_pid
    if cause is None:
        cause = ring.failure()  # the process may be seen gone after it wrote why
    if cause is not None:
        what = f"the producer (pid {pid}) failed: {cause}"
    elif gone is not None and info.state == RingState.FINISHED:
        what = gone
    else:
        what = (f"the producer process (pid {pid}) is gone without finishing, and left no "
                "reason: it was killed by a signal it cannot catch (SIGKILL: kill -9, or the "
                "kernel's out-of-memory killer, which the kernel log names) or it crashed; "
                "its own output says which")
    return ProducerFailed(
        f"{what}. No more batches will come from {address}: this consumer is done; create a "
        "new TensorConsumer once a producer runs there again", cause=cause)
