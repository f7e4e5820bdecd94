"""The ring's size: the late-joiner window (batches that stay readable for consumers that
attach mid-epoch), checked against ring_slots and max_lag, and the slot size and count,
taken from the first batch and the settings."""

from __future__ import annotations

import math
from typing import NamedTuple

from ..ring import MAX_SLOTS, RESERVE_SLOTS
from .settings import ProducerSettings

DEFAULT_SLOTS = 4
DEFAULT_MAX_WINDOW = 8  # the default window's most batches, unless asked for explicitly
SLOT_HEADROOM = 1.5  # slot size = first batch x this (plus room for the structure)
MIN_SLOT_BYTES = 64 * 1024


class RingShape(NamedTuple):
    """The ring to create: its slots, the bytes of each, and the most tensors per batch."""

    slots: int
    slot_bytes: int
    max_leaves: int


class RingSizing:
    """The late-joiner window (``window``, known from the start where the loader has a
    len() or rubber_band= is given, else from the first epoch's loader) and the ring's
    shape from the first batch."""

    def __init__(self, settings: ProducerSettings, length: int | None) -> None:
        """The window for an epoch of `length` batches (None: unknown yet); ValueError
        where it cannot fit the ring or max_lag."""
        self._settings = settings
        self._known = length is not None or settings.rubber_band is not None
        self.window = late_joiner_window(settings, length)

    def shape(self, meta: bytes, leaves: list, length: int | None) -> RingShape:
        """The ring for a first batch of `meta` and `leaves`, in an epoch of `length`
        batches (a callable's first loader tells it only now: the window follows)."""
        s = self._settings
        if not self._known and length is not None:
            self.window = late_joiner_window(s, length)
            self._known = True
        size = batch_bytes(leaves) + 2 * len(meta) + 4096
        slot_bytes = s.slot_bytes or max(MIN_SLOT_BYTES, int(size * SLOT_HEADROOM))
        slots = s.ring_slots
        if slots is None:
            need = max(self.window, s.max_lag or 0) + RESERVE_SLOTS
            if s.ring_bytes:
                slots = min(MAX_SLOTS, s.ring_bytes // slot_bytes)
                if slots < need:
                    raise ValueError(
                        f"ring_bytes={s.ring_bytes} holds {slots} slots of {slot_bytes} "
                        f"bytes, but the late-joiner window ({self.window}) and max_lag "
                        f"({s.max_lag}) need {need}: raise ring_bytes= or lower "
                        "rubber_band= / rubber_band_pct= / max_lag="
                    )
            else:
                slots = max(DEFAULT_SLOTS, need)
        return RingShape(slots, slot_bytes, s.max_leaves or max(64, 2 * len(leaves)))


def late_joiner_window(s: ProducerSettings, length: int | None) -> int:
    """The late-joiner window in batches for epochs of `length` batches, checked against
    ring_slots and max_lag (ValueError naming the setting to change)."""
    window = window_batches(s, length)
    slots, max_lag = s.ring_slots, s.max_lag
    if not s.explicit_window:
        # The default window stays small and fits the ring the user asked for.
        window = min(window, DEFAULT_MAX_WINDOW)
        if slots is not None:
            window = max(0, min(window, slots - RESERVE_SLOTS))
        if max_lag is not None:
            window = min(window, max_lag - 1)
    if window > MAX_SLOTS - RESERVE_SLOTS:
        raise ValueError(
            f"a late-joiner window of {window} batches needs more than the "
            f"{MAX_SLOTS} slots a ring holds: lower rubber_band_pct= or rubber_band="
        )
    if max_lag is not None and max_lag <= window:
        raise ValueError(
            f"{s.show('max_lag', max_lag)} must exceed the late-joiner window of "
            f"{window} batches (rubber_band= / rubber_band_pct=): a late joiner starts "
            "that far behind"
        )
    if slots is not None and slots <= window:
        raise ValueError(
            f"{s.show('ring_slots', slots)} cannot keep a late-joiner window of "
            f"{window} batches: raise ring_slots= or lower rubber_band= / rubber_band_pct="
        )
    if slots is not None and max_lag is not None and max_lag + RESERVE_SLOTS > slots:
        raise ValueError(
            f"{s.show('max_lag', max_lag)} needs ring_slots >= max_lag + {RESERVE_SLOTS} "
            f"({s.show('ring_slots', slots)}): a consumer that holds its current "
            "batch while it trains can only fall ring_slots - 1 batches behind"
        )
    return window


def window_batches(s: ProducerSettings, length: int | None) -> int:
    """The late-joiner window in batches, before the default's clamps."""
    if s.rubber_band is not None:
        return s.rubber_band
    if length is None:
        return 0
    return math.ceil(s.rubber_band_pct * length - 1e-9)


def batch_bytes(leaves: list) -> int:
    """Bytes of tensor data in a flattened batch."""
    total = 0
    for buf, _ in leaves:
        total += memoryview(buf).nbytes + 64
    return total
