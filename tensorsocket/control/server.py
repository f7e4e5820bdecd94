"""The control plane over pyzmq: ROUTER in the producer, DEALER per consumer.

Only handshakes, heartbeats and leaves travel here; batches never do. Messages
are read and built as the typed messages of tensorsocket.control.protocol. The
producer's server runs in a background thread that owns its socket; it
answers consumers even while the producer's main thread is blocked waiting
for a free slot.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import zmq

from .. import _core, config
from ..data import diagnosis
from . import protocol
from .auth import ClientSecret, Gate, is_nonce, new_nonce
from ..errors import (
    AuthenticationError,
    ProducerFailed,
    ProducerFinished,
    ProducerNotFound,
    ProtocolError,
    TensorSocketError,
    VersionMismatch,
)

log = logging.getLogger("tensorsocket")

_M = TypeVar("_M", bound=protocol.Message)  # the message type a consumer waits for

HEARTBEAT_INTERVAL = 1.0  # seconds between consumer heartbeats
HEARTBEAT_TIMEOUT = config.SETTINGS["heartbeat_timeout"].default  # then a consumer is evicted
PENDING_TIMEOUT = 10.0  # a consumer that never says "ready" is dropped after this
GROUP_TIMEOUT = 60.0  # the ranks of a group wait this long for each other to attach
LIVENESS_INTERVAL = 0.25  # how often the server checks consumer processes
MAX_ERROR_CHARS = 1000  # error replies stay well inside the protocol's string limit
LAG_WARN_AFTER = 10.0  # seconds a consumer may hold the others back before a warning
HELD_WARN_AFTER = 30.0  # seconds the producer may wait for a slot a consumer read and keeps
FAREWELL_LINGER_MS = 1000  # how long a closing server tries to deliver its farewells
REFUSAL_WARNINGS = 3  # refused hellos logged as warnings; later ones at debug level
# A peer's flood must not starve the server's own checks: it handles at most
# MESSAGES_PER_TURN messages per turn of its loop, and pauses FLOOD_PAUSE seconds after
# a turn that had more (libzmq then holds the rest, and TCP slows the sender), so it
# reads at most MESSAGES_PER_TURN / FLOOD_PAUSE messages a second; it takes them from
# every connection in turn, so a consumer's heartbeat waits for one turn at most.
MESSAGES_PER_TURN = 100
FLOOD_PAUSE = 0.02
# Error replies to a connection that is no consumer: REFUSAL_BURST at once, then
# REFUSAL_RATE a second; the others are dropped unanswered (counted in .dropped).
REFUSAL_RATE = 20.0
REFUSAL_BURST = 100.0
REFUSAL_PEERS = 4096  # connections whose refusals are counted (the oldest go first)
HANDSHAKE_IVL_MS = 5000  # libzmq closes a connection that has not greeted by then
# TCP connections that have not proved the secret yet (any local user can open them, and
# each costs the producer an fd; libzmq has no cap, and spins when accept() fails for
# want of fds): at most UNPROVEN_MAX of them, or a quarter of the fd limit, are kept,
# each for UNPROVEN_TIMEOUT seconds at most. When the table is full, a new connection
# makes room by closing the oldest one if that has had UNPROVEN_GRACE seconds to prove
# itself (else the new one is closed): a consumer proves itself milliseconds after it
# connects, so a table kept full by another user never keeps a consumer out.
UNPROVEN_MAX = 256
UNPROVEN_TIMEOUT = 10.0
UNPROVEN_GRACE = 1.0
CHALLENGE_AGAIN = 1.0  # seconds a consumer waits for the proof before it challenges again
_EVENT = struct.Struct("=HI")  # a libzmq monitor event's first frame: event, value (the fd)
# A consumer that has read no batch at all since it started, while the others wait for
# it (it is the whole ring behind), is detached after this (None: never); a
# TensorConsumer so detached attaches again as a late joiner when its loop starts. A
# consumer that read and then stops is waited for (lossless) until max_lag or
# heartbeat_timeout.
UNREAD_TIMEOUT: float | None = 300.0


@dataclass
class _Peer:
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
    unread_since: float | None = None  # holding the others back having read nothing


class ControlServer:
    """Producer side: answers handshakes, heartbeats and leaves in a thread.

    welcome_info() supplies the handshake reply fields; ring() the ring once
    it exists (hellos that arrive before are answered when it does). A hello is
    admitted only from a peer that tensorsocket.control.auth lets in (secret: what a peer
    without credentials must present, None: nothing). A consumer not heard from for
    heartbeat_timeout seconds (None: never) is evicted.
    """

    def __init__(
        self,
        context: zmq.Context,
        address: str,
        ring: Callable[[], Any],
        welcome_info: Callable[[], dict],
        park_hold: float = 0.0,
        secret: str | None = None,
        heartbeat_timeout: float | None = HEARTBEAT_TIMEOUT,
    ) -> None:
        self._ring = ring
        self.park_hold = park_hold
        self.heartbeat_timeout = heartbeat_timeout
        self._gate = Gate(address, secret)
        self._welcome_info = welcome_info
        self._sock = context.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        if not address.startswith("ipc://"):
            _raise_fd_limit()
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self._sock.close(0)
            raise TensorSocketError(
                f"cannot listen on {address}: {e}; is another producer using it? "
                "choose another name= or port="
            ) from None
        self.address = address
        # TCP: the connections not proven yet (fd -> (when accepted, the socket's inode: an
        # fd number is reused at once), from libzmq's monitor
        self._monitor: zmq.Socket | None = None
        self._unproven: OrderedDict[int, tuple[float, int]] = OrderedDict()
        self._unproven_max = 0
        self.cut = 0  # connections closed for not proving the secret in time (or at all)
        if not address.startswith("ipc://"):
            self._monitor = self._sock.get_monitor_socket(
                zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            self._unproven_max = UNPROVEN_MAX if soft == resource.RLIM_INFINITY else \
                max(8, min(UNPROVEN_MAX, soft // 4))
            bound = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._port = int(bound.rsplit(":", 1)[1])  # the real one, were it a wildcard
        self._peers: dict[bytes, _Peer] = {}
        # hellos and infos that came before the ring
        self._waiting: list[tuple[bytes, protocol.Hello | protocol.Info]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._farewell: tuple[str, str] | None = None  # see close()
        self.rejected = 0  # malformed messages seen
        self.refused = 0  # hellos not admitted (tensorsocket.control.auth)
        self.dropped = 0  # error replies not sent: the peer was refused too often
        self._refusals: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # (allowance, at)
        self._held: tuple[int, float, bool] = (-1, 0.0, False)  # (published, since, warned)
        # the messages of a consumer that has a place (each handler takes its own type)
        self._handlers: dict[str, Callable[[bytes, Any], None]] = {"ready": self._ready,
                          "heartbeat": self._heartbeat, "bye": self._bye,
                          "park": self._park, "unpark": self._unpark}
        self._thread = threading.Thread(target=self._run, name="tensorsocket-control", daemon=True)
        self._thread.start()

    # -- thread ----------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        next_check = 0.0
        last = time.monotonic()
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if self._monitor in ready:
                    self._watch_connections()
                if self._sock in ready and self._drain(MESSAGES_PER_TURN):
                    self._stop.wait(FLOOD_PAUSE)  # more are waiting: a flood (see above)
                now = time.monotonic()
                if now - last > HEARTBEAT_INTERVAL:
                    self._excuse(now - last, now)
                last = now
                if self._waiting and self._ring() is not None:
                    waiting, self._waiting = self._waiting, []
                    for ident, msg in waiting:
                        self._answer(ident, msg)
                if now >= next_check:
                    next_check = now + LIVENESS_INTERVAL
                    self._gate.forget(now)
                    if self._monitor is not None:
                        self._watch_connections()  # closes first: an fd may be reused
                        self._cut_unproven(now)
                    self._check_peers(now)
        except Exception:  # the thread must never die silently
            log.exception("tensorsocket control thread failed")
        finally:
            said = self._say_farewell()
            if self._monitor is not None:
                self._sock.disable_monitor()
                self._monitor.close(0)
            self._sock.close(FAREWELL_LINGER_MS if said else 0)

    def _say_farewell(self) -> bool:
        """The producer closes before its ring exists: answer the hellos waiting for it
        with the farewell error (see close()) rather than leave those consumers waiting
        out their timeout. Whether any was sent."""
        if self._farewell is None or self._ring() is not None:
            return False
        try:
            self._drain()  # hellos that came in the meantime
        except zmq.ZMQError:
            pass
        code, message = self._farewell
        waiting, self._waiting = self._waiting, []
        for ident, _ in waiting:
            self._send(ident, protocol.Error(code, message))
        return bool(waiting)

    def _watch_connections(self) -> None:
        """Note the TCP connections libzmq accepted and closed (its monitor's events); a
        new one beyond the cap is closed at once (see UNPROVEN_MAX). A consumer's
        connection closed so before its handshake loses nothing: its zmq socket keeps
        the challenge queued and connects again (every 100 ms), until there is room."""
        monitor = self._monitor
        assert monitor is not None  # polled only when there is one
        for _ in range(10 * MESSAGES_PER_TURN):
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2 or len(frames[0]) != _EVENT.size:
                continue
            event, fd = _EVENT.unpack(frames[0])
            if event == zmq.EVENT_ACCEPTED:
                self._accepted(fd, time.monotonic())
            elif event == zmq.EVENT_DISCONNECTED:
                self._unproven.pop(fd, None)

    def _accepted(self, fd: int, now: float) -> None:
        """Note a new connection on `fd`, making room for it (see UNPROVEN_GRACE)."""
        self._unproven.pop(fd, None)
        try:
            inode = os.fstat(fd).st_ino
        except OSError:
            return  # closed already
        if len(self._unproven) >= self._unproven_max:
            oldest, (since, oldest_inode) = next(iter(self._unproven.items()))
            if now - since < UNPROVEN_GRACE:
                self._cut(fd, inode)  # the others may be consumers proving themselves
                return
            del self._unproven[oldest]
            self._cut(oldest, oldest_inode)
        self._unproven[fd] = (now, inode)

    def _cut_unproven(self, now: float) -> None:
        """Close the connections that have not proved the secret within UNPROVEN_TIMEOUT."""
        while self._unproven:
            fd, (since, inode) = next(iter(self._unproven.items()))
            if now - since <= UNPROVEN_TIMEOUT:
                return
            del self._unproven[fd]
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

    def _excuse(self, gap: float, now: float) -> None:
        """This thread did not run for `gap` seconds (the producer was stopped, or
        starved): the consumers' heartbeats of that time may still wait unread in the
        socket, so it does not count as their silence."""
        with self._lock:
            for peer in self._peers.values():
                peer.last_seen = min(now, peer.last_seen + gap)
        for fd, (since, inode) in self._unproven.items():  # their proofs may be unread too
            self._unproven[fd] = (min(now, since + gap), inode)

    def _drain(self, budget: int | None = None) -> bool:
        """Handle the messages waiting on the socket, `budget` of them at most (None:
        all); whether some were left waiting."""
        while budget is None or budget > 0:
            if budget is not None:
                budget -= 1
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            if len(frames) != 2:
                self.rejected += 1
                continue
            ident, payload = frames[0].bytes, frames[1].bytes
            try:
                msg = protocol.read(payload)
            except ProtocolError as e:
                self.rejected += 1
                log.debug("rejected control message: %s", e)
                version = protocol.foreign_hello(payload)
                if version is not None:
                    self._send(ident, protocol.Error("version", _version_message(version)))
                else:
                    self._send(ident, protocol.Error("protocol", str(e)))
                continue
            if isinstance(msg, protocol.Challenge):
                self._challenge(ident, msg)
                continue
            if isinstance(msg, (protocol.Hello, protocol.Info)):
                self._admit(ident, msg, frames[1])
                continue
            handler = self._handlers.get(msg.kind)
            if handler is None:
                self.rejected += 1
                self._send(ident, protocol.Error("protocol",
                                                 f"{msg.kind} is not a consumer message"))
                continue
            try:
                handler(ident, msg)
            except Exception as e:  # a message must never take the control thread down
                self.rejected += 1
                log.warning("control message %s failed: %s: %s", msg.kind,
                            type(e).__name__, e)
                self._send(ident, protocol.Error("protocol",
                                                 f"{msg.kind} failed: {type(e).__name__}"))
        return bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def _send(self, ident: bytes, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.Error):
            if ident not in self._peers and not self._may_refuse(ident):
                self.dropped += 1
                return
            msg = protocol.Error(msg.code, msg.message[:MAX_ERROR_CHARS])
        try:
            self._sock.send_multipart([ident, msg.encode()], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer is gone or its queue is full: it will time out

    def _may_refuse(self, ident: bytes) -> bool:
        """Whether an error reply to `ident`, no consumer, is within its allowance
        (REFUSAL_BURST, refilled at REFUSAL_RATE a second): a flood of refused messages
        gets a few answers, then none, each costing no more than its reading."""
        now = time.monotonic()
        allowance, at = self._refusals.pop(ident, (REFUSAL_BURST, now))
        allowance = min(REFUSAL_BURST, allowance + (now - at) * REFUSAL_RATE)
        self._refusals[ident] = (allowance - 1, now)
        while len(self._refusals) > REFUSAL_PEERS:
            self._refusals.popitem(last=False)
        return allowance >= 1

    def _peer(self, ident: bytes, msg: protocol.Placed) -> _Peer | None:
        """The peer this message claims to be, if it really is that peer."""
        peer = self._peers.get(ident)
        if peer is None or peer.index != msg.consumer or peer.token != msg.token:
            self.rejected += 1
            self._send(ident, protocol.Error("unknown", "no such consumer on this socket"))
            return None
        peer.last_seen = time.monotonic()
        return peer

    # -- messages ----------------------------------------------------------------

    def _challenge(self, ident: bytes, msg: protocol.Challenge) -> None:
        """A consumer's challenge, before its hello: answered with this producer's own
        nonce and its proof that it knows the secret (tensorsocket.control.auth)."""
        if msg.protocol != protocol.PROTOCOL_VERSION:
            self.rejected += 1
            self._send(ident, protocol.Error("version", _version_message(msg.protocol)))
            return
        if not is_nonce(msg.nonce):
            self.rejected += 1
            self._send(ident, protocol.Error("protocol", "challenge with a bad nonce"))
            return
        nonce, proof = self._gate.challenge(ident, msg.nonce)
        self._send(ident, protocol.Proof(nonce=nonce, mac=proof))

    def _admit(self, ident: bytes, msg: protocol.Hello | protocol.Info, frame: zmq.Frame) -> None:
        """A hello (or an info): answered if it is well formed, of this protocol version
        and from a peer tensorsocket.control.auth lets in; refused with an error that tells nothing
        of the producer otherwise."""
        if not 0 < msg.pid < 2**31 or not 0 <= msg.start_time < 2**64:
            self.rejected += 1
            self._send(ident, protocol.Error("protocol", f"{msg.kind} with an impossible pid"))
            return
        if msg.protocol != protocol.PROTOCOL_VERSION:
            self.rejected += 1
            log.warning("consumer pid %s speaks protocol %s, this producer %s",
                        msg.pid, msg.protocol, protocol.PROTOCOL_VERSION)
            self._send(ident, protocol.Error("version", _version_message(msg.protocol)))
            return
        refusal = self._gate.refusal(ident, frame, msg)
        if refusal is not None:
            self.rejected += 1
            self.refused += 1
            log.log(logging.WARNING if self.refused <= REFUSAL_WARNINGS else logging.DEBUG,
                    "refused a %s (claiming pid %d)%s: %s", msg.kind, msg.pid,
                    " (later refusals are logged at debug level)"
                    if self.refused == REFUSAL_WARNINGS else "", refusal)
            self._send(ident, protocol.Error("auth", refusal))
            return
        if self._unproven:
            try:
                self._unproven.pop(frame.get(zmq.SRCFD), None)  # proven: kept
            except zmq.ZMQError:
                pass
        try:
            self._answer(ident, msg)
        except Exception as e:  # a message must never take the control thread down
            self.rejected += 1
            log.warning("control message %s failed: %s: %s", msg.kind, type(e).__name__, e)
            self._send(ident, protocol.Error("protocol", f"{msg.kind} failed: {type(e).__name__}"))

    def _answer(self, ident: bytes, msg: protocol.Hello | protocol.Info) -> None:
        """An admitted hello or info, answered once the ring exists (before it, a loader
        callable's loader is not known yet, nor is the segment)."""
        if self._ring() is None:
            self._waiting.append((ident, msg))
        elif isinstance(msg, protocol.Info):
            info = self._welcome_info()
            self._send(ident, protocol.LoaderInfo(
                protocol=protocol.PROTOCOL_VERSION,
                **{f: info[f] for f in protocol.SCHEMAS["loader_info"] if f != "protocol"}))
        else:
            self._hello(ident, msg)

    def _hello(self, ident: bytes, msg: protocol.Hello) -> None:
        """An admitted hello, once the ring exists: reserve an entry and answer welcome."""
        ring = self._ring()
        if ident in self._peers:
            self._retire(ident)
        try:
            index, token = ring.reserve(msg.pid, msg.start_time, msg.batch_size or 0)
        except _core.TooManyConsumers as e:
            self._send(ident, protocol.Error("full", str(e)))
            return
        with self._lock:
            group = None
        if msg.world_size > 1:
            if not 0 <= msg.rank < msg.world_size <= _core.MAX_CONSUMERS:
                ring.retire(index)
                self.rejected += 1
                self._send(ident, protocol.Error(
                    "protocol", "hello with an impossible rank or world size"))
                return
            group = f"{msg.group or ''}/{msg.world_size}"
        with self._lock:
            self._peers[ident] = _Peer(index, token, msg.pid, msg.start_time,
                                       time.monotonic(), msg.batch_size, group=group,
                                       rank=msg.rank)
        self._send(ident, protocol.Welcome(protocol=protocol.PROTOCOL_VERSION, consumer=index,
                                           token=token, **self._welcome_info()))

    def _ready(self, ident: bytes, msg: protocol.Ready) -> None:
        peer = self._peer(ident, msg)
        if peer is None:
            return
        ring = self._ring()
        if peer.active or ring is None:
            return
        if peer.group is not None:
            peer.ready_align = msg.align
            self._start_group(peer.group, time.monotonic())
            return
        start = ring.activate(peer.index, msg.align)
        self._started(ident, peer, start, msg.align)

    def _started(self, ident: bytes, peer: _Peer, start: int, align: bool) -> None:
        """The consumer receives entries from `start` on: tell it."""
        ring = self._ring()
        peer.active = True
        peer.start_seq = start
        peer.last_seen = time.monotonic()  # its heartbeats start now (a rank waited for its group)
        self._restart_holds(time.monotonic())
        log.info("consumer %d (pid %d%s) joined at entry %d (%d published%s)", peer.index,
                 peer.pid, "" if peer.group is None else f", rank {peer.rank} of {peer.group}",
                 start, ring.info()["published"], ", aligned" if align else "")
        self._send(ident, protocol.Started(start_seq=start))

    def _start_group(self, group: str, now: float) -> None:
        """Start the ranks of `group` that said ready, all at the same entry, once every
        rank said so (or GROUP_TIMEOUT after the first): ranks that start at different
        entries could read different epochs, and a data-parallel job then hangs in its
        collectives. The first rank's bits keep the entry in the ring for the others."""
        with self._lock:
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

    def _heartbeat(self, ident: bytes, msg: protocol.Heartbeat) -> None:
        self._peer(ident, msg)

    def _bye(self, ident: bytes, msg: protocol.Bye) -> None:
        if self._peer(ident, msg) is None:
            return
        self._retire(ident)
        self._send(ident, protocol.ByeOk())

    def _park(self, ident: bytes, msg: protocol.Park) -> None:
        """The consumer stopped reading: take it off the ring so that nobody waits for
        it, but keep it as a consumer of this producer (its heartbeats go on) until it
        attaches again or leaves. One that stopped between epochs (hold), to read
        another loader for a while (a validation loop), keeps its place in the ring for
        park_hold seconds once others read again: the entries from the next epoch's
        first on stay there, so that it reads the same epochs as the jobs it started
        with, not a later one because it came back a moment after them."""
        peer = self._peer(ident, msg)
        ring = self._ring()
        if peer is None or ring is None:
            return
        if peer.parked:
            if not msg.hold and peer.held_until is not None:
                self._give_up_place(ring, peer)
            return
        peer.parked = True
        peer.active = False
        if msg.hold and self.park_hold > 0 and \
                ring.consumer(peer.index)["state"] == _core.CONSUMER_ACTIVE:
            if msg.skip_epoch:  # left its epoch with break: its place is the next one's
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

    def _give_up_place(self, ring: Any, peer: _Peer) -> None:
        """A consumer parked keeping its place gives it up before park_hold ran out: its
        process waits, through another loader, for a job that waits for this place (a
        cycle of waits between two jobs out of phase, which only park_hold would end
        otherwise; see consumer._park_idle_siblings). It attaches again at a later
        epoch start when it reads again."""
        peer.held_until = None
        ring.retire(peer.index)
        log.info("consumer %d (pid %d) gave up its place: its process waits for a job that "
                 "waits for this place (it starts at a later epoch when it reads again)",
                 peer.index, peer.pid)

    def _unpark(self, ident: bytes, msg: protocol.Unpark) -> None:
        """A parked consumer reads again: it goes on from its place if that was kept."""
        peer = self._peer(ident, msg)
        ring = self._ring()
        if peer is None or ring is None:
            return
        held = peer.held_until is not None and \
            ring.consumer(peer.index)["state"] == _core.CONSUMER_ACTIVE
        if held:
            peer.held_until = None
            peer.parked = False
            peer.active = True
            self._restart_holds(time.monotonic())
            log.info("consumer %d (pid %d) reads again from its place", peer.index, peer.pid)
        self._send(ident, protocol.Unparked(held=held))

    def _restart_holds(self, now: float) -> None:
        """A consumer reads again: the places kept for parked ones hold it back from now
        on, for park_hold seconds at most (while all are parked, nobody waits)."""
        for peer in list(self._peers.values()):
            if peer.held_until is not None:
                peer.held_until = max(peer.held_until, now + self.park_hold)

    def _check_holds(self, ring: Any, now: float) -> None:
        """Give up the places of consumers parked longer than park_hold while others
        read: they would hold those back; they attach again at a later epoch."""
        if not any(p.active for p in self._peers.values()):
            return
        for peer in list(self._peers.values()):
            if peer.held_until is not None and now >= peer.held_until:
                peer.held_until = None
                ring.retire(peer.index)
                log.info("consumer %d (pid %d) stayed parked longer than park_hold=%s s "
                         "while others read; its place is given up (it starts at a later "
                         "epoch when it reads again)", peer.index, peer.pid, self.park_hold)

    def _retire(self, ident: bytes) -> None:
        with self._lock:
            peer = self._peers.pop(ident, None)
        ring = self._ring()
        if peer is not None and ring is not None and \
                (not peer.parked or peer.held_until is not None):
            ring.retire(peer.index)
            log.info("consumer %d (pid %d) left", peer.index, peer.pid)

    def _check_peers(self, now: float) -> None:
        """Evict consumers whose process died, and those not heard from for
        heartbeat_timeout; note consumers the ring detached for lagging; drop handshakes
        never finished."""
        ring = self._ring()
        if ring is None:
            return
        self._check_lag(ring, now)
        self._check_held(ring, now)
        self._check_holds(ring, now)
        for ident, peer in list(self._peers.items()):
            if peer.active and not peer.detached and \
                    ring.consumer(peer.index)["state"] == _core.CONSUMER_DETACHED:
                peer.detached = True  # _check_unread's detaches are logged there
                log.warning("consumer %d (pid %d) fell more than max_lag batches behind and "
                            "was detached", peer.index, peer.pid)
            if not _core.process_alive(peer.pid, peer.start_time):
                with self._lock:
                    self._peers.pop(ident, None)
                if not peer.parked or peer.held_until is not None:
                    ring.evict(peer.index)
                log.warning("consumer %d (pid %d) died; its slots were released",
                            peer.index, peer.pid)
            elif self._silent(peer, now):
                self._evict_silent(ring, ident, peer, now)
            elif peer.group is not None and peer.ready_align is not None:
                self._start_group(peer.group, now)
            elif not peer.active and not peer.parked and now - peer.since > PENDING_TIMEOUT:
                self._retire(ident)
        # A consumer that said bye while still holding batches is no peer any more, but
        # its entry keeps its bits in those slots until the views die. If its process
        # exits first (a script ending with its last batch in a variable), nobody would
        # clear them and the producer would wait for those slots forever. Only this
        # thread reserves entries, so an entry seen LEAVING here cannot be reused meanwhile.
        for entry in ring.consumers():
            if entry["state"] == _core.CONSUMER_LEAVING and \
                    not _core.process_alive(entry["pid"], entry["start_time"]):
                ring.evict(entry["index"])
                log.info("consumer %d (pid %d) exited after leaving, still holding batches; "
                         "its slots were released", entry["index"], entry["pid"])

    def _silent(self, peer: _Peer, now: float) -> bool:
        """Whether a consumer whose heartbeat thread runs (it started reading, or parked)
        has not been heard from for heartbeat_timeout. One still in its handshake sends
        none yet: PENDING_TIMEOUT and GROUP_TIMEOUT bound that."""
        return self.heartbeat_timeout is not None and (peer.active or peer.parked) and \
            now - peer.last_seen > self.heartbeat_timeout

    def _evict_silent(self, ring: Any, ident: bytes, peer: _Peer, now: float) -> None:
        """Take off a consumer whose process lives on but sends nothing (stopped, a step
        holding the GIL, or a client that said hello and went quiet): it reads nothing
        either, so the others would wait for it for ever. It stops receiving (nobody waits
        for it), but the slots it holds stay held while its process lives: it may run
        again and read the batches it kept, which must not be overwritten (the producer
        skips those slots). Its next batch request raises ConsumerDetached, saying why;
        once it exits, its entry and holds go as a left consumer's do (_check_peers)."""
        with self._lock:
            self._peers.pop(ident, None)
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

    def _check_held(self, ring: Any, now: float) -> None:
        """Warn once when the producer has not published for HELD_WARN_AFTER seconds and
        the slot it must reuse next is held by consumers that read its entry and keep it
        alive: a training script keeping batches stalls every consumer."""
        info = ring.info()
        published, slots = info["published"], info["slot_count"]
        readers = ring.slot_readers()[published % slots] if published >= slots else 0
        last, since, warned = self._held
        if published != last or readers == 0 or info["state"] != _core.RING_OPEN:
            self._held = (published, now, False)
            return
        if warned or now - since < HELD_WARN_AFTER:
            return
        holders = diagnosis.next_slot_holders(ring, info)
        if not holders:
            return  # unread by a slow consumer: _check_lag's case
        self._held = (published, since, True)
        log.warning("%s", diagnosis.kept_slot_warning(now - since, holders))

    def _check_lag(self, ring: Any, now: float) -> None:
        """Warn once about a consumer that holds the others back: it has been behind the
        fastest consumer by (nearly) the whole ring for LAG_WARN_AFTER seconds, so the
        producer and every faster consumer wait for it (see diagnosis.lag_behind_fastest;
        with max_lag the ring detaches such a consumer instead, warned about below)."""
        lag = diagnosis.lag_behind_fastest(ring)
        for peer in list(self._peers.values()):
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

    def _check_unread(self, ring: Any, peer: _Peer, holds_back: bool, now: float) -> None:
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
            ring.detach(peer.index, _core.REASON_UNREAD)
            peer.detached = True
            log.warning("consumer %d (pid %d) read no batch at all while the others waited "
                        "for it for %.0f s; it was detached so that they go on",
                        peer.index, peer.pid, now - peer.unread_since)

    # -- owner -------------------------------------------------------------------

    def consumer_count(self) -> int:
        """Consumers attached and receiving now."""
        ring = self._ring()
        with self._lock:
            peers = [p for p in self._peers.values() if p.active]
        if ring is None or ring.closed:
            return len(peers)
        return sum(1 for p in peers
                   if ring.consumer(p.index)["state"] == _core.CONSUMER_ACTIVE)

    def present_count(self) -> int:
        """Consumers of this producer: attached, or parked between epochs."""
        with self._lock:  # a rank waiting for its group, a consumer just saying hello too
            return len(self._peers)

    def batch_sizes(self) -> dict[int, int | None]:
        """Batch size each attached consumer asked for, by consumer index."""
        with self._lock:
            return {p.index: p.batch_size for p in self._peers.values() if not p.parked}

    def close(self, farewell: tuple[str, str] | None = None) -> None:
        """Stop the thread; it closes the socket. farewell: (code, message) of the error
        that consumers still waiting for the ring receive, if there is no ring: code
        "failed" (message: the producer's error) or "finished" (message: how it ended)."""
        self._farewell = farewell
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


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


def _version_message(theirs: int) -> str:
    """The error for a consumer that speaks protocol version `theirs`."""
    return (f"producer speaks protocol {protocol.PROTOCOL_VERSION}, consumer {theirs}: "
            "install the same tensorsocket version on both sides")


class ControlClient:
    """Consumer side: handshake in the caller's thread, then heartbeats in a thread."""

    def __init__(self, context: zmq.Context, address: str, timeout: float | None,
                 secret: ClientSecret | None = None) -> None:
        self.address = address
        self._secret = secret  # the producer's secret, which this consumer proves it knows
        self._sock = context.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        self._sock.connect(address)
        self._timeout = timeout
        self._stop = threading.Event()
        self._leave = threading.Event()  # leave the ring without closing (request_leave)
        self._park = threading.Event()  # park between epochs (request_park)
        self._park_hold = False  # the park asks the producer to keep the place
        self._park_skip = False  # ... at the producer's next epoch
        self._wake = threading.Event()  # cuts the heartbeat thread's wait short
        self._thread: threading.Thread | None = None
        self.consumer = -1
        self.token = 0
        self.left = False  # bye sent for the current consumer entry

    def hello(self, batch_size: int | None, group: str | None = None, rank: int = 0,
              world_size: int = 1, watch: Any = None) -> protocol.Welcome:
        """Send hello; return the welcome, waiting up to the timeout for a producer. On
        TCP the producer must first prove that it knows the secret (see _proof); a
        proof that does not fit makes the consumer read the secret file again (a
        producer that started after the consumer wrote a new one). watch: a
        ProducerWatch, which raises while we wait if the producer died."""
        pid, start_time = self._identity()
        deadline = self._deadline()
        proof = self._proof(deadline, watch)
        msg = self._admission(protocol.Hello(
            protocol=protocol.PROTOCOL_VERSION, pid=pid, start_time=start_time,
            batch_size=batch_size, group=group, rank=rank, world_size=world_size,
            proof=proof), protocol.Welcome, deadline, watch)
        self.consumer, self.token = msg.consumer, msg.token
        self.left = False
        return msg

    def info(self, watch: Any = None) -> protocol.LoaderInfo:
        """What the producer's loader is (its loader_info reply), asked as a hello is but
        taking no place in its ring: nothing to say bye for."""
        pid, start_time = self._identity()
        deadline = self._deadline()
        proof = self._proof(deadline, watch)
        return self._admission(protocol.Info(protocol=protocol.PROTOCOL_VERSION, pid=pid,
                                             start_time=start_time, proof=proof),
                               protocol.LoaderInfo, deadline, watch)

    @staticmethod
    def _identity() -> tuple[int, int]:
        """This process's pid and start time, which a hello and an info carry."""
        pid = os.getpid()
        return pid, _core.process_start_time(pid)

    def _deadline(self) -> float | None:
        """When a producer must have answered (None: no timeout)."""
        return None if self._timeout is None else time.monotonic() + self._timeout

    def _admission(self, msg: protocol.Hello | protocol.Info, want: type[_M],
                   deadline: float | None, watch: Any) -> _M:
        """Send a hello or an info (with this process's identity and its proof of the
        producer's secret, once the producer proved it knows it: see _proof); the reply
        of type `want`, waiting until `deadline` for a producer (see hello)."""
        self._sock.send(msg.encode())
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        reply = self._receive(left, want, watch)
        if reply is None:
            raise self._not_found(watch)
        return reply

    def _proof(self, deadline: float | None, watch: Any) -> str | None:
        """Challenge the producer, check its proof that it knows the secret, and return
        this consumer's answer for the hello (tensorsocket.control.auth); nothing of the secret
        is sent before the producer proved itself. None: nothing to prove (an ipc
        endpoint without a secret, where the peer's credentials decide)."""
        secret = self._secret
        if secret is None:
            return None
        known = secret.current()
        if known is None and not secret.tcp:
            return None
        nonce = new_nonce()
        challenge = protocol.Challenge(protocol=protocol.PROTOCOL_VERSION, nonce=nonce).encode()
        try:
            while True:
                # Sent again while no answer comes: a connection the producer closed (its
                # table of unproven connections was full) may have taken it along.
                self._sock.send(challenge)
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                step = CHALLENGE_AGAIN if left is None else min(CHALLENGE_AGAIN, left)
                reply = self._receive(step, protocol.Proof, watch)
                if reply is not None or (left is not None and step >= left):
                    break
        except VersionMismatch:
            raise
        except TensorSocketError as e:
            if "challenge" not in str(e):
                raise
            raise VersionMismatch(
                f"the producer at {self.address} does not know this consumer's challenge: it "
                "speaks an older protocol; install the same tensorsocket version on both "
                "sides") from None
        if reply is None:
            raise self._not_found(watch)
        return secret.answer(self.address, nonce, reply, known)

    def _not_found(self, watch: Any) -> ProducerNotFound:
        """The error for a producer that did not answer within the timeout."""
        return ProducerNotFound(
            f"no tensorsocket producer answered at {self.address} within {self._timeout} s; "
            "start the producer (same name=/port=) or raise the consumer's timeout="
            + (watch.note() if watch is not None else ""))

    def ready(self, align: bool = False, group: bool = False) -> int:
        """Tell the producer we mapped the ring; return our first sequence number (align:
        start at the current epoch's first entry if it is still in the ring)."""
        self._sock.send(protocol.Ready(self.consumer, self.token, align=bool(align)).encode())
        msg = self._receive(PENDING_TIMEOUT + (GROUP_TIMEOUT if group else 0), protocol.Started)
        if msg is None:
            raise ProducerNotFound(f"the producer at {self.address} stopped answering")
        return msg.start_seq

    def _receive(self, timeout: float | None, want: type[_M], watch: Any = None) -> _M | None:
        """The next message of type want; raises on an error reply; None on timeout.
        watch: see hello()."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            wait_ms = 100 if left is None else max(1, min(100, int(left * 1000)))
            if not self._sock.poll(wait_ms):
                if watch is not None:
                    try:
                        watch.check()
                    except TensorSocketError:
                        if self._sock.poll(250):
                            continue  # the producer's last answer (its farewell) came: read it
                        raise
                continue
            try:
                msg = protocol.read(self._sock.recv())
            except ProtocolError as e:
                raise ProtocolError(f"bad reply from the producer at {self.address}: {e}") from None
            if isinstance(msg, protocol.Error):
                raise self._refusal(msg.code, msg.message)
            if isinstance(msg, want):
                return msg

    def _refusal(self, code: str, message: str) -> Exception:
        """The exception for an error reply of the producer."""
        if code == "version":
            return VersionMismatch(message)
        if code == "auth":
            note = self._secret.note() if self._secret is not None else ""
            return AuthenticationError(
                f"the producer at {self.address} refused this consumer: {message}"
                + (f" ({note})" if note else ""))
        if code == "unsupported":
            return NotImplementedError(message)
        if code == "failed":
            return ProducerFailed(
                f"the producer at {self.address} failed before its first batch: {message}. "
                "Fix it and start it again, then create the TensorConsumer again",
                cause=message)
        if code == "finished":
            return ProducerFinished(
                f"the producer at {self.address} {message}; no batches will come from it")
        return TensorSocketError(f"producer refused: {message}")

    def start_heartbeats(self) -> None:
        """Hand the socket to a thread that sends heartbeats until stopped."""
        self._stop.clear()
        self._leave.clear()
        self._park.clear()
        self._wake.clear()
        self._thread = threading.Thread(target=self._beat, name="tensorsocket-heartbeat",
                                        daemon=True)
        self._thread.start()

    def request_park(self, hold: bool = False, skip_epoch: bool = False) -> None:
        """Park soon (the heartbeat thread sends it; heartbeats go on); hold: asking the
        producer to keep this consumer's place for a while: where it is (between epochs),
        or (skip_epoch: it left its epoch with break) at the producer's next epoch. Safe
        from any thread, a finalizer included, as it only sets events."""
        self._park_hold = hold
        self._park_skip = skip_epoch
        self._park.set()
        self._wake.set()

    def unpark(self) -> bool:
        """Read again after a park that asked to keep the place: whether the producer
        kept it (go on from it); if not, the caller attaches again."""
        self.stop_heartbeats()  # sends the park if the heartbeat thread had not yet
        self._sock.send(protocol.Unpark(self.consumer, self.token).encode())
        msg = self._receive(PENDING_TIMEOUT, protocol.Unparked)
        if msg is None:
            raise ProducerNotFound(f"the producer at {self.address} stopped answering")
        if msg.held:
            self.start_heartbeats()
        return msg.held

    def request_leave(self) -> None:
        """Leave the ring soon, from the heartbeat thread (which owns the socket): safe
        from any thread, a finalizer included, as it only sets events."""
        self._leave.set()
        self._wake.set()

    def stop_heartbeats(self) -> None:
        """Take the socket back from the heartbeat thread (sending a requested bye)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        if self._leave.is_set() and not self.left:
            self._send_bye()
        elif self._park.is_set():
            self._park.clear()
            try:
                self._sock.send(self._park_message(), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _park_message(self) -> bytes:
        return protocol.Park(self.consumer, self.token, hold=self._park_hold,
                             skip_epoch=self._park_skip).encode()

    def _send_bye(self) -> None:
        try:
            self._sock.send(protocol.Bye(self.consumer, self.token).encode(),
                            zmq.NOBLOCK)
            self.left = True
        except zmq.ZMQError:
            pass

    def _beat(self) -> None:
        beat = protocol.Heartbeat(self.consumer, self.token).encode()
        while True:
            self._wake.wait(HEARTBEAT_INTERVAL)
            self._wake.clear()
            if self._leave.is_set():
                self._send_bye()
                return
            if self._stop.is_set():
                return
            parking = False
            try:
                if self._park.is_set():
                    self._park.clear()
                    parking = True
                    self._sock.send(self._park_message(), zmq.NOBLOCK)
                    parking = False
                self._sock.send(beat, zmq.NOBLOCK)
                while self._sock.poll(0):
                    self._sock.recv()  # nothing is expected; drop stray replies
            except zmq.Again:
                # The queue to the producer is full (it read nothing for a long while, e.g.
                # stopped): beat on, or the producer would evict us once it runs again.
                if parking:
                    self._park.set()  # sent at the next beat
            except zmq.ZMQError:
                return

    def close(self, say_bye: bool, wait: float = 1.0) -> None:
        """Stop heartbeats, say bye (waiting briefly for the ack) and close."""
        self.stop_heartbeats()
        try:
            if say_bye and self.consumer >= 0 and not self.left:
                self._sock.send(protocol.Bye(self.consumer, self.token).encode(),
                                zmq.NOBLOCK)
                try:
                    self._receive(wait, protocol.ByeOk)
                except TensorSocketError:
                    pass
        except zmq.ZMQError:
            pass
        finally:
            self._sock.close(0)
