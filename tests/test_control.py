"""The control plane: schema checks, garbage, version mismatch, duplicate names."""

from __future__ import annotations

import os
import socket

import msgpack
import pytest
import zmq

from tensorsocket import (
    ProtocolError,
    TensorConsumer,
    TensorProducer,
    TensorSocketError,
    VersionMismatch,
)
from tensorsocket import _core
from tensorsocket.control import protocol
from tensorsocket.control.endpoints import resolve


def test_decode_rejects_garbage_and_wrong_types():
    for data in [b"", b"\xc1", b"\x93\x01\x02\x03", msgpack.packb({"type": "nope"}),
                 msgpack.packb({"type": "hello", "protocol": "1", "pid": 1, "start_time": 1,
                                "batch_size": None}),
                 msgpack.packb({"type": "bye", "consumer": 1, "token": 2, "extra": 1}),
                 msgpack.packb({"type": "bye", "consumer": True, "token": 2}),
                 b"\x80\x04\x95" + b"\x00" * 20]:  # a pickle header
        with pytest.raises(ProtocolError):
            protocol.decode(data)
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.decode(b"\x00" * (protocol.MAX_MESSAGE_BYTES + 1))


def _raw_dealer(address: str) -> zmq.Socket:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(address)
    return s


def _loader():
    import torch

    return [(torch.full((2,), float(i)),) for i in range(5)]


def test_garbage_and_version_mismatch_do_not_disturb_the_producer(name):
    """Hostile bytes get error replies; a real consumer still works afterwards."""
    p = TensorProducer(_loader(), name=name, min_consumers=1, start_timeout=30)
    try:
        s = _raw_dealer(p.endpoint.address)
        for junk in [b"garbage", b"\xc1\xc1", msgpack.packb([1, 2, 3]),
                     msgpack.packb({"type": "welcome"})]:
            s.send(junk)
            reply = protocol.decode(s.recv())
            assert reply["type"] == "error"
        s.send(protocol.encode("hello", protocol=999, pid=os.getpid(), start_time=0,
                               batch_size=None, group=None, rank=0, world_size=1,
                               proof=None))
        reply = protocol.decode(s.recv())
        assert reply["type"] == "error" and reply["code"] == "version"
        assert "999" in reply["message"]
        s.send(protocol.encode("bye", consumer=0, token=123))  # not ours
        assert protocol.decode(s.recv())["code"] == "unknown"
        s.close()
        assert p._server.rejected >= 6
        import threading

        got = []

        def consume():
            with TensorConsumer(name=name, timeout=10) as c:
                got.extend(float(b[0][0]) for b in c)

        t = threading.Thread(target=consume)
        t.start()
        for _ in p:
            pass
        t.join(30)
        assert got == [0.0, 1.0, 2.0, 3.0, 4.0]
    finally:
        p.close()


def test_hello_of_another_layout_gets_a_version_error(name):
    """A hello of another tensorsocket version has other fields (protocol 4 had no
    secret; a later one may add some): it fails the schema, and yet its sender is told
    about the versions, which is what to fix, not about a field."""
    p = TensorProducer(_loader(), name=name)
    try:
        s = _raw_dealer(p.endpoint.address)
        base = dict(type="hello", pid=os.getpid(), start_time=0, batch_size=None,
                    group=None, rank=0, world_size=1)
        for theirs, fields in ((protocol.PROTOCOL_VERSION - 1, {}),
                               (protocol.PROTOCOL_VERSION + 1,
                                {"proof": None, "something_new": 1})):
            s.send(msgpack.packb({**base, "protocol": theirs, **fields}))
            reply = protocol.decode(s.recv())
            assert reply["type"] == "error" and reply["code"] == "version", reply
            assert f"consumer {theirs}" in reply["message"], reply
        s.close()
        assert p._server.rejected == 2
    finally:
        p.close()


