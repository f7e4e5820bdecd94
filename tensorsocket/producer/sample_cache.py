"""The producer's decoded-sample cache (``cache_bytes=``): a torch DataLoader's samples
kept in memory during the first epoch, and every later epoch built from them.

What a DataLoader over a map-style dataset yields is, per batch, the collated rows of
the samples its batch sampler drew. Where every tensor of a batch holds one row per
sample (dim 0 = the batch's sample ids), the rows of sample i are the same in every
epoch (where the decode before collation is deterministic, as it must be: random
augmentation belongs in the consumers' ``transform=``; checked, see below), so once
every sample was seen, an epoch is only a new order: its batch sampler's index lists,
each made into a batch by gathering rows.

- ``SampleCache``: the rows, one array per leaf of the batch, (N, *row shape), in one
  memfd mapped shared, and the bitmap of the samples filled.
- ``CachedEpochs``: the publisher's hook. At the first batch it decides (``offer``):
  the cache is made if the loader is such a DataLoader, no transform of its dataset (or
  of a dataset it wraps: Subset, ConcatDataset, see loader.fingerprint.dataset_layers)
  is named as a random one, and the whole dataset fits ``cache_bytes`` and what the
  machine and the producer's memory cgroups have left (memory_room: shmem is not
  refused, the OOM killer comes instead); else one line in the log says why not (a
  WARNING and a TensorSocketWarning when cache_bytes or the machine is too small). Each
  batch the loader yields fills rows; a batch of another structure drops the cache. At
  the start of an epoch (``start``) it says whether the epoch is served from the cache,
  and ``batches`` gives that epoch's batches. Before each epoch served from the cache,
  CHECKED_SAMPLES samples drawn at random are loaded again in the producer and compared
  with the bytes cached: a dataset that draws random numbers in ``__getitem__`` (which
  no name tells) gives other bytes, and the cache is dropped (a WARNING and a
  TensorSocketWarning) before it replays anything. stats()' ``cache_off`` says why
  there is no cache.

The memory is an anonymous memfd (``memfd:tensorsocket-cache-<name>``): it has no name
in /dev/shm or anywhere else and its descriptor is closed once it is mapped, so only the
mapping holds it, and the mapping is not inherited by processes forked later
(MADV_DONTFORK: the loader's workers of a later epoch). The kernel frees it when the
producer unmaps it or ends, however it ends (SIGKILL too): nothing is left to clean.
"""

from __future__ import annotations

import errno
import functools
import logging
import mmap
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from ..augment.split import random_steps
from ..data.dtypes import DLType, torch_leaf
from ..data.structure import TORCH, Decoder, flatten
from ..errors import TensorSocketError, TensorSocketWarning
from ..loader.fingerprint import dataset_transforms
from .memory_room import MemoryRoom, memory_room
from .settings import ProducerSettings

log = logging.getLogger("tensorsocket")

CHECKED_SAMPLES = 8  # samples loaded again at the start of each cached epoch (_check)

@dataclass(frozen=True)
class LeafRows:
    """Where one leaf's rows lie in the cache: dtype (the leaf array's), DLPack dtype,
    shape of one sample's row, and offset of row 0 in the memfd."""

    dtype: np.dtype
    dl: DLType
    row_shape: tuple[int, ...]
    offset: int

    @property
    def row_items(self) -> int:
        """Items in one sample's row."""
        return int(np.prod(self.row_shape, dtype=np.int64))

    @property
    def row_bytes(self) -> int:
        """Bytes of one sample's row."""
        return self.dtype.itemsize * self.row_items

    def matches(self, array: np.ndarray, dl: DLType) -> bool:
        """Whether a batch's leaf is rows of this kind."""
        return array.dtype == self.dtype and dl == self.dl and \
            tuple(array.shape[1:]) == self.row_shape


