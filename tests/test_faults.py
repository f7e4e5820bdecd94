"""Faults in real processes: SIGKILL and SIGSTOP of either role, SIGTERM of the producer,
/dev/shm too small, files planted in /dev/shm, random kills. Each test adds a row to the fault table (what was done, how long detection
took, what the survivors saw, what was left behind); `python -m pytest tests/test_faults.py
--fault-table docs/faults.md` writes it."""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time

import pytest
import torch
import zmq

from conftest import hello_message, shm_segments
from tensorsocket import SharedMemoryTooSmall, TensorConsumer, TensorProducer, TensorSocketError
from tensorsocket import _core
from tensorsocket.control import protocol
from tensorsocket.control.endpoints import resolve, runtime_dir


def _batches(epoch: int, start: int, stop: int) -> list[int]:
    return [epoch * 1000 + b for b in range(start, stop)]


def _ring_of(name: str, producer_pid: int, timeout: float = 60):
    """A watcher's handle on a producer's ring (never bound to a consumer entry); the
    producer creates the ring with its first batch, so wait for it."""
    segment = resolve(name, None, None).segment_name(producer_pid)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _core.Ring.open(segment)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until(predicate, timeout: float, step: float = 0.01) -> float:
    """Seconds until predicate() held; fails after timeout."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(step)
    return time.monotonic() - t0


def _wait_for_delivery(name: str, producer_pid: int, consumer_pid: int) -> None:
    """Until the consumer process took its first batch (it attached and reads)."""
    ring = _ring_of(name, producer_pid)
    try:
        _wait_until(lambda: any(c["pid"] == consumer_pid and c["delivered"] >= 1
                                for c in ring.consumers()), 60)
    finally:
        ring.close()


def _tuple_producer(procs, name: str, *args: str, env: dict | None = None):
    """A roles.py producer of tuple batches under `name`, and its pid once it is ready."""
    prod = procs.start("producer", "--name", name, "--kind", "tuple", *args, env=env)
    return prod, procs.wait_ready(prod)["pid"]


def _left_behind(name: str) -> str:
    """What of producer `name` is left in /dev/shm and the runtime directory."""
    files = sorted(p.name for p in runtime_dir().glob(name + ".*"))
    left = shm_segments(name) + files
    return ", ".join(left) if left else "nothing"


def test_consumer_sigkilled_holding_a_batch(procs, name, fault_table):
    prod, pid = _tuple_producer(procs, name, "--batches", "60", "--min-consumers", "2")
    victim = procs.start("consumer", "--name", name, "--kind", "tuple", "--stall-after", "3")
    survivor = procs.start("consumer", "--name", name, "--kind", "tuple", "--delay", "0.01")
    procs.wait_ready(victim)  # it holds batch 2 and hangs
    ring = _ring_of(name, pid)
    try:
        assert any(c["pid"] == victim.pid for c in ring.consumers())
        victim.kill()
        took = _wait_until(lambda: all(c["pid"] != victim.pid for c in ring.consumers()), 3.0)
    finally:
        ring.close()
    r = procs.result(survivor)
    assert r["errors"] == [] and r["epochs"] == [_batches(0, 0, 60)]
    assert procs.result(prod)["drained"] is True
    left = _left_behind(name)
    assert left == "nothing"
    fault_table.add("consumer SIGKILLed while holding a batch",
                    f"{took:.2f} s (entry evicted, its slots released)",
                    "every batch once, in order", left)


def test_consumer_sigstopped_is_detached_by_the_lag_policy(procs, name, fault_table):
    prod, pid = _tuple_producer(procs, name, "--batches", "80", "--min-consumers", "2",
                                "--max-lag", "4", "--window", "0")
    stopped = procs.start("consumer", "--name", name, "--kind", "tuple", "--delay", "0.01")
    survivor = procs.start("consumer", "--name", name, "--kind", "tuple", "--delay", "0.01")
    ring = _ring_of(name, pid)
    try:
        _wait_until(lambda: any(c["pid"] == stopped.pid and c["delivered"] >= 3
                                for c in ring.consumers()), 30)
        os.kill(stopped.pid, signal.SIGSTOP)
        took = _wait_until(lambda: any(c["pid"] == stopped.pid and
                                       c["state"] == _core.CONSUMER_DETACHED
                                       for c in ring.consumers()), 5.0)
    finally:
        ring.close()
        os.kill(stopped.pid, signal.SIGCONT)
    r = procs.result(survivor)
    assert r["errors"] == [] and r["epochs"] == [_batches(0, 0, 80)]
    s = procs.result(stopped)
    assert s["outcome"].startswith("ConsumerDetached") and "max_lag=4" in s["outcome"]
    procs.result(prod)
    left = _left_behind(name)
    assert left == "nothing"
    fault_table.add("consumer SIGSTOPped (max_lag=4)",
                    f"{took:.2f} s (detached once 4 batches behind the other)",
                    "every batch once, in order; the stopped one gets ConsumerDetached "
                    "on SIGCONT", left)


def test_consumer_sigstopped_without_max_lag_is_evicted(procs, name, fault_table):
    """Lossless (no max_lag): a stopped consumer's heartbeats stop, and after
    heartbeat_timeout it is taken off, so the others stop waiting for it (a batch it holds
    stays held: test_silent_consumer_keeps_its_batch_intact)."""
    env = {"TENSORSOCKET_HEARTBEAT_TIMEOUT": "3"}
    prod, pid = _tuple_producer(procs, name, "--batches", "80", "--min-consumers", "2", env=env)
    stopped = procs.start("consumer", "--name", name, "--kind", "tuple", "--delay", "0.01")
    survivor = procs.start("consumer", "--name", name, "--kind", "tuple", "--delay", "0.01")
    ring = _ring_of(name, pid)
    try:
        _wait_until(lambda: any(c["pid"] == stopped.pid and c["delivered"] >= 3
                                for c in ring.consumers()), 30)
        os.kill(stopped.pid, signal.SIGSTOP)
        took = _wait_until(lambda: all(c["state"] != _core.CONSUMER_ACTIVE
                                       for c in ring.consumers() if c["pid"] == stopped.pid),
                           30)
    finally:
        ring.close()
        os.kill(stopped.pid, signal.SIGCONT)
    r = procs.result(survivor)
    assert r["errors"] == [] and r["epochs"] == [_batches(0, 0, 80)]
    s = procs.result(stopped)
    assert s["outcome"].startswith("ConsumerDetached") and \
        "heartbeat_timeout" in s["outcome"], s["outcome"]
    procs.result(prod)
    left = _left_behind(name)
    assert left == "nothing"
    fault_table.add("consumer SIGSTOPped (no max_lag, heartbeat_timeout=3)",
                    f"{took:.2f} s (taken off: no heartbeat for heartbeat_timeout; its unread "
                    "entries dropped, a batch it holds stays held)",
                    "every batch once, in order, after a pause; the stopped one gets "
                    "ConsumerDetached naming heartbeat_timeout on SIGCONT", left)


# A consumer that keeps batch 10 and then falls silent: SIGSTOPped by itself ("stop"), or
# holding the GIL in a C call ("gil": a read() through ctypes.PyDLL, which keeps the GIL,
# until the test writes to the FIFO), so that its heartbeat thread cannot run. Prints the
# batch's content before and after the silence, and what its next next() said.
_SILENT_CONSUMER = """
import ctypes, os, signal, sys
from tensorsocket import TensorConsumer
from tools.harness import emit
name, how, fifo = sys.argv[1:4]
fd = os.open(fifo, os.O_RDWR)  # never blocks; the test's write ends the read below
c = TensorConsumer(name=name, timeout=60, batch_timeout=60)
it = iter(c)
for _ in range(10):
    next(it)
