"""The decoded-sample cache (cache_bytes=, tensorsocket/producer/sample_cache.py) under
faults of the machine and of the dataset, with real producer and consumer processes;
each test adds its row to the fault table (docs/faults.md).

- A budget larger than the machine gives: the producer in a small memory cgroup (made
  here where cgroups are writable: root, a cgroup v1 memory hierarchy or a v2 one whose
  root delegates the memory controller; skipped elsewhere, saying why). shmem is not
  refused when it does not fit: without a check of the room, posix_fallocate charges the
  memfd page by page until the cgroup's OOM killer SIGKILLs the producer.
- A dataset whose __getitem__ draws random numbers, which no transform's name tells:
  the check before each cached epoch loads a few samples again and compares bytes.
"""

from __future__ import annotations

import errno
import os
import signal
import uuid
from pathlib import Path

import pytest

# -- a small memory cgroup -----------------------------------------------------------------

CGROUP_LIMIT = 384 << 20  # the producer's cgroup
SAMPLE_BYTES = 256 << 10  # ... and a dataset of 4096 such samples: 1 GiB to cache
SAMPLES = 4096
BATCH = 4
BATCHES = 8  # the producer breaks out of its epoch after these


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _memory_mounts() -> dict[str, Path]:
    """Where the cgroup v2 hierarchy ("v2") and the v1 memory controller's ("v1") are
    mounted, from /proc/self/mountinfo (read here, not by the code under test)."""
    found: dict[str, Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mine, _, theirs = line.partition(" - ")
        point, (kind, _, options) = mine.split()[4], theirs.split()[:3]
        if kind == "cgroup2" or (kind == "cgroup" and "memory" in options.split(",")):
            found.setdefault("v2" if kind == "cgroup2" else "v1", Path(point))
    return found


def _make_cgroup(limit: int) -> tuple[Path, str]:
    """A new memory cgroup limited to `limit` bytes, without swap: (its directory, its
    version); pytest.skip with the reason where none can be made here."""
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root (this test runs as uid "
                    f"{os.geteuid()})")
    mounts = _memory_mounts()
    leaf = f"ts-test-{uuid.uuid4().hex[:8]}"
    tried = []
    if "v2" in mounts:
        top = mounts["v2"]
        try:
            if "memory" not in (top / "cgroup.controllers").read_text().split():
                raise OSError(errno.ENOTSUP, "the memory controller is not in "
                              f"{top}/cgroup.controllers (it is bound to cgroup v1)")
            if "memory" not in (top / "cgroup.subtree_control").read_text().split():
                _write(top / "cgroup.subtree_control", "+memory")
            made = top / leaf
            made.mkdir()
            try:
                _write(made / "memory.max", str(limit))
                if (made / "memory.swap.max").exists():
                    _write(made / "memory.swap.max", "0")
            except OSError:
                made.rmdir()
                raise
            return made, "v2"
        except OSError as e:
            tried.append(f"cgroup v2 at {top}: {e}")
    if "v1" in mounts:
        top = mounts["v1"]
        try:
            made = top / leaf
            made.mkdir()
            try:
                _write(made / "memory.limit_in_bytes", str(limit))
                if (made / "memory.memsw.limit_in_bytes").exists():
                    _write(made / "memory.memsw.limit_in_bytes", str(limit))
            except OSError:
                made.rmdir()
                raise
            return made, "v1"
        except OSError as e:
            tried.append(f"cgroup v1 memory at {top}: {e}")
    pytest.skip("no memory cgroup can be made here: "
                + ("; ".join(tried) or "no cgroup memory hierarchy is mounted"))


def _oom_kills(cgroup: Path, version: str) -> int:
    """The OOM kills in the cgroup so far."""
    name = "memory.events" if version == "v2" else "memory.oom_control"
    for line in (cgroup / name).read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def _peak(cgroup: Path, version: str) -> int | None:
    """The cgroup's peak memory usage (None where the kernel does not keep it)."""
    path = cgroup / ("memory.peak" if version == "v2" else "memory.max_usage_in_bytes")
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@pytest.fixture
def small_cgroup(procs):
    """(directory, version) of a memory cgroup of CGROUP_LIMIT bytes for the test's
    producer to join (it writes its pid to cgroup.procs); at teardown the processes the
    test put there are killed (by pid) and the cgroup removed. (It takes `procs` so that
    it is torn down first.)"""
    cgroup, version = _make_cgroup(CGROUP_LIMIT)
    yield cgroup, version
    for _ in range(200):
        pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            cgroup.rmdir()
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
        os.sched_yield()
    cgroup.rmdir()


BIG_PRODUCER = r"""
import json, os, sys
cgroup = os.environ["TS_TEST_CGROUP"]
with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:  # before anything is allocated
    f.write(str(os.getpid()))
import torch
from torch.utils.data import DataLoader, Dataset
from tools.harness import emit, keep_log_and_warnings
from tensorsocket import TensorProducer

name, samples, sample_bytes, batch, batches = sys.argv[1], *map(int, sys.argv[2:6])

class Big(Dataset):
    def __len__(self):
        return samples

    def __getitem__(self, i):
        return torch.full((sample_bytes,), i % 251, dtype=torch.uint8), i

records, caught = keep_log_and_warnings()

producer = TensorProducer(DataLoader(Big(), batch_size=batch), name=name,
                          cache_bytes=1 << 40)  # 1 TiB: trusting it needs the room check
emit({"ready": True})
for k, _ in enumerate(producer):
    if k + 1 == batches:
        break
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
memory = {key: int(status[key].split()[0]) << 10 for key in ("VmRSS", "RssShmem", "VmHWM")}
stats = {k: v for k, v in producer.stats().items() if k.startswith("cache_")}
producer.join(timeout=60)
emit({"stats": stats, "log": records, "warnings": caught, "memory": memory})
"""

BIG_CONSUMER = r"""
import sys
from tools.harness import emit
from tensorsocket import TensorConsumer, ProducerGone

consumer = TensorConsumer(name=sys.argv[1], timeout=60)
emit({"ready": True})
ids, bad = [], 0
try:
    for rows, labels in consumer:
        ids += labels.tolist()
        bad += sum(int((rows[k] != int(labels[k]) % 251).any()) for k in range(len(labels)))
        del rows, labels
except ProducerGone as e:
    emit({"raised": type(e).__name__, "message": str(e)[:300]})
    sys.exit(0)
consumer.close()
emit({"ids": ids, "bad": bad})
"""


def test_a_budget_over_the_cgroup_is_refused_not_oom_killed(procs, name, small_cgroup,
                                                            fault_table):
    """cache_bytes=1 TiB, a dataset needing 1 GiB, the producer in a 384 MiB memory
    cgroup: the cache is refused before anything is allocated (a WARNING and a
    TensorSocketWarning naming the cgroup's limit, stats' cache_off), the producer is not
    OOM-killed (the cgroup counts no OOM kill), and the consumer gets its batches whole.
    Before the check posix_fallocate charged the memfd until the OOM killer SIGKILLed
    the producer at its first batch."""
    cgroup, version = small_cgroup
    producer = procs.script(BIG_PRODUCER, name, str(SAMPLES), str(SAMPLE_BYTES), str(BATCH),
                            str(BATCHES), env={"TS_TEST_CGROUP": str(cgroup)})
    assert producer.wait_ready(timeout=60)["ready"]
    consumer = procs.script(BIG_CONSUMER, name)
    assert consumer.wait_ready(timeout=60)["ready"]
    got = consumer.result(timeout=120)
    returncode = producer.wait(timeout=120)
    kills, peak = _oom_kills(cgroup, version), _peak(cgroup, version)
    assert returncode == 0, (
        f"the producer exited with {returncode} (-9: SIGKILL, the cgroup's OOM killer; "
        f"{kills} OOM kill(s), peak {peak} bytes of {CGROUP_LIMIT}); the consumer: {got}")
    assert kills == 0
    result = producer.result(timeout=60)
    assert got.get("ids") == list(range(BATCH * BATCHES)) and got["bad"] == 0, got
    stats = result["stats"]
    assert stats["cache_bytes"] == 0 and stats["cache_epochs"] == 0
    assert stats["cache_off"].startswith("not made: ") and "could not be allocated" in \
        stats["cache_off"] and f"memory cgroup {version} /" in stats["cache_off"]
    warned = [m for lv, m in result["log"] if lv == "WARNING" and "decoded cache off" in m]
    assert len(warned) == 1 and "more than this process may take" in warned[0], result["log"]
    assert ["TensorSocketWarning", warned[0]] in result["warnings"]
    memory = result["memory"]
    assert memory["RssShmem"] < CGROUP_LIMIT // 4, memory
    fault_table.add(
        f"cache_bytes=1 TiB over a 1 GiB dataset, the producer in a "
        f"{CGROUP_LIMIT >> 20} MiB memory cgroup ({version})",
        "at the first batch, before allocating: the room left (MemAvailable; each "
        "cgroup level's limit less its working set; less a margin) is read and the cache "
        "refused: WARNING and TensorSocketWarning in the producer, stats()['cache_off']",
        f"the consumer: its {BATCH * BATCHES} samples, whole; the producer runs on "
        f"(RSS {memory['VmRSS'] >> 20} MiB, shmem {memory['RssShmem'] >> 20} MiB). "
        "Before: SIGKILLed by the cgroup's OOM killer at its first batch",
        f"nothing: no memfd, {kills} OOM kills, cgroup peak "
        f"{(peak or 0) >> 20} MiB of {CGROUP_LIMIT >> 20}")


# -- a dataset that draws random numbers ---------------------------------------------------

RANDOM_SAMPLES = 500
RANDOM_BATCH = 50
EPOCHS = 3

RANDOM_PRODUCER = r"""
import sys
import torch
from torch.utils.data import DataLoader, Dataset
from tools.harness import emit, keep_log_and_warnings
from tensorsocket import TensorProducer

name, samples, batch, workers, epochs = sys.argv[1], *map(int, sys.argv[2:6])

class Noisy(Dataset):
    # A noise augmentation written in __getitem__: no transform, no name to read.
    def __len__(self):
        return samples

    def __getitem__(self, i):
        return torch.full((16,), float(i)) + torch.randn(16), i

records, caught = keep_log_and_warnings()

torch.manual_seed(7)
producer = TensorProducer(DataLoader(Noisy(), batch_size=batch, shuffle=True,
                                     num_workers=workers),
                          name=name, cache_bytes=1 << 30)
emit({"ready": True})
for epoch in range(epochs):
    for _ in producer:
        pass
stats = {k: v for k, v in producer.stats().items() if k.startswith("cache_")}
producer.join(timeout=60)
emit({"stats": stats, "log": records, "warnings": caught})
"""

RANDOM_CONSUMER = r"""
import sys
from tools.harness import emit
from tensorsocket import TensorConsumer

consumer = TensorConsumer(name=sys.argv[1], timeout=60)
emit({"ready": True})
epochs = []
for epoch in range(int(sys.argv[2])):
    rows = {}
    for values, ids in consumer:
        rows.update((int(i), v.numpy().tobytes().hex()) for v, i in zip(values, ids))
        del values, ids
    epochs.append(rows)
consumer.close()
emit({"epochs": epochs})
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_drawing_random_numbers_is_not_replayed(procs, name, fault_table, workers):
    """A dataset whose __getitem__ adds torch.randn noise (no transform to name it),
    cache_bytes large enough, 3 epochs: before epoch 2 the producer loads a few samples
    again, finds other bytes than it cached and drops the cache (a WARNING and a
    TensorSocketWarning saying why, stats' cache_off); no sample of epochs 2 and 3 is
    the bytes epoch 1 gave it (before: all 500 replayed, each epoch)."""
    producer = procs.script(RANDOM_PRODUCER, name, str(RANDOM_SAMPLES), str(RANDOM_BATCH),
                            str(workers), str(EPOCHS))
    assert producer.wait_ready(timeout=60)["ready"]
    consumer = procs.script(RANDOM_CONSUMER, name, str(EPOCHS))
    assert consumer.wait_ready(timeout=60)["ready"]
    epochs = consumer.result(timeout=120)["epochs"]
    result = producer.result(timeout=120)
    assert [sorted(map(int, e)) for e in epochs] == [list(range(RANDOM_SAMPLES))] * EPOCHS
    replayed = [sum(e[i] == epochs[0][i] for i in epochs[0]) for e in epochs[1:]]
    assert replayed == [0] * (EPOCHS - 1), f"samples replayed per later epoch: {replayed}"
    stats = result["stats"]
    assert (stats["cache_bytes"], stats["cache_epochs"]) == (0, 0), stats
    assert stats["cache_off"].startswith("dropped: sample ") and \
        "loaded again in the producer at the start of epoch 1" in stats["cache_off"]
    dropped = [m for lv, m in result["log"] if lv == "WARNING" and "cache dropped" in m]
    assert len(dropped) == 1 and "is not what the cache holds" in dropped[0], result["log"]
    assert ["TensorSocketWarning", dropped[0]] in result["warnings"]
    fault_table.add(
        f"a dataset whose __getitem__ draws random numbers (torch.randn), "
        f"{RANDOM_SAMPLES} samples, cache_bytes= large enough, num_workers={workers}",
        "at the start of epoch 2, before it is served: 8 random samples loaded again in the "
        "producer differ from the bytes cached; cache dropped with a WARNING and a "
        "TensorSocketWarning in the producer, stats()['cache_off']",
        f"the consumer: {sum(replayed)} of {RANDOM_SAMPLES * (EPOCHS - 1)} samples of epochs "
        f"2-{EPOCHS} repeat epoch 1's draws (before: all {RANDOM_SAMPLES} each epoch); every "
        "epoch runs the loader",
        "nothing: the memfd freed (cache_bytes 0)")
