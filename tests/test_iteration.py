"""A consumer iterates like a DataLoader: len() for progress bars (re-batching and
drop_last included), enumerate, zip and islice, epochs left early; and what it logs."""

from __future__ import annotations

import io
import itertools
import json
import logging
import sys
import textwrap
import threading

import pytest

from conftest import ROOT, run as run_python
from roles import CountingLoader
from tensorsocket import TensorConsumer, TensorProducer, TensorSocketError

tqdm = pytest.importorskip("tqdm").tqdm


def test_len_matches_what_tqdm_counts(procs, name):
    """A DataLoader of 50 samples in batches of 8 (the last one 2), in a producer process;
    consumers in threads here with their own batch sizes: len(consumer) is the tqdm
    total, and each epoch yields exactly that many batches."""
    cases = {"loader": (None, False, 7), "3": (3, False, 17), "3-drop": (3, True, 16),
             "16": (16, False, 4), "16-drop": (16, True, 3)}
    prod = procs.start("producer", "--name", name, "--kind", "samples", "--samples", "50",
                       "--loader-bs", "8", "--epochs", "2", "--min-consumers", str(len(cases)))
    procs.wait_ready(prod)
    results: dict = {}

    def consume(key: str, batch_size: int | None, drop_last: bool) -> None:
        try:
            with TensorConsumer(name=name, timeout=30, batch_timeout=30,
                                batch_size=batch_size, drop_last=drop_last) as c:
                out = []
                for _ in range(2):
                    bar = tqdm(c, file=io.StringIO(), mininterval=0)
                    ids = [i for batch in bar for i in batch["id"].tolist()]
                    out.append((len(c), bar.total, bar.n, ids))
                    bar.close()
                results[key] = out
        except Exception as e:  # reported by the assertions below
            results[key] = repr(e)

    threads = [threading.Thread(target=consume, args=(k, *v[:2])) for k, v in cases.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    procs.result(prod)
    for key, (_, drop_last, want) in cases.items():
        assert isinstance(results[key], list), (key, results[key])
        for epoch, (length, total, n, ids) in enumerate(results[key]):
            assert length == total == n == want, (key, epoch, length, total, n)
            kept = 48 if drop_last else 50  # 16 x 3 and 3 x 16 samples
            assert ids == [epoch * 100000 + i for i in range(kept)], key


class Epochs:
    """A producer of CountingLoader epochs (batch b of epoch e carries e * 1000 + b) in a
    thread, with a window covering a whole epoch, so that a consumer that leaves an
    epoch early comes back at the start of one."""

    def __init__(self, name: str, batches: int, epochs: int) -> None:
        self.batches = batches
        self.producer = TensorProducer(CountingLoader(batches, "tuple"), name=name,
                                       rubber_band=batches, start_timeout=30)
        self.thread = threading.Thread(target=self._run, args=(epochs,), daemon=True)
        self.thread.start()

    def _run(self, epochs: int) -> None:
        try:
            for _ in range(epochs):
                for _ in self.producer:
                    pass
        except TensorSocketError:  # closed by the test while waiting for a consumer
            pass

    def epoch(self, e: int) -> list[int]:
        return [e * 1000 + b for b in range(self.batches)]

    def close(self) -> None:
        self.producer.close()
        self.thread.join(10)
        assert not self.thread.is_alive()


def _value(batch) -> int:
    return int(batch[1][0])


def test_enumerate_zip_and_islice(name, caplog):
    """enumerate and zip over whole epochs; zip and islice that stop early leave their
    epoch, and the next epoch is the producer's next one, whole and in order."""
    # The producer's and the consumer's parks, unparks and attaches show on a failure.
    caplog.set_level(logging.INFO, logger="tensorsocket")
    epochs = Epochs(name, batches=12, epochs=8)
    try:
        with TensorConsumer(name=name, timeout=10, batch_timeout=20) as c:
            assert len(c) == 12
            got = [(i, _value(b)) for i, b in enumerate(c)]
            assert got == list(enumerate(epochs.epoch(0)))
            # zip with a longer range: the consumer's epoch ends it, nothing is lost.
            got = [(_value(b), i) for b, i in zip(c, range(100), strict=False)]
            assert got == list(zip(epochs.epoch(1), range(12), strict=True))
            # zip with a shorter range: five batches, then the epoch is left early.
            got = [_value(b) for b, _ in zip(c, range(5), strict=False)]
            assert got == epochs.epoch(2)[:5]
            whole = [_value(b) for b in c]
            # It kept its place at the start of the producer's next epoch: epoch 3.
            assert whole == epochs.epoch(3), whole
            assert [_value(b) for b in itertools.islice(c, 3)] == epochs.epoch(4)[:3]
            whole = [_value(b) for b in c]
            assert whole == epochs.epoch(5), whole
            assert [_value(b) for b in c] == epochs.epoch(6)
            assert c.stats()["rejoins"] == 0  # leaving early is not being detached
    finally:
        epochs.close()


def test_producer_logs_joins_leaves_and_lag_detaches(procs, name, caplog):
    """With the producer in this process, its control thread logs each consumer that
    joins (INFO) and leaves (INFO), and one detached for lagging (WARNING)."""
    caplog.set_level(logging.INFO, logger="tensorsocket")
    producer = TensorProducer(CountingLoader(40, "tuple"), name=name, min_consumers=2,
                              max_lag=3, rubber_band=0, start_timeout=30)
    errors: list = []

    def produce() -> None:
        try:
            for _ in producer:
                pass
        except Exception as e:
            errors.append(e)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        # It holds each batch for 0.5 s while it "trains" on it: the other one gets more
        # than max_lag batches ahead.
        slow = procs.start("consumer", "--name", name, "--kind", "tuple", "--delay", "0.5",
                           "--hold")
        fast = procs.start("consumer", "--name", name, "--kind", "tuple")
        r, s = procs.result(fast), procs.result(slow)
        assert r["errors"] == [] and r["epochs"] == [list(range(40))]
        assert s["outcome"].startswith("ConsumerDetached"), s["outcome"]
        thread.join(30)
        assert producer.join(timeout=30) is True
    finally:
        producer.close()
        thread.join(10)
    assert errors == []
    ours = [r for r in caplog.records
            if r.name == "tensorsocket" and r.threadName == "tensorsocket-control"]
    joined = [r for r in ours if "joined at entry" in r.getMessage()]
    left = [r for r in ours if r.getMessage().endswith(" left")]
    detached = [r for r in ours if "fell more than max_lag" in r.getMessage()]
    assert len(joined) == 2 and {r.levelno for r in joined} == {logging.INFO}
    assert len(left) >= 1 and {r.levelno for r in left} == {logging.INFO}
    assert f"(pid {fast.pid}) left" in " ".join(r.getMessage() for r in left)
    assert len(detached) == 1 and detached[0].levelno == logging.WARNING
    assert f"(pid {slow.pid})" in detached[0].getMessage()


def test_producer_warns_about_a_consumer_holding_the_others_back(procs, name, caplog,
                                                                  monkeypatch):
    """Without max_lag nobody is detached; a consumer that keeps the others waiting (behind
    the fastest by nearly the whole ring) gets one WARNING naming it and max_lag=."""
    from tensorsocket.control import stall_watch

    monkeypatch.setattr(stall_watch, "LAG_WARN_AFTER", 1.0)
    caplog.set_level(logging.INFO, logger="tensorsocket")
    producer = TensorProducer(CountingLoader(30, "tuple"), name=name, min_consumers=2,
                              ring_slots=4, rubber_band=0, start_timeout=30)
    thread = threading.Thread(target=lambda: [None for _ in producer], daemon=True)
    thread.start()
    try:
        slow = procs.start("consumer", "--name", name, "--kind", "tuple", "--delay", "0.1",
                           "--hold")
        fast = procs.start("consumer", "--name", name, "--kind", "tuple")
        r, s = procs.result(fast), procs.result(slow)
        assert r["epochs"] == [list(range(30))] and s["epochs"] == [list(range(30))]
        thread.join(30)
        assert producer.join(timeout=30) is True
    finally:
        producer.close()
        thread.join(10)
    warned = [r for r in caplog.records if "held the producer and the others back"
              in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert f"(pid {slow.pid})" in warned[0].getMessage()
    assert "max_lag=" in warned[0].getMessage()


NO_ROOT_HANDLERS = """
import json, logging, sys, threading
before = list(logging.root.handlers)
import torch
import tensorsocket
from tensorsocket import TensorConsumer, TensorProducer

name = sys.argv[1]
producer = TensorProducer([torch.zeros(3)] * 4, name=name, start_timeout=30)
thread = threading.Thread(target=lambda: [None for _ in producer])
thread.start()
with TensorConsumer(name=name, timeout=30) as c:
    n = sum(1 for _ in c)
thread.join(30)
producer.join(timeout=30)
# A WARNING from the library (an epoch with no batch) must not reach stderr either.
empty = TensorProducer([], name=name + "-empty", min_consumers=0)
list(empty)
empty.close()
ts = logging.getLogger("tensorsocket")
print(json.dumps({"batches": n, "root_before": len(before),
                  "root_after": len(logging.root.handlers), "root_level": logging.root.level,
                  "handlers": [type(h).__name__ for h in ts.handlers],
                  "level": ts.level}))
"""


def test_library_never_configures_logging(name):
    """Importing tensorsocket and running a producer and a consumer adds no handler to
    the root logger and sets no level; its records reach only the application's handlers
    (none here: nothing is printed, even for a WARNING)."""
    proc = run_python([sys.executable, "-c", textwrap.dedent(NO_ROOT_HANDLERS), name],
                      capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"batches": 4, "root_before": 0, "root_after": 0,
                   "root_level": logging.WARNING, "handlers": ["NullHandler"],
                   "level": logging.NOTSET}
    assert proc.stderr == ""
