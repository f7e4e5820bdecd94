"""What a training process hears of the shared producer's decoded-sample cache.

A job asks for the cache with ``share(..., cache_bytes=...)`` (or
TENSORSOCKET_CACHE_BYTES), but the producer, another process, decides whether it gets
one, and logs why not to its own log file. The producer notes its cache in its ring's
header (``Ring.cache()``); each consumer reads that note at the end of each epoch and
says in the training process what changed: a cache made (INFO), or none made or one
dropped, and why (a WARNING and a TensorSocketWarning, once per reason)."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from ..errors import TensorSocketWarning

log = logging.getLogger("tensorsocket")


class CacheNotice:
    """Says, once each, what the producer's cache note tells (see the module docstring)."""

    def __init__(self) -> None:
        self._told: str | None = None  # the last state said: "made", or why there is none

    def check(self, ring: Any, consumer: int) -> None:
        """Read the producer's cache note in `ring` and say what is new (consumer: this
        consumer's index, for the log)."""
        note = ring.cache()
        if note is None or not note["budget"]:
            return  # not readable whole (said at the next epoch's end), or none asked for
        off = note["off"]
        state = off or ("made" if note["bytes"] else None)
        if state is None or state == self._told:
            return
        self._told = state
        if off is None:
            log.info("consumer %d: the shared producer caches the decoded samples (%d bytes "
                     "of cache_bytes=%d; %d samples filled)", consumer, note["bytes"],
                     note["budget"], note["samples"])
            return
        message = (f"the shared producer's decoded-sample cache (cache_bytes="
                   f"{note['budget']}) is {off}")
        log.warning("%s", message)
        warnings.warn(message, TensorSocketWarning, stacklevel=5)  # (the loop's next())
