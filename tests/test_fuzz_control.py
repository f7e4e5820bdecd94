"""Fuzz the control socket of a live producer.

A real TensorProducer streams batches (iterating in a thread of this process)
to a real TensorConsumer (another thread) while raw ZeroMQ sockets throw
garbage at the producer's control address: random bytes, mutated and
ill-typed msgpack, oversized frames, wrong frame counts, forged and
out-of-order handshake messages, pickles, non-ZMTP bytes. The producer must
neither crash nor wedge, the consumer must get every batch in order with the
right content, and a new consumer must still be able to attach afterwards.

Every wait has a deadline, so a bug shows as a failure, not a hang.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorsocket import TensorConsumer, TensorProducer, _core
from tensorsocket.control import protocol
from tensorsocket.errors import ProtocolError

WIDTH = 4  # batch i is arange(i * WIDTH, (i + 1) * WIDTH)
DEADLINE = 20.0  # seconds any single wait may take before the test fails
MAX = protocol.MAX_MESSAGE_BYTES
FUZZ = settings(
    database=None,  # write nothing into the checkout
    deadline=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)


# -- helpers ---------------------------------------------------------------------------


def _wait_until(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def _expected(i: int) -> list[int]:
    return list(range(i * WIDTH, (i + 1) * WIDTH))


class StreamLoader:
    """Batch i is (arange(i*WIDTH, (i+1)*WIDTH),), until stop is set (no len())."""

    def __init__(self, pace: float = 0.002) -> None:
        self.stop = threading.Event()
        self.pace = pace

    def __iter__(self):
        i = 0
        while not self.stop.is_set():
            yield (torch.arange(i * WIDTH, (i + 1) * WIDTH, dtype=torch.int64),)
            i += 1
            time.sleep(self.pace)  # leave the CPU to the fuzzer (2-core machine)


class ConsumerThread(threading.Thread):
    """A real TensorConsumer in a thread that checks every batch's content and order."""

    def __init__(self, name: str, limit: int | None = None) -> None:
        super().__init__(daemon=True, name=f"consumer-{name}")
        self.producer_name = name
        self.limit = limit
        self.seen: list[int] = []  # batch numbers, in arrival order
        self.error: BaseException | None = None
        self.attached = threading.Event()
        self.index = self.token = self.start_seq = None

    def run(self) -> None:
        try:
            with TensorConsumer(name=self.producer_name, timeout=10, batch_timeout=10) as c:
                self.index, self.token = c._place.index, c._place.token
                self.start_seq = c.start_seq
                self.attached.set()
                for batch in c:
                    values = batch[0].tolist()
                    n = values[0] // WIDTH
                    if values != _expected(n):
                        raise AssertionError(f"batch {n} has wrong content {values}")
                    if self.seen and n != self.seen[-1] + 1:
                        raise AssertionError(f"batch {n} came after batch {self.seen[-1]}")
                    self.seen.append(n)
                    del batch
                    if self.limit is not None and len(self.seen) >= self.limit:
                        break
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            self.error = e
        finally:
            self.attached.set()

    def wait_batches(self, n: int, what: str) -> None:
        _wait_until(lambda: len(self.seen) >= n or self.error is not None or not self.is_alive(),
                    DEADLINE, what)
        assert self.error is None, f"consumer failed: {self.error!r}"
        assert len(self.seen) >= n, f"consumer stopped after {len(self.seen)} batches"


