"""A job's own DataLoader over the store of decoded samples: what
``share(loader, name, store=True)`` returns.

``store_loader`` rebuilds the user's DataLoader with the user's own arguments (its
sampler or batch sampler, batch size, drop_last, collate_fn, workers, worker_init_fn,
generator, pin_memory, persistent_workers, prefetch_factor, timeout), reading a
StoreDataset (store.dataset) of the user's dataset, its indices through an EpochOrder:

- EpochOrder draws the epoch's order from the user's sampler when the loader first asks
  for an index, as the user's loader draws it then (torch's samplers draw their
  randomness at that moment: RandomSampler one seed of the global generator, or its own
  generator, and its permutation; WeightedRandomSampler all its draws), so the job's
  indices are those its own DataLoader would give with the same seed, checked index for
  index by the tests. (A custom sampler that draws from the global generator lazily, item
  by item, would see the training's draws in between in the user's loader and not here.)
- With the order it tells the store what the job needs this epoch (the store evicts what
  no job needs soon), has the dataset check a few stored samples by decoding them again,
  and records where the job is (``tensorsocket status``); each index goes to the dataset
  with its epoch, which seeds the job's own part of the transform.

The StoreLoader takes DataLoader's own arguments and is made with the user's (its own
sampler object, or batch sampler); its ``sampler``, ``batch_sampler``, ``batch_size`` and
``drop_last`` are those, and only its ``_index_sampler`` (what the DataLoader's iterators
draw from) is the EpochOrder over them: a framework that rebuilds the loader with
another sampler gets a StoreLoader over the same store. ``dataset`` is the StoreDataset,
whose attributes read through to the user's dataset.
``close()`` (or the dataset's collection, or the interpreter's exit) leaves the store;
the last job to leave removes it.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from ..augment.seeding import callers_generators_kept, sample_seed
from ..control.endpoints import runtime_dir
from ..errors import TensorSocketError
from ..loader.fingerprint import dataset_identity
from ..producer.memory_room import memory_room
from ..ring import Store
from .codec import arena_block, block_bytes, encode
from .dataset import StoreDataset
from .loader_checks import check_loader, public_data
from .parts import DatasetParts, split_dataset
from .segment import join, leave, sweep

log = logging.getLogger("tensorsocket")

MIN_BUDGET = 1 << 20  # the smallest store budget taken


class EpochOrder(Sampler):
    """The job's sampler (or batch sampler) with each epoch's order drawn whole at its
    first index, told to the store, and handed out as (index, epoch) (module docstring).
    Other attributes (``set_epoch``, ``sampler`` ...) are the user's sampler's."""

    def __init__(self, inner: Any, batched: bool, dataset: StoreDataset) -> None:
        self.inner = inner
        self.batched = batched
        self._dataset = dataset
        self.epoch = -1  # of the order drawn last

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner")
        if name.startswith("_") or inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __iter__(self) -> Iterator[Any]:
        return self._epoch()

    def _epoch(self) -> Iterator[Any]:
        """One epoch's indices, with their epoch."""
        order = list(self.inner)
        self.epoch += 1
        epoch = self.epoch
        flat = list(itertools.chain.from_iterable(order)) if self.batched else order
        try:
            indices = np.asarray(flat, dtype=np.int64).reshape(-1)
        except (TypeError, ValueError):
            raise TypeError(
                f"the loader's sampler yields {type(flat[0]).__name__} items, not dataset "
                "indices: store=True needs a sampler of integer indices (a map-style dataset)"
            ) from None
        dataset = self._dataset
        store = dataset.job_store()
        if store is not None:
            base = dataset.parts.base_indices(indices)
            store.need(store.job, base)
            dataset.check(epoch, base)
            store.progress(epoch, 0, len(order))
        for k, item in enumerate(order):
            if store is not None and not store.closed:
                if k % 16 == 0 and store.dropped is not None:
                    dataset.warn_dropped()
                store.progress(epoch, k, len(order))
            yield [(i, epoch) for i in item] if self.batched else (item, epoch)
        if store is not None and not store.closed:
            store.progress(epoch, len(order), len(order))


