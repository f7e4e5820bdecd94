"""The producer's listening socket of the control plane, and the TCP connections to it that
have not proved the secret yet.

On TCP any local user can open connections to the producer, each costing it an fd, and
libzmq has no cap on them (and spins when accept() fails for want of fds). So the
producer raises its fd limit, and UnprovenConnections keeps at most UNPROVEN_MAX of the
connections that have not proved the secret (or a quarter of the fd limit), each for
UNPROVEN_TIMEOUT seconds at most. When the table is full, a new connection makes room by
closing the oldest one if that has had UNPROVEN_GRACE seconds to prove itself: a consumer
proves itself milliseconds after it connects, so a table kept full by another user never
keeps a consumer out.

A connection on which the producer answered a challenge is spared by that rule (up to
SPARED_SHARE of the table, the one answered longest ago losing it first): its consumer's
hello, which must come on the same connection, follows within the time its proof takes
(on a loaded machine, more than UNPROVEN_GRACE). Before issue 35 the table closed it, and
the consumer's zmq socket sent the hello on a new connection, where it answered no
challenge and was refused. A spared connection is still closed after UNPROVEN_TIMEOUT; a
hello that answers no challenge on its connection is asked to challenge again
("rechallenge"), and the consumer does (tensorsocket.control.client), which also tries a
closed connection again after 10 ms, not libzmq's 100 ms, and sends its challenge again
every 0.25 s.

A new connection that finds the table full of younger ones waits beyond it (up to
OVERFLOW_SHARE of the table more) for OVERFLOW_WAIT seconds: a challenge on it in that
time moves it into the table, spared; else it is closed. Only when that too is full is a
new connection closed at once. Closed at once, a churning user's connection came back
at once, and the producer spent a core accepting and closing ~14,000 connections a second
from another user holding 300 (8% of a core now); and a consumer's connection stood the
same small chance of a place as each of them.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import struct
import time
from collections import OrderedDict

import zmq

from .channel import control_socket
from .endpoints import holder_note
from ..errors import TensorSocketError

log = logging.getLogger("tensorsocket")

HANDSHAKE_IVL_MS = 5000  # libzmq closes a connection that has not greeted by then
UNPROVEN_MAX = 256
UNPROVEN_TIMEOUT = 10.0
UNPROVEN_GRACE = 1.0
SPARED_SHARE = 0.25  # of the table: answered connections spared by the cap (see above)
OVERFLOW_SHARE = 0.5  # of the table: connections kept beyond it for OVERFLOW_WAIT (above)
OVERFLOW_WAIT = 0.25
_EVENT = struct.Struct("=HI")  # a libzmq monitor event's first frame: event, value (the fd)


def listen(context: zmq.Context, address: str) -> zmq.Socket:
    """The producer's ROUTER socket, bound to `address` (on TCP with the fd limit raised
    first); TensorSocketError if another process listens there."""
    sock = control_socket(context, zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    # Only ZMTP 3 peers (every consumer): with a ZAP domain set, libzmq refuses ZMTP 1.0
    # and 2.0 greetings (zmtp_engine.cpp, handshake_v1_0*/v2_0: "reject ... if ZAP is
    # enabled"). A ROUTER takes an old peer's first frame as its routing id and asserts
    # that its session took it (process_routing_id_msg: errno_assert), which fails with
    # EAGAIN when the session is being closed meanwhile: random bytes from another user,
    # read as a ZMTP 1.0 greeting on a connection the cap closes, aborted the producer
    # (libzmq 4.3.5, about 1 flood in 8 of test_tcp_flood's). No ZAP handler runs in the
    # producer's context, and without ZAP_ENFORCE_DOMAIN a NULL-mechanism peer is then
    # let in as before (null_mechanism.cpp).
    sock.setsockopt(zmq.ZAP_DOMAIN, b"tensorsocket")
    if not address.startswith("ipc://"):
        _raise_fd_limit()
    try:
        sock.bind(address)
    except zmq.ZMQError as e:
        sock.close(0)
        holder = holder_note(address)  # on TCP: who listens there (another user?)
        raise TensorSocketError(
            f"cannot listen on {address}: {e};"
            + (holder if holder else " is another producer using it?")
            + " Choose another name= or port="
        ) from None
    return sock


def _raise_fd_limit() -> None:
    """Raise this process's soft limit of open files to its hard limit: on TCP any local
    user can open connections to the producer, each costing it an fd, and a producer out
    of fds cannot accept its consumers (nor does libzmq stop trying: it spins). Go's
    runtime does the same at start."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        most = 1 << 20 if hard == resource.RLIM_INFINITY else hard  # 1 << 20: nr_open
        if soft != resource.RLIM_INFINITY and soft < most:
            resource.setrlimit(resource.RLIMIT_NOFILE, (most, hard))
            log.info("raised the open-file limit from %d to %d (TCP control plane)", soft, most)
    except (ValueError, OSError) as e:
        log.debug("could not raise the open-file limit: %s", e)


