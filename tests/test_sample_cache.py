"""The producer's decoded-sample cache (cache_bytes=, tensorsocket/producer/sample_cache.py):
a real producer process over a DataLoader whose dataset logs every sample it loads (a
file of "pid index" lines), and a real consumer process; the assertions are on the ids
and contents the consumer received, the loads, and the producer's stats and log."""

from __future__ import annotations

import logging
import os
import signal
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import Producing
from tensorsocket import TensorConsumer, TensorProducer, config
from tensorsocket.config import ArgumentTypeError
from tensorsocket.errors import TensorSocketWarning

SAMPLES = 100
BATCH = 16  # the last batch of an epoch holds 4
ROW_BYTES = 3 * 4 * 4 + 8  # an image of uint8 (3, 4, 4) and an int64 label
CACHE_NEEDS = SAMPLES * ROW_BYTES
MEMFD = "memfd:tensorsocket-cache"

# Sample i: an image whose bytes say i, and the label i. The dataset appends "pid i" to
# $TS_TEST_LOADS at every load (tests/clients/_common.py's IdDataset does the same).
COMMON = r"""
import json, os, sys, threading, logging
import torch
from torch.utils.data import DataLoader, Dataset
from tools.harness import emit

def image_of(i):
    return ((torch.arange(48) + 7 * i) % 251).to(torch.uint8).reshape(3, 4, 4)

def bad_rows(images, labels):
    return sum(int(not torch.equal(images[k], image_of(int(labels[k]))))
               for k in range(len(labels)))
"""

PRODUCER = COMMON + r"""
from tensorsocket import TensorProducer
from tensorsocket.config import UNSET

name, cache_bytes, workers, epochs, hold, wide_from, drop_last = sys.argv[1:8]
workers_only = sys.argv[8:9] == ["workers-only"]  # loads only in a loader worker

class LoggedDataset(Dataset):
    loaded = 0  # samples this process loaded

    def __len__(self):
        return 100

    def __getitem__(self, i):
        if workers_only and torch.utils.data.get_worker_info() is None:
            raise RuntimeError("this dataset opens its files in its loader workers only")
        fd = os.open(os.environ["TS_TEST_LOADS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, b"%d %d\n" % (os.getpid(), i))
        os.close(fd)
        image = image_of(i)
        LoggedDataset.loaded += 1
        if 0 <= int(wide_from) < LoggedDataset.loaded:  # from then on, wider rows
            image = torch.cat([image, image], dim=2)
        return image, i

records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append([record.levelname, record.getMessage()])
logger = logging.getLogger("tensorsocket")
logger.setLevel(logging.INFO)
logger.addHandler(Keep())

torch.manual_seed(1234)
loader = DataLoader(LoggedDataset(), batch_size=16, shuffle=True, num_workers=int(workers),
                    drop_last=drop_last == "1")
producer = TensorProducer(loader, name=name,  # "env": from TENSORSOCKET_CACHE_BYTES
                          cache_bytes=UNSET if cache_bytes == "env" else int(cache_bytes))
emit({"ready": True, "pid": os.getpid()})
yielded, bad = [], 0
for epoch in range(int(epochs)):
    ids = []
    for images, labels in producer:
        assert images.dtype == torch.uint8 and labels.dtype == torch.int64
        ids += labels.tolist()
        if int(wide_from) < 0:
            bad += bad_rows(images, labels)
    yielded.append(ids)
    stats = {k: v for k, v in producer.stats().items() if k.startswith("cache_")}
    emit({"epoch": epoch, "stats": stats})
    if int(hold) == epoch:
        emit({"holding": True, "log": records})
        threading.Event().wait()  # until the test kills this process
producer.join(timeout=60)
emit({"yielded": yielded, "bad": bad, "stats": stats, "log": records})
"""

CONSUMER = COMMON + r"""
from tensorsocket import TensorConsumer, ProducerGone

name, epochs, check = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
consumer = TensorConsumer(name=name, timeout=60)
emit({"ready": True})
bad = 0
try:
    for epoch in range(epochs):
        ids = []
        for images, labels in consumer:
            ids += labels.tolist()
            if check:
                bad += bad_rows(images, labels)
            del images, labels
        emit({"epoch": epoch, "ids": ids, "bad": bad})
except ProducerGone as e:
    emit({"raised": type(e).__name__, "message": str(e)[:300]})
    sys.exit(0)
consumer.close()
emit({"done": True, "bad": bad})
"""


