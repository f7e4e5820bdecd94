"""Two jobs alternating between two shared loaders never hold each other for park_hold
(issue 24, item 3).

A job that reads its validation loader keeps its place in the training loader's ring
(park_hold), so that it reads the same next training epoch as the jobs it started with.
When the two jobs are out of phase (one attached later than the start grace, as the ranks
of a Lightning DDP job do), the kept place can close a cycle of waits: job A reads the
validation loader, whose producer waits for job B's validation consumer (B left it
between epochs, or mid-epoch as a DDP rank does, and reads the training loader now);
B's training consumer waits for the place A keeps there. Nobody reads until park_hold
runs out. Here A's process sees that cycle (from the two rings' consumer tables) and
gives its place up at once.

The jobs are real processes (forked from the fork server) reading two producers that run
in threads of the test process, so the producers' log records are the test's to read.
Every sample is counted by id. The order of events is set by handshakes: B says it is
ready (it read one validation batch), A says it finished its training epoch, then the
test lets B read the training loader (a file B waits for).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch

from tensorsocket import TensorProducer
from tensorsocket.errors import TensorSocketError

TIMEOUT_SCALE = float(os.environ.get("TS_TEST_TIMEOUT_SCALE", "1"))
# park_hold of the producers: long enough that a wait for it is told apart from the
# ordinary waits of a loaded machine; a job held for it fails the test.
PARK_HOLD = 8.0 * TIMEOUT_SCALE
BATCHES = 6  # per epoch, of 4 samples each; the rings have 4 slots
VAL_OFFSET = 1000
HELD_TOO_LONG = "stayed parked longer than park_hold"

# Job B: reads one batch of the validation loader and keeps that epoch open (a DDP rank
# after Lightning's sanity check: it stays attached), then, once told, one training epoch,
# then the rest of its validation epoch.
JOB_B = r"""
import os, sys, time
from tensorsocket import TensorConsumer
from tools.harness import emit
name, go = sys.argv[1], sys.argv[2]
val = TensorConsumer(name=name + "-val", timeout=60)
it = iter(val)
first = [int(i) for i in next(it)]
emit({"event": "ready"})
deadline = time.monotonic() + 120
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit("the test never said go")
    time.sleep(0.01)
train = TensorConsumer(name=name, timeout=60)
start = time.monotonic()
ids = [int(i) for b in train for i in b]
took = time.monotonic() - start
rest = [int(i) for b in it for i in b]
emit({"train": ids, "train_s": took, "val": first + rest})
train.close()
val.close()
"""

# Job A: one training epoch, then one validation epoch (its training consumer sits between
# epochs meanwhile, keeping its place).
JOB_A = r"""
import sys, time
from tensorsocket import TensorConsumer
from tools.harness import emit
name = sys.argv[1]
train = TensorConsumer(name=name, timeout=60)
val = TensorConsumer(name=name + "-val", timeout=60)
ids = [int(i) for b in train for i in b]
emit({"event": "trained"})
start = time.monotonic()
vids = [int(i) for b in val for i in b]
emit({"train": ids, "val": vids, "val_s": time.monotonic() - start})
train.close()
val.close()
"""


def _batches(offset: int) -> list[torch.Tensor]:
    return [torch.arange(offset + i * 4, offset + i * 4 + 4) for i in range(BATCHES)]


class _Epochs(threading.Thread):
    """A producer's epochs, one after another, until the test closes it."""

    def __init__(self, producer: TensorProducer) -> None:
        super().__init__(daemon=True)
        self.producer = producer

    def run(self) -> None:
        try:
            for _ in range(50):
                for _ in self.producer:
                    pass
        except TensorSocketError:  # closed by the test while it waits
            pass


def _whole(ids: list[int], offset: int) -> bool:
    return sorted(ids) == list(range(offset, offset + 4 * BATCHES))


def test_out_of_phase_jobs_do_not_hold_each_other(name, procs, short_tmp, caplog):
    """Job A keeps its training place while it reads validation; job B, out of phase,
    keeps its validation epoch open while it reads training, and waits for A's place. A
    sees the cycle and gives its place up: B's training epoch and A's validation epoch
    come at once, not after park_hold, and every epoch of both is whole."""
    caplog.set_level(logging.INFO, logger="tensorsocket")
    producers = [TensorProducer(_batches(offset), name=n, ring_slots=4, start_grace=0,
                                min_consumers=1, park_hold=PARK_HOLD)
                 for n, offset in ((name, 0), (name + "-val", VAL_OFFSET))]
    threads = [_Epochs(p) for p in producers]
    for t in threads:
        t.start()
    go = short_tmp / "go"
    try:
        job_b = procs.script(JOB_B, name, str(go))
        assert job_b.wait_ready(60)["event"] == "ready"
        job_a = procs.script(JOB_A, name)
        assert job_a.read_json(60)["event"] == "trained"
        go.touch()
        a = job_a.result(60 + 3 * PARK_HOLD)
        b = job_b.result(60 + 3 * PARK_HOLD)
    finally:
        for p in producers:
            p.close()
        for t in threads:
            t.join(30)
    assert _whole(a["train"], 0) and _whole(b["train"], 0), (a["train"], b["train"])
    assert _whole(a["val"], VAL_OFFSET) and _whole(b["val"], VAL_OFFSET), (a["val"], b["val"])
    held = [r.getMessage() for r in caplog.records if HELD_TOO_LONG in r.getMessage()]
    assert not held, f"a consumer was held for park_hold={PARK_HOLD} s: {held}"
    assert b["train_s"] < PARK_HOLD / 2 and a["val_s"] < PARK_HOLD / 2, (
        f"job B waited {b['train_s']:.1f} s for its training epoch, job A "
        f"{a['val_s']:.1f} s for its validation epoch (park_hold={PARK_HOLD} s)")
