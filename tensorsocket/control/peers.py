"""The consumers the producer's control server knows: one Peer each, in a PeerTable by the
identity of the connection it came on."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..ring import ConsumerState, ProcessWatch

log = logging.getLogger("tensorsocket")


@dataclass
class Peer:
    """What the server knows of one connected consumer."""

    index: int
    token: int
    pid: int
    start_time: int
    since: float
    batch_size: int | None = None
    active: bool = False
    detached: bool = False
    parked: bool = False  # left the ring between epochs; still a consumer of this producer
    last_seen: float = field(default_factory=time.monotonic)
    lagging_since: float | None = None  # behind the fastest by (nearly) the whole ring
    lag_warned: bool = False
    group: str | None = None  # "<group id>/<world size>" of a rank of a data-parallel job
    rank: int = 0
    ready_align: bool | None = None  # a rank's "ready", held until its group is complete
    held_until: float | None = None  # parked with its place in the ring kept until then
    start_seq: int | None = None  # its first entry, once started
    first_epoch: int | None = None  # the epoch it reads first, from that entry
    unread_since: float | None = None  # holding the others back having read nothing
    # Its process, watched by a pidfd taken as it said hello (each look one poll, no
    # /proc read; closed when it is off the table, PeerTable.pop).
    watch: ProcessWatch = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """Take the pidfd of the consumer's process (pid and start time as it said)."""
        self.watch = ProcessWatch.of(self.pid, self.start_time)

    def alive(self) -> bool:
        """Whether the consumer's process still runs."""
        return self.watch.alive()

    def note_detached(self, ring: Any) -> None:
        """Log, once, that the ring detached this consumer for lagging, if it did (the
        liveness check looks; so does its leaving, which may come first: the consumer
        raised ConsumerDetached and said bye)."""
        if self.active and not self.detached and \
                ring.consumer(self.index)["state"] == ConsumerState.DETACHED:
            self.detached = True  # the stall watch's detaches are logged there
            log.warning("consumer %d (pid %d) fell more than max_lag batches behind and "
                        "was detached", self.index, self.pid)

    def holds_entry(self) -> bool:
        """Whether its entry in the ring is its own to give back: not parked, or parked
        with its place kept (a parked consumer's entry was retired when it parked)."""
        return not self.parked or self.held_until is not None


class PeerTable:
    """The server's consumers by connection identity. Only the server's thread adds and
    removes them (under the lock, as the owner's counts read them from another thread);
    ring() is the producer's ring, None before it exists."""

    def __init__(self, ring: Callable[[], Any]) -> None:
        self._ring = ring
        self._peers: dict[bytes, Peer] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, ident: bytes) -> bool:
        return ident in self._peers

    def get(self, ident: bytes) -> Peer | None:
        return self._peers.get(ident)

    def items(self) -> list[tuple[bytes, Peer]]:
        """(identity, peer) of every consumer now (a copy: the table may change)."""
        with self._lock:
            return list(self._peers.items())

    def values(self) -> list[Peer]:
        with self._lock:
            return list(self._peers.values())

    def add(self, ident: bytes, peer: Peer) -> None:
        with self._lock:
            self._peers[ident] = peer

    def pop(self, ident: bytes) -> Peer | None:
        """The consumer on `ident` is off the table: its process watch's pidfd is given
        back (its alive() raises from then on)."""
        with self._lock:
            peer = self._peers.pop(ident, None)
        if peer is not None:
            peer.watch.close()
        return peer

    def close(self) -> None:
        """The server stops: every consumer's pidfd is given back."""
        with self._lock:
            for peer in self._peers.values():
                peer.watch.close()

    def retire(self, ident: bytes) -> None:
        """The consumer on `ident` leaves: off the table, and its entry off the ring."""
        peer = self.pop(ident)
        ring = self._ring()
        if peer is not None and ring is not None and peer.holds_entry():
            peer.note_detached(ring)
            ring.retire(peer.index)
            log.info("consumer %d (pid %d) left", peer.index, peer.pid)

    def excuse(self, gap: float, now: float) -> None:
        """The server's thread did not run for `gap` seconds (the producer was stopped, or
        starved): the consumers' heartbeats of that time may still wait unread in the
        socket, so it does not count as their silence."""
        with self._lock:
            for peer in self._peers.values():
                peer.last_seen = min(now, peer.last_seen + gap)

    def consumer_count(self) -> int:
        """Consumers attached and receiving now."""
        ring = self._ring()
        with self._lock:
            peers = [p for p in self._peers.values() if p.active]
        if ring is None or ring.closed:
            return len(peers)
        return sum(1 for p in peers
                   if ring.consumer(p.index)["state"] == ConsumerState.ACTIVE)

    def present_count(self) -> int:
        """Consumers of this producer: attached, or parked between epochs."""
        with self._lock:  # a rank waiting for its group, a consumer just saying hello too
            return len(self._peers)

    def batch_sizes(self) -> dict[int, int | None]:
        """Batch size each attached consumer asked for, by consumer index."""
        with self._lock:
            return {p.index: p.batch_size for p in self._peers.values() if not p.parked}
