"""Who may attach to a producer, and what happens to a consumer that falls silent.

A hello over ipc:// must come from a process of the producer's user and name that
process's own pid (the kernel's peer credentials of the socket say which it is); over
TCP it must carry the producer's secret. A peer refused so learns nothing of the
producer. A consumer whose heartbeats stop while its process lives on (stopped, or a
socket that said hello and went quiet) is evicted after heartbeat_timeout, and the
others go on; a consumer busy with a long step keeps heartbeating from its thread.

Every wait has a deadline, so a regression fails instead of hanging.
"""

from __future__ import annotations

import os
import socket
import stat
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch
import zmq

from conftest import ROOT, Producing, hello_message, run as run_python
from tensorsocket import TensorConsumer, TensorProducer, TensorSocketError, _core
from tensorsocket.control import auth, protocol
from tensorsocket.control.endpoints import runtime_dir

DEADLINE = 30.0  # seconds any single wait may take before the test fails


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loader(n: int) -> list:
    return [(torch.full((2,), float(i)),) for i in range(n)]


def _dealer(address: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, int(DEADLINE * 1000))
    s.setsockopt(zmq.SNDTIMEO, int(DEADLINE * 1000))
    s.connect(address)
    return s


def _ask(s: zmq.Socket, payload: bytes) -> dict:
    s.send(payload)
    return protocol.decode(s.recv())


