"""TensorConsumer: iterate the producer's batches like a DataLoader, zero-copy."""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from typing import Any, Callable

import numpy as np
import torch
import zmq

from . import _core, config
from .config import UNSET, Unset
from .control import ControlClient
from .endpoints import resolve
from .gpu import parse_device
from .errors import (
    ConsumerDetached,
    GPUFallbackWarning,
    GPUUnavailable,
    LagWarning,
    ProducerFinished,
    ProducerGone,
    TensorSocketError,
    TensorSocketWarning,
)
from .rebatch import EpochEnd, Rebatcher, batch_samples, consumer_len
from .structure import NUMPY, NUMPY_SCALAR, TORCH, Decoder

log = logging.getLogger("tensorsocket")

DL_CUDA = 2  # DLDeviceType of a GPU ring

DEFAULT_TIMEOUT = config.SETTINGS["timeout"].default
STALL_WARN_AFTER = 5.0  # seconds waiting for a batch the consumer's own held batches block


class TensorConsumer:
    """Receive the batches of a TensorProducer; a drop-in for a DataLoader.

    ``for batch in consumer:`` is one epoch and ends with StopIteration;
    iterating again gives the next epoch. Batches keep the loader's
    structure; tensors are zero-copy, read-only views of the shared ring
    (in-place ops on them are not allowed: pass ``copy=True`` for private
    writable copies, or ``.clone()``). A batch holds its ring slot for as long
    as any tensor (or slice of one) from it is alive.

    Epochs: a consumer attached before the producer's first batch, or between
    two epochs, sees the producer's epochs. A late joiner starts at the oldest
    batch of the producer's window (see TensorProducer) and each of its epochs
    is the next ``len(consumer)`` batches, wrapping into the producer's next
    epoch. Leaving an epoch mid-way (break, dropping the iterator, or a new
    iteration) leaves the ring at once, so the others never wait for this
    consumer; the next batch asked for attaches it again, as a late joiner.

    Positional parameters follow the original TensorSocket
    (``port, ack_port, heart_ports, unpack_fn, batch_size``). When ``port`` is
    given the consumer yields ``(batch_index, batch)`` pairs like the original
    did (override with ``with_index=``).

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
      timeout: seconds to wait for the producer to answer (default 60; None:
        forever); then ProducerNotFound (env).
      batch_timeout: seconds to wait for one batch (None, the default: as
        long as the producer lives); then TimeoutError (env).
      copy: deliver private, writable copies instead of views.
      with_index: yield (batch_index, batch) pairs; batch_index counts the
        batches of the current epoch from 0.
      device: where tensors are delivered. None (default): where the
        producer put them: on its GPU for a GPU ring (read in place through
        CUDA IPC, no copy), else in host memory. ``"cpu"``: host memory, even
        from a GPU ring. ``"cuda:N"``: on GPU N: in place if the ring is on
        GPU N, through peer access if it is on another GPU (or copied into
        GPU N with ``peer_access=False``), copied by this consumer from a
        host ring. If CUDA IPC cannot work (another PID namespace, no
        driver here, ...), a GPUFallbackWarning says why and tensors come
        through host memory (copied to ``device`` if one was given).
        ``"auto"`` is the default's name (env:
        ``TENSORSOCKET_CONSUMER_DEVICE``).
      pin_memory: page-lock this process's mapping of the ring's host slots,
        so copies from them to a GPU are asynchronous (like
        DataLoader(pin_memory=True), without its extra copy).
      peer_access: read a GPU ring on another GPU through peer access
        (default True); False copies each batch into ``device`` instead.
    """

    # Set by tensorsocket.share() on the consumers it returns.
    started_producer: bool = False
    """share(): True if this call started the producer process."""
    producer_log: Any = None
    """share(): the producer process's log file (a pathlib.Path), else None."""
    dataset: Any = None
    """share(): the caller's ``loader.dataset``, when its loader has one, else None."""

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
        with_index: bool | None = None,
        device: Any = UNSET,
        pin_memory: bool = False,
        peer_access: bool = True,
    ) -> None:
        origins: dict[str, str] = {}  # setting key -> its environment variable

        def setting(key: str, value: Any) -> Any:
            value, source = config.lookup(key, value)
            if source == "environment":
                origins[key] = config.SETTINGS[key].env
            return value

        # The timeouts as resolved: the argument, else the environment, else the default.
        answer_wait: float | None = setting("timeout", timeout)
        batch_wait: float | None = setting("batch_timeout", batch_timeout)
        if isinstance(device, str) and device == "auto":
            device = None  # explicitly the default: the environment does not apply
        else:
            device = setting("consumer_device", device)
        name = setting("name", name)
        if port is None:
            address = setting("address", address)
        setting("runtime_dir", UNSET)
        self._rebatcher = Rebatcher(batch_size, drop_last) if batch_size is not None else None
        self.unpack_fn = unpack_fn
        self.batch_size = batch_size
        self.drop_last = bool(drop_last)
        self.batch_timeout = batch_wait
        self.timeout = answer_wait
        self.copy = bool(copy)
        self._device_kind, self._device_index = parse_device(device)
        self.pin_memory = bool(pin_memory)
        self.peer_access = bool(peer_access)
        self.device = "cpu"  # where tensors are delivered (set once attached)
        self.device_fallback_reason: str | None = None
        self._import = False  # tensors come from the ring's GPU copy
        self._cuda: torch.device | None = None  # the GPU they are on, when they do
        self._move_to: torch.device | None = None  # host tensors are copied here
        self._inflight: list = []  # (cuda event, host tensors) of copies not yet done
        self.with_index = (port is not None) if with_index is None else bool(with_index)
        self.endpoint = resolve(name, port, address)
        self.epoch = 0
        self._decoder = Decoder()
        self._closed = False
        # Epoch bookkeeping: the consumer's epochs run from producer position
        # (epoch, index) = (e, i0) up to, not including, (e + 1, i0).
        self._in_epoch = False
        self._epoch_end: tuple[int, int] | None = None  # first position past this epoch
        self._source_done = False  # no more loader batches in this epoch
        self._epoch_pulled = 0  # loader batches taken in this epoch
        self._epoch_batches = 0  # batches returned in this epoch
        self._after_end_marker = False  # the last entry taken ended a producer epoch
        self._attached = True  # False after leaving mid-epoch, until the next batch
        # Counters for stats().
        self._batches = 0
        self._samples = 0
        self._loader_batches = 0
        self._bytes = 0
        self._wait_s = 0.0
        self._rejoins = 0
        self._skipped = 0

        self._context = zmq.Context()
        self._client = ControlClient(self._context, self.endpoint.address, answer_wait)
        ring = None
        try:
            welcome = self._client.hello(batch_size)
            ring = _core.Ring.open(welcome["segment"])
            ring.bind(welcome["consumer"], welcome["token"])
            self.start_seq = self._client.ready()
        except BaseException:
            if ring is not None:
                ring.close()
            self._client.close(say_bye=ring is not None, wait=0.2)
            self._context.term()
            raise
        self._ring = ring
        self._segment: str = welcome["segment"]
        self._index: int = welcome["consumer"]
        self._length: int | None = welcome["length"]
        self.loader_batch_size: int | None = welcome["loader_batch_size"]
        self.samples_per_epoch: int | None = welcome["samples"]
        self._samples_exact: bool = welcome["samples_exact"]
        # What the producer's loader reads: its dataset's type name and length (or None).
        self.producer_dataset: str | None = welcome["dataset"]
        self.producer_dataset_len: int | None = welcome["dataset_len"]
        self.producer_pid: int = welcome["producer_pid"]
        self.window: int = welcome["window"]
        self.max_lag: int | None = welcome["max_lag"] or None
        self.lag_policy: str = welcome["lag_policy"]
        try:
            self._setup_device(ring)
        except BaseException:
            ring.close()
            self._client.close(say_bye=True, wait=0.2)
            self._context.term()
            raise
        self._client.start_heartbeats()
        self._finalizer = weakref.finalize(self, _teardown, self._client, self._context, ring,
                                           self._inflight)
        log.info("consumer %d attached to %s at entry %d", self._index, self.endpoint.address,
                 self.start_seq)
        if origins:
            log.info("consumer settings from the environment: %s",
                     config.describe_origins(origins))

    # -- device ------------------------------------------------------------------------

    def _setup_device(self, ring: Any) -> None:
        """Decide where tensors are delivered and open what that needs."""
        info = ring.info()
        gpu_ring = info["device_type"] == DL_CUDA
        kind, index = self._device_kind, self._device_index
        if kind == "cuda" and index is None:
            index = 0
        if kind == "cpu" or (kind == "auto" and not gpu_ring):
            self.device = "cpu"
        elif gpu_ring and (kind == "auto" or self.peer_access or _same_gpu(info, index)):
            try:
                ordinal = ring.import_device(None if kind == "auto" else index)
            except GPUUnavailable as e:
                self._fall_back(str(e), None if kind == "auto" else index)
            else:
                self._import = True
                self._cuda = torch.device("cuda", ordinal)
                self.device = str(self._cuda)
                return  # tensors come from GPU memory: nothing to page-lock
        else:
            # A host ring, or another GPU without peer access: copy from host memory.
            assert index is not None  # only kind "cuda" comes here, and it has one
            self._move_to = torch.device("cuda", index)
            self.device = str(self._move_to)
        if self.pin_memory:
            try:
                ring.pin_host(index or 0)
            except GPUUnavailable as e:
                raise GPUUnavailable(f"pin_memory=True needs a GPU: {e}") from None

    def _fall_back(self, reason: str, index: int | None) -> None:
        """CUDA IPC cannot work here: deliver through host memory instead."""
        self.device_fallback_reason = reason
        if index is not None:
            self._move_to = torch.device("cuda", index)
            self.device = str(self._move_to)
        where = f"copied to {self.device} by this consumer" if index is not None else \
            "delivered as host tensors"
        warnings.warn(f"tensorsocket: cannot read the producer's GPU ring here ({reason}); "
                      f"batches are {where}", GPUFallbackWarning, stacklevel=4)
        log.warning("GPU ring unavailable to this consumer: %s", reason)

    def _to_device(self, leaves: list, kinds: list) -> list:
        """Copy the torch leaves to self._move_to; hold the host views until the copies
        are done (the ring slot must not be reused under an asynchronous copy)."""
        moved, held = [], []
        for kind, leaf in zip(kinds, leaves, strict=True):
            if kind == TORCH:
                held.append(leaf)
                leaf = leaf.to(self._move_to, non_blocking=self.pin_memory)
            moved.append(leaf)
        if self.pin_memory and held:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._move_to))
            self._inflight.append((event, held))
        self._inflight[:] = [(e, h) for e, h in self._inflight if not e.query()]
        return moved

    # -- DataLoader protocol -----------------------------------------------------------

    def __len__(self) -> int:
        """Batches in one epoch of this consumer; TypeError if that is unknown (see the
        class docstring)."""
        if self._length is None:
            raise TypeError(
                "len() of this consumer is unknown: the producer's loader has no len() (a "
                "generator or an iterable without __len__, as a DataLoader over an "
                "IterableDataset without __len__); iterate without len(), or give the "
                "producer a loader with __len__"
            )
        if self.batch_size is None:
            return self._length
        if self.samples_per_epoch is None:
            raise TypeError(
                f"len() of this consumer is unknown: the producer's loader does not tell "
                f"its sample count (it is not a DataLoader and has no int batch_size), so "
                f"the number of batch_size={self.batch_size} batches per epoch is unknown"
            )
        return consumer_len(self.samples_per_epoch, self.batch_size, self.drop_last)

    def __iter__(self) -> "EpochIterator":
        """The next epoch (an earlier iterator still mid-epoch ends here)."""
        if self._closed:
            raise TensorSocketError("this consumer is closed")
        if self._in_epoch:  # an earlier iterator is still mid-epoch: it ends here
            self._abandon_epoch(self.epoch)
        self._in_epoch = True
        self._source_done = False
        self._epoch_pulled = 0
        self._epoch_batches = 0
        return EpochIterator(self)

    def _next_batch(self) -> Any:
        """The next batch of the current epoch; StopIteration at its end."""
        if not self._in_epoch:
            raise StopIteration
        try:
            if self._rebatcher is None:
                batch, n = self._pull()
                self._samples += n if n is not None else _samples_or_zero(batch)
            else:
                batch = self._rebatcher.next_batch(self._pull)
                self._samples += self._rebatcher.last_samples
        except EpochEnd:
            self._end_epoch()
            raise StopIteration from None
        if self.unpack_fn is not None:
            batch = self.unpack_fn(batch)
        index = self._epoch_batches
        self._epoch_batches += 1
        self._batches += 1
        return (index, batch) if self.with_index else batch

    def _end_epoch(self) -> None:
        self._in_epoch = False
        if self._rebatcher is not None:
            self._rebatcher.reset()
        self.epoch += 1

    def _abandon_epoch(self, epoch: int) -> None:
        """The epoch was left mid-way (break, or a new iteration): leave the ring at
        once, so that nobody waits for us; the next batch asked for attaches again,
        as a late joiner. Safe from a finalizer: it only sets events."""
        if self._closed or not self._in_epoch or self.epoch != epoch:
            return
        self._end_epoch()
        if self._attached:
            self._attached = False
            self._client.request_leave()

    # -- the loader batches of this consumer's epoch ----------------------------------

    def _pull(self) -> tuple[Any, int | None]:
        """The next loader batch of this consumer's epoch and its sample count if the
        loader tells; EpochEnd after its last."""
        while True:
            if self._source_done:
                raise EpochEnd
            slot = self._acquire()
            self._after_end_marker = slot.is_end_of_epoch
            if slot.is_end_of_epoch:
                epoch = slot.epoch
                slot.release()
                if self._epoch_end is not None and (epoch + 1, 0) >= self._epoch_end:
                    # The producer's epoch ended here (perhaps cut short): the next of
                    # ours starts with its next epoch, aligned with it from now on.
                    self._source_done = True
                    self._epoch_end = (epoch + 2, 0)
                    raise EpochEnd
                continue
            position = (slot.epoch, slot.index)
            if self._epoch_end is None:  # the first batch since we attached: anchor epochs
                self._epoch_end = (slot.epoch + 1, slot.index)
            self._epoch_pulled += 1
            self._loader_batches += 1
            self._bytes += slot.nbytes
            batch = self._build(slot)
            if (position[0], position[1] + 1) >= self._epoch_end:
                self._close_source()
            return batch, self._samples_in(position[1])

    def _samples_in(self, index: int) -> int | None:
        """Samples in loader batch `index` of an epoch, when the loader tells."""
        size, length = self.loader_batch_size, self._length
        if size is None or length is None:
            return None
        if index < length - 1:
            return size
        if self._samples_exact and self.samples_per_epoch is not None:
            return self.samples_per_epoch - (length - 1) * size
        return None

    def _close_source(self) -> None:
        """This epoch had its last loader batch; the next one ends a producer epoch later."""
        self._source_done = True
        assert self._epoch_end is not None
        self._epoch_end = (self._epoch_end[0] + 1, self._epoch_end[1])

    def _acquire(self) -> Any:
        """The next ring entry for us, with errors turned into what the caller needs."""
        if not self._attached:
            self._attach_again()
        while True:
            start = time.perf_counter()
            try:
                return self._acquire_slot()
            except ProducerFinished:
                if self._epoch_pulled > 0 and self._after_end_marker:
                    # A late joiner's epoch spans two producer epochs, and the producer
                    # stopped after the first of them. End the epoch with what came.
                    warnings.warn(
                        f"the producer finished in the middle of this consumer's epoch "
                        f"{self.epoch} (it joined late, so its epochs span two of the "
                        f"producer's); the epoch ends after {self._epoch_pulled} loader batches",
                        TensorSocketWarning, stacklevel=5)
                    self._source_done = True
                    raise EpochEnd from None
                self._in_epoch = False
                if self._epoch_pulled > 0:
                    raise ProducerFinished(
                        f"the producer stopped in the middle of its epoch, after this "
                        f"consumer's epoch {self.epoch} had received {self._epoch_pulled} "
                        "of the loader's batches; no more batches will come"
                    ) from None
                raise ProducerFinished(
                    f"the producer finished after {self.epoch} epoch(s) seen by this "
                    "consumer; no more batches will come"
                ) from None
            except ProducerGone as e:
                raise ProducerGone(
                    f"{e}: no more batches will come from {self.endpoint.address}") from None
            except ConsumerDetached as e:
                if self._closed:  # close() from another thread detached us first
                    raise TensorSocketError(
                        "the consumer was closed by another thread while this call waited"
                    ) from None
                if not self._lagged() or self.lag_policy != "rejoin":
                    raise ConsumerDetached(
                        f"{e}; create a new TensorConsumer to attach again") from None
                self._rejoin()
                if self._epoch_pulled > 0:
                    self._source_done = True
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
        own doing (see _held_slots_blocking)."""
        if self.batch_timeout is not None and self.batch_timeout <= STALL_WARN_AFTER:
            return self._ring.acquire(self.batch_timeout)
        try:
            return self._ring.acquire(STALL_WARN_AFTER)
        except TimeoutError:
            held = self._held_slots_blocking()
            if held:
                message = (
                    f"this consumer has waited {STALL_WARN_AFTER:.0f} s for its next batch, "
                    f"which the producer cannot publish: the ring slot it must reuse holds a "
                    f"batch this process received and still keeps alive ({held} of the "
                    f"ring's {self._ring.info()['slot_count']} slots are held so). Every "
                    "consumer of this producer waits until those batches are dropped. Kept "
                    "batches are e.g. list(consumer), a batch from next(iter(consumer)) kept "
                    "while the loop runs, or outputs that still reference a batch; drop them, "
                    "or take private copies: TensorConsumer(copy=True) or tensor.clone()")
                log.warning("%s", message)
                warnings.warn(message, TensorSocketWarning, stacklevel=6)
        remaining = None if self.batch_timeout is None else \
            self.batch_timeout - STALL_WARN_AFTER
        return self._ring.acquire(remaining)

    def _held_slots_blocking(self) -> int:
        """Slots this consumer holds (entries it took whose views are alive), if one of
        them is the slot the producer must reuse for its next entry; else 0."""
        info = self._ring.info()
        slots, published = info["slot_count"], info["published"]
        entry = self._ring.consumer(self._index)
        if entry["token"] != self._client.token or published == 0 or entry["cursor"] >= 1 << 63:
            return 0  # not ours any more, nothing published, nothing read yet, or detached
        me = 1 << self._index
        held = []
        for k, readers in enumerate(self._ring.slot_readers()):
            if k >= published or not readers & me:
                continue
            newest = published - 1 - (published - 1 - k) % slots  # the entry slot k holds
            if newest < entry["cursor"]:
                held.append(k)
        return len(held) if published % slots in held else 0

    def _lagged(self) -> bool:
        entry = self._ring.consumer(self._index)
        return entry["token"] == self._client.token and entry["reason"] == _core.REASON_LAGGED

    def _rejoin(self) -> None:
        """Attach again as a late joiner after the producer detached us for lagging."""
        old_cursor = self._ring.consumer(self._index)["cursor"]
        start = self._attach_again()
        skipped = max(0, start - old_cursor)
        self._rejoins += 1
        self._skipped += skipped
        ended = " The current epoch ends here." if self._epoch_pulled > 0 else ""
        message = (
            f"this consumer fell more than max_lag={self.max_lag} batches behind the fastest "
            f"consumer, was detached and attached again as a late joiner; it skipped {skipped} "
            f"ring entries.{ended}")
        log.warning("%s", message)
        warnings.warn(message, LagWarning, stacklevel=6)

    def _attach_again(self) -> int:
        """Take a new place in the same producer's ring (a late joiner); its first seq."""
        info = self._ring.info()
        if not _core.process_alive(info["producer_pid"], info["producer_start_time"]):
            self._in_epoch = False
            raise ProducerGone(
                f"the producer process (pid {info['producer_pid']}) is gone; no more batches "
                f"will come from {self.endpoint.address}")
        if info["state"] == _core.RING_FINISHED:
            self._in_epoch = False
            raise ProducerFinished(
                "the producer finished while this consumer was away from the ring (it had "
                "left its epoch, or was detached); no more batches will come")
        self._client.stop_heartbeats()
        welcome = self._client.hello(self.batch_size)
        if welcome["segment"] != self._segment:
            raise ConsumerDetached(
                "the producer that answered is a new one, not the one this consumer was "
                "attached to; create a new TensorConsumer to attach to it")
        self._ring.bind(welcome["consumer"], welcome["token"])
        self._index = welcome["consumer"]
        start = self._client.ready()
        self._client.start_heartbeats()
        self._attached = True
        self._epoch_end = None  # epochs are anchored again at the next batch
        log.info("consumer attached again as %d at entry %d", self._index, start)
        return start

    def _build(self, slot: Any) -> Any:
        """Turn a slot into the loader's batch structure of tensors and values."""
        build, kinds = self._decoder.compile(slot.meta)
        if self._import:
            leaves = self._device_leaves(slot, kinds)
        elif NUMPY not in kinds and NUMPY_SCALAR not in kinds:
            leaves = [torch.from_dlpack(c) for c in slot.capsules(versioned=True, copy=self.copy)]
        else:
            leaves = []
            for kind, view in zip(kinds, slot.views(), strict=True):
                if kind == TORCH:
                    leaves.append(torch.from_dlpack(view.__dlpack__(max_version=(1, 0),
                                                                    copy=self.copy or None)))
                else:
                    array = np.from_dlpack(view)
                    leaves.append(array.copy() if self.copy else array)
        slot.release()
        if self._move_to is not None:
            leaves = self._to_device(leaves, kinds)
        return build(leaves)

    def _device_leaves(self, slot: Any, kinds: list) -> list:
        """Torch leaves from the slot's GPU copy (zero-copy; ordered after the producer's
        copy on the current stream), numpy leaves from its host copy."""
        assert self._cuda is not None  # set when the GPU ring was imported
        if NUMPY not in kinds and NUMPY_SCALAR not in kinds:
            tensors = _device_tensors(slot, self._cuda)
            return [t.clone() for t in tensors] if self.copy else tensors
        device_views = slot.views(device=True)
        host_views = slot.views()  # numpy leaves come from the host copy
        leaves: list[Any] = []
        for i, kind in enumerate(kinds):
            if kind == TORCH:
                tensor = _device_tensor(device_views[i])
                leaves.append(tensor.clone() if self.copy else tensor)
            else:
                array = np.from_dlpack(host_views[i])
                leaves.append(array.copy() if self.copy else array)
        return leaves

    # -- end ---------------------------------------------------------------------------

    def close(self) -> None:
        """Leave: the producer stops sending to us. Tensors still held stay valid."""
        if self._closed:
            return
        self._closed = True
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
        not yet taken; rejoins / skipped_entries: re-attachments after being
        detached for lagging and the entries they skipped; dropped_samples:
        samples dropped by drop_last.
        """
        lag = None
        if not self._closed:
            lag = self._ring.consumer(self._index)["lag"]
        return {
            "epoch": self.epoch,
            "device": self.device,
            "zero_copy_gpu": self._import,
            "device_fallback_reason": self.device_fallback_reason,
            "batches": self._batches,
            "samples": self._samples,
            "loader_batches": self._loader_batches,
            "bytes": self._bytes,
            "wait_seconds": self._wait_s,
            "lag": lag,
            "rejoins": self._rejoins,
            "skipped_entries": self._skipped,
            "dropped_samples": self._rebatcher.dropped_samples if self._rebatcher else 0,
        }


class EpochIterator:
    """One epoch of a TensorConsumer. Keeps no reference to the batches it returned,
    so a batch's ring slot is released as soon as the caller drops it."""

    __slots__ = ("_consumer", "_epoch")

    def __init__(self, consumer: TensorConsumer) -> None:
        self._consumer = consumer
        self._epoch = consumer.epoch

    def __iter__(self) -> "EpochIterator":
        """The iterator itself."""
        return self

    def __next__(self) -> Any:
        """The next batch of this epoch; StopIteration at its end."""
        if self._consumer.epoch != self._epoch:
            raise StopIteration
        return self._consumer._next_batch()

    def close(self) -> None:
        """Leave this epoch now (as when the iterator is dropped mid-epoch)."""
        self._consumer._abandon_epoch(self._epoch)

    def __del__(self) -> None:
        """Dropped mid-epoch: leave the ring (see TensorConsumer)."""
        try:
            self._consumer._abandon_epoch(self._epoch)
        except Exception:  # never raise from a finalizer
            pass

    def __len__(self) -> int:
        """Batches in the whole epoch (as ``len(consumer)``)."""
        return len(self._consumer)


