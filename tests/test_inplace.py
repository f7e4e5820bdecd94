"""In-place writes into batch tensors, with real processes: private to the writer.

A consumer's mapping of the host ring is read-only and shared; a write into a batch it
holds makes that slot private to it, copy on write (csrc/base/ts_fault.c), and its release maps
the shared view back before the producer refills the slot. One producer publishes known
batches through a ring of few slots (each slot is reused many times); a writer consumer
changes every batch in place the way training code does (x.mul_(2), x[0] = -1, x += 1,
numpy arrays and half tensors too) and checks its own tensors changed as written, while a
reader consumer checks it sees every batch as published, also batches the writer had
written into before it read them. Both check that every batch arrives as published (a
slot the writer wrote into reads the next batch correctly) and exactly once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import popen

TESTS = Path(__file__).resolve().parent
BATCHES, SLOTS = 24, 4

CONSUMER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[4])
import torch
from roles import check_batch
from tensorsocket import TensorConsumer

name, kind, role = sys.argv[1:4]
c = TensorConsumer(name=name, timeout=60)
seen, errors, held, private = [], [], [], 0


def write(batch, v):
    # What a training step's in-place ops do to a batch (timm's Mixup: mul_, slices, add_).
    x = batch[0] if kind == "tuple" else batch["x"]
    x.mul_(2)
    x[0] = -1
    x += 1
    want = torch.full((4, 8), 2.0 * v + 1)
    want[0] = 0
    if not torch.equal(x, want):
        errors.append(f"batch {v}: x reads {x[:2, :2].tolist()} after the writes")
    if kind == "tuple":
        batch[1].add_(7)
    else:
        batch["pair"][0][:] += 3  # a numpy leaf: writable as well
        batch["meta"]["half"].mul_(2)


def written_ok(batch, v):
    x = batch[0] if kind == "tuple" else batch["x"]
    want = torch.full((4, 8), 2.0 * v + 1)
    want[0] = 0
    if not torch.equal(x, want):
        return False
    if kind == "tuple":
        return torch.equal(batch[1], torch.full((4,), v + 7, dtype=torch.int64))
    return bool((batch["pair"][0] == v + 3).all()) and torch.equal(
        batch["meta"]["half"], torch.full((2, 2), v % 7 * 2).half())


for batch in c:
    x = batch[0] if kind == "tuple" else batch["x"]
    v = int(x[0, 0])
    seen.append(v)
    try:  # every batch arrives as published, in slots the writer wrote into before too
        check_batch(kind, batch, v)
    except AssertionError as e:
        errors.append(f"batch {v} arrived changed: {e!r}"[:300])
    if role == "writer":
        write(batch, v)
        private = max(private, c.ring.info()["private_slots"])
    else:
        time.sleep(0.02)  # behind the writer: it writes into batches before this reads them
    held.append((v, batch))
    del x, batch
    if len(held) > 1:  # the previous batch, still held, is as this process left it
        old_v, old = held.pop(0)
        if role == "writer" and not written_ok(old, old_v):
            errors.append(f"batch {old_v}: the writes did not stay while it was held")
        if role == "reader":
            try:
                check_batch(kind, old, old_v)
            except AssertionError as e:
                errors.append(f"batch {old_v} changed while held: {e!r}"[:300])
        del old
held.clear()
info = c.ring.info()
print(json.dumps({"seen": seen, "errors": errors, "max_private": private,
                  "private_after": info["private_slots"], "writable": info["host_writable"]}),
      flush=True)
c.close()
"""


def _consumer(name: str, kind: str, role: str, flags: tuple = ()) -> subprocess.Popen:
    return popen([sys.executable, *flags, "-c", CONSUMER, name, kind, role,
                             str(TESTS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:{out}\nstderr:{err}"
    assert "tensorsocket:" not in err, err  # no fault was named
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("kind,flags", [("tuple", ()), ("mixed", ("-X", "faulthandler"))],
                         ids=["tuple", "dict-faulthandler"])
def test_in_place_writes_stay_private_to_the_writer(procs, name, kind, flags):
    """The writer's in-place ops succeed on its own copy of each batch; the reader sees
    every batch as published; slots reused after a write read the next batch as published;
    every batch reaches each consumer exactly once. (A dict batch: a float tensor, a numpy
    array and a half tensor per batch; with Python's faulthandler on in the writer.)"""
    p = procs.start("producer", "--name", name, "--kind", kind, "--batches", str(BATCHES),
                    "--slots", str(SLOTS), "--min-consumers", "2")
    procs.wait_ready(p)
    writer = _consumer(name, kind, "writer", flags)
    reader = _consumer(name, kind, "reader")
    w, r = _result(writer), _result(reader)
    expected = list(range(BATCHES))
    assert w["errors"] == [] and r["errors"] == []
    assert w["seen"] == expected and r["seen"] == expected
    assert w["writable"] == 1 and r["writable"] == 1
    assert w["max_private"] >= 1  # the writes were made private...
    assert w["private_after"] == 0  # ...and undone as each batch was released
    prod = procs.result(p)
    assert prod["drained"] is True
