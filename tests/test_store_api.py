"""share(..., store=True) in one process: the job's own DataLoader over the store of
decoded samples (issue 38; the jobs of real processes are tests/test_store.py's).

Each loader here is compared with the user's own DataLoader made the same way after the
same ``torch.manual_seed``: the same batches, index for index. Datasets yield their index,
so a batch says which samples it holds; every decode is counted."""

from __future__ import annotations

import abc
import collections
import contextlib
import gc
import os
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import (DataLoader, Dataset, DistributedSampler, IterableDataset,
                              Subset, WeightedRandomSampler)

import tensorsocket as ts
from tensorsocket.errors import TensorSocketWarning
from tensorsocket.ring import Store
from tensorsocket.store.dataset import CHECKED_SAMPLES
from tensorsocket.store.codec import SampleDecoder, encode, encoded_bytes
from tensorsocket.store.loader import dataset_key
from tensorsocket.store.segment import segment_name, store_keys

Point = collections.namedtuple("Point", ["x", "y"])


class Numbers(Dataset):
    """n samples; sample i is (a uint8 image filled with i % 251, i). Decodes counted (in
    this process: the loaders here have no workers unless a test says so)."""

    def __init__(self, n: int = 64, shape: tuple = (3, 16, 16)) -> None:
        self.n, self.shape, self.decodes = n, shape, 0
        self.classes = ["even", "odd"]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.decodes += 1
        return torch.full(self.shape, i % 251, dtype=torch.uint8), i


def noise(x):
    """A job's random transform: uniform noise drawn from torch's generator."""
    return x.float() + torch.rand(x.shape)


@pytest.fixture(autouse=True)
def private_runtime(tmp_path, monkeypatch):
    """A runtime directory of the test's own; no store this test's process joined left in
    /dev/shm (other tests' stores, of other xdist workers, are theirs to check)."""
    from tensorsocket.store import loader as store_loader_module

    monkeypatch.setenv("TENSORSOCKET_RUNTIME_DIR", str(tmp_path / "run"))
    joined: set[str] = set()
    real_join = store_loader_module.join

    def recording_join(key, *args, **kwargs):
        joined.add(key)
        return real_join(key, *args, **kwargs)

    monkeypatch.setattr(store_loader_module, "join", recording_join)
    yield
    gc.collect()  # (a loader a test did not close leaves when collected)
    left = joined & set(store_keys())
    for key in left:
        os.unlink(f"/dev/shm{segment_name(key)}")
    assert not left, f"stores left in /dev/shm: {left}"


def ids(loader, epochs: int = 1) -> list[list[int]]:
    """The sample ids of each batch of `epochs` epochs."""
    return [batch[1].tolist() for _ in range(epochs) for batch in loader]


def test_codec_round_trip():
    """A sample of any structure a batch may have comes back as it went in: tensors of
    each dtype (0-d and empty too), numpy arrays and scalars, plain values, namedtuples,
    dicts; its tensors are writable views of the block."""
    decoder = SampleDecoder()
    samples = [
        (torch.arange(6, dtype=torch.int16).view(2, 3), 7, "label", None, 1.5, True),
        {"x": torch.randn(4)[::2], "mask": torch.tensor([True, False]), "n": np.int64(3),
         "a": np.arange(5, dtype=np.float32), "b": b"raw"},
        Point(torch.tensor(2.5, dtype=torch.bfloat16), [torch.zeros(0, 3), np.float16(1)]),
        torch.tensor(3 + 4j, dtype=torch.complex64),
    ]
    for sample in samples:
        block = bytearray(encoded_bytes(sample))
        back = decoder.decode(block)
        assert type(back) is type(sample) or isinstance(sample, Point)
        flat_in, flat_out = _flat(sample), _flat(back)
        assert len(flat_in) == len(flat_out)
        for a, b in zip(flat_in, flat_out):
            if isinstance(a, torch.Tensor):
                assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
            elif isinstance(a, (np.ndarray, np.generic)):
                assert type(a) is type(b) and np.array_equal(a, b) and a.dtype == b.dtype
            else:
                assert a == b and type(a) is type(b)
    back = decoder.decode(bytearray(encoded_bytes(samples[0])))
    back[0][0, 0] = 99  # writable, and private
    nbytes, pieces = encode(samples[0])
    assert nbytes % 64 == 0 and pieces[0][0] == 0


