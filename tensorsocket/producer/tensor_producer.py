"""TensorProducer: runs a data loader once and publishes every batch to the ring."""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
import traceback
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator

import zmq

from .. import _core, config
from ..control import auth
from ..config import UNSET, Unset
from ..control.server import ControlServer
from ..control.endpoints import Endpoint, resolve
from ..errors import (
    BatchTooLarge,
    GPUFallbackWarning,
    GPUUnavailable,
    SharedMemoryTooSmall,
    TensorSocketError,
    TensorSocketWarning,
)
from ..data.gpu import parse_device
from ..loader.loader_info import (
    describe_loader,
    epoch_factory,
    epoch_limit,
    is_iterable,
    length_of,
    set_sampler_epoch,
)
from ..control.producer_files import (
    OwnedFiles,
    forget_on_sigterm,
    remove_on_sigterm,
    sweep_stale_segments,
    take_name_lock,
)
from ..data.sample_ids import SampleIdRecorder, with_ids
from ..data.structure import Encoder
from ..loader.worker_heap import padded_workers

log = logging.getLogger("tensorsocket")

DEFAULT_SLOTS = 4
MAX_SLOTS = config.MAX_SLOTS
DEFAULT_RUBBER_BAND_PCT = 0.005  # of an epoch's batches ...
DEFAULT_MAX_WINDOW = 8  # ... but at most this many, unless asked for explicitly
SLOT_HEADROOM = 1.5  # slot size = first batch x this (plus room for the structure)
MIN_SLOT_BYTES = 64 * 1024
SEGMENT_NAME_TRIES = 8  # segment names tried when the name is taken (a planted file)
FAILURE_CHARS = 800  # the text of a failure the consumers are told (ring header, control)