@dataclass(frozen=True)
class CacheLayout:
    """The rows of the N samples of a dataset, one block per leaf, the blocks of larger
    items first: each block begins aligned to its items (sizes are powers of two), with
    no padding between them, so the memfd holds N x the bytes of one sample's rows."""

    samples: int
    leaves: tuple[LeafRows, ...]

    @classmethod
    def of_batch(cls, samples: int, leaves: list) -> "CacheLayout":
        """The layout for `samples` samples whose batch leaves are like `leaves` (arrays
        of one row per sample, with their DLPack dtypes)."""
        rows: list[LeafRows | None] = [None] * len(leaves)
        offset = 0
        for k in sorted(range(len(leaves)), key=lambda k: -leaves[k][0].dtype.itemsize):
            array, dl = leaves[k]
            leaf = rows[k] = LeafRows(array.dtype, dl, tuple(array.shape[1:]), offset)
            offset += samples * leaf.row_bytes
        return cls(samples, tuple(leaf for leaf in rows if leaf is not None))

    @property
    def sample_bytes(self) -> int:
        """Bytes of one sample's rows, all leaves."""
        return sum(leaf.row_bytes for leaf in self.leaves)

    @property
    def nbytes(self) -> int:
        """Bytes of the memfd: every sample's rows."""
        return self.samples * self.sample_bytes


