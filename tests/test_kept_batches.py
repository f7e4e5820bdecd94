"""Batches kept alive hold ring slots: a consumer stalled by its own kept batches says so.

The producer is a real process (tests/roles.py) over a ring of 4 slots; the consumer is
this process.
"""

from __future__ import annotations

import warnings

import pytest

from tensorsocket import TensorConsumer, TensorSocketWarning
from conftest import popen


def test_list_of_batches_works_like_a_dataloaders(procs, name):
    """list(consumer) keeps every batch alive, three times as many as the ring has slots:
    as with a DataLoader, every batch is there with its contents, and nothing waits (the
    batches that held the slots the producer had to refill were copied privately)."""
    p = procs.start("producer", "--name", name, "--kind", "tuple", "--batches", "12",
                    "--slots", "4")
    procs.wait_ready(p)
    with TensorConsumer(name=name, timeout=30, batch_timeout=20) as c:
        with warnings.catch_warnings():
            warnings.simplefilter("error", TensorSocketWarning)
            batches = list(c)
        assert [int(x[0, 0]) for x, _ in batches] == list(range(12))
        assert all(bool((x == i).all()) for i, (x, _) in enumerate(batches))
        assert c.stats()["copied_kept_batches"] >= 8
        batches[0][0].add_(1)  # still writable, and private
        assert int(batches[0][0][0, 0]) == 1
    del batches  # the producer's last entries wait for these views before it finishes
    procs.result(p)


def test_kept_batches_with_copies_do_not_stall(procs, name):
    """copy=True batches hold no slot: list(consumer) works."""
    p = procs.start("producer", "--name", name, "--kind", "tuple", "--batches", "12",
                    "--slots", "4")
    procs.wait_ready(p)
    with TensorConsumer(name=name, timeout=30, batch_timeout=20, copy=True) as c:
        batches = list(c)
    assert [int(x[0, 0]) for x, _ in batches] == list(range(12))
    procs.result(p)


def test_slow_producer_is_no_stall_of_ours(procs, name):
    """Waiting for a slow loader, holding only the current batch, is not warned about."""
    p = procs.start("producer", "--name", name, "--kind", "tuple", "--batches", "2",
                    "--slots", "4", "--delay", "6.5")
    procs.wait_ready(p)
    with TensorConsumer(name=name, timeout=30, batch_timeout=30) as c:
        with warnings.catch_warnings():
            warnings.simplefilter("error", TensorSocketWarning)
            seen = [int(x[0, 0]) for x, _ in c]
    assert seen == [0, 1]
    procs.result(p)


KEEPER = r"""
import sys, time
from itertools import islice
from tensorsocket import TensorConsumer
print("up", flush=True)
c = TensorConsumer(name=sys.argv[1], timeout=30)
kept = list(islice(c, 4))   # every slot of the ring
print("kept", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_producer_logs_the_consumer_that_keeps_its_slots(name, procs, caplog, monkeypatch):
    """The producer names the consumer whose kept batches hold the slot it must reuse."""
    import logging
    import selectors
    import subprocess
    import sys
    import threading

    import torch

    from tensorsocket import TensorProducer
    from tensorsocket.control import stall_watch

    monkeypatch.setattr(stall_watch, "HELD_WARN_AFTER", 1.0)
    caplog.set_level(logging.WARNING, logger="tensorsocket")
    loader = [torch.full((2,), float(i)) for i in range(8)]
    # The keeper may take long to start on a loaded machine: the first wait is long, the
    # one after the keeper left (the end of this test) short.
    producer = TensorProducer(loader, name=name, ring_slots=4, rubber_band=0, start_timeout=60)
    keeper = popen([sys.executable, "-c", KEEPER, name, "4"],
                   stdout=subprocess.PIPE, text=True)
    procs.procs.append(keeper)
    ended: list[str] = []

    def run() -> None:
        try:
            for i, _ in enumerate(producer):
                if i == 0:
                    producer.start_timeout = 3
        except TimeoutError as e:  # the keeper left and nobody else came
            ended.append(str(e))

    t = threading.Thread(target=run, daemon=True)
    assert keeper.stdout.readline().strip() == "up"
    t.start()
    with selectors.DefaultSelector() as sel:
        sel.register(keeper.stdout, selectors.EVENT_READ)
        assert sel.select(60), "the keeper did not take its batches within 60 s"
    assert keeper.stdout.readline().strip() == "kept"
    keeper.wait(timeout=30)  # it exits: its slots are released
    t.join(timeout=30)
    assert ended and "start_timeout=3" in ended[0]
    producer.close()
    held = [r.getMessage() for r in caplog.records if "still keep" in r.getMessage()]
    assert len(held) == 1, caplog.text
    assert f"(pid {keeper.pid}) read and still keeps alive" in held[0]
    assert "TensorConsumer(copy=True)" in held[0]


BOUNDARY_JOB = r"""
import json, sys
from tensorsocket import TensorConsumer
name, mode, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
c = TensorConsumer(name=name, timeout=60, batch_timeout=30)
seen = []
for epoch in range(epochs):
    ids = []
    for step, batch in enumerate(c):
        ids.append(int(batch[0]))
        if mode == "break" and step == 17:
            break   # the loop variable still holds this batch when the next epoch starts
    seen.append(ids)