class TensorProducer:
    """Publish the batches of ``data_loader`` to every attached consumer.

    ``for batch in producer:`` runs one epoch of the loader, publishing each
    batch before yielding it; iterating again runs the next epoch.
    ``producer.join()`` waits until the consumers have read everything that
    was published, then tears the ring and sockets down.

    ``data_loader`` is what yields the batches, one epoch per iteration:

    - a re-iterable object: a torch DataLoader, a list, a Hugging Face
      ``datasets.IterableDataset``, any object whose ``__iter__`` starts a new
      pass each time. Every item it yields is published as one batch (so batch
      a per-example stream first, e.g. ``ds.batch(batch_size=32)`` or a
      DataLoader over it). Its ``len()``, if it has one, is the number of
      batches per epoch (``len(consumer)``); without one, ``len(consumer)``
      raises TypeError, as for a DataLoader over an IterableDataset without
      ``__len__``.
    - a callable that returns a fresh iterable for each epoch: it is called at
      the start of every epoch, with the epoch number (0, 1, ...) if it has a
      required positional parameter, else with no argument:
      ``TensorProducer(lambda: ds.iter(batch_size=32))``,
      ``TensorProducer(lambda epoch: make_loader(seed=epoch))``. The iterable
      it returns counts as the loader of that epoch (its ``len()``,
      ``batch_size`` and sampler, for a DataLoader).
    - an iterator (a generator, say) serves one epoch only: iterating it again
      after it was used up raises TypeError naming the fix, rather than
      publishing an empty epoch. (An epoch cut short by ``break`` leaves it
      where it stopped; the next epoch continues from there.)

    The positional parameters after ``data_loader`` are those of the original
    TensorSocket (``port, ack_port, heart_ports, rubber_band_pct, pack_fn,
    consumer_max_buffer_size, producer_batch_size``) so scripts written for it
    run unchanged. ``port`` selects a loopback TCP control endpoint;
    ``ack_port`` and ``heart_ports`` are accepted and unused (one socket does
    it all); ``consumer_max_buffer_size`` is the number of ring slots;
    ``producer_batch_size`` is accepted and ignored (every loader batch is
    published as it is; consumers choose their own ``batch_size``).

    Epochs: a loader with ``len()`` ends its epoch after that many batches even
    if it would yield more (the original TensorSocket's loaders never stop);
    before each epoch the producer calls ``set_epoch(epoch)`` on the loader's
    sampler and batch sampler where they have it (a DistributedSampler).

    Late joiners: the last ``rubber_band_pct`` of an epoch's batches (rounded
    up), or ``rubber_band=`` batches, stay readable in the ring. A consumer
    that attaches mid-epoch starts at the oldest of them (never before the
    current epoch's first batch); see docs/usage.md for the exact semantics.
    Without either, the window is 0.5% of an epoch but at most 8 batches (and
    at most ring_slots - 2 when ring_slots is given), to keep memory bounded.
    A loader without ``len()`` has no window unless ``rubber_band=`` is given.

    Settings marked (env) below take their value from the argument, else from
    their ``TENSORSOCKET_*`` environment variable, else the default; see
    tensorsocket.config and docs/configuration.md.

    Keyword-only:
      name: producer name for rendezvous (default ``"default"``) (env);
        consumers with the same name find it.
      address: explicit ZeroMQ address (``ipc://...`` or ``tcp://host:port``)
        (env).
      min_consumers: consumers that must be attached before the first batch
        is published (default 1) (env). After that, whenever no consumer at
        all is attached, the producer pauses (the loader is not run for
        nobody) until one attaches; 0 never waits.
      start_timeout: seconds to wait for them, and for one consumer while none
        is attached (None: forever) (env); TimeoutError after.
      start_grace: once min_consumers are attached, seconds to wait more before
        the first batch (default 3) (env), so that jobs started together (a
        sweep launched by one shell line, the ranks of a torchrun) all begin at
        batch 0 of epoch 0 instead of joining late; 0 starts at once.
      park_hold: seconds a consumer that stopped reading between epochs (its
        job runs its validation loader) keeps its place in the ring once
        other consumers read again (default 10) (env): the next epoch's first
        batches wait for it, so that jobs alternating loaders read the same
        epochs; after that its place is given up and it starts at a later epoch.
      heartbeat_timeout: seconds without a heartbeat after which a consumer whose
        process lives on (stopped, or a step holding the GIL) is taken off, so that
        the others go on; the batches it holds stay intact (default 30; None: never)
        (env). Consumers heartbeat every second from a Python thread of their own,
        through long training steps too unless a step holds the GIL that long.
      auth_token: the secret a consumer must present on a TCP address (``port=``
        or ``address="tcp://..."``) (env). Default: a random one. Either way it
        is written to ``<runtime dir>/<name>.secret`` (mode 0600, removed at
        close), where consumers of this user find it; consumers that cannot read
        that file take the same ``auth_token``. Over ipc:// the peer's user and
        pid are checked instead. ``producer.auth_token`` is the secret in use
        (None for ipc:// without one).
      rubber_band: the late-joiner window in batches (overrides rubber_band_pct).
      max_lag: detach a consumer that falls more than this many batches behind
        the fastest consumer, so the others are not held back (default None:
        lossless, the producer waits for the slowest consumer) (env).
      lag_policy: what a detached laggard does: ``"raise"`` (ConsumerDetached)
        or ``"rejoin"`` (a LagWarning, then it attaches again as a late
        joiner) (env).
      ring_slots: slots in the ring (default: 4, or the window + 2, or
        max_lag + 2, whichever is largest) (env).
      slot_bytes: capacity of one slot (default: first batch x 1.5) (env).
      ring_bytes: total slot memory; sets ring_slots from slot_bytes (env).
      max_leaves: most tensors one batch may hold (default: from the first batch).
      publish_timeout: seconds to wait for a free slot (None: forever) (env).
      device: ``"cuda:N"`` (or ``"cuda"`` for GPU 0) keeps the ring's slots
        in GPU memory as well: each batch is copied to the GPU once, for all
        consumers, which receive CUDA tensors read in place through CUDA IPC
        (see docs/gpu.md). Default: host memory only (env:
        ``TENSORSOCKET_PRODUCER_DEVICE``).
      device_fallback: if the GPU ring cannot work here (no driver, MIG, no
        CUDA IPC events), warn and use the host ring (default True); False
        raises GPUUnavailable instead (env).
      release_timeout: a GPU ring's device memory is freed only once no
        consumer process maps it any more; join()/close() wait this many
        seconds for that (default 30; None: forever), then return and leave
        the memory to a keeper thread that frees it when the last consumer
        closed or died, however long that takes (env). See docs/gpu.md, "When
        the producer's GPU memory is freed".
      worker_heap_pad: for a torch DataLoader with workers, each worker keeps
        this many bytes at the top of its malloc heap and takes blocks under
        32 MiB from the heap (glibc only; default 16 MiB; 0 turns it off)
        (env). A worker forked from the producer otherwise may hand every
        decoded image's memory back to the kernel and fault it in again for
        the next one, which cost 50% more CPU per batch in the benchmarks; see
        docs/usage.md, "The loader's workers". Only the workers are changed:
        the loader's ``worker_init_fn`` is wrapped while ``iter()`` starts them,
        and put back.
    """

    def __init__(
        self,
        data_loader: Iterable | Callable[..., Iterable],
        port: int | str | None = None,
        ack_port: int | str | None = None,
        heart_ports: Any = None,
        rubber_band_pct: float | None = None,
        pack_fn: Callable[[Any], Any] | None = None,
        consumer_max_buffer_size: int | None = None,
        producer_batch_size: int = 8,
        *,
        name: str | None = None,
        address: str | None = None,
        min_consumers: int | Unset = UNSET,
        start_timeout: float | None | Unset = UNSET,
        start_grace: float | Unset = UNSET,
        park_hold: float | Unset = UNSET,
        heartbeat_timeout: float | None | Unset = UNSET,
        auth_token: str | None = None,
        ring_slots: int | None | Unset = UNSET,
        slot_bytes: int | None | Unset = UNSET,
        ring_bytes: int | None | Unset = UNSET,
        max_leaves: int | None = None,
        publish_timeout: float | None | Unset = UNSET,
        rubber_band: int | None = None,
        max_lag: int | None | Unset = UNSET,
        lag_policy: str | Unset = UNSET,
        device: Any = UNSET,
        device_fallback: bool | Unset = UNSET,
        release_timeout: float | None | Unset = UNSET,
        worker_heap_pad: int | Unset = UNSET,
    ) -> None:
        self._factory = epoch_factory(data_loader)
        given = self._settings = config.Resolver()
        if ring_slots is None or ring_slots is UNSET:
            ring_slots = consumer_max_buffer_size  # the original's name for it
        elif consumer_max_buffer_size is not None:
            raise ValueError("give ring_slots= or consumer_max_buffer_size=, not both")
        # The settings as resolved: the argument, else the environment, else the default.
        slots: int | None = given.get("ring_slots", ring_slots)
        slot_size: int | None = given.get("slot_bytes", slot_bytes)
        ring_size: int | None = given.get("ring_bytes", ring_bytes)
        lag_limit: int | None = given.get("max_lag", max_lag)
        where: Any = given.get("producer_device", device)
        if rubber_band_pct is not None and not 0 <= float(rubber_band_pct) <= 1:
            raise ValueError(f"rubber_band_pct must be in 0..1, got {rubber_band_pct}")
        if rubber_band is not None and not 0 <= int(rubber_band) <= MAX_SLOTS - 2:
            raise ValueError(f"rubber_band must be in 0..{MAX_SLOTS - 2} batches, got "
                             f"{rubber_band}")
        kind, ordinal = parse_device(where)
        if kind == "cuda" and ordinal is None:
            ordinal = 0
        self._device_ordinal = ordinal if kind == "cuda" else None
        self.device = f"cuda:{ordinal}" if kind == "cuda" else "cpu"
        self.device_fallback: bool = given.get("device_fallback", device_fallback)
        self.device_fallback_reason: str | None = None
        self.release_timeout: float | None = given.get("release_timeout", release_timeout)
        self.worker_heap_pad: int = given.get("worker_heap_pad", worker_heap_pad)
        self._explicit_window = rubber_band is not None or rubber_band_pct is not None
        self.rubber_band_pct = DEFAULT_RUBBER_BAND_PCT if rubber_band_pct is None \
            else float(rubber_band_pct)
        self.rubber_band = int(rubber_band) if rubber_band is not None else None
        self.max_lag = lag_limit
        self.lag_policy: str = given.get("lag_policy", lag_policy)
        self._ring_slots = slots
        # The loader of the current epoch: the iterable itself, or the one the
        # callable returned for it (None before the first epoch).
        self._current: Any = data_loader if self._factory is None else None
        self._window_known = self._length() is not None or self.rubber_band is not None
        self.window = self._compute_window()
        self.data_loader = data_loader
        self.producer_batch_size = producer_batch_size
        self.pack_fn = pack_fn
        self.min_consumers: int = given.get("min_consumers", min_consumers)
        self.start_timeout: float | None = given.get("start_timeout", start_timeout)
        self.start_grace = float(given.get("start_grace", start_grace))
        self.park_hold = float(given.get("park_hold", park_hold))
        silence = given.get("heartbeat_timeout", heartbeat_timeout)
        self.heartbeat_timeout: float | None = None if silence is None else float(silence)
        self._sets_epoch = False  # the loader's sampler has set_epoch and we call it
        self._graced = False  # the start grace is over (it runs once, before batch 0)
        self.publish_timeout: float | None = given.get("publish_timeout", publish_timeout)
        self._slot_bytes = slot_size
        self._ring_bytes = ring_size
        self._max_leaves = max_leaves
        self.epoch = 0
        self._wait_consumers_s = 0.0
        self._ring_box: list = [None]  # the ring, shared with the control thread and finalizer
        # Why the producer failed (its loader raised, ...), for the finalizer to tell the
        # consumers; None while it runs well.
        self._failure_box: list[str | None] = [None]
        self._closed = False
        self._batches = 0
        self._encoder = Encoder()  # batch -> spec and leaves (keeps the last spec's bytes)
        self._sample_ids = SampleIdRecorder()  # the dataset indices of each batch
        self._used_up: Any = None  # the last iterator that yielded batches
        self._warned_cut = False  # said once that len() cut an epoch of a longer loader

        name = given.get("name", name)
        if port is None:
            address = given.get("address", address)
        given.get("runtime_dir")
        self.endpoint: Endpoint = resolve(name, port, address, for_producer=True)
        self._lock_fd = take_name_lock(self.endpoint)
        self._segment = self.endpoint.segment_name(os.getpid())
        self._files = OwnedFiles(self.endpoint)
        try:
            # (never through the Resolver: the log of settings from the environment shows values)
            self.auth_token: str | None = auth.producer_secret(self.endpoint, auth_token)
            if self.auth_token is not None and self.endpoint.socket_path is None:  # TCP
                auth.write_secret(auth.secret_path(self.endpoint), self.auth_token)
            sweep_stale_segments(self.endpoint.name)
            self._context = zmq.Context()
            box, me = self._ring_box, weakref.ref(self)
            self._server = ControlServer(self._context, self.endpoint.address,
                                         lambda: box[0], lambda: _welcome_info(me),
                                         park_hold=self.park_hold, secret=self.auth_token,
                                         heartbeat_timeout=self.heartbeat_timeout)
        except BaseException:
            auth.secret_path(self.endpoint).unlink(missing_ok=True)
            os.close(self._lock_fd)
            raise
        self._finalizer = weakref.finalize(
            self, _teardown, self._server, self._context, self._files, self._lock_fd, box,
            self.release_timeout, self._failure_box,
        )
        remove_on_sigterm(self._files)
        log.info("producer %r listening on %s", self.endpoint.name, self.endpoint.address)
        if given.origins:
            log.info("producer settings from the environment: %s", given.describe())

    # -- handshake info ------------------------------------------------------------

    @property
    def _ring(self) -> Any:
        return self._ring_box[0]

    def _welcome_info(self) -> dict:
        """Handshake fields for a consumer (sent once the ring exists, so the first
        epoch has started and a callable's loader of it is known)."""
        return {
            **describe_loader(self._current),
            "segment": self._segment,
            "epoch": self.epoch,
            "producer_pid": os.getpid(),
            "window": self.window,
            "max_lag": self.max_lag or 0,
            "lag_policy": self.lag_policy,
            "auto_set_epoch": self._sets_epoch,
        }

    def _window_batches(self) -> int:
        """The late-joiner window in batches, before the default's clamps."""
        if self.rubber_band is not None:
            return self.rubber_band
        n = self._length()
        if n is None:
            return 0
        return math.ceil(self.rubber_band_pct * n - 1e-9)

    def _compute_window(self) -> int:
        """The late-joiner window in batches, checked against ring_slots and max_lag."""
        window = self._window_batches()
        slots, max_lag = self._ring_slots, self.max_lag
        if not self._explicit_window:
            # The default window stays small and fits the ring the user asked for.
            window = min(window, DEFAULT_MAX_WINDOW)
            if slots is not None:
                window = max(0, min(window, slots - 2))
            if max_lag is not None:
                window = min(window, max_lag - 1)
        if window > MAX_SLOTS - 2:
            raise ValueError(
                f"a late-joiner window of {window} batches needs more than the "
                f"{MAX_SLOTS} slots a ring holds: lower rubber_band_pct= or rubber_band="
            )
        if max_lag is not None and max_lag <= window:
            raise ValueError(
                f"{self._settings.show('max_lag', max_lag)} must exceed the late-joiner window of "
                f"{window} batches (rubber_band= / rubber_band_pct=): a late joiner starts "
                "that far behind"
            )
        if slots is not None and slots <= window:
            raise ValueError(
                f"{self._settings.show('ring_slots', slots)} cannot keep a late-joiner window of "
                f"{window} batches: raise ring_slots= or lower rubber_band= / rubber_band_pct="
            )
        if slots is not None and max_lag is not None and max_lag + 2 > slots:
            raise ValueError(
                f"{self._settings.show('max_lag', max_lag)} needs ring_slots >= max_lag + 2 "
                f"({self._settings.show('ring_slots', slots)}): a consumer that holds its current "
                "batch while it trains can only fall ring_slots - 1 batches behind"
            )
        return window

    def _length(self) -> int | None:
        """Batches per epoch: len() of the current epoch's loader, if it has one."""
        return length_of(self._current)

    def __len__(self) -> int:
        """Batches per epoch of the loader; TypeError if it has no len() (a generator,
        an iterable without ``__len__``, or a callable before its first epoch)."""
        n = self._length()
        if n is None:
            what = "the data loader has no len()" if self._factory is None else \
                "the iterable the data loader callable returned has no len()" \
                if self._current is not None else \
                "the data loader is a callable, and its first epoch has not started"
            raise TypeError(f"{what}: the number of batches per epoch is unknown")
        return n

    # -- ring ------------------------------------------------------------------------

    def _make_ring(self, meta: bytes, leaves: list) -> None:
        """Create the ring sized from the first batch."""
        if not self._window_known and self._length() is not None:
            # A callable's first loader tells the epoch length only now.
            self.window = self._compute_window()
            self._window_known = True
        size = _batch_bytes(leaves) + 2 * len(meta) + 4096
        slot_bytes = self._slot_bytes or max(MIN_SLOT_BYTES, int(size * SLOT_HEADROOM))
        slots = self._ring_slots
        if slots is None:
            need = max(self.window + 2, (self.max_lag or 0) + 2)
            if self._ring_bytes:
                slots = min(MAX_SLOTS, self._ring_bytes // slot_bytes)
                if slots < need:
                    raise ValueError(
                        f"ring_bytes={self._ring_bytes} holds {slots} slots of {slot_bytes} "
                        f"bytes, but the late-joiner window ({self.window}) and max_lag "
                        f"({self.max_lag}) need {need}: raise ring_bytes= or lower "
                        "rubber_band= / rubber_band_pct= / max_lag="
                    )
            else:
                slots = max(DEFAULT_SLOTS, need)
        max_leaves = self._max_leaves or max(64, 2 * len(leaves))
        try:
            ring = self._create_ring(slots, slot_bytes, max_leaves)
        except SharedMemoryTooSmall as e:
            raise SharedMemoryTooSmall(
                f"{e}. The ring is {slots} slots x {slot_bytes} bytes (a late-joiner window "
                f"of {self.window}): lower ring_slots=, slot_bytes= or rubber_band_pct=, or "
                "enlarge /dev/shm (docker run --shm-size=...)"
            ) from None
        try:
            ring.set_policy(self.window, self.max_lag or 0)
        except BaseException:
            ring.close()
            self._files.segment = None
            _core.Ring.unlink_name(self._segment)
            raise
        self._ring_box[0] = ring
        log.info("ring %s: %d slots of %d bytes", self._segment, slots, slot_bytes)

    def _create_ring(self, slots: int, slot_bytes: int, max_leaves: int) -> Any:
        """A host ring, or a GPU ring on self.device (falling back to host if allowed)."""
        if self._device_ordinal is None:
            return self._create_named(slots, slot_bytes, max_leaves)
        try:
            return self._create_named(slots, slot_bytes, max_leaves,
                                      device=self._device_ordinal)
        except GPUUnavailable as e:
            if not self.device_fallback:
                raise GPUUnavailable(
                    f"{e} (device={self.device!r}; device_fallback=True uses the host ring "
                    "instead)") from None
            self.device_fallback_reason = str(e)
            self.device = "cpu"
            self._device_ordinal = None
            warnings.warn(
                f"tensorsocket: the GPU ring cannot work here, using the host ring: {e}",
                GPUFallbackWarning, stacklevel=4)
            log.warning("GPU ring unavailable, using the host ring: %s", e)
            return self._create_named(slots, slot_bytes, max_leaves)

    def _create_named(self, slots: int, slot_bytes: int, max_leaves: int, **kw: Any) -> Any:
        """Ring.create under our segment name; where a file already has that name (anyone
        may create files in /dev/shm, under any name), under the name with a random
        ``.<tag>`` appended instead, a few times. A file found there is never removed: it
        may not be ours."""
        base = self.endpoint.segment_name(os.getpid())
        taken = []
        for attempt in range(SEGMENT_NAME_TRIES):
            name = base if attempt == 0 else f"{base}.{secrets.token_hex(4)}"
            try:
                ring = _core.Ring.create(name, slots, slot_bytes, max_leaves, **kw)
            except FileExistsError:
                taken.append(name)
                log.warning("shared-memory segment name %s is taken by a file that is not "
                            "this producer's; trying another name", name)
                continue
            # Ours from here on (only now: SIGTERM must never remove the file found there).
            self._segment = self._files.segment = name
            return ring
        raise TensorSocketError(
            f"every shared-memory segment name tried for the ring is taken by a file "
            f"already in /dev/shm ({', '.join('/dev/shm' + n for n in taken)}): someone "
            "creates them on purpose; find out who (ls -l /dev/shm), remove them, and "
            "start the producer again")

    def _publish(self, meta: bytes, leaves: list, *, end: bool = False, index: int = 0) -> None:
        try:
            self._ring.publish(leaves, meta, end_of_epoch=end, epoch=self.epoch, index=index,
                               timeout=self.publish_timeout)
        except BatchTooLarge as e:
            raise BatchTooLarge(
                f"{e}. Batch {index} of epoch {self.epoch} is larger than the ring's slots, "
                "which were sized from the first batch: pass slot_bytes= (bytes per batch) to "
                "TensorProducer. Nothing was published."
            ) from None
        except TimeoutError:
            raise TimeoutError(
                f"no ring slot became free within publish_timeout={self.publish_timeout} s: "
                "a consumer holds its batches (or stopped reading)"
            ) from None
        if not end:
            self._batches += 1

    def _encode(self, batch: Any) -> tuple[bytes, list]:
        if self.pack_fn is not None:
            batch = self.pack_fn(batch)
        return self._encoder.flatten(batch)

    # -- iteration -------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        """One epoch: run the loader, publishing each batch before yielding it."""
        if self._closed:
            raise TensorSocketError("this producer was joined or closed")
        return self._run_epoch()

    def _epoch_source(self) -> Any:
        """The iterable of this epoch: the loader, or what the callable returns."""
        if self._factory is None:
            return self.data_loader
        source = self._factory(self.epoch)
        if not is_iterable(source):
            raise TypeError(
                f"the data loader callable returned {type(source).__name__!r} for epoch "
                f"{self.epoch}, which is not iterable: it must return an iterable of batches"
            )
        self._current = source
        return source

    def _run_epoch(self) -> Iterator[Any]:
        try:
            yield from self._publish_epoch()
        except GeneratorExit:
            raise
        except BaseException as e:
            self._note_failure(e)  # the consumers are told when the producer closes
            raise
        self._failure_box[0] = None  # a whole epoch ran after an earlier failure

    def _note_failure(self, exc: BaseException) -> None:
        text = _failure_text(exc)
        if text is not None:
            self._failure_box[0] = text

    def _publish_epoch(self) -> Iterator[Any]:
        source = self._epoch_source()
        self._sets_epoch = set_sampler_epoch(source, self.epoch) or self._sets_epoch
        limit = epoch_limit(source)
        # The sampler records the indices it draws for the whole epoch: a loader whose
        # __iter__ is a generator (a DataLoader subclass such as accelerate's
        # DataLoaderShard) draws them only at its first next().
        with self._sample_ids.recording(source):
            yield from self._publish_recorded_epoch(source, limit)

    def _publish_recorded_epoch(self, source: Any, limit: int | None) -> Iterator[Any]:
        """_publish_epoch, while the sampler of `source` records the indices it draws."""
        with padded_workers(source, self.worker_heap_pad) as padded:
            it = iter(source)
        if padded:
            log.debug("epoch %d: the loader's workers keep %d bytes at the top of their heaps",
                      self.epoch, self.worker_heap_pad)
        one_shot = it is source  # an iterator: iterating it again continues it
        index = 0
        try:
            for batch in it:
                if limit is not None and index >= limit:
                    # len() says the epoch is over, yet the loader goes on (a loader that
                    # never stops, as the original TensorSocket's examples have): end it.
                    self._warn_cut(source, limit)
                    break
                meta, leaves = self._encode(batch)
                meta = with_ids(meta, self._sample_ids.next_ids())
                if self._ring is None:
                    self._make_ring(meta, leaves)
                self._wait_for_consumers()
                self._publish(meta, leaves, index=index)
                index += 1
                if one_shot:
                    self._used_up = source  # if it yields nothing next epoch, it is used up
                yield batch
        except GeneratorExit:
            # An epoch cut short (break) still ends with a marker: consumers never hang.
            self._end_epoch(index)
            raise
        if index == 0 and one_shot and source is self._used_up:
            raise TypeError(self._used_up_message(source))
        if index == 0:
            log.warning("epoch %d of the data loader yielded no batch; nothing was published",
                        self.epoch)
        self._end_epoch(index)

    def _warn_cut(self, source: Any, limit: int) -> None:
        """Say once that epochs of `source` end at its len() while it yields more."""
        if self._warned_cut:
            return
        self._warned_cut = True
        message = (
            f"the data loader (a {type(source).__qualname__!r} object) has len() {limit} but "
            f"yields more batches (a batch {limit + 1} came in epoch {self.epoch}): each "
            f"epoch is cut at len() = {limit} batches, and the rest of what it yields is "
            "never published. "
            "Make __len__ return the number of batches one pass yields, or drop __len__ "
            "for a loader that ends by itself (this is said once)")
        log.warning("%s", message)
        warnings.warn(message, TensorSocketWarning, stacklevel=4)

    def _used_up_message(self, source: Any) -> str:
        """Why an iterator cannot give a second epoch, and what to pass instead."""
        what = f"{type(source).__name__!r} object"
        if self._factory is None:
            problem = (f"the data loader is an iterator (a {what}) that epoch "
                       f"{self.epoch - 1} used up: iterating it again yields nothing, so "
                       f"epoch {self.epoch} would publish nothing")
        else:
            problem = (f"the data loader callable returned the same {what} for epoch "
                       f"{self.epoch} as for epoch {self.epoch - 1}, an iterator that epoch "
                       f"{self.epoch - 1} used up, so epoch {self.epoch} would publish nothing")
        return (
            f"{problem}. Pass an object that can be iterated again (a DataLoader, a list, a "
            "class whose __iter__ starts a new pass), or a callable that returns a fresh "
            "iterable for each epoch: TensorProducer(lambda: make_batches()), or "
            "TensorProducer(lambda epoch: make_batches(epoch)) to receive the epoch number"
        )

    def _end_epoch(self, index: int) -> None:
        """Publish the end-of-epoch marker after `index` batches."""
        if index == 0:
            return
        if self._ring is not None and not self._closed:
            self._publish(b"", [], end=True, index=index)
        self.epoch += 1

    def _wait_for_consumers(self) -> None:
        """Before the first batch: wait for min_consumers, then start_grace seconds for
        jobs started together with them. Later: for at least one consumer."""
        if self.min_consumers == 0:
            return
        want = self.min_consumers if self._batches == 0 else 1
        if self._ring.wait_consumers(want, 0):
            self._start_grace()
            return
        if self._batches > 0:
            log.info("no consumer attached: pausing until one attaches")
        start = time.perf_counter()
        ok = self._ring.wait_consumers(want, self.start_timeout)
        if ok:
            self._start_grace()
        self._wait_consumers_s += time.perf_counter() - start
        if not ok:
            where = f"producer {self.endpoint.name!r} at {self.endpoint.address}"
            if self._batches == 0:
                raise TimeoutError(
                    f"only {self._server.consumer_count()} of min_consumers={want} consumers "
                    f"attached within start_timeout={self.start_timeout} s ({where})"
                )
            raise TimeoutError(
                f"every consumer left and none attached again within start_timeout="
                f"{self.start_timeout} s ({where}); pass start_timeout=None to wait for "
                "consumers indefinitely"
            )

    def _start_grace(self) -> None:
        """Before the very first batch only: give the jobs started together with the first
        consumers start_grace seconds to attach, so that all of them begin at batch 0."""
        if self._batches > 0 or self._graced or self.start_grace <= 0:
            return
        self._graced = True
        log.info("first consumer attached: waiting start_grace=%s s for others started with "
                 "it", self.start_grace)
        end = time.monotonic() + self.start_grace
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))

    # -- end ------------------------------------------------------------------------

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the consumers have read everything published, then tear down.

        Returns False if the timeout passed first (teardown happens anyway).
        """
        if self._closed:
            return True
        drained = True
        if self._ring is not None:
            drained = self._ring.wait_drained(timeout)
            if not drained:
                log.warning("join(): consumers did not read everything within %s s", timeout)
        self.close()
        return drained

    def close(self) -> None:
        """Tear down now: consumers see the ring finished; segment and sockets go."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    def __enter__(self) -> "TensorProducer":
        """The producer itself."""
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """join() if the block ended normally, else close() at once, telling the
        consumers that the producer failed and why (ProducerFailed)."""
        if exc_type is None:
            self.join()
        else:
            self._note_failure(exc)
            self.close()

    # -- introspection --------------------------------------------------------------

    def consumers_present(self) -> int:
        """Consumers of this producer: attached, or parked between epochs (they attach
        again when they next iterate)."""
        return 0 if self._closed else self._server.present_count()

    @property
    def ring(self) -> Any:
        """The C ring handle (None before the first batch)."""
        return self._ring

    def stats(self) -> dict:
        """Counters of the producer and of each consumer.

        batches: batches published; bytes_copied: bytes copied into the ring
        (one copy per batch, whatever the number of consumers); wait_seconds:
        time spent waiting for a free slot (the slowest consumer's pace);
        consumer_wait_seconds: time spent waiting for min_consumers; occupied:
        slots some consumer still has to read or still holds; skipped_slots: times
        the producer went past a slot kept by a consumer that receives no more (taken
        off as silent, detached or gone while its batches live: never overwritten, see
        docs/failures.md), publishing a hole there; late_releases:
        releases that came from a consumer after it was evicted (a stopped process
        resumed, a deferred GPU release); they leave the slot to whoever holds it now
        (docs/architecture.md, "Incarnations"); consumer_table:
        per consumer, its lag in ring entries (batches plus one end marker per
        epoch) behind the producer, entries and bytes delivered, and the time
        it spent waiting for batches; rejected_messages: malformed control
        messages, consumers of another protocol version, and hellos refused by
        tensorsocket.control.auth (another user, another pid, no or a wrong secret).
        """
        ring = self._ring if self._ring is not None and not self._ring.closed else None
        info = ring.info() if ring is not None else {}
        table = []
        if ring is not None:
            sizes = self._server.batch_sizes()
            for c in ring.consumers():
                table.append({
                    "index": c["index"],
                    "pid": c["pid"],
                    "state": _STATE_NAMES.get(c["state"], str(c["state"])),
                    "batch_size": sizes.get(c["index"]),
                    "lag": c["lag"],
                    "delivered": c["delivered"],
                    "delivered_bytes": c["delivered_bytes"],
                    "wait_seconds": c["wait_ns"] / 1e9,
                })
        return {
            "epoch": self.epoch,
            "device": self.device,
            "host_pinned": bool(info.get("producer_host_pinned", 0)),
            "batches": self._batches,
            "bytes_copied": info.get("bytes_copied", 0),
            "wait_seconds": info.get("publish_wait_ns", 0) / 1e9,
            "consumer_wait_seconds": self._wait_consumers_s,
            "consumers": self._server.consumer_count() if not self._closed else 0,
            "slots": info.get("slot_count", 0),
            "slot_bytes": info.get("slot_bytes", 0),
            "occupied": info.get("occupied", 0),
            "window": self.window,
            "max_lag": self.max_lag,
            "lag_detached": info.get("lag_detached", 0),
            "skipped_slots": info.get("holes", 0),
            "late_releases": info.get("late_releases", 0),
            "rejected_messages": self._server.rejected,
            "consumer_table": table,
        }