class SampleCache:
    """The rows of every sample, one array per leaf, in one shared memfd mapping (see the
    module docstring), and which samples are filled."""

    def __init__(self, name: str, layout: CacheLayout, room: MemoryRoom | None = None) -> None:
        """Allocate the memory (all of it, now: OSError if the machine cannot give it,
        rather than SIGBUS at a later write). OSError (ENOMEM) before anything is
        allocated if it is more than `room` (default: memory_room(), the machine's and
        this process's cgroups') leaves: shmem is not refused when it does not fit,
        posix_fallocate charges it page by page until the OOM killer SIGKILLs."""
        self.layout = layout
        self.nbytes = layout.nbytes
        refusal = (room if room is not None else memory_room()).refusal(self.nbytes)
        if refusal is not None:
            raise OSError(errno.ENOMEM, refusal)
        fd = os.memfd_create(f"tensorsocket-cache-{name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.nbytes)
            os.posix_fallocate(fd, 0, self.nbytes)
            self._map = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping holds the memory from now on
        if hasattr(mmap, "MADV_DONTFORK"):
            self._map.madvise(mmap.MADV_DONTFORK)
        n = layout.samples
        self._rows: list[np.ndarray] | None = [
            np.frombuffer(self._map, leaf.dtype, n * leaf.row_items, leaf.offset).reshape(
                (n, *leaf.row_shape)) for leaf in layout.leaves]
        self._filled = np.zeros(n, dtype=bool)
        self.filled = 0  # samples whose rows are in

    def missing(self) -> np.ndarray:
        """The ids of the samples not in yet."""
        return np.flatnonzero(~self._filled)

    @property
    def complete(self) -> bool:
        """Whether every sample's rows are in."""
        return self.filled == self.layout.samples

    def fits(self, leaves: list, ids: np.ndarray) -> str | None:
        """Why a batch's leaves cannot go in (None if they can): another number of
        leaves, a leaf of other rows, rows not one per id, ids outside the dataset."""
        layout = self.layout
        if len(leaves) != len(layout.leaves):
            return f"a batch holds {len(leaves)} tensors, the first held {len(layout.leaves)}"
        for k, ((array, dl), leaf) in enumerate(zip(leaves, layout.leaves)):
            if array.ndim == 0 or array.shape[0] != ids.size:
                return f"tensor {k} of a batch of {ids.size} samples has shape {array.shape}"
            if not leaf.matches(array, dl):
                return (f"tensor {k} of a batch has rows of shape {tuple(array.shape[1:])} "
                        f"and dtype {array.dtype}, the first batch's had {leaf.row_shape} "
                        f"and {leaf.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= layout.samples):
            return f"a batch holds sample ids outside 0..{layout.samples - 1}"
        return None

    def fill(self, leaves: list, ids: np.ndarray) -> None:
        """Copy a batch's rows (checked by fits()) into the rows of its sample ids."""
        for rows, (array, _) in zip(self._live_rows(), leaves):
            rows[ids] = array
        new = np.unique(ids[~self._filled[ids]])
        self._filled[new] = True
        self.filled += int(new.size)

    def gather(self, ids: np.ndarray) -> list[tuple[np.ndarray, DLType]]:
        """The leaves of the batch of samples `ids` (new arrays), with their DLPack
        dtypes, as the loader's batch of those samples would have them."""
        return [(np.take(rows, ids, axis=0), leaf.dl)
                for rows, leaf in zip(self._live_rows(), self.layout.leaves)]

    def _live_rows(self) -> list[np.ndarray]:
        """The row arrays; TensorSocketError once the cache was closed."""
        if self._rows is None:
            raise TensorSocketError("the producer's decoded-sample cache was closed")
        return self._rows

    def close(self) -> None:
        """Unmap the memory (the kernel frees it). An array of it still in use elsewhere
        (another thread gathering) keeps the mapping until it is collected."""
        if self._rows is None:
            return
        self._rows = None
        try:
            self._map.close()
        except BufferError:  # a view of it lives on: the mapping goes with the last one
            pass


@dataclass(frozen=True)
class CachedBatch:
    """A batch of a cached epoch: its structure blob, leaves, sample ids, and the batch
    as the producer's loop receives it."""

    structure: bytes
    leaves: list
    ids: np.ndarray
    batch: Any


class CachedEpochs:
    """The cache's part in the publisher's epochs (see the module docstring):
    ``offer`` each batch the loader yields, ``start`` each epoch, ``batches`` of an
    epoch served from the cache; ``stats`` for TensorProducer.stats()."""

    def __init__(self, settings: ProducerSettings) -> None:
        """Nothing decided: that happens at the first batch."""
        self._settings = settings
        self._cache: SampleCache | None = None
        self._decided = False  # the first batch was offered
        self._source: Any = None  # the loader of the epoch running
        self._dataset: Any = None  # the cached loader's dataset and collate_fn
        self._collate: Any = None
        self._structure = b""  # the structure blob of the cached batches
        self._batch_samples = 0  # samples in the first batch
        self._build: Any = None  # the batch from its leaves (Decoder.compile)
        self._kinds: list[int] = []
        self._said: set[str] = set()  # INFO lines said once
        self.epochs_served = 0
        self.off: str | None = None  # why there is no cache (not made, or dropped)
        self._noted: tuple = ()  # what note_in() last wrote in the ring's header

    # -- the loader's epochs -------------------------------------------------------------

    @property
    def reads_leaves(self) -> bool:
        """Whether offer() may read the next batch's leaves (then they must be arrays)."""
        return not self._decided or (self._cache is not None and not self._cache.complete)

    def offer(self, structure: bytes, leaves: list, ids: np.ndarray | None,
              epoch: int) -> None:
        """A batch the loader yielded in `epoch` (its structure blob, leaves as
        Encoder.flatten gives them, sample ids): decide at the first, then fill."""
        if not self._decided:
            self._decided = True
            self._decide(structure, leaves, ids, epoch)
        cache = self._cache
        if cache is None or cache.complete or not self._cached_loader(self._source):
            return
        if ids is None:
            why: str | None = "the loader's sample ids are no longer known"
        elif structure != self._structure:
            why = "a batch has another structure than the first"
        else:
            why = cache.fits(leaves, ids)
        if why is not None or ids is None:
            self._drop(f"{why} (epoch {epoch})")
            return
        cache.fill(leaves, ids)

    def _decide(self, structure: bytes, leaves: list, ids: np.ndarray | None,
                epoch: int) -> None:
        """At the first batch: make the cache if it applies and fits, else say why not."""
        budget = self._settings.cache_bytes
        if not budget:
            return
        why = _not_cacheable(self._source, leaves, ids, self._settings.pack_fn)
        if why is not None or ids is None:
            self.off = f"not made: {why}"
            log.info("decoded cache off: %s; every epoch runs the loader", why)
            return
        layout = CacheLayout.of_batch(len(self._source.dataset), leaves)
        shown = self._settings.show("cache_bytes", budget)
        if layout.nbytes > budget:
            self._warn_off(
                f"the {layout.samples} samples of the dataset need {layout.nbytes} bytes "
                f"({layout.sample_bytes} per sample), over {shown}: every epoch runs the "
                "loader. Set cache_bytes= (or TENSORSOCKET_CACHE_BYTES) to "
                f"{layout.nbytes} or more to cache them")
            return
        try:
            self._cache = SampleCache(self._settings.endpoint.name, layout)
        except OSError as e:
            self._warn_off(f"{layout.nbytes} bytes for {layout.samples} samples could not "
                           f"be allocated ({e.strerror or e}): every epoch runs the loader")
            return
        self._dataset, self._collate = self._source.dataset, self._source.collate_fn
        self._structure = structure
        self._batch_samples = int(ids.size)
        self._build, self._kinds = Decoder().compile(structure)
        log.info("decoded cache: %d bytes for the %d samples of the dataset (%s); epoch "
                 "%d fills it", layout.nbytes, layout.samples, shown, epoch)

    def _warn_off(self, why: str) -> None:
        """No cache, for a reason the user must hear of (see _tell)."""
        self._tell(f"not made: {why}", f"decoded cache off: {why}")

    def _tell(self, off: str, message: str) -> None:
        """There is no cache now, for a reason the user must hear of: stats()' cache_off
        says `off`, and `message` goes to the log as a WARNING and, here in the producer's
        process, as a TensorSocketWarning."""
        self.off = off
        log.warning("%s", message)
        warnings.warn(message, TensorSocketWarning, stacklevel=3)

    def _drop(self, why: str) -> None:
        """Free the cache: the loader runs every epoch from now on (said as _warn_off
        says it)."""
        cache, self._cache = self._cache, None
        if cache is not None:
            cache.close()
            self._tell(f"dropped: {why}", f"decoded cache dropped ({cache.nbytes} bytes "
                       f"freed): {why}; every epoch runs the loader from now on")

    # -- epochs served from the cache ----------------------------------------------------

    def start(self, source: Any, epoch: int) -> bool:
        """Epoch `epoch` of `source` begins: whether it is served from the cache."""
        self._source = source
        if self._cache is None:
            return False
        if not self._cached_loader(source):
            self._say_once("other", "decoded cache: the loader of epoch %d has another "
                           "dataset or collate_fn than the one cached: it runs the loader",
                           epoch)
            return False
        if not self._cache.complete:
            self._top_up(source, epoch)
        cache: SampleCache | None = self._cache
        if cache is not None and not cache.complete:
            # A whole epoch ran since the cache was made: a sampler that leaves more than a
            # batch's worth out each epoch (a subset, sampling with replacement) may never
            # complete it, and filling it would cost a copy per sample for nothing.
            self._drop(f"epoch {epoch - 1} left {cache.missing().size} of "
                       f"{cache.layout.samples} samples undrawn (its sampler does not "
                       "cover the dataset each epoch)")
            cache = None
        if cache is None or not cache.complete:
            if cache is not None:
                self._say_once("incomplete", "decoded cache: %d of %d samples in it at the "
                               "start of epoch %d: epochs run the loader until every sample "
                               "was seen", cache.filled, cache.layout.samples, epoch)
            return False
        why = self._check(source, epoch)
        if why is not None:
            self._drop(why)
            return False
        self._say_once("serving", "decoded cache: %d samples, %d bytes: epoch %d on is "
                       "served from it", cache.layout.samples, cache.nbytes, epoch)
        self.epochs_served += 1
        return True

    def _top_up(self, source: Any, epoch: int) -> None:
        """Load the samples not drawn yet, if they are no more than a batch (the tail
        that drop_last=True leaves out of each epoch): once each, in this process, as
        the loader makes a batch of them (collate_fn([dataset[i]]))."""
        cache = self._cache
        assert cache is not None
        missing = cache.missing()
        if missing.size > self._batch_samples:
            return
        for i in missing:
            ids = np.array([i], dtype=np.int64)
            leaves, why = self._load_alone(source, int(i))
            if why is not None:
                self._drop(why)
                return
            cache.fill(leaves, ids)
        log.info("decoded cache: the %d samples the sampler had not drawn by epoch %d "
                 "were loaded once, in the producer", missing.size, epoch)

    def _check(self, source: Any, epoch: int) -> str | None:
        """Why the cache must not serve epoch `epoch` (None if it may): CHECKED_SAMPLES
        of its samples, drawn at random (a generator of its own: torch's, random's and
        NumPy's are not touched), loaded again in this process as the top-up loads, must
        be the bytes cached. A dataset whose __getitem__ draws random numbers (or a
        collate_fn that mixes the samples of a batch, or data that changes) gives other
        bytes: each cached epoch would replay the first epoch's."""
        cache = self._cache
        assert cache is not None
        for i in checked_samples(epoch, cache.layout.samples):
            leaves, why = self._load_alone(source, int(i), "to check the cache")
            if why is not None:
                return why
            cached = cache.gather(np.array([i], dtype=np.int64))
            for k, ((got, dl), (kept, kept_dl)) in enumerate(zip(leaves, cached)):
                if dl != kept_dl or np.ascontiguousarray(got).tobytes() != kept.tobytes():
                    return (f"sample {i}, loaded again in the producer at the start of "
                            f"epoch {epoch}, is not what the cache holds of it (tensor {k} "
                            "differs): the dataset's __getitem__ (or the collate_fn) gives "
                            "other bytes each time, so a cached epoch would replay the "
                            "first epoch's (random augmentation there? move it to each "
                            "job's transform=, see tensorsocket.split_transform)")
        return None

    def _load_alone(self, source: Any, i: int, purpose: str = "") -> tuple[list, str | None]:
        """(leaves, None) of sample `i` loaded in this process as the loader makes a
        batch of it (collate_fn([dataset[i]])), checked to fit the cache; ([], why) if it
        raises or does not fit."""
        cache = self._cache
        assert cache is not None
        alone = f"sample {i}, loaded alone in the producer{' ' + purpose if purpose else ''}"
        try:
            structure, leaves = flatten(source.collate_fn([source.dataset[i]]))
        except Exception as e:  # a dataset that loads only in its workers, say
            return [], f"{alone}, raised {type(e).__name__}: {e}"
        why = "its batch has another structure" if structure != self._structure else \
            cache.fits(leaves, np.array([i], dtype=np.int64))
        return (leaves, None) if why is None else ([], f"{alone}: {why}")

    def _cached_loader(self, source: Any) -> bool:
        """Whether `source` batches the samples cached: the same dataset and collate_fn,
        with a batch sampler."""
        return getattr(source, "dataset", None) is self._dataset and \
            getattr(source, "collate_fn", None) is self._collate and \
            getattr(source, "batch_sampler", None) is not None

    def batches(self, source: Any,
                order: Callable[[Any], Iterable[Any]] = iter) -> Iterator[CachedBatch]:
        """The batches of an epoch of `source` served from the cache: the index lists its
        batch sampler yields (order(batch_sampler): what it yields for the epoch, as the
        producer's EpochPlanner lists it), each one's rows gathered."""
        cache = self._cache
        assert cache is not None
        _draw_as_an_iterator_would(source)
        for indices in order(source.batch_sampler):
            ids = np.asarray(indices, dtype=np.int64).reshape(-1)
            leaves = cache.gather(ids)
            yield CachedBatch(self._structure, leaves, ids, self._batch_of(leaves))

    def _batch_of(self, leaves: list) -> Any:
        """The batch of these leaves with the loader's structure (torch tensors where it
        had tensors, numpy arrays where it had arrays)."""
        values = [_torch_view(array, dl) if kind == TORCH else array
                  for (array, dl), kind in zip(leaves, self._kinds)]
        return self._build(values)

    def _say_once(self, key: str, message: str, *args: Any) -> None:
        """An INFO line, said once per producer for `key`."""
        if key not in self._said:
            self._said.add(key)
            log.info(message, *args)

    # -- the rest --------------------------------------------------------------------

    def stats(self) -> dict:
        """cache_bytes (allocated now), cache_samples (filled), cache_epochs (served),
        cache_off (why there is no cache: "not made: ..." or "dropped: ..."; None while
        there is one, before the first batch, or with cache_bytes=0)."""
        cache = self._cache
        return {"cache_bytes": cache.nbytes if cache is not None else 0,
                "cache_samples": cache.filled if cache is not None else 0,
                "cache_epochs": self.epochs_served,
                "cache_off": self.off}

    def note_in(self, ring: Any) -> None:
        """Note the cache in the ring's header, where `tensorsocket status` and the
        consumers (the training processes that asked for it) read it, if it changed since
        the last note; nothing when no cache was asked for (cache_bytes=0)."""
        budget = self._settings.cache_bytes or 0
        if not budget:
            return
        cache = self._cache
        now = (cache.nbytes if cache is not None else 0, cache.filled if cache is not None
               else 0, self.epochs_served, self.off or "")
        if now != self._noted:
            self._noted = now
            bytes_, samples, epochs, off = now
            # (the header holds UTF-8: a path's lone surrogates become "?")
            ring.note_cache(budget, bytes_, samples, epochs,
                            off.encode("utf-8", "replace").decode("utf-8"))

    def close(self) -> None:
        """Free the cache (the producer closes)."""
        cache, self._cache = self._cache, None
        if cache is not None:
            cache.close()


def checked_samples(epoch: int, samples: int) -> np.ndarray:
    """The ids of the samples CachedEpochs._check loads again before epoch `epoch` of a
    dataset of `samples` samples, in order: CHECKED_SAMPLES of them (all, if fewer),
    drawn by a generator of their own seeded by both numbers."""
    chosen = np.random.default_rng([epoch, samples]).choice(
        samples, min(CHECKED_SAMPLES, samples), replace=False)
    return np.sort(chosen)


def _not_cacheable(source: Any, leaves: list, ids: np.ndarray | None,
                   pack_fn: Any) -> str | None:
    """Why the batches of `source` cannot be cached (None if they can), given its first
    batch's leaves and sample ids."""
    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(source, DataLoader):
        return f"the data loader is a {type(source).__qualname__!r}, not a torch DataLoader"
    if isinstance(source.dataset, IterableDataset) or not hasattr(source.dataset, "__len__"):
        return "the DataLoader's dataset is not a map-style dataset with len()"
    if source.batch_sampler is None:
        return "the DataLoader does not batch samples itself (batch_size=None)"
    if pack_fn is not None:
        return "pack_fn= changes the loader's batches"
    drawn = [step for _, value in dataset_transforms(source.dataset)
             for step in random_steps(value)]
    if drawn:
        return (f"the dataset's transform draws random numbers ({', '.join(drawn)}): every "
                "epoch would repeat the first's draws; move them to each job's transform= "
                "(tensorsocket.split_transform)")
    if ids is None:
        return "the sample ids of the loader's batches are not known"
    if not leaves:
        return "the batches hold no tensors"
    for k, (array, _) in enumerate(leaves):
        if array.ndim == 0 or array.shape[0] != ids.size:
            return (f"tensor {k} of the first batch (shape {tuple(array.shape)}) is not one "
                    f"row per sample of its {ids.size}")
    if ids.size and (ids.min() < 0 or ids.max() >= len(source.dataset)):
        return "the sampler draws indices outside the dataset's len()"
    if CacheLayout.of_batch(1, leaves).nbytes == 0:
        return "the samples hold no bytes"
    return None


def _draw_as_an_iterator_would(loader: Any) -> None:
    """Draw from torch's RNG (or the loader's generator) what iter(loader) would: a
    DataLoader's iterator draws its workers' base seed when it is made (except a later
    epoch's of persistent workers, which reuses the first iterator). An epoch served
    from the cache thus leaves the RNG where the loader would: the samplers of the
    following epochs draw the orders they would have drawn without the cache."""
    if loader.persistent_workers and loader.num_workers > 0 and \
            getattr(loader, "_iterator", None) is not None:
        return
    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)


def _torch_view(array: np.ndarray, dl: DLType) -> torch.Tensor:
    """The torch tensor of a leaf array (viewed as bfloat16 where the array carries one)."""
    tensor = torch.from_numpy(array)
    dtype = _torch_dtypes().get(dl, tensor.dtype)
    return tensor if dtype == tensor.dtype else tensor.view(dtype)


@functools.cache
def _torch_dtypes() -> dict[DLType, torch.dtype]:
    """DLPack dtype -> torch dtype, as tensorsocket.data.dtypes.torch_leaf maps them."""
    found: dict[DLType, torch.dtype] = {}
    with warnings.catch_warnings():  # (torch warns making empty complex32, quint8 ...)
        warnings.simplefilter("ignore")
        for dtype in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
            try:
                found[torch_leaf(torch.empty(0, dtype=dtype))[1]] = dtype
            except (TypeError, RuntimeError):  # not carried by tensorsocket
                continue
    return found
