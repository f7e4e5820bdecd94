"""TensorProducer: runs a data loader once and publishes every batch to the ring.

The class composes one part per job (see the package's docstring): the settings, the
ring's sizing and making, the loader's epochs, the gate that waits for consumers, the
publisher of an epoch, and the lifecycle (name lock, control server, teardown).
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable, Iterable, Iterator

from ..config import UNSET, Unset
from ..control.producer_files import OwnedFiles
from ..errors import TensorSocketError
from .epochs import LoaderEpochs
from .gate import ConsumerGate
from .lifecycle import ProducerLifecycle, ProducerState
from .listings import EpochPlanner
from .publisher import EpochPublisher, collected_welcome, welcome_info
from .ring_maker import RingMaker
from .settings import ProducerSettings, setting
from .sizing import RingSizing
from .stats import producer_stats

log = logging.getLogger("tensorsocket")


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
      cache_bytes: bytes of memory the producer may keep the decoded samples of
        a torch DataLoader in (default 0: off) (env). At the first batch, if the
        loader batches a map-style dataset with len() (a batch sampler, sample ids
        known) and every tensor of the batch holds one row per sample, the cache
        of the whole dataset is made when it fits in cache_bytes and in what the
        machine and the producer's memory cgroups leave, less a margin (else a
        warning names the bytes it needs and nothing is cached). The first epoch
        fills it as the loader runs (the few samples an epoch did not draw, drop_last's
        tail, are loaded once at the next epoch's start); once every sample is
        in it, each later epoch is built from it: the sampler's batches of that epoch (set_epoch applied), their
        rows gathered, published with their sample ids, without running the
        loader (no decoding, no workers). The memory is one memfd, which the
        kernel frees when the producer ends, SIGKILL included; a later batch of
        another shape or structure drops the cache (a warning says why), and so
        do a few samples loaded again in the producer before each cached epoch
        that are not the bytes cached (a dataset drawing random numbers in
        __getitem__). See tensorsocket/producer/sample_cache.py.
    """

    def __init__(
        self, data_loader: Iterable | Callable[..., Iterable], port: int | str | None = None,
        ack_port: int | str | None = None, heart_ports: Any = None,
        rubber_band_pct: float | None = None, pack_fn: Callable[[Any], Any] | None = None,
        consumer_max_buffer_size: int | None = None, producer_batch_size: int = 8, *,
        name: str | None = None, address: str | None = None,
        min_consumers: int | Unset = UNSET, start_timeout: float | None | Unset = UNSET,
        start_grace: float | Unset = UNSET, park_hold: float | Unset = UNSET,
        heartbeat_timeout: float | None | Unset = UNSET, auth_token: str | None = None,
        ring_slots: int | None | Unset = UNSET, slot_bytes: int | None | Unset = UNSET,
        ring_bytes: int | None | Unset = UNSET, max_leaves: int | None = None,
        publish_timeout: float | None | Unset = UNSET, rubber_band: int | None = None,
        max_lag: int | None | Unset = UNSET, lag_policy: str | Unset = UNSET,
        device: Any = UNSET, device_fallback: bool | Unset = UNSET,
        release_timeout: float | None | Unset = UNSET, worker_heap_pad: int | Unset = UNSET,
        cache_bytes: int | str | Unset = UNSET,
    ) -> None:
        epochs = self._epochs = LoaderEpochs(data_loader)
        settings = self._settings = ProducerSettings(
            name=name, port=port, address=address, auth_token=auth_token,
            min_consumers=min_consumers, start_timeout=start_timeout, start_grace=start_grace,
            park_hold=park_hold, heartbeat_timeout=heartbeat_timeout, ring_slots=ring_slots,
            consumer_max_buffer_size=consumer_max_buffer_size, slot_bytes=slot_bytes,
            ring_bytes=ring_bytes, max_leaves=max_leaves, publish_timeout=publish_timeout,
            rubber_band_pct=rubber_band_pct, rubber_band=rubber_band, max_lag=max_lag,
            lag_policy=lag_policy, device=device, device_fallback=device_fallback,
            release_timeout=release_timeout, worker_heap_pad=worker_heap_pad,
            cache_bytes=cache_bytes, pack_fn=pack_fn)
        self.producer_batch_size = producer_batch_size
        sizing = self._sizing = RingSizing(settings, epochs.length())
        files = OwnedFiles(settings.endpoint)
        rings = self._rings = RingMaker(settings, sizing, files)
        state = self._state = ProducerState()
        welcome = functools.partial(_welcome, weakref.ref(self))
        listings = EpochPlanner()  # each epoch's order in full, for consumers that ask
        self._lifecycle = ProducerLifecycle(self, settings, files, state, welcome, listings)
        self._server = self._lifecycle.server
        self.auth_token: str | None = self._lifecycle.secret
        self._gate = ConsumerGate(settings, self._server.consumer_count)
        self._publisher = EpochPublisher(settings, epochs, rings, self._gate, state, listings)

    # -- settings (read and written through; see the class docstring) -------------------

    endpoint = setting("endpoint", "Where consumers find this producer: name, address.")
    min_consumers = setting("min_consumers", "Consumers to wait for before batch 0.")
    start_timeout = setting("start_timeout", "Seconds to wait for consumers (None: forever).")
    start_grace = setting("start_grace", "Seconds to wait more before batch 0.")
    park_hold = setting("park_hold", "Seconds a parked consumer keeps its place.")
    heartbeat_timeout = setting("heartbeat_timeout", "Seconds of silence to evict after.")
    publish_timeout = setting("publish_timeout", "Seconds to wait for a free slot.")
    max_lag = setting("max_lag", "Batches a consumer may fall behind (None: lossless).")
    lag_policy = setting("lag_policy", "What a detached laggard does: raise or rejoin.")
    rubber_band_pct = setting("rubber_band_pct", "The late-joiner window, of an epoch.")
    rubber_band = setting("rubber_band", "The late-joiner window in batches, if given.")
    device = setting("device", "The ring's device: 'cuda:N', or 'cpu' (also on fallback).")
    device_fallback = setting("device_fallback", "Whether a GPU ring may fall back to host.")
    release_timeout = setting("release_timeout", "Seconds close() waits for GPU memory.")
    worker_heap_pad = setting("worker_heap_pad", "Bytes a loader worker keeps on its heap.")
    cache_bytes = setting("cache_bytes", "Bytes the decoded-sample cache may take (0: off), "
                          "read at the first batch.")
    pack_fn = setting("pack_fn", "Applied to each batch before it is published (or None).")

    @property
    def device_fallback_reason(self) -> str | None:
        """Why the GPU ring fell back to the host ring (None where it did not)."""
        return self._rings.fallback_reason

    @property
    def window(self) -> int:
        """The late-joiner window in batches (known once the epoch's length is)."""
        return self._sizing.window

    @property
    def epoch(self) -> int:
        """The epoch running, or the next one between epochs (set it between epochs: the
        number the next epoch is published under and passes to the sampler's set_epoch)."""
        return self._epochs.epoch

    @epoch.setter
    def epoch(self, number: int) -> None:
        self._epochs.epoch = number

    @property
    def data_loader(self) -> Iterable | Callable[..., Iterable]:
        """What yields the batches, as given (see the class docstring)."""
        return self._epochs.loader

    @data_loader.setter
    def data_loader(self, loader: Iterable | Callable[..., Iterable]) -> None:
        self._epochs.loader = loader

    def __len__(self) -> int:
        """Batches per epoch of the loader; TypeError if it has no len() (a generator,
        an iterable without ``__len__``, or a callable before its first epoch)."""
        return self._epochs.known_length()

    # -- iteration -------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        """One epoch: run the loader, publishing each batch before yielding it."""
        if self._state.closed:
            raise TensorSocketError("this producer was joined or closed")
        return self._publisher.run_epoch()

    # -- end ------------------------------------------------------------------------

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the consumers have read everything published, then tear down.

        Returns False if the timeout passed first (teardown happens anyway).
        """
        if self._state.closed:
            return True
        drained = True
        if self.ring is not None:
            drained = self.ring.wait_drained(timeout)
            if not drained:
                log.warning("join(): consumers did not read everything within %s s", timeout)
        self.close()
        return drained

    def close(self) -> None:
        """Tear down now: consumers see the ring finished; segment, sockets and the
        decoded-sample cache go."""
        self._lifecycle.close()
        self._publisher.cache.close()

    def __enter__(self) -> "TensorProducer":
        """The producer itself."""
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """join() if the block ended normally, else close() at once, telling the
        consumers that the producer failed and why (ProducerFailed)."""
        if exc_type is None:
            self.join()
        else:
            self._state.note_failure(exc)
            self.close()

    # -- introspection --------------------------------------------------------------

    def consumers_present(self) -> int:
        """Consumers of this producer: attached, or parked between epochs (they attach
        again when they next iterate)."""
        return 0 if self._state.closed else self._server.present_count()

    @property
    def ring(self) -> Any:
        """The C ring handle (None before the first batch)."""
        return self._state.ring

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
        tensorsocket.control.auth (another user, another pid, no or a wrong secret);
        cache_bytes: bytes of the decoded-sample cache (``cache_bytes=``) allocated now
        (0: none, dropped, or the producer closed); cache_samples: samples whose rows are in it;
        cache_epochs: epochs served from it; cache_off: why there is no cache
        ("not made: ..." or "dropped: ...", as the warning said; None while there is one,
        before the first batch, or with cache_bytes=0).
        """
        return producer_stats(
            self.ring, self._server, self._state.closed, epoch=self.epoch,
            device=self.device, batches=self._publisher.batches,
            consumer_wait_seconds=self._gate.wait_seconds, window=self.window,
            max_lag=self.max_lag, cache=self._publisher.cache.stats())


def _welcome(producer_ref: "weakref.ref[TensorProducer]") -> dict:
    """Handshake fields for the control thread (which holds no reference to the producer),
    or placeholders if the producer is being collected."""
    producer = producer_ref()
    if producer is None:
        return collected_welcome()
    return welcome_info(producer._settings, producer._epochs, producer._sizing,
                        producer._rings)