held = next(it)  # batch 10, kept while silent
before = held[1].tolist()
emit({"ready": True, "before": before})
if how == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
else:
    ctypes.PyDLL(None).read(fd, ctypes.create_string_buffer(1), 1)
after = held[1].tolist()
try:
    next(it)
    outcome = "next() returned a batch"
except Exception as e:
    outcome = f"{type(e).__name__}: {e}"
emit({"before": before, "after": after, "outcome": outcome})
"""


@pytest.mark.parametrize("how", ["stop", "gil"])
def test_silent_consumer_keeps_its_batch_intact(procs, name, fault_table, short_tmp, how):
    """A consumer silent for longer than heartbeat_timeout (SIGSTOPped, or a step holding
    the GIL) while it keeps batch 10: the producer detaches it, so that the other consumer
    goes on through many batches, but the slot of its batch is never reused while its
    process lives: after the silence the batch still reads 10, and its next next() says
    why it was detached."""
    env = {"TENSORSOCKET_HEARTBEAT_TIMEOUT": "3"}
    prod, pid = _tuple_producer(procs, name, "--batches", "200", "--min-consumers", "2",
                                "--slots", "4", env=env)
    fifo = os.path.join(short_tmp, "resume")
    os.mkfifo(fifo)
    silent = procs.script(_SILENT_CONSUMER, name, how, fifo)
    survivor = procs.start("consumer", "--name", name, "--kind", "tuple")
    assert procs.wait_ready(silent)["before"] == [10] * 4
    ring = _ring_of(name, pid)
    try:
        # Detached (not receiving), and the producer went round its 4 slots many times.
        took = _wait_until(lambda: ring.info()["published"] >= 60 and all(
            c["state"] != _core.CONSUMER_ACTIVE for c in ring.consumers()
            if c["pid"] == silent.pid), 60)
    finally:
        ring.close()
        if how == "stop":
            os.kill(silent.pid, signal.SIGCONT)
        try:  # ends the GIL-holding read (the consumer has the FIFO open if it got there)
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"x")
            os.close(fd)
        except OSError:
            pass
    out = procs.result(silent)
    assert out["after"] == out["before"], f"the kept batch 10 now reads {out['after']}"
    assert out["outcome"].startswith("ConsumerDetached") and \
        "heartbeat_timeout=3" in out["outcome"] and "intact" in out["outcome"], out["outcome"]
    r = procs.result(survivor)
    assert r["errors"] == [] and r["epochs"] == [_batches(0, 0, 200)]
    procs.result(prod)
    left = _left_behind(name)
    assert left == "nothing"
    fault = "SIGSTOPped" if how == "stop" else "holding the GIL (a long C call)"
    fault_table.add(f"consumer {fault} while keeping a batch (heartbeat_timeout=3)",
                    f"{took:.2f} s (detached: no heartbeat for heartbeat_timeout; the slot "
                    "of its kept batch stays held while its process lives)",
                    "every batch once, in order; the silent one's kept batch still reads "
                    "its own data, its next next() raises ConsumerDetached saying why", left)


def test_silent_consumer_killed_gives_its_batch_back(procs, name, fault_table, short_tmp):
    """A consumer taken off for silence keeps the slot of its batch only while its process
    lives: SIGKILLed then, its hold is released within a liveness check, and the slot
    takes entries again."""
    env = {"TENSORSOCKET_HEARTBEAT_TIMEOUT": "3"}
    prod, pid = _tuple_producer(procs, name, "--batches", "1000", "--min-consumers", "2",
                                "--slots", "4", env=env)
    fifo = os.path.join(short_tmp, "resume")
    os.mkfifo(fifo)
    silent = procs.script(_SILENT_CONSUMER, name, "stop", fifo)
    survivor = procs.start("consumer", "--name", name, "--kind", "tuple", "--delay", "0.003")
    procs.wait_ready(silent)
    ring = _ring_of(name, pid)
    try:
        _wait_until(lambda: ring.info()["holes"] > 0 and all(
            c["state"] != _core.CONSUMER_ACTIVE for c in ring.consumers()
            if c["pid"] == silent.pid), 60)
        assert any(c["pid"] == silent.pid for c in ring.consumers())  # it holds its slot
        silent.kill()
        took = _wait_until(lambda: all(c["pid"] != silent.pid for c in ring.consumers()), 5)
        holes = ring.info()["holes"]
        published = ring.info()["published"]
        # A round of the ring later, no slot is skipped any more.
        _wait_until(lambda: ring.info()["published"] >= published + 8, 60)
        assert ring.info()["holes"] == holes
    finally:
        ring.close()
    silent.wait()
    r = procs.result(survivor)
    assert r["errors"] == [] and r["epochs"] == [_batches(0, 0, 1000)]
    procs.result(prod)
    left = _left_behind(name)
    assert left == "nothing"
    fault_table.add("consumer SIGKILLed after it was taken off for silence, keeping a batch",
                    f"{took:.2f} s (entry evicted, the slot of its batch released)",
                    "every batch once, in order; the kept slot takes entries again", left)


def test_producer_sigstopped_longer_than_heartbeat_timeout(procs, name, fault_table):
    """The producer's own pause is no silence of its consumers: their heartbeats wait in
    the socket while it is stopped, and none is evicted when it runs again."""
    env = {"TENSORSOCKET_HEARTBEAT_TIMEOUT": "3"}
    prod, pid = _tuple_producer(procs, name, "--batches", "60", "--min-consumers", "2", env=env)
    cons = [procs.start("consumer", "--name", name, "--kind", "tuple", "--delay", "0.01")
            for _ in range(2)]
    ring = _ring_of(name, pid)
    try:
        _wait_until(lambda: sum(c["delivered"] >= 3 for c in ring.consumers()) == 2, 30)
        os.kill(pid, signal.SIGSTOP)
        stop_end = time.monotonic() + 5  # longer than heartbeat_timeout
        try:
            while time.monotonic() < stop_end:
                time.sleep(0.1)
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        ring.close()
    for c in cons:
        r = procs.result(c)
        assert r["outcome"] == "done" and r["errors"] == [], r["outcome"]
        assert r["epochs"] == [_batches(0, 0, 60)]
    procs.result(prod)
    left = _left_behind(name)
    assert left == "nothing"
    fault_table.add("producer SIGSTOPped for 5 s (heartbeat_timeout=3)",
                    "- (no consumer is evicted: the producer's own pause is no silence of "
                    "theirs)", "every batch once, in order, after the pause", left)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_forged_hello_is_refused(procs, name, fault_table, transport):
    """A hello as pid 1 (alive for ever, so never evicted as dead), then ready: over TCP
    another local user can connect, but has no secret; over ipc:// only this user can,
    and the kernel says which process it is. Refused, it learns nothing, and the real
    consumer reads every batch from the first (it used to join late behind a consumer
    that never reads, and everything hung for good)."""
    if transport == "tcp":
        port = _free_port()
        where, address = ["--port", str(port)], f"tcp://127.0.0.1:{port}"
        owner = f"port{port}"
    else:
        where, address, owner = ["--name", name], resolve(name, None, None).address, name
    prod = procs.start("producer", *where, "--batches", "20", "--kind", "tuple")
    procs.wait_ready(prod)
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 30000)
    s.connect(address)
    try:
        t0 = time.monotonic()
        s.send(hello_message(1))  # no secret: another user has none
        reply = protocol.decode(s.recv())
        took = time.monotonic() - t0
        if reply["type"] == "welcome":  # hijacked: the forger is consumer 0, and ready
            s.send(protocol.encode("ready", consumer=reply["consumer"], token=reply["token"],
                                   align=False))
            assert protocol.decode(s.recv())["type"] == "started"
        cons = procs.start("consumer", *where, "--kind", "tuple")
        r = procs.result(cons, timeout=60)
    finally:
        s.close(0)
    assert r["errors"] == [] and r["epochs"] == [_batches(0, 0, 20)], r
    assert reply["type"] == "error" and reply["code"] == "auth", reply
    assert "tensorsocket-" not in reply["message"]
    assert ("secret" if transport == "tcp" else "pid 1") in reply["message"], reply
    assert procs.result(prod)["stats"]["rejected_messages"] == 1
    left = _left_behind(owner)
    assert left == "nothing"
    if transport == "tcp":
        fault, why = "another local user's hello as pid 1 on a TCP port (then ready)", \
            "no secret"
    else:
        fault, why = "a hello as pid 1 over ipc:// (then ready)", \
            "the kernel's peer credentials name another pid"
    fault_table.add(fault, f"{took:.2f} s (refused at hello: {why}; nothing of the producer "
                    "revealed)", "every batch once, in order, from batch 0", left)


def _kill_producer_after_first_delivery(procs, name: str, *consumer_args: str, settle: float,
                                       sig: int = signal.SIGKILL) -> tuple[dict, float]:
    """Send `sig` to a producer (which sleeps after its first batch) `settle` s after a
    consumer took that batch: (the consumer's result, seconds from the kill to its
    exception)."""
    prod, pid = _tuple_producer(procs, name, "--batches", "5", "--delay", "3600")
    c = procs.start("consumer", "--name", name, "--kind", "tuple", *consumer_args)
    _wait_for_delivery(name, pid, c.pid)
    time.sleep(settle)
    t0 = time.monotonic()
    prod.send_signal(sig)
    r = procs.result(c)
    assert prod.wait(timeout=30) == -sig  # it dies of the signal, whatever it removed first
    return r, r["ended_at"] - t0


def test_producer_sigkilled_while_a_consumer_waits(procs, name, fault_table):
    # The producer publishes batch 0, then sleeps; the consumer waits for batch 1.
    r, took = _kill_producer_after_first_delivery(procs, name, settle=0.2)
    assert r["outcome"].startswith("ProducerFailed") and took < 5.0
    assert "is gone without finishing" in r["outcome"]
    assert "SIGKILL" in r["outcome"] and "(out of memory?)" not in r["outcome"], r["outcome"]
    assert r["epochs"] == [] or r["epochs"][0][:1] == [0]
    # A new producer of the same name starts at once.
    t1 = time.monotonic()
    again = procs.start("producer", "--name", name, "--batches", "1", "--min-consumers", "0")
    procs.wait_ready(again)
    restart = time.monotonic() - t1
    procs.result(again)
    left = _left_behind(name)
    assert left == "nothing"
    fault_table.add("producer SIGKILLed while a consumer waits for a batch",
                    f"{took:.2f} s (ProducerFailed raised)",
                    f"ProducerFailed (a ProducerGone); a new producer of the name was ready "
                    f"{restart:.2f} s after being started", left)


def test_producer_sigkilled_while_a_consumer_holds_a_batch(procs, name, fault_table):
    # The consumer holds each batch for 2 s ("training"), then asks for the next.
    r, took = _kill_producer_after_first_delivery(procs, name, "--hold", "--delay", "2",
                                                  settle=0.5)
    assert r["outcome"].startswith("ProducerFailed") and took < 5.0
    assert r["errors"] == []  # the batch it held stayed valid while the producer died
    left = _left_behind(name)
    # The consumer, last party out, removed the segment; the dead producer's socket and
    # lock files wait for the next producer of the name, which reuses them.
    assert shm_segments(name) == []
    fault_table.add("producer SIGKILLed while a consumer holds a batch",
                    f"{took:.2f} s (at its next batch request, after its 2 s step)",
                    "the held batch stays valid; ProducerFailed at the next request", left)


def _attach_in_thread(name: str, timeout: float) -> tuple[threading.Thread, list]:
    """A consumer attaching in a thread: [(its exception, CLOCK_MONOTONIC when raised)]."""
    from tensorsocket import TensorConsumer

    raised: list = []

    def attach() -> None:
        try:
            TensorConsumer(name=name, timeout=timeout).close()
        except BaseException as e:
            raised.append((e, time.monotonic()))

    thread = threading.Thread(target=attach)
    thread.start()
    return thread, raised


def test_producer_sigkilled_before_its_first_batch(procs, name, fault_table):
    """The producer took its name, and its loader has not given the first batch yet,
    when it is SIGKILLed; a consumer waiting for its welcome is told at once."""
    from tensorsocket import ProducerFailed
    from test_producer_failure import PRODUCER

    prod = procs.script(PRODUCER, name, "block")
    assert prod.stdout.readline() == "ready\n"
    waiter, raised = _attach_in_thread(name, timeout=30)
    time.sleep(0.5)  # for the measurement only: the consumer waits for its welcome by now
    t0 = time.monotonic()
    prod.kill()
    prod.wait()
    waiter.join(40)
    (e, at), = raised
    took = at - t0
    assert isinstance(e, ProducerFailed) and f"(pid {prod.pid}) died before" in str(e)
    assert took < 5.0
    left = _left_behind(name)
    assert shm_segments(name) == []  # no ring yet; its socket and lock files stay
    fault_table.add("producer SIGKILLed before its first batch, a consumer waiting for it",
                    f"{took:.2f} s (the name's lock file names a dead pid)",
                    "ProducerFailed naming the pid, not ProducerNotFound after its 30 s "
                    "timeout", left)


def test_loader_raises_before_the_first_batch(procs, name, fault_table):
    from tensorsocket import ProducerFailed
    from test_producer_failure import PRODUCER

    prod = procs.script(PRODUCER, name, "fail-first")
    assert prod.stdout.readline() == "ready\n"
    waiter, raised = _attach_in_thread(name, timeout=30)
    waiter.join(40)
    (e, at), = raised
    out, _ = prod.communicate(timeout=60)
    took = at - float(out.split("raising at ")[1].split()[0])
    assert isinstance(e, ProducerFailed) and "ValueError: no such file" in e.cause
    assert took < 5.0
    left = _left_behind(name)
    assert left == "nothing"
    fault_table.add("the loader raises before the first batch, a consumer waiting for it",
                    f"{took:.2f} s (the producer answers the waiting consumers as it "
                    "closes)",
                    "ProducerFailed with the loader's error and where it was raised", left)


def test_loader_raises_mid_run(procs, name, fault_table):
    from tensorsocket import ProducerFailed, TensorConsumer
    from test_producer_failure import PRODUCER

    prod = procs.script(PRODUCER, name, "fail-mid")
    assert prod.stdout.readline() == "ready\n"
    got = []
    with TensorConsumer(name=name, timeout=30) as c:
        with pytest.raises(ProducerFailed) as e:
            for batch in c:
                got.append(int(batch[0]))
        at = time.monotonic()
    out, _ = prod.communicate(timeout=60)
    took = at - float(out.split("raising at ")[1].split()[0])
    assert got == [0, 1, 2, 3, 4] and e.value.cause.startswith("RuntimeError: corrupt")
    assert took < 5.0
    left = _left_behind(name)
    assert left == "nothing"
    fault_table.add("the loader raises after 5 batches",
                    f"{took:.2f} s (the error is in the ring's header when it finishes)",
                    "the 5 batches, then ProducerFailed with the loader's error (not "
                    "ProducerFinished)", left)


def test_producer_sigtermed_while_a_consumer_waits(procs, name, fault_table):
    """SIGTERM on a producer script (not started by share()) removes its segment, socket
    and lock before it dies of the signal; its consumer sees it gone as after SIGKILL."""
    r, took = _kill_producer_after_first_delivery(procs, name, settle=0.2, sig=signal.SIGTERM)
    assert r["outcome"].startswith("ProducerFailed") and took < 5.0  # a ProducerGone
    # It says so (the producer wrote it in the ring's header as it died), and guesses no
    # out-of-memory kill (before issue 35: "killed (out of memory?) or crashed").
    assert "stopped by SIGTERM before it finished" in r["outcome"], r["outcome"]
    assert "out of memory" not in r["outcome"] and "out-of-memory" not in r["outcome"]
    left = _left_behind(name)
    assert left == "nothing"
    fault_table.add("producer (a plain script) SIGTERMed while a consumer waits for a batch",
                    f"{took:.2f} s (ProducerFailed raised)",
                    "ProducerFailed (a ProducerGone) saying that SIGTERM stopped the "
                    "producer (it wrote so in the ring's header, removed its files, then "
                    "died of SIGTERM)", left)


def test_shm_too_small_fails_at_start_naming_the_knob(name, fault_table):
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    loader = [torch.zeros(4)]
    p = TensorProducer(loader, name=name, min_consumers=0, slot_bytes=free // 2 + (1 << 30))
    t0 = time.monotonic()
    with pytest.raises(SharedMemoryTooSmall) as e:
        for _ in p:
            pass
    took = time.monotonic() - t0
    msg = str(e.value)
    assert "slot_bytes=" in msg and "ring_slots=" in msg and "--shm-size" in msg
    assert "needs" in msg or "bytes" in msg
    assert shm_segments(name) == []
    p.close()
    left = _left_behind(name)
    assert left == "nothing"
    fault_table.add("/dev/shm smaller than the ring",
                    f"{took:.2f} s (SharedMemoryTooSmall before the first batch)",
                    "an error naming the size and slot_bytes= / ring_slots= / --shm-size",
                    left)


@pytest.mark.parametrize("seed", range(4))
def test_random_kills_leave_nothing_behind(procs, name, fault_table, seed):
    """Kill a random role at a random point; then the next producer of the name starts,
    and once everyone is gone nothing of the name is left."""
    rng = random.Random(seed)
    prod = procs.start("producer", "--name", name, "--batches", "200", "--kind", "tuple",
                       "--epochs", "2", "--min-consumers", "1", "--delay", "0.002")
    procs.wait_ready(prod)
    # A consumer still starting when the producer dies gives up after --timeout.
    cons = [procs.start("consumer", "--name", name, "--kind", "tuple", "--epochs", "2",
                        "--timeout", "3") for _ in range(2)]
    time.sleep(rng.uniform(0.2, 1.0))
    victim = rng.choice([prod, *cons])
    victim.kill()
    victim.wait()
    survivors = [p for p in [prod, *cons] if p is not victim]
    for p in survivors:
        try:
            p.communicate(timeout=60)
        except Exception:
            p.kill()
            raise
    # The next producer of the name sweeps whatever a dead producer left.
    again = procs.start("producer", "--name", name, "--batches", "1", "--min-consumers", "0")
    procs.wait_ready(again)
    procs.result(again)
    left = _left_behind(name)
    assert left == "nothing", left
    role = "producer" if victim is prod else "consumer"
    fault_table.add(f"random SIGKILL (seed {seed}): the {role}", "-",
                    "the others end (finish, or ProducerFailed)", left)


def test_consumer_process_fds_return_to_baseline_after_producer_crash(procs, name):
    """A consumer that outlives a SIGKILLed producer gives back every fd on close(), and
    it removes the dead producer's segment (last party out)."""
    from tensorsocket import ProducerGone, TensorConsumer

    fd_dir = "/proc/self/fd"
    prod = procs.start("producer", "--name", name, "--batches", "5", "--kind", "tuple",
                       "--delay", "3600")
    procs.wait_ready(prod)
    before = len(os.listdir(fd_dir))
    c = TensorConsumer(name=name, timeout=30)
    it = iter(c)
    next(it)
    prod.kill()
    prod.wait()
    with pytest.raises(ProducerGone):
        next(it)
    del it
    c.close()
    time.sleep(0.2)  # zmq's I/O thread closes its sockets asynchronously
    assert len(os.listdir(fd_dir)) <= before
    assert shm_segments(name) == []