def start(procs, name: str, loads: Path, *, cache_bytes: int | str, workers: int = 0,
          epochs: int = 3, hold: int = -1, wide_from: int = -1,
          drop_last: bool = False, env: dict | None = None,
          workers_only: bool = False) -> tuple:
    """The producer and consumer processes, both ready (the consumer attached);
    cache_bytes "env": the producer takes it from `env`."""
    env = {"TS_TEST_LOADS": str(loads), **(env or {})}
    producer = procs.script(PRODUCER, name, str(cache_bytes), str(workers), str(epochs),
                            str(hold), str(wide_from), "1" if drop_last else "0",
                            *(["workers-only"] if workers_only else []), env=env)
    assert producer.wait_ready(timeout=60)["ready"]
    consumer = procs.script(CONSUMER, name, str(epochs), "1" if wide_from < 0 else "0")
    assert consumer.wait_ready(timeout=60)["ready"]
    return producer, consumer


def consumer_epochs(consumer, epochs: int) -> list[list[int]]:
    """The ids the consumer received per epoch; its checks of the contents passed."""
    got = [consumer.read_json(timeout=120) for _ in range(epochs)]
    assert [g["epoch"] for g in got] == list(range(epochs))
    assert got[-1]["bad"] == 0, "a batch's rows are not the samples its ids name"
    assert consumer.result(timeout=60)["done"]
    return [g["ids"] for g in got]


def loads_of(path: Path) -> list[tuple[int, int]]:
    """(pid, index) of every sample the dataset loaded."""
    if not path.exists():
        return []
    return [tuple(map(int, line.split())) for line in path.read_text().splitlines()]


def whole(epochs: list[list[int]]) -> None:
    """Every sample once per epoch."""
    for e, ids in enumerate(epochs):
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {e} is not a whole pass"


def checks(*epochs: int) -> list[int]:
    """The sample ids the producer loads again, in order, to check the cache before each
    of these epochs (served from it)."""
    from tensorsocket.producer.sample_cache import checked_samples

    return [int(i) for e in epochs for i in checked_samples(e, SAMPLES)]


def said(log: list, level: str, text: str) -> list[str]:
    """The log lines of `level` holding `text`."""
    return [m for lv, m in log if lv == level and text in m]


@pytest.mark.parametrize("workers", [0, 2])
def test_epochs_after_the_first_come_from_the_cache(procs, name, tmp_path, workers):
    """cache_bytes large enough: every sample once per epoch by id, the dataset read N
    times by the loader in all (epoch 1 only) and, by the producer, the few samples that
    check the cache before each cached epoch; epoch 2 in the sampler's new order, every
    batch's rows the dataset's samples of its ids (in the consumer and in the producer's
    loop)."""
    loads = tmp_path / "loads"
    producer, consumer = start(procs, name, loads, cache_bytes=10 * CACHE_NEEDS,
                               workers=workers)
    epochs = consumer_epochs(consumer, 3)
    result = producer.result(timeout=120)
    whole(epochs)
    assert result["yielded"] == epochs and result["bad"] == 0
    assert epochs[1] != epochs[0] and epochs[2] != epochs[1], "the epochs were not reshuffled"
    read = loads_of(loads)
    by_loader, checked = read[:SAMPLES], read[SAMPLES:]
    assert sorted(i for _, i in by_loader) == list(range(SAMPLES)), "each sample read once"
    readers = {pid for pid, _ in by_loader}
    if workers:
        assert producer.pid not in readers and len(readers) == workers
    else:
        assert readers == {producer.pid}
    assert checked == [(producer.pid, i) for i in checks(1, 2)]
    assert result["stats"] == {"cache_bytes": CACHE_NEEDS, "cache_samples": SAMPLES,
                               "cache_epochs": 2, "cache_off": None}
    assert said(result["log"], "INFO", f"decoded cache: {SAMPLES} samples, {CACHE_NEEDS} "
                "bytes: epoch 1 on is served from it")


def test_the_samples_drop_last_leaves_out_are_loaded_once(procs, name, tmp_path):
    """drop_last=True: each epoch draws 96 of the 100 samples; the 4 that epoch 1 left
    out are loaded once at the start of epoch 2, in the producer, and epoch 2 on is
    served from the cache, those 4 samples' rows right when later epochs draw them."""
    loads = tmp_path / "loads"
    producer, consumer = start(procs, name, loads, cache_bytes=CACHE_NEEDS, drop_last=True)
    epochs = consumer_epochs(consumer, 3)
    result = producer.result(timeout=120)
    drawn = SAMPLES // BATCH * BATCH
    for ids in epochs:
        assert len(ids) == len(set(ids)) == drawn and set(ids) <= set(range(SAMPLES))
    left_out = set(range(SAMPLES)) - set(epochs[0])
    assert left_out & set(epochs[1] + epochs[2]), "no later epoch drew the samples topped up"
    assert result["yielded"] == epochs and result["bad"] == 0
    read = loads_of(loads)
    topped_up, checked = read[drawn:SAMPLES], read[SAMPLES:]
    assert sorted(i for _, i in read[:SAMPLES]) == list(range(SAMPLES))
    assert {i for _, i in topped_up} == left_out and {p for p, _ in read} == {producer.pid}
    assert [i for _, i in checked] == checks(1, 2)
    assert result["stats"]["cache_epochs"] == 2
    assert said(result["log"], "INFO", f"the {SAMPLES - drawn} samples the sampler had not "
                "drawn by epoch 1 were loaded once")


