"""TensorConsumer: iterate the producer's batches like a DataLoader, zero-copy.

The class is the public face; each job is a part it holds (this package, one file
each): its settings (options), its place in the ring (place: attach, park, attach
again, set aside), the waits for a ring entry (acquire), the batches of its epochs
(reader), the epoch and resume bookkeeping (book), the parking of this process's idle
consumers of other producers (siblings), and the DataLoader surface (surface)."""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..augment import TransformOptions, TransformStage
from ..config import UNSET, Unset
from ..data.epoch_cursor import InFlight
from ..data.resume import EpochTaken
from ..errors import TensorSocketError
from .acquire import SlotAcquirer
from .book import ResumeBook
from .counters import consumer_stats
from .epoch_state import EpochState
from .flow import BatchFlow
from .iterator import EpochIterator
from .options import ConsumerOptions, SharedLoader
from .place import RingPlace
from .reader import EpochReader
from .siblings import SIBLINGS, ParkingMember
from .surface import LoaderSurface, SamplerView

log = logging.getLogger("tensorsocket")


class TensorConsumer:
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
      shared: share()'s own (a SharedLoader: what it knows of its caller's loader);
        not for direct use.

    transform, seed, transform_workers, transform_prefetch, transform_input,
    transform_key, transform_context: each job's own transform of every sample it
    receives, seeded per (seed, epoch, sample id), in worker processes or at next():
    see tensorsocket.augment.TransformOptions and docs/usage.md ("A shared decode").
    """

    started_producer: bool = False
    """share(): True if this call started the producer process."""
    producer_log: Any = None
    """share(): the producer process's log file (a pathlib.Path), else None."""
    dataset: Any = None
    """share(): the caller's ``loader.dataset``, when its loader has one, else None."""

    def __init__(
        self, port: int | str | None = None, ack_port: int | str | None = None,
        heart_ports: Any = None, unpack_fn: Callable[[Any], Any] | None = None,
        batch_size: int | None = None, *, drop_last: bool = False, name: str | None = None,
        address: str | None = None, timeout: float | None | Unset = UNSET,
        batch_timeout: float | None | Unset = UNSET, copy: bool = False,
        with_index: bool = False, device: Any = UNSET, pin_memory: bool = False,
        peer_access: bool = True, align_epochs: bool = True, rank: int | None = None,
        world_size: int | None = None, group: str | None = None,
        auth_token: str | None = None, shared: SharedLoader | None = None,
        transform: Callable[[Any], Any] | None = None, seed: int | None = None,
        transform_workers: int = 0, transform_prefetch: int = 2, transform_input: str = "tensor",
        transform_key: Any = None, transform_context: str | None = None,
    ) -> None:
        transforms = TransformOptions.resolve(
            transform=transform, seed=seed, workers=transform_workers, key=transform_key,
            transform_input=transform_input, prefetch=transform_prefetch, context=transform_context)
        o = ConsumerOptions.resolve(
            port=port, address=address, name=name, timeout=timeout,
            batch_timeout=batch_timeout, device=device, batch_size=batch_size,
            drop_last=drop_last, copy=copy, with_index=with_index, pin_memory=pin_memory,
            peer_access=peer_access, align_epochs=align_epochs, rank=rank,
            world_size=world_size, group=group, auth_token=auth_token)
        self.endpoint = o.endpoint
        # Not `timeout`: training code reads that as DataLoader.timeout (a batch fetch limit).
        self.answer_timeout, self._options = o.answer_wait, o
        self.copy, self.pin_memory, self.peer_access = o.copy, o.pin_memory, o.peer_access
        self.align_epochs, self.group, self.rank = o.align_epochs, o.group, o.rank
        self.world_size = o.world_size
        self._place = place = RingPlace(o, InFlight())
        try:
            self._attach_parts(o, place, shared, unpack_fn,
                               TransformStage.of(transforms, lambda: place.ring))
            place.ready(None if shared is None else shared.before_ready)
        except BaseException:
            place.close()
            raise
        SIBLINGS.add(self._member)  # (parked by this process's other consumers from now)
        self.start_seq: int = place.start_seq
        log.info("consumer %d attached to %s at entry %d", place.index, o.endpoint.address,
                 place.start_seq)
        if o.origins:
            log.info("consumer settings from the environment: %s", o.origins)
        if shared is not None:
            self.started_producer, self.producer_log = shared.started_producer, shared.producer_log
            if hasattr(shared.loader, "dataset"):
                self.dataset = shared.loader.dataset
        self._surface = LoaderSurface(self._reader, self._book, self._state, o, place,
                                      shared, self._sets_epoch)

    @property
    def batch_timeout(self) -> float | None:
        """Seconds to wait for one batch (None: no limit); set it to change the next waits."""
        return self._options.batch_wait

    @batch_timeout.setter
    def batch_timeout(self, seconds: float | None) -> None:
        self._options.batch_wait = seconds

    @property
    def unpack_fn(self) -> Callable[[Any], Any] | None:
        """The function applied to each batch before it is returned (None: none)."""
        return self._flow.unpack_fn

    @property
    def with_index(self) -> bool:
        """Whether next() returns (batch_index, batch) pairs."""
        return self._flow.with_index

    def _attach_parts(self, o: ConsumerOptions, place: RingPlace, shared: SharedLoader | None,
                      unpack_fn: Callable[[Any], Any] | None,
                      stage: TransformStage | None) -> None:
        """Make the parts of a consumer attached at `place`, and the producer's facts it
        told on attach (public attributes)."""
        w = place.welcome
        self._state = state = EpochState(place.cursor, place.flow, EpochTaken(
            o.world_size, o.batch_size), o.rebatcher)
        self._member = ParkingMember(place, state, o.world_size)
        self._acquirer = SlotAcquirer(place, state, self._member, o)
        self._reader = EpochReader(place, state, self._acquirer, self._member, o)
        self._book = ResumeBook(place, state, self._reader, self._acquirer, o,
                                shared.drop_last if shared is not None else False)
        self._flow = BatchFlow(place, state, self._reader, self._acquirer, self._book, stage,
                               o, unpack_fn)
        self._book.count_in_flight(self._flow.undelivered)
        self.loader_batch_size: int | None = w.loader_batch_size
        self.samples_per_epoch: int | None = w.samples
        # What the producer's loader reads: its dataset's type name and length (or None).
        self.producer_dataset: str | None = w.dataset
        self.producer_dataset_len: int | None = w.dataset_len
        self.producer_pid: int = w.producer_pid
        self.window, self.max_lag = w.window, w.max_lag or None  # (int, int | None)
        self.lag_policy: str = w.lag_policy
        self.producer_fingerprint: str | None = w.fingerprint
        self._sets_epoch: bool = w.auto_set_epoch  # the producer calls set_epoch itself

    @property
    def device(self) -> str:
        """Where tensors are delivered: ``"cpu"``, or ``"cuda:N"``."""
        return self._place.delivery.device

    @property
    def device_fallback_reason(self) -> str | None:
        """Why the producer's GPU ring is read through host memory here (None: it is not)."""
        return self._place.delivery.fallback_reason

    @property
    def drop_last(self) -> bool:
        """Whether a short last batch is dropped: this consumer's drop_last= when it cuts
        its own batches, else the loader's (share() knows it from the caller's loader)."""
        return self._surface.drop_last

    @property
    def batch_size(self) -> int | None:
        """Samples per batch, as DataLoader.batch_size: the batch_size= asked for, else
        the producer's loader's (None if it has none)."""
        return self._reader.batch_size

    # -- DataLoader protocol -----------------------------------------------------------

    def __len__(self) -> int:
        """Batches in one epoch of this consumer; TypeError if that is unknown (see the
        class docstring)."""
        return self._reader.length()

    def __iter__(self) -> EpochIterator:
        """The next epoch (an earlier iterator still mid-epoch ends here)."""
        self._place.check_process()
        if self._place.closed:
            raise TensorSocketError("this consumer is closed")
        epoch, serial = self._flow.begin_epoch()
        return EpochIterator(self._flow, epoch, serial)

    @property
    def epoch(self) -> int:
        """Epochs this consumer completed (the number of the one it iterates, or next)."""
        return self._state.cursor.epoch

    @property
    def sampler(self) -> SamplerView:
        """The sampling of this consumer's batches; ``set_epoch`` is accepted (see
        SamplerView)."""
        return self._surface.sampler(batches=False)

    @property
    def batch_sampler(self) -> SamplerView:
        """The batch-level view of the sampling, with ``batch_size`` and ``drop_last``."""
        return self._surface.sampler(batches=True)

    @property
    def num_workers(self) -> int:
        """The caller's loader's ``num_workers`` (share()), else 0: this process runs no
        loader worker; the producer does the loading."""
        return self._surface.num_workers

    def set_epoch(self, epoch: int) -> None:
        """As ``loader.sampler.set_epoch``: the shared producer orders the samples (a
        number below the last one warns once: see LoaderSurface.note_set_epoch)."""
        self._surface.note_set_epoch(epoch)

    def state_dict(self) -> dict:
        """Where this consumer is, for resuming (torchdata StatefulDataLoader convention):
        epochs completed, batches delivered of the current one and which samples of it were
        taken (in a group: by the group). After a ``break``, the epoch left, until the next
        begins; right after load_state_dict(), the place loaded. JSON-serialisable
        (docs/usage.md, "Checkpoints and restarts")."""
        return self._surface.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume from state_dict(): the epoch counter is restored and the next epoch
        yields exactly the samples of the interrupted one not taken yet, cut into batches of
        this consumer's batch size (in a group, each rank its part, the same number of
        batches on every rank), then whole epochs. Its samples come from the producer's
        batches as they are published: it may read up to one producer epoch to find them
        all. A producer that does not tell the samples of its batches (a loader without a
        sampler) resumes by count instead: the next epoch skips the batches taken, with a
        warning. An empty dict is ignored, as StatefulDataLoader ignores it."""
        self._surface.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        """Attributes of the caller's own loader (share()) that a consumer lacks, e.g. a
        framework's loader flags; AttributeError naming both otherwise."""
        surface = self.__dict__.get("_surface")
        if name.startswith("_") or surface is None:
            raise AttributeError(name)
        return surface.loader_attribute(type(self).__name__, name)

    # -- end ---------------------------------------------------------------------------

    def close(self) -> None:
        """Leave: the producer stops sending to us. Tensors still held stay valid."""
        self._flow.close()
        self._place.close()

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
        return self._place.ring

    def stats(self) -> dict:
        """Counters of this consumer.

        batches / samples: delivered so far; loader_batches and bytes: ring entries taken
        (bytes of tensor data and structure); wait_seconds: time spent waiting for batches;
        lag: batches (ring entries) published but not yet taken (the end marker of an epoch
        that ended with its last batch is no batch: a finished epoch leaves lag 0); rejoins
        / skipped_entries: re-attachments after being detached for lagging and the entries
        they skipped; dropped_samples: samples dropped by drop_last; copied_kept_batches:
        batches still alive that were copied privately so that the consumer never waits for
        their slots; cache_*: the producer's decoded-sample cache (counters.producer_cache).
        With transform=, also transform_seconds, transform_wait_seconds, transform_workers
        and transform_seed (see tensorsocket.augment.TransformStage.stats).
        """
        return consumer_stats(self, self._place, self._state, self._acquirer,
                              self._flow.stage)