class Rig:
    """A streaming producer (iterated in a thread) with one consumer reading it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loader = StreamLoader()
        self.producer = TensorProducer(self.loader, name=name, min_consumers=1,
                                       start_timeout=DEADLINE, publish_timeout=DEADLINE)
        self.server = self.producer._server
        self.address = self.producer.endpoint.address
        self.produce_error: BaseException | None = None
        self.thread = threading.Thread(target=self._produce, daemon=True, name="producer")
        self.thread.start()
        self.consumer = ConsumerThread(name)
        self.consumer.start()
        assert self.consumer.attached.wait(DEADLINE), "consumer did not attach"
        assert self.consumer.error is None, f"consumer failed: {self.consumer.error!r}"
        self.consumer.wait_batches(3, "the first batches")
        assert self.consumer.seen[:3] == [0, 1, 2]
        idents = [i for i, p in self.server._peers.items() if p.index == self.consumer.index]
        assert len(idents) == 1
        self.ident: bytes = idents[0]
        self.ctx = zmq.Context()
        self.extra: list[ConsumerThread] = []

    def _produce(self) -> None:
        try:
            for _ in self.producer:
                pass
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            self.produce_error = e

    def socket(self, kind: int = zmq.DEALER, **opts) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, 5000)  # a wedged producer fails the test, never hangs it
        s.setsockopt(zmq.RCVTIMEO, 5000)
        for opt, value in opts.items():
            s.setsockopt(getattr(zmq, opt), value)
        s.connect(self.address)
        return s

    def assert_consumer_intact(self) -> None:
        """The real consumer is still attached, active and receiving."""
        assert self.consumer.error is None, f"consumer failed: {self.consumer.error!r}"
        assert self.produce_error is None, f"producer failed: {self.produce_error!r}"
        entry = self.producer.ring.consumer(self.consumer.index)
        assert entry["state"] == _core.CONSUMER_ACTIVE, entry
        assert entry["token"] == self.consumer.token, entry
        peer = self.server._peers.get(self.ident)
        assert peer is not None and peer.active and peer.index == self.consumer.index
        before = len(self.consumer.seen)
        self.consumer.wait_batches(before + 5, "the consumer to keep receiving")

    def assert_new_consumer_attaches(self, batches: int = 10) -> None:
        """The producer is not wedged: a new consumer attaches and reads batches."""
        c = ConsumerThread(self.name, limit=batches)
        self.extra.append(c)
        c.start()
        c.join(DEADLINE)
        assert not c.is_alive(), "new consumer hung"
        assert c.error is None, f"new consumer failed: {c.error!r}"
        assert len(c.seen) == batches

    def finish(self) -> None:
        """End the epoch; the first consumer must have seen every batch, in order."""
        self.loader.stop.set()
        self.thread.join(DEADLINE)
        assert not self.thread.is_alive(), "producer hung"
        assert self.produce_error is None, f"producer failed: {self.produce_error!r}"
        self.consumer.join(DEADLINE)
        assert not self.consumer.is_alive(), "consumer hung"
        assert self.consumer.error is None, f"consumer failed: {self.consumer.error!r}"
        published = self.producer.stats()["batches"]
        assert self.consumer.seen == list(range(published))

    def close(self) -> None:
        self.loader.stop.set()
        self.thread.join(DEADLINE)
        for c in [self.consumer, *self.extra]:
            c.join(DEADLINE)
        self.producer.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def rig(name):
    r = Rig(name)
    try:
        yield r
    finally:
        r.close()


def classify(frames: list[bytes]) -> str:
    """What the producer must do with a message of these frames from a DEALER:
    'oversized' (zmq drops the connection), 'rejected' (counted once), 'hello'
    (a genuine handshake or info, not garbage)."""
    if any(len(f) > MAX for f in frames):
        return "oversized"
    if len(frames) != 1:
        return "rejected"
    try:
        msg = protocol.decode(frames[0])
    except ProtocolError:
        return "rejected"
    if msg["type"] in protocol.ADMISSIONS and msg["protocol"] == protocol.PROTOCOL_VERSION:
        if not 0 < msg["pid"] < 2**31 or not 0 <= msg["start_time"] < 2**64:
            return "rejected"  # an impossible pid: refused with an error
        return "hello"
    return "rejected"


def _drain_replies(s: zmq.Socket, tally: dict) -> None:
    """Read the replies waiting on s; each must be an error message. (Some break the
    protocol's own string limit: see test_error_replies_fit_the_protocol.)"""
    while s.poll(0):
        data = s.recv()
        try:
            reply = protocol.decode(data)
        except ProtocolError:
            reply = msgpack.unpackb(data, raw=False)
            tally["undecodable replies"] += 1
        assert reply["type"] == "error" and set(reply) == {"type", "code", "message"}, reply
        tally["replies"] += 1


# -- strategies ------------------------------------------------------------------------

FIELDS = sorted({f for schema in protocol.SCHEMAS.values() for f in schema} | {"type"})
INT = st.integers(-2**63, 2**64 - 1)  # the whole msgpack integer range
SCALARS = st.one_of(st.none(), st.booleans(), INT, st.floats(), st.text(max_size=40),
                    st.binary(max_size=40))
VALUES = st.recursive(
    SCALARS,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                              max_size=4),
    max_leaves=12,
)
KEYS = st.sampled_from(FIELDS) | st.text(max_size=12) | INT | st.binary(max_size=8)
TYPES = st.sampled_from(sorted(protocol.SCHEMAS)) | st.text(max_size=12)
GOOD = {(int,): INT.filter(lambda v: -2**31 <= v < 2**31), (str,): st.text(max_size=20),
        (bool,): st.booleans(), (bytes,): st.binary(max_size=40)}


