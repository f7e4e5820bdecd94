"""An epoch run: the loader's batches encoded (with the dataset indices the sampler drew),
the ring made at the first one, each published once consumers are there, then yielded;
the epoch ends with a marker, also when it is cut short. An epoch of a DataLoader whose
samples are all in the decoded-sample cache (cache_bytes=) is built from it instead
(sample_cache.CachedEpochs)."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterator

from ..data.sample_ids import SampleIdRecorder, with_ids
from ..data.structure import Encoder
from ..errors import BatchTooLarge
from ..ring import RingInfo
from ..loader.loader_info import describe_loader
from .epochs import LoaderEpochs
from .gate import ConsumerGate
from .lifecycle import ProducerState
from .listings import EpochPlanner
from .ring_maker import RingMaker
from .sample_cache import CachedBatch, CachedEpochs
from .settings import ProducerSettings
from .sizing import RingSizing


# The publishing CPU is measured on one batch in CPU_SAMPLE_STRIDE, counted for all of
# them (batches 1, 1 + CPU_SAMPLE_STRIDE, ...; the first batch, which walks the structure,
# is measured and counted on its own): a thread CPU clock read is a system call (about
# 0.6 us here), two a batch cost more than a tiny batch's whole publish.
CPU_SAMPLE_STRIDE = 16


class EpochPublisher:
    """Runs the loader's epochs into the ring; ``batches`` counts the batches published."""

    def __init__(self, settings: ProducerSettings, epochs: LoaderEpochs, rings: RingMaker,
                 gate: ConsumerGate, state: ProducerState, listings: EpochPlanner) -> None:
        """Nothing published yet; the ring is made at the first batch. listings: where
        each epoch's order is listed (shared with the control thread, which reads it)."""
        self._settings = settings
        self._epochs = epochs
        self._rings = rings
        self._gate = gate
        self._state = state
        self.batches = 0
        self._encoder = Encoder()  # batch -> spec and leaves (keeps the last spec's bytes)
        self.listings = listings
        self._sample_ids = SampleIdRecorder(self.listings.items)  # each batch's indices
        self.cache = CachedEpochs(settings)  # the decoded samples, if cache_bytes= allows
        # This process's CPU before its loader's first epoch began (imports, set-up), noted
        # in the ring header when the ring is made: status leaves it out of the loader's.
        self._setup_cpu_ns: int | None = None

    def run_epoch(self) -> Iterator[Any]:
        """One epoch: run the loader, publishing each batch before yielding it. An error
        is noted for the consumers (told when the producer closes); a whole epoch that ran
        after an earlier failure clears it."""
        try:
            yield from self._publish_epoch()
        except GeneratorExit:
            raise
        except BaseException as e:
            self._state.note_failure(e)
            raise
        self._state.failure = None

    def _publish_epoch(self) -> Iterator[Any]:
        """run_epoch, without the failure's note."""
        if self._setup_cpu_ns is None:  # as status counts it: this process and its reaped
            t = os.times()  # children (/proc/<pid>/stat utime, stime, cutime, cstime)
            self._setup_cpu_ns = int((t.user + t.system + t.children_user
                                      + t.children_system) * 1e9)
        with self.listings.lock:  # (its sampler's epoch is set for the epoch's listing)
            source, limit = self._epochs.start()
            self.listings.begin(source, self._epochs.epoch, self._sample_ids.sampler_of(source),
                                next_too=source is self._epochs.loader)
        if self.cache.start(source, self._epochs.epoch):
            batches = self.cache.batches(source, self.listings.items)
            yield from self._publish_each(source, limit, batches, False, self._publish_cached)
            return
        # The sampler records the indices it draws for the whole epoch: a loader whose
        # __iter__ is a generator (a DataLoader subclass such as accelerate's
        # DataLoaderShard) draws them only at its first next().
        with self._sample_ids.recording(source):
            yield from self._publish_recorded_epoch(source, limit)

    def _publish_recorded_epoch(self, source: Any, limit: int | None) -> Iterator[Any]:
        """_publish_epoch, while the sampler of `source` records the indices it draws."""
        it = self._epochs.iterate(source, self._settings.worker_heap_pad)
        # one_shot: an iterator, which iterating again continues
        yield from self._publish_each(source, limit, it, it is source, self._publish_batch)

    def _publish_each(self, source: Any, limit: int | None, it: Iterator[Any],
                      one_shot: bool, publish: Callable[[Any, int], Any]) -> Iterator[Any]:
        """Publish each item of `it`, an epoch of `source` (publish(item, index) returns
        the batch to yield), and the epoch's end marker."""
        epochs = self._epochs
        index = 0
        try:
            for item in it:
                if limit is not None and index >= limit:
                    # len() says the epoch is over, yet the loader goes on (a loader that
                    # never stops, as the original TensorSocket's examples have): end it.
                    epochs.warn_cut(source, limit)
                    break
                batch = publish(item, index)
                index += 1
                if one_shot:
                    epochs.yielded(source)
                yield batch
        except GeneratorExit:
            # An epoch cut short (break) still ends with a marker: consumers never hang.
            self._end_epoch(index)
            raise
        if index == 0:
            epochs.ended_empty(source, one_shot)
        self._end_epoch(index)

    def _publish_batch(self, batch: Any, index: int) -> Any:
        """Encode batch `index` of the epoch, make the ring at the first, wait for
        consumers, publish, offer it to the cache; the thread's CPU time for it goes to
        the ring header (measured on one batch in CPU_SAMPLE_STRIDE, counted for each),
        where `tensorsocket status` tells it from the loader's (the C publish cannot see
        the encoding done here; waits for consumers or slots sleep, costing no CPU).
        Returns the batch (as the loader yielded it)."""
        weight = 1 if self.batches == 0 else \
            CPU_SAMPLE_STRIDE if self.batches % CPU_SAMPLE_STRIDE == 1 else 0
        start = time.thread_time_ns() if weight else 0
        packed = batch if self._settings.pack_fn is None else self._settings.pack_fn(batch)
        structure, leaves = self._encoder.flatten(packed, capsules=not self.cache.reads_leaves)
        ids = self._sample_ids.next_ids()
        meta = with_ids(structure, ids)
        if self._state.ring is None:  # making it (sized to its slots) is set-up too
            made = time.thread_time_ns()
            self._state.ring = self._rings.make(meta, leaves, self._epochs.length())
            making = time.thread_time_ns() - made
            self._state.ring.note_setup_cpu((self._setup_cpu_ns or 0) + making)
            start += making
        self._gate.wait(self._state.ring, first=self.batches == 0)
        self._publish(meta, leaves, index=index)
        self.cache.offer(structure, leaves, ids, self._epochs.epoch)
        self.cache.note_in(self._state.ring)
        if weight:
            self._state.ring.note_publish_cpu((time.thread_time_ns() - start) * weight)
        return batch

    def _publish_cached(self, cached: CachedBatch, index: int) -> Any:
        """Publish batch `index` of an epoch served from the cache (the ring exists: the
        first epoch made it); returns the batch for the producer's loop."""
        start = time.thread_time_ns()
        self._gate.wait(self._state.ring, first=False)
        self._publish(with_ids(cached.structure, cached.ids), cached.leaves, index=index)
        self.cache.note_in(self._state.ring)
        self._state.ring.note_publish_cpu(time.thread_time_ns() - start)
        return cached.batch

    def _publish(self, meta: bytes, leaves: list, *, end: bool = False, index: int = 0) -> None:
        """Publish a batch (or the end marker), waiting up to publish_timeout for a slot."""
        epoch, timeout = self._epochs.epoch, self._settings.publish_timeout
        try:
            self._state.ring.publish(leaves, meta, end_of_epoch=end, epoch=epoch, index=index,
                                     timeout=timeout)
        except BatchTooLarge as e:
            raise BatchTooLarge(
                f"{e}. Batch {index} of epoch {epoch} is larger than the ring's slots, "
                "which were sized from the first batch: pass slot_bytes= (bytes per batch) to "
                "TensorProducer. Nothing was published."
            ) from None
        except TimeoutError:
            raise TimeoutError(
                f"no ring slot became free within publish_timeout={timeout} s: "
                "a consumer holds its batches (or stopped reading)"
            ) from None
        if not end:
            self.batches += 1
            if index == 0:
                self.listings.published(RingInfo.of(self._state.ring).published - 1)

    def _end_epoch(self, index: int) -> None:
        """Publish the end-of-epoch marker after `index` batches."""
        if index == 0:
            return
        if self._state.ring is not None and not self._state.closed:
            self._publish(b"", [], end=True, index=index)
        self._epochs.epoch += 1


def welcome_info(settings: ProducerSettings, epochs: LoaderEpochs, sizing: RingSizing,
                 rings: RingMaker) -> dict:
    """Handshake fields for a consumer (sent once the ring exists, so the first epoch has
    started and a callable's loader of it is known)."""
    return {
        **describe_loader(epochs.current),
        "segment": rings.segment,
        "epoch": epochs.epoch,
        "producer_pid": os.getpid(),
        "window": sizing.window,
        "max_lag": settings.max_lag or 0,
        "lag_policy": settings.lag_policy,
        "auto_set_epoch": epochs.sets_epoch,
    }


def collected_welcome() -> dict:
    """Handshake fields of a producer being collected: placeholders."""
    return {"segment": "", "length": None, "loader_batch_size": None, "samples": None,
            "samples_exact": False, "dataset": None, "dataset_len": None,
            "epoch": 0, "producer_pid": os.getpid(), "window": 0, "max_lag": 0,
            "lag_policy": "raise", "fingerprint": None, "auto_set_epoch": False}