_STATE_NAMES = {
    _core.CONSUMER_PENDING: "joining",
    _core.CONSUMER_ACTIVE: "active",
    _core.CONSUMER_LEAVING: "leaving",
    _core.CONSUMER_DETACHED: "detached",
}


# -- helpers (module level so the finalizer holds no reference to the producer) -------


def _welcome_info(producer_ref: "weakref.ref[TensorProducer]") -> dict:
    """Handshake fields, or placeholders if the producer is being collected."""
    producer = producer_ref()
    if producer is None:
        return {"segment": "", "length": None, "loader_batch_size": None, "samples": None,
                "samples_exact": False, "dataset": None, "dataset_len": None,
                "epoch": 0, "producer_pid": os.getpid(), "window": 0, "max_lag": 0,
                "lag_policy": "raise", "fingerprint": None, "auto_set_epoch": False}
    return producer._welcome_info()


def _teardown(server: ControlServer, context: zmq.Context, files: "OwnedFiles",
              lock_fd: int, ring_box: list, release_timeout: float | None,
              failure_box: list) -> None:
    """Finish the ring (with the producer's failure, if it failed), stop the control
    thread (answering consumers that still wait for a ring that never came), unlink the
    segment, the socket file and the lock file, then drop the lock."""
    ring = ring_box[0]
    failure = failure_box[0]
    try:
        if ring is not None:
            ring.finish(failure)
            _wait_gpu_released(ring, release_timeout)
        if failure is not None:
            server.close(farewell=("failed", failure))
        else:
            server.close(farewell=("finished", "closed before publishing its first batch"))
        context.term()
    finally:
        # Whatever happened above (a second Ctrl-C, say), the files must go. The device
        # memory goes only once no consumer maps it (see _POOL_KEEPER).
        if ring is not None and not (_gpu_mapped(ring) and _POOL_KEEPER.keep(ring)):
            ring.close()
        files.remove()
        forget_on_sigterm(files)
        os.close(lock_fd)