print(json.dumps(seen), flush=True)
c.close()
"""


@pytest.mark.parametrize("policy", [{}, {"max_lag": 2, "lag_policy": "rejoin"}],
                         ids=["lossless", "lag-rejoin"])
def test_breaking_at_the_epoch_end_while_holding_the_batch_never_deadlocks(name, policy,
                                                                           fault_table):
    """A job that breaks out near each epoch's end keeps its last batch in the loop
    variable while it reads on into the next epoch: it must not wait for the slot
    it holds itself (the producer cannot refill it, so both jobs and the producer would
    wait for good). Its next epochs are whole; the other job loses nothing."""
    import json
    import subprocess
    import sys
    import threading

    import torch

    from tensorsocket import TensorProducer

    epochs = 3
    loader = [torch.full((2,), float(i)) for i in range(20)]
    producer = TensorProducer(loader, name=name, min_consumers=2, start_timeout=60, **policy)
    jobs = {mode: popen([sys.executable, "-c", BOUNDARY_JOB, name, mode,
                                    str(epochs)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
            for mode in ("break", "read")}
    done = threading.Event()

    def produce() -> None:
        try:
            while not done.is_set():  # epochs until the jobs are done
                for _ in producer:
                    pass
        except Exception:  # closed by the test once the jobs are done
            pass

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    try:
        out = {}
        for mode, job in jobs.items():
            stdout, stderr = job.communicate(timeout=150)
            assert job.returncode == 0, f"{mode}: {stderr[-3000:]}"
            out[mode] = json.loads(stdout)
    finally:
        done.set()
        for job in jobs.values():
            if job.poll() is None:
                job.kill()
                job.wait()
        producer.close()
        t.join(30)
    if policy:  # a job detached for lagging ends its epoch where it was detached
        for ids in out["read"] + out["break"]:
            assert ids == list(range(len(ids))) and ids, out
        assert all(len(ids) <= 18 for ids in out["break"]), out
        fault_table.add("a job breaks out near each epoch's end holding its batch, then "
                        "reads its next epoch (max_lag=2, lag_policy='rejoin')",
                        "- (its place is kept at the next epoch; a batch it keeps is copied "
                        "privately once it would block the producer)",
                        "every epoch of both jobs starts at batch 0, no gap or repeat; "
                        "nothing waits", "nothing")
        return
    assert out["read"] == [list(range(20))] * epochs
    assert out["break"] == [list(range(18))] * epochs
    fault_table.add("a job breaks out at batch 18 of 20 each epoch holding its batch, then "
                    "reads its next epoch",
                    "- (its place is kept at the next epoch; a batch it keeps is copied "
                        "privately once it would block the producer)",
                    "the other job reads every batch once; the breaker's next epochs are "
                    "whole", "nothing")


# More set-asides than fault handling once had places for mappings (64): with 2 slots, a
# consumer that keeps a piece of every batch sets its handle aside every 2 batches.
MANY_BATCHES = 200

KEEP_PIECES = r"""
import json, sys
from tensorsocket import TensorConsumer
c = TensorConsumer(name=sys.argv[1], timeout=60, batch_timeout=15)
labels = []
try:
    for x, y in c:
        labels.append(y[:2])  # a validation loop keeping the labels of every batch
    outcome = "done"
except Exception as e:
    outcome = f"{type(e).__name__}: {e}"
print(json.dumps({"ids": [int(t[0]) for t in labels], "outcome": outcome,
                  "copied": c.stats()["copied_kept_batches"]}), flush=True)
c.close()
"""


def test_keeping_a_piece_of_every_batch_never_hangs(procs, name, fault_table):
    """A consumer that keeps a 2-element slice of every batch reads all of them, well past
    64 x ring_slots batches (where it once waited for itself for ever), and the other
    consumer of the producer reads every batch too, without stalling."""
    p = procs.start("producer", "--name", name, "--kind", "tuple",
                    "--batches", str(MANY_BATCHES), "--slots", "2", "--min-consumers", "2")
    procs.wait_ready(p)
    keeper = procs.script(KEEP_PIECES, name)
    other = procs.start("consumer", "--name", name, "--kind", "tuple")
    kept = keeper.result(timeout=150)
    assert kept["outcome"] == "done", kept["outcome"]
    assert kept["ids"] == list(range(MANY_BATCHES))
    assert kept["copied"] >= MANY_BATCHES - 2
    seen = procs.result(other, timeout=60)
    assert seen["outcome"] == "done" and seen["epochs"] == [list(range(MANY_BATCHES))]
    procs.result(p)
    fault_table.add(f"a consumer keeps a 2-element slice of each of {MANY_BATCHES} batches "
                    "over 2 ring slots (it hung at 64 x ring_slots before issue 22)",
                    f"- ({kept['copied']} kept batches copied privately, page by page of "
                    "the tensors still alive, as each came to block the producer)",
                    "the keeper and the other consumer read every batch once; nothing "
                    "waits", "nothing")


def test_list_of_a_long_epoch_gets_every_batch(procs, name):
    """list(consumer) over an epoch of more than 64 x ring_slots batches: every batch is
    there with its contents (it once stopped after 64 x slots + slots)."""
    p = procs.start("producer", "--name", name, "--kind", "tuple",
                    "--batches", str(MANY_BATCHES), "--slots", "2")
    procs.wait_ready(p)
    with TensorConsumer(name=name, timeout=30, batch_timeout=15) as c:
        batches = list(c)
        assert [int(x[0, 0]) for x, _ in batches] == list(range(MANY_BATCHES))
        assert all(bool((y == i).all()) for i, (_, y) in enumerate(batches))
    del batches
    procs.result(p)


KEEP_SLICES_MEMORY = r"""
import json, sys
from tensorsocket import TensorConsumer

