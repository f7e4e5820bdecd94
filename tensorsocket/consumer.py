"""TensorConsumer: iterate the producer's batches like a DataLoader, zero-copy."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import warnings
import weakref
from typing import Any, Callable

import numpy as np
import zmq

from . import _core, config
from .data import diagnosis, sample_ids
from .control.producer_watch import ProducerWatch
from .control.auth import ClientSecret
from .config import UNSET, Unset
from .control.client import ControlClient
from .data.delivery import Delivery
from .control.endpoints import resolve
from .data.epoch_cursor import Abandon, EpochCursor, InFlight, Step
from .errors import (
    ConsumerDetached,
    LagWarning,
    ProducerFailed,
    ProducerFinished,
    ProducerGone,
    TensorSocketError,
    TensorSocketWarning,
)
from .loader.loader_info import LoaderShape
from .data.rebatch import EpochEnd, Rebatcher, batch_samples, combine, consumer_len
from .data.resume import EpochTaken, SavedPlace
from .data.sample_ids import IdMask
from .surface import LoaderSurface

log = logging.getLogger("tensorsocket")

DEFAULT_TIMEOUT = config.SETTINGS["timeout"].default
STALL_WARN_AFTER = 5.0  # seconds waiting for a batch the consumer's own held batches block
SIBLING_PARK_AFTER = 0.5  # seconds of waiting before this process's idle consumers park
SET_ASIDE_AFTER = 0.05  # seconds a wait lasts between checks for kept batches that block
FLUSH_EVERY = 0.05  # seconds a GPU consumer's wait lasts between flushes of its releases
RELEASE_DRAIN_MS = 10000  # at close: longest wait for the GPU work before dropped batches

# Every open consumer of this process, for parking the idle ones (see _park_idle_siblings).
_CONSUMERS: "weakref.WeakSet[TensorConsumer]" = weakref.WeakSet()

# A child forked while this process holds batches (multiprocessing's fork, os.fork) gets
# private copies of them: a DataLoader's batches are private memory that a fork copies, and
# the parent dropping its views (the producer then refills their slots) must not change
# what the child reads.
# _SELF_PID: this process's pid, for the per-batch check that a consumer reads in the
# process that made it (os.getpid() is a system call); a forked child sets its own.
_SELF_PID = [os.getpid()]


def _after_fork_in_child() -> None:
    _core.fork_child()
    _SELF_PID[0] = os.getpid()


os.register_at_fork(before=_core.fork_prepare, after_in_parent=_core.fork_parent,
                    after_in_child=_after_fork_in_child)


class TensorConsumer(LoaderSurface):
    """Receive the batches of a TensorProducer; a drop-in for a DataLoader.

    ``for batch in consumer:`` is one epoch and ends with StopIteration;
    iterating again gives the next epoch. Batches keep the loader's
    structure; tensors are zero-copy views of the shared ring, writable like a
    DataLoader's: an in-place op makes the pages it writes private to this
    process (copy on write; not on a GPU ring, nor with ``pin_memory=True``:
    pass ``copy=True`` there for private writable copies, or ``.clone()``). A
    batch holds its ring slot for as long as any tensor (or slice of one) from
    it is alive.

    Epochs: a consumer attached before the producer's first batch, or between
    two epochs, sees the producer's epochs. A late joiner starts at the oldest
    batch of the producer's window (see TensorProducer) and each of its epochs
    is the next ``len(consumer)`` batches, wrapping into the producer's next
    epoch. Leaving an epoch mid-way (break, dropping the iterator, or a new
    iteration) leaves the ring at once, so the others never wait for this
    consumer; the next batch asked for attaches it again, as a late joiner.

    Positional parameters follow the original TensorSocket
    (``port, ack_port, heart_ports, unpack_fn, batch_size``); like the original
    (0.0.4, 0.0.5), the consumer yields the batch itself (``with_index=True``
    yields ``(batch_index, batch)`` pairs instead).

    batch_size: samples per batch (None: the loader's own batches, untouched).
      When it divides the loader's batch size, batches are zero-copy slices;
      otherwise samples are concatenated across loader batches (one copy of
      those samples). Every sample comes exactly once per epoch, in order.

    ``len(consumer)`` is the number of batches in one of its epochs: the
    producer's loader's ``len()``, or with ``batch_size=`` the batches of that
    size its samples make (``drop_last`` counted). It raises TypeError, as a
    DataLoader over an IterableDataset without ``__len__`` does, when the
    producer's loader has no ``len()`` (a generator, say), or, with
    ``batch_size=``, when its sample count is unknown (a loader that is
    neither a DataLoader nor has an int ``batch_size``). ``tqdm(consumer)``
    handles that TypeError.

    Keeping batches: the ring has a few slots (``TensorProducer(ring_slots=)``)
    and every batch still alive holds one, so code that keeps more batches
    than that (``list(consumer)``, a batch taken with ``next(iter(consumer))``
    and kept while the loop runs) stops the producer and every consumer. A
    consumer that waits for a batch its own kept batches block warns after a
    few seconds (TensorSocketWarning); ``copy=True`` gives batches that hold
    no slot.

    Settings marked (env) below take their value from the argument, else from
    their ``TENSORSOCKET_*`` environment variable, else the default; see
    tensorsocket.config and docs/configuration.md.

    Keyword-only:
      drop_last: drop the last batch of an epoch if it has fewer than
        batch_size samples (as DataLoader(drop_last=True)).
      name / address: rendezvous, as for TensorProducer (env).
      timeout: seconds to wait for the producer to answer (default 60; None
        or float('inf'): forever; NaN or a negative number is refused); then
        ProducerNotFound, or ProducerFailed at once if the producer died
        first (env).
      batch_timeout: seconds to wait for one batch (None, the default, or
        float('inf'): as long as the producer lives); then TimeoutError (env).
      copy: deliver private, writable copies instead of views.
      with_index: yield (batch_index, batch) pairs; batch_index counts the
        batches of the current epoch from 0.
      device: where tensors are delivered. None (default): where the
        producer put them: on its GPU for a GPU ring (read in place through
        CUDA IPC, no copy), else in host memory. ``"cpu"``: host memory, even
        from a GPU ring. ``"cuda:N"``: on GPU N: in place if the ring is on
        GPU N, through peer access if it is on another GPU (or copied into
        GPU N with ``peer_access=False``), copied by this consumer from a
        host ring. ``"cuda"``: torch's current GPU (torch.cuda.current_device()
        when the consumer attaches), as torch reads "cuda". If CUDA IPC cannot
        work (another PID namespace, no driver here, ...), a
        GPUFallbackWarning says why and tensors come through host memory
        (copied to ``device`` if one was given).
        ``"auto"`` is the default's name (env:
        ``TENSORSOCKET_CONSUMER_DEVICE``).
      pin_memory: page-lock this process's mapping of the ring's host slots,
        so copies from them to a GPU are asynchronous (like
        DataLoader(pin_memory=True), without its extra copy). They are
        page-locked for one GPU: ``device``'s, else torch's current device
        when the consumer is created (torch.cuda.current_device(), as the
        DataLoader does; call torch.cuda.set_device first). A dropped view's
        slot goes back only after the work queued on that GPU before the
        release (docs/gpu.md, "Orderings on the GPU path"): copies out of
        the views to another GPU are not waited for.
      peer_access: read a GPU ring on another GPU through peer access
        (default True); False copies each batch into ``device`` instead.
        Where the two GPUs have no peer access (cuDeviceCanAccessPeer; MIG
        instances), a GPUFallbackWarning names both and batches are copied.
      align_epochs: every epoch is one whole epoch of the producer, from its
        first batch (default True): a consumer that attaches mid-epoch starts
        at the next epoch's first batch, unless the current one's is still in
        the ring. False: a late joiner starts at once, in the producer's
        window, and its epochs span two of the producer's (docs/usage.md).
        Only for loaders with ``len()``: without one, a late joiner always
        starts at once (the stream may never start another epoch).
      rank, world_size, group: this consumer is rank ``rank`` of the
        ``world_size`` ranks of one data-parallel job (``group`` names the
        job; share() fills all three from torchrun's environment): the ranks
        split the stream, rank r taking loader batches r, r + world_size, ...
        of each epoch, each rank the same number (``len(loader) //
        world_size``); they start together, at the same entry.
      auth_token: the producer's secret, for a producer on a TCP address
        (env). Default: read from the producer's ``<runtime dir>/<name>.secret``
        (same user, runtime directory and name/port as the producer); give it
        where that file cannot be read. See tensorsocket.control.auth.
    """

    # Set by tensorsocket.share() on the consumers it returns.
    started_producer: bool = False
    """share(): True if this call started the producer process."""
    producer_log: Any = None
    """share(): the producer process's log file (a pathlib.Path), else None."""
    dataset: Any = None
    """share(): the caller's ``loader.dataset``, when its loader has one, else None."""
    _defer_ready = False  # share(): ready is said later, by _ready_now()

    def __init__(
        self,
        port: int | str | None = None,
        ack_port: int | str | None = None,
        heart_ports: Any = None,
        unpack_fn: Callable[[Any], Any] | None = None,
        batch_size: int | None = None,
        *,
        drop_last: bool = False,
        name: str | None = None,
        address: str | None = None,
        timeout: float | None | Unset = UNSET,
        batch_timeout: float | None | Unset = UNSET,
        copy: bool = False,
        with_index: bool = False,
        device: Any = UNSET,
        pin_memory: bool = False,
        peer_access: bool = True,
        align_epochs: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        group: str | None = None,
        auth_token: str | None = None,
    ) -> None:
        given = config.Resolver()
        # The timeouts as resolved: the argument, else the environment, else the default.
        answer_wait: float | None = given.get("timeout", timeout)
        batch_wait: float | None = given.get("batch_timeout", batch_timeout)
        if isinstance(device, str) and device == "auto":
            device = None  # explicitly the default: the environment does not apply
        else:
            device = given.get("consumer_device", device)
        name = given.get("name", name)
        if port is None:
            address = given.get("address", address)
        given.get("runtime_dir")
        self._rebatcher = Rebatcher(batch_size, drop_last) if batch_size is not None else None
        # A resumed epoch of a consumer without batch_size= cuts the samples it keeps into
        # the loader's batch size (set at the epoch's start; see _begin_taken).
        self._resume_batcher: Rebatcher | None = None
        self.unpack_fn = unpack_fn
        self._own_batch_size = batch_size  # None: the producer's batches as they are
        self._drop_last = bool(drop_last)
        self._loader_drop_last = False  # share(): the loader's, when batches come as they are
        self.batch_timeout = batch_wait
        # Not `timeout`: training code reads that as DataLoader.timeout (a batch fetch limit).
        self.answer_timeout = answer_wait
        self.copy = bool(copy)
        self.pin_memory = bool(pin_memory)
        self.peer_access = bool(peer_access)
        self._delivery = Delivery(device, self.copy, self.pin_memory, self.peer_access)
        # The original TensorSocket (0.0.5) yields the batch itself, with or without ports.
        self.with_index = bool(with_index)
        self.align_epochs = bool(align_epochs)
        self._aligned = False  # align_epochs, and the loader has a len() (set on attach)
        self.rank, self.world_size = _check_group(rank, world_size)
        if group is not None and (not isinstance(group, str) or len(group) > 200):
            raise TypeError(f"group must be a str of at most 200 characters, got {group!r}")
        self.group = group
        self.endpoint = resolve(name, port, address)
        self._closed = False
        self._state_lock = threading.Lock()  # __iter__ against parking from another thread
        self._attached = True  # False after leaving mid-epoch, until the next batch
        self._held_place = False  # parked between epochs, asking to keep the place
        # What next() took and has not returned yet, and the counts of what it returned.
        self._flow = InFlight()
        self._skipped_to_align = 0  # entries skipped waiting for an epoch start
        self._iterators = 0  # iter() calls: the last one's iterator is the current one
        self._local_loader: Any = None  # share(): the caller's own loader (attributes)
        self._set_epoch_warned = False
        # Exact resume (tensorsocket.data.resume): the place loaded and not yet resumed from,
        # the place of an epoch left mid-way (break), the samples of this epoch taken.
        self._resume_place: SavedPlace | None = None
        self._left_place: SavedPlace | None = None
        self._left_source: int | None = None  # the producer epoch it was left in
        # A resumed group epoch left: the sample ids read and not yet dealt, in order.
        self._left_stream: list | None = None
        # Counters for stats() (and those of self._flow).
        self._wait_s = 0.0
        self._rejoins = 0
        self._skipped = 0
        self._set_aside_batches = 0  # kept batches copied privately (see _set_aside_held)

        self._pid = os.getpid()  # the process this consumer reads in (a fork's child may not)
        secret = ClientSecret(self.endpoint, auth_token)
        self._context = zmq.Context()
        self._client = ControlClient(self._context, self.endpoint.address, answer_wait, secret)
        # The name's lock file tells of a producer that died before answering; an address
        # given explicitly may belong to a producer of another name.
        watch = ProducerWatch(self.endpoint, answer_wait) \
            if port is not None or address is None else None
        ring = None
        try:
            welcome = self._client.hello(batch_size, group, self.rank, self.world_size,
                                         watch=watch)
            ring = _core.Ring.open(welcome.segment)
            ring.bind(welcome.consumer, welcome.token)
            # Whole epochs need an epoch length: a loader without len() may be an endless
            # stream, whose next epoch never starts; a late joiner reads on from where it is.
            self._aligned = self.align_epochs and welcome.length is not None
            self._cursor = EpochCursor(self._aligned, welcome.length, self.rank,
                                       self.world_size)
            self._taken = EpochTaken(self.world_size, batch_size)
            self.start_seq = -1
            if not self._defer_ready:
                self.start_seq = self._client.ready(self._aligned, self.world_size > 1)
        except BaseException:
            if ring is not None:
                ring.close()
            self._client.close(say_bye=ring is not None, wait=0.2)
            self._context.term()
            raise
        # The current ring handle, in a box: a set-aside puts its successor there itself
        # (see _set_aside_held), and the finalizer closes whatever handle is there then
        # (set-aside ones go with their views).
        self._ring_box = [ring]
        self._segment: str = welcome.segment
        self._index: int = welcome.consumer
        self._shape = LoaderShape.of_reply(welcome)  # what the producer's loader yields
        self.loader_batch_size: int | None = welcome.loader_batch_size
        self.samples_per_epoch: int | None = welcome.samples
        # What the producer's loader reads: its dataset's type name and length (or None).
        self.producer_dataset: str | None = welcome.dataset
        self.producer_dataset_len: int | None = welcome.dataset_len
        self.producer_pid: int = welcome.producer_pid
        self.window: int = welcome.window
        self.max_lag: int | None = welcome.max_lag or None
        self.lag_policy: str = welcome.lag_policy
        self.producer_fingerprint: str | None = welcome.fingerprint
        # The producer calls set_epoch on its loader's sampler itself.
        self._producer_sets_epoch: bool = welcome.auto_set_epoch
        try:
            self._delivery.attach(ring)
        except BaseException:
            ring.close()
            self._client.close(say_bye=True, wait=0.2)
            self._context.term()
            raise
        if not self._defer_ready:
            self._client.start_heartbeats()
        self._finalizer = weakref.finalize(self, _teardown, self._client, self._context,
                                           self._ring_box, self._delivery, self._pid)
        _CONSUMERS.add(self)
        log.info("consumer %d attached to %s at entry %d", self._index, self.endpoint.address,
                 self.start_seq)
        if given.origins:
            log.info("consumer settings from the environment: %s", given.describe())

    @property
    def _ring(self) -> Any:
        """The ring handle this consumer reads through now."""
        return self._ring_box[0]

    @property
    def device(self) -> str:
        """Where tensors are delivered: ``"cpu"``, or ``"cuda:N"``."""
        return self._delivery.device

    @property
    def device_fallback_reason(self) -> str | None:
        """Why the producer's GPU ring is read through host memory here (None: it is not)."""
        return self._delivery.fallback_reason

    @property
    def drop_last(self) -> bool:
        """Whether a short last batch is dropped: this consumer's drop_last= when it cuts
        its own batches, else the loader's (share() knows it from the caller's loader)."""
        return self._drop_last if self._own_batch_size is not None else self._loader_drop_last

    @property
    def batch_size(self) -> int | None:
        """Samples per batch, as DataLoader.batch_size: the batch_size= asked for, else
        the producer's loader's (None if it has none)."""
        return self._own_batch_size or self.loader_batch_size

    def _ready_now(self) -> None:
        """Say ready (a consumer made with _defer_ready: share() makes the ranks of a
        group wait for each other outside its election lock)."""
        try:
            self.start_seq = self._client.ready(self._aligned, self.world_size > 1)
        except BaseException:
            self.close()
            raise
        self._client.start_heartbeats()
        log.info("consumer %d started at entry %d", self._index, self.start_seq)

    # -- DataLoader protocol -----------------------------------------------------------

    def __len__(self) -> int:
        """Batches in one epoch of this consumer; TypeError if that is unknown (see the
        class docstring)."""
        if self._shape.length is None:
            raise TypeError(
                "len() of this consumer is unknown: the producer's loader has no len() (a "
                "generator or an iterable without __len__, as a DataLoader over an "
                "IterableDataset without __len__); iterate without len(), or give the "
                "producer a loader with __len__"
            )
        if self._own_batch_size is None:
            return self._shape.length // self.world_size
        if self.samples_per_epoch is None:
            raise TypeError(
                f"len() of this consumer is unknown: the producer's loader does not tell "
                f"its sample count (it is not a DataLoader and has no int batch_size), so "
                f"the number of batch_size={self._own_batch_size} batches per epoch is unknown"
            )
        return consumer_len(self._rank_samples(), self._own_batch_size, self._drop_last)

    def _rank_samples(self) -> int:
        """Samples one epoch brings this consumer (its rank's share in a group)."""
        return self._shape.rank_samples(self.rank, self.world_size)

    def _check_process(self) -> None:
        """Raise if this is not the process the consumer was made in (a fork of it)."""
        if _SELF_PID[0] != self._pid:
            raise TensorSocketError(
                f"this TensorConsumer was created in process {self._pid} and cannot read in "
                f"process {os.getpid()}, a fork of it (its place in the producer's ring and its "
                "socket belong to the parent). Create a TensorConsumer in the child instead; "
                "batches the parent had received when it forked stay valid in the child")

    def __iter__(self) -> "EpochIterator":
        """The next epoch (an earlier iterator still mid-epoch ends here)."""
        self._check_process()
        if self._closed:
            raise TensorSocketError("this consumer is closed")
        with self._state_lock:
            if self._cursor.in_epoch:  # an earlier iterator is still mid-epoch: it ends here
                self._abandon_epoch(self.epoch)
            if not self._cursor.in_epoch:  # (else its first next() was interrupted: go on)
                self._cursor.begin()
                self._begin_taken()
            self._iterators += 1
            return EpochIterator(self, self._iterators)

    def _next_batch(self) -> Any:
        """What next() returns next (the batch of the current epoch, unpacked, with its
        index if asked); StopIteration at the epoch's end. The batch stays in
        ``self._flow.ready`` until EpochIterator.__next__ counts it as delivered.

        A KeyboardInterrupt (Ctrl-C caught by the loop, which goes on) may land anywhere
        here; the next call goes on from the state it left: a ring entry taken stays in
        flow.entry (Ring.acquire puts it there), the cursor places an entry placed already
        as before and takes it once (see epoch_cursor), the batch made of it waits in
        flow.loaded, then flow.ready, each moved on in a step with no call in it, and the
        end of an epoch is counted last, once its other steps (which may be repeated) are
        done."""
        self._check_process()
        cursor, flow = self._cursor, self._flow
        self._flush_releases()
        if flow.ready is None or cursor.resuming and self.world_size > 1:
            if not cursor.in_epoch:
                raise StopIteration
            if cursor.fresh():
                _park_idle_siblings(self)  # nobody waits for this process's idle consumers
            try:
                self._make_ready()
            except EpochEnd:
                if self._batcher is not None:
                    self._batcher.reset()
                self._take_end_marker()
                cursor.end()
                self._flush_releases()
                raise StopIteration from None
        batch = flow.ready[0]  # type: ignore[index]
        if self.unpack_fn is not None:
            batch = self.unpack_fn(batch)
        return (cursor.delivered, batch) if self.with_index else batch

    @property
    def _batcher(self) -> Rebatcher | None:
        """What cuts this epoch's batches: the resumed epoch's, else batch_size='s."""
        return self._resume_batcher or self._rebatcher

    def _make_ready(self) -> None:
        """Make the next batch of this epoch into flow.ready (see _next_batch); EpochEnd
        after its last. In a resumed epoch, the batches it still owes (see _resume_quota);
        in a resumed group epoch, the batches dealt to this rank."""
        cursor, flow, taken = self._cursor, self._flow, self._taken
        batcher = self._batcher
        dealing = cursor.resuming and self.world_size > 1 and batcher is not None
        while True:
            if flow.ready is not None:
                if not dealing:
                    return
                # Which rank's it is follows from the count of batches made (the same
                # after an interrupt before this step: the batch is dealt once).
                assert batcher is not None
                index = batcher.handed_over - 1 - taken.deal_base
                taken.deal(index, flow.ready[2])
                if index % self.world_size == self.rank:
                    return
                flow.ready = None  # another rank's batch of the deal
                continue
            if cursor.resuming and cursor.delivered >= self._resume_quota():
                raise EpochEnd
            if batcher is None:
                batch, n, ids = self._pull()
                # (n None: neither the loader nor a tensor with a dimension tells)
                flow.ready, flow.loaded = (batch, n or 0, ids), None
            else:
                if cursor.resuming and self.world_size > 1:
                    batcher.batch_size = taken.deal_batch_size(self.batch_size or 1)
                batcher.next_batch(self._pull, flow)
            if cursor.skip:  # taken before the state resumed from: as delivered
                cursor.skip -= 1
                cursor.delivered += 1
                flow.ready = None

    def _resume_quota(self) -> float:
        """Batches of this consumer's resumed epoch, counting those delivered before the
        interruption: one epoch's (len()), or no limit if that is unknown."""
        try:
            return len(self)
        except TypeError:
            return float("inf")

    def _begin_taken(self) -> None:
        """An epoch begins: what it takes is recorded from nothing, or from the place
        loaded by load_state_dict() (a resumed epoch)."""
        place, self._resume_place = self._resume_place, None
        if not self._cursor.resuming:
            place = None  # (none loaded, or one that resumes by count)
        taken = self._taken
        taken.begin(place)
        self._left_place, self._left_stream = None, None
        batch_size = self.loader_batch_size
        self._resume_batcher = Rebatcher(batch_size, self._loader_drop_last) \
            if place is not None and self._rebatcher is None and batch_size else None
        if place is not None and place.taken is not None and self.world_size > 1:
            # What the ranks' deal hands out: the samples not taken, at most the batches
            # each rank is still owed.
            size = place.dataset_len if place.dataset_len is not None \
                else place.taken.bits.size
            owed = self._resume_quota() - place.batches
            taken.deal_base = self._batcher.handed_over if self._batcher is not None else 0
            taken.deal_total = int(min(size - place.taken.count(),
                                       owed * self.world_size * (self.batch_size or 1)))

    def _place_now(self, look_ahead: bool = False) -> SavedPlace:
        """Where this consumer is in its epochs, for state_dict(): epochs completed, batches
        delivered of the current one and the samples of it taken (by the group). In a
        group, look_ahead reads on to this rank's next batch when the group's batches
        taken are not all seen yet (the ranks ahead of it in the deal)."""
        cursor = self._cursor
        if not cursor.in_epoch:
            return SavedPlace(cursor.epoch, 0, None, self.producer_dataset_len)
        batches, size = cursor.delivered, self.producer_dataset_len
        if self.world_size > 1 and self._taken.known and size is not None and \
                self._epoch_complete():
            # Every rank's batches of the epoch were delivered (ranks step together): all
            # of it is taken, what no rank takes (the tail a group leaves) included.
            return SavedPlace(cursor.epoch, batches, IdMask.whole(size), size)
        taken = self._taken.taken(batches)
        if taken is None and look_ahead and self.world_size > 1 and self._taken.known:
            self._read_to_next_batch()
            taken = self._taken.taken(batches)
            if taken is None and self._taken.known:
                log.warning("consumer %d (rank %d of %d): the group's batches before its "
                            "own next one did not all come; its state counts batches only",
                            self._index, self.rank, self.world_size)
        return SavedPlace(cursor.epoch, batches, taken, self.producer_dataset_len)

    def _left_place_now(self) -> SavedPlace | None:
        """The place of the epoch left mid-way, for state_dict(). A rank of a group reads
        on through the rest of the producer epoch it left (it skips it anyway) until the
        group's batches taken are all seen; the entry after that epoch stays for the next."""
        place = self._left_place
        if place is None or place.taken is not None or self.world_size == 1 or \
                not self._taken.known or self._left_source is None or self._closed:
            return place
        if self._left_stream is not None:
            self._deal_on(place.batches)
        else:
            while self._taken.taken(place.batches) is None:
                read = self._read_on_in_left_epoch()
                if read is None:
                    break
                self._taken.group_batch(*read)
        self._left_place = place = SavedPlace(place.epoch, place.batches,
                                              self._taken.taken(place.batches),
                                              place.dataset_len)
        return place

    def _read_on_in_left_epoch(self) -> tuple[int, Any] | None:
        """The next entry of the producer epoch left mid-way, skipped (as reading on would
        skip it): (its index, its sample ids); None once that epoch is over (the entry
        after it stays in flow.entry, for the next epoch to place) or reading stopped."""
        entry = self._flow.entry
        slot = entry[0]
        if slot is None:
            try:
                slot = self._acquire()
            except (TensorSocketError, TimeoutError) as e:  # the state says less
                log.info("consumer %d: reading on for its state stopped: %s", self._index, e)
                return None
        if slot.is_end_of_epoch or slot.epoch != self._left_source:
            return None
        read = slot.index, sample_ids.split(slot.meta)[1]
        self._cursor.place(slot)  # (the rest of the epoch left: skipped)
        entry[0] = None
        slot.release()
        return read

    def _deal_on(self, batches: int) -> None:
        """A resumed group epoch was left: go on with the deal (reading on in the
        producer epoch it read, keeping the samples not taken, cutting them as the deal
        does) until the group's batches taken by `batches` of each rank are known."""
        taken, stream = self._taken, self._left_stream
        assert stream is not None
        ended = False
        while taken.taken(batches) is None:
            size = taken.deal_batch_size(self.batch_size or 1)
            while sum(0 if ids is None else ids.size for ids in stream) < size and not ended:
                read = None if taken.unclaimed(self.producer_dataset_len) == 0 \
                    else self._read_on_in_left_epoch()
                if read is None:
                    ended = True
                elif read[1] is None:
                    stream.append(None)
                else:
                    stream.append(read[1][taken.keep(read[1])])
            if any(ids is None for ids in stream):
                taken.known = False  # (a batch without sample ids: the state counts)
                return
            joined = np.concatenate(stream) if stream else np.empty(0, np.int64)
            if joined.size == 0:
                return
            stream[:] = [joined[size:]]
            taken.deal(taken.dealt, joined[:size])

    def _delivered_and_pending(self) -> tuple[list[list[int]], list[list[int]]] | None:
        """For a sampler view (consumer.batch_sampler): the samples of the batches this
        consumer delivered of its current (or resumed) epoch, and those it is still owed,
        each in batches of its batch size (in a group, this rank's deal of the samples not
        taken); None when the samples are not known. The batches delivered are told by
        their samples, not their order."""
        if self._resume_place is not None and not self._cursor.in_epoch:
            place, mine = self._resume_place, None
        else:
            place = self._left_place or self._place_now()
            mine = self._taken.mine
        size, batch_size = place.dataset_len, self.batch_size
        if place.taken is None or size is None or not batch_size:
            return None
        taken = place.taken.bits[:size]
        own = mine.bits[:size] if mine is not None and self.world_size > 1 else taken
        delivered = _chunks(np.flatnonzero(own), batch_size)[:place.batches]
        pending = _chunks(np.flatnonzero(~np.pad(taken, (0, size - taken.size))),
                          batch_size)
        owed = max(self._resume_quota() - place.batches, 0)
        dealt = pending[self.rank::self.world_size]
        return delivered, dealt[:int(min(owed, len(dealt)))]

    def _read_to_next_batch(self) -> None:
        """Make this rank's next batch ready (not delivered), reading the group's batches
        before it; nothing if the epoch ends first (its next next() ends it)."""
        if self._epoch_complete():
            return
        try:
            self._make_ready()
        except EpochEnd:
            return
        if self._cursor.resuming or self._own_batch_size is None:
            return
        # Own batch sizes: the other ranks' batches up to this rank's next loader batch
        # (kept, placed, for its next next()), which hold the rest of their samples taken.
        entry = self._flow.entry
        while entry[0] is None and not self._cursor.source_done:
            try:
                slot = self._acquire()
            except (TensorSocketError, TimeoutError):
                return  # (the producer finished or is gone: the state says what is known)
            step = self._cursor.place(slot)
            if step is not Step.DROP:
                return  # a batch of ours (TAKE), or the epoch's end: kept for next()
            if not slot.is_end_of_epoch:
                self._taken.group_batch(slot.index, sample_ids.split(slot.meta)[1])
            entry[0] = None
            slot.release()

    def _flush_releases(self) -> None:
        """Release the slots of the batches dropped since the last call, after the GPU work
        queued on them (Delivery.flush_releases); a failed release raises here."""
        ring = self._ring_box[0]
        if ring is not None and not ring.closed:
            self._delivery.flush_releases(ring)

    def _take_end_marker(self) -> None:
        """After an epoch that ended with its last batch (len() known), take the
        producer's end-of-epoch marker now if it is already published, so that nothing
        of the finished epoch stays unread (an entry of the next epoch is kept for it)."""
        if not self._cursor.wants_end_marker() or not self._attached:
            return
        entry = self._flow.entry
        slot = entry[0]  # an entry of the next epoch, or the marker (taken, then interrupted)
        if slot is None:
            try:
                slot = self._ring.acquire(0, entry)
            except Exception:  # nothing published yet (or the producer is gone): later
                self._cursor.marker_unpublished()
                return
        if self._cursor.ends_finished_epoch(slot):
            entry[0] = None
            slot.release()

    def _holding(self) -> bool:
        """Samples of the current epoch are held back, to be delivered (a partial batch
        of the re-batcher, unless drop_last drops it)."""
        rebatcher = self._batcher
        return rebatcher is not None and not rebatcher.drop_last and rebatcher.holding()

    def _epoch_complete(self) -> bool:
        """Every batch of the current epoch was delivered (its end not yet reported)."""
        return self._cursor.complete(self._holding())

    def _abandon_epoch(self, epoch: int) -> None:
        """The epoch's iterator was dropped or replaced before StopIteration (see
        EpochCursor.abandon). Left mid-way (break), the consumer parks, and its next
        batch comes from the start of the producer's next epoch. Aligned, it keeps its
        place while parked (for park_hold seconds once others read; it skips the rest of
        the epoch it left when it reads again), so that its next epoch is the one the jobs
        it started with read: a loop left early (Lightning's sanity check of a validation
        loader) would otherwise come back as a late joiner, an epoch later than the
        others. Safe from a finalizer: it only sets flags and events."""
        if self._closed or os.getpid() != self._pid:
            return
        cursor = self._cursor
        place = self._place_now() if cursor.in_epoch and cursor.epoch == epoch else None
        source = cursor.producer_epoch
        batcher = self._batcher
        stream = None
        if cursor.resuming and self.world_size > 1 and batcher is not None:
            loaded = self._flow.loaded
            stream = batcher.held_ids() + ([loaded[2]] if loaded is not None else [])
        outcome = cursor.abandon(epoch, self._holding())
        if outcome in (Abandon.COMPLETE, Abandon.LEFT):
            self._flow.drop()
            if batcher is not None:
                batcher.reset()
        if outcome is not Abandon.LEFT:
            return
        # What state_dict() says until the next epoch begins.
        self._left_place, self._left_source, self._left_stream = place, source, stream
        if self.world_size > 1 and self._aligned:
            # A rank stays attached and skips the rest of the epoch as it reads on, so
            # that every rank of its group starts the same next epoch.
            return
        self._park(hold=self._aligned, skip_epoch=True)

    def _park(self, hold: bool = False, skip_epoch: bool = False) -> None:
        """Stop holding the producer back until the next batch is asked for (the
        producer still counts this consumer; the next batch attaches it again). hold:
        this consumer sits between epochs and its process reads another loader for a
        while; the producer keeps its place (and the entry it took ahead) for
        park_hold seconds once others read, so that it reads the same next epoch as
        the jobs it started with."""
        if not hold:
            self._drop_entry()
        self._cursor.parked()
        if self._attached and not self._closed:
            self._attached = False
            if self._aligned:
                self._held_place = hold
                self._client.request_park(hold, skip_epoch)
            else:
                self._client.request_leave()
        elif not hold and self._held_place and not self._closed:
            # Parked keeping its place, which now holds back a job that this process waits
            # for (see _park_idle_siblings): the place is given up (the entry kept with it
            # was released above), and the next batch attaches again at an epoch start.
            self._held_place = False
            self._client.request_park(False)

    def _ensure_attached(self) -> None:
        """Before reading after a park: go on from the place the producer kept, or
        attach again (at an epoch start)."""
        if self._attached or self._closed:
            return
        if self._held_place:
            self._held_place = False
            if self._client.unpark():
                self._attached = True
                return
        self._attach_again()

    def _drop_entry(self) -> None:
        """Release the ring entry taken and not used (kept for the next epoch)."""
        entry = self._flow.entry
        slot, entry[0] = entry[0], None
        if slot is not None:
            slot.release()

    # -- the loader batches of this consumer's epoch ----------------------------------

    def _pull(self) -> tuple[Any, int | None, Any]:
        """The next loader batch of this consumer's epoch and its sample count if the
        loader tells, made into flow.loaded unless one is there; EpochEnd after its last.
        It leaves flow.loaded in the caller's step that hands it on."""
        flow, cursor = self._flow, self._cursor
        while flow.loaded is None:
            if cursor.resuming and self._taken.unclaimed(self.producer_dataset_len) == 0:
                raise EpochEnd  # every sample of the resumed epoch was read
            self._ensure_attached()
            if self._aligned and not (cursor.resuming and self.world_size == 1):
                self._pull_aligned()
            else:
                self._pull_window()
        return flow.loaded  # type: ignore[return-value]

    def _pull_aligned(self) -> None:
        """_pull for aligned epochs: each epoch of this consumer is one whole epoch of the
        producer, from its first batch; a consumer that attached mid-epoch skips to the
        next epoch's start. In a group, this rank's share of it (see EpochCursor)."""
        cursor, entry = self._cursor, self._flow.entry
        while True:
            slot = entry[0]
            if slot is None:
                if cursor.source_done:
                    raise EpochEnd
                slot = self._acquire()
            step = cursor.place(slot)
            if step is Step.TAKE:
                self._take(slot)
                return
            if step is Step.END_BEFORE:
                raise EpochEnd  # the entry stays: the next epoch's first
            if step is Step.DROP and self.world_size > 1 and not slot.is_end_of_epoch:
                self._taken.group_batch(slot.index, sample_ids.split(slot.meta)[1])
            entry[0] = None
            slot.release()
            if step is Step.SKIP:
                self._skip_to_align(slot)
            elif step is Step.END:
                raise EpochEnd

    def _pull_window(self) -> None:
        """_pull with align_epochs=False: a late joiner's epoch is the next len() batches
        from where it started (see docs/usage.md)."""
        cursor, entry = self._cursor, self._flow.entry
        while True:
            slot = entry[0]
            if slot is None:
                if cursor.source_done:
                    raise EpochEnd
                slot = self._acquire()
            step = cursor.place(slot)
            if step is Step.TAKE:
                self._take(slot)
                return
            entry[0] = None
            slot.release()
            if step is Step.END:
                raise EpochEnd

    def _take(self, slot: Any) -> None:
        """Make the batch of a slot of this epoch into flow.loaded, with its sample count
        if known: the loader's, or else (without a re-batcher, whose own rules count the
        rest) dim 0 of the batch's first tensor with a dimension; None otherwise. Made
        again if an interrupt comes before it is there (the slot stays in flow.entry)."""
        n = self._shape.samples_in(slot.index)
        cursor, taken = self._cursor, self._taken
        batch, leading, ids = self._delivery.build(slot, n is None and self._batcher is None)
        n = leading if n is None else n
        cursor.taken(slot)
        loaded: tuple | None = (batch, n, ids)
        if cursor.resuming and ids is None and taken.known:
            log.warning("consumer %d resumes from a state that names the samples taken, but "
                        "the producer does not tell the samples of its batches: its resumed "
                        "epoch takes %s batches as they come", self._index,
                        self._resume_quota() - cursor.delivered)
        if cursor.resuming and ids is not None:
            loaded = _kept_samples(batch, n, ids, taken.claimed)  # type: ignore[arg-type]
        elif self.world_size > 1:
            taken.group_batch(slot.index, ids)
        flow = self._flow
        # One step (no call): the entry is used up, its batch is made and counted.
        flow.loaded, flow.entry[0] = loaded, None
        if loaded is not None and cursor.resuming and ids is not None:
            taken.claim(loaded[2])  # read: not kept again (from the next producer epoch)
        flow.loader_batches += 1
        flow.bytes += slot.nbytes
        slot.release()

    def _skip_to_align(self, slot: Any) -> None:
        """Drop an entry taken while waiting for the start of an epoch."""
        slot.release()
        if self._skipped_to_align == 0 or self._skipped_to_align % 1000 == 0:
            log.info("consumer %d attached in the middle of the producer's epoch %d: waiting "
                     "for the start of epoch %d, so that its epochs are whole (entries "
                     "skipped so far: %d)", self._index, slot.epoch, self._cursor.want_epoch,
                     self._skipped_to_align + 1)
        self._skipped_to_align += 1

    def _acquire(self) -> Any:
        """The next ring entry for us, with errors turned into what the caller needs."""
        self._ensure_attached()
        try:  # published already (a consumer that keeps up): no wait, nothing to check
            slot = self._ring.try_acquire(self._flow.entry)
        except (ProducerFinished, ProducerGone, ConsumerDetached):
            slot = None  # the waiting acquire below raises it again, and says what it means
        if slot is not None:
            return slot
        cursor = self._cursor
        while True:
            self._flush_releases()  # the wait may be for a slot our dropped views hold
            start = time.perf_counter()
            try:
                return self._acquire_slot()
            except ProducerFinished:
                failure = self._ring.failure()
                if failure is not None:
                    cursor.in_epoch = False
                    raise _failed(self._ring, self.endpoint.address, failure) from None
                if cursor.finished_between_windows():
                    # A late joiner's epoch spans two producer epochs, and the producer
                    # stopped after the first of them. End the epoch with what came.
                    warnings.warn(
                        f"the producer finished in the middle of this consumer's epoch "
                        f"{self.epoch} (it joined late, so its epochs span two of the "
                        f"producer's); the epoch ends after {cursor.pulled} loader batches",
                        TensorSocketWarning, stacklevel=5)
                    raise EpochEnd from None
                if cursor.pulled > 0:
                    raise ProducerFinished(
                        f"the producer stopped in the middle of its epoch, after this "
                        f"consumer's epoch {self.epoch} had received {cursor.pulled} "
                        "of the loader's batches; no more batches will come"
                    ) from None
                raise ProducerFinished(
                    f"the producer finished after {self.epoch} epoch(s) seen by this "
                    "consumer; no more batches will come"
                ) from None
            except ProducerGone as e:
                cursor.in_epoch = False
                raise _failed(self._ring, self.endpoint.address, None, str(e)) from None
            except ConsumerDetached as e:
                if self._closed:  # close() from another thread detached us first
                    raise TensorSocketError(
                        "the consumer was closed by another thread while this call waited"
                    ) from None
                reason = diagnosis.detach_reason(self._ring, self._index, self._client.token)
                if reason == _core.REASON_UNREAD and cursor.pulled == 0:
                    self._start_late()
                    continue
                if reason != _core.REASON_LAGGED or self.lag_policy != "rejoin":
                    raise ConsumerDetached(
                        f"{e}; create a new TensorConsumer to attach again") from None
                self._rejoin()
                if cursor.rejoined():
                    raise EpochEnd from None
            except TimeoutError:
                raise TimeoutError(
                    f"no batch within batch_timeout={self.batch_timeout} s from "
                    f"{self.endpoint.address}"
                ) from None
            finally:
                self._wait_s += time.perf_counter() - start

    def _acquire_slot(self) -> Any:
        """Ring.acquire within batch_timeout; warns once if the wait is this consumer's
        own doing (see diagnosis.blocking_held_slots). The slot is put in flow.entry."""
        box = self._flow.entry
        deadline = None if self.batch_timeout is None else \
            time.monotonic() + self.batch_timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        # This process may be about to wait here while another of its consumers sits
        # between epochs holding its producer back (a validation loader during training):
        # if the wait lasts, that one parks, so no two jobs wait on each other through two
        # rings. A place kept while parked can close such a cycle too (the job we wait for
        # waits for that place): looked at again every SIBLING_PARK_AFTER of the wait, as
        # the other job may come to wait for it only later (see _park_idle_siblings). Our
        # own kept batches that block us are the loop below's to handle.
        while _has_idle_siblings(self) and not self._held_slots_blocking():
            wait = left()
            if wait is not None and wait <= SIBLING_PARK_AFTER:
                break
            try:
                return self._wait_for_slot(SIBLING_PARK_AFTER, box)
            except TimeoutError:
                _park_idle_siblings(self)

        # Batches this consumer keeps may come to hold the slot the producer must refill
        # next (as soon as it gets there): then they are copied privately rather than
        # waited for (see _set_aside_held), at once (a list(consumer) waits for nothing).
        # Only while it keeps some: in short waits.
        while diagnosis.may_set_aside(self._ring, self._delivery.gpu_import):
            if self._held_slots_blocking():
                if not self._set_aside_held(rebind=True):
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
            held = self._held_slots_blocking()
            if held:
                message = diagnosis.kept_batches_warning(
                    STALL_WARN_AFTER, held, self._ring.info()["slot_count"])
                log.warning("%s", message)
                warnings.warn(message, TensorSocketWarning, stacklevel=6)
        return self._wait_for_slot(left(), box)

    def _wait_for_slot(self, timeout: float | None, box: Any) -> Any:
        """Ring.acquire(timeout, box). Where releases wait for a flush (GPU state, see
        Delivery.defers_releases), in FLUSH_EVERY steps with the releases of the views
        dropped meanwhile flushed between them: the slot waited for may be one that
        another thread of this process let go while this one waits (a prefetch thread
        in next() while the training loop drops its batch). Host-only consumers wait in
        one call (no wakeups: their releases are not deferred)."""
        if not self._delivery.defers_releases:
            return self._ring.acquire(timeout, box)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            step = FLUSH_EVERY if left is None else min(FLUSH_EVERY, left)
            try:
                return self._ring.acquire(step, box)
            except TimeoutError:
                # Also after the last step: a caller waiting in steps of its own (the
                # may_set_aside loop of _acquire_slot) flushes between them too.
                self._flush_releases()
                if left is not None and step >= left:
                    raise

    def _held_slots_blocking(self) -> int:
        """Slots this consumer holds, if one is the slot the producer must reuse next."""
        return diagnosis.blocking_held_slots(self._ring, self._index, self._client.token)

    def _rejoin(self) -> None:
        """Attach again as a late joiner after the producer detached us for lagging."""
        old_cursor = self._ring.consumer(self._index)["cursor"] or 0  # set: it was reading
        start = self._attach_again()
        skipped = max(0, start - old_cursor)
        self._rejoins += 1
        self._skipped += skipped
        ended = " The current epoch ends here." if self._cursor.pulled > 0 else ""
        message = (
            f"this consumer fell more than max_lag={self.max_lag} batches behind the fastest "
            f"consumer, was detached and attached again as a late joiner; it skipped {skipped} "
            f"ring entries.{ended}")
        log.warning("%s", message)
        warnings.warn(message, LagWarning, stacklevel=6)

    def _start_late(self) -> None:
        """Attach again after the producer detached us for reading nothing while the
        others waited (a consumer made long before its loop starts: share() at the top of
        a script, then minutes of model set-up). It had read nothing, so nothing is lost:
        as a DataLoader made early starts when it is iterated, it starts now, a late
        joiner with whole epochs from the next epoch start."""
        start = self._attach_again()
        log.info("consumer %d read nothing for longer than the others would wait, so the "
                 "producer went on without it; it starts now, at entry %d", self._index,
                 start)

    def _attach_again(self) -> int:
        """Take a new place in the same producer's ring (a late joiner); its first seq."""
        info = self._ring.info()
        failure = self._ring.failure()
        if failure is not None or \
                not _core.process_alive(info["producer_pid"], info["producer_start_time"]):
            self._cursor.in_epoch = False
            raise _failed(self._ring, self.endpoint.address, failure)
        if info["state"] == _core.RING_FINISHED:
            self._cursor.in_epoch = False
            raise ProducerFinished(
                "the producer finished while this consumer was away from the ring (it had "
                "left its epoch, or was detached); no more batches will come")
        # An entry kept from the place given up (also when an interrupt cut unpark short:
        # a new place may start at that very entry, which would then come twice).
        self._drop_entry()
        self._set_aside_held()
        self._client.stop_heartbeats()
        welcome = self._client.hello(self._own_batch_size, self.group, self.rank,
                                     self.world_size)
        if welcome.segment != self._segment:
            raise ConsumerDetached(
                "the producer that answered is a new one, not the one this consumer was "
                "attached to; create a new TensorConsumer to attach to it")
        self._ring.bind(welcome.consumer, welcome.token)
        self._index = welcome.consumer
        start = self._client.ready(self._aligned, self.world_size > 1)
        self._client.start_heartbeats()
        self._attached = True
        self._cursor.attached_again()
        log.info("consumer attached again as %d at entry %d", self._index, start)
        return start

    def _set_aside_held(self, rebind: bool = False) -> bool:
        """Batches of this consumer still alive (the loop variable of a loop left with
        break, batches the script keeps) hold their ring slots; when the producer must
        refill one of them before this consumer's next batch can come, the consumer would
        wait for itself. Instead those batches become private copies here (as a
        DataLoader's batches are private memory), their slots go back to the producer, and
        the consumer reads on through a new mapping of the ring: before it attaches again,
        or (rebind) at once, in the same place. Whether that happened (not on a GPU ring,
        nor with pin_memory=True: there the slots stay held)."""
        ring = self._ring
        held = ring.held_slots()
        if held == 0 or self._delivery.gpu_import:
            return False
        fresh = None
        try:
            fresh = _core.Ring.open(self._segment)  # first: a failure leaves all as it was
            if rebind:
                fresh.bind(self._index, self._client.token)
            # Done, it puts fresh in the box itself: an interrupt as it returns cannot
            # leave this consumer reading through the handle set aside.
            ring.set_aside(self._ring_box, fresh)
        except (ValueError, OSError) as e:
            if fresh is not None:
                fresh.close()
            if getattr(e, "errno", None) == errno.ENOMEM:  # nothing was handed back
                raise MemoryError(diagnosis.kept_batches_no_memory(
                    held, self._set_aside_batches)) from e
            log.info("consumer %d keeps %d ring slots held by batches still alive: %s",
                     self._index, held, e)
            return False
        ring.close()  # the views of its batches keep that mapping until they go
        self._set_aside_batches += held
        log.info("consumer %d: %d batches still alive were copied privately, so that it "
                 "never waits for their ring slots", self._index, held)
        return True

    # -- end ---------------------------------------------------------------------------

    def close(self) -> None:
        """Leave: the producer stops sending to us. Tensors still held stay valid."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:  # a fork's child: the parent's to close
            self._finalizer.detach()
            return
        self._finalizer()

    def __enter__(self) -> "TensorConsumer":
        """The consumer itself; leaving the block closes it."""
        return self

    def __exit__(self, *exc: Any) -> None:
        """Close the consumer."""
        self.close()

    # -- introspection -----------------------------------------------------------------

    @property
    def ring(self) -> Any:
        """The C ring handle of this consumer."""
        return self._ring

    def stats(self) -> dict:
        """Counters of this consumer.

        batches / samples: delivered so far; loader_batches and bytes: ring
        entries taken (bytes of tensor data and structure); wait_seconds: time
        spent waiting for batches; lag: batches (ring entries) published but
        not yet taken (the end marker of an epoch that ended with its last batch
        is no batch: a finished epoch leaves lag 0); rejoins / skipped_entries:
        re-attachments after being detached for lagging and the entries they
        skipped; dropped_samples:
        samples dropped by drop_last; copied_kept_batches: batches still alive
        that were copied privately so that the consumer never waits for their slots.
        """
        lag = None
        if not self._closed:
            lag = self._ring.consumer(self._index)["lag"]
            if lag > 0 and self._cursor.end_marker_unread and self._attached:
                lag -= 1
        return {
            "epoch": self.epoch,
            "device": self.device,
            "zero_copy_gpu": self._delivery.gpu_import,
            "device_fallback_reason": self.device_fallback_reason,
            "batches": self._flow.batches,
            "samples": self._flow.samples,
            "loader_batches": self._flow.loader_batches,
            "bytes": self._flow.bytes,
            "wait_seconds": self._wait_s,
            "lag": lag,
            "rejoins": self._rejoins,
            "skipped_entries": self._skipped,
            "dropped_samples": self._rebatcher.dropped_samples if self._rebatcher else 0,
            "copied_kept_batches": self._set_aside_batches,
        }


class EpochIterator:
    """One epoch of a TensorConsumer. Keeps no reference to the batches it returned,
    so a batch's ring slot is released as soon as the caller drops it."""

    __slots__ = ("_consumer", "_epoch", "_serial")

    def __init__(self, consumer: TensorConsumer, serial: int) -> None:
        self._consumer = consumer
        self._epoch = consumer.epoch
        self._serial = serial  # which iter() of the consumer made it

    def __iter__(self) -> "EpochIterator":
        """The iterator itself."""
        return self

    def __next__(self) -> Any:
        """The next batch of this epoch; StopIteration at its end."""
        consumer = self._consumer
        if consumer.epoch != self._epoch:
            raise StopIteration
        out = consumer._next_batch()
        # Delivered: counted in one step with the return (no call in between, where a
        # KeyboardInterrupt could land: until here the batch stays for the next next()).
        flow = consumer._flow
        # (Recorded again after an interrupt before the count: no change.)
        consumer._taken.delivered(flow.ready[2])  # type: ignore[index]
        flow.samples += flow.ready[1]  # type: ignore[index]
        flow.ready = None
        flow.batches += 1
        consumer._cursor.delivered += 1
        return out

    def close(self) -> None:
        """Leave this epoch now (as when the iterator is dropped mid-epoch)."""
        self._abandon()

    def __del__(self) -> None:
        """Dropped mid-epoch: leave the ring (see TensorConsumer)."""
        try:
            self._abandon()
        except Exception:  # never raise from a finalizer
            pass

    def _abandon(self) -> None:
        """Leave this iterator's epoch, unless a later iterator took it over (one made
        after this one was interrupted before it returned a batch goes on with it)."""
        if self._serial == self._consumer._iterators:
            self._consumer._abandon_epoch(self._epoch)

    def __len__(self) -> int:
        """Batches in the whole epoch (as ``len(consumer)``)."""
        return len(self._consumer)


def _kept_samples(batch: Any, n: int | None, ids: np.ndarray,
                  claimed: IdMask) -> tuple[Any, int, np.ndarray] | None:
    """A loader batch read in a resumed epoch, with only the samples not taken yet:
    (batch, samples, ids); the batch itself when all are kept, None when none is (a copy
    of the samples kept otherwise)."""
    keep = ~claimed.contains(ids)
    if keep.all():
        return batch, ids.size, ids
    if not keep.any():
        return None
    if n is None or n != ids.size:
        n = batch_samples(batch)
        if n != ids.size:  # a collate_fn that changes the number of samples
            log.warning("a batch of %d samples came with %d sample ids: it is kept whole in "
                        "the resumed epoch", n, ids.size)
            return batch, n, ids
    runs = _runs(keep)
    return combine([(batch, start, stop, n) for start, stop in runs]), \
        int(keep.sum()), ids[keep]


def _chunks(ids: np.ndarray, size: int) -> list[list[int]]:
    """`ids` in lists of `size` (the last one shorter)."""
    values = ids.tolist()
    return [values[i:i + size] for i in range(0, len(values), size)]


def _runs(keep: np.ndarray) -> list[tuple[int, int]]:
    """The (start, stop) ranges of the True runs of `keep`."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], keep.astype(np.int8), [0]))))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


def _teardown(client: ControlClient, context: zmq.Context, ring_box: list, delivery: Delivery,
              pid: int) -> None:
    """Say bye, close the socket and drop our ring handle. If the producer died,
    the last one out removes its segment name (nobody else will). Nothing in a forked
    child (the consumer, its socket and its place are the parent's)."""
    if os.getpid() != pid:
        return
    ring = ring_box[0]
    delivery.finish()  # asynchronous copies out of ring slots finish first
    if ring.closed:  # the handle was closed under us (c.ring.close()): say bye, no more
        client.close(say_bye=True)
        context.term()
        return
    try:  # releases of dropped views go before the ring handle, and before exit
        delivery.flush_releases(ring, RELEASE_DRAIN_MS)
    except Exception as e:  # a failed release: its slot stays held until we leave
        log.warning("GPU releases at close: %s", e)
    info = ring.info()
    producer_alive = _core.process_alive(info["producer_pid"], info["producer_start_time"])
    client.close(say_bye=producer_alive and info["state"] == _core.RING_OPEN)
    context.term()
    ring.close()
    if not producer_alive:
        _core.Ring.unlink_name(info["name"])


def _failed(ring: Any, address: str, cause: str | None,
            gone: str | None = None) -> ProducerFailed:
    """The error for a producer that failed (cause: its error, from the ring) or whose
    process is gone without finishing the ring (cause None), or, with the ring's own words
    (gone), whose process exited after finishing it while batches of its GPU memory were
    still unread here."""
    info = ring.info()
    pid = info["producer_pid"]
    if cause is not None:
        what = f"the producer (pid {pid}) failed: {cause}"
    elif gone is not None and info["state"] == _core.RING_FINISHED:
        what = gone
    else:
        what = (f"the producer process (pid {pid}) is gone without finishing: it was killed "
                "(out of memory?) or crashed; its own output says why")
    return ProducerFailed(
        f"{what}. No more batches will come from {address}: this consumer is done; create a "
        "new TensorConsumer once a producer runs there again", cause=cause)


def _check_group(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size) of a consumer group, checked; (0, 1) for a lone consumer."""
    if rank is None and world_size is None:
        return 0, 1
    if rank is None or world_size is None:
        raise ValueError("give rank= and world_size= together (a consumer group: the ranks "
                         "of one data-parallel job split the stream), or neither")
    for what, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{what} must be an int, got {value!r}")
    if not 1 <= world_size <= _core.MAX_CONSUMERS or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} and world_size={world_size}: need 0 <= rank < "
                         f"world_size <= {_core.MAX_CONSUMERS}")
    return rank, world_size


def _idle(consumer: TensorConsumer) -> bool:
    """Attached to its ring, yet between epochs: never iterated, or every batch of its
    epoch delivered (a loop that stops at len() leaves the epoch open). The ranks of a
    group are never idle: they stay attached, so that all of them read the same epochs."""
    return consumer._attached and not consumer._closed and consumer._aligned \
        and consumer.world_size == 1 and consumer._cursor.idle(consumer._holding())


def _keeps_place(consumer: TensorConsumer) -> bool:
    """Parked between epochs with its place in the ring kept (see TensorConsumer._park),
    and not iterated since: an iter() (under its _state_lock) begins an epoch, and then
    the place is that iterator's to go on from."""
    return consumer._held_place and not consumer._attached and not consumer._closed \
        and consumer._cursor.idle(consumer._holding())


def _sibling(me: TensorConsumer, other: TensorConsumer) -> bool:
    """Whether `other` is a consumer of this process reading another producer than `me`
    (consumers of the same producer only wait for each other as any two consumers do)."""
    return other is not me and other._segment != me._segment


def _has_idle_siblings(me: TensorConsumer) -> bool:
    """Whether a consumer of another producer in this process is idle (see _idle), or
    parked keeping its place: either holds its producer back while this process reads
    `me`."""
    return any(_sibling(me, c) and (_idle(c) or _keeps_place(c)) for c in list(_CONSUMERS))


def _park_idle_siblings(me: TensorConsumer) -> None:
    """Park the consumers of other producers in this process that sit between epochs:
    this process is reading `me` now, so they would only hold their producers (and the
    other jobs reading them) back, and two jobs alternating between two shared loaders
    would wait on each other. Each attaches again, at an epoch start, when next iterated.

    A parked consumer keeps its place for park_hold seconds (its producer keeps the next
    epoch's first batches for it, so that its job reads the same epochs as the others).
    That place is given up at once where it closes a cycle of waits (see
    _waits_on_each_other): two jobs out of phase, one reading the training loader, the
    other the validation loader, would otherwise each wait for the other's place until
    park_hold ran out."""
    for other in list(_CONSUMERS):
        if not _sibling(me, other):
            continue
        with other._state_lock:
            if not (_idle(other) or _keeps_place(other)):
                continue
            if _waits_on_each_other(me, other):
                log.info("consumer %d gives up its place in its ring: a job that it holds "
                         "back is one that this process waits for through another loader",
                         other._index)
                other._park(hold=False)
            elif _idle(other):
                log.debug("consumer %d parks while this process reads another loader",
                          other._index)
                other._park(hold=True)


def _waits_on_each_other(me: TensorConsumer, other: TensorConsumer) -> bool:
    """Whether this process waits (reading `me`) for a process that waits for `other`'s
    place: `me` read everything published and its producer cannot publish more until
    consumers of other processes free the slot it must reuse; `other`'s entry is one
    that keeps its own producer from publishing; and a consumer of one of those
    processes read everything `other`'s producer published (it waits for it). Read from
    the two rings' consumer tables."""
    ring = me._ring
    if ring.closed:
        return False
    mine = ring.consumer(me._index)
    if mine["token"] != me._client.token or mine["lag"] != 0:
        return False  # a batch is there for `me` (or its place is gone): no wait here
    awaited = {e["pid"] for e in diagnosis.holding_back(ring)} - {os.getpid()}
    theirs = other._ring
    if not awaited or theirs.closed:
        return False
    holders = diagnosis.holding_back(theirs)
    if not any(e["index"] == other._index and e["token"] == other._client.token
               for e in holders):
        return False
    return any(e["pid"] in awaited and e["state"] == _core.CONSUMER_ACTIVE and e["lag"] == 0
               for e in theirs.consumers())
