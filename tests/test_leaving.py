"""Leaving: a consumer that leaves while it still holds a batch, then exits without
freeing it; a producer script stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import torch

from conftest import ROOT, Producing, popen, shm_segments
from tensorsocket import TensorConsumer, TensorProducer
from tensorsocket.control.endpoints import runtime_dir
from tensorsocket.ring import ConsumerState

HOLD_AND_EXIT = textwrap.dedent("""
    import os, sys
    from tensorsocket import TensorConsumer
    c = TensorConsumer(name=sys.argv[1], timeout=30)
    kept = [next(iter(c))]   # holds its slot
    c.close()                # says bye: no longer a peer of the control server
    os._exit(0)              # exits without the views ever being freed
""")


HOLD_LEAVE_WAIT = textwrap.dedent("""
    import os, sys
    from tensorsocket import TensorConsumer
    c = TensorConsumer(name=sys.argv[1], timeout=30)
    kept = [next(iter(c))]   # holds its slot
    c.close()                # says bye
    print("left", flush=True)
    sys.stdin.readline()     # lives on (holding the batch) until told
    os._exit(0)              # exits without the views ever being freed
""")


def test_consumer_exiting_after_bye_with_a_held_batch_does_not_stall_the_ring(name):
    """The held slot is released once its process is gone, so the producer and the other
    consumer go on (before the fix, the producer waited for that slot forever)."""
    loader = [torch.full((4,), float(i)) for i in range(40)]
    producer = TensorProducer(loader, name=name, min_consumers=2, ring_slots=4,
                              start_timeout=30, publish_timeout=30)
    errors: list = []

    def produce() -> None:
        try:
            for _ in producer:
                pass
            producer.join(timeout=30)
        except Exception as e:  # reported by the assertion below
            errors.append(e)

    pidfds_before = _pidfds()
    thread = threading.Thread(target=produce)
    thread.start()
    holder = popen([sys.executable, "-c", HOLD_AND_EXIT, name], cwd=ROOT)
    reader = TensorConsumer(name=name, timeout=30, batch_timeout=15)
    try:
        values = [int(x[0]) for x in reader]
        assert holder.wait(timeout=30) == 0
        assert values == list(range(40))
    finally:
        reader.close()
        thread.join(60)
        producer.close()
    assert not thread.is_alive() and errors == []
    # The pidfds of the consumers (the producer's watch of each) are given back by close().
    assert _pidfds() == pidfds_before


def test_entry_left_holding_a_batch_is_freed_once_its_process_exits(name):
    """A consumer that said bye holding a batch leaves its entry LEAVING (its bit stays in
    that slot); the producer's liveness check watches its process (a pidfd taken when it
    first sees the entry leaving) and evicts the entry once the process is gone, while the
    producer goes on publishing; the watch's pidfd is given back."""
    loader = [torch.full((4,), float(i)) for i in range(8)]
    # (min_consumers=0: epochs go on, for nobody once the holder left)
    producer = TensorProducer(loader, name=name, min_consumers=0, ring_slots=4,
                              publish_timeout=30)
    pidfds_before = _pidfds()
    producing = Producing(producer, forever=True)
    producing.start()
    try:
        holder = popen([sys.executable, "-c", HOLD_LEAVE_WAIT, name], cwd=ROOT,
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline() == "left\n"
        # While its process lives, the entry stays (its batch may still be read): the
        # liveness check (every 0.25 s) looks at it several times meanwhile.
        for _ in range(8):
            entries = [c for c in producer.ring.consumers() if c["pid"] == holder.pid]
            assert [c["state"] for c in entries] == [ConsumerState.LEAVING], entries
            time.sleep(0.1)
        holder.stdin.write("exit\n")
        holder.stdin.flush()
        assert holder.wait(timeout=60) == 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            entries = [c for c in producer.ring.consumers() if c["pid"] == holder.pid]
            if not any(c["state"] == ConsumerState.LEAVING for c in entries):
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the entry of the exited holder stays LEAVING: {entries}")
    finally:
        producing.stop()
        producing.join(60)
        producer.close()
    assert not producing.is_alive() and producing.error is None
    assert _pidfds() == pidfds_before  # (given back by close())


def _pidfds() -> int:
    """This process's open pidfds."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
        except OSError:  # (the listing's own fd, closed meanwhile)
            pass
    return count


# A plain producer script (not share()): it says where its files are once its ring exists,
# then publishes until it is stopped. argv: name, what to do before the producer starts.
PRODUCER_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch
    from tensorsocket import TensorProducer
    name, setup = sys.argv[1], sys.argv[2]
    if setup == "own-handler":
        def stop(signum, frame):
            raise SystemExit(3)
        signal.signal(signal.SIGTERM, stop)
    p = TensorProducer([torch.zeros(4)] * 1000000, name=name, min_consumers=0)
    for i, _ in enumerate(p):
        if i == 0:
            out = {"segment": p.ring.info()["name"],
                   "files": [str(p.endpoint.lock_path), str(p.endpoint.socket_path)]}
            if setup == "fork":
                # A child of the producer's process (a loader worker, say) that dies of
                # SIGTERM leaves its parent's files alone.
                child = os.fork()
                if child == 0:
                    os.kill(os.getpid(), signal.SIGTERM)
                    os._exit(7)  # not reached: the signal ends the child
                _, status = os.waitpid(child, 0)
                out["child_signal"] = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
                out["kept"] = all(os.path.exists(f) for f in
                                  out["files"] + ["/dev/shm" + out["segment"]])
            print(json.dumps(out), flush=True)
        time.sleep(0.01)
""")