def private_kib():
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f
                   if line.startswith(("Private_Clean", "Private_Dirty")))

c = TensorConsumer(name=sys.argv[1], timeout=60, batch_timeout=30)
kept, first = [], None
for i, batch in enumerate(c):
    kept.append(batch["idx"][:2])
    if i == 9:
        first = private_kib()
del batch
print(json.dumps({"kib_per_slice": (private_kib() - first) / (len(kept) - 10),
                  "ids": [int(t[0]) for t in kept],
                  "copied": c.stats()["copied_kept_batches"]}), flush=True)
c.close()
"""


def _produce_in_thread(producer):
    """Run the producer's loop on a thread (it ends when the test closes the producer)."""
    import threading

    def run() -> None:
        try:
            for _ in producer:
                pass
        except Exception:  # closed by the test, or its consumer left
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_kept_slice_keeps_only_its_own_pages(procs, name, fault_table):
    """A 2-element slice kept of each batch of {"x": 1 MiB, "idx": 256 int64} keeps about
    a page of private memory per batch once its batch was copied privately, not the 1 MiB
    of the whole batch: only the pages of tensors still alive are copied, and the pages
    of a tensor go when it does."""
    import torch

    from tensorsocket import TensorProducer

    batches = 70
    loader = [{"x": torch.full((262144,), float(i)), "idx": torch.arange(i * 256, i * 256 + 256)}
              for i in range(batches)]
    producer = TensorProducer(loader, name=name, ring_slots=2, rubber_band=0, start_timeout=60)
    keeper = procs.script(KEEP_SLICES_MEMORY, name)
    t = _produce_in_thread(producer)
    try:
        out = keeper.result(timeout=120)
    finally:
        t.join(30)
        producer.close()
    assert out["ids"] == [i * 256 for i in range(batches)]
    assert out["copied"] >= batches - 12
    assert out["kib_per_slice"] < 64, out  # a whole batch is 1028 KiB
    fault_table.add(f"a consumer keeps batch['idx'][:2] of each of {batches} batches of "
                    "1 MiB + 2 KiB over 2 ring slots",
                    f"- ({out['kib_per_slice']:.1f} KiB of private memory per kept slice; "
                    "1.5 MiB before issue 22)", "the keeper reads every batch once",
                    "nothing")


KEEP_UNTIL_NO_MEMORY = r"""
import json, resource, sys
from tensorsocket import TensorConsumer

def vm_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmSize"))

c = TensorConsumer(name=sys.argv[1], timeout=60, batch_timeout=30)
kept, error = [], None
try:
    for i, batch in enumerate(c):
        kept.append(batch["idx"][:2])
        if i == 0:  # room for a few pieces, none for another mapping of the 16 MiB ring
            limit = (vm_kib() + 4096) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
except MemoryError as e:
    error = str(e)
print(json.dumps({"kept": len(kept), "error": error}), flush=True)
"""


def test_kept_batches_out_of_memory_is_a_clear_error(procs, name):
    """Kept batches are bounded by memory only, and running out of it is a MemoryError
    naming the cause and what to do, not a hang (address space limited with RLIMIT_AS)."""
    import torch

    from tensorsocket import TensorProducer

    big = torch.zeros(2 * 1024 * 1024)  # 8 MiB per batch: a 16 MiB ring of 2 slots
    loader = [{"x": big, "idx": torch.arange(i * 4, i * 4 + 4)} for i in range(20)]
    producer = TensorProducer(loader, name=name, ring_slots=2, rubber_band=0, start_timeout=60)
    keeper = procs.script(KEEP_UNTIL_NO_MEMORY, name)
    t = _produce_in_thread(producer)
    try:
        out = keeper.result(timeout=120)
    finally:
        producer.close()
        t.join(30)
    assert out["error"] is not None, out
    assert "no memory is left" in out["error"] and "TensorConsumer(copy=True)" in out["error"]
    assert ".clone()" in out["error"]
