"""The producer's ring, created at its first batch: under the producer's segment name
(another where a planted file took it), on the GPU where asked (the host where it cannot
work and fallback is allowed), with the late-joiner window and max_lag set."""

from __future__ import annotations

import logging
import os
import secrets
import warnings
from typing import Any

from ..ring import Ring
from ..control.producer_files import OwnedFiles
from ..errors import GPUFallbackWarning, GPUUnavailable, SharedMemoryTooSmall, TensorSocketError
from .settings import ProducerSettings
from .sizing import RingSizing

log = logging.getLogger("tensorsocket")

SEGMENT_NAME_TRIES = 8  # segment names tried when the name is taken (a planted file)


class RingMaker:
    """Creates the producer's ring; ``segment`` is its shared-memory name (the one it
    would have before), ``fallback_reason`` why a GPU ring fell back to the host."""

    def __init__(self, settings: ProducerSettings, sizing: RingSizing,
                 files: OwnedFiles) -> None:
        """Nothing created yet; `files` learns the segment once it is ours."""
        self._settings = settings
        self._sizing = sizing
        self._files = files
        self.segment = settings.endpoint.segment_name(os.getpid())
        self.fallback_reason: str | None = None

    def make(self, meta: bytes, leaves: list, length: int | None) -> Any:
        """The ring, sized from the first batch (`meta`, `leaves`) of an epoch of `length`
        batches."""
        slots, slot_bytes, max_leaves = self._sizing.shape(meta, leaves, length)
        window = self._sizing.window
        try:
            ring = self._create(slots, slot_bytes, max_leaves)
        except SharedMemoryTooSmall as e:
            raise SharedMemoryTooSmall(
                f"{e}. The ring is {slots} slots x {slot_bytes} bytes (a late-joiner window "
                f"of {window}): lower ring_slots=, slot_bytes= or rubber_band_pct=, or "
                "enlarge /dev/shm (docker run --shm-size=...)"
            ) from None
        try:
            ring.set_policy(window, self._settings.max_lag or 0)
        except BaseException:
            ring.close()
            self._files.segment = None
            Ring.unlink_name(self.segment)
            raise
        log.info("ring %s: %d slots of %d bytes", self.segment, slots, slot_bytes)
        return ring

    def _create(self, slots: int, slot_bytes: int, max_leaves: int) -> Any:
        """A host ring, or a GPU ring on the settings' device (falling back to host if
        allowed: the settings' device becomes "cpu")."""
        s = self._settings
        if s.device_ordinal is None:
            return self._create_named(slots, slot_bytes, max_leaves)
        try:
            return self._create_named(slots, slot_bytes, max_leaves, device=s.device_ordinal)
        except GPUUnavailable as e:
            if not s.device_fallback:
                raise GPUUnavailable(
                    f"{e} (device={s.device!r}; device_fallback=True uses the host ring "
                    "instead)") from None
            self.fallback_reason = str(e)
            s.device, s.device_ordinal = "cpu", None
            warnings.warn(
                f"tensorsocket: the GPU ring cannot work here, using the host ring: {e}",
                GPUFallbackWarning, stacklevel=5)
            log.warning("GPU ring unavailable, using the host ring: %s", e)
            return self._create_named(slots, slot_bytes, max_leaves)

    def _create_named(self, slots: int, slot_bytes: int, max_leaves: int, **kw: Any) -> Any:
        """Ring.create under our segment name; where a file already has that name (anyone
        may create files in /dev/shm, under any name), under the name with a random
        ``.<tag>`` appended instead, a few times. A file found there is never removed: it
        may not be ours."""
        base = self._settings.endpoint.segment_name(os.getpid())
        taken = []
        for attempt in range(SEGMENT_NAME_TRIES):
            name = base if attempt == 0 else f"{base}.{secrets.token_hex(4)}"
            try:
                ring = Ring.create(name, slots, slot_bytes, max_leaves, **kw)
            except FileExistsError:
                taken.append(name)
                log.warning("shared-memory segment name %s is taken by a file that is not "
                            "this producer's; trying another name", name)
                continue
            # Ours from here on (only now: SIGTERM must never remove the file found there).
            self.segment = self._files.segment = name
            return ring
        raise TensorSocketError(
            f"every shared-memory segment name tried for the ring is taken by a file "
            f"already in /dev/shm ({', '.join('/dev/shm' + n for n in taken)}): someone "
            "creates them on purpose; find out who (ls -l /dev/shm), remove them, and "
            "start the producer again")
