"""TensorProducer: runs a data loader once and publishes every batch to the ring."""

from __future__ import annotations

import fcntl
import logging
import math
import os
import re
import time
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator

import zmq

from . import _core
from .control import ControlServer
from .endpoints import Endpoint, resolve, segment_prefix
from .errors import (
    BatchTooLarge,
    GPUFallbackWarning,
    GPUUnavailable,
    SharedMemoryTooSmall,
    TensorSocketError,
)
from .gpu import parse_device
from .structure import flatten

log = logging.getLogger("tensorsocket")

DEFAULT_SLOTS = 4
MAX_SLOTS = 4096
LAG_POLICIES = ("raise", "rejoin")
DEFAULT_RUBBER_BAND_PCT = 0.005  # of an epoch's batches ...
DEFAULT_MAX_WINDOW = 8  # ... but at most this many, unless asked for explicitly
SLOT_HEADROOM = 1.5  # slot size = first batch x this (plus room for the structure)
MIN_SLOT_BYTES = 64 * 1024
DL_CUDA = 2  # DLDeviceType of a GPU ring


class TensorProducer:
    """Publish the batches of ``data_loader`` to every attached consumer.

    ``for batch in producer:`` runs one epoch of the loader, publishing each
    batch before yielding it; iterating again runs the next epoch.
    ``producer.join()`` waits until the consumers have read everything that
    was published, then tears the ring and sockets down.

    The positional parameters after ``data_loader`` are those of the original
    TensorSocket (``port, ack_port, heart_ports, rubber_band_pct, pack_fn,
    consumer_max_buffer_size, producer_batch_size``) so scripts written for it
    run unchanged. ``port`` selects a loopback TCP control endpoint;
    ``ack_port`` and ``heart_ports`` are accepted and unused (one socket does
    it all); ``consumer_max_buffer_size`` is the number of ring slots;
    ``producer_batch_size`` is accepted and ignored (every loader batch is
    published as it is; consumers choose their own ``batch_size``).

    Late joiners: the last ``rubber_band_pct`` of an epoch's batches (rounded
    up), or ``rubber_band=`` batches, stay readable in the ring. A consumer
    that attaches mid-epoch starts at the oldest of them (never before the
    current epoch's first batch); see the README for the exact semantics.
    Without either, the window is 0.5% of an epoch but at most 8 batches (and
    at most ring_slots - 2 when ring_slots is given), to keep memory bounded.

    Keyword-only:
      name: producer name for rendezvous (default ``"default"``, or
        ``$TENSORSOCKET_NAME``); consumers with the same name find it.
      address: explicit ZeroMQ address (``ipc://...`` or ``tcp://host:port``).
      min_consumers: consumers that must be attached before the first batch
        is published (default 1). After that, whenever no consumer at all is
        attached, the producer pauses (the loader is not run for nobody) until
        one attaches; 0 never waits.
      start_timeout: seconds to wait for them, and for one consumer while none
        is attached (None: forever); TimeoutError after.
      rubber_band: the late-joiner window in batches (overrides rubber_band_pct).
      max_lag: detach a consumer that falls more than this many batches behind
        the fastest consumer, so the others are not held back (default None:
        lossless, the producer waits for the slowest consumer).
      lag_policy: what a detached laggard does: ``"raise"`` (ConsumerDetached)
        or ``"rejoin"`` (a LagWarning, then it attaches again as a late joiner).
      ring_slots: slots in the ring (default: 4, or the window + 2, or
        max_lag + 2, whichever is largest).
      slot_bytes: capacity of one slot (default: first batch x 1.5).
      ring_bytes: total slot memory; sets ring_slots from slot_bytes.
      max_leaves: most tensors one batch may hold (default: from the first batch).
      publish_timeout: seconds to wait for a free slot (None: forever).
      device: ``"cuda:N"`` (or ``"cuda"`` for GPU 0) keeps the ring's slots
        in GPU memory as well: each batch is copied to the GPU once, for all
        consumers, which receive CUDA tensors read in place through CUDA IPC
        (see the README, "GPU ring"). Default: host memory only.
      device_fallback: if the GPU ring cannot work here (no driver, MIG, no
        CUDA IPC events), warn and use the host ring (default True); False
        raises GPUUnavailable instead.
      release_timeout: a GPU ring's device memory is freed only once no
        consumer holds a batch of it; at join()/close() wait this many seconds
        for them (default 30), then free it anyway with a warning.
    """

    def __init__(
        self,
        data_loader: Iterable,
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
        min_consumers: int = 1,
        start_timeout: float | None = None,
        ring_slots: int | None = None,
        slot_bytes: int | None = None,
        ring_bytes: int | None = None,
        max_leaves: int | None = None,
        publish_timeout: float | None = None,
        rubber_band: int | None = None,
        max_lag: int | None = None,
        lag_policy: str = "raise",
        device: Any = None,
        device_fallback: bool = True,
        release_timeout: float | None = 30.0,
    ) -> None:
        if ring_slots is not None and consumer_max_buffer_size is not None:
            raise ValueError("give ring_slots= or consumer_max_buffer_size=, not both")
        slots = ring_slots if ring_slots is not None else consumer_max_buffer_size
        if slots is not None and not 2 <= int(slots) <= MAX_SLOTS:
            raise ValueError(f"ring_slots must be in 2..{MAX_SLOTS}, got {slots}")
        if slot_bytes is not None and int(slot_bytes) <= 0:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        if min_consumers < 0 or min_consumers > _core.MAX_CONSUMERS:
            raise ValueError(f"min_consumers must be in 0..{_core.MAX_CONSUMERS}")
        if rubber_band_pct is not None and not 0 <= float(rubber_band_pct) <= 1:
            raise ValueError(f"rubber_band_pct must be in 0..1, got {rubber_band_pct}")
        if rubber_band is not None and int(rubber_band) < 0:
            raise ValueError(f"rubber_band must be >= 0 batches, got {rubber_band}")
        if max_lag is not None and not 1 <= int(max_lag) <= MAX_SLOTS - 2:
            raise ValueError(f"max_lag must be in 1..{MAX_SLOTS - 2} batches, got {max_lag}")
        if rubber_band is not None and int(rubber_band) > MAX_SLOTS - 2:
            raise ValueError(f"rubber_band must be at most {MAX_SLOTS - 2} batches, got "
                             f"{rubber_band}")
        kind, ordinal = parse_device(device)
        if kind == "cuda" and ordinal is None:
            ordinal = 0
        self._device_ordinal = ordinal if kind == "cuda" else None
        self.device = f"cuda:{ordinal}" if kind == "cuda" else "cpu"
        self.device_fallback = bool(device_fallback)
        self.device_fallback_reason: str | None = None
        self.release_timeout = release_timeout
        if lag_policy not in LAG_POLICIES:
            raise ValueError(f"lag_policy must be one of {LAG_POLICIES}, got {lag_policy!r}")
        explicit_window = rubber_band is not None or rubber_band_pct is not None
        self.rubber_band_pct = DEFAULT_RUBBER_BAND_PCT if rubber_band_pct is None \
            else float(rubber_band_pct)
        self.rubber_band = int(rubber_band) if rubber_band is not None else None
        self.max_lag = int(max_lag) if max_lag is not None else None
        self.lag_policy = lag_policy
        self.window = self._window_batches(data_loader)
        if not explicit_window:
            # The default window stays small and fits the ring the user asked for.
            self.window = min(self.window, DEFAULT_MAX_WINDOW)
            if slots is not None:
                self.window = max(0, min(self.window, int(slots) - 2))
            if self.max_lag is not None:
                self.window = min(self.window, self.max_lag - 1)
        if self.window > MAX_SLOTS - 2:
            raise ValueError(
                f"a late-joiner window of {self.window} batches needs more than the "
                f"{MAX_SLOTS} slots a ring holds: lower rubber_band_pct= or rubber_band="
            )
        if self.max_lag is not None and self.max_lag <= self.window:
            raise ValueError(
                f"max_lag={self.max_lag} must exceed the late-joiner window of {self.window} "
                "batches (rubber_band= / rubber_band_pct=): a late joiner starts that far behind"
            )
        if slots is not None and int(slots) <= self.window:
            raise ValueError(
                f"ring_slots={slots} cannot keep a late-joiner window of {self.window} batches: "
                "raise ring_slots= or lower rubber_band= / rubber_band_pct="
            )
        if slots is not None and self.max_lag is not None and self.max_lag + 2 > int(slots):
            raise ValueError(
                f"max_lag={self.max_lag} needs ring_slots >= max_lag + 2 (ring_slots={slots}): "
                "a consumer that holds its current batch while it trains can only fall "
                "ring_slots - 1 batches behind"
            )
        self.data_loader = data_loader
        self.producer_batch_size = producer_batch_size
        self.pack_fn = pack_fn
        self.min_consumers = int(min_consumers)
        self.start_timeout = start_timeout
        self.publish_timeout = publish_timeout
        self._ring_slots = int(slots) if slots is not None else None
        self._slot_bytes = int(slot_bytes) if slot_bytes is not None else None
        self._ring_bytes = int(ring_bytes) if ring_bytes is not None else None
        self._max_leaves = max_leaves
        self.epoch = 0
        self._wait_consumers_s = 0.0
        self._ring_box: list = [None]  # the ring, shared with the control thread and finalizer
        self._closed = False
        self._batches = 0

        self.endpoint: Endpoint = resolve(name, port, address, for_producer=True)
        self._lock_fd = _take_name_lock(self.endpoint)
        self._segment = self.endpoint.segment_name(os.getpid())
        try:
            _sweep_stale_segments(self.endpoint.name)
            self._context = zmq.Context()
            box, me = self._ring_box, weakref.ref(self)
            self._server = ControlServer(self._context, self.endpoint.address,
                                         lambda: box[0], lambda: _welcome_info(me))
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._finalizer = weakref.finalize(
            self, _teardown, self._server, self._context, self._segment, self._lock_fd, box,
            self.endpoint, release_timeout,
        )
        log.info("producer %r listening on %s", self.endpoint.name, self.endpoint.address)

    # -- handshake info ------------------------------------------------------------

    @property
    def _ring(self) -> Any:
        return self._ring_box[0]

    def _welcome_info(self) -> dict:
        samples, exact = _samples_per_epoch(self.data_loader)
        return {
            "segment": self._segment,
            "length": self._length(),
            "loader_batch_size": _loader_batch_size(self.data_loader),
            "samples": samples,
            "samples_exact": exact,
            "epoch": self.epoch,
            "producer_pid": os.getpid(),
            "window": self.window,
            "max_lag": self.max_lag or 0,
            "lag_policy": self.lag_policy,
        }

    def _window_batches(self, loader: Any) -> int:
        """The late-joiner window in batches."""
        if self.rubber_band is not None:
            return self.rubber_band
        try:
            n = len(loader)
        except TypeError:
            return 0
        return math.ceil(self.rubber_band_pct * n - 1e-9)

    def _length(self) -> int | None:
        try:
            return len(self.data_loader)  # type: ignore[arg-type]
        except TypeError:
            return None

    def __len__(self) -> int:
        n = self._length()
        if n is None:
            raise TypeError("the data loader has no len()")
        return n

    # -- ring ------------------------------------------------------------------------

    def _make_ring(self, meta: bytes, leaves: list) -> None:
        """Create the ring sized from the first batch."""
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
            _core.Ring.unlink_name(self._segment)
            raise
        self._ring_box[0] = ring
        log.info("ring %s: %d slots of %d bytes", self._segment, slots, slot_bytes)

    def _create_ring(self, slots: int, slot_bytes: int, max_leaves: int) -> Any:
        """A host ring, or a GPU ring on self.device (falling back to host if allowed)."""
        if self._device_ordinal is None:
            return _core.Ring.create(self._segment, slots, slot_bytes, max_leaves)
        try:
            return _core.Ring.create(self._segment, slots, slot_bytes, max_leaves,
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
            return _core.Ring.create(self._segment, slots, slot_bytes, max_leaves)

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
        return flatten(batch)

    # -- iteration -------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise TensorSocketError("this producer was joined or closed")
        return self._run_epoch()

    def _run_epoch(self) -> Iterator[Any]:
        it = iter(self.data_loader)
        index = 0
        try:
            for batch in it:
                meta, leaves = self._encode(batch)
                if self._ring is None:
                    self._make_ring(meta, leaves)
                self._wait_for_consumers()
                self._publish(meta, leaves, index=index)
                index += 1
                yield batch
        except GeneratorExit:
            # An epoch cut short (break) still ends with a marker: consumers never hang.
            self._end_epoch(index)
            raise
        self._end_epoch(index)

    def _end_epoch(self, index: int) -> None:
        """Publish the end-of-epoch marker after `index` batches."""
        if index == 0:
            return
        if self._ring is not None and not self._closed:
            self._publish(b"", [], end=True, index=index)
        self.epoch += 1

    def _wait_for_consumers(self) -> None:
        """Before the first batch: wait for min_consumers. Later: for at least one."""
        if self.min_consumers == 0:
            return
        want = self.min_consumers if self._batches == 0 else 1
        if self._ring.wait_consumers(want, 0):
            return
        if self._batches > 0:
            log.info("no consumer attached: pausing until one attaches")
        start = time.perf_counter()
        ok = self._ring.wait_consumers(want, self.start_timeout)
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
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.join()
        else:
            self.close()

    # -- introspection --------------------------------------------------------------

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
        slots some consumer still has to read or still holds; consumer_table:
        per consumer, its lag in ring entries (batches plus one end marker per
        epoch) behind the producer, entries and bytes delivered, and the time
        it spent waiting for batches; rejected_messages: malformed control
        messages and consumers of another protocol version turned away.
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
                "samples_exact": False,
                "epoch": 0, "producer_pid": os.getpid(), "window": 0, "max_lag": 0,
                "lag_policy": "raise"}
    return producer._welcome_info()