def _good_value(types: tuple):
    if type(None) in types:
        return st.none() | GOOD[(int,)]
    return GOOD[types]


@st.composite
def valid_messages(draw) -> bytes:
    """A message that passes protocol.decode (any type, consumer or producer side)."""
    kind = draw(st.sampled_from(sorted(protocol.SCHEMAS)))
    fields = {f: draw(_good_value(t)) for f, t in protocol.SCHEMAS[kind].items()}
    return msgpack.packb({"type": kind, **fields}, use_bin_type=True)


@st.composite
def mutated(draw) -> bytes:
    """A valid message truncated, bit-flipped, or with bytes inserted or deleted."""
    data = bytearray(draw(valid_messages()))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["truncate", "flip", "insert", "delete", "set"]))
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        if op == "truncate":
            del data[i:]
        elif op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete":
            del data[i]
        else:
            data[i] = draw(st.sampled_from([0xC0, 0xC1, 0xC4, 0xD4, 0xDC, 0xDE, 0xFF, 0x80]))
    return bytes(data)


@st.composite
def schema_abuse(draw) -> bytes:
    """Maps close to a real message: wrong types, missing, extra or renamed fields."""
    kind = draw(TYPES)
    schema = protocol.SCHEMAS.get(kind, {})
    msg: dict = {"type": kind}
    for f, t in schema.items():
        if draw(st.booleans()):
            msg[f] = draw(_good_value(t))
        elif draw(st.booleans()):
            msg[f] = draw(VALUES)  # usually the wrong type
    for k in draw(st.lists(KEYS, max_size=3)):
        msg[k] = draw(VALUES)
    if draw(st.integers(0, 9)) == 0:
        msg["type"] = draw(VALUES)  # a type that is not a string
    if draw(st.integers(0, 9)) == 0:
        msg = draw(VALUES)  # not a map at all
    return msgpack.packb(msg, use_bin_type=True, strict_types=False)