def _device_tensor(view: Any) -> torch.Tensor:
    """A torch tensor over a device SlotView; torch passes its current stream, which
    is made to wait for the producer's copy of the slot."""
    return torch.from_dlpack(view)


def _device_tensors(slot: Any, device: torch.device) -> list[torch.Tensor]:
    """Torch tensors over every leaf of a slot's GPU copy, all exported in one call with
    this thread's current stream on ``device`` (made to wait for the producer's copy),
    without torch.from_dlpack's per-view protocol calls."""
    caps = slot.capsules(versioned=True, device=True, stream=_stream_of(device))
    return [torch.from_dlpack(c) for c in caps]


# The raw handle of the current stream without building a torch.cuda.Stream (a private
# function torch's own generated code calls; the public way where it is missing).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream_of(device: torch.device) -> int:
    """The DLPack stream number of this thread's current stream on ``device``: its handle,
    or 1 for the legacy default stream (whose handle is 0, which DLPack forbids)."""
    if _raw_stream is not None:
        handle = _raw_stream(device.index)
    else:
        handle = torch.cuda.current_stream(device).cuda_stream
    return handle if handle != 0 else 1


def _same_gpu(info: dict, index: int | None) -> bool:
    """True if CUDA device index of this process is the GPU holding the ring's pool."""
    status = _core.cuda_status()
    for dev in status["devices"] or ():
        if dev["ordinal"] == index:
            return dev["uuid"] == info["device_uuid"]
    return False


def _teardown(client: ControlClient, context: zmq.Context, ring: Any, inflight: list) -> None:
    """Say bye, close the socket and drop our ring handle. If the producer died,
    the last one out removes its segment name (nobody else will)."""
    for event, _ in inflight:
        event.synchronize()  # asynchronous copies out of ring slots finish first
    inflight.clear()
    info = ring.info()
    producer_alive = _core.process_alive(info["producer_pid"], info["producer_start_time"])
    client.close(say_bye=producer_alive and info["state"] == _core.RING_OPEN)
    context.term()
    ring.close()
    if not producer_alive:
        _core.Ring.unlink_name(info["name"])


def _samples_or_zero(batch: Any) -> int:
    try:
        return batch_samples(batch)
    except ValueError:
        return 0