def _plant(path: str) -> None:
    """An empty file at path, another user's where we may give it away (root)."""
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    if os.geteuid() == 0:
        os.chown(path, 65534 if os.getuid() != 65534 else 65533, -1)


def test_file_planted_at_the_segment_name_before_the_first_batch(name, fault_table):
    """Anyone may create the file a producer's ring will have (its name is known from the
    pid) before its first batch: the ring is then created under that name plus a random
    tag, consumers attach as usual, and the planted file is left alone (the producer
    died of FileExistsError before)."""
    from tensorsocket.cli.status import segments

    base = resolve(name).segment_name(os.getpid())
    planted = "/dev/shm" + base
    p = TensorProducer([torch.full((4,), float(i)) for i in range(3)], name=name,
                       start_timeout=30)
    got: list = []

    def read() -> None:
        with TensorConsumer(name=name, timeout=30) as c:
            got.extend(int(b[0]) for b in c)

    try:
        _plant(planted)
        reader = threading.Thread(target=read)
        reader.start()
        assert sum(1 for _ in p) == 3
        reader.join(30)
        assert got == [0, 1, 2]
        ring = p.ring.info()["name"]
        assert ring.startswith(base + ".") and len(ring) == len(base) + 9
        assert (ring[1:], name, os.getpid()) in segments()  # status and clean see it
        if os.geteuid() == 0:  # the planted file is another user's: never taken for ours
            assert base[1:] not in [seg for seg, _, _ in segments()]
        p.close()
        assert os.path.exists(planted) and not os.path.exists("/dev/shm" + ring)
        left = _left_behind(name)
        assert left == base[1:]
    finally:
        p.close()
        if os.path.exists(planted):
            os.unlink(planted)
    fault_table.add("a file planted at the producer's segment name before its first batch",
                    "- (the name is taken: the ring is created under it plus a random tag)",
                    "every batch once, in order",
                    "the planted file (not the producer's to remove)")


