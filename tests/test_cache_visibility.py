"""The decoded-sample cache, seen from the job that asked for it (issue 36, item 7).

A share() caller never holds the producer: before issue 36 the cache's figures were in
the producer's stats() only, and "cache off: needs N bytes" went to the producer's log
file. Now the producer notes its cache in its ring's header (ring layout 9), where the
training process reads it: consumer.stats() has cache_* fields, the job is told in its
own process (a TensorSocketWarning when it got no cache, saying why), and `tensorsocket
status --json` shows it. share() runs in the test process; the producer it forks is a
real process; status runs as a real CLI process."""

from __future__ import annotations

import json
import sys
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

import tensorsocket
from tensorsocket.errors import TensorSocketWarning

from conftest import run
from test_cache_bytes_text import _wait_gone

SAMPLES, BATCH = 32, 4
SAMPLE_BYTES = 8  # one int64 per sample


def _status(name: str) -> dict:
    """The producer of `name` in `tensorsocket status --json`."""
    out = run([sys.executable, "-m", "tensorsocket", "status", "--json", "--name", name,
               "--interval", "0"], capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (producer,) = json.loads(out.stdout)["producers"]
    return producer


def _two_epochs(name: str, budget: int) -> tuple[list[dict], list, dict]:
    """share() a loader with cache_bytes=budget, read 2 epochs (every sample once each);
    the consumer's stats() after each, the TensorSocketWarnings in this process, and the
    status of the producer read during the second epoch."""
    loader = DataLoader(TensorDataset(torch.arange(SAMPLES)), batch_size=BATCH, shuffle=True)
    consumer = tensorsocket.share(loader, name=name, epochs=2, idle_timeout=30, timeout=60,
                                  cache_bytes=budget)
    stats, status = [], {}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for epoch in range(2):
                ids = []
                for (batch,) in consumer:
                    ids.extend(int(i) for i in batch)
                    if epoch == 1 and not status:
                        status = _status(name)
                assert sorted(ids) == list(range(SAMPLES))
                stats.append(consumer.stats())
        pid = consumer.producer_pid
    finally:
        consumer.close()
    _wait_gone(pid)  # (a producer that ends cleanly removes its segment)
    said = [w for w in caught if issubclass(w.category, TensorSocketWarning)]
    return stats, said, status


def test_a_cache_that_does_not_fit_is_told_to_the_job(name):
    """cache_bytes under what the dataset needs: after its first epoch the job hears why
    in its own process (a TensorSocketWarning naming cache_bytes and the bytes needed),
    once; stats() and status say the same."""
    stats, said, status = _two_epochs(name, budget=SAMPLES * SAMPLE_BYTES // 2)
    assert len(said) == 1, [str(w.message) for w in said]
    message = str(said[0].message)
    assert f"cache_bytes={SAMPLES * SAMPLE_BYTES // 2}" in message, message
    assert f"need {SAMPLES * SAMPLE_BYTES} bytes" in message, message
    for s in stats:
        assert s["cache_budget"] == SAMPLES * SAMPLE_BYTES // 2
        assert s["cache_bytes"] == 0 and s["cache_off"].startswith("not made:"), s
    assert status["cache"]["budget"] == SAMPLES * SAMPLE_BYTES // 2
    assert status["cache"]["off"].startswith("not made:"), status["cache"]


def test_a_cache_that_fits_is_seen_by_the_job(name):
    """A budget that fits: no warning; stats() shows the cache filled in epoch 0 and
    serving from epoch 1 on; status shows its bytes and samples."""
    stats, said, status = _two_epochs(name, budget=1 << 20)
    assert not said, [str(w.message) for w in said]
    assert stats[0]["cache_bytes"] >= SAMPLES * SAMPLE_BYTES
    assert stats[0]["cache_off"] is None
    assert stats[1]["cache_samples"] == SAMPLES and stats[1]["cache_epochs"] >= 1
    assert status["cache"]["bytes"] >= SAMPLES * SAMPLE_BYTES
    assert status["cache"]["samples"] == SAMPLES and status["cache"]["off"] is None
