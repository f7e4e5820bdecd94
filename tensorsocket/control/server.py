"""The producer's end of the control plane: ControlServer, a ROUTER socket the consumers'
ControlClients (tensorsocket.control.client) talk to.

Only handshakes, heartbeats and leaves travel here; batches never do. Messages are read
and built as the typed messages of tensorsocket.control.protocol. The server runs in a
background thread that owns its socket; it answers consumers even while the producer's
main thread is blocked waiting for a free slot. It reads the messages and dispatches
them; the work is done by its parts: the listening socket and its unproven TCP
connections (listener), the checks of the handshake (admission), the table of consumers
(peers), their places in the ring (places), their eviction when gone (liveness) and the
watch for consumers that stall the others (stall_watch).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, cast

import zmq

from .. import config
from ..ring import MAX_CONSUMERS, TooManyConsumers
from . import protocol
from .admission import Admission, RefusalAllowance, version_message
from .auth import Gate
from .channel import HEARTBEAT_INTERVAL
from .listener import UnprovenConnections, listen
from .liveness import Liveness
from .peers import Peer, PeerTable
from .places import Places
from .stall_watch import StallWatch
from ..errors import ProtocolError

log = logging.getLogger("tensorsocket")

HEARTBEAT_TIMEOUT = config.SETTINGS["heartbeat_timeout"].default  # then a consumer is evicted
LIVENESS_INTERVAL = 0.25  # how often the server checks consumer processes
MAX_ERROR_CHARS = 1000  # error replies stay well inside the protocol's string limit
# The bytes of batch sizes and of indices in one epoch_batches answer (together well
# within MAX_MESSAGE_BYTES, which the consumer's socket enforces).
LISTING_SIZES_BYTES = 8 * 1024
LISTING_IDS_BYTES = 48 * 1024
FAREWELL_LINGER_MS = 1000  # how long a closing server tries to deliver its farewells
# A peer's flood must not starve the server's own checks: it handles at most
# MESSAGES_PER_TURN messages per turn of its loop, and pauses FLOOD_PAUSE seconds after
# a turn that had more (libzmq then holds the rest, and TCP slows the sender), so it
# reads at most MESSAGES_PER_TURN / FLOOD_PAUSE messages a second; it takes them from
# every connection in turn, so a consumer's heartbeat waits for one turn at most.
MESSAGES_PER_TURN = 100
FLOOD_PAUSE = 0.02


class ControlServer:
    """Producer side: answers handshakes, heartbeats and leaves in a thread.

    welcome_info() supplies the handshake reply fields; ring() the ring once
    it exists (hellos that arrive before are answered when it does). A hello is
    admitted only from a peer that tensorsocket.control.auth lets in (secret: what a peer
    without credentials must present, None: nothing). A consumer not heard from for
    heartbeat_timeout seconds (None: never) is evicted. listings: the producer's
    EpochPlanner (producer/listings.py), which answers list_epoch (None: nothing listed).
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
        listings: Any = None,
    ) -> None:
        self._ring = ring
        self._welcome_info = welcome_info
        self._admission = Admission(Gate(address, secret))
        self._sock = listen(context, address)
        self.address = address
        self._connections = None if address.startswith("ipc://") else \
            UnprovenConnections(self._sock, 10 * MESSAGES_PER_TURN)
        self._refusals = RefusalAllowance()
        self._peers = PeerTable(ring)
        self._places = Places(ring, self._peers, park_hold, self._send,
                              None if listings is None else listings.epoch_at)
        self._liveness = Liveness(self._peers, heartbeat_timeout)
        self._stall_watch = StallWatch()
        self._listings = listings
        # hellos and infos that came before the ring
        self._waiting: list[tuple[bytes, protocol.Hello | protocol.Info]] = []
        self._stop = threading.Event()
        self._farewell: tuple[str, str] | None = None  # see close()
        self.rejected = 0  # malformed messages seen
        self.dropped = 0  # error replies not sent: the peer was refused too often
        # the messages of a consumer that has a place (each handler takes its own type)
        self._handlers: dict[str, Callable[[bytes, Any], None]] = {"ready": self._ready,
                          "heartbeat": self._heartbeat, "bye": self._bye,
                          "park": self._park, "unpark": self._unpark,
                          "list_epoch": self._list_epoch}
        self._thread = threading.Thread(target=self._run, name="tensorsocket-control", daemon=True)
        self._thread.start()

    # -- thread ----------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        connections = self._connections
        if connections is not None:
            poller.register(connections.monitor, zmq.POLLIN)
        next_check = 0.0
        last = time.monotonic()
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if connections is not None:
                    if connections.monitor in ready:
                        connections.watch()
                    connections.cut_overflow(time.monotonic())
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
                    self._admission.forget(now)
                    if connections is not None:
                        connections.watch()  # closes first: an fd may be reused
                        connections.cut_unproven(now)
                    self._check_peers(now)
        except Exception:  # the thread must never die silently
            log.exception("tensorsocket control thread failed")
        finally:
            said = self._say_farewell()
            self._liveness.close()
            self._peers.close()
            if connections is not None:
                connections.close()
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

    def _excuse(self, gap: float, now: float) -> None:
        """This thread did not run for `gap` seconds (the producer was stopped, or
        starved): the consumers' heartbeats and proofs of that time may still wait unread
        in the socket, so it does not count as their silence."""
        self._peers.excuse(gap, now)
        if self._connections is not None:
            self._connections.excuse(gap, now)

    def _check_peers(self, now: float) -> None:
        """The liveness check, every LIVENESS_INTERVAL once the ring exists: stalls,
        places kept too long, consumers gone (see the parts)."""
        ring = self._ring()
        if ring is None:
            return
        self._stall_watch.check(ring, self._peers.values(), now)
        self._places.check_holds(ring, now)
        self._liveness.check(ring, now, self._places.start_group)

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
            self._dispatch(frames[0].bytes, frames[1])
        return bool(cast(int, self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def _dispatch(self, ident: bytes, frame: zmq.Frame) -> None:
        """Handle one message from connection `ident`; an error it causes is replied,
        never raised (a message must never take the control thread down)."""
        payload = frame.bytes
        try:
            msg = protocol.read(payload)
        except ProtocolError as e:
            log.debug("rejected control message: %s", e)
            version = protocol.foreign_hello(payload)
            self._reject(ident, protocol.Error("protocol", str(e)) if version is None
                         else protocol.Error("version", version_message(version)))
            return
        if isinstance(msg, protocol.Challenge):
            reply = self._admission.challenge(ident, msg)
            if isinstance(reply, protocol.Error):
                self._reject(ident, reply)
            else:
                self._send(ident, reply)
                if self._connections is not None:
                    self._connections.answered(frame)  # spared: its hello must come on it
            return
        handler = self._handlers.get(msg.kind)
        if handler is None and not isinstance(msg, (protocol.Hello, protocol.Info)):
            self._reject(ident, protocol.Error("protocol", f"{msg.kind} is not a consumer message"))
            return
        try:
            if isinstance(msg, (protocol.Hello, protocol.Info)):
                self._admit(ident, msg, frame)
            elif handler is not None:
                handler(ident, msg)
        except Exception as e:  # a message must never take the control thread down
            log.warning("control message %s failed: %s: %s", msg.kind, type(e).__name__, e)
            self._reject(ident, protocol.Error("protocol", f"{msg.kind} failed: {type(e).__name__}"))

    def _send(self, ident: bytes, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.Error):
            if ident not in self._peers and not self._refusals.take(ident):
                self.dropped += 1
                return
            msg = protocol.Error(msg.code, msg.message[:MAX_ERROR_CHARS])
        try:
            self._sock.send_multipart([ident, msg.encode()], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer is gone or its queue is full: it will time out

    def _reject(self, ident: bytes, error: protocol.Error) -> None:
        """A message from `ident` was not taken: count it, and reply `error`."""
        self.rejected += 1
        self._send(ident, error)

    def _peer(self, ident: bytes, msg: protocol.Placed) -> Peer | None:
        """The peer this message claims to be, if it really is that peer."""
        peer = self._peers.get(ident)
        if peer is None or peer.index != msg.consumer or peer.token != msg.token:
            self._reject(ident, protocol.Error("unknown", "no such consumer on this socket"))
            return None
        peer.last_seen = time.monotonic()
        return peer

    # -- messages ----------------------------------------------------------------

    def _admit(self, ident: bytes, msg: protocol.Hello | protocol.Info, frame: zmq.Frame) -> None:
        """A hello (or an info): answered if tensorsocket.control.admission takes it,
        refused with the error it gives otherwise."""
        refusal = self._admission.refusal(ident, msg, frame)
        if refusal is not None:
            self._reject(ident, refusal)
            return
        if self._connections is not None:
            self._connections.proven(frame)  # kept
        self._answer(ident, msg)

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
            self._peers.retire(ident)
        try:
            index, token = ring.reserve(msg.pid, msg.start_time, msg.batch_size or 0)
        except TooManyConsumers as e:
            self._send(ident, protocol.Error("full", str(e)))
            return
        group = None
        if msg.world_size > 1:
            if not 0 <= msg.rank < msg.world_size <= MAX_CONSUMERS:
                ring.retire(index)
                self._reject(ident, protocol.Error(
                    "protocol", "hello with an impossible rank or world size"))
                return
            group = f"{msg.group or ''}/{msg.world_size}"
        self._peers.add(ident, Peer(index, token, msg.pid, msg.start_time, time.monotonic(),
                                    msg.batch_size, group=group, rank=msg.rank))
        self._send(ident, protocol.Welcome(protocol=protocol.PROTOCOL_VERSION, consumer=index,
                                           token=token, **self._welcome_info()))

    def _ready(self, ident: bytes, msg: protocol.Ready) -> None:
        peer = self._peer(ident, msg)
        if peer is not None:
            self._places.ready(ident, peer, msg.align)

    def _heartbeat(self, ident: bytes, msg: protocol.Heartbeat) -> None:
        self._peer(ident, msg)

    def _bye(self, ident: bytes, msg: protocol.Bye) -> None:
        if self._peer(ident, msg) is None:
            return
        self._peers.retire(ident)
        self._send(ident, protocol.ByeOk())

    def _park(self, ident: bytes, msg: protocol.Park) -> None:
        peer = self._peer(ident, msg)
        if peer is not None:
            self._places.park(peer, msg.hold, msg.skip_epoch)

    def _unpark(self, ident: bytes, msg: protocol.Unpark) -> None:
        peer = self._peer(ident, msg)
        ring = self._ring()
        if peer is not None and ring is not None:
            self._send(ident, protocol.Unparked(held=self._places.unpark(ring, peer)))

    def _list_epoch(self, ident: bytes, msg: protocol.ListEpoch) -> None:
        """The sizes of an epoch's batches from msg.first_batch on and its indices from
        msg.first_id on, as many as fit in one answer (epoch -1: the one the consumer reads
        first, from the entry it started at: for the ranks of a group, which start
        together, the same one)."""
        peer = self._peer(ident, msg)
        if peer is None:
            return
        listed = self._listing(peer, msg.epoch)
        if isinstance(listed, str):
            self._send(ident, protocol.EpochBatches(
                epoch=-1, batches=0, samples=0, first_batch=0, sizes=b"", first_id=0,
                ids=b"", unlisted=listed[:MAX_ERROR_CHARS]))
            return
        if not (0 <= msg.first_batch <= listed.batches and 0 <= msg.first_id <= listed.samples):
            self._reject(ident, protocol.Error(
                "protocol", f"list_epoch from batch {msg.first_batch} and index "
                            f"{msg.first_id} of {listed.batches} and {listed.samples}"))
            return
        sizes, ids = listed.part(msg.first_batch, msg.first_id, LISTING_SIZES_BYTES,
                                 LISTING_IDS_BYTES)
        self._send(ident, protocol.EpochBatches(
            epoch=listed.epoch, batches=listed.batches, samples=listed.samples,
            first_batch=msg.first_batch, sizes=sizes, first_id=msg.first_id, ids=ids,
            unlisted=None))

    def _listing(self, peer: Peer, epoch: int) -> Any:
        """The listing `peer` asks for (see _list_epoch), or why there is none."""
        if self._listings is None:
            return "this producer lists no epoch"
        if epoch < 0:
            if peer.first_epoch is None:
                return ("the consumer does not read from an epoch's start (it joined "
                        "within one, align_epochs=False or a loader without len())")
            epoch = peer.first_epoch
        return self._listings.listing(epoch)

    # -- owner -------------------------------------------------------------------

    def consumer_count(self) -> int:
        """Consumers attached and receiving now."""
        return self._peers.consumer_count()

    def present_count(self) -> int:
        """Consumers of this producer: attached, or parked between epochs."""
        return self._peers.present_count()

    def batch_sizes(self) -> dict[int, int | None]:
        """Batch size each attached consumer asked for, by consumer index."""
        return self._peers.batch_sizes()

    def close(self, farewell: tuple[str, str] | None = None) -> None:
        """Stop the thread; it closes the socket. farewell: (code, message) of the error
        that consumers still waiting for the ring receive, if there is no ring: code
        "failed" (message: the producer's error) or "finished" (message: how it ended)."""
        self._farewell = farewell
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