class StoreLoader(DataLoader):
    """A DataLoader over a StoreDataset: it takes DataLoader's own arguments and makes its
    sampler and batch sampler from them as DataLoader does (its ``sampler``,
    ``batch_sampler``, ``batch_size`` and ``drop_last`` are those), and reads its indices
    through an EpochOrder over them (module docstring). A framework that rebuilds a
    DataLoader from its arguments (Lightning putting in a DistributedSampler) gets a
    StoreLoader again."""

    def __init__(self, dataset: StoreDataset, batch_size: int | None = 1,
                 shuffle: bool | None = None, sampler: Any = None, batch_sampler: Any = None,
                 num_workers: int = 0, collate_fn: Any = None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn: Any = None,
                 multiprocessing_context: Any = None, generator: Any = None, *,
                 prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True) -> None:
        if not isinstance(dataset, StoreDataset):
            raise TypeError(f"StoreLoader reads a StoreDataset, got {type(dataset).__name__}: "
                            "make one with share(DataLoader(...), name=..., store=True)")
        extra = {"in_order": in_order} if _TAKES_IN_ORDER else {}
        # (By keyword: a framework that records what DataLoader.__init__ got, Lightning
        # patching it when StoreLoader was not imported yet, rebuilds the loader with
        # these names, its sampler in place of this one.)
        super().__init__(dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                         batch_sampler=batch_sampler, num_workers=num_workers,
                         collate_fn=collate_fn, pin_memory=pin_memory, drop_last=drop_last,
                         timeout=timeout, worker_init_fn=worker_init_fn,
                         multiprocessing_context=multiprocessing_context, generator=generator,
                         prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                         pin_memory_device=pin_memory_device, **extra)
        batched = self.batch_sampler is not None
        # (object.__setattr__: not a set a framework records and replays on the loaders it
        # rebuilds, as Lightning replays the sets made after DataLoader.__init__.)
        object.__setattr__(self, "_order", EpochOrder(
            self.batch_sampler if batched else self.sampler, batched, dataset))

    @property
    def _index_sampler(self) -> Any:
        """What the DataLoader's iterators draw indices from: the EpochOrder."""
        return self._order

    @property
    def order(self) -> EpochOrder:
        """The EpochOrder of this loader (its epoch, the order it drew last)."""
        return self._order

    @property
    def store(self) -> Store | None:
        """The job's handle on the store (None when the job decodes its own samples)."""
        return self.dataset.job_store()

    @property
    def store_key(self) -> str:
        """The store's key (its segment's name ends in it)."""
        return self.dataset.key

    @property
    def job_seed(self) -> int:
        """The seed of the job's own part of the transform."""
        return self.dataset.job_seed

    def close(self) -> None:
        """Stop the loader's persistent workers and leave the store now (the last job to
        leave removes it); iterating afterwards decodes every sample in the job's
        processes."""
        iterator = self.__dict__.get("_iterator")
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self.dataset.leave()

    def store_info(self) -> dict[str, Any]:
        """The store's figures (Store.info) and this job's: ``epoch`` (the last drawn),
        ``job`` (its slot); {} once closed, or when the job decodes its own samples."""
        store = self.store
        if store is None:
            return {}
        return {**store.info(), "epoch": self._order.epoch, "job": store.job}


_TAKES_IN_ORDER = "in_order" in inspect.signature(DataLoader.__init__).parameters


class _Then:
    """One transform, then another (the dataset's own part, then share()'s transform=)."""

    def __init__(self, first: Callable[[Any], Any], then: Callable[[Any], Any]) -> None:
        self.first, self.then = first, then

    def __call__(self, x: Any) -> Any:
        return self.then(self.first(x))

    def __repr__(self) -> str:
        return f"{self.first!r} then {self.then!r}"


def store_key(name: str, parts: DatasetParts, probe: list) -> str:
    """The store's key: a digest of the runtime directory, the share() name, the base
    dataset's identity with its shared transforms, and the blocks of a few of its samples
    (_probe). Two jobs share a store only if all agree: jobs share a store where they
    would share a ring, in one runtime directory (whose flock orders the store's joins and
    leaves: store.segment); a transform that no name tells apart (two closures of one
    function), or in-memory data of one class and length, gives other samples and so
    another store."""
    digest = hashlib.sha256(f"{runtime_dir()}\0{name}\0"
                            f"{dataset_identity(parts.base, parts.transforms)}\0"
                            .encode("utf-8", "replace"))
    for _, _, block in probe:
        digest.update(block)
    return digest.hexdigest()[:16]


def _budget(parts: DatasetParts, asked: int, first: tuple[int, list]) -> int:
    """The store's budget: `asked` (0: the default), no more than every sample needs
    (estimated from the base dataset's first sample, `first`: its encoded bytes and
    pieces) and than the machine can give (ValueError naming cache_bytes when the asked
    budget is more than that)."""
    whole = len(parts.base) * arena_block(first[0])
    room = memory_room()
    if asked:
        refusal = room.refusal(asked)
        if refusal is not None:
            raise ValueError(f"cache_bytes={asked} for the decoded-sample store is {refusal}: "
                             "give a smaller cache_bytes (the store evicts what does not fit)")
        return min(asked, 2 * whole)
    bound = room.tightest
    usable = bound.usable // 2 if bound is not None else whole
    budget = max(MIN_BUDGET, min(whole, usable))
    log.info("decoded-sample store: budget %d bytes (the %d samples take about %d; set "
             "cache_bytes= to choose)", budget, len(parts.base), whole)
    return budget