@st.composite
def huge(draw) -> bytes:
    """Big strings, arrays, maps and binaries (some beyond MAX_MESSAGE_BYTES)."""
    n = draw(st.integers(1, 3 * MAX // 2))
    what = draw(st.sampled_from(["str", "array", "map", "bin", "top-array"]))
    field = draw(st.sampled_from(FIELDS))
    if what == "str":
        value = "x" * n
    elif what == "array":
        value = [1] * min(n, 40000)
    elif what == "map":
        value = {str(i): i for i in range(min(n, 5000))}
    elif what == "bin":
        value = b"\x00" * n
    else:
        return msgpack.packb([0] * min(n, 40000))
    return msgpack.packb({"type": draw(TYPES), field: value}, use_bin_type=True)


@st.composite
def nested(draw) -> bytes:
    """Deeply nested maps or arrays at the top, under 'type' or under a field."""
    depth = draw(st.integers(1, 1200) | st.integers(1, 50))
    if draw(st.booleans()):
        inner = b"\x81\xa1k" * depth + b"\xc0"
    else:
        inner = b"\x91" * depth + b"\xc0"
    where = draw(st.sampled_from(["top", "type", "field"]))
    if where == "top":
        return inner
    if where == "type":
        return b"\x81\xa4type" + inner
    return b"\x83\xa4type\xa9heartbeat\xa8consumer\x00\xa5token" + inner


@st.composite
def oversized(draw) -> bytes:
    """Frames beyond MAX_MESSAGE_BYTES (zmq's MAXMSGSIZE must drop them)."""
    n = draw(st.integers(MAX + 1, 3 * MAX))
    head = draw(valid_messages() | st.binary(max_size=32))
    return (head + draw(st.binary(min_size=1, max_size=16)) * n)[:n]


PAYLOADS = st.one_of(
    st.binary(max_size=512),
    st.binary(min_size=1, max_size=8),
    mutated(),
    schema_abuse(),
    huge(),
    nested(),
)


def forged(index: int, token: int):
    """ready / heartbeat / bye claiming the real consumer's index, with a wrong token,
    or with its real token but from another socket (so from another identity)."""
    delta = st.integers(-2**63, 2**63).filter(lambda d: d != 0)
    tokens = st.one_of(
        st.just(token),
        delta.map(lambda d: token + d).filter(lambda t: -2**63 <= t < 2**64),
        st.just(0), st.just(token ^ 1), st.just(token + 1),
    )
    indices = st.one_of(st.just(index), st.integers(0, _core.MAX_CONSUMERS + 1))
    return st.builds(
        peer_message, st.sampled_from(["ready", "heartbeat", "bye", "park", "unpark", "list_epoch"]), indices, tokens,
    )


def peer_message(kind: str, consumer: int, token: int) -> bytes:
    """A well-formed message of an attached consumer (a ready asks for no alignment, a
    park to keep the place)."""
    extra = {"ready": {"align": False}, "park": {"hold": True, "skip_epoch": False},
             "list_epoch": {"epoch": -1, "first_batch": 0, "first_id": 0}}.get(kind, {})
    return protocol.encode(kind, consumer=consumer, token=token, **extra)


def messages(index: int, token: int):
    """(route, frames): route 'dealer' (one of several DEALERs), 'req' (a REQ socket,
    which adds an empty delimiter frame) or 'big' (a DEALER kept for oversized frames)."""
    payload = PAYLOADS | forged(index, token)
    single = st.tuples(st.just("dealer"), st.lists(payload, min_size=1, max_size=1))
    multi = st.tuples(st.just("dealer"),
                      st.lists(payload | st.just(b""), min_size=2, max_size=5))
    req = st.tuples(st.just("req"), st.lists(payload | forged(index, token), min_size=1,
                                             max_size=2))
    big = st.tuples(st.just("big"), st.lists(oversized(), min_size=1, max_size=1))
    return st.one_of(single, single, single, single, single, multi, multi, req, big)


# -- tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("examples", [150, pytest.param(900, marks=pytest.mark.slow)])
def test_fuzz_control_socket_while_a_consumer_reads(rig, examples):
    """Hundreds (900 lists under the slow marker: thousands) of malformed messages: each is
    rejected (and counted) exactly once, the consumer keeps getting every batch, a new
    consumer can attach afterwards."""
    idx, token = rig.consumer.index, rig.consumer.token
    dealers = [rig.socket() for _ in range(3)]
    req = rig.socket(zmq.REQ, REQ_RELAXED=1)
    big = rig.socket()
    base = rig.server.rejected
    tally = {"sent": 0, "rejected": 0, "oversized": 0, "skipped": 0, "replies": 0,
             "undecodable replies": 0}
    rr = [0]

    @settings(FUZZ, max_examples=examples)
    @given(st.lists(messages(idx, token), min_size=1, max_size=8))
    def fuzz(batch):
        for route, frames in batch:
            verdict = classify(frames if route != "req" else [b"", *frames])
            if verdict == "hello":
                tally["skipped"] += 1  # a genuine handshake, not garbage
                continue
            if route == "big":
                assert verdict == "oversized"
                try:
                    big.send_multipart(frames, zmq.NOBLOCK)
                except zmq.Again:
                    pass  # big is between two connections: nothing to count either way
                tally["oversized"] += 1
                continue
            if verdict == "oversized":
                continue  # a 'huge' value past the limit: it goes on 'big' instead
            sock = req if route == "req" else dealers[rr[0] % len(dealers)]
            rr[0] += 1
            sock.send_multipart(frames)
            tally["sent"] += 1
            tally["rejected"] += 1
        for s in dealers:
            _drain_replies(s, tally)

    fuzz()
    for s in dealers:
        s.send(peer_message("bye", idx, token))  # the real token
        tally["sent"] += 1
        tally["rejected"] += 1
    _wait_until(lambda: rig.server.rejected - base >= tally["rejected"], DEADLINE,
                f"the producer to reject {tally['rejected']} messages "
                f"(it rejected {rig.server.rejected - base})")
    time.sleep(0.2)
    assert rig.server.rejected - base == tally["rejected"], tally
    print("fuzz tally:", tally)
    assert tally["sent"] >= 1500 * examples // 900, tally  # every list sent, not a handful
    assert tally["oversized"] >= 20, tally
    for s in dealers:
        _drain_replies(s, tally)
    assert tally["replies"] > 0

    rig.assert_consumer_intact()
    assert rig.server._thread.is_alive()
    rig.assert_new_consumer_attaches()
    rig.assert_consumer_intact()
    for s in [*dealers, req, big]:
        s.close(0)
    rig.finish()


def test_forged_and_out_of_order_messages_do_not_detach_the_consumer(rig):
    """ready / heartbeat / bye before hello, with the real consumer's index and a wrong
    token, or its real token from another socket or a spoofed routing id; handshake
    games of a second client; none disturbs the real consumer."""
    idx, token = rig.consumer.index, rig.consumer.token
    s = rig.socket()
    for kind in ("bye", "ready", "heartbeat", "park", "unpark", "bye"):
        for t in (token + 1, token - 1, token ^ (1 << 40), 0, 2**64 - 1, token):
            base = rig.server.rejected
            s.send(peer_message(kind, idx, t))
            reply = protocol.decode(s.recv())
            assert reply == {"type": "error", "code": "unknown",
                             "message": "no such consumer on this socket"}
            assert rig.server.rejected == base + 1
    rig.assert_consumer_intact()

    # A DEALER claiming the consumer's own routing id: zmq refuses the duplicate id,
    # so the forged bye (with the real index and token) never reaches the producer.
    spoof = rig.socket(ROUTING_ID=rig.ident)
    spoof.send(peer_message("bye", idx, token))
    assert not spoof.poll(500), "the producer answered a spoofed routing id"
    spoof.close(0)
    rig.assert_consumer_intact()

    # A second client plays the handshake out of order.
    c = rig.socket()
    c.send(peer_message("ready", idx, token))
    assert protocol.decode(c.recv())["code"] == "unknown"
    me = os.getpid()  # alive, so the liveness check leaves these places alone
    hello = protocol.encode("hello", protocol=protocol.PROTOCOL_VERSION, pid=me,
                            start_time=_core.process_start_time(me), batch_size=3,
                            group=None, rank=0, world_size=1, proof=None)
    c.send(hello)
    welcome = protocol.decode(c.recv())
    assert welcome["type"] == "welcome" and welcome["consumer"] != idx
    c.send(hello)  # hello again: the first place is given back, a new one taken
    welcome = protocol.decode(c.recv())
    assert welcome["type"] == "welcome" and welcome["consumer"] != idx
    mine, my_token = welcome["consumer"], welcome["token"]
    for kind in ("bye", "ready", "heartbeat", "park", "unpark"):  # our token, the real consumer's index
        c.send(peer_message(kind, idx, my_token))
        assert protocol.decode(c.recv())["code"] == "unknown"
    c.send(peer_message("bye", mine, token))  # their token, our index
    assert protocol.decode(c.recv())["code"] == "unknown"
    c.send(peer_message("ready", mine, my_token))
    assert protocol.decode(c.recv())["type"] == "started"
    c.send(peer_message("ready", mine, my_token))  # twice: ignored
    c.send(peer_message("heartbeat", mine, my_token))
    c.send(peer_message("bye", mine, my_token))
    assert protocol.decode(c.recv())["type"] == "bye_ok"
    c.send(peer_message("bye", mine, my_token))  # after bye
    assert protocol.decode(c.recv())["code"] == "unknown"
    c.send(peer_message("heartbeat", mine, my_token))
    assert protocol.decode(c.recv())["code"] == "unknown"
    c.send(protocol.encode("hello", protocol=protocol.PROTOCOL_VERSION, pid=0, start_time=0,
                           batch_size=None, group=None, rank=0,
                           world_size=1, proof=None))  # no process has pid 0: refused
    assert protocol.decode(c.recv())["code"] == "protocol"
    c.send(protocol.encode("hello", protocol=protocol.PROTOCOL_VERSION, pid=2**31 - 1,
                           start_time=1, batch_size=None, group=None, rank=0,
                           world_size=1, proof=None))  # another process: refused
    assert protocol.decode(c.recv())["code"] == "auth"
    c.send(protocol.encode("hello", protocol=protocol.PROTOCOL_VERSION, pid=me,
                           start_time=1, batch_size=None, group=None, rank=0,
                           world_size=1, proof=None))  # then silence: evicted, not alive
    assert protocol.decode(c.recv())["type"] == "welcome"
    _wait_until(lambda: len(rig.server._peers) == 1, DEADLINE, "the dead client's eviction")
    for sock in (s, c):
        sock.close(0)

    rig.assert_consumer_intact()
    rig.assert_new_consumer_attaches()
    rig.finish()


def test_transport_level_garbage(rig, tmp_path):
    """Bytes that are not ZMTP at all, a broken ZMTP greeting, an absurd frame length,
    and an incompatible socket type (PUSH) on the control endpoint."""
    assert rig.address.startswith("ipc://")
    path = rig.address[len("ipc://"):]
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") \
        + b"\x00" + b"\x00" * 31
    ready = b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x06DEALER"
    prefixes = [b"", greeting[:10], greeting, greeting + ready]
    count = [0]

    @settings(FUZZ, max_examples=80)
    @given(st.sampled_from(prefixes), st.binary(max_size=256),
           st.sampled_from([b"", b"\x02\xff\xff\xff\xff\xff\xff\xff\xff",  # 2^64-1 bytes
                            b"\x00\x05hello", b"\x01\x00\x00\x05hello"]))
    def raw(prefix, junk, tail):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as u:
            u.settimeout(2)
            u.connect(path)
            try:
                u.sendall(prefix + junk + tail)
            except OSError:
                pass  # the producer may hang up first: that is fine
        count[0] += 1

    raw()
    assert count[0] >= 50
    push = rig.socket(zmq.PUSH)
    for _ in range(20):
        try:
            push.send(b"\x81\xa4type\xa3bye", zmq.NOBLOCK)
        except zmq.Again:
            pass  # ROUTER and PUSH are incompatible: zmq never completes the handshake
    push.close(0)
    assert rig.server._thread.is_alive()
    rig.assert_consumer_intact()
    rig.assert_new_consumer_attaches()
    rig.finish()


class _Marker:
    """Unpickling this creates a directory: proof that something was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (str(self.path),))


def test_pickle_payloads_are_never_unpickled(rig, tmp_path, monkeypatch):
    control = tmp_path / "control"
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):  # the payload works when unpickled
        pickle.loads(pickle.dumps(_Marker(control), protocol=proto))
        assert control.is_dir()
        control.rmdir()

    def refuse(*a, **k):
        raise AssertionError("something called pickle")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)

    marker = tmp_path / "pwned"
    pickles = [pickle.dumps(_Marker(marker), protocol=p)
               for p in range(pickle.HIGHEST_PROTOCOL + 1)]
    singles = []
    for p in pickles:
        singles += [
            p,
            msgpack.packb(p, use_bin_type=True),  # a msgpack bin holding the pickle
            msgpack.packb(msgpack.ExtType(1, p)),
            msgpack.packb({"type": "hello", "protocol": protocol.PROTOCOL_VERSION, "pid": p,
                           "start_time": 0, "batch_size": None}, use_bin_type=True),
            msgpack.packb({"type": p}, use_bin_type=True),
            msgpack.packb({"type": "error", "code": "protocol", "message": p},
                          use_bin_type=True),
            msgpack.packb({"type": "heartbeat", "consumer": rig.consumer.index,
                           "token": rig.consumer.token, "pickle": p}, use_bin_type=True),
        ]
    dealer = rig.socket()
    req = rig.socket(zmq.REQ, REQ_RELAXED=1)
    base = rig.server.rejected
    for data in singles:
        dealer.send(data)
        reply = protocol.decode(dealer.recv())
        assert reply["type"] == "error" and reply["code"] == "protocol", reply
    for p in pickles:
        dealer.send_multipart([p, p])  # wrong frame count: dropped unanswered
        req.send(p)
    expected = len(singles) + 2 * len(pickles)
    _wait_until(lambda: rig.server.rejected - base >= expected, DEADLINE,
                "the pickles to be rejected")
    time.sleep(0.3)
    assert rig.server.rejected - base == expected
    assert not marker.exists(), "a pickle sent to the control socket was unpickled"
    dealer.close(0)
    req.close(0)
    rig.assert_consumer_intact()
    rig.finish()


# -- bugs found by the fuzzer ----------------------------------------------------------


def _attach_after(rig: Rig, payload: bytes) -> None:
    """Send payload, then show the producer still answers and takes a new consumer."""
    s = rig.socket()
    s.send(payload)
    reply = s.poll(1500)
    s.close(0)
    rig.consumer.wait_batches(len(rig.consumer.seen) + 3, "the old consumer")  # unaffected
    assert reply, "the producer never answered: its control thread died"
    rig.assert_new_consumer_attaches(batches=3)
    rig.finish()


def test_hello_with_out_of_range_pid_does_not_kill_the_control_server(rig):
    _attach_after(rig, protocol.encode("hello", protocol=protocol.PROTOCOL_VERSION,
                                       pid=2**31, start_time=0, batch_size=None, group=None, rank=0,
                           world_size=1, proof=None))


def test_deeply_nested_type_does_not_kill_the_control_server(rig):
    _attach_after(rig, b"\x81\xa4type" * 1020 + b"\xc0")


def test_error_replies_fit_the_protocol(rig):
    s = rig.socket()
    s.send(msgpack.packb({"type": "\x00" * 4000}))
    data = s.recv()
    s.close(0)
    rig.assert_consumer_intact()
    rig.finish()
    assert msgpack.unpackb(data)["type"] == "error"
    protocol.decode(data)