def test_every_segment_name_taken_is_an_error_naming_the_files(name, monkeypatch,
                                                                fault_table):
    """The producer tries a few names; when a planter took them all (here the random tags
    are made predictable), the first batch raises an error naming the files."""
    from tensorsocket.producer import ring_maker

    monkeypatch.setattr(ring_maker.secrets, "token_hex", lambda n: "0badc0de")
    base = resolve(name).segment_name(os.getpid())
    taken = ["/dev/shm" + base, f"/dev/shm{base}.0badc0de"]
    p = TensorProducer([torch.zeros(4)], name=name, min_consumers=0)
    try:
        for path in taken:
            _plant(path)
        t0 = time.monotonic()
        with pytest.raises(TensorSocketError, match="ls -l /dev/shm") as e:
            for _ in p:
                pass
        took = time.monotonic() - t0
        assert all(path in str(e.value) for path in taken)
        assert all(os.path.exists(path) for path in taken)
    finally:
        p.close()
        for path in taken:
            if os.path.exists(path):
                os.unlink(path)
    assert _left_behind(name) == "nothing"
    fault_table.add("every segment name the producer tries is taken by planted files",
                    f"{took:.2f} s (TensorSocketError at the first batch)",
                    "an error naming the files and how to find their owner",
                    "the planted files (not the producer's to remove)")


