"""Soak: one producer publishes tens of thousands of tiny batches over many epochs while
consumers join and leave all the time; resource usage must stay flat.

Processes (all real, over real shared memory and sockets):

- the producer: a loader of N batches per epoch, E epochs. Batch g (g = epoch * N + b)
  is ``{"id": [4g .. 4g+3], "x": [[2*id, 2*id+1] per sample], "g": g}``, so every
  sample carries its position in the stream;
- a long-lived consumer, attached before the first batch, that checks every batch of
  every epoch (exactly once, in order, right values);
- a churner that attaches and leaves over and over in one process: close() mid-epoch,
  break out of the loop and come back, batch_size= 2 (zero-copy slices), 3 (samples
  concatenated across loader batches), 8 with drop_last, leaving a `with` block, and
  keeping a tensor alive past close(); it checks that the samples of each attachment
  are consecutive;
- victims: consumers that are SIGKILLed while holding a batch, then replaced.

At sample points (a warm-up, then spread over the run) the churner is paused and no
victim is alive, so the only consumer attached is the long-lived one; the test then
reads the producer's RSS and open fds, the long-lived consumer's fds, the producer's
/dev/shm segments and its runtime-dir files, and asserts that the later samples do not
exceed the warm-up ones by more than a small margin.
"""

from __future__ import annotations

import json
import os
import random
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import shm_segments, popen

ROOT = Path(__file__).resolve().parent.parent

# Margins over the warm-up sample that the later samples may not exceed.
FD_MARGIN = 2
UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")  # scripts/test-sanitized.sh
# Seconds the churning consumer waits for one batch before counting a timeout. With 2 s,
# the stream paused longer on a loaded 2-core machine in 2 to 4 reads of a run (about 1 in
# 100; on 2026-11-23, with and without ASan; cause not established: the victims' start-up
# competing for the 2 cores is suspected). A stuck stream still fails the test.
CHURN_BATCH_TIMEOUT = 20.0 if UNDER_ASAN else 10.0
RSS_MARGIN = 4 * 1024 * 1024

_COMMON = r"""
import json, os, sys, time, warnings
sys.path.insert(0, os.getcwd())
import torch
from tensorsocket import (TensorConsumer, TensorProducer, ProducerFinished, ProducerGone,
                          ProducerNotFound, TensorSocketWarning)

def say(**kw):
    print(json.dumps(kw), flush=True)
"""

PRODUCER = _COMMON + r"""
name, batches, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rate = float(sys.argv[4])  # batches per second at most (a loader takes time)
clock = {"t0": None, "n": 0}

def pace():
    # Counted from the second batch: the first waits for min_consumers.
    clock["n"] += 1
    if clock["n"] == 2:
        clock["t0"] = time.monotonic()
    elif clock["n"] % 25 == 0:
        ahead = clock["t0"] + (clock["n"] - 2) / rate - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)

class Loader:
    batch_size = 4

    def __init__(self):
        self.epoch = 0

    def __len__(self):
        return batches

    def __iter__(self):
        e, self.epoch = self.epoch, self.epoch + 1
        for b in range(batches):
            g = e * batches + b
            pace()
            yield {"id": torch.arange(4 * g, 4 * g + 4),
                   "x": torch.arange(8 * g, 8 * g + 8, dtype=torch.float32).view(4, 2),
                   "g": g}

p = TensorProducer(Loader(), name=name, min_consumers=2, start_timeout=120)
say(ready=True, pid=os.getpid())
for e in range(epochs):
    st = p.stats()
    say(epoch=e, table=len(st["consumer_table"]), consumers=st["consumers"])
    if e == epochs - 1:  # the test samples once more, then lets the last epoch run
        say(gate=True)
        sys.stdin.readline()
    for _ in p:
        pass
stats = p.stats()
stats.pop("consumer_table")
drained = p.join(timeout=60)
say(done=True, stats=stats, drained=drained)
"""

LONG = _COMMON + r"""
name, batches, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = TensorConsumer(name=name, timeout=60)
say(attached=True, pid=os.getpid())
errors, lens = [], []
for e in range(epochs):
    n = 0
    for batch in c:
        g = e * batches + n
        ids = batch["id"].tolist()
        if ids != list(range(4 * g, 4 * g + 4)) or batch["g"] != g or \
                batch["x"].tolist() != [[2 * i, 2 * i + 1] for i in ids]:
            if len(errors) < 10:
                errors.append(f"epoch {e} batch {n}: g={batch['g']} ids={ids}")
        n += 1
        del batch
    lens.append(n)
try:
    next(iter(c))
    finished = False
except ProducerFinished:
    finished = True
stats = c.stats()
c.close()
say(lens=lens, errors=errors, finished=finished, stats=stats)
"""