def _teardown(server: ControlServer, context: zmq.Context, segment: str, lock_fd: int,
              ring_box: list, endpoint: Endpoint, release_timeout: float | None) -> None:
    """Finish the ring, stop the control thread, unlink the segment, the socket file
    and the lock file, then drop the lock."""
    ring = ring_box[0]
    try:
        if ring is not None:
            ring.finish()
            _wait_gpu_released(ring, release_timeout)
        server.close()
        context.term()
    finally:
        # Whatever happened above (a second Ctrl-C, say), the files must go.
        if ring is not None:
            ring.close()
        _core.Ring.unlink_name(segment)
        for path in (endpoint.lock_path, endpoint.socket_path):
            if path is not None:  # we still hold the name lock: these files are ours
                path.unlink(missing_ok=True)
        os.close(lock_fd)


def _wait_gpu_released(ring: Any, timeout: float | None) -> None:
    """A GPU ring's device memory may be freed only once no consumer holds a batch of it
    and no consumer process maps it any more (freeing exported memory still mapped
    elsewhere is undefined behaviour). The control thread still runs meanwhile, so
    consumers that die are evicted and stop counting."""
    info = ring.info()
    if info["device_type"] != DL_CUDA or ring.wait_released(0):
        return
    log.info("waiting up to %s s for consumers to free the GPU batches they hold", timeout)
    if not ring.wait_released(timeout):
        now = ring.info()
        log.warning(
            "after release_timeout=%s s, %d ring slots are still held and %d consumer "
            "processes still map the GPU ring; freeing it anyway: their tensors are no longer "
            "valid (consumers should close() when done)",
            timeout, now["occupied"], now["gpu_importers"])


