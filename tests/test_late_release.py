"""Late releases after eviction (issue 23, item 5), in real processes.

A consumer holds a batch and is evicted while it still has a release to come: it was
stopped (SIGSTOP) with a host view alive, or its GPU release is deferred until the work
queued on its stream is done. A new consumer gets the same consumer table index and holds
the same slot. When the old consumer's release finally arrives, it names an incarnation of
the index that is gone: it must not clear the new consumer's hold, or the producer refills
the slot under the new consumer's batch.

Every process here is driven over pipes, one command and one JSON answer at a time, so
each step happens after the one before it: no sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from pathlib import Path
from subprocess import PIPE

import fakecuda
from conftest import popen
from test_gpu import fake_lib  # noqa: F401  (fixture, built once a session)

# One process of the test: the producer or a consumer of the ring `segment`, reading
# commands from stdin and answering each with one JSON line.
ROLE = r"""
import json, os, sys, time
import numpy as np
from tensorsocket import _core

segment, role = sys.argv[1], sys.argv[2]
N = 4096  # int64 elements of a batch: every one is its tag + 1 (never 0)


def answer(**kw):
    print(json.dumps(kw), flush=True)


ring = held = None
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "create":  # producer: 4 slots, a late joiner gets the last 2 entries
        ring = _core.Ring.create(segment, 4, 8 * N + 4096, 2, device=int(args[0]))
        ring.set_policy(2, 0)
        answer(ok=True)
    elif cmd == "reserve":
        pid = int(args[0])
        index, token = ring.reserve(pid, _core.process_start_time(pid))
        answer(index=index, token=token)
    elif cmd == "activate":
        answer(start=ring.activate(int(args[0])))
    elif cmd == "publish":  # tag, timeout: whether the entry was published
        tag = int(args[0])
        data = np.full(N, tag + 1, dtype=np.int64)
        try:
            ring.publish([(data, (0, 64, 1))], b"%d" % tag, index=tag, timeout=float(args[1]))
            answer(published=True)
        except TimeoutError:
            answer(published=False)
    elif cmd == "evict":
        ring.evict(int(args[0]), _core.REASON_SILENT)
        answer(ok=True)
    elif cmd == "info":
        info = ring.info()
        answer(late_releases=info.get("late_releases"), readers=list(ring.slot_readers()))
    elif cmd == "bind":  # consumer: index, token, host|device
        ring = _core.Ring.open(segment)
        ring.bind(int(args[0]), int(args[1]))
        if args[2] == "device":
            sys.path.insert(0, os.environ["FAKECUDA_TESTS"])
            from fakecuda import FakeCuda
            cuda = FakeCuda(os.environ["TENSORSOCKET_LIBCUDA"])
            cuda.setup(0)
            stream = cuda.stream_create(1)
            ring.import_device(0)
        answer(ok=True)
    elif cmd == "hold":  # take the next entry and keep a view of it
        slot = ring.acquire(30)
        if args[0] == "device":
            caps = slot.capsules(versioned=True, device=True, stream=stream)
            view = slot.views(device=True)[0]
            cuda.stream_synchronize(stream)
            total = int(np.frombuffer(cuda.read(view.data_ptr, view.nbytes), np.int64).sum())
            held = (slot, caps, view)
        else:
            array = np.from_dlpack(slot.views()[0])
            total = int(array.sum())
            held = (slot, array)
        answer(seq=slot.seq, slot=slot.slot, tag=int(slot.meta), sum=total)
        slot = caps = view = array = None  # `held` alone keeps the batch
    elif cmd == "take":  # take the next entry and give it back at once
        slot = ring.acquire(30)
        seq = slot.seq
        slot.release()
        slot = None
        answer(seq=seq)
    elif cmd == "check":  # the held view's sum now
        answer(sum=int(held[1].sum()), tag=int(held[0].meta))
    elif cmd == "drop":  # drop the held batch; answer once its release has run
        if args[0] == "device":
            # A slow kernel reads the batch on the stream: the release is deferred until it
            # has run, and made by the GPU backend's release thread.
            view = held[2]
            cuda.launch_read(stream, view.data_ptr, view.nbytes, 50000)
        held = view = None
        ring.flush_releases()  # deleters only queue GPU releases: hand them on
        deadline = time.monotonic() + 60
        while ring.held_slots() != 0:
            assert time.monotonic() < deadline, "the release never ran"
            time.sleep(0.005)
        answer(dropped=True)
    elif cmd == "exit":
        if ring is not None:
            if role == "producer":
                ring.finish()
            ring.close()
            if role == "producer":
                _core.Ring.unlink_name(segment)
        answer(ok=True)
        break
