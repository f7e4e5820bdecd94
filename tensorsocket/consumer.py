"""TensorConsumer: iterate the producer's batches like a DataLoader, zero-copy."""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import numpy as np
import torch
import zmq

from . import _core
from .control import ControlClient
from .endpoints import resolve
from .errors import ConsumerDetached, ProducerFinished, ProducerGone, TensorSocketError
from .structure import NUMPY, NUMPY_SCALAR, TORCH, Decoder

log = logging.getLogger("tensorsocket")

DEFAULT_TIMEOUT = 60.0


class TensorConsumer:
    """Receive the batches of a TensorProducer; a drop-in for a DataLoader.

    ``for batch in consumer:`` is one epoch and ends with StopIteration;
    iterating again gives the next epoch. ``len(consumer)`` is the loader's
    length. Batches keep the loader's structure; tensors are zero-copy,
    read-only views of the shared ring (in-place ops on them are not allowed:
    pass ``copy=True`` for private writable copies, or ``.clone()``). A batch
    holds its ring slot for as long as any tensor (or slice of one) from it is
    alive.

    Positional parameters follow the original TensorSocket
    (``port, ack_port, heart_ports, unpack_fn, batch_size``). When ``port`` is
    given the consumer yields ``(batch_index, batch)`` pairs like the original
    did (override with ``with_index=``). ``batch_size=None`` means the
    loader's own batch size.

    Keyword-only:
      name / address: rendezvous, as for TensorProducer.
      timeout: seconds to wait for the producer to answer (default 60); then
        ProducerNotFound.
      batch_timeout: seconds to wait for one batch (None: as long as the
        producer lives); then TimeoutError.
      copy: deliver private, writable copies instead of views.
      with_index: yield (batch_index, batch) pairs.
    """

    def __init__(
        self,
        port: int | str | None = None,
        ack_port: int | str | None = None,
        heart_ports: Any = None,
        unpack_fn: Callable[[Any], Any] | None = None,
        batch_size: int | None = None,
        *,
        name: str | None = None,
        address: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        batch_timeout: float | None = None,
        copy: bool = False,
        with_index: bool | None = None,
    ) -> None:
        if batch_size is not None:
            raise NotImplementedError(
                f"batch_size={batch_size}: per-consumer batch sizes are not supported yet; "
                "use batch_size=None to receive the loader's own batches"
            )
        self.unpack_fn = unpack_fn
        self.batch_size = batch_size
        self.batch_timeout = batch_timeout
        self.copy = bool(copy)
        self.with_index = (port is not None) if with_index is None else bool(with_index)
        self.endpoint = resolve(name, port, address)
        self.epoch = 0
        self._decoder = Decoder()
        self._in_epoch = False
        self._closed = False
        self._batches = 0

        self._context = zmq.Context()
        self._client = ControlClient(self._context, self.endpoint.address, timeout)
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
        self._length: int | None = welcome["length"]
        self.loader_batch_size: int | None = welcome["loader_batch_size"]
        self.producer_pid: int = welcome["producer_pid"]
        self._client.start_heartbeats()
        self._finalizer = weakref.finalize(self, _teardown, self._client, self._context, ring)
        log.info("consumer %d attached to %s", welcome["consumer"], self.endpoint.address)

    # -- DataLoader protocol -----------------------------------------------------------

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("the producer's loader has no len()")
        return self._length

    def __iter__(self) -> "EpochIterator":
        if self._closed:
            raise TensorSocketError("this consumer is closed")
        if self._in_epoch:
            self._skip_rest_of_epoch()
        self._in_epoch = True
        return EpochIterator(self)

    def _next_batch(self) -> Any:
        """The next batch of the current epoch; StopIteration at its end."""
        if not self._in_epoch:
            raise StopIteration
        slot = self._acquire()
        if slot.is_end_of_epoch:
            slot.release()
            self._in_epoch = False
            self.epoch += 1
            raise StopIteration
        index = slot.index
        batch = self._build(slot)
        self._batches += 1
        return (index, batch) if self.with_index else batch

    def _acquire(self) -> Any:
        try:
            return self._ring.acquire(self.batch_timeout)
        except ProducerFinished:
            self._in_epoch = False
            raise ProducerFinished(
                f"the producer finished after {self.epoch} epoch(s) seen by this consumer; "
                "no more batches will come"
            ) from None
        except ProducerGone as e:
            raise ProducerGone(f"{e}: no more batches will come from {self.endpoint.address}") \
                from None
        except ConsumerDetached as e:
            raise ConsumerDetached(f"{e}; create a new TensorConsumer to attach again") from None
        except TimeoutError:
            raise TimeoutError(
                f"no batch within batch_timeout={self.batch_timeout} s from "
                f"{self.endpoint.address}"
            ) from None

    def _skip_rest_of_epoch(self) -> None:
        """A new epoch was asked for mid-epoch: drop the old epoch's remaining batches."""
        while True:
            slot = self._acquire()
            end = slot.is_end_of_epoch
            slot.release()
            if end:
                self.epoch += 1
                self._in_epoch = False
                return

    def _build(self, slot: Any) -> Any:
        """Turn a slot into the loader's batch structure of tensors and values."""
        build, kinds = self._decoder.compile(slot.meta)
        if NUMPY not in kinds and NUMPY_SCALAR not in kinds:
            leaves = [torch.from_dlpack(c) for c in slot.capsules(versioned=True, copy=self.copy)]
        else:
            leaves = []
            for kind, view in zip(kinds, slot.views()):
                if kind == TORCH:
                    leaves.append(torch.from_dlpack(view.__dlpack__(max_version=(1, 0),
                                                                    copy=self.copy or None)))
                else:
                    array = np.from_dlpack(view)
                    leaves.append(array.copy() if self.copy else array)
        slot.release()
        batch = build(leaves)
        if self.unpack_fn is not None:
            batch = self.unpack_fn(batch)
        return batch

    # -- end ---------------------------------------------------------------------------

    def close(self) -> None:
        """Leave: the producer stops sending to us. Tensors still held stay valid."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    def __enter__(self) -> "TensorConsumer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- introspection -----------------------------------------------------------------

    @property
    def ring(self) -> Any:
        """The C ring handle of this consumer."""
        return self._ring

    def stats(self) -> dict:
        """Counters of this consumer."""
        return {"epoch": self.epoch, "batches": self._batches}


class EpochIterator:
    """One epoch of a TensorConsumer. Keeps no reference to the batches it returned,
    so a batch's ring slot is released as soon as the caller drops it."""

    __slots__ = ("_consumer", "_epoch")

    def __init__(self, consumer: TensorConsumer) -> None:
        self._consumer = consumer
        self._epoch = consumer.epoch

    def __iter__(self) -> "EpochIterator":
        return self

    def __next__(self) -> Any:
        if self._consumer.epoch != self._epoch:
            raise StopIteration
        return self._consumer._next_batch()

    def __len__(self) -> int:
        return len(self._consumer)


def _teardown(client: ControlClient, context: zmq.Context, ring: Any) -> None:
    """Say bye, close the socket and drop our ring handle. If the producer died,
    the last one out removes its segment name (nobody else will)."""
    info = ring.info()
    producer_alive = _core.process_alive(info["producer_pid"], info["producer_start_time"])
    client.close(say_bye=producer_alive and info["state"] == _core.RING_OPEN)
    context.term()
    ring.close()
    if not producer_alive:
        _core.Ring.unlink_name(info["name"])
