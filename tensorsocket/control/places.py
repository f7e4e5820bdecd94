"""Where each consumer of the producer reads in the ring, as its control messages say:
started once it mapped the ring (the ranks of a data-parallel group together, at one
entry), taken off the ring when it parks, and its place kept for a while when it parks
between epochs."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ..ring import ConsumerState, RingInfo
from . import protocol
from .channel import GROUP_TIMEOUT
from .peers import Peer, PeerTable

log = logging.getLogger("tensorsocket")


class Places:
    """The consumers' places in the ring, for the server's thread. ring() is the
    producer's ring (None before it exists); send(ident, message) replies to a consumer;
    park_hold: seconds a consumer parked between epochs keeps its place once others read
    again; epoch_at(seq, aligned): the epoch a consumer that starts at entry seq reads
    first (the producer's EpochPlanner.epoch_at; None: not told)."""

    def __init__(self, ring: Callable[[], Any], peers: PeerTable, park_hold: float,
                 send: Callable[[bytes, protocol.Message], None],
                 epoch_at: Callable[[int, bool], int | None] | None = None) -> None:
        self._ring = ring
        self._epoch_at = epoch_at  # the epoch a consumer starting at an entry reads first
        self._peers = peers
        self.park_hold = park_hold
        self._send = send

    def ready(self, ident: bytes, peer: Peer, align: bool) -> None:
        """The consumer on `ident` mapped the ring: start it (align: at the current
        epoch's first entry if it is still in the ring), or its group once complete."""
        ring = self._ring()
        if peer.active or ring is None:
            return
        if peer.group is not None:
            peer.ready_align = align
            self.start_group(peer.group, time.monotonic())
            return
        start = ring.activate(peer.index, align)
        self._started(ident, peer, start, align)

    def _started(self, ident: bytes, peer: Peer, start: int, align: bool) -> None:
        """The consumer receives entries from `start` on: tell it."""
        ring = self._ring()
        peer.active = True
        peer.start_seq = start
        peer.first_epoch = None if self._epoch_at is None else self._epoch_at(start, align)
        peer.last_seen = time.monotonic()  # its heartbeats start now (a rank waited for its group)
        self._restart_holds(time.monotonic())
        log.info("consumer %d (pid %d%s) joined at entry %d (%d published%s)", peer.index,
                 peer.pid, "" if peer.group is None else f", rank {peer.rank} of {peer.group}",
                 start, RingInfo.of(ring).published, ", aligned" if align else "")
        self._send(ident, protocol.Started(start_seq=start))

    def start_group(self, group: str, now: float) -> None:
        """Start the ranks of `group` that said ready, all at the same entry, once every
        rank said so (or GROUP_TIMEOUT after the first): ranks that start at different
        entries could read different epochs, and a data-parallel job then hangs in its
        collectives. The first rank's bits keep the entry in the ring for the others."""
        members = [(i, p) for i, p in self._peers.items() if p.group == group]
        waiting = [(i, p) for i, p in members if not p.active and p.ready_align is not None]
        if not waiting:
            return
        world = int(group.rsplit("/", 1)[1])
        # A rank counts once it said ready, not at its hello: one started before the
        # others mapped the ring reads on, and frees the entries they would start at.
        ranks = {p.rank for _, p in members if p.active or p.ready_align is not None}
        oldest = min(p.since for _, p in waiting)
        if len(ranks) < world and now - oldest < GROUP_TIMEOUT:
            return  # not all ranks are ready yet
        if len(ranks) < world:
            log.warning("group %s: only ranks %s of %d ready within %.0f s; starting them",
                        group, sorted(ranks), world, GROUP_TIMEOUT)
        ring = self._ring()
        running = [p for _, p in members if p.active]
        start = None
        if running:  # a rank attaching again: with the group, if its entries are still here
            start = min(ring.consumer(p.index)["first_seq"] for p in running)
        align = any(bool(p.ready_align) for _, p in waiting)
        indices = [p.index for _, p in waiting]
        try:  # all in one step: started one by one, the first could read on and hand back
            begun = ring.activate_group(indices, align, start)  # the others' first entry
        except ValueError:  # the group's entries left the ring: start where it can
            begun = ring.activate_group(indices, align)
        for ident, peer in waiting:
            peer.ready_align = None
            self._started(ident, peer, begun, align)

    def park(self, peer: Peer, hold: bool, skip_epoch: bool) -> None:
        """The consumer stopped reading: take it off the ring so that nobody waits for
        it, but keep it as a consumer of this producer (its heartbeats go on) until it
        attaches again or leaves. One that stopped between epochs (hold), to read
        another loader for a while (a validation loop), keeps its place in the ring for
        park_hold seconds once others read again: the entries from the next epoch's
        first on stay there, so that it reads the same epochs as the jobs it started
        with, not a later one because it came back a moment after them (skip_epoch: it
        left its epoch with break, so its place is the next epoch's first entry)."""
        ring = self._ring()
        if ring is None:
            return
        if peer.parked:
            if not hold and peer.held_until is not None:
                self._give_up_place(ring, peer)
            return
        peer.parked = True
        peer.active = False
        if hold and self.park_hold > 0 and \
                ring.consumer(peer.index)["state"] == ConsumerState.ACTIVE:
            if skip_epoch:  # left its epoch with break: its place is the next one's
                try:
                    ring.await_next_epoch(peer.index)
                except ValueError:  # detached meanwhile: no place to keep
                    ring.retire(peer.index)
                    return
            peer.held_until = time.monotonic() + self.park_hold
            log.info("consumer %d (pid %d) parked between epochs; its place is kept",
                     peer.index, peer.pid)
            return
        ring.retire(peer.index)
        log.info("consumer %d (pid %d) parked", peer.index, peer.pid)

    def _give_up_place(self, ring: Any, peer: Peer) -> None:
        """A consumer parked keeping its place gives it up before park_hold ran out: its
        process waits, through another loader, for a job that waits for this place (a
        cycle of waits between two jobs out of phase, which only park_hold would end
        otherwise; see Siblings.park_idle in consumer/siblings.py). It attaches again at a later
        epoch start when it reads again."""
        peer.held_until = None
        ring.retire(peer.index)
        log.info("consumer %d (pid %d) gave up its place: its process waits for a job that "
                 "waits for this place (it starts at a later epoch when it reads again)",
                 peer.index, peer.pid)

    def unpark(self, ring: Any, peer: Peer) -> bool:
        """A parked consumer reads again: whether its place was kept (it goes on from it)."""
        held = peer.held_until is not None and \
            ring.consumer(peer.index)["state"] == ConsumerState.ACTIVE
        if held:
            peer.held_until = None
            peer.parked = False
            peer.active = True
            self._restart_holds(time.monotonic())
            log.info("consumer %d (pid %d) reads again from its place", peer.index, peer.pid)
        return held

    def _restart_holds(self, now: float) -> None:
        """A consumer reads again: the places kept for parked ones hold it back from now
        on, for park_hold seconds at most (while all are parked, nobody waits)."""
        for peer in self._peers.values():
            if peer.held_until is not None:
                peer.held_until = max(peer.held_until, now + self.park_hold)

    def check_holds(self, ring: Any, now: float) -> None:
        """Give up the places of consumers parked longer than park_hold while others
        read: they would hold those back; they attach again at a later epoch."""
        peers = self._peers.values()
        if not any(p.active for p in peers):
            return
        for peer in peers:
            if peer.held_until is not None and now >= peer.held_until:
                peer.held_until = None
                ring.retire(peer.index)
                log.info("consumer %d (pid %d) stayed parked longer than park_hold=%s s "
                         "while others read; its place is given up (it starts at a later "
                         "epoch when it reads again)", peer.index, peer.pid, self.park_hold)