def test_consumer_sees_version_mismatch_clearly(name):
    """A producer answering with a version error makes the consumer raise VersionMismatch."""
    ep = resolve(name)
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(ep.address)
    import threading

    def fake_producer():
        ident, _ = router.recv_multipart()
        router.send_multipart([ident, protocol.encode(
            "error", code="version", message="producer speaks protocol 2, consumer 1")])

    t = threading.Thread(target=fake_producer)
    t.start()
    try:
        with pytest.raises(VersionMismatch, match="protocol 2"):
            TensorConsumer(name=name, timeout=5)
    finally:
        t.join(5)
        router.close(0)


def test_second_producer_with_same_name_is_refused(name):
    p = TensorProducer(_loader(), name=name)
    try:
        with pytest.raises(TensorSocketError, match="already running"):
            TensorProducer(_loader(), name=name)
    finally:
        p.close()
    TensorProducer(_loader(), name=name).close()  # free again


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_port_binds_loopback_only(name):
    port = _free_port()
    p = TensorProducer(_loader(), str(port), str(port + 1))
    try:
        assert p.endpoint.address == f"tcp://127.0.0.1:{port}"
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    finally:
        p.close()


def test_a_producer_that_cannot_listen_leaves_no_files_and_names_the_holder():
    """Something listens on the port already (here this process: a plain socket): the
    producer cannot bind it. It left port<N>.lock behind in the runtime directory (issue
    35); now its lock, secret and socket files all go, and the error names who listens
    there (from the kernel's table of listening sockets)."""
    from tensorsocket.control.endpoints import runtime_dir

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(TensorSocketError) as raised:
            TensorProducer(_loader(), port=port)
    left = sorted(p.name for p in runtime_dir().glob(f"port{port}.*"))
    assert left == [], left
    message = str(raised.value)
    assert f"cannot listen on tcp://127.0.0.1:{port}" in message, message
    assert f"a process of this user (uid {os.getuid()}" in message, message
    assert "listens there" in message and "another name= or port=" in message, message


def test_non_loopback_address_warns(name):
    port = _free_port()
    with pytest.warns(UserWarning, match="reachable from other machines"):
        p = TensorProducer(_loader(), name=name, address=f"tcp://0.0.0.0:{port}")
    p.close()


def test_runtime_dir_is_private():
    ep = resolve("x")
    st = os.stat(ep.runtime_dir)
    assert st.st_mode & 0o777 == 0o700 and st.st_uid == os.getuid()


def test_bad_names_are_rejected():
    for bad in ["", "a/b", "../x", "x" * 100, "sp ace"]:
        with pytest.raises(ValueError, match="invalid producer name"):
            resolve(bad)


def test_ranks_of_a_group_start_together_once_all_are_ready(name):
    """A rank that said ready waits for the group's other ranks to say ready too, not
    merely hello: started alone it would read on and free the entries the others need
    (the CI failure: ranks of one torchrun job joined at entries 34 and 35)."""
    import threading

    import torch

    loader = [(torch.full((2,), float(i)),) for i in range(1000)]
    p = TensorProducer(loader, name=name, start_timeout=30)
    stop = threading.Event()

    def produce():
        try:
            for _ in p:
                if stop.is_set():
                    break
        except TensorSocketError:  # closed by the test while waiting for its ring
            pass

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    socks = [_raw_dealer(p.endpoint.address) for _ in range(2)]
    try:
        welcomes = []
        for rank, s in enumerate(socks):
            s.send(protocol.encode("hello", protocol=protocol.PROTOCOL_VERSION, pid=os.getpid(),
                                   start_time=_core.process_start_time(os.getpid()),
                                   batch_size=None, group="job", rank=rank, world_size=2,
                                   proof=None))
            reply = protocol.decode(s.recv())
            assert reply["type"] == "welcome", reply
            welcomes.append(reply)
        w0, w1 = welcomes
        socks[0].send(protocol.encode("ready", consumer=w0["consumer"], token=w0["token"],
                                      align=True))
        # Rank 1 said hello but not ready: rank 0 must not start. (Waiting longer could
        # only make this check stricter, never make a correct producer fail it.)
        assert socks[0].poll(1500) == 0, protocol.decode(socks[0].recv())
        socks[1].send(protocol.encode("ready", consumer=w1["consumer"], token=w1["token"],
                                      align=True))
        starts = [protocol.decode(s.recv()) for s in socks]
        assert [m["type"] for m in starts] == ["started", "started"], starts
        assert starts[0]["start_seq"] == starts[1]["start_seq"]
        for s, w in zip(socks, welcomes):
            s.send(protocol.encode("bye", consumer=w["consumer"], token=w["token"]))
            assert protocol.decode(s.recv())["type"] == "bye_ok"
    finally:
        stop.set()
        for s in socks:
            s.close()
        p.close()
        t.join(30)