def test_a_top_up_that_cannot_load_drops_the_cache(procs, name, tmp_path):
    """A dataset that loads only in its loader workers (per-worker file handles, say):
    the drop_last tail loaded alone in the producer raises, the cache is dropped with a
    warning saying why, and every epoch runs the loader; the producer does not fail."""
    loads = tmp_path / "loads"
    producer, consumer = start(procs, name, loads, cache_bytes=CACHE_NEEDS, drop_last=True,
                               workers=2, workers_only=True)
    epochs = consumer_epochs(consumer, 3)
    result = producer.result(timeout=120)
    drawn = SAMPLES // BATCH * BATCH
    assert all(len(ids) == len(set(ids)) == drawn for ids in epochs)
    assert result["stats"]["cache_epochs"] == 0 and result["stats"]["cache_bytes"] == 0
    assert len(loads_of(loads)) == 3 * drawn
    assert said(result["log"], "WARNING", "loaded alone in the producer, raised RuntimeError")


def test_a_budget_one_byte_short_caches_nothing(procs, name, tmp_path):
    """cache_bytes one byte under what the dataset needs: a warning names the bytes,
    nothing is allocated, every epoch reads every sample; the epochs' orders are those
    of a run with the cache (the cache draws from torch's RNG what the loader would).
    The short budget comes from TENSORSOCKET_CACHE_BYTES."""
    orders = {}
    for budget in (CACHE_NEEDS, CACHE_NEEDS - 1):
        loads = tmp_path / f"loads-{budget}"
        short = budget < CACHE_NEEDS
        producer, consumer = start(
            procs, f"{name}-{budget}", loads, cache_bytes="env" if short else budget,
            env={"TENSORSOCKET_CACHE_BYTES": str(budget)} if short else None)
        orders[budget] = consumer_epochs(consumer, 3)
        result = producer.result(timeout=120)
        whole(orders[budget])
        reads = len(loads_of(loads))
        if budget == CACHE_NEEDS:
            assert reads == SAMPLES + len(checks(1, 2))
            assert result["stats"]["cache_epochs"] == 2
            continue
        assert reads == 3 * SAMPLES
        off = result["stats"].pop("cache_off")
        assert result["stats"] == {"cache_bytes": 0, "cache_samples": 0, "cache_epochs": 0}
        warned = said(result["log"], "WARNING", "decoded cache off")
        assert len(warned) == 1, result["log"]
        for fact in (f"{SAMPLES} samples", f"need {CACHE_NEEDS} bytes",
                     f"cache_bytes={budget} (from TENSORSOCKET_CACHE_BYTES)"):
            assert fact in warned[0] and fact in off
    assert orders[CACHE_NEEDS] == orders[CACHE_NEEDS - 1]


def test_rows_of_another_shape_drop_the_cache(procs, name, tmp_path):
    """A batch whose rows have another shape than the first batch's: the cache is freed
    with a warning saying why, and the loader runs every epoch."""
    loads = tmp_path / "loads"
    # The dataset loads wider rows from its 33rd load on: batch 2 of epoch 0 on.
    producer, consumer = start(procs, name, loads, cache_bytes=10 * CACHE_NEEDS,
                               wide_from=2 * BATCH)
    epochs = consumer_epochs(consumer, 3)
    result = producer.result(timeout=120)
    whole(epochs)
    assert len(loads_of(loads)) == 3 * SAMPLES
    dropped = said(result["log"], "WARNING", "decoded cache dropped")
    assert len(dropped) == 1 and "rows of shape (3, 4, 8)" in dropped[0], result["log"]
    assert result["stats"]["cache_bytes"] == 0 and result["stats"]["cache_epochs"] == 0


def test_a_cached_epoch_cut_short_ends_with_its_marker(name):
    """A producer loop that breaks out of an epoch served from the cache: the consumer's
    epoch ends there (the end marker), and the next epoch is whole, from the cache."""
    data = TensorDataset(torch.arange(64) * 3)
    producer = TensorProducer(DataLoader(data, batch_size=8, shuffle=True), name=name,
                              cache_bytes=64 * 8)
    counts: list[int] = []

    def produce() -> None:
        for epoch in range(3):
            for index, _ in enumerate(producer):
                if epoch == 1 and index == 1:
                    break
            counts.append(producer.stats()["cache_epochs"])
        producer.join(30)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    consumer = TensorConsumer(name=name, timeout=30)
    epochs = [[int(v) for b in consumer for v in b[0]] for _ in range(3)]
    consumer.close()
    thread.join(30)
    assert sorted(epochs[0]) == sorted(epochs[2]) == list(range(0, 192, 3))
    assert len(epochs[1]) == 16 and set(epochs[1]) < set(epochs[0])
    assert counts == [0, 1, 2]


