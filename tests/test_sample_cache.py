"""The producer's decoded-sample cache (cache_bytes=, tensorsocket/producer/sample_cache.py):
a real producer process over a DataLoader whose dataset logs every sample it loads (a
file of "pid index" lines), and a real consumer process; the assertions are on the ids
and contents the consumer received, the loads, and the producer's stats and log."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import Producing
from tensorsocket import TensorConsumer, TensorProducer, config
from tensorsocket.config import ArgumentTypeError

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


def said(log: list, level: str, text: str) -> list[str]:
    """The log lines of `level` holding `text`."""
    return [m for lv, m in log if lv == level and text in m]


@pytest.mark.parametrize("workers", [0, 2])
def test_epochs_after_the_first_come_from_the_cache(procs, name, tmp_path, workers):
    """cache_bytes large enough: every sample once per epoch by id, the dataset read N
    times in all (epoch 1 only), epoch 2 in the sampler's new order, every batch's rows
    the dataset's samples of its ids (in the consumer and in the producer's loop)."""
    loads = tmp_path / "loads"
    producer, consumer = start(procs, name, loads, cache_bytes=10 * CACHE_NEEDS,
                               workers=workers)
    epochs = consumer_epochs(consumer, 3)
    result = producer.result(timeout=120)
    whole(epochs)
    assert result["yielded"] == epochs and result["bad"] == 0
    assert epochs[1] != epochs[0] and epochs[2] != epochs[1], "the epochs were not reshuffled"
    read = loads_of(loads)
    assert sorted(i for _, i in read) == list(range(SAMPLES)), "each sample read once"
    readers = {pid for pid, _ in read}
    if workers:
        assert producer.pid not in readers and len(readers) == workers
    else:
        assert readers == {producer.pid}
    assert result["stats"] == {"cache_bytes": CACHE_NEEDS, "cache_samples": SAMPLES,
                               "cache_epochs": 2}
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
    assert sorted(i for _, i in read) == list(range(SAMPLES))
    assert {i for _, i in read[drawn:]} == left_out and {p for p, _ in read} == {producer.pid}
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
            assert reads == SAMPLES and result["stats"]["cache_epochs"] == 2
            continue
        assert reads == 3 * SAMPLES
        assert result["stats"] == {"cache_bytes": 0, "cache_samples": 0, "cache_epochs": 0}
        warned = said(result["log"], "WARNING", "decoded cache off")
        assert len(warned) == 1, result["log"]
        for fact in (f"{SAMPLES} samples", f"need {CACHE_NEEDS} bytes",
                     f"cache_bytes={budget} (from TENSORSOCKET_CACHE_BYTES)"):
            assert fact in warned[0]
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
    line says why, and the epochs run as before; a DataLoader with cache_bytes=0 (the
    default): nothing about the cache is logged."""
    caplog.set_level(logging.INFO, logger="tensorsocket")
    data = TensorDataset(torch.arange(32))
    for loader, budget in (([torch.arange(i * 4, i * 4 + 4) for i in range(8)], 1 << 20),
                           (DataLoader(data, batch_size=4, shuffle=True), 0)):
        caplog.clear()
        producer = TensorProducer(loader, name=name, cache_bytes=budget)
        producing = Producing(producer)
        producing.start()
        consumer = TensorConsumer(name=name, timeout=30)
        got = [int(i) for b in consumer for i in (b if budget else b[0])]
        producing.join(30)
        assert producing.error is None and sorted(got) == list(range(32))
        producer.join(30)
        consumer.close()
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


def test_a_dataset_with_random_transforms_is_not_cached(name, caplog):
    """A dataset whose transform draws random numbers (a RandomResizedCrop left in the
    shared part) is not cached: every epoch would replay the first's crops."""
    from tensorsocket.producer.sample_cache import _not_cacheable

    class RandomResizedCrop:
        def __call__(self, x):
            return x

    class Compose:
        def __init__(self, transforms):
            self.transforms = transforms

    class Crops(torch.utils.data.Dataset):
        transform = Compose([RandomResizedCrop()])

        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.full((2,), i)

    loader = DataLoader(Crops(), batch_size=4)
    leaves = [(np.zeros((4, 2), np.int64), None)]
    why = _not_cacheable(loader, leaves, np.arange(4), None)
    assert why is not None and "RandomResizedCrop" in why and "transform=" in why
