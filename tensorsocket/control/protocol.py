"""Control-plane messages: msgpack maps checked against a schema.

Nothing received is ever unpickled or evaluated. A message is a msgpack map
with a string ``type`` and exactly the typed fields its schema lists; anything
else is rejected with ProtocolError.

Each message type is a frozen dataclass below (``Welcome``, ``Ready``, ...): its
``kind`` is the map's ``type``, its fields are the map's, and the schema checks
(``SCHEMAS``: field -> accepted types) are derived from its annotations. The
control plane writes a message as one of these (``Ready(...).encode()``) and
reads one with ``read()``; ``decode()`` and ``encode()`` do the same with plain
dicts (for tests and tools that write raw maps).
"""

from __future__ import annotations

import dataclasses
import reprlib
from dataclasses import dataclass
from typing import Any, ClassVar, get_args, get_type_hints

import msgpack

from ..errors import ProtocolError

PROTOCOL_VERSION = 8  # 8: list_epoch / epoch_batches (an epoch's order, before reading it);
#                       7: 7: challenge / proof before a hello or info, which carry a proof
#                       (an HMAC) instead of the secret (tensorsocket.control.auth); 6: info / loader_info (share() learns of the producer's loader
#                       without attaching); 5: hello carries the producer's secret (TCP),
#                       park{skip_epoch} (a loop left with break keeps its place at the next
#                       epoch); 4: aligned joins, parking, consumer groups, loader fingerprint
MAX_MESSAGE_BYTES = 64 * 1024


@dataclass(frozen=True)
class Message:
    """A control message: one frozen dataclass per type, below."""

    kind: ClassVar[str] = ""  # the message type: the map's "type"

    def encode(self) -> bytes:
        """The message's bytes on the wire (checked against its schema)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return encode(self.kind, **fields)


# consumer -> producer

@dataclass(frozen=True)
class Challenge(Message):
    """A consumer's random nonce, before its hello or info (tensorsocket.control.auth)."""
    kind: ClassVar[str] = "challenge"
    protocol: int
    nonce: str


@dataclass(frozen=True)
class Admission(Message):
    """What a consumer's hello and info carry (no message of its own): its protocol and
    process, and its proof (tensorsocket.control.auth), which a TCP producer requires."""
    protocol: int
    pid: int
    start_time: int
    proof: str | None


@dataclass(frozen=True)
class Hello(Admission):
    """A consumer asks for a place in the ring."""
    kind: ClassVar[str] = "hello"
    batch_size: int | None
    group: str | None
    rank: int
    world_size: int


@dataclass(frozen=True)
class Placed(Message):
    """A message of a consumer that has its place (no message of its own): which
    entry, and the token that proves it is that entry's consumer."""
    consumer: int
    token: int


@dataclass(frozen=True)
class Ready(Placed):
    """The consumer mapped the ring (align: start at the current epoch's first entry)."""
    kind: ClassVar[str] = "ready"
    align: bool


@dataclass(frozen=True)
class Park(Placed):
    """Stop reading for a while (hold: keep the place; skip_epoch: at the next epoch)."""
    kind: ClassVar[str] = "park"
    hold: bool
    skip_epoch: bool


@dataclass(frozen=True)
class Unpark(Placed):
    """Read again after a park that asked to keep the place."""
    kind: ClassVar[str] = "unpark"


@dataclass(frozen=True)
class Heartbeat(Placed):
    """The consumer is alive."""
    kind: ClassVar[str] = "heartbeat"


@dataclass(frozen=True)
class Bye(Placed):
    """The consumer leaves the ring."""
    kind: ClassVar[str] = "bye"


@dataclass(frozen=True)
class ListEpoch(Placed):
    """The index lists of an epoch's batches: the sizes of its batches from `first_batch`
    on and its indices from `first_id` on (the answer carries as many as fit), of `epoch`,
    or (epoch -1) of the epoch the consumer reads first (tensorsocket.data.listings)."""
    kind: ClassVar[str] = "list_epoch"
    epoch: int
    first_batch: int
    first_id: int


@dataclass(frozen=True)
class Info(Admission):
    """What the producer's loader is, asked without attaching (share()); admitted as a
    hello is."""
    kind: ClassVar[str] = "info"