def _take_name_lock(endpoint: Endpoint) -> int:
    """flock the name's lock file; the kernel drops it if we die."""
    fd = os.open(endpoint.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        finally:
            os.close(fd)
        raise TensorSocketError(
            f"a producer named {endpoint.name!r} is already running (pid {owner}); "
            "give this one another name= or port="
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _sweep_stale_segments(name: str) -> None:
    """Remove segments of earlier producers of this name (we hold the name lock,
    so none of them is alive)."""
    prefix = segment_prefix(name)
    pattern = re.compile(re.escape(prefix) + r"\d+$")
    try:
        entries = os.listdir("/dev/shm")
    except OSError:
        return
    for entry in entries:
        if pattern.match(entry):
            log.info("removing stale segment /dev/shm/%s", entry)
            _core.Ring.unlink_name("/" + entry)


def _batch_bytes(leaves: list) -> int:
    """Bytes of tensor data in a flattened batch."""
    total = 0
    for buf, _ in leaves:
        total += memoryview(buf).nbytes + 64
    return total


def _samples_per_epoch(loader: Any) -> tuple[int | None, bool]:
    """(samples one epoch of the loader yields, whether that count is exact).

    Exact for a torch DataLoader (its sampler's length, or full batches with
    drop_last); for another loader with a batch_size and a len(), full batches
    are assumed."""
    bs = _loader_batch_size(loader)
    if bs is None:
        return None, False
    try:
        batches = len(loader)
    except TypeError:
        return None, False
    if getattr(loader, "batch_sampler", None) is not None:
        if getattr(loader, "drop_last", False):
            return batches * bs, True
        try:
            return min(len(loader.sampler), batches * bs), True
        except (AttributeError, TypeError):
            pass
    return batches * bs, False


def _loader_batch_size(loader: Any) -> int | None:
    bs = getattr(loader, "batch_size", None)
    return bs if isinstance(bs, int) and not isinstance(bs, bool) else None