CHURN = _COMMON + r"""
import gc, random, select
name, seed = sys.argv[1], int(sys.argv[2])
bt = float(sys.argv[3])  # batch_timeout: a longer wait than this counts as a timeout
rng = random.Random(seed)
warnings.simplefilter("ignore", TensorSocketWarning)
buf = b""

def command(block):
    global buf
    while b"\n" not in buf:
        if not block and not select.select([0], [], [], 0)[0]:
            return None
        chunk = os.read(0, 4096)
        if not chunk:
            return "stop"
        buf += chunk
    line, buf = buf.split(b"\n", 1)
    return line.decode().strip()

errors, modes, attaches, timeouts, timed_out = [], {}, 0, 0, []
t_start = time.monotonic()
state = {"next": None}

def check(batch):
    # The samples of one attachment are consecutive positions of the stream.
    ids = batch["id"].tolist()
    ok = ids == list(range(ids[0], ids[0] + len(ids))) and \
        batch["x"][:, 0].tolist() == [2.0 * i for i in ids]
    if state["next"] is not None and ids[0] != state["next"]:
        ok = False
    if not ok and len(errors) < 10:
        errors.append(f"{mode}: ids {ids[:8]} after {state['next']}")
    state["next"] = ids[-1] + 1

def read(c, k):
    # Up to k batches of the current epoch; then leave the loop (break).
    global attaches
    attaches += 1
    state["next"] = None
    n = 0
    for batch in c:
        check(batch)
        n += 1
        if n >= k:
            break
    return n

# The churners start where they attach (align_epochs=False): they stress attaching and
# leaving at any moment; waiting for the next epoch start would leave few attaches.
MODES = ["close-mid-epoch", "break-and-back", "bs3", "bs2-keep", "bs8-drop-with"]
cycle, done, c = 0, False, None
while not done:
    cmd = command(False)
    if cmd == "pause":
        gc.collect()
        say(paused=True)
        cmd = command(True)
    if cmd == "stop":
        break
    mode = MODES[cycle % len(MODES)]
    cycle += 1
    k = rng.randint(5, 60)
    try:
        if mode == "close-mid-epoch":
            c = TensorConsumer(name=name, timeout=10, batch_timeout=bt, align_epochs=False)
            it = iter(c)
            attaches += 1
            state["next"] = None
            for _ in range(k):
                check(next(it))
            c.close()  # the iterator is still mid-epoch
            del it
        elif mode == "break-and-back":
            c = TensorConsumer(name=name, timeout=10, batch_timeout=bt, align_epochs=False)
            read(c, k)
            time.sleep(rng.random() * 0.05)  # "evaluating"
            read(c, rng.randint(5, 60))  # attached again, as a late joiner
            c.close()
        elif mode == "bs3":
            c = TensorConsumer(name=name, timeout=10, batch_timeout=bt, align_epochs=False, batch_size=3)
            read(c, k)
            c.close()
        elif mode == "bs2-keep":
            c = TensorConsumer(name=name, timeout=10, batch_timeout=bt, align_epochs=False, batch_size=2)
            attaches += 1
            state["next"] = None
            it = iter(c)
            for _ in range(k):
                b = next(it)
                check(b)
            kept = b["id"]  # a view of a ring slot, kept past close()
            del b, it
            c.close()
            first = kept.tolist()
            if first != [first[0], first[0] + 1]:
                errors.append(f"kept tensor changed after close: {first}")
            del kept
        else:
            with TensorConsumer(name=name, timeout=10, batch_timeout=bt, align_epochs=False, batch_size=8,
                                drop_last=True) as c:
                read(c, k)
        modes[mode] = modes.get(mode, 0) + 1
    except TimeoutError as e:
        timeouts += 1  # the producer holds before its last epoch (see PRODUCER)
        timed_out.append(f"{mode} at {time.monotonic() - t_start:.1f} s: {e}"[:300])
    except (ProducerFinished, ProducerGone, ProducerNotFound, StopIteration):
        done = True  # the producer finished (or is finishing) under us
    except Exception as e:
        errors.append(f"{mode}: {type(e).__name__}: {e}"[:300])
        done = True
    finally:
        if c is not None:
            c.close()
        c = None
say(modes=modes, attaches=attaches, timeouts=timeouts, timed_out=timed_out, errors=errors)
"""

VICTIM = _COMMON + r"""
name = sys.argv[1]
say(imported=True)
sys.stdin.readline()  # attach when told
c = TensorConsumer(name=name, timeout=30, batch_size=int(sys.argv[2]) or None)
say(attached=True)
held = []
while True:
    for batch in c:
        held = [batch]  # dies holding a ring slot
        time.sleep(0.001)
"""


