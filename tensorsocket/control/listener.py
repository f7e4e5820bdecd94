"""The producer's listening socket of the control plane, and the TCP connections to it that
have not proved the secret yet.

On TCP any local user can open connections to the producer, each costing it an fd, and
libzmq has no cap on them (and spins when accept() fails for want of fds). So the
producer raises its fd limit, and UnprovenConnections keeps at most UNPROVEN_MAX of the
connections that have not proved the secret (or a quarter of the fd limit), each for
UNPROVEN_TIMEOUT seconds at most. When the table is full, a new connection makes room by
closing the oldest one if that has had UNPROVEN_GRACE seconds to prove itself (else the
new one is closed): a consumer proves itself milliseconds after it connects, so a table
kept full by another user never keeps a consumer out.
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
from ..errors import TensorSocketError

log = logging.getLogger("tensorsocket")

HANDSHAKE_IVL_MS = 5000  # libzmq closes a connection that has not greeted by then
UNPROVEN_MAX = 256
UNPROVEN_TIMEOUT = 10.0
UNPROVEN_GRACE = 1.0
_EVENT = struct.Struct("=HI")  # a libzmq monitor event's first frame: event, value (the fd)


def listen(context: zmq.Context, address: str) -> zmq.Socket:
    """The producer's ROUTER socket, bound to `address` (on TCP with the fd limit raised
    first); TensorSocketError if another process listens there."""
    sock = control_socket(context, zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    if not address.startswith("ipc://"):
        _raise_fd_limit()
    try:
        sock.bind(address)
    except zmq.ZMQError as e:
        sock.close(0)
        raise TensorSocketError(
            f"cannot listen on {address}: {e}; is another producer using it? "
            "choose another name= or port="
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
    number is reused at once). Used by the server's thread only."""

    def __init__(self, sock: zmq.Socket, events_per_turn: int) -> None:
        self._sock = sock
        self._events_per_turn = events_per_turn  # monitor events read per watch() at most
        self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._max = UNPROVEN_MAX if soft == resource.RLIM_INFINITY else \
            max(8, min(UNPROVEN_MAX, soft // 4))
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._port = int(bound.rsplit(":", 1)[1])  # the real one, were it a wildcard
        self._unproven: OrderedDict[int, tuple[float, int]] = OrderedDict()
        self.cut = 0  # connections closed for not proving the secret in time (or at all)

    @property
    def monitor(self) -> zmq.Socket:
        """The monitor socket, readable when libzmq accepted or closed connections."""
        return self._monitor

    @property
    def count(self) -> int:
        """Connections not proven yet, now."""
        return len(self._unproven)

    def watch(self) -> None:
        """Note the TCP connections libzmq accepted and closed (its monitor's events); a
        new one beyond the cap is closed at once (see UNPROVEN_MAX). A consumer's
        connection closed so before its handshake loses nothing: its zmq socket keeps
        the challenge queued and connects again (every 100 ms), until there is room."""
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
                self._unproven.pop(fd, None)

    def proven(self, frame: zmq.Frame) -> None:
        """The connection that `frame` came on proved the secret: it is kept."""
        if self._unproven:
            try:
                self._unproven.pop(frame.get(zmq.SRCFD), None)
            except zmq.ZMQError:
                pass

    def cut_unproven(self, now: float) -> None:
        """Close the connections that have not proved the secret within UNPROVEN_TIMEOUT."""
        while self._unproven:
            fd, (since, inode) = next(iter(self._unproven.items()))
            if now - since <= UNPROVEN_TIMEOUT:
                return
            del self._unproven[fd]
            self._cut(fd, inode)

    def excuse(self, gap: float, now: float) -> None:
        """The server's thread did not run for `gap` seconds: the proofs of that time may
        still wait unread in the socket, so that time does not count against them."""
        for fd, (since, inode) in self._unproven.items():
            self._unproven[fd] = (min(now, since + gap), inode)

    def close(self) -> None:
        """Stop monitoring the socket (before it is closed)."""
        self._sock.disable_monitor()
        self._monitor.close(0)

    def _accepted(self, fd: int, now: float) -> None:
        """Note a new connection on `fd`, making room for it (see UNPROVEN_GRACE)."""
        self._unproven.pop(fd, None)
        try:
            inode = os.fstat(fd).st_ino
        except OSError:
            return  # closed already
        if len(self._unproven) >= self._max:
            oldest, (since, oldest_inode) = next(iter(self._unproven.items()))
            if now - since < UNPROVEN_GRACE:
                self._cut(fd, inode)  # the others may be consumers proving themselves
                return
            del self._unproven[oldest]
            self._cut(oldest, oldest_inode)
        self._unproven[fd] = (now, inode)

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
