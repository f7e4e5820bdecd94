"""The consumer's end of the control plane: ControlClient, a DEALER socket to the producer's
ControlServer (tensorsocket.control.server).

The handshake runs in the caller's thread: the challenge of the producer's secret
(tensorsocket.control.auth), hello, ready; then a thread owns the socket and sends
heartbeats, and the park and bye the consumer asks for, until the caller takes the socket
back. Messages are the typed messages of tensorsocket.control.protocol.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, TypeVar

import zmq

from ..ring import process_start_time
from . import protocol
from .auth import RECHALLENGE, ClientSecret, derive_key, new_nonce
from .channel import GROUP_TIMEOUT, HEARTBEAT_INTERVAL, PENDING_TIMEOUT, control_socket
from .endpoints import listener_note
from ..data.listings import Assembly, EpochListing
from ..errors import (
    AuthenticationError,
    ProducerFailed,
    ProducerFinished,
    ProducerNotFound,
    ProtocolError,
    TensorSocketError,
    VersionMismatch,
)

_M = TypeVar("_M", bound=protocol.Message)  # the message type a consumer waits for

# Seconds a consumer waits for the proof before it sends its challenge again: a connection
# the producer closed (its table of unproven connections full) may have taken it along.
CHALLENGE_AGAIN = 0.25
RECONNECT_MS = 10  # ms before a consumer's closed connection to the producer is tried again
RECONNECT_MAX_MS = 100  # ... at most, refused connects backing off (libzmq's default)
LISTING_RESTARTS = 2  # times an epoch's listing is asked for again when it went meanwhile
PEER_TEXT_CHARS = 300  # of an error text from a peer that has not proved it is the producer
PRODUCER_TEXT_CHARS = 1000  # ... from the producer (its own limit: server.MAX_ERROR_CHARS)


class _Rechallenge(TensorSocketError):
    """The producer asks this consumer to challenge again (see ControlClient._admitted)."""


def peer_text(text: str, proven: bool) -> str:
    """An error text received from a peer, as shown to the user: its control characters
    escaped (a terminal's escape sequences included: newlines and tabs stay in the
    producer's own texts), at most PEER_TEXT_CHARS shown (PRODUCER_TEXT_CHARS once the
    peer proved that it is the producer), and, from a peer not proven, quoted, with its
    quotes and backslashes escaped, so that nothing it says reads as outside the quote."""
    limit = PRODUCER_TEXT_CHARS if proven else PEER_TEXT_CHARS
    keep = "\n\t" if proven else ""
    special = "" if proven else "'\\"
    shown: list[str] = []
    size = 0
    for ch in text:
        if ch in special:
            piece = "\\" + ch
        elif ch.isprintable() or ch in keep:
            piece = ch
        else:
            piece = ascii(ch)[1:-1]
        if size + len(piece) > limit:
            shown.append(f" [... {size} characters shown, the rest cut]")
            break
        shown.append(piece)
        size += len(piece)
    out = "".join(shown)
    return out if proven else f"'{out}'"


class ControlClient:
    """Consumer side: handshake in the caller's thread, then heartbeats in a thread."""

    def __init__(self, context: zmq.Context, address: str, timeout: float | None,
                 secret: ClientSecret | None = None) -> None:
        self.address = address
        self._secret = secret  # the producer's secret, which this consumer proves it knows
        self._sock = control_socket(context, zmq.DEALER)
        # A connection the producer closed at once (its table of connections that have not
        # proved the secret is full: tensorsocket.control.listener) is tried again after
        # RECONNECT_MS, not libzmq's 100 ms: under another user's flood of connections,
        # each try has a small chance of a place; refused connects back off to 100 ms.
        self._sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
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
        # The peer proved that it knows the secret (an ipc:// peer lies in this user's
        # private directory): its error texts are the producer's (see _refusal).
        self._proven = address.startswith("ipc://")
        self._challenging = False  # waiting for the proof (see _refusal)
        self.rechallenges = 0  # hellos the producer asked to challenge again (see _admitted)

    def hello(self, batch_size: int | None, group: str | None = None, rank: int = 0,
              world_size: int = 1, watch: Any = None) -> protocol.Welcome:
        """Send hello; return the welcome, waiting up to the timeout for a producer. On
        TCP the producer must first prove that it knows the secret (see _proof); a
        proof that does not fit makes the consumer read the secret file again (a
        producer that started after the consumer wrote a new one). watch: a
        ProducerWatch, which raises while we wait if the producer died."""
        pid, start_time = self._identity()
        msg = self._admitted(lambda proof: protocol.Hello(
            protocol=protocol.PROTOCOL_VERSION, pid=pid, start_time=start_time,
            batch_size=batch_size, group=group, rank=rank, world_size=world_size,
            proof=proof), protocol.Welcome, watch)
        self.consumer, self.token = msg.consumer, msg.token
        self.left = False
        return msg

    def info(self, watch: Any = None) -> protocol.LoaderInfo:
        """What the producer's loader is (its loader_info reply), asked as a hello is but
        taking no place in its ring: nothing to say bye for."""
        pid, start_time = self._identity()
        return self._admitted(lambda proof: protocol.Info(
            protocol=protocol.PROTOCOL_VERSION, pid=pid, start_time=start_time, proof=proof),
            protocol.LoaderInfo, watch)

    @staticmethod
    def _identity() -> tuple[int, int]:
        """This process's pid and start time, which a hello and an info carry."""
        pid = os.getpid()
        return pid, process_start_time(pid)

    def _deadline(self) -> float | None:
        """When a producer must have answered (None: no timeout)."""
        return None if self._timeout is None else time.monotonic() + self._timeout

    def _admitted(self, make: Callable[[str | None], protocol.Hello | protocol.Info],
                  want: type[_M], watch: Any) -> _M:
        """The producer's reply of type `want` to the hello (or info) that make(proof)
        builds, waiting until the timeout: the challenge first (_proof), then the hello
        with this consumer's proof. A producer whose table of unproven connections was
        full may close the connection its challenge was answered on, and the zmq socket
        then sends the hello on a new one, which answered no challenge: the producer asks
        for one there (RECHALLENGE), and this consumer challenges again, until the
        timeout."""
        deadline = self._deadline()
        while True:
            self._proven = self.address.startswith("ipc://")  # each connection proves anew
            proof = self._proof(deadline, watch)
            try:
                return self._admission(make(proof), want, deadline, watch)
            except _Rechallenge:
                self.rechallenges += 1
                self._drop_replies()  # stale answers of the closed connection's exchange
                if deadline is not None and time.monotonic() >= deadline:
                    raise self._not_found(watch) from None

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

    def _drop_replies(self) -> None:
        """Drop the replies that wait unread."""
        while self._sock.poll(0):
            self._sock.recv()

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
        if known is not None:
            # The key (PBKDF2: ~50 ms, seconds on a loaded machine) before the challenge,
            # so that the hello follows the producer's proof at once, on its connection.
            derive_key(known)
        nonce = new_nonce()
        challenge = protocol.Challenge(protocol=protocol.PROTOCOL_VERSION, nonce=nonce).encode()
        self._challenging = True
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
        finally:
            self._challenging = False
        if reply is None:
            raise self._not_found(watch)
        answer = secret.answer(self.address, nonce, reply, known)
        self._proven = True  # the peer proved it knows the secret (or ipc: see __init__)
        return answer

    def _not_found(self, watch: Any) -> ProducerNotFound:
        """The error for a producer that did not answer within the timeout: with what is
        known of challenges whose connections the producer closed, of whatever listens on
        a TCP port where no producer proved itself (tensorsocket.control.endpoints: a
        squatter holds the port, or nothing listens), and of the name's producer
        (watch.note())."""
        rechallenged = ""
        if self.rechallenges:
            rechallenged = (
                f" The producer answered, but closed the connection its answer went on "
                f"before this consumer's hello could follow, {self.rechallenges} time(s): "
                "its table of connections that have not proved the secret was kept full, "
                "as another local user flooding the port with connections would.")
        return ProducerNotFound(
            f"no tensorsocket producer answered at {self.address} within {self._timeout} s; "
            "start the producer (same name=/port=) or raise the consumer's timeout=."
            + rechallenged
            + ("" if self._proven else listener_note(
                self.address, self._secret.lock_path if self._secret is not None else None))
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
                raise ProtocolError(
                    f"bad reply from {self._speaker()}: {peer_text(str(e), self._proven)}"
                ) from None
            if isinstance(msg, protocol.Error):
                raise self._refusal(msg.code, msg.message)
            if isinstance(msg, want):
                return msg

    def _speaker(self) -> str:
        """Who sent the replies read now: the producer once it proved that it knows the
        secret (or on ipc://, in this user's private directory), else whatever listens
        at the address, which may be another user's process."""
        if self._proven:
            return f"the producer at {self.address}"
        return (f"the process listening at {self.address} (it has not proved that it is the "
                "producer: it may be another user's process holding the port)")

    def _refusal(self, code: str, message: str) -> Exception:
        """The exception for an error reply. Its text is the peer's, bounded and with its
        control characters escaped (peer_text); before the peer proved that it knows the
        secret, it is quoted as what that peer said, never as the producer's word."""
        text = peer_text(message, self._proven)
        if code == RECHALLENGE and self._proven and not self._challenging:
            return _Rechallenge(text)
        if not self._proven:
            if code == "protocol" and self._challenging and "challenge" in message:
                # A producer of protocol 6 or older does not know the challenge.
                return VersionMismatch(
                    f"{self._speaker()} does not know this consumer's challenge, saying "
                    f"{text}: if it is the producer, it speaks an older protocol; install "
                    "the same tensorsocket version on both sides")
            said = f"{self._speaker()} refused this consumer, saying {text}"
            if code == "version":
                return VersionMismatch(said)
            if code == "auth":
                why = ("; a producer answers a challenge with its proof, never with this "
                       "error, so these are not the producer's words") \
                    if self._challenging else ""
                return AuthenticationError(
                    f"{said}{why} (choose another port= if another user's process holds "
                    f"it){self._note()}")
            return TensorSocketError(said)
        if code == "version":
            return VersionMismatch(text)
        if code == "auth":
            return AuthenticationError(
                f"the producer at {self.address} refused this consumer: {text}{self._note()}")
        if code == "unsupported":
            return NotImplementedError(text)
        if code == "failed":
            return ProducerFailed(
                f"the producer at {self.address} failed before its first batch: {text}. "
                "Fix it and start it again, then create the TensorConsumer again",
                cause=text)
        if code == "finished":
            return ProducerFinished(
                f"the producer at {self.address} {text}; no batches will come from it")
        return TensorSocketError(f"producer refused: {text}")

    def _note(self) -> str:
        """Where the secret used came from, in parentheses (or nothing)."""
        note = self._secret.note() if self._secret is not None else ""
        return f" ({note})" if note else ""

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

    def list_epoch(self) -> EpochListing | str:
        """The index lists of the batches of the epoch this consumer would begin at now
        (of its group's, for a rank), as the producer will deliver them; or why the
        producer has none (tensorsocket.data.listings). Raises ProducerNotFound if it
        stopped answering."""
        beating = self._thread is not None
        self.stop_heartbeats()  # (the heartbeat thread owns the socket)
        try:
            return self._listing()
        finally:
            if beating and not self.left:
                self.start_heartbeats()

    def _listing(self) -> EpochListing | str:
        """list_epoch, with the socket this thread's."""
        assembly: Assembly | None = None
        restarts = 0
        while restarts <= LISTING_RESTARTS:
            self._sock.send(protocol.ListEpoch(
                self.consumer, self.token, epoch=-1 if assembly is None else assembly.epoch,
                first_batch=0 if assembly is None else assembly.received_batches,
                first_id=0 if assembly is None else assembly.received_ids).encode())
            msg = self._receive(PENDING_TIMEOUT, protocol.EpochBatches)
            if msg is None:
                raise ProducerNotFound(f"the producer at {self.address} stopped answering")
            if msg.unlisted is not None:
                if assembly is None:
                    return peer_text(msg.unlisted, self._proven)
                assembly = None  # its epoch went while the parts came: the next one's
                restarts += 1
                continue
            if assembly is None:
                assembly = Assembly(msg.epoch, msg.batches, msg.samples)
            try:
                if msg.epoch != assembly.epoch or msg.batches != assembly.batches or \
                        msg.first_batch != assembly.received_batches or \
                        msg.first_id != assembly.received_ids:
                    raise ValueError("the parts of an epoch's listing do not follow each other")
                if not assembly.complete:
                    assembly.add(msg.sizes, msg.ids)
                if assembly.complete:
                    return assembly.listing()
            except ValueError as e:
                raise ProtocolError(f"bad reply from {self._speaker()}: {e}") from None
        return "the producer's epochs moved on while their order was read"

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