def _start(procs, script: str, *args, stdin: bool = False) -> subprocess.Popen:
    p = popen(
        [sys.executable, "-c", script, *map(str, args)],
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    procs.procs.append(p)  # killed at teardown if still running
    return p


def _line(p: subprocess.Popen, timeout: float = 60) -> dict:
    """The next JSON line of p's stdout."""
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        raise AssertionError(f"no output from pid {p.pid} within {timeout} s")
    line = p.stdout.readline()
    if not line:
        p.wait(10)
        raise AssertionError(f"pid {p.pid} exited {p.returncode}: {p.stderr.read()[-3000:]}")
    return json.loads(line)


def _last(p: subprocess.Popen, timeout: float) -> dict:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:{out[-2000:]}\nstderr:{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def _runtime_files(name: str) -> list[str]:
    from tensorsocket.control.endpoints import runtime_dir

    return sorted(p.name for p in runtime_dir().glob(name + ".*"))


def _soak(procs, name: str, batches: int, epochs: int, rate: float, samples: list[int],
          victims: int, victim_gap: float) -> dict:
    """Run the soak; sample at the start of each epoch in `samples` (the first one is the
    warm-up) and once more at the gate before the producer's last epoch, after the churn
    and the victims have stopped."""
    assert all(at < epochs - 1 for at in samples)
    # min_consumers=2: the long-lived consumer and the churner's first consumer are
    # attached before the first batch.
    prod = _start(procs, PRODUCER, name, batches, epochs, rate, stdin=True)
    ready = _line(prod)
    long = _start(procs, LONG, name, batches, epochs)
    churn = _start(procs, CHURN, name, 1234, CHURN_BATCH_TIMEOUT, stdin=True)
    long_pid = _line(long)["pid"]

    # The producer's epoch lines, read in the background.
    progress = {"epoch": -1, "tables": [], "gate": False, "done": None}

    def read_producer():
        for raw in prod.stdout:
            msg = json.loads(raw)
            if "epoch" in msg:
                progress["tables"].append(msg["table"])
                progress["epoch"] = msg["epoch"]
            elif msg.get("gate"):
                progress["gate"] = True
            elif msg.get("done"):
                progress["done"] = msg

    reader = threading.Thread(target=read_producer, daemon=True)
    reader.start()

    quiet = threading.Lock()  # held while a victim is attached (and being evicted)
    stop = threading.Event()
    killed, victim_errors = [], []

    def victim_loop():
        rng = random.Random(99)
        try:
            while not stop.is_set() and len(killed) < victims:
                v = _start(procs, VICTIM, name, rng.choice([0, 3]), stdin=True)
                try:
                    _line(v, 60)  # torch imported: attaching is quick now
                    if stop.wait(victim_gap * rng.uniform(0.5, 1.5)):
                        break
                    with quiet:
                        if stop.is_set():
                            break
                        v.stdin.write("go\n")
                        v.stdin.flush()
                        assert _line(v, 30) == {"attached": True}
                        time.sleep(rng.uniform(0.0, 0.3))  # reading, holding a batch
                        v.send_signal(signal.SIGKILL)
                        v.wait(10)
                        killed.append(v.pid)
                        time.sleep(0.6)  # the producer notices within ~0.25 s
                finally:
                    if v.poll() is None:
                        v.send_signal(signal.SIGKILL)
                        v.wait(10)
        except (AssertionError, OSError, ValueError, subprocess.TimeoutExpired) as e:
            victim_errors.append(repr(e))

    victim_thread = threading.Thread(target=victim_loop, daemon=True)
    victim_thread.start()

    pp, cp = psutil.Process(ready["pid"]), psutil.Process(long_pid)
    segment = f"tensorsocket-{os.getuid()}-{name}-{ready['pid']}"
    taken = []

    def sample() -> None:
        time.sleep(0.3)  # the producer's end of departed consumers' sockets closes
        reads = []
        for _ in range(6):
            reads.append((pp.num_fds(), cp.num_fds(), pp.memory_info().rss,
                          cp.memory_info().rss))
            time.sleep(0.05)
        taken.append({
            "epoch": progress["epoch"],
            "producer_fds": min(x[0] for x in reads),
            "consumer_fds": min(x[1] for x in reads),
            "producer_rss": min(x[2] for x in reads),
            "consumer_rss": min(x[3] for x in reads),
            "shm": shm_segments(name),
            "runtime": _runtime_files(name),
        })

    def tell(p: subprocess.Popen, line: str) -> None:
        p.stdin.write(line + "\n")
        p.stdin.flush()

    try:
        for at in samples:
            deadline = time.monotonic() + 300
            while progress["epoch"] < at:
                assert prod.poll() is None, prod.stderr.read()[-3000:]
                assert time.monotonic() < deadline, f"producer stuck before epoch {at}"
                time.sleep(0.02)
            with quiet:  # no victim attached
                tell(churn, "pause")
                assert _line(churn, 60) == {"paused": True}
                sample()
                tell(churn, "resume")
        victim_thread.join(120)  # the victims still to come
    finally:
        stop.set()
        victim_thread.join(120)
    tell(churn, "stop")
    churned = _last(churn, 60)
    deadline = time.monotonic() + 300
    while not progress["gate"]:
        assert prod.poll() is None, prod.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "producer never reached its last epoch"
        time.sleep(0.02)
    sample()  # the end: everything but the long-lived consumer came and went
    tell(prod, "go")
    got = _last(long, 120)
    assert prod.wait(120) == 0, prod.stderr.read()[-3000:]
    reader.join(10)
    return {"samples": taken, "churn": churned, "long": got, "producer": progress["done"],
            "tables": progress["tables"], "killed": killed, "victim_errors": victim_errors,
            "segment": segment, "end_shm": shm_segments(name),
            "end_runtime": _runtime_files(name)}


def _check(r: dict, name: str, batches: int, epochs: int, victims: int,
           min_attaches: int) -> None:
    # The long-lived consumer got every batch of every epoch exactly once, in order.
    long = r["long"]
    assert long["errors"] == [] and long["lens"] == [batches] * epochs, long
    assert long["finished"] is True and long["stats"]["rejoins"] == 0
    assert long["stats"]["batches"] == batches * epochs

    done = r["producer"]
    assert done is not None and done["drained"] is True, done
    assert done["stats"]["batches"] == batches * epochs
    assert done["stats"]["lag_detached"] == 0

    churn = r["churn"]
    assert churn["errors"] == [], churn
    assert churn["attaches"] >= min_attaches, churn
    assert len(churn["modes"]) == 5, churn
    assert churn["timeouts"] <= 1, churn  # only at the gate, if at all
    assert r["victim_errors"] == [] and len(r["killed"]) == victims, r
    # The consumer table never filled up with dead or departed entries.
    assert max(r["tables"]) <= 4, r["tables"]

    # Flat resource usage: every later sample against the warm-up (the first one).
    base, *later = r["samples"]
    for s in r["samples"]:
        assert s["shm"] == [r["segment"]], s  # one segment, ever
        assert s["runtime"] == [f"{name}.lock", f"{name}.sock"], s
    for s in later:
        assert s["producer_fds"] <= base["producer_fds"] + FD_MARGIN, (base, s)
        assert s["consumer_fds"] <= base["consumer_fds"] + FD_MARGIN, (base, s)
        if not UNDER_ASAN:  # ASan's quarantine keeps freed memory resident by design
            assert s["producer_rss"] <= base["producer_rss"] + RSS_MARGIN, (base, s)
            assert s["consumer_rss"] <= base["consumer_rss"] + RSS_MARGIN, (base, s)

    # Nothing left behind.
    assert r["end_shm"] == [] and r["end_runtime"] == [], r


def _report(r: dict) -> None:
    base, end = r["samples"][0], r["samples"][-1]
    print(f"\nsoak: churn {r['churn']['modes']} ({r['churn']['attaches']} attachments), "
          f"{len(r['killed'])} consumers SIGKILLed, consumer table at most {max(r['tables'])}")
    for s in r["samples"]:
        print(f"  epoch {s['epoch']:4d}: producer rss {s['producer_rss'] / 2**20:7.2f} MiB "
              f"fds {s['producer_fds']}; consumer rss {s['consumer_rss'] / 2**20:7.2f} MiB "
              f"fds {s['consumer_fds']}; shm {len(s['shm'])}; runtime {len(s['runtime'])}")
    print(f"  growth: producer rss {(end['producer_rss'] - base['producer_rss']) / 2**10:+.0f} "
          f"KiB, consumer rss {(end['consumer_rss'] - base['consumer_rss']) / 2**10:+.0f} KiB")


@pytest.mark.slow  # 15 s: a soak; kills and churn in short: test_faults, test_churn
def test_soak_short(procs, name):
    """20,000 batches (1000 x 20 epochs) with churn, three consumers SIGKILLed."""
    batches, epochs = 1000, 20
    r = _soak(procs, name, batches, epochs, rate=1500, samples=[3, 7, 11, 14, 17],
              victims=3, victim_gap=2.0)
    _report(r)
    _check(r, name, batches, epochs, victims=3, min_attaches=40)


@pytest.mark.slow
def test_soak_long(procs, name):
    """100,000 batches (1000 x 100 epochs) with churn, ten consumers SIGKILLed."""
    batches, epochs = 1000, 100
    r = _soak(procs, name, batches, epochs, rate=800, samples=[10, 25, 40, 55, 70, 85, 95],
              victims=10, victim_gap=6.0)
    _report(r)
    _check(r, name, batches, epochs, victims=10, min_attaches=200)