def _failure_text(exc: BaseException) -> str | None:
    """What the consumers are told of the error that ended the producer: its type, its
    message and where it was raised, at most FAILURE_CHARS characters (the end of a long
    message, where a DataLoader worker's traceback names the error, is kept). None for
    an exit that is no failure (sys.exit(0))."""
    if isinstance(exc, GeneratorExit) or (isinstance(exc, SystemExit) and
                                          exc.code in (None, 0)):
        return None
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    where = _raised_at(exc)
    if where is not None:
        text += f" (raised at {os.path.basename(where.filename)}:{where.lineno} in " \
                f"{where.name})"
    text = text.replace("\0", "?")
    if len(text) > FAILURE_CHARS:
        head = FAILURE_CHARS // 4
        text = text[:head] + " [...] " + text[-(FAILURE_CHARS - head - 7):]
    return text


def _raised_at(exc: BaseException) -> traceback.FrameSummary | None:
    """The frame that raised exc, for the user: its traceback's last frame, unless that
    one is this package's and exc was raised from a cause that reaches further (Python
    turns a StopIteration leaking out of the loader's generator into a RuntimeError
    raised at our loop over the loader, "from" the user's StopIteration)."""
    frames = traceback.extract_tb(exc.__traceback__)
    cause = exc.__cause__
    if cause is not None and cause.__traceback__ is not None and \
            (not frames or os.path.dirname(frames[-1].filename) == _PACKAGE_DIR):
        return _raised_at(cause)
    return frames[-1] if frames else None


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _wait_gpu_released(ring: Any, timeout: float | None) -> None:
    """Wait up to timeout for no consumer to hold a batch of a GPU ring or map its device
    memory. The control thread still runs meanwhile, so consumers that die are evicted
    and stop counting."""
    info = ring.info()
    if info["device_type"] != _core.DL_CUDA or ring.wait_released(0):
        return
    log.info("waiting up to %s s for consumers to free the GPU batches they hold", timeout)
    if ring.wait_released(timeout):
        return
    importers = ring.info()["gpu_importers"]
    if importers == 0:
        return
    log.warning(
        "after release_timeout=%s s, %d consumer processes still map the GPU ring: its device "
        "memory is kept until they close or die (a keeper thread frees it then); if this "
        "process exits first, they get ProducerGone (consumers should close() when done)",
        timeout, importers)