def test_files_with_names_no_producer_makes_are_ignored(name, fault_table):
    """Files in /dev/shm under names no producer makes (a pid out of range or no number),
    and links or directories under a producer's name, are not segments: status, clean and
    a producer of the name pass them by (an out-of-range pid was an OverflowError in all
    three) and never remove them."""
    from tensorsocket.cli import clean, status

    prefix = f"/dev/shm/tensorsocket-{os.getuid()}-{name}-"
    files = [prefix + "9" * 23, prefix + "abc", prefix + str((1 << 22) + 1)]  # PID_MAX_LIMIT + 1
    link, folder = prefix + "4194001", prefix + "4194002"
    try:
        for path in files:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.symlink("/dev/null", link)
        os.mkdir(folder, 0o700)
        assert [seg for seg in status.segments() if seg[1] == name] == []
        assert [o for o in status.other_users(name)] == []
        assert [item for item in clean.leftovers() if item.name == name] == []
        p = TensorProducer([torch.zeros(4)], name=name, min_consumers=0)
        assert sum(1 for _ in p) == 1
        p.close()
        assert all(os.path.lexists(path) for path in files + [link, folder])
    finally:
        for path in files + [link]:
            if os.path.lexists(path):
                os.unlink(path)
        if os.path.isdir(folder):
            os.rmdir(folder)
    fault_table.add("files in /dev/shm under names no producer makes (pid 99...9 or abc), "
                    "links and directories under a producer's name",
                    "- (names and file types are checked before a segment is opened)",
                    "status, top, clean and producers of the name pass them by",
                    "the planted files (never removed)")
