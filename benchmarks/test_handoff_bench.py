"""pytest-benchmark benchmarks of the producer -> consumer handoff.

Run explicitly (the default ``pytest`` run only collects ``tests/``):

    python -m pytest benchmarks/ --benchmark-only -n 0

``test_iceoryx2_peer_counters`` is a plain test (no ``benchmark`` fixture, so
``--benchmark-only`` skips it): ``python -m pytest benchmarks/test_handoff_bench.py -k
iceoryx2 -n 0``.

The producer is a real subprocess (``benchmarks/handoff.py _producer``) whose
loader yields the same pre-made batch every time; the consumer is this
process, and each timed call takes one batch and touches it. The memcpy
benchmark is the baseline to compare the 32 MiB handoff with.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

_HERE = Path(__file__).resolve().parent


def _load_handoff():
    """benchmarks/handoff.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("_tensorsocket_bench_handoff",
                                                  _HERE / "handoff.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


handoff = _load_handoff()
common = sys.modules["handoff_common"]  # imported by handoff.py
bench = sys.modules["bench_common"]  # likewise

TINY_ROUNDS, TINY_ITERATIONS, TINY_WARMUP = 200, 50, 10
LARGE_ROUNDS, LARGE_WARMUP = 40, 5
MEMCPY_ROUNDS, MEMCPY_WARMUP = 40, 3


@contextlib.contextmanager
def producer_process(kind: str, batches: int):
    """A producer subprocess publishing `batches` copies of the `kind` batch
    to one consumer; yields its name. Always killed and cleaned up."""
    name = f"bench-pytest-{os.getpid()}-{kind}-{time.monotonic_ns() % 10**9}"
    proc = bench.harness().spawn(
        handoff.child_argv("_producer", "--name", name, "--kind", kind,
                           "--batches", str(batches), "--consumers", "1"), label="producer")
    try:
        proc.wait_ready(handoff.ATTACH_TIMEOUT)
        yield name
        proc.result(handoff.JOIN_TIMEOUT + 30)
    finally:
        bench.stop_all([proc])
        bench.remove_leftovers(name)


@contextlib.contextmanager
def consumer_of(name: str):
    """A TensorConsumer in this process and its epoch iterator; drained and closed."""
    from tensorsocket import TensorConsumer

    consumer = TensorConsumer(name=name, timeout=handoff.ATTACH_TIMEOUT,
                              batch_timeout=handoff.BATCH_TIMEOUT)
    try:
        it = iter(consumer)
        yield it
        for _ in it:  # read the rest of the epoch so that the producer can join
            pass
    finally:
        consumer.close()


def test_consumer_tiny_batch(benchmark):
    """Consumer-side time per tiny batch (acquire, decode, build, touch, release)."""
    calls = (TINY_WARMUP + TINY_ROUNDS + 2) * TINY_ITERATIONS  # + pytest-benchmark's extras
    with producer_process("tiny", calls + 5000) as name, consumer_of(name) as it:

        def take_one():
            batch = next(it)
            return int(batch[1][0])  # touch one element

        benchmark.pedantic(take_one, rounds=TINY_ROUNDS, iterations=TINY_ITERATIONS,
                           warmup_rounds=TINY_WARMUP)
    benchmark.extra_info["batch_bytes"] = common.batch_bytes("tiny")
    median = benchmark.stats.stats.median
    benchmark.extra_info["batches_per_s"] = 1.0 / median if median > 0 else None


def test_consumer_32mib_batch(benchmark):
    """Consumer-side time per 32 MiB batch, touching one byte per 4 KiB page."""
    calls = LARGE_WARMUP + LARGE_ROUNDS + 2
    with producer_process("32MiB", calls + 20) as name, consumer_of(name) as it:

        def take_one():
            batch = next(it)
            return int(batch[0].view(-1)[:: common.PAGE].sum())

        benchmark.pedantic(take_one, rounds=LARGE_ROUNDS, iterations=1,
                           warmup_rounds=LARGE_WARMUP)
    nbytes = common.batch_bytes("32MiB")
    benchmark.extra_info["batch_bytes"] = nbytes
    median = benchmark.stats.stats.median
    benchmark.extra_info["gb_per_s"] = nbytes / median / 1e9 if median > 0 else None


def test_memcpy_32mib_baseline(benchmark):
    """Baseline: single-threaded np.copyto of 32 MiB into a preallocated buffer."""
    nbytes = common.batch_bytes("32MiB")
    src = np.full(nbytes, 7, dtype=np.uint8)
    dst = np.ones_like(src)  # written, so its pages are faulted in
    benchmark.pedantic(np.copyto, args=(dst, src), rounds=MEMCPY_ROUNDS, iterations=1,
                       warmup_rounds=MEMCPY_WARMUP)
    assert dst[-1] == 7
    benchmark.extra_info["batch_bytes"] = nbytes
    median = benchmark.stats.stats.median
    benchmark.extra_info["gb_per_s"] = nbytes / median / 1e9 if median > 0 else None


def _iceoryx2_files() -> set[str]:
    """The iceoryx2 files and directories that iceoryx2_handoff.py's runs leave, if any."""
    return set(glob.glob("/dev/shm/tsb-iox2-*")) | set(
        glob.glob(os.path.join(tempfile.gettempdir(), "tsb-iox2-*")))


def test_iceoryx2_peer_counters(tmp_path):
    """The iceoryx2 peer (tiny, 1 consumer, --quick) delivers 0..N-1 once each, intact,
    reports CPU per batch, and leaves no files behind."""
    pytest.importorskip("iceoryx2")
    before = _iceoryx2_files()
    out = tmp_path / "iceoryx2.json"
    proc = subprocess.run(
        [sys.executable, str(_HERE / "iceoryx2_handoff.py"), "--quick", "--kinds", "tiny",
         "--consumers", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == common.SCHEMA and not doc.get("skipped")
    assert doc["implementation"].startswith("iceoryx2 ")
    (result,) = doc["results"]
    batches = doc["settings"]["batches"]["tiny"]
    assert result["error"] is None, result["error"]
    (run,) = result["runs"]
    (consumer,) = run["consumers"]
    assert consumer["batches"] == batches
    assert (consumer["first_counter"], consumer["last_counter"]) == (0, batches - 1)
    assert consumer["missing"] == consumer["duplicates"] == consumer["corrupt"] == 0
    assert run["producer"]["batches"] == batches and run["producer"]["drained"]
    assert result["batches_per_s"] > 0 and result["consumer_cpu_us_per_batch"] > 0
    assert _iceoryx2_files() <= before


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "--benchmark-only", "-n", "0", *sys.argv[1:]]))