def test_what_cannot_be_cached_is_said_once_at_info(name, caplog):
    """A loader the cache cannot serve (a list of batches) with cache_bytes set: one INFO
    line says why, and the epochs run as before; the consumer (the job that asked) is
    told why at its epoch's end, by a TensorSocketWarning (issue 36); a DataLoader with
    cache_bytes=0 (the default): nothing about the cache is logged."""
    caplog.set_level(logging.INFO, logger="tensorsocket")
    data = TensorDataset(torch.arange(32))
    for loader, budget in (([torch.arange(i * 4, i * 4 + 4) for i in range(8)], 1 << 20),
                           (DataLoader(data, batch_size=4, shuffle=True), 0)):
        caplog.clear()
        producer = TensorProducer(loader, name=name, cache_bytes=budget)
        producing = Producing(producer)
        producing.start()
        consumer = TensorConsumer(name=name, timeout=30)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [int(i) for b in consumer for i in (b if budget else b[0])]
        told = [str(w.message) for w in caught if issubclass(w.category, TensorSocketWarning)]
        assert told == ([f"the shared producer's decoded-sample cache (cache_bytes={budget}) "
                         "is not made: the data loader is a 'list', not a torch DataLoader"]
                        if budget else []), told
        producing.join(30)
        assert producing.error is None and sorted(got) == list(range(32))
        consumer.close()  # (before join: its epoch ended at len(), maybe before the marker)
        producer.join(30)
        lines = [r.getMessage() for r in caplog.records if "decoded cache" in r.getMessage()]
        if budget:
            assert lines == ["decoded cache off: the data loader is a 'list', not a torch "
                             "DataLoader; every epoch runs the loader"], lines
            assert [r.levelname for r in caplog.records
                    if "decoded cache" in r.getMessage()] == ["INFO"]
        else:
            assert lines == []


def _holders(name: str) -> tuple[list[str], list[str]]:
    """(fd links, mapping lines) of this user's processes naming the memfd of the cache
    of producer `name` (other tests may run caches of their own meanwhile)."""
    memfd = f"{MEMFD}-{name}"
    fds, maps = [], []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid != os.getuid():
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if memfd in target:
                    fds.append(f"{pid}: {target}")
            with open(f"/proc/{pid}/maps") as f:
                maps += [f"{pid}: {line.strip()}" for line in f if memfd in line]
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return fds, maps


def test_nothing_is_left_after_the_producer_is_killed(procs, name, tmp_path):
    """SIGKILL of the producer after epoch 2 was served from the cache: no process holds
    the memfd any more (no descriptor, no mapping), /dev/shm never had it, and the
    consumer raises instead of waiting."""
    producer, consumer = start(procs, name, tmp_path / "loads", cache_bytes=CACHE_NEEDS,
                               epochs=3, hold=1)
    for epoch in range(2):
        assert consumer.read_json(timeout=120)["epoch"] == epoch
    assert producer.read_json(timeout=60)["epoch"] == 0
    assert producer.read_json(timeout=60)["stats"]["cache_epochs"] == 1
    assert said(producer.read_json(timeout=60)["log"], "INFO", "epoch 1 on is served")
    _, maps = _holders(name)  # the check sees the cache while it lives
    assert [m for m in maps if m.startswith(f"{producer.pid}:")], maps
    os.kill(producer.pid, signal.SIGKILL)
    producer.wait(timeout=30)
    fds, maps = _holders(name)
    assert fds == [] and maps == [], (fds, maps)
    assert [e for e in os.listdir("/dev/shm") if "tensorsocket-cache" in e] == []
    raised = consumer.result(timeout=60)
    assert raised.get("raised") in ("ProducerGone", "ProducerFailed"), raised


@pytest.mark.parametrize("value", [-1, "lots", 1.5])
def test_a_bad_cache_bytes_is_refused(value):
    """A bad argument raises ValueError naming cache_bytes (and, for a bad value of the
    right type, the variable it shares the rule with)."""
    with pytest.raises(ValueError, match="cache_bytes") as raised:
        TensorProducer([torch.zeros(2)], name="cache-check", cache_bytes=value)
    if not isinstance(raised.value, ArgumentTypeError):
        assert "TENSORSOCKET_CACHE_BYTES" in str(raised.value)


@pytest.mark.parametrize("text", ["-5", "lots", "1.5G"])
def test_a_bad_cache_bytes_variable_is_refused(text):
    with pytest.raises(ValueError, match="TENSORSOCKET_CACHE_BYTES"):
        config.get("cache_bytes", environ={"TENSORSOCKET_CACHE_BYTES": text})


