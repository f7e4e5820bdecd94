"""A GPU ring's device memory is freed only once no consumer process maps it: the wait for
that at close (release_timeout), and the keeper thread that frees the memory of closed
producers' rings later, when the last consumer closed or died."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any
from ..ring import DeviceType, RingInfo


log = logging.getLogger("tensorsocket")


def wait_gpu_released(ring: Any, timeout: float | None) -> None:
    """Wait up to timeout for no consumer to hold a batch of a GPU ring or map its device
    memory. The control thread still runs meanwhile, so consumers that die are evicted
    and stop counting."""
    info = RingInfo.of(ring)
    if info.device_type != DeviceType.CUDA or ring.wait_released(0):
        return
    log.info("waiting up to %s s for consumers to free the GPU batches they hold", timeout)
    if ring.wait_released(timeout):
        return
    importers = RingInfo.of(ring).gpu_importers
    if importers == 0:
        return
    log.warning(
        "after release_timeout=%s s, %d consumer processes still map the GPU ring: its device "
        "memory is kept until they close or die (a keeper thread frees it then); if this "
        "process exits first, they get ProducerGone (consumers should close() when done)",
        timeout, importers)


def gpu_mapped(ring: Any) -> bool:
    """Whether consumer processes still map the ring's device memory, asked once no import
    can begin any more (Ring.seal_pool): a consumer that imports between this answer and
    the ring's close would otherwise leave the pool with nobody to free it. After the
    first call the answer can only go from True to False."""
    try:
        return RingInfo.of(ring).device_type == DeviceType.CUDA and ring.seal_pool() > 0
    except Exception:  # a ring that cannot say keeps nothing
        return False


KEEP_CHECK = 1.0  # seconds: how often the keeper looks again for importers that died


class PoolKeeper:
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
                    unmapped = ring.seal_pool() == 0  # sealed already: it only goes down
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


POOL_KEEPER = PoolKeeper()