"""


class Role:
    """One process of the test, driven one command at a time."""

    def __init__(self, segment: str, role: str, env: dict) -> None:
        self.proc = popen([sys.executable, "-c", ROLE, segment, role], env=env, stdin=PIPE,
                          stdout=PIPE, text=True)
        self.pid = self.proc.pid

    def __call__(self, *words: object) -> dict:
        """Send a command; its answer."""
        self.proc.stdin.write(" ".join(str(w) for w in words) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"{words[0]}: the process ended (status {self.proc.wait(30)})"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)
                self("exit")
                self.proc.wait(30)
            except (OSError, AssertionError, ValueError):
                self.proc.kill()
                self.proc.wait(30)


def _late_release(env: dict, old_kind: str) -> int:
    """The scenario: consumer A (old_kind: host or device views) holds entry 0 and is stopped,
    then evicted; consumer B gets A's index and holds entry 0 (the window); A runs again and
    drops its batch; the producer comes round to slot 0. Returns A's pid."""
    env = {**os.environ, **env}
    segment = f"/tensorsocket-{os.getuid()}-late{uuid.uuid4().hex[:8]}-{os.getpid()}"
    prod = Role(segment, "producer", env)
    a = b = None
    try:
        assert prod("create", 0 if old_kind == "device" else -1)["ok"]
        a = Role(segment, "consumer", env)
        ra = prod("reserve", a.pid)
        prod("activate", ra["index"])
        assert prod("publish", 0, 10)["published"]
        assert a("bind", ra["index"], ra["token"], old_kind)["ok"]
        got = a("hold", old_kind)
        assert (got["seq"], got["slot"], got["tag"]) == (0, 0, 0)

        os.kill(a.pid, signal.SIGSTOP)  # stopped with its batch alive
        prod("evict", ra["index"])
        b = Role(segment, "consumer", env)
        rb = prod("reserve", b.pid)
        assert rb["index"] == ra["index"]  # the index A had
        assert prod("activate", rb["index"])["start"] == 0
        assert b("bind", rb["index"], rb["token"], "host")["ok"]
        got = b("hold", "host")
        assert (got["seq"], got["slot"], got["tag"]) == (0, 0, 0)
        want = got["sum"]
        assert want == 4096  # tag 0: 4096 ones
        assert prod("info")["readers"][0] == 1 << rb["index"]

        os.kill(a.pid, signal.SIGCONT)
        assert a("drop", old_kind)["dropped"]  # A's late release has run

        # The producer comes round: entries 1..3 in slots 1..3, then slot 0 again.
        for tag in (1, 2, 3):
            assert prod("publish", tag, 10)["published"]
            assert b("take")["seq"] == tag
        # B still holds entry 0: the producer cannot have slot 0 (it waits, then gives up).
        refilled = prod("publish", 4, 0.3)["published"]
        now = b("check")
        assert (now["tag"], now["sum"]) == (0, want), "B's batch was overwritten"
        assert not refilled, "the producer refilled a slot the new consumer holds"
        info = prod("info")
        assert info["readers"][0] == 1 << rb["index"]
        assert info["late_releases"] == 1
        return a.pid
    finally:
        for role in (a, b, prod):
            if role is not None:
                role.close()


def test_late_host_release_leaves_the_new_consumers_hold(tmp_path):
    """A stopped host consumer, evicted, runs again and drops its view: the consumer that
    got its index keeps its batch intact, and the ring counts the release as late."""
    _late_release({}, "host")


def test_late_gpu_release_leaves_the_new_consumers_hold(fake_lib, tmp_path):
    """The same on a GPU ring of the driver double: the evicted consumer's device export
    is released by the GPU backend's release thread, after a slow kernel on its stream."""
    log = tmp_path / "cuda.log"
    env = {"TENSORSOCKET_LIBCUDA": str(fake_lib), "FAKECUDA_LOG": str(log),
           "FAKECUDA_OP_DELAY_US": "200", "FAKECUDA_TESTS": str(Path(__file__).parent)}
    old = _late_release(env, "device")
    # A's release went the deferred way: after the slow kernel, an event recorded on its
    # stream at the flush and waited for by the release thread.
    ops = [line.op for line in fakecuda.select(fakecuda.parse_log(log), pid=old)]
    after = ops[len(ops) - ops[::-1].index("launch_read"):]
    assert "event_record" in after and "event_sync" in after, after
    pids = {line.pid for line in fakecuda.parse_log(log)}
    left = [o for o in fakecuda.shm_objects() if int(o.rsplit("-", 2)[1]) in pids]
    assert left == [], f"device memory or events left behind: {left}"