def test_cache_bytes_takes_sizes_and_is_off_by_default():
    env = "TENSORSOCKET_CACHE_BYTES"
    assert config.get("cache_bytes", environ={}) == 0
    assert config.get("cache_bytes", environ={env: "64M"}) == 64 << 20
    assert config.get("cache_bytes", environ={env: "off"}) == 0
    assert config.get("cache_bytes", 4096, environ={env: "64M"}) == 4096


def test_rows_of_mixed_dtypes_are_aligned_and_come_back_whole():
    """Leaves of 1-, 8- and 2-byte items, a row of 3 bytes among them: each leaf's block
    begins aligned to its items, the memfd holds exactly N x the bytes of a sample, the
    rows written come back in the order asked, and close() unmaps the memfd."""
    import numpy as np

    from tensorsocket.data.dtypes import numpy_leaf
    from tensorsocket.producer.sample_cache import CacheLayout, SampleCache

    n = 7
    def batch(ids):  # noqa: E306 - rows that say their sample id, in three dtypes
        ids = np.asarray(ids)
        return [numpy_leaf(a) for a in ((ids[:, None] + np.arange(3)).astype(np.uint8),
                                        ids * 1000, ids[:, None].astype(np.float16))]

    layout = CacheLayout.of_batch(n, batch([0, 1]))
    assert layout.nbytes == n * (3 + 8 + 2)
    assert [leaf.dtype for leaf in layout.leaves] == [np.uint8, np.int64, np.float16]
    assert all(leaf.offset % leaf.dtype.itemsize == 0 for leaf in layout.leaves)
    cache = SampleCache("unit", layout)
    maps = Path("/proc/self/maps")
    try:
        assert f"{MEMFD}-unit" in maps.read_text()
        for ids in ([3, 0, 6], [1, 5], [2, 4, 4]):
            assert cache.fits(batch(ids), np.asarray(ids)) is None
            cache.fill(batch(ids), np.asarray(ids))
        assert cache.complete and cache.filled == n
        order = np.array([6, 2, 2, 0, 5])
        for (got, dl), (want, want_dl) in zip(cache.gather(order), batch(order)):
            assert dl == want_dl and np.array_equal(got, want)
        assert "rows of shape (4,)" in cache.fits([(np.zeros((3, 4), np.uint8), batch([0])[0][1])]
                                            + batch([0, 1, 2])[1:], np.arange(3))
    finally:
        cache.close()
    assert f"{MEMFD}-unit" not in maps.read_text()


def _transformed_epochs(name: str, cache_bytes: int, workers: int) -> tuple[list, int]:
    """Three epochs of a shuffling DataLoader read by a consumer with a random per-sample
    transform (seed 5): per epoch, sample id -> the mean of its transformed row; and the
    epochs the producer served from its cache."""
    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> tuple:
            return torch.full((3, 8, 8), i, dtype=torch.uint8), i

    def jitter(x: torch.Tensor) -> torch.Tensor:
        return (x.float() + torch.rand(())).flip(-1)

    # The producer runs in a thread of this process: its loader draws from a generator of
    # its own, not torch's global one, which the consumer's transform (run here, at
    # next(), with transform_workers=0) seeds and draws from at the same time.
    producer = TensorProducer(DataLoader(Rows(), batch_size=8, shuffle=True,
                                         generator=torch.Generator().manual_seed(0)),
                              name=name, cache_bytes=cache_bytes)

    def produce() -> None:
        for _ in range(3):
            for _ in producer:
                pass
        producer.join(30)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    consumer = TensorConsumer(name=name, timeout=30, transform=jitter, seed=5,
                              transform_workers=workers)
    epochs = [{int(i): float(x.mean()) for xs, ids in consumer for x, i in zip(xs, ids)}
              for _ in range(3)]
    consumer.close()
    thread.join(30)
    return epochs, producer.stats()["cache_epochs"]


def test_a_jobs_transform_gives_the_same_samples_from_the_cache(name):
    """A consumer's per-sample transform (transform=, seeded by job seed, epoch and sample
    id) gives the same output for every sample of every epoch whether the producer served
    epochs 2 and 3 from its cache or ran its loader, with transform workers too."""
    cached, served = _transformed_epochs(f"{name}-a", 64 * (192 + 8), 0)
    loaded, none = _transformed_epochs(f"{name}-b", 0, 0)
    cached_workers, served_too = _transformed_epochs(f"{name}-c", 64 * (192 + 8), 2)
    assert (served, none, served_too) == (2, 0, 2)
    assert all(sorted(e) == list(range(64)) for e in cached)
    assert cached == loaded == cached_workers


class _Crop:
    """A transform named like a random one (RandomResizedCrop)."""

    def __call__(self, x):
        return x


_Crop.__name__ = _Crop.__qualname__ = "RandomResizedCrop"


