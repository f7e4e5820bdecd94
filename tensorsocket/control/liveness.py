"""Which of the producer's consumers are gone: evicted when their process died or they went
silent, dropped when they never finished their handshake, and released when they exited
after leaving with batches still held."""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..ring import ConsumerState, ProcessWatch
from .channel import PENDING_TIMEOUT
from .peers import Peer, PeerTable

log = logging.getLogger("tensorsocket")


class Liveness:
    """The server's eviction of consumers that are gone (see the module docstring): a
    consumer not heard from for heartbeat_timeout seconds (None: never) is taken off."""

    def __init__(self, peers: PeerTable, heartbeat_timeout: float | None) -> None:
        self._peers = peers
        self.heartbeat_timeout = heartbeat_timeout
        # The processes of the entries left holding batches (LEAVING), by (index, pid,
        # start time): a pidfd each, taken when the entry is first seen leaving (its Peer,
        # and the Peer's pidfd, went with its bye or its park), closed once it is gone.
        self._left: dict[tuple[int, int, int], ProcessWatch] = {}

    def check(self, ring: Any, now: float, start_group: Callable[[str, float], None]) -> None:
        """Evict consumers whose process died, and those not heard from for
        heartbeat_timeout; note consumers the ring detached for lagging; drop handshakes
        never finished. A rank found waiting for its group is passed to start_group."""
        for ident, peer in self._peers.items():
            if self._peers.get(ident) is not peer:
                continue  # taken off meanwhile (by a step of this loop: a group's start)
            peer.note_detached(ring)
            if not peer.alive():
                self._peers.pop(ident)
                if peer.holds_entry():
                    ring.evict(peer.index)
                log.warning("consumer %d (pid %d) died; its slots were released",
                            peer.index, peer.pid)
            elif self._silent(peer, now):
                self._evict_silent(ring, ident, peer, now)
            elif peer.group is not None and peer.ready_align is not None:
                start_group(peer.group, now)
            elif not peer.active and not peer.parked and now - peer.since > PENDING_TIMEOUT:
                self._peers.retire(ident)
        self._release_left(ring)

    def _release_left(self, ring: Any) -> None:
        """A consumer that said bye (or parked) while still holding batches is no peer any
        more, but its entry keeps its bits in those slots until the views die. If its
        process exits first (a script ending with its last batch in a variable), nobody
        would clear them and the producer would wait for those slots forever. Only the
        server's thread reserves entries, so an entry seen LEAVING here cannot be reused
        meanwhile. Each such process is watched by a pidfd (self._left), one poll a look."""
        leaving: dict[tuple[int, int, int], ProcessWatch] = {}
        for entry in ring.consumers():
            if entry["state"] != ConsumerState.LEAVING:
                continue
            key = (entry["index"], entry["pid"], entry["start_time"])
            watch = self._left.pop(key, None) or ProcessWatch.of(key[1], key[2])
            if watch.alive():
                leaving[key] = watch
                continue
            watch.close()
            ring.evict(entry["index"])
            log.info("consumer %d (pid %d) exited after leaving, still holding batches; "
                     "its slots were released", entry["index"], entry["pid"])
        for gone in self._left.values():  # entries no longer leaving (released, reused)
            gone.close()
        self._left = leaving

    def close(self) -> None:
        """Give back the pidfds of the left consumers watched (the server stops)."""
        for watch in self._left.values():
            watch.close()
        self._left = {}

    def _silent(self, peer: Peer, now: float) -> bool:
        """Whether a consumer whose heartbeat thread runs (it started reading, or parked)
        has not been heard from for heartbeat_timeout. One still in its handshake sends
        none yet: PENDING_TIMEOUT and GROUP_TIMEOUT bound that."""
        return self.heartbeat_timeout is not None and (peer.active or peer.parked) and \
            now - peer.last_seen > self.heartbeat_timeout

    def _evict_silent(self, ring: Any, ident: bytes, peer: Peer, now: float) -> None:
        """Take off a consumer whose process lives on but sends nothing (stopped, a step
        holding the GIL, or a client that said hello and went quiet): it reads nothing
        either, so the others would wait for it for ever. It stops receiving (nobody waits
        for it), but the slots it holds stay held while its process lives: it may run
        again and read the batches it kept, which must not be overwritten (the producer
        skips those slots). Its next batch request raises ConsumerDetached, saying why;
        once it exits, its entry and holds go as a left consumer's do (_release_left)."""
        self._peers.pop(ident)
        silent = now - peer.last_seen
        entry = ring.consumer(peer.index)
        if entry["token"] == peer.token:
            ring.retire_silent(peer.index, silent, self.heartbeat_timeout)
        log.warning(
            "consumer %d (pid %d) sent no heartbeat for %.0f s, though its process lives (it "
            "is stopped, or a step holds the GIL); it was taken off so that the others go on "
            "(the batches it holds stay intact: their slots are skipped until it frees them "
            "or exits). A consumer that is busy for that long needs a longer "
            "TensorProducer(heartbeat_timeout=) or TENSORSOCKET_HEARTBEAT_TIMEOUT",
            peer.index, peer.pid, silent)
