"""The producer's life outside its loop: it takes its name's lock, writes the secret,
starts the control server, and tears all of that down once, at close() or when the
producer is collected (module-level teardown: the finalizer holds no reference to it),
its files also on SIGTERM."""

from __future__ import annotations

import functools
import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from ..ring import RingInfo, RingState
from ..control import auth
from ..control.producer_files import (
    OwnedFiles,
    forget_on_sigterm,
    remove_on_sigterm,
    sweep_stale_segments,
    take_name_lock,
)
from ..control.server import ControlServer
from .failure import failure_text, signal_failure
from .gpu_release import POOL_KEEPER, gpu_mapped, wait_gpu_released
from .listings import EpochPlanner
from .settings import ProducerSettings

log = logging.getLogger("tensorsocket")


@dataclass
class ProducerState:
    """What the producer's parts share with the control thread and the teardown (which
    hold no reference to the producer itself)."""

    ring: Any = None  # the C ring, from the first batch on
    # Why the producer failed (its loader raised, ...), for the teardown to tell the
    # consumers; None while it runs well.
    failure: str | None = None
    closed: bool = False  # joined or closed: torn down

    def note_failure(self, exc: BaseException) -> None:
        """The producer ends with `exc`: the consumers are told at the teardown (not for
        an exit that is no failure)."""
        text = failure_text(exc)
        if text is not None:
            self.failure = text


class ProducerLifecycle:
    """The name lock, the secret, the control server (``server``, answering consumers'
    hellos with `welcome`, and their asks for an epoch's order from `listings`), and the teardown of them all, once. ``secret`` is what a
    consumer must present (None for ipc:// without auth_token)."""

    def __init__(self, owner: object, settings: ProducerSettings, files: OwnedFiles,
                 state: ProducerState, welcome: Callable[[], dict],
                 listings: EpochPlanner) -> None:
        """Take the name and start listening; the teardown runs when `owner` (the
        producer) is collected, if close() did not run it first."""
        endpoint = settings.endpoint
        lock_fd = take_name_lock(endpoint)
        try:
            self.secret: str | None = auth.producer_secret(endpoint, settings.auth_token)
            if self.secret is not None and endpoint.socket_path is None:  # TCP
                auth.write_secret(auth.secret_path(endpoint), self.secret)
            sweep_stale_segments(endpoint.name)
            context = zmq.Context()
            self.server = ControlServer(context, endpoint.address, lambda: state.ring,
                                        welcome, park_hold=settings.park_hold,
                                        secret=self.secret,
                                        heartbeat_timeout=settings.heartbeat_timeout,
                                        listings=listings)
        except BaseException:
            # Nothing started: the files of the name go with the lock, which is still ours
            # (the lock file too: before issue 35 a failed bind left port<N>.lock behind).
            files.remove()
            os.close(lock_fd)
            raise
        self._state = state
        self._finalizer = weakref.finalize(owner, _teardown, self.server, context, files,
                                           lock_fd, state, settings.release_timeout)
        files.on_signal = functools.partial(_signalled, state)
        remove_on_sigterm(files)
        log.info("producer %r listening on %s", endpoint.name, endpoint.address)
        if settings.resolver.origins:
            log.info("producer settings from the environment: %s",
                     settings.resolver.describe())

    def close(self) -> None:
        """Tear down now (once): consumers see the ring finished; segment and sockets go."""
        if self._state.closed:
            return
        self._state.closed = True
        self._finalizer()


def _signalled(state: ProducerState, signum: int) -> None:
    """The process dies of `signum` (SIGTERM, see producer_files.on_sigterm) now: its
    consumers read why in the ring's header, as they read a loader's error, rather than
    find a producer gone without a word (which reads as SIGKILL or a crash). Not over a
    ring finished already (the producer ended well, and is joining its consumers)."""
    ring = state.ring
    if ring is None or state.closed or ring.closed or \
            RingInfo.of(ring).state == RingState.FINISHED:
        return
    ring.finish(signal_failure(signum))


def _teardown(server: ControlServer, context: zmq.Context, files: OwnedFiles,
              lock_fd: int, state: ProducerState, release_timeout: float | None) -> None:
    """Finish the ring (with the producer's failure, if it failed), stop the control
    thread (answering consumers that still wait for a ring that never came), unlink the
    segment, the socket file and the lock file, then drop the lock."""
    ring = state.ring
    failure = state.failure
    try:
        if ring is not None:
            ring.finish(failure)
            wait_gpu_released(ring, release_timeout)
        if failure is not None:
            server.close(farewell=("failed", failure))
        else:
            server.close(farewell=("finished", "closed before publishing its first batch"))
        context.term()
    finally:
        # Whatever happened above (a second Ctrl-C, say), the files must go. The device
        # memory goes only once no consumer maps it (see gpu_release.PoolKeeper).
        if ring is not None and not (gpu_mapped(ring) and POOL_KEEPER.keep(ring)):
            ring.close()
        files.remove()
        forget_on_sigterm(files)
        os.close(lock_fd)