def _wait_until(pred, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - t0


class Reading(threading.Thread):
    """A TensorConsumer in a thread: the first value of every batch it receives."""

    def __init__(self, **kwargs) -> None:
        super().__init__(daemon=True, name="consumer")
        self.kwargs = kwargs
        self.seen: list[float] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with TensorConsumer(timeout=DEADLINE, batch_timeout=DEADLINE, **self.kwargs) as c:
                for batch in c:
                    self.seen.append(float(batch[0][0]))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def _refusal_reveals_nothing(reply: dict, producer: TensorProducer) -> None:
    """A refused peer gets an `auth` error and nothing of the producer's state."""
    assert reply["type"] == "error" and reply["code"] == "auth", reply
    assert set(reply) == {"type", "code", "message"}, reply
    for secret in (producer._rings.segment, "tensorsocket-", "builtins.list"):
        assert secret not in reply["message"], reply["message"]
    assert producer._server.present_count() == 0


class Rig:
    """One test's producers (each iterated in a Producing thread), raw peer sockets and
    Reading consumers; close() (the `rig` fixture calls it, a test may call it first)
    closes the sockets, then the producers, then joins the threads."""

    def __init__(self) -> None:
        self.sockets: list[zmq.Socket] = []
        self.producers: list[TensorProducer] = []
        self.threads: list[threading.Thread] = []

    def serve(self, batches: int, *args, **kw) -> tuple[TensorProducer, Producing]:
        """A producer of `batches` batches (start_timeout=DEADLINE unless given), iterated
        in a thread: hellos are answered once its ring exists."""
        kw.setdefault("start_timeout", DEADLINE)
        p = TensorProducer(_loader(batches), *args, **kw)
        self.producers.append(p)
        producing = Producing(p)
        producing.start()
        self.threads.append(producing)
        return p, producing

    def peer(self, address: str) -> zmq.Socket:
        """A raw DEALER socket connected to `address`."""
        s = _dealer(address)
        self.sockets.append(s)
        return s

    def read(self, **kwargs) -> Reading:
        """A consumer reading in a thread (TensorConsumer(**kwargs))."""
        reading = Reading(**kwargs)
        reading.start()
        self.threads.append(reading)
        return reading

    def close(self) -> None:
        for s in self.sockets:
            s.close(0)
        for p in self.producers:
            p.close()
        for t in self.threads:
            t.join(DEADLINE)
        self.sockets, self.producers, self.threads = [], [], []


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


# -- forged hellos ----------------------------------------------------------------------


def test_hello_claiming_another_pid_over_ipc_is_refused(name, rig):
    """The hijack over the unix socket: a peer says hello as pid 1 (alive for ever, so
    never evicted) and ready. It must be refused, so that the real consumer reads the
    epoch from batch 0 instead of becoming a late joiner behind a reader that never
    reads (everything hung for good)."""
    p, _ = rig.serve(20, name=name, publish_timeout=DEADLINE)
    s = rig.peer(p.endpoint.address)
    reply = _ask(s, hello_message(1))
    if reply["type"] == "welcome":  # hijacked: the forger is consumer 0, and ready
        assert _ask(s, protocol.encode("ready", consumer=reply["consumer"],
                                       token=reply["token"], align=False))["type"] == "started"
    reading = rig.read(name=name)
    reading.join(DEADLINE + 5)
    assert reading.error is None, repr(reading.error)
    assert reading.seen == [float(i) for i in range(20)]
    _refusal_reveals_nothing(reply, p)
    assert "pid 1" in reply["message"] and f"pid {os.getpid()}" in reply["message"]
    assert p._server.rejected == 1


def test_hello_from_its_own_process_is_accepted_over_ipc(name, rig):
    """The peer check lets a raw client speaking for its own process in (what the
    control-plane tests rely on)."""
    p, _ = rig.serve(2, name=name)
    s = rig.peer(p.endpoint.address)
    reply = _ask(s, hello_message(os.getpid()))
    assert reply["type"] == "welcome", reply
    assert _ask(s, protocol.encode("bye", consumer=reply["consumer"],
                                   token=reply["token"]))["type"] == "bye_ok"


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
def test_ipc_peer_of_another_user_is_refused(name, rig):
    """A producer on an explicit ipc:// path others can reach (outside the 0700 runtime
    directory) still refuses a process of another user, whatever pid it claims."""
    where = tempfile.mkdtemp(prefix="ts-auth-")
    os.chmod(where, 0o755)
    address = f"ipc://{where}/control.sock"
    p, _ = rig.serve(2, name=name, address=address)
    try:
        os.chmod(f"{where}/control.sock", 0o777)
        client = textwrap.dedent(f"""
            import os
            import zmq
            from tensorsocket import _core
            from tensorsocket.control import protocol
            os.setgid(65534)
            os.setuid(65534)  # every thread of the process; zmq's start below
            s = zmq.Context().socket(zmq.DEALER)
            s.setsockopt(zmq.RCVTIMEO, {int(DEADLINE * 1000)})
            s.connect({address!r})
            me = os.getpid()
            fields = dict(protocol=protocol.PROTOCOL_VERSION, pid=me,
                          start_time=_core.process_start_time(me), batch_size=None,
                          group=None, rank=0, world_size=1)
            for f in protocol.SCHEMAS["hello"]:
                fields.setdefault(f, None)
            s.send(protocol.encode("hello", **fields))
            reply = protocol.decode(s.recv())
            print(reply["type"], reply.get("code"), reply.get("message"))
        """)
        # cwd="/": the client imports this tree's tensorsocket through PYTHONPATH, which
        # conftest starts with ROOT.
        assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
        out = run_python([sys.executable, "-c", client], capture_output=True, text=True,
                         timeout=DEADLINE, cwd="/")
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("error auth "), out.stdout
        assert "uid 65534" in out.stdout and "same user" in out.stdout, out.stdout
        assert p._server.present_count() == 0
    finally:
        rig.close()
        os.rmdir(where)


# -- the TCP secret ---------------------------------------------------------------------


def test_tcp_producer_refuses_a_hello_without_its_secret(name, rig):
    """The hijack over loopback TCP, where any local user can connect: a hello as pid 1
    without the producer's secret is refused and learns nothing; the real consumer
    (same user: it reads the secret file) reads every batch from batch 0."""
    port = _free_port()
    p, _ = rig.serve(20, port, name=name, publish_timeout=DEADLINE)
    s = rig.peer(f"tcp://127.0.0.1:{port}")
    reply = _ask(s, hello_message(1))
    if reply["type"] == "welcome":  # hijacked: the forger is consumer 0, and ready
        assert _ask(s, protocol.encode("ready", consumer=reply["consumer"],
                                       token=reply["token"], align=False))["type"] == "started"
    reading = rig.read(port=port, name=name)
    reading.join(DEADLINE + 5)
    assert reading.error is None, repr(reading.error)
    assert reading.seen == [float(i) for i in range(20)]
    _refusal_reveals_nothing(reply, p)
    assert "secret" in reply["message"]


def test_tcp_secret_file_and_wrong_secrets(name, monkeypatch, tmp_path, rig):
    """The secret: a 0600 file of this user in the runtime directory, removed when the
    producer closes; a wrong or missing one is refused with an error naming what to do;
    a consumer that cannot read the file passes it as auth_token= / the variable."""
    monkeypatch.delenv("TENSORSOCKET_AUTH_TOKEN", raising=False)
    port = _free_port()
    p, producing = rig.serve(3, port, name=name, publish_timeout=DEADLINE)
    path = runtime_dir() / f"{name}.secret"
    s = rig.peer(f"tcp://127.0.0.1:{port}")
    try:
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.getuid()
        secret = path.read_text().strip()
        assert secret == p.auth_token and len(secret) >= 32
        near = secret[:-1] + ("0" if secret[-1] != "0" else "1")
        for wrong in (None, "", auth.derive_key(near), auth.derive_key(secret + "0"),
                      "x" * 4000, "é" * 64):
            nonce = auth.new_nonce()
            proof = _ask(s, protocol.encode("challenge", protocol=protocol.PROTOCOL_VERSION,
                                            nonce=nonce))
            assert proof["type"] == "proof", proof
            if isinstance(wrong, bytes):  # a key: the proof of another secret
                wrong = auth.mac(wrong, "consumer", nonce, proof["nonce"])
            _refusal_reveals_nothing(_ask(s, hello_message(os.getpid(), proof=wrong)), p)
        assert p._server.rejected == 6

        with pytest.raises(TensorSocketError) as refused:
            TensorConsumer(port, name=name, timeout=DEADLINE, auth_token="0" * 64)
        message = str(refused.value)
        assert "secret" in message and "auth_token=" in message and \
            "TENSORSOCKET_AUTH_TOKEN" in message, message
        assert p._server.present_count() == 0

        # Another runtime directory: no secret file there; the variable carries it.
        other = tmp_path / "rt"
        monkeypatch.setenv("TENSORSOCKET_RUNTIME_DIR", str(other))
        with pytest.raises(TensorSocketError, match="no secret file"):
            TensorConsumer(port, name=name, timeout=DEADLINE)
        monkeypatch.setenv("TENSORSOCKET_AUTH_TOKEN", secret)
        with TensorConsumer(port, name=name, timeout=DEADLINE, batch_timeout=DEADLINE) as c:
            assert [float(b[0][0]) for b in c] == [0.0, 1.0, 2.0]
    finally:
        rig.close()
    assert producing.error is None, repr(producing.error)
    assert not path.exists(), "the secret file outlived its producer"


def test_consumer_started_before_the_tcp_producer_finds_the_new_secret(name, monkeypatch, rig):
    """A consumer that says hello before the producer runs, with a stale secret file of
    an earlier producer of the name (killed, say), still attaches: the producer replaces
    the file, and the refused consumer reads it again."""
    from tensorsocket.control import auth

    sent: list = []
    current = auth.ClientSecret.current
    monkeypatch.setattr(auth.ClientSecret, "current",
                        lambda self: sent.append(current(self)) or sent[-1])
    port = _free_port()
    stale = runtime_dir() / f"{name}.secret"
    fd = os.open(stale, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"f" * 64)
    os.close(fd)
    reading = rig.read(port=port, name=name)
    _wait_until(lambda: sent or reading.error, DEADLINE, "the consumer's first hello")
    p, _ = rig.serve(5, port, name=name, publish_timeout=DEADLINE)
    reading.join(DEADLINE + 5)
    assert reading.error is None, repr(reading.error)
    assert reading.seen == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert sent == ["f" * 64, p.auth_token] and p.auth_token != "f" * 64


# -- silent consumers -------------------------------------------------------------------


def test_silent_peer_is_evicted_and_the_others_go_on(name, monkeypatch, rig):
    """A peer of a live process that said hello and ready, then nothing: it never reads,
    so the ring fills and the real consumer waits; after heartbeat_timeout it is evicted
    (its place and slots released) and the real consumer gets every batch."""
    monkeypatch.setenv("TENSORSOCKET_HEARTBEAT_TIMEOUT", "3")
    p, producing = rig.serve(30, name=name, min_consumers=2, publish_timeout=DEADLINE)
    s = rig.peer(p.endpoint.address)
    try:
        welcome = _ask(s, hello_message(os.getpid()))
        assert welcome["type"] == "welcome", welcome
        started = _ask(s, protocol.encode("ready", consumer=welcome["consumer"],
                                          token=welcome["token"], align=False))
        assert started["type"] == "started", started
        reading = rig.read(name=name)
        # (Not "one peer left": the reader may have read everything and left by then.)
        _wait_until(lambda: all(peer.token != welcome["token"]
                                for peer in list(p._server._peers.values())),
                    DEADLINE, "the silent peer's eviction")
        reading.join(DEADLINE + 5)
        assert reading.error is None, repr(reading.error)
        assert reading.seen == [float(i) for i in range(30)]
        entry = p.ring.consumer(welcome["consumer"])
        assert entry["token"] != welcome["token"] or entry["state"] == _core.CONSUMER_FREE
        reply = _ask(s, protocol.encode("heartbeat", consumer=welcome["consumer"],
                                        token=welcome["token"]))
        assert reply["code"] == "unknown", reply  # it is no consumer any more
    finally:
        rig.close()
    assert producing.error is None, repr(producing.error)


def test_busy_consumer_is_not_evicted(name, rig):
    """A training step longer than heartbeat_timeout, holding its batch: the consumer's
    heartbeat thread keeps it attached, and it reads the whole epoch."""
    p, producing = rig.serve(3, name=name, publish_timeout=DEADLINE, heartbeat_timeout=3)
    try:
        with TensorConsumer(name=name, timeout=DEADLINE, batch_timeout=DEADLINE) as c:
            seen = []
            for batch in c:
                seen.append(float(batch[0][0]))
                if len(seen) == 1:
                    step_end = time.monotonic() + 7  # more than twice the timeout
                    while time.monotonic() < step_end:
                        time.sleep(0.1)
                    assert p.consumers_present() == 1
                    assert p.ring.consumer(c._place.index)["state"] == _core.CONSUMER_ACTIVE
                del batch
        assert seen == [0.0, 1.0, 2.0]
    finally:
        rig.close()
    assert producing.error is None, repr(producing.error)


def test_heartbeat_timeout_is_checked(name, monkeypatch):
    """Too short a heartbeat_timeout would evict consumers between two heartbeats."""
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        TensorProducer(_loader(1), name=name, heartbeat_timeout=0.5)
    monkeypatch.setenv("TENSORSOCKET_HEARTBEAT_TIMEOUT", "none")
    p = TensorProducer(_loader(1), name=name)
    try:
        assert p._server._liveness.heartbeat_timeout is None
    finally:
        p.close()


def test_heartbeats_go_on_when_the_queue_to_the_producer_is_full(monkeypatch):
    """A heartbeat that cannot be queued (the producer read nothing for so long that the
    socket's queue is full) is skipped, not the end of the heartbeat thread: once the
    producer reads again, it must hear from this consumer, or it evicts it."""
    from tensorsocket.control import client as control

    class FullThenFree:
        """Stands in for the consumer's socket: full until it refused a few messages, a
        park among them, then free."""

        def __init__(self) -> None:
            self.refused: list[str] = []
            self.sent: list[str] = []

        def send(self, data: bytes, flags: int = 0) -> None:
            kind = protocol.decode(data)["type"]
            if len(self.refused) < 3 or "park" not in self.refused:
                self.refused.append(kind)
                raise zmq.Again()
            self.sent.append(kind)

        def poll(self, timeout: int = 0) -> int:
            return 0

    monkeypatch.setattr(control, "HEARTBEAT_INTERVAL", 0.01)
    client = control.ControlClient.__new__(control.ControlClient)
    client._sock = FullThenFree()
    client.consumer, client.token, client.left, client._park_hold = 0, 7, False, False
    for event in ("_stop", "_leave", "_park", "_wake"):
        setattr(client, event, threading.Event())
    client._thread = None
    client.start_heartbeats()
    client.request_park(hold=True)  # refused at first: sent once there is room
    try:
        _wait_until(lambda: len(client._sock.sent) >= 3, DEADLINE, "heartbeats after the queue "
                    "had room again")
    finally:
        client._stop.set()
        client._wake.set()
        client._thread.join(DEADLINE)
    kinds = client._sock.sent
    assert kinds[0] == "park" and kinds.count("park") == 1 and "heartbeat" in kinds, kinds


# -- a hello on a connection that answered no challenge (issue 35) --------------------------


def _challenge(nonce: str) -> bytes:
    return protocol.encode("challenge", protocol=protocol.PROTOCOL_VERSION, nonce=nonce)


def test_a_hello_that_answers_no_challenge_on_its_connection_is_asked_to_challenge_again(
        name, rig):
    """A producer whose table of unproven connections is full may close the connection a
    consumer's challenge was answered on; the consumer's zmq socket then sends its hello
    on a new connection, which answered no challenge. That hello was refused like a
    forgery (code "auth": AuthenticationError "answers no challenge"); now it is answered
    "rechallenge", which reveals nothing either and is no refusal, and the consumer's
    challenge on the new connection lets its hello in."""
    port = _free_port()
    p, _ = rig.serve(3, port, name=name, publish_timeout=DEADLINE)
    key = auth.derive_key(p.auth_token)
    address = f"tcp://127.0.0.1:{port}"
    closed, fresh = rig.peer(address), rig.peer(address)
    nonce = auth.new_nonce()
    proof = _ask(closed, _challenge(nonce))  # answered on one connection ...
    assert proof["type"] == "proof", proof
    answer = auth.mac(key, "consumer", nonce, proof["nonce"])
    reply = _ask(fresh, hello_message(os.getpid(), proof=answer))  # ... the hello on another
    assert reply["type"] == "error" and reply["code"] == "rechallenge", reply
    assert set(reply) == {"type", "code", "message"} and "answers no challenge" in \
        reply["message"], reply
    for secret in (p._rings.segment, "tensorsocket-", "builtins.list"):
        assert secret not in reply["message"], reply["message"]
    assert p._server.present_count() == 0
    nonce = auth.new_nonce()
    proof = _ask(fresh, _challenge(nonce))
    reply = _ask(fresh, hello_message(os.getpid(),
                                      proof=auth.mac(key, "consumer", nonce, proof["nonce"])))
    assert reply["type"] == "welcome", reply
    assert p._server._admission.refused == 0 and p._server._admission.rechallenged == 1


def test_a_hello_made_of_an_answer_on_another_connection_is_asked_to_challenge_again(
        name, rig):
    """A consumer's challenge sent again on a new connection (the first closed once
    answered) gets another nonce there; a hello made of the first answer and sent on the
    new connection is asked to challenge again (it was refused as a wrong secret: fatal),
    while a proof of another secret, or the same answer replayed by another peer that
    sent its own challenge, is still refused or asked again, never let in."""
    port = _free_port()
    p, _ = rig.serve(3, port, name=name, publish_timeout=DEADLINE)
    key = auth.derive_key(p.auth_token)
    address = f"tcp://127.0.0.1:{port}"
    first, second = rig.peer(address), rig.peer(address)
    nonce = auth.new_nonce()
    one, two = _ask(first, _challenge(nonce)), _ask(second, _challenge(nonce))
    assert one["nonce"] != two["nonce"], (one, two)  # a nonce per connection
    answer = auth.mac(key, "consumer", nonce, one["nonce"])
    reply = _ask(second, hello_message(os.getpid(), proof=answer))
    assert reply["type"] == "error" and reply["code"] == "rechallenge", reply
    assert "another connection" in reply["message"], reply
    three = _ask(second, _challenge(nonce))  # (the hello took the challenge: a new one)
    wrong = auth.mac(auth.derive_key(p.auth_token + "0"), "consumer", nonce, three["nonce"])
    _refusal_reveals_nothing(_ask(second, hello_message(os.getpid(), proof=wrong)), p)
    assert p._server.present_count() == 0
    assert p._server._admission.refused == 1 and p._server._admission.rechallenged == 1


def test_a_consumer_asked_to_challenge_again_does(monkeypatch):
    """The consumer's side: a producer (here a stand-in that knows the secret) asks for a
    challenge again at the first hello (info, here); the consumer challenges again with a
    new nonce, and its second proof fits that exchange. Before issue 35 the consumer
    raised TensorSocketError ("producer refused")."""
    from tensorsocket.control.client import ControlClient
    from tensorsocket.control.endpoints import resolve

    token = "s" * 48
    monkeypatch.setenv("TENSORSOCKET_AUTH_TOKEN", token)
    key = auth.derive_key(token)
    port = _free_port()
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    got: list[dict] = []
    errors: list = []

    def stand_in() -> None:
        exchanges: dict[bytes, tuple[str, str]] = {}
        try:
            while router.poll(int(DEADLINE * 1000)):
                ident, payload = router.recv_multipart()
                msg = protocol.decode(payload)
                got.append(msg)
                if msg["type"] == "challenge":
                    mine = auth.new_nonce()
                    exchanges[ident] = (msg["nonce"], mine)
                    router.send_multipart([ident, protocol.encode(
                        "proof", nonce=mine, mac=auth.mac(key, "producer", msg["nonce"], mine))])
                    continue
                theirs, mine = exchanges.pop(ident)
                assert msg["proof"] == auth.mac(key, "consumer", theirs, mine), msg
                if sum(m["type"] == "info" for m in got) == 1:
                    router.send_multipart([ident, protocol.encode(
                        "error", code="rechallenge",
                        message="the info answers no challenge of this producer on its "
                                "connection")])
                    continue
                router.send_multipart([ident, protocol.LoaderInfo(
                    protocol=protocol.PROTOCOL_VERSION, producer_pid=1, length=3,
                    loader_batch_size=4, samples=10, samples_exact=True, dataset=None,
                    dataset_len=None, fingerprint=None).encode()])
                return
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    thread = threading.Thread(target=stand_in, daemon=True)
    thread.start()
    endpoint = resolve(None, port, None)
    client = ControlClient(context, endpoint.address, DEADLINE, auth.ClientSecret(endpoint))
    try:
        reply = client.info()
    finally:
        client.close(say_bye=False)
        thread.join(DEADLINE)
        router.close(0)
        context.term()
    assert errors == [], errors
    assert reply.length == 3 and client.rechallenges == 1
    assert [m["type"] for m in got] == ["challenge", "info", "challenge", "info"], got
    assert got[0]["nonce"] != got[2]["nonce"]