# producer -> consumer

@dataclass(frozen=True)
class Proof(Message):
    """The answer to a challenge: the producer's nonce, and its proof that it knows the
    secret (None: an ipc producer that has none)."""
    kind: ClassVar[str] = "proof"
    nonce: str
    mac: str | None


@dataclass(frozen=True)
class LoaderAnswer(Message):
    """What the producer tells of its loader (tensorsocket.loader.loader_info.describe_loader)
    in a welcome and a loader_info (no message of its own)."""
    protocol: int
    producer_pid: int
    length: int | None
    loader_batch_size: int | None
    samples: int | None
    samples_exact: bool
    dataset: str | None
    dataset_len: int | None
    fingerprint: str | None


@dataclass(frozen=True)
class Welcome(LoaderAnswer):
    """The answer to a hello: the consumer's place, the segment, what the producer tells
    of its loader and its settings."""
    kind: ClassVar[str] = "welcome"
    consumer: int
    token: int
    segment: str
    epoch: int
    window: int
    max_lag: int
    lag_policy: str
    auto_set_epoch: bool


@dataclass(frozen=True)
class LoaderInfo(LoaderAnswer):
    """The answer to info: the loader fields of a welcome."""
    kind: ClassVar[str] = "loader_info"


@dataclass(frozen=True)
class EpochBatches(Message):
    """The answer to list_epoch, for `epoch` of `batches` batches and `samples` indices:
    the sizes (little-endian int32) of batches first_batch, first_batch + 1, ... and the
    indices (int64) from first_id on; epoch -1 and `unlisted` (why) where the producer
    cannot list it."""
    kind: ClassVar[str] = "epoch_batches"
    epoch: int
    batches: int
    samples: int
    first_batch: int
    sizes: bytes
    first_id: int
    ids: bytes
    unlisted: str | None


@dataclass(frozen=True)
class Started(Message):
    """The answer to ready: the consumer's first sequence number."""
    kind: ClassVar[str] = "started"
    start_seq: int


@dataclass(frozen=True)
class Unparked(Message):
    """The answer to unpark: whether the place was kept."""
    kind: ClassVar[str] = "unparked"
    held: bool


@dataclass(frozen=True)
class ByeOk(Message):
    """The answer to bye."""
    kind: ClassVar[str] = "bye_ok"


@dataclass(frozen=True)
class Error(Message):
    """A refusal or failure (code: protocol, version, auth, rechallenge, unknown, full, ...)."""
    kind: ClassVar[str] = "error"
    code: str
    message: str


def _schema(cls: type[Message]) -> dict[str, tuple[type, ...]]:
    """Field -> accepted python types, from the dataclass's annotations (``int | None``
    -> ``(int, NoneType)``)."""
    hints = get_type_hints(cls)
    return {f.name: get_args(hints[f.name]) or (hints[f.name],)
            for f in dataclasses.fields(cls)}


MESSAGES: dict[str, type[Message]] = {
    cls.kind: cls for cls in (Challenge, Hello, Ready, Park, Unpark, Heartbeat, Bye, Info,
                              ListEpoch, Proof, Welcome, LoaderInfo, EpochBatches, Started,
                              Unparked, ByeOk, Error)}
# type -> {field: accepted python types}
SCHEMAS: dict[str, dict[str, tuple[type, ...]]] = {
    kind: _schema(cls) for kind, cls in MESSAGES.items()}

# Message types a consumer sends before it has a place (checked by tensorsocket.control.auth).
ADMISSIONS = ("hello", "info")
# ... and every one that carries its protocol version (a foreign one is answered so).
OPENINGS = ("challenge",) + ADMISSIONS


def read(data: bytes) -> Message:
    """Decode and check one message into its class; ProtocolError on anything unexpected."""
    fields = decode(data)
    return MESSAGES[fields.pop("type")](**fields)


def encode(kind: str, **fields: Any) -> bytes:
    """Encode a map of message type kind, checked against its schema (the control plane
    sends typed messages: Message.encode())."""
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
            max_bin_len=MAX_MESSAGE_BYTES,  # (only an answer's schema has bytes fields)
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