class _Compose:
    def __init__(self, transforms):
        self.transforms = transforms


class _Crops(torch.utils.data.Dataset):
    transform = _Compose([_Crop()])

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2,), i)


def test_a_dataset_with_random_transforms_is_not_cached(name, caplog):
    """A dataset whose transform draws random numbers (a RandomResizedCrop left in the
    shared part) is not cached: every epoch would replay the first's crops."""
    from tensorsocket.producer.sample_cache import _not_cacheable

    loader = DataLoader(_Crops(), batch_size=4)
    leaves = [(np.zeros((4, 2), np.int64), None)]
    why = _not_cacheable(loader, leaves, np.arange(4), None)
    assert why is not None and "RandomResizedCrop" in why and "transform=" in why


def _producing(producer, epochs: int, stats: list) -> threading.Thread:
    """A thread (not started) that runs `epochs` epochs of `producer`, appending its
    stats() after each to `stats`, then joins its consumers."""

    def produce() -> None:
        for _ in range(epochs):
            for _ in producer:
                pass
            stats.append(producer.stats())
        producer.join(30)

    return threading.Thread(target=produce, daemon=True)


# -- the machine's room (issue 35, item 5) --------------------------------------------------

GIB, MIB = 1 << 30, 1 << 20
UNLIMITED_V1 = "9223372036854771712"  # what cgroup v1 writes for no limit


def _tree(root: Path, files: dict[str, str]) -> str:
    """Files under `root` (path -> text); returns the root as memory_room() takes it."""
    for path, text in files.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return str(root)


MEMINFO = (f"MemTotal:       {16 * GIB >> 10} kB\nMemFree:  1 kB\n"
           f"MemAvailable:   {10 * GIB >> 10} kB\n")