def dataset_key(name: str, dataset: Any) -> str:
    """The key of the store that share(DataLoader(dataset), name=name, store=True) uses
    (store_key over _probe's samples)."""
    parts = split_dataset(dataset)
    return store_key(name, parts, _probe(parts))


def _probe(parts: DatasetParts) -> list[tuple[int, tuple[int, list] | None, bytes]]:
    """The base dataset's first and last samples (one if it has one), decoded here with
    the caller's generators kept: (base index, its encoded bytes and pieces or None if it
    cannot be stored, its block as bytes). They go into the store's key, size its budget,
    and go into the store once it is joined."""
    n = len(parts.base)
    out = []
    for index in sorted({0, n - 1}):
        with callers_generators_kept():
            sample = parts.base[index]
        try:
            nbytes, pieces = encode(sample)
        except TypeError:
            out.append((index, None, repr(type(sample)).encode()))
            continue
        out.append((index, (nbytes, pieces), block_bytes(nbytes, pieces)))
    return out


def _job_seed(loader: DataLoader) -> int:
    """The seed of the job's own transforms: from the next draw of the generator the
    loader's sampler draws from (the loader's, else torch's global one), peeked at without
    taking it, so the job's indices stay those of its own DataLoader."""
    peek = torch.Generator()
    source = loader.generator
    peek.set_state(source.get_state() if source is not None else torch.get_rng_state())
    drawn = int(torch.empty((), dtype=torch.int64).random_(generator=peek).item())
    return sample_seed(drawn, 0x73746F7265, 0)


def store_loader(loader: Any, name: str, cache_bytes: int = 0, *,
                 transform: Callable[[Any], Any] | None = None,
                 seed: int | None = None) -> StoreLoader:
    """The job's own DataLoader over the store of `name` (module docstring); `transform`:
    the job's own part, after the dataset's (if its transform was split); `seed`: of the
    job's own part (default: from the generator its sampler draws from, peeked at).
    TypeError / ValueError naming the knob for a loader the store cannot serve."""
    check_loader(loader)
    try:
        samples = len(loader.dataset)
    except TypeError:
        raise ValueError("store=True needs a dataset with a length") from None
    if samples == 0:
        raise ValueError("store=True: the loader's dataset is empty")
    parts = split_dataset(loader.dataset)
    if transform is not None:
        parts.suffix = transform if parts.suffix is None else _Then(parts.suffix, transform)
    probe = _probe(parts)
    key = store_key(name, parts, probe)
    sweep(keep=key)
    first = probe[0][1]
    try:
        joined = join(key, len(parts.base),
                      lambda: _budget(parts, int(cache_bytes or 0), first or (1 << 12, [])))
    except OSError as e:
        raise TensorSocketError(f"the decoded-sample store of {name!r} could not be made: "
                                f"{e}; give a smaller cache_bytes") from e
    store = joined.store
    try:
        if not store.closed:
            for index, encoded, _ in probe:  # (decoded already: into the store)
                if encoded is not None:
                    store.put(index, *encoded)
            log.info("decoded-sample store %s: %s, budget %d bytes, job slot %s", store.name,
                     "made" if joined.created else "joined", joined.budget, store.job)
        job_seed = _job_seed(loader) if seed is None else int(seed)
        dataset = StoreDataset(loader.dataset, parts, key, job_seed, store)
    except BaseException:  # (Ctrl-C, say): the job leaves the store it joined
        if not store.closed:
            leave(key, store)
        raise
    made = StoreLoader(dataset, **_loader_arguments(loader))
    for attribute, value in public_data(loader, made).items():  # (self.vocab, say)
        setattr(made, attribute, value)
    return made


def _loader_arguments(loader: DataLoader) -> dict[str, Any]:
    """The arguments that make `loader` again, less its dataset: its own sampler object
    (and batch size and drop_last) or its own batch sampler, and everything else."""
    args: dict[str, Any] = dict(
        num_workers=loader.num_workers, collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
        persistent_workers=loader.persistent_workers, pin_memory_device=loader.pin_memory_device)
    if loader.num_workers > 0:
        args["prefetch_factor"] = loader.prefetch_factor
    if _TAKES_IN_ORDER:
        args["in_order"] = getattr(loader, "in_order", True)
    if loader.batch_size is None and loader.batch_sampler is not None:
        args.update(batch_size=None, batch_sampler=loader.batch_sampler)  # the user's own
    else:
        args.update(batch_size=loader.batch_size, sampler=loader.sampler,
                    drop_last=loader.drop_last)
    return args