def _start_producer_script(name: str, setup: str) -> tuple[subprocess.Popen, dict]:
    """The producer script and its first report (its ring exists then)."""
    proc = popen([sys.executable, "-c", PRODUCER_SCRIPT, name, setup], cwd=ROOT,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        raise AssertionError(f"the producer script failed: {proc.stderr.read()}")
    return proc, json.loads(line)


def _stop(proc: subprocess.Popen) -> int:
    """SIGTERM the script; its exit status."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    return proc.returncode


def _left(name: str) -> list[str]:
    """What of producer `name` is in /dev/shm and the runtime directory."""
    return shm_segments(name) + sorted(p.name for p in runtime_dir().glob(name + ".*"))


def test_sigterm_on_a_producer_script_removes_its_files(name):
    """SIGTERM on a plain TensorProducer script removes its segment, socket and lock file,
    and the process still dies of SIGTERM (before, all three were left behind)."""
    proc, report = _start_producer_script(name, "default")
    assert _left(name) == [report["segment"][1:], f"{name}.lock", f"{name}.sock"]
    assert _stop(proc) == -signal.SIGTERM
    assert _left(name) == []


def test_sigterm_handler_of_the_program_is_kept(name):
    """A SIGTERM handler the script installed is not replaced: it runs (here it exits 3)
    and the producer is torn down as the interpreter exits."""
    proc, _ = _start_producer_script(name, "own-handler")
    assert _stop(proc) == 3
    assert _left(name) == []


def test_sigterm_on_a_forked_child_leaves_the_producers_files(name):
    """A forked child inherits the handler but owns none of the producer's files: it dies
    of SIGTERM and the parent's segment, socket and lock stay."""
    proc, report = _start_producer_script(name, "fork")
    assert report["child_signal"] == signal.SIGTERM and report["kept"] is True
    assert _stop(proc) == -signal.SIGTERM
    assert _left(name) == []


def test_sigterm_handler_only_from_the_main_thread_over_the_default(name):
    """The handler is installed by a producer the main thread creates, over the default
    action only, and the default comes back once the last producer is closed."""
    from tensorsocket.control.producer_files import on_sigterm

    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        p = TensorProducer([torch.zeros(2)], name=name, min_consumers=0)
        assert signal.getsignal(signal.SIGTERM) is on_sigterm
        p.close()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        made: list = []
        t = threading.Thread(target=lambda: made.append(
            TensorProducer([torch.zeros(2)], name=name, min_consumers=0)))
        t.start()
        t.join(30)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        made[0].close()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        p = TensorProducer([torch.zeros(2)], name=name, min_consumers=0)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        p.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
