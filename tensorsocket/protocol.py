"""Control-plane messages: msgpack maps checked against a schema.

Nothing received is ever unpickled or evaluated. A message is a msgpack map
with a string ``type`` and exactly the typed fields its schema lists; anything
else is rejected with ProtocolError.
"""

from __future__ import annotations

import reprlib
from typing import Any

import msgpack

from .errors import ProtocolError

PROTOCOL_VERSION = 5  # 5: hello carries the producer's secret (TCP), park{skip_epoch} (a
#                       loop left with break keeps its place at the next epoch); 4: aligned
#                       joins, parking, consumer groups, loader fingerprint
MAX_MESSAGE_BYTES = 64 * 1024

_INT = (int,)
_OPT_INT = (int, type(None))
_STR = (str,)
_OPT_STR = (str, type(None))
_BOOL = (bool,)

# type -> {field: accepted python types}
SCHEMAS: dict[str, dict[str, tuple]] = {
    # consumer -> producer
    # secret: the producer's secret, which a TCP producer requires (tensorsocket.auth)
    "hello": {"protocol": _INT, "pid": _INT, "start_time": _INT, "batch_size": _OPT_INT,
              "group": _OPT_STR, "rank": _INT, "world_size": _INT, "secret": _OPT_STR},
    "ready": {"consumer": _INT, "token": _INT, "align": _BOOL},
    "park": {"consumer": _INT, "token": _INT, "hold": _BOOL, "skip_epoch": _BOOL},
    "unpark": {"consumer": _INT, "token": _INT},
    "heartbeat": {"consumer": _INT, "token": _INT},
    "bye": {"consumer": _INT, "token": _INT},
    # producer -> consumer
    "welcome": {
        "protocol": _INT,
        "consumer": _INT,
        "token": _INT,
        "segment": _STR,
        "length": _OPT_INT,
        "loader_batch_size": _OPT_INT,
        "samples": _OPT_INT,
        "samples_exact": _BOOL,
        "dataset": _OPT_STR,
        "dataset_len": _OPT_INT,
        "epoch": _INT,
        "producer_pid": _INT,
        "window": _INT,
        "max_lag": _INT,
        "lag_policy": _STR,
        "fingerprint": _OPT_STR,
        "auto_set_epoch": _BOOL,
    },
    "started": {"start_seq": _INT},
    "unparked": {"held": _BOOL},
    "bye_ok": {},
    "error": {"code": _STR, "message": _STR},
}


def encode(kind: str, **fields: Any) -> bytes:
    """Encode a message of type kind (checked against its schema)."""
    msg = {"type": kind, **fields}
    _check(msg)
    return msgpack.packb(msg, use_bin_type=True)


def foreign_hello(data: bytes) -> int | None:
    """The protocol version of a hello that decode() refused because it comes from
    another version of tensorsocket (whose hello has other fields); else None. Lets the
    producer answer such a consumer with a version error rather than a schema error."""
    try:
        msg = _unpack(data)
    except ProtocolError:  # garbage: not a hello of any version
        return None
    if not isinstance(msg, dict) or msg.get("type") != "hello":
        return None
    version = msg.get("protocol")
    if type(version) is not int or version == PROTOCOL_VERSION:
        return None
    return version


def decode(data: bytes) -> dict[str, Any]:
    """Decode and check one message; raises ProtocolError on anything unexpected."""
    msg = _unpack(data)
    _check(msg)
    return msg


def _unpack(data: bytes) -> Any:
    """The msgpack value of data, within the protocol's limits (not yet checked against
    a schema); ProtocolError if it is not one."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=4096,
            max_bin_len=0,
            max_array_len=0,
            max_map_len=32,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable control message: {type(e).__name__}: {e}") from None
    return msg


_REPR = reprlib.Repr()
_REPR.maxlevel = 2
_REPR.maxstring = 40
_REPR.maxother = 40


def _short(value: Any) -> str:
    """A bounded repr of untrusted data, for error messages (never deep, never long)."""
    return _REPR.repr(value)


def _check(msg: Any) -> None:
    """Raise ProtocolError unless msg matches its schema exactly."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"control message is a {type(msg).__name__}, not a map")
    kind = msg.get("type")
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(f"unknown control message type {_short(kind)}")
    extra = set(msg) - set(schema) - {"type"}
    if extra:
        raise ProtocolError(f"{kind} message has unexpected fields {_short(list(extra))}")
    for field, types in schema.items():
        if field not in msg:
            raise ProtocolError(f"{kind} message lacks field {field!r}")
        value = msg[field]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ProtocolError(f"{kind} message field {field!r} has type {type(value).__name__}")
