"""StoreDataset: a job's dataset read through the store of decoded samples.

The job's own DataLoader (store.loader) reads this dataset, in its own process or in its
workers. Its indices come as ``(index, epoch)`` from the job's EpochOrder; a plain index
comes from a loader the job's framework made over this dataset (accelerate's
``prepare``, which keeps the user's batch sampler) or from ``dataset[i]``. For each:

- the base dataset's sample (store.parts) is looked up in the store: a hit is a private
  copy of the stored block, decoded (store.codec);
- a miss decodes it here (the base dataset's ``__getitem__`` with the shared transform)
  and offers it to the store, which keeps it if the budget allows (evicting samples no job
  needs soon): whoever first needs a sample decodes it, no process waits for another;
- the job's own part of the transform runs on it, seeded from (the job's seed, the epoch,
  the sample): the same output whichever process runs it, in any order. For a plain
  index the epoch is not known: the own part draws from the caller's generators, as
  the user's dataset does in the user's DataLoader (in a worker, the generators the
  DataLoader seeded for it), so each epoch gets fresh draws and they are the user's
  loader's.

A dataset whose shared part is not deterministic (random draws in ``__getitem__``, data
that changes) would hand every job the first decode forever. It is found by content: a
sample decoded twice (two processes missing it together, or the job's check of a few
stored samples at each epoch start, ``check``) must give the same bytes; if not, the
store is dropped for every job (``Store.drop``: gets miss, puts find no room) and each
job warns once and decodes privately from then on.

Each process opens its own handle (a forked worker does not use its parent's) and
attaches as a process of the job: its pins are its own, its visits are the job's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import warnings
import weakref
from typing import Any

import numpy as np
from torch.utils.data import Dataset, get_worker_info

from ..augment.seeding import callers_generators_kept, sample_seed, seed_everything
from ..errors import TensorSocketWarning
from ..ring import Store, StoreOutcome, TooManyConsumers
from .codec import SampleDecoder, block_bytes, encode, encoded_bytes
from .parts import DatasetParts, apply_to_inputs
from .segment import attach_worker, leave

log = logging.getLogger("tensorsocket")

CHECKED_SAMPLES = 4  # stored samples decoded again at each epoch start (check)


class StoreDataset(Dataset):
    """The job's dataset through the store (module docstring). Attributes the user's
    dataset has (``classes``, ``samples`` ...) are read through."""

    def __init__(self, dataset: Any, parts: DatasetParts, key: str, job_seed: int,
                 store: Store) -> None:
        """Over `store`, the job's handle (attached; closed if the job could not join:
        then it decodes its own samples), which it leaves when collected (or leave())."""
        self.dataset = dataset  # the user's (its attributes are read through)
        self._parts = parts
        self._key = key
        joined = not store.closed
        self._job = store.job if joined else 0  # its needs, which this process's visits take
        self._seed = job_seed
        self._store: Store | None = store
        self._pid = os.getpid()
        self._decoder = SampleDecoder()
        self._said: set[str] = set()
        # Decode here, never use the store: the job could not join it, or its samples
        # cannot be stored.
        self._private = not joined
        self._leave = weakref.finalize(self, _leave, key, store)

    # -- a process's handle --------------------------------------------------------------

    def __getstate__(self) -> dict:
        """What goes to a spawned worker: no handle (it opens its own), no finalizer."""
        state = dict(self.__dict__)
        state["_store"], state["_pid"], state["_decoder"] = None, -1, None
        state["_leave"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._decoder = SampleDecoder()

    def __getattr__(self, name: str) -> Any:
        """The user's dataset's attribute `name` (not for private names, which would
        recurse while unpickling)."""
        inner = self.__dict__.get("dataset")
        if name.startswith("_") or inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def _handle(self) -> Store | None:
        """This process's handle (opened and attached once per process); None when there is
        none to be had (the job decodes privately)."""
        if self._pid == os.getpid():
            return self._store
        self._pid = os.getpid()
        self._store = None
        try:
            self._store = attach_worker(self._key)
        except TooManyConsumers as e:
            self._say("full", f"decoded-sample store: this process ({os.getpid()}) "
                      f"decodes on its own: {e}")
        except OSError as e:
            self._say("open", f"decoded-sample store: this process ({os.getpid()}) "
                      f"decodes on its own: the store could not be opened: {e}")
        return self._store

    # -- the job's ---------------------------------------------------------------------------

    @property
    def key(self) -> str:
        """The store's key."""
        return self._key

    @property
    def parts(self) -> DatasetParts:
        """The user's dataset taken apart (store.parts)."""
        return self._parts

    @property
    def job_seed(self) -> int:
        """The seed of the job's own part of the transform."""
        return self._seed

    def job_store(self) -> Store | None:
        """The job's handle (in its own process), None once it left or when it decodes its
        own samples."""
        store = self._store
        if store is None or store.closed or self._pid != os.getpid():
            return None
        return store

    def leave(self) -> None:
        """The job leaves the store (the last job to leave removes it); its samples are
        decoded in its processes from then on."""
        self._private = True
        if self._leave is not None:
            self._leave()

    # -- samples --------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._parts.length

    def __getitem__(self, key: Any) -> Any:
        """The sample of the job's index: (index, epoch) from EpochOrder, or a plain index
        (module docstring)."""
        index, epoch = key if isinstance(key, tuple) else (key, None)
        i = self._parts.base_index(int(index))
        sample = self._load(i)
        suffix = self._parts.suffix
        if suffix is None:
            return sample
        if epoch is None:  # (the caller's generators draw, as in the user's own loader)
            return apply_to_inputs(sample, suffix)
        # (A worker's generators are its own; the job's training keeps its randomness.)
        in_worker = get_worker_info() is not None
        with contextlib.nullcontext() if in_worker else callers_generators_kept():
            seed_everything(sample_seed(self._seed, int(epoch), i))
            return apply_to_inputs(sample, suffix)

    def _load(self, i: int) -> Any:
        """Base sample i: from the store, else decoded here (and offered to the store)."""
        store = None if self._private else self._handle()
        if store is None:
            return self._parts.base[i]
        block = store.get(i)
        if block is not None:
            store.visited(self._job, i)
            return self._decoder.decode(block)
        sample = self._parts.base[i]
        try:
            nbytes, pieces = encode(sample)
        except TypeError as e:
            self._private = True
            self._say("type", f"decoded-sample store off for this job: its dataset's "
                      f"samples cannot be stored ({e}); each sample is decoded where it is "
                      "read, as without the store")
            return sample
        outcome = store.put(i, nbytes, pieces)
        if outcome == StoreOutcome.PRESENT:
            self._compare(store, i, store.get(i, counted=False), block_bytes(nbytes, pieces),
                          "decoded by two processes")
        store.visited(self._job, i)
        return sample

    def _compare(self, store: Store, i: int, block: bytearray | None, fresh: bytes,
                 how: str) -> bool:
        """Whether `block`, the store's of sample i (None: it holds none now), is `fresh`,
        a decode's block; if not, the store is dropped for every job (and this process
        says so)."""
        if block is None or bytes(block) == fresh:
            return True
        reason = (f"sample {i} of {type(self._parts.base).__name__}, {how}, gave other "
                  "bytes than the store holds: the dataset's shared part is not "
                  "deterministic (random draws in __getitem__ or its shared transform, or "
                  "data that changed); move random steps after the deterministic ones of the "
                  "transform")
        try:
            store.drop(reason)
        except TimeoutError:  # (its lock held by a stopped process: this job stops alone)
            self._private = True
        self.warn_dropped(reason)
        return False

    # -- the job's checks (its own process) ----------------------------------------------

    def check(self, epoch: int, indices: np.ndarray) -> None:
        """At an epoch's start: decode again up to CHECKED_SAMPLES of this epoch's samples
        that the store holds, picked by a generator of its own, and compare (the caller's
        generators are kept: the decode may draw from them)."""
        store = None if self._private else self._handle()
        if store is None or store.closed or store.dropped is not None or not indices.size:
            return
        picker = random.Random(sample_seed(self._seed, epoch, 0x636865636B))
        tried = 0
        for _ in range(4 * CHECKED_SAMPLES):
            i = int(indices[picker.randrange(indices.size)])
            block = store.get(i, counted=False)
            if block is None:
                continue
            with callers_generators_kept():
                fresh = encoded_bytes(self._parts.base[i])
            if not self._compare(store, i, block, fresh, f"decoded again at the start of "
                                 f"epoch {epoch}"):
                return
            tried += 1
            if tried == CHECKED_SAMPLES:
                return

    def warn_dropped(self, reason: str | None = None) -> None:
        """Say once in this process that the store was dropped, and why."""
        store = self._store
        if reason is None and store is not None and not store.closed:
            reason = store.dropped
        if reason is None:
            return
        self._say("dropped", f"decoded-sample store dropped: {reason}. Every job decodes "
                  "its samples itself from now on", warn=True)

    def _say(self, what: str, message: str, warn: bool = False) -> None:
        """Log `message` once per process (and warn it, with warn=True)."""
        if what in self._said:
            return
        self._said.add(what)
        log.warning("%s", message)
        if warn:
            warnings.warn(message, TensorSocketWarning, stacklevel=3)


def _leave(key: str, store: Store) -> None:
    """A job's handle leaves the store (a finalizer: never raises)."""
    try:
        if not store.closed:
            leave(key, store)
    except Exception as e:  # noqa: BLE001 - at exit, say, with the runtime directory gone
        log.warning("leaving the decoded-sample store %s: %s", key, e)