def _flat(obj):
    if isinstance(obj, dict):
        return [v for k in obj for v in _flat(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [v for item in obj for v in _flat(item)]
    return [obj]


def test_codec_refuses_what_no_batch_holds():
    """A sample with an object no batch can carry is refused with the place named."""
    with pytest.raises(TypeError, match=r"batch\[1\]"):
        encode((torch.zeros(1), object()))


def test_same_batches_as_its_own_loader_and_one_decode_per_sample():
    """Shuffled by the global generator: the same ids as the user's DataLoader, epoch by
    epoch; the first epoch decodes each sample once, the second none (hits)."""
    torch.manual_seed(7)
    want = ids(DataLoader(Numbers(), batch_size=5, shuffle=True), 2)
    ds = Numbers()
    torch.manual_seed(7)
    loader = ts.share(DataLoader(ds, batch_size=5, shuffle=True), name="same", store=True)
    try:
        first = ids(loader)
        # Each sample once (the first and the last at share(): they went into the key and
        # the store), and the check at the epoch's start decodes again some of what the
        # store holds then (those two).
        assert 64 <= ds.decodes <= 64 + 2
        second = ids(loader)
        assert first + second == want
        assert ds.decodes <= 64 + 2 + CHECKED_SAMPLES  # the second epoch's check only
        info = loader.store_info()
        assert info["commits"] == 64 and info["stored"] == 64 and not info["dropped"]
        assert loader.batch_size == 5 and loader.drop_last is False and len(loader) == 13
        assert isinstance(loader.sampler, torch.utils.data.RandomSampler)
        assert loader.dataset.classes == ["even", "odd"]  # read through
        assert len(loader.dataset) == 64
    finally:
        loader.close()
    assert loader.store_info() == {}


def test_two_jobs_on_subsets_share_what_they_have_in_common():
    """A job on a Subset and a job with a WeightedRandomSampler (with replacement) on one
    dataset share one store: the second decodes only what the first had not."""
    base = Numbers(100)
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(5)
    half = list(range(0, 100, 2))
    make_a = lambda: DataLoader(Subset(base, half), batch_size=8, shuffle=True, generator=g)
    weights = torch.rand(100)
    make_b = lambda: DataLoader(base, batch_size=None,
                                sampler=WeightedRandomSampler(weights, 60, generator=g))
    g.manual_seed(5)
    want_a = ids(make_a())
    want_b = [int(x) for x in [s[1] for s in make_b()]]
    g.manual_seed(5)
    a = ts.share(make_a(), name="subsets", store=True)
    got_a = ids(a)
    decoded = base.decodes
    b = ts.share(make_b(), name="subsets", store=True)
    try:
        assert b.store.name == a.store.name
        got_b = [int(s[1]) for s in b]
        assert got_a == want_a and got_b == want_b
        odd = {i for i in got_b if i % 2}
        # Even ones are hits; odd ones decoded once (drawn again: a hit), B's check
        # decodes a few stored ones again, and its share() the first and the last.
        assert base.decodes - decoded <= len(odd) + CHECKED_SAMPLES + 2  # (+ the key's two)
    finally:
        b.close()
        a.close()


def test_distributed_sampler_shards_and_set_epoch():
    """Two ranks' DistributedSampler shards, set_epoch() through the loader's sampler:
    each rank's ids are its own loader's, epoch by epoch."""
    base = Numbers(50)
    for rank in (0, 1):
        def make():
            return DataLoader(base, batch_size=4,
                              sampler=DistributedSampler(base, num_replicas=2, rank=rank,
                                                         seed=3))
        own, want = make(), []
        for epoch in range(2):
            own.sampler.set_epoch(epoch)
            want += ids(own)
        loader, got = ts.share(make(), name=f"ddp{rank}", store=True), []
        try:
            for epoch in range(2):
                loader.sampler.set_epoch(epoch)
                got += ids(loader)
        finally:
            loader.close()
        assert got == want


def test_workers_persistent_and_not():
    """With workers (their own handles, a process each), persistent or not, forked or
    spawned (the dataset pickled without its handle: the worker opens its own), the ids
    are the user's loader's; the second epoch reads from the store."""
    for persistent, context in ((False, None), (True, None), (True, "spawn")):
        def make():
            return DataLoader(Numbers(40), batch_size=4, shuffle=True, num_workers=2,
                              persistent_workers=persistent, multiprocessing_context=context)
        torch.manual_seed(11)
        want = ids(make(), 2)
        torch.manual_seed(11)
        loader = ts.share(make(), name=f"workers{persistent}{context}", store=True)
        try:
            assert ids(loader, 2) == want
            info = loader.store_info()
            assert info["commits"] == 40 and info["hits"] >= 40
        finally:
            loader.close()


def test_bad_arguments_name_the_knob():
    """What the store cannot serve, and the ring's options, are refused naming them."""
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(ValueError, match="map-style"):
        ts.share(DataLoader(Stream()), name="bad", store=True)
    with pytest.raises(TypeError, match="torch DataLoader"):
        ts.share([1, 2, 3], name="bad", store=True)
    with pytest.raises(TypeError, match="batch_size="):
        ts.share(DataLoader(Numbers()), name="bad", store=True, batch_size=3)
    with pytest.raises(TypeError, match="epochs="):
        ts.share(DataLoader(Numbers()), name="bad", store=True, epochs=2)
    with pytest.raises(ValueError, match="cache_bytes"):
        ts.share(DataLoader(Numbers()), name="bad", store=True, cache_bytes=1 << 60)
    with pytest.raises(ValueError, match="empty"):
        ts.share(DataLoader(Numbers(0)), name="bad", store=True)


class BatchesDoubled(DataLoader):
    """A DataLoader subclass with behaviour of its own (a loader made again from its
    arguments would not double its batches)."""

    def __iter__(self):
        for x, y in super().__iter__():
            yield x * 2, y


class Logging:
    """A mixin with a method the training calls."""

    def log_batches(self) -> str:
        return "logged"


class LoggingLoader(DataLoader, Logging):
    """The mixin after DataLoader in the MRO."""


class ShuffledBy4(DataLoader, abc.ABC):
    """A DataLoader subclass that only sets arguments (with a private helper, a class
    constant, an attribute of its own, and markers: no behaviour)."""

    __slots__ = ()
    unit = "samples"

    def __init__(self, dataset, vocab=None):
        super().__init__(dataset, batch_size=4, sampler=self._sampler(dataset))
        self.vocab = vocab

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)

    @staticmethod
    def _sampler(dataset):
        return torch.utils.data.RandomSampler(dataset)


def test_loader_subclasses_and_shared_loaders():
    """A DataLoader subclass whose own behaviour a loader made again from its arguments
    would lose is refused, naming what it adds (its __iter__, a mixin's method); one that
    only sets arguments is made again, its batches its own, its public data (a class
    constant, what its __init__ kept) carried over. A loader over a store's dataset (one
    share() returned, or a DataLoader over its dataset) and a loader that only passes for
    a DataLoader (accelerate's prepared loaders) are refused, saying what to do."""
    with pytest.raises(TypeError, match=r"BatchesDoubled is a DataLoader subclass whose "
                                        r"own __iter__ would be lost"):
        ts.share(BatchesDoubled(Numbers(8), batch_size=4), name="sub", store=True)
    with pytest.raises(TypeError, match=r"own log_batches would be lost"):
        ts.share(LoggingLoader(Numbers(8), batch_size=4), name="sub", store=True)
    torch.manual_seed(2)
    want = ids(ShuffledBy4(Numbers(8)), 2)
    torch.manual_seed(2)
    try:  # (as in a LightningModule's train_dataloader(): Lightning patches __init__)
        from lightning.fabric.utilities.data import _replace_dunder_methods
        recorded = _replace_dunder_methods(DataLoader, "dataset")
    except ImportError:
        recorded = contextlib.nullcontext()
    with recorded:
        loader = ts.share(ShuffledBy4(Numbers(8), vocab={"a": 1}), name="sub", store=True)
    try:
        assert ids(loader, 2) == want
        assert loader.vocab == {"a": 1} and loader.unit == "samples"
        for again in (loader, DataLoader(loader.dataset),
                      DataLoader(Subset(loader.dataset, [1, 2]))):
            with pytest.raises(TypeError, match="the loader's dataset is a store's already"):
                ts.share(again, name="sub", store=True)
    finally:
        loader.close()
    accelerate = pytest.importorskip("accelerate")
    prepared = accelerate.Accelerator(cpu=True).prepare(DataLoader(Numbers(8)))
    with pytest.raises(TypeError, match=r"DataLoaderShard wraps one \(accelerate's prepare"):
        ts.share(prepared, name="sub", store=True)


def test_a_sample_that_cannot_be_stored_is_decoded_privately():
    """A dataset whose samples hold objects no batch can carry: the job warns in its log
    once and decodes every sample itself, batches as its own loader's."""
    class Odd(Numbers):
        def __getitem__(self, i):
            return {"x": torch.tensor([i]), "tag": frozenset([i])}, i

    loader = ts.share(DataLoader(Odd(10), batch_size=None, collate_fn=lambda s: s),
                      name="odd", store=True)
    try:
        got = [s[1] for s in loader]
        assert got == list(range(10)) and loader.store_info()["commits"] == 0
    finally:
        loader.close()


def test_a_dataset_that_draws_random_numbers_is_found_and_dropped():
    """Noise drawn in __getitem__: at the second epoch's start the job decodes stored
    samples again and finds other bytes; the store is dropped for every job with a
    TensorSocketWarning naming the sample, and the job goes on decoding privately, each
    sample once per epoch. (Its order is its own loader's in the first epoch only: a
    dataset that draws from the global generator in this process draws less on a hit,
    so its sampler's next draw differs: one reason such a dataset is refused.)"""
    class Noisy(Numbers):
        def __getitem__(self, i):
            x, i = super().__getitem__(i)
            return x + torch.randint(0, 2, x.shape, dtype=torch.uint8), i

    torch.manual_seed(2)
    want = ids(DataLoader(Noisy(32), batch_size=4, shuffle=True), 3)
    torch.manual_seed(2)
    loader = ts.share(DataLoader(Noisy(32), batch_size=4, shuffle=True), name="noisy",
                      store=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = ids(loader, 3)
        said = [str(w.message) for w in caught if issubclass(w.category, TensorSocketWarning)]
        assert len(said) == 1 and "not deterministic" in said[0] and "sample" in said[0], said
        assert loader.store.dropped is not None and loader.store_info()["dropped"]
        assert got[:8] == want[:8]
        for epoch in range(3):
            assert sorted(i for batch in got[8 * epoch:8 * epoch + 8] for i in batch) == \
                list(range(32))
    finally:
        loader.close()


def test_the_last_job_out_removes_the_store_and_a_dead_ones_is_swept(tmp_path):
    """Two loaders of one name: the first to close leaves the store to the second, the
    second removes it. A store whose every process died (here: made by a child that was
    SIGKILLed) is removed by the next job of any name."""
    a = ts.share(DataLoader(Numbers(8)), name="last", store=True)
    b = ts.share(DataLoader(Numbers(8)), name="last", store=True)
    key = a.store_key
    a.close()
    assert key in store_keys()
    b.close()
    assert key not in store_keys()
    assert not list(Path(os.environ["TENSORSOCKET_RUNTIME_DIR"]).glob("*.store-lock"))

    pid = os.fork()
    if pid == 0:  # a job that dies with its store attached
        try:
            loader = ts.share(DataLoader(Numbers(8)), name="dead", store=True)
            ids(loader)
            os.kill(os.getpid(), 9)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9
    # (Its store is in /dev/shm now, unless a job of another test running beside this one
    # swept it already: the same rule.)
    dead = dataset_key("dead", Numbers(8))
    c = ts.share(DataLoader(Numbers(8)), name="alive", store=True)
    try:
        assert dead not in store_keys()
    finally:
        c.close()


@pytest.mark.parametrize("size", [0, 1 << 16], ids=["no-size-yet", "no-magic-yet"])
def test_a_store_left_half_made_is_waited_for_then_replaced(size, caplog):
    """A store's segment as its maker leaves it if it dies while making it (its size not
    set yet, or its magic not stored): opening it reads "not there yet", so a job waits
    MAKING_SECONDS for the maker to finish (one whose flock is not this one's may be making
    it), then replaces it, saying so; its batches are its own loader's. Before, the job's share() raised ValueError ("no sample store"), or
    took the half-made store for another layout's and removed it at once."""
    from tensorsocket.store.segment import MAKING_SECONDS

    path = f"/dev/shm{segment_name(dataset_key('half-made', Numbers(8)))}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    with pytest.raises(FileNotFoundError, match="being made"):
        Store.open(path[len("/dev/shm"):])
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="tensorsocket"):
        loader = ts.share(DataLoader(Numbers(8), batch_size=4), name="half-made", store=True)
    try:
        assert time.monotonic() - started >= MAKING_SECONDS
        assert any("left half made" in r.getMessage() for r in caplog.records)
        assert ids(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert loader.store_info()["commits"] == 8
    finally:
        loader.close()


def test_a_forked_child_cannot_use_its_parents_handle():
    """The parent's Store object in a forked child raises, naming the fix, and closing
    the child's copy leaves the parent's job attached."""
    loader = ts.share(DataLoader(Numbers(8)), name="forked", store=True)
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                loader.dataset._store.get(0)  # (the parent's handle itself)
            except RuntimeError as e:
                code = 0 if "open the store again here" in str(e) else 2
            except BaseException:  # noqa: BLE001 - the child never returns into pytest
                code = 3
            finally:
                os.write(write, b"%d" % code)
                os._exit(0)
        assert loader.store is not None
        os.close(write)
        assert os.read(read, 8) == b"0"
        os.waitpid(pid, 0)
        os.close(read)
        assert loader.store.job is not None
        assert any(row[1] == os.getpid() for row in loader.store.jobs())
    finally:
        loader.close()


def test_store_handle_errors():
    """The binding's own refusals: a get before attach, pieces that overrun the sample,
    needs that are no int64 buffer, a closed handle."""
    name = "/tensorsocket-store-test-api-%d" % os.getpid()
    store = Store.create(name, 10, 1 << 16)
    try:
        with pytest.raises(ValueError, match="attach"):
            store.get(0)
        job = store.attach()
        with pytest.raises(ValueError, match="overruns"):
            store.put(1, 16, [(8, b"0123456789")])
        with pytest.raises(TypeError, match="64-bit"):
            store.need(job, np.arange(3, dtype=np.int32))
        with pytest.raises(ValueError, match="out of range|of a store of 10"):
            store.put(10, 16, [])
        assert store.put(1, 16, [(0, b"abc")]) == 0 and bytes(store.get(1)[:4]) == b"abc\0"
    finally:
        store.close()
        os.unlink(f"/dev/shm{name}")
    with pytest.raises(ValueError, match="closed"):
        store.get(1)


def test_the_jobs_own_transform_and_seed():
    """share(..., store=True, transform=, seed=): the job's own part runs on each sample's
    inputs after the store, seeded per (seed, epoch, sample): the same outputs on a hit as
    on a miss, other ones in another epoch; the caller's generators draw what the job's
    own DataLoader would have drawn (its base seed per epoch), no more."""
    from tensorsocket.augment.seeding import sample_seed

    loader = ts.share(DataLoader(Numbers(12), batch_size=4), name="own-part", store=True,
                      transform=noise, seed=42)
    try:
        assert loader.job_seed == 42
        state = torch.get_rng_state()
        own = DataLoader(Numbers(12), batch_size=4)
        for _ in range(2):
            list(own)
        after_own = torch.get_rng_state()
        torch.set_rng_state(state)
        epochs = [[(x.clone(), y.clone()) for x, y in loader] for _ in range(2)]
        assert torch.equal(torch.get_rng_state(), after_own)
        for epoch, batches in enumerate(epochs):
            for x, y in batches:
                for row, i in enumerate(y.tolist()):
                    torch.manual_seed(sample_seed(42, epoch, i))
                    want = torch.full((3, 16, 16), i % 251, dtype=torch.uint8).float() + \
                        torch.rand(3, 16, 16)
                    assert torch.equal(x[row], want)
        assert not torch.equal(epochs[0][0][0], epochs[1][0][0])
        assert loader.store_info()["hits"] >= 12
    finally:
        loader.close()
    with pytest.raises(TypeError, match="transform= must be callable"):
        ts.share(DataLoader(Numbers(4)), name="own-part", store=True, transform=3)


def test_a_store_whose_lock_a_stopped_job_holds(monkeypatch, caplog):
    """Joining a store whose lock a stopped process holds (its attach times out, as
    csrc/tests/test_store.c's store_stopped_holder shows of the core): the job does not
    wait for it, it decodes its own samples, its batches its own loader's; the log says
    why."""
    from tensorsocket.store import segment

    class Stopped:
        """The real store, but its lock held by a stopped process."""

        @staticmethod
        def open(name):
            raise FileNotFoundError(name)

        @staticmethod
        def create(name, samples, budget):
            real = Store.create(name, samples, budget)

            class Held:
                def __getattr__(self, attr):
                    return getattr(real, attr)

                def attach(self):
                    raise TimeoutError("the sample store's lock was held for more than "
                                       "200 ms (a process of a job that shares it is stopped?)")
            return Held()

    monkeypatch.setattr(segment, "Store", Stopped)
    torch.manual_seed(3)
    want = ids(DataLoader(Numbers(20), batch_size=3, shuffle=True), 2)
    ds = Numbers(20)
    torch.manual_seed(3)
    with caplog.at_level("WARNING", logger="tensorsocket"):
        loader = ts.share(DataLoader(ds, batch_size=3, shuffle=True), name="held", store=True)
    try:
        assert ids(loader, 2) == want
        assert ds.decodes == 40 + 2  # every sample, every epoch (and the key's two)
        assert loader.store_info() == {}
        assert any("decodes its own samples" in r.getMessage() for r in caplog.records)
    finally:
        loader.close()
        monkeypatch.undo()
        for key in store_keys():  # (the store this test made and could not use)
            segment.remove_unused(key)


def test_transforms_no_name_tells_apart_get_their_own_stores():
    """Two jobs of one name whose datasets differ only in a transform no name tells apart
    (two closures of one function): the key holds the blocks of a few of the dataset's
    samples, so each job gets a store of its own, and its own samples."""
    def scale(k):
        def f(x):
            return x * k
        return f

    class Scaled(Numbers):
        def __init__(self, k):
            super().__init__(32)
            self.transform = scale(k)

        def __getitem__(self, i):
            x, i = super().__getitem__(i)
            return self.transform(x), i

    a = ts.share(DataLoader(Scaled(1), batch_size=4), name="closures", store=True)
    b = ts.share(DataLoader(Scaled(2), batch_size=4), name="closures", store=True)
    try:
        assert a.store_key != b.store_key
        for _ in range(2):
            for (xa, ya), (xb, yb) in zip(a, b):
                assert torch.equal(xa, torch.stack([torch.full((3, 16, 16), i % 251,
                                                               dtype=torch.uint8) for i in ya]))
                assert torch.equal(xb, 2 * xa)
    finally:
        a.close()
        b.close()


class Noisy(Dataset):
    """Numbers with the job's random transform in its own __getitem__ (the user's own
    dataset, whose loader the store's run is compared with)."""

    def __init__(self, n: int, transform) -> None:
        self.inner, self.transform = Numbers(n), transform

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        x, y = self.inner[i]
        return self.transform(x), y


@pytest.mark.parametrize("workers", [0, 2])
def test_accelerate_prepare_reads_the_store_with_the_loaders_draws(workers):
    """accelerator.prepare() makes a DataLoader of its own over the store's dataset and the
    user's batch sampler (plain indices, no epoch): each sample comes from the store and
    the job's own part draws from the caller's generators, as in the user's own loader
    (before: seeded by epoch 0 every epoch, the same augmentation in each). Two epochs
    through the store equal, batch for batch and value for value, the same prepare() of
    the user's own DataLoader; each sample's draws differ from one epoch to the next."""
    accelerate = pytest.importorskip("accelerate")
    options = dict(batch_size=4, shuffle=True, num_workers=workers,
                   persistent_workers=workers > 0)

    def two_epochs(loader):
        prepared = accelerate.Accelerator(cpu=True).prepare(loader)
        return [[(x.clone(), y.clone()) for x, y in prepared] for _ in range(2)]

    torch.manual_seed(5)
    want = two_epochs(DataLoader(Noisy(24, noise), **options))
    torch.manual_seed(5)
    loader = ts.share(DataLoader(Numbers(24), **options), name=f"accelerate-{workers}",
                      store=True, transform=noise)
    try:
        got = two_epochs(loader)
        info = loader.store_info()
    finally:
        loader.close()
    assert [[y.tolist() for _, y in epoch] for epoch in got] == \
        [[y.tolist() for _, y in epoch] for epoch in want]
    for mine, theirs in zip(got, want):
        for (x, _), (w, _) in zip(mine, theirs):
            assert torch.equal(x, w)
    first = {int(i): x[row] for x, y in got[0] for row, i in enumerate(y)}
    second = {int(i): x[row] for x, y in got[1] for row, i in enumerate(y)}
    assert sorted(first) == list(range(24)) and sorted(second) == list(range(24))
    assert not any(torch.equal(first[i], second[i]) for i in range(24))
    assert info["commits"] == 24 and info["hits"] >= 24, info