def test_the_room_is_the_tightest_of_the_machine_and_each_cgroup_level(tmp_path):
    """Fake /proc and cgroup files: the machine (MemAvailable of MemTotal), a cgroup v2
    whose own level has no limit ("max") but whose parent has one (its working set: usage
    less inactive_file), and a v1 memory hierarchy mounted at a container's cgroup (mount
    root /batch, under a mount point with a space in its name) whose mount-root level is
    the tightest; each bound's usable bytes are what is left less 1/8 of its total less
    64 MiB, and a refusal names the tightest."""
    from tensorsocket.producer.memory_room import margin, memory_room

    root = _tree(tmp_path, {
        "/proc/meminfo": MEMINFO,
        "/proc/self/cgroup": "4:memory:/batch/b1\n1:cpu:/x\n0::/jobs/job1\n",
        "/proc/self/mountinfo":
            "30 23 0:26 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw\n"
            "35 31 0:32 /batch /sys/fs/cgroup/my\\040memory rw - cgroup cgroup rw,memory\n"
            "36 31 0:33 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n",
        "/sys/fs/cgroup/unified/memory.stat": "inactive_file 0\n",  # the root: no limit
        "/sys/fs/cgroup/unified/jobs/memory.max": f"{2 * GIB}\n",
        "/sys/fs/cgroup/unified/jobs/memory.current": f"{3 * GIB // 2}\n",
        "/sys/fs/cgroup/unified/jobs/memory.stat": f"anon 1\ninactive_file {GIB}\n",
        "/sys/fs/cgroup/unified/jobs/job1/memory.max": "max\n",
        "/sys/fs/cgroup/unified/jobs/job1/memory.current": f"{100 * MIB}\n",
        "/sys/fs/cgroup/my memory/memory.limit_in_bytes": f"{4 * GIB}\n",
        "/sys/fs/cgroup/my memory/memory.usage_in_bytes": f"{3 * GIB + GIB // 2}\n",
        "/sys/fs/cgroup/my memory/memory.stat": "inactive_file 5\ntotal_inactive_file 0\n",
        "/sys/fs/cgroup/my memory/b1/memory.limit_in_bytes": UNLIMITED_V1,
        "/sys/fs/cgroup/my memory/b1/memory.usage_in_bytes": f"{GIB}\n",
    })
    room = memory_room(root)
    found = {(b.what.split(" (")[0], b.total, b.left) for b in room.bounds}
    assert found == {("the machine", 16 * GIB, 10 * GIB),
                     ("memory cgroup v2 /jobs", 2 * GIB, 2 * GIB - GIB // 2),
                     ("memory cgroup v1 /batch", 4 * GIB, GIB // 2)}
    assert margin(2 * GIB) == 2 * GIB // 8 + 64 * MIB
    assert room.tightest.what.startswith("memory cgroup v1 /batch")
    assert room.usable == 0  # 512 MiB left, less a margin of 576 MiB
    assert room.refusal(0) is None
    refusal = room.refusal(1)
    assert refusal is not None and "memory cgroup v1 /batch (memory.limit_in_bytes" in refusal
    assert "512.0 MiB of 4.0 GiB left" in refusal

    # The v1 hierarchy without its limits: the v2 parent is the tightest.
    (tmp_path / "sys/fs/cgroup/my memory/memory.limit_in_bytes").write_text(UNLIMITED_V1)
    room = memory_room(root)
    assert room.usable == 2 * GIB - GIB // 2 - margin(2 * GIB)
    assert room.refusal(room.usable) is None and room.refusal(room.usable + 1) is not None


def test_the_room_without_cgroups_or_without_anything(tmp_path):
    """No cgroup files (and no mountinfo): the machine's bound alone; nothing readable at
    all: no bound, and nothing is refused (the allocation then says what it says)."""
    from tensorsocket.producer.memory_room import margin, memory_room

    room = memory_room(_tree(tmp_path / "a", {"/proc/meminfo": MEMINFO}))
    assert room.usable == 10 * GIB - margin(16 * GIB)
    assert "the machine (MemAvailable of MemTotal)" in room.refusal(10 * GIB)
    empty = memory_room(str(tmp_path / "b"))
    assert empty.bounds == () and empty.usable is None and empty.refusal(1 << 50) is None
    # A cgroup outside the one mounted here (a process moved out of a container's cgroup
    # namespace sees "/../..."): the limit of what is mounted is what is read.
    outside = memory_room(_tree(tmp_path / "c", {
        "/proc/self/cgroup": "0::/../other\n",
        "/proc/self/mountinfo": "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        "/sys/fs/cgroup/memory.max": f"{GIB}", "/sys/fs/cgroup/memory.current": "0",
        "/sys/fs/other/memory.max": "1", "/sys/fs/other/memory.current": "0"}))
    assert [(b.what, b.left) for b in outside.bounds] == [
        ("memory cgroup v2 / (memory.max less the working set)", GIB)]


def test_a_cache_over_the_room_is_refused_with_a_warning(name, tmp_path, monkeypatch, caplog):
    """The room (fake files: 1 GiB of MemAvailable, a cgroup of 300 MiB) leaves less than
    the cache needs, though cache_bytes= allows it: nothing is allocated (no memfd is
    made), a WARNING and a TensorSocketWarning say "could not be allocated" and name the
    cgroup, stats' cache_off says it, and the epochs run the loader."""
    from tensorsocket import TensorSocketWarning
    from tensorsocket.producer import memory_room as room_module
    from tensorsocket.producer import sample_cache

    root = _tree(tmp_path, {
        "/proc/meminfo": f"MemTotal: {2 * GIB >> 10} kB\nMemAvailable: {GIB >> 10} kB\n",
        "/proc/self/cgroup": "0::/job\n",
        "/proc/self/mountinfo": "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        "/sys/fs/cgroup/job/memory.max": f"{300 * MIB}",
        "/sys/fs/cgroup/job/memory.current": f"{200 * MIB}",
    })
    monkeypatch.setattr(sample_cache, "memory_room", lambda: room_module.memory_room(root))
    caplog.set_level(logging.INFO, logger="tensorsocket")
    data = TensorDataset(torch.zeros(64, 1 << 20, dtype=torch.uint8))  # 64 MiB to cache
    producer = TensorProducer(DataLoader(data, batch_size=8, shuffle=True), name=name,
                              cache_bytes=1 << 40)
    stats: list[dict] = []
    thread = _producing(producer, 2, stats)
    with pytest.warns(TensorSocketWarning, match="could not be allocated") as caught:
        thread.start()
        consumer = TensorConsumer(name=name, timeout=30)
        counts = [sum(len(b[0]) for b in consumer) for _ in range(2)]
        consumer.close()
        thread.join(30)
    assert counts == [64, 64]
    assert f"{MEMFD}-{name}" not in Path("/proc/self/maps").read_text()
    off = stats[-1]["cache_off"]
    assert stats[-1]["cache_bytes"] == 0 and stats[-1]["cache_epochs"] == 0
    assert off.startswith("not made: 67108864 bytes for 64 samples could not be allocated")
    assert "memory cgroup v2 /job (memory.max less the working set): 100.0 MiB of 300.0 " \
        "MiB left" in off
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"
              and "decoded cache off" in r.getMessage()]
    assert warned == [f"decoded cache off: {off.removeprefix('not made: ')}"]
    assert [str(w.message) for w in caught if "decoded cache" in str(w.message)] == warned


def test_a_sample_cache_over_the_room_maps_nothing():
    """SampleCache refuses (OSError ENOMEM, naming the bound) before it makes the memfd."""
    import errno

    from tensorsocket.data.dtypes import numpy_leaf
    from tensorsocket.producer.memory_room import Bound, MemoryRoom
    from tensorsocket.producer.sample_cache import CacheLayout, SampleCache

    layout = CacheLayout.of_batch(1000, [numpy_leaf(np.zeros((2, 1024), np.uint8))])
    assert layout.nbytes == 1000 * 1024
    # A bound of 1 GiB keeps 128 MiB + 64 MiB free: it leaves room for the cache or not.
    room = MemoryRoom((Bound("a test bound", GIB, 192 * MIB + layout.nbytes - 1),))
    with pytest.raises(OSError) as raised:
        SampleCache("over", layout, room)
    assert raised.value.errno == errno.ENOMEM and "a test bound" in str(raised.value)
    assert f"{MEMFD}-over" not in Path("/proc/self/maps").read_text()
    room = MemoryRoom((Bound("a test bound", GIB, 192 * MIB + layout.nbytes),))
    SampleCache("fits", layout, room).close()


# -- what the cache checks (issue 35, item 6) -------------------------------------------------


class _Wrapper(torch.utils.data.Dataset):
    """A library's wrapper: holds the dataset it wraps as .dataset, and a transform of its
    own that draws nothing."""

    def __init__(self, dataset):
        self.dataset, self.transform = dataset, (lambda x: x)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.dataset[i]


@pytest.mark.parametrize("wrap", ["subset", "concat", "wrapper of a subset"])
def test_a_random_transform_behind_a_wrapper_is_seen(wrap):
    """A dataset whose transform is named as random, behind a Subset, in a ConcatDataset,
    behind a wrapper (with a transform of its own) of a Subset: not cached, the reason
    names the transform, as the fingerprint describes it (the same look-through)."""
    import json

    from torch.utils.data import ConcatDataset, Subset

    from tensorsocket.loader.fingerprint import describe
    from tensorsocket.producer.sample_cache import _not_cacheable

    dataset = {"subset": lambda: Subset(_Crops(), range(6)),
               "concat": lambda: ConcatDataset([_Crops(), _Crops()]),
               "wrapper of a subset": lambda: _Wrapper(Subset(_Crops(), range(6)))}[wrap]()
    loader = DataLoader(dataset, batch_size=4)
    leaves = [(np.zeros((4, 2), np.int64), None)]
    why = _not_cacheable(loader, leaves, np.arange(4), None)
    assert why is not None and "RandomResizedCrop" in why and "transform=" in why
    if wrap != "wrapper of a subset":  # (the wrapper's own transform is the one described)
        assert "_Compose" in json.loads(describe(loader))["transform"]


def test_a_dataset_that_cannot_be_checked_drops_the_cache(procs, name, tmp_path):
    """A dataset that loads only in its loader workers, drop_last=False (epoch 1 fills the
    cache whole): the check before epoch 2 cannot load a sample in the producer, so the
    cache is dropped with a warning saying why, and every epoch runs the loader."""
    loads = tmp_path / "loads"
    producer, consumer = start(procs, name, loads, cache_bytes=CACHE_NEEDS, workers=2,
                               workers_only=True)
    epochs = consumer_epochs(consumer, 3)
    result = producer.result(timeout=120)
    whole(epochs)
    assert (result["stats"]["cache_epochs"], result["stats"]["cache_bytes"]) == (0, 0)
    assert result["stats"]["cache_off"].startswith("dropped: sample ")
    assert len(loads_of(loads)) == 3 * SAMPLES
    assert said(result["log"], "WARNING", "loaded alone in the producer to check the cache, "
                "raised RuntimeError")


def test_a_collate_fn_that_mixes_a_batch_drops_the_cache(name):
    """A collate_fn whose rows depend on the batch (each row less the batch's mean): the
    rows cached in epoch 1 are not what sample i gives alone, the check drops the cache
    before epoch 2, and epoch 2's batches are the loader's (each row's batch mean 0)."""
    def centred(samples):
        rows = torch.stack([s[0] for s in samples]).float()
        return rows - rows.mean(dim=0), torch.stack([s[1] for s in samples])

    data = TensorDataset(torch.arange(32 * 4).reshape(32, 4), torch.arange(32))
    producer = TensorProducer(DataLoader(data, batch_size=8, shuffle=True, collate_fn=centred),
                              name=name, cache_bytes=1 << 20)
    stats: list[dict] = []
    thread = _producing(producer, 2, stats)
    with pytest.warns(Warning, match="is not what the cache holds"):
        thread.start()
        consumer = TensorConsumer(name=name, timeout=30)
        means = [[float(rows.mean(dim=0).abs().max()) for rows, _ in consumer]
                 for _ in range(2)]
        consumer.close()
        thread.join(30)
    assert [len(m) for m in means] == [4, 4] and max(means[0] + means[1]) < 1e-4
    assert stats[0]["cache_samples"] == 32 and stats[1]["cache_epochs"] == 0
    assert stats[1]["cache_off"].startswith("dropped: sample ")
