"""Waiting for consumers before a batch: min_consumers and then start_grace seconds
before the first batch, at least one consumer before any later one (the loader is not
run for nobody)."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from .settings import ProducerSettings

log = logging.getLogger("tensorsocket")


class ConsumerGate:
    """Holds the producer's batches back until consumers are there to read them;
    ``wait_seconds`` is the time it waited (stats()' consumer_wait_seconds)."""

    def __init__(self, settings: ProducerSettings, attached: Callable[[], int]) -> None:
        """`attached`: the number of consumers attached now, for the timeout's message."""
        self._settings = settings
        self._attached = attached
        self.wait_seconds = 0.0
        self._graced = False  # the start grace is over (it runs once, before batch 0)

    def wait(self, ring: Any, first: bool) -> None:
        """Before the `first` batch: wait for min_consumers, then start_grace seconds for
        jobs started together with them. Later: for at least one consumer. TimeoutError
        after start_timeout."""
        s = self._settings
        if s.min_consumers == 0:
            return
        want = s.min_consumers if first else 1
        if ring.wait_consumers(want, 0):
            self._start_grace(first)
            return
        if not first:
            log.info("no consumer attached: pausing until one attaches")
        start = time.perf_counter()
        ok = ring.wait_consumers(want, s.start_timeout)
        if ok:
            self._start_grace(first)
        self.wait_seconds += time.perf_counter() - start
        if not ok:
            where = f"producer {s.endpoint.name!r} at {s.endpoint.address}"
            if first:
                raise TimeoutError(
                    f"only {self._attached()} of min_consumers={want} consumers "
                    f"attached within start_timeout={s.start_timeout} s ({where})"
                )
            raise TimeoutError(
                f"every consumer left and none attached again within start_timeout="
                f"{s.start_timeout} s ({where}); pass start_timeout=None to wait for "
                "consumers indefinitely"
            )

    def _start_grace(self, first: bool) -> None:
        """Before the very first batch only: give the jobs started together with the first
        consumers start_grace seconds to attach, so that all of them begin at batch 0."""
        if not first or self._graced or self._settings.start_grace <= 0:
            return
        self._graced = True
        log.info("first consumer attached: waiting start_grace=%s s for others started with "
                 "it", self._settings.start_grace)
        end = time.monotonic() + self._settings.start_grace
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
