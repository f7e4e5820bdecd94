"""The producer's watch for consumers that stall the others (read through
tensorsocket.data.diagnosis): a warning for one that holds the others back by lagging, or
by keeping the slot the producer must reuse next, and a detach for one that has read
nothing at all while the others wait for it."""

from __future__ import annotations

import logging
from typing import Any

from ..ring import RingInfo, RingState, StopReason
from ..data import diagnosis
from .peers import Peer

log = logging.getLogger("tensorsocket")

LAG_WARN_AFTER = 10.0  # seconds a consumer may hold the others back before a warning
HELD_WARN_AFTER = 30.0  # seconds the producer may wait for a slot a consumer read and keeps
# A consumer that has read no batch at all since it started, while the others wait for
# it (it is the whole ring behind), is detached after this (None: never); a
# TensorConsumer so detached attaches again as a late joiner when its loop starts. A
# consumer that read and then stops is waited for (lossless) until max_lag or
# heartbeat_timeout.
UNREAD_TIMEOUT: float | None = 300.0


class StallWatch:
    """Checks of the server's thread (see the module docstring); it remembers what it
    warned about, so that each stall is warned about once."""

    def __init__(self) -> None:
        self._held: tuple[int, float, bool] = (-1, 0.0, False)  # (published, since, warned)

    def check(self, ring: Any, peers: list[Peer], now: float) -> None:
        """Check the consumers `peers` of `ring` for lag, then the slot reused next."""
        self._check_lag(ring, peers, now)
        self._check_held(ring, now)

    def _check_held(self, ring: Any, now: float) -> None:
        """Warn once when the producer has not published for HELD_WARN_AFTER seconds and
        the slot it must reuse next is held by consumers that read its entry and keep it
        alive: a training script keeping batches stalls every consumer."""
        info, nxt = RingInfo.of(ring), ring.next_slot()  # (the core says which slot is next)
        published, readers = nxt["published"], nxt["readers"]
        last, since, warned = self._held
        if published != last or readers == 0 or info.state != RingState.OPEN:
            self._held = (published, now, False)
            return
        if warned or now - since < HELD_WARN_AFTER:
            return
        holders = diagnosis.next_slot_holders(ring)
        if not holders:
            return  # unread by a slow consumer: _check_lag's case
        self._held = (published, since, True)
        log.warning("%s", diagnosis.kept_slot_warning(now - since, holders))

    def _check_lag(self, ring: Any, peers: list[Peer], now: float) -> None:
        """Warn once about a consumer that holds the others back: it has been behind the
        fastest consumer by (nearly) the whole ring for LAG_WARN_AFTER seconds, so the
        producer and every faster consumer wait for it (see diagnosis.lag_behind_fastest;
        with max_lag the ring detaches such a consumer instead, warned about below)."""
        lag = diagnosis.lag_behind_fastest(ring)
        for peer in peers:
            if peer.index not in lag or not peer.active or peer.detached:
                continue
            behind, holds_back = lag[peer.index]
            self._check_unread(ring, peer, holds_back, now)
            if not holds_back:
                peer.lagging_since = None
                peer.lag_warned = False
                continue
            if peer.lagging_since is None:
                peer.lagging_since = now
            elif not peer.lag_warned and now - peer.lagging_since >= LAG_WARN_AFTER:
                peer.lag_warned = True
                log.warning("%s", diagnosis.laggard_warning(peer.index, peer.pid, behind,
                                                            now - peer.lagging_since))

    def _check_unread(self, ring: Any, peer: Peer, holds_back: bool, now: float) -> None:
        """Detach a consumer that has read nothing since it started while the others
        waited for it for UNREAD_TIMEOUT (see there): a consumer made long before its
        loop, or a peer that attached and never reads. Nothing of its epoch is lost to
        it: it read none."""
        unread = holds_back and peer.start_seq is not None and \
            ring.consumer(peer.index)["cursor"] == peer.start_seq
        if not unread or UNREAD_TIMEOUT is None:
            peer.unread_since = None
            return
        if peer.unread_since is None:
            peer.unread_since = now
        elif now - peer.unread_since >= UNREAD_TIMEOUT:
            ring.detach(peer.index, StopReason.UNREAD)
            peer.detached = True
            log.warning("consumer %d (pid %d) read no batch at all while the others waited "
                        "for it for %.0f s; it was detached so that they go on",
                        peer.index, peer.pid, now - peer.unread_since)