def test_info_tells_the_loader_without_attaching(name):
    """info (what share() asks) is answered with the producer's loader, once its ring
    exists, and takes no place in the ring; it is admitted as a hello is."""
    import threading

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from tensorsocket.control.client import ControlClient
    from tensorsocket.loader.loader_info import LoaderShape

    loader = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4)
    p = TensorProducer(loader, name=name, min_consumers=1, start_timeout=30, start_grace=0)
    producing = threading.Thread(target=lambda: [None for _ in p], daemon=True)
    me = os.getpid()
    info = dict(protocol=protocol.PROTOCOL_VERSION, pid=me,
                start_time=_core.process_start_time(me), proof=None)
    try:
        s = _raw_dealer(p.endpoint.address)
        s.send(protocol.encode("info", **info))
        assert not s.poll(300)  # no ring yet: answered once there is one
        producing.start()
        reply = protocol.read(s.recv())
        assert reply.kind == "loader_info", reply
        assert (reply.length, reply.loader_batch_size, reply.samples, reply.samples_exact) \
            == (3, 4, 10, True)
        assert (reply.producer_pid, reply.dataset_len) == (me, 10)
        assert reply.dataset == "torch.utils.data.dataset.TensorDataset"
        assert p._server.present_count() == 0 and p.stats()["consumers"] == 0
        s.send(protocol.encode("info", **{**info, "pid": 2**31 - 1, "start_time": 1}))
        assert protocol.read(s.recv()).code == "auth"  # another process: refused
        s.close()

        context = zmq.Context()
        client = ControlClient(context, p.endpoint.address, 10)
        try:
            shape = LoaderShape.of_reply(client.info())
        finally:
            client.close(say_bye=False)
            context.term()
        assert shape.same_batches(4, False)
        assert not shape.same_batches(4, True) and not shape.same_batches(5, False)
        assert p._server.present_count() == 0

        with TensorConsumer(name=name, timeout=10) as c:
            assert [b[0].tolist() for b in c] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        producing.join(30)
    finally:
        p.close()


def test_a_name_lock_taken_on_a_removed_lock_file_is_taken_again(monkeypatch, tmp_path):
    """A producer that ends (or fails to bind) removes its lock file while it holds it;
    another that opened the file before and locks it after holds a removed file, no lock
    of the name: it opens and locks the file at the path now (the review of issue 35:
    two producers both held "the" name, and the first to end removed the other's file)."""
    from tensorsocket.control import producer_files
    from tensorsocket.control.endpoints import file_is_at, open_lock_file

    monkeypatch.setenv("TENSORSOCKET_RUNTIME_DIR", str(tmp_path / "rt"))
    endpoint = resolve("locked", for_producer=True)
    first = producer_files.take_name_lock(endpoint)
    stale = open_lock_file(endpoint.lock_path)  # the second producer opened it, then ...
    endpoint.lock_path.unlink()  # ... the first removed it and let go
    os.close(first)
    opened = iter([stale])
    monkeypatch.setattr(producer_files, "open_lock_file",
                        lambda path: next(opened, None) or open_lock_file(path))
    fd = producer_files.take_name_lock(endpoint)
    try:
        assert file_is_at(fd, endpoint.lock_path)
        assert endpoint.lock_path.read_text() == str(os.getpid())
    finally:
        os.close(fd)