def _gpu_mapped(ring: Any) -> bool:
    """Whether consumer processes still map the ring's device memory."""
    try:
        info = ring.info()
    except Exception:  # a ring that cannot say keeps nothing
        return False
    return info["device_type"] == _core.DL_CUDA and info["gpu_importers"] > 0


KEEP_CHECK = 1.0  # seconds: how often the keeper looks again for importers that died


class _PoolKeeper:
    """Keeps the device memory of the GPU rings of closed producers that consumer processes
    still map, and frees each once none does any more (they closed or died).

    The CUDA driver says "Calling cuMemFree on an exported memory region before calling
    cuIpcCloseMemHandle in the importing context will result in undefined behavior"
    (cuIpcOpenMemHandle), so a closed producer's pool cannot go while a consumer maps it,
    however long after release_timeout. One daemon thread keeps them all: it sleeps on
    the first ring's release futex (a consumer's close wakes it) for at most KEEP_CHECK
    seconds between looks (a dead consumer wakes nobody), and ends when no ring is left.
    Everything else of the producer (segment name, sockets, lock file) is gone already;
    the ring handle it closes holds the rest (its mapping, fd and device memory). If the
    process exits first, its exit takes the memory, and the consumers' next batch raises
    ProducerGone (see docs/gpu.md)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rings: list = []  # under _lock: rings kept, each closed once unmapped
        self._thread: threading.Thread | None = None  # under _lock: while rings are kept

    def keep(self, ring: Any) -> bool:
        """Keep ring until no consumer maps its device memory, then close it. False where
        no thread can start (the interpreter exits): the caller closes the ring, and the
        C core then leaves the memory to the process's exit."""
        with self._lock:
            self._rings.append(ring)
            if self._thread is not None:
                return True
            thread = threading.Thread(target=self._run, name="tensorsocket-gpu-keeper",
                                      daemon=True)
            try:
                thread.start()
            except RuntimeError:  # "can't create new thread at interpreter shutdown"
                self._rings.remove(ring)
                return False
            self._thread = thread
            return True

    def kept(self) -> int:
        """Rings kept now."""
        with self._lock:
            return len(self._rings)

    def _run(self) -> None:
        """Close each kept ring once nobody maps it; end when none is left."""
        while True:
            with self._lock:
                rings = list(self._rings)
                if not rings:
                    self._thread = None
                    return
            for ring in rings:
                try:
                    unmapped = ring.info()["gpu_importers"] == 0
                except Exception:  # the thread must never die with rings kept
                    log.exception("tensorsocket GPU keeper failed to look at a ring")
                    unmapped = False
                if unmapped:
                    with self._lock:
                        self._rings.remove(ring)
                    try:
                        ring.close()
                    except Exception:
                        log.exception("tensorsocket GPU keeper failed to close a ring")
                    log.info("the last consumer unmapped a closed producer's GPU ring: freed")
            with self._lock:
                first = self._rings[0] if self._rings else None
            if first is not None:
                try:
                    first.wait_released(KEEP_CHECK)
                except Exception:  # interrupted: look again
                    time.sleep(KEEP_CHECK)


_POOL_KEEPER = _PoolKeeper()


def _batch_bytes(leaves: list) -> int:
    """Bytes of tensor data in a flattened batch."""
    total = 0
    for buf, _ in leaves:
        total += memoryview(buf).nbytes + 64
    return total

