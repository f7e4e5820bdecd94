"""Control-plane messages: msgpack maps checked against a schema.

Nothing received is ever unpickled or evaluated. A message is a msgpack map
with a string ``type`` and exactly the typed fields its schema lists; anything
else is rejected with ProtocolError.

Each message type also has a class made from its schema (``MESSAGES``: a frozen
dataclass whose fields are the schema's, ``Welcome``, ``Ready``, ...):
``read()`` decodes bytes into one, ``message()`` builds one, checked, and its
``encode()`` gives the bytes, so the control plane reads and writes messages by
attribute. ``decode()`` and ``encode()`` do the same with plain dicts.
"""

from __future__ import annotations

import dataclasses
import reprlib
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import msgpack

from .errors import ProtocolError

PROTOCOL_VERSION = 7  # 7: challenge / proof before a hello or info, which carry a proof
#                       (an HMAC) instead of the secret (tensorsocket.auth); 6: info / loader_info (share() learns of the producer's loader
#                       without attaching); 5: hello carries the producer's secret (TCP),
#                       park{skip_epoch} (a loop left with break keeps its place at the next
#                       epoch); 4: aligned joins, parking, consumer groups, loader fingerprint
MAX_MESSAGE_BYTES = 64 * 1024

_INT = (int,)
_OPT_INT = (int, type(None))
_STR = (str,)
_OPT_STR = (str, type(None))
_BOOL = (bool,)

# What a welcome and a loader_info tell of the producer's loader.
_LOADER_FIELDS: dict[str, tuple] = {
    "length": _OPT_INT,
    "loader_batch_size": _OPT_INT,
    "samples": _OPT_INT,
    "samples_exact": _BOOL,
    "dataset": _OPT_STR,
    "dataset_len": _OPT_INT,
    "fingerprint": _OPT_STR,
}

# type -> {field: accepted python types}
SCHEMAS: dict[str, dict[str, tuple]] = {
    # consumer -> producer
    # a consumer's random nonce, before its hello or info (tensorsocket.auth)
    "challenge": {"protocol": _INT, "nonce": _STR},
    # proof: the consumer's answer to the challenges, which a TCP producer requires
    "hello": {"protocol": _INT, "pid": _INT, "start_time": _INT, "batch_size": _OPT_INT,
              "group": _OPT_STR, "rank": _INT, "world_size": _INT, "proof": _OPT_STR},
    "ready": {"consumer": _INT, "token": _INT, "align": _BOOL},
    "park": {"consumer": _INT, "token": _INT, "hold": _BOOL, "skip_epoch": _BOOL},
    "unpark": {"consumer": _INT, "token": _INT},
    "heartbeat": {"consumer": _INT, "token": _INT},
    "bye": {"consumer": _INT, "token": _INT},
    # what the producer's loader is, asked without attaching (share()); admitted as a hello
    "info": {"protocol": _INT, "pid": _INT, "start_time": _INT, "proof": _OPT_STR},
    # producer -> consumer
    # the answer to a challenge: the producer's nonce, and its proof that it knows the
    # secret (None: an ipc producer that has none)
    "proof": {"nonce": _STR, "mac": _OPT_STR},
    "welcome": {
        "protocol": _INT,
        "consumer": _INT,
        "token": _INT,
        "segment": _STR,
        **_LOADER_FIELDS,
        "epoch": _INT,
        "producer_pid": _INT,
        "window": _INT,
        "max_lag": _INT,
        "lag_policy": _STR,
        "auto_set_epoch": _BOOL,
    },
    # the answer to info: the loader fields of a welcome
    "loader_info": {"protocol": _INT, "producer_pid": _INT, **_LOADER_FIELDS},
    "started": {"start_seq": _INT},
    "unparked": {"held": _BOOL},
    "bye_ok": {},
    "error": {"code": _STR, "message": _STR},
}


# Message types a consumer sends before it has a place (checked by tensorsocket.auth).
ADMISSIONS = ("hello", "info")
# ... and every one that carries its protocol version (a foreign one is answered so).
OPENINGS = ("challenge",) + ADMISSIONS


class Message:
    """A control message, checked against its schema: one frozen dataclass per type (see
    MESSAGES), whose fields are the schema's."""

    kind: ClassVar[str] = ""  # the message type
    names: ClassVar[tuple[str, ...]] = ()  # its fields, in schema order

    def fields(self) -> dict[str, Any]:
        """The fields, as the wire map has them (less ``type``)."""
        return {name: getattr(self, name) for name in self.names}

    def encode(self) -> bytes:
        """The message's bytes on the wire."""
        return encode(self.kind, **self.fields())

    if TYPE_CHECKING:  # the fields are made at import time, from SCHEMAS
        def __getattr__(self, name: str) -> Any: ...


def _annotation(types: tuple) -> Any:
    """The type hint of a field that accepts `types`."""
    real = [t for t in types if t is not type(None)]
    hint: Any = real[0] if len(real) == 1 else Any
    return Optional[hint] if type(None) in types else hint


def _message_class(kind: str, schema: dict[str, tuple]) -> type[Message]:
    """The dataclass of message type `kind` (``loader_info`` -> ``LoaderInfo``)."""
    name = "".join(part.title() for part in kind.split("_"))
    fields = [(field, _annotation(types)) for field, types in schema.items()]
    doc = f"The {kind} control message" + (f": {', '.join(schema)}." if schema else ".")
    cls = dataclasses.make_dataclass(name, fields, bases=(Message,), frozen=True,
                                     namespace={"kind": kind, "names": tuple(schema),
                                                "__doc__": doc})
    cls.__module__ = __name__
    return cls


MESSAGES: dict[str, type[Message]] = {kind: _message_class(kind, schema)
                                      for kind, schema in SCHEMAS.items()}


def message(kind: str, **fields: Any) -> Message:
    """A message of type kind, checked against its schema (ProtocolError if it does not
    match)."""
    _check({"type": kind, **fields})
    return MESSAGES[kind](**fields)


def read(data: bytes) -> Message:
    """Decode and check one message into its class; ProtocolError on anything unexpected."""
    fields = decode(data)
    return MESSAGES[fields.pop("type")](**fields)


def encode(kind: str, **fields: Any) -> bytes:
    """Encode a message of type kind (checked against its schema)."""
    msg = {"type": kind, **fields}
    _check(msg)
    return msgpack.packb(msg, use_bin_type=True)


def foreign_hello(data: bytes) -> int | None:
    """The protocol version of a hello (or info) that decode() refused because it comes
    from another version of tensorsocket (whose hello has other fields); else None. Lets
    the producer answer such a consumer with a version error rather than a schema error."""
    try:
        msg = _unpack(data)
    except ProtocolError:  # garbage: not a hello of any version
        return None
    if not isinstance(msg, dict) or msg.get("type") not in OPENINGS:
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
