"""Who the producer's control server answers: the checks of a challenge and of a hello (or
an info) before it is answered, and the allowance of error replies to connections that are
no consumer.

A consumer first challenges the producer, which proves that it knows the secret
(tensorsocket.control.auth); its hello then carries its own proof. A hello is answered
only if it is well formed, of this protocol version and from a peer the auth gate lets in;
otherwise the error reply tells nothing of the producer.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import zmq

from . import protocol
from .auth import RECHALLENGE, Gate, is_nonce

log = logging.getLogger("tensorsocket")

REFUSAL_WARNINGS = 3  # refused hellos logged as warnings; later ones at debug level
# Error replies to a connection that is no consumer: REFUSAL_BURST at once, then
# REFUSAL_RATE a second; the others are dropped unanswered (counted in .dropped).
REFUSAL_RATE = 20.0
REFUSAL_BURST = 100.0
REFUSAL_PEERS = 4096  # connections whose refusals are counted (the oldest go first)


def version_message(theirs: int) -> str:
    """The error for a consumer that speaks protocol version `theirs`."""
    return (f"producer speaks protocol {protocol.PROTOCOL_VERSION}, consumer {theirs}: "
            "install the same tensorsocket version on both sides")


class Admission:
    """The checks of the handshake's first messages (see the module docstring); each
    returns the error to reply with (the server counts it rejected) or the answer."""

    def __init__(self, gate: Gate) -> None:
        self._gate = gate
        self.refused = 0  # hellos not admitted (tensorsocket.control.auth)
        self.rechallenged = 0  # hellos whose proof answered no challenge on their connection

    def challenge(self, ident: bytes, msg: protocol.Challenge) -> protocol.Proof | protocol.Error:
        """A consumer's challenge on connection `ident`, before its hello: answered with
        this producer's own nonce and its proof that it knows the secret."""
        if msg.protocol != protocol.PROTOCOL_VERSION:
            return protocol.Error("version", version_message(msg.protocol))
        if not is_nonce(msg.nonce):
            return protocol.Error("protocol", "challenge with a bad nonce")
        nonce, proof = self._gate.challenge(ident, msg.nonce)
        return protocol.Proof(nonce=nonce, mac=proof)

    def refusal(self, ident: bytes, msg: protocol.Hello | protocol.Info,
                frame: zmq.Frame) -> protocol.Error | None:
        """Why a hello (or an info) that came in `frame` on connection `ident` is not
        answered, as the error reply; None: it is."""
        if not 0 < msg.pid < 2**31 or not 0 <= msg.start_time < 2**64:
            return protocol.Error("protocol", f"{msg.kind} with an impossible pid")
        if msg.protocol != protocol.PROTOCOL_VERSION:
            log.warning("consumer pid %s speaks protocol %s, this producer %s",
                        msg.pid, msg.protocol, protocol.PROTOCOL_VERSION)
            return protocol.Error("version", version_message(msg.protocol))
        refused = self._gate.refusal(ident, frame, msg)
        if refused is None:
            return None
        code, refusal = refused
        if code == RECHALLENGE:  # no refusal of the consumer: it challenges again
            self.rechallenged += 1
            log.debug("a %s (claiming pid %d) answers no challenge on its connection: "
                      "asked to challenge again", msg.kind, msg.pid)
            return protocol.Error(code, refusal)
        self.refused += 1
        log.log(logging.WARNING if self.refused <= REFUSAL_WARNINGS else logging.DEBUG,
                "refused a %s (claiming pid %d)%s: %s", msg.kind, msg.pid,
                " (later refusals are logged at debug level)"
                if self.refused == REFUSAL_WARNINGS else "", refusal)
        return protocol.Error(code, refusal)

    def forget(self, now: float) -> None:
        """Forget the challenges no hello followed in time (see auth.Gate.forget)."""
        self._gate.forget(now)


class RefusalAllowance:
    """How many error replies each connection that is no consumer may still get
    (REFUSAL_BURST, refilled at REFUSAL_RATE a second): a flood of refused messages gets
    a few answers, then none, each costing no more than its reading."""

    def __init__(self) -> None:
        self._left: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # (allowance, at)

    def take(self, ident: bytes) -> bool:
        """Spend one reply of `ident`'s allowance: whether it had one."""
        now = time.monotonic()
        allowance, at = self._left.pop(ident, (REFUSAL_BURST, now))
        allowance = min(REFUSAL_BURST, allowance + (now - at) * REFUSAL_RATE)
        self._left[ident] = (allowance - 1, now)
        while len(self._left) > REFUSAL_PEERS:
            self._left.popitem(last=False)
        return allowance >= 1