class UnprovenConnections:
    """The TCP connections to the server's socket not proven yet (see the module docstring),
    from libzmq's monitor of that socket: fd -> (when accepted, the socket's inode: an fd
    number is reused at once), those not answered yet in order of acceptance, those the
    producer answered a challenge on (spared) in order of that answer. Used by the
    server's thread only."""

    def __init__(self, sock: zmq.Socket, events_per_turn: int) -> None:
        self._sock = sock
        self._events_per_turn = events_per_turn  # monitor events read per watch() at most
        self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._max = UNPROVEN_MAX if soft == resource.RLIM_INFINITY else \
            max(8, min(UNPROVEN_MAX, soft // 4))
        self._spared_max = max(1, int(self._max * SPARED_SHARE))
        self._overflow_max = max(1, int(self._max * OVERFLOW_SHARE))
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._port = int(bound.rsplit(":", 1)[1])  # the real one, were it a wildcard
        self._unproven: OrderedDict[int, tuple[float, int]] = OrderedDict()
        self._spared: OrderedDict[int, tuple[float, int]] = OrderedDict()  # answered
        self._overflow: OrderedDict[int, tuple[float, int]] = OrderedDict()  # beyond it
        self.cut = 0  # connections closed for not proving the secret in time (or at all)
        self.accepted = 0  # TCP connections accepted

    @property
    def monitor(self) -> zmq.Socket:
        """The monitor socket, readable when libzmq accepted or closed connections."""
        return self._monitor

    @property
    def count(self) -> int:
        """Connections not proven yet, now, in the table (not those beyond it)."""
        return len(self._unproven) + len(self._spared)

    @property
    def overflow(self) -> int:
        """Connections not proven yet beyond the table, now (see OVERFLOW_WAIT)."""
        return len(self._overflow)

    @property
    def spared(self) -> int:
        """Connections not proven yet that the producer answered a challenge on, now."""
        return len(self._spared)

    def watch(self) -> None:
        """Note the TCP connections libzmq accepted and closed (its monitor's events); a
        new one beyond the cap is closed at once (see UNPROVEN_MAX). A consumer's
        connection closed so before its handshake loses nothing: its zmq socket keeps
        the challenge queued (or sends it again) and connects again (after 10 ms:
        tensorsocket.control.client.RECONNECT_MS), until there is room."""
        for _ in range(self._events_per_turn):
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2 or len(frames[0]) != _EVENT.size:
                continue
            event, fd = _EVENT.unpack(frames[0])
            if event == zmq.EVENT_ACCEPTED:
                self._accepted(fd, time.monotonic())
            elif event == zmq.EVENT_DISCONNECTED:
                self._forget(fd)

    def answered(self, frame: zmq.Frame) -> None:
        """The producer answered a challenge that came in `frame`: its connection is
        spared by the cap (see the module docstring); past the spared share, the one
        answered longest ago is not any more (it is the next to go)."""
        fd = _source_fd(frame)
        if fd is None:
            return
        entry = self._unproven.pop(fd, None) or self._overflow.pop(fd, None)
        if entry is None:
            return  # answered before (a challenge sent again), proven, or gone
        self._spared[fd] = entry
        if len(self._spared) > self._spared_max:
            oldest, old = self._spared.popitem(last=False)
            self._unproven[oldest] = old
            self._unproven.move_to_end(oldest, last=False)

    def proven(self, frame: zmq.Frame) -> None:
        """The connection that `frame` came on proved the secret: it is kept."""
        if self._unproven or self._spared or self._overflow:
            fd = _source_fd(frame)
            if fd is not None:
                self._forget(fd)

    def cut_overflow(self, now: float) -> None:
        """Close the connections beyond the table that no challenge came on within
        OVERFLOW_WAIT."""
        while self._overflow:
            fd, (since, inode) = next(iter(self._overflow.items()))
            if now - since < OVERFLOW_WAIT:
                return
            del self._overflow[fd]
            self._cut(fd, inode)

    def cut_unproven(self, now: float) -> None:
        """Close the connections that have not proved the secret within UNPROVEN_TIMEOUT
        (spared or not)."""
        for table in (self._unproven, self._spared):
            for fd, (since, inode) in list(table.items()):
                if now - since > UNPROVEN_TIMEOUT:
                    del table[fd]
                    self._cut(fd, inode)

    def excuse(self, gap: float, now: float) -> None:
        """The server's thread did not run for `gap` seconds: the proofs of that time may
        still wait unread in the socket, so that time does not count against them."""
        for table in (self._unproven, self._spared, self._overflow):
            for fd, (since, inode) in table.items():
                table[fd] = (min(now, since + gap), inode)

    def close(self) -> None:
        """Stop monitoring the socket (before it is closed)."""
        self._sock.disable_monitor()
        self._monitor.close(0)

    def _forget(self, fd: int) -> None:
        self._unproven.pop(fd, None)
        self._spared.pop(fd, None)
        self._overflow.pop(fd, None)

    def _accepted(self, fd: int, now: float) -> None:
        """Note a new connection on `fd`, making room for it (see UNPROVEN_GRACE): the
        oldest connection not answered goes, never a spared one (there is always one
        not spared in a full table: see SPARED_SHARE). Where none may go yet, the new
        one waits beyond the table for OVERFLOW_WAIT (see the module docstring), or, that
        full too, is closed at once."""
        self.accepted += 1
        self._forget(fd)
        try:
            inode = os.fstat(fd).st_ino
        except OSError:
            return  # closed already
        while self.count >= self._max and self._unproven:
            oldest, (since, oldest_inode) = next(iter(self._unproven.items()))
            if now - since < UNPROVEN_GRACE:
                break  # the others may be consumers proving themselves
            del self._unproven[oldest]
            self._cut(oldest, oldest_inode)
        if self.count < self._max:
            self._unproven[fd] = (now, inode)
        elif len(self._overflow) < self._overflow_max:
            self._overflow[fd] = (now, inode)
        else:
            self._cut(fd, inode)

    def _cut(self, fd: int, inode: int) -> None:
        """Make libzmq close the accepted connection on `fd` (it reads its end): ROUTER
        has no call that closes one peer. Only the socket accepted then (its inode: the fd
        number may have been reused since), a TCP socket on our port, is touched."""
        try:
            if os.fstat(fd).st_ino != inode:
                return  # closed, and the number reused since
            sock = socket.socket(fileno=fd)  # no new fd: a view of libzmq's
        except OSError:
            return  # closed meanwhile, and no socket now
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and \
                    sock.getsockname()[1] == self._port:
                sock.shutdown(socket.SHUT_RDWR)
                self.cut += 1
        except OSError:
            pass
        finally:
            sock.detach()


def _source_fd(frame: zmq.Frame) -> int | None:
    """The fd of the connection that `frame` came on (None: libzmq does not say)."""
    try:
        return frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
