"""Sibling parking: the consumers of one process that read other producers.

A process may read two shared loaders in turns (training, then validation). While it
reads one, its consumer of the other sits between epochs holding that producer back
(and the jobs reading it); two jobs alternating between two shared loaders would wait
on each other. So a consumer that is about to wait parks this process's idle consumers
of other producers (Siblings.park_idle). Each consumer takes part through a
ParkingMember: the small public view of it that parking reads and acts on."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any

from ..data import diagnosis
from ..ring import ConsumerState
from .epoch_state import EpochState
from .place import RingPlace

log = logging.getLogger("tensorsocket")


class ParkingMember:
    """What sibling parking sees of one consumer: its ring and place, whether it sits
    between epochs, and park()."""

    def __init__(self, place: RingPlace, state: EpochState, world_size: int) -> None:
        """The member for the consumer whose place and epoch state these are."""
        self._place = place
        self._state = state
        self._world_size = world_size

    @property
    def lock(self) -> threading.Lock:
        """Held while the consumer begins an epoch, and while it is parked from here."""
        return self._place.lock

    @property
    def segment(self) -> str:
        """The producer's ring (its segment name): members of one producer are no
        siblings."""
        return self._place.segment

    @property
    def index(self) -> int:
        """The consumer's index in its ring."""
        return self._place.index

    @property
    def token(self) -> int:
        """The token of the consumer's place in its ring."""
        return self._place.token

    @property
    def ring(self) -> Any:
        """The ring handle the consumer reads through."""
        return self._place.ring

    def idle(self) -> bool:
        """Attached to its ring, yet between epochs: never iterated, or every batch of
        its epoch delivered (a loop that stops at len() leaves the epoch open). The ranks
        of a group are never idle: they stay attached, so that all of them read the same
        epochs."""
        place = self._place
        return place.attached and not place.closed and place.aligned \
            and self._world_size == 1 and self._state.between_epochs()

    def keeps_place(self) -> bool:
        """Parked between epochs with its place in the ring kept (see RingPlace.park),
        and not iterated since: an iter() (under its lock) begins an epoch, and then the
        place is that iterator's to go on from."""
        place = self._place
        return place.held_place and not place.attached and not place.closed \
            and self._state.between_epochs()

    def park(self, hold: bool) -> None:
        """Park the consumer (RingPlace.park): keeping its place (hold), or not."""
        self._place.park(hold=hold)


class Siblings:
    """The open consumers of this process (weakly held), for parking the idle ones."""

    def __init__(self) -> None:
        """No consumer yet."""
        self._members: "weakref.WeakSet[ParkingMember]" = weakref.WeakSet()

    def add(self, member: ParkingMember) -> None:
        """A consumer opened in this process."""
        self._members.add(member)

    def _of(self, me: ParkingMember) -> list[ParkingMember]:
        """The consumers of this process reading another producer than `me` (consumers
        of the same producer only wait for each other as any two consumers do)."""
        return [c for c in list(self._members) if c is not me and c.segment != me.segment]

    def any_idle(self, me: ParkingMember) -> bool:
        """Whether a consumer of another producer in this process is idle, or parked
        keeping its place: either holds its producer back while this process reads
        `me`."""
        if len(self._members) < 2:
            return False  # (the common case, one consumer in the process: at once)
        return any(c.idle() or c.keeps_place() for c in self._of(me))

    def park_idle(self, me: ParkingMember) -> None:
        """Park the consumers of other producers in this process that sit between epochs:
        this process is reading `me` now, so they would only hold their producers (and
        the other jobs reading them) back, and two jobs alternating between two shared
        loaders would wait on each other. Each attaches again, at an epoch start, when
        next iterated.

        A parked consumer keeps its place for park_hold seconds (its producer keeps the
        next epoch's first batches for it, so that its job reads the same epochs as the
        others). That place is given up at once where it closes a cycle of waits (see
        _waits_on_each_other): two jobs out of phase, one reading the training loader,
        the other the validation loader, would otherwise each wait for the other's place
        until park_hold ran out."""
        for other in self._of(me):
            with other.lock:
                if not (other.idle() or other.keeps_place()):
                    continue
                if _waits_on_each_other(me, other):
                    log.info("consumer %d gives up its place in its ring: a job that it "
                             "holds back is one that this process waits for through "
                             "another loader", other.index)
                    other.park(hold=False)
                elif other.idle():
                    log.debug("consumer %d parks while this process reads another loader",
                              other.index)
                    other.park(hold=True)


SIBLINGS = Siblings()  # this process's


def _waits_on_each_other(me: ParkingMember, other: ParkingMember) -> bool:
    """Whether this process waits (reading `me`) for a process that waits for `other`'s
    place: `me` read everything published and its producer cannot publish more until
    consumers of other processes free the slot it must reuse; `other`'s entry is one
    that keeps its own producer from publishing; and a consumer of one of those
    processes read everything `other`'s producer published (it waits for it). Read from
    the two rings' consumer tables."""
    ring = me.ring
    if ring.closed:
        return False
    mine = ring.consumer(me.index)
    if mine["token"] != me.token or mine["lag"] != 0:
        return False  # a batch is there for `me` (or its place is gone): no wait here
    awaited = {e["pid"] for e in diagnosis.holding_back(ring)} - {os.getpid()}
    theirs = other.ring
    if not awaited or theirs.closed:
        return False
    holders = diagnosis.holding_back(theirs)
    if not any(e["index"] == other.index and e["token"] == other.token for e in holders):
        return False
    return any(e["pid"] in awaited and e["state"] == ConsumerState.ACTIVE and e["lag"] == 0
               for e in theirs.consumers())
