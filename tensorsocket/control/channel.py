"""What the producer's server and the consumers' clients of the control plane agree on
beside the messages themselves (tensorsocket.control.protocol): how often a consumer beats,
how long a step of the handshake may take, and the options of the sockets at both ends."""

from __future__ import annotations

import zmq

from . import protocol

HEARTBEAT_INTERVAL = 1.0  # seconds between consumer heartbeats
PENDING_TIMEOUT = 10.0  # a consumer that never says "ready" is dropped after this
GROUP_TIMEOUT = 60.0  # the ranks of a group wait this long for each other to attach


def control_socket(context: zmq.Context, kind: int) -> zmq.Socket:
    """A socket of the control plane (zmq.ROUTER: the producer's; zmq.DEALER: a consumer's):
    closed without lingering, and taking no message over protocol.MAX_MESSAGE_BYTES."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
    return sock
