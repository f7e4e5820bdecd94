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
from typing import Any, TypeVar

import zmq

from .. import _core
from . import protocol
from .auth import ClientSecret, new_nonce
from .channel import GROUP_TIMEOUT, HEARTBEAT_INTERVAL, PENDING_TIMEOUT, control_socket
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

CHALLENGE_AGAIN = 1.0  # seconds a consumer waits for the proof before it challenges again


class ControlClient:
    """Consumer side: handshake in the caller's thread, then heartbeats in a thread."""

    def __init__(self, context: zmq.Context, address: str, timeout: float | None,
                 secret: ClientSecret | None = None) -> None:
        self.address = address
        self._secret = secret  # the producer's secret, which this consumer proves it knows
        self._sock = control_socket(context, zmq.DEALER)
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
