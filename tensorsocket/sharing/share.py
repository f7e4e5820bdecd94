"""share(): the one-line shared loader.

Every collocated training script calls::

    loader = tensorsocket.share(DataLoader(dataset, batch_size=64, ...), name="cifar")

instead of iterating its own DataLoader. The first caller of a name (across
processes, elected under a file lock) forks a producer process that runs its
loader; every caller, the first included, gets a TensorConsumer attached to
it. No separate producer script is needed.

How it works:

- Election. ``<runtime dir>/<name>.share-lock`` is flocked around "is a
  producer of this name live? If not, start one and wait until it publishes
  its first batch; attach". Liveness is the producer's own exclusive flock on
  ``<name>.lock``, which the kernel drops when it dies, so a crashed producer
  never looks live. The retiring producer takes the same lock before it tears
  down, so a caller either attaches to a producer that keeps serving it or
  finds none and starts a new one; it never attaches to one on its way out.
- Process. The producer is forked (the loader lives in the caller and is
  generally not picklable), twice, with a new session in between: it is not
  a child of the caller (no zombie, nobody waits for it at exit) and Ctrl-C in
  the first trainer's terminal does not reach it. It keeps serving the others
  when the first caller exits. Its stdin is /dev/null; its stdout, stderr,
  logging and fatal-signal tracebacks go to ``<runtime dir>/<name>.producer.log``
  (_shared_producer.ProducerLog: moved to ``<name>.producer.log.1`` when full,
  removed when the producer ends cleanly, kept when it fails). It never
  returns into the caller's code: it leaves with ``os._exit``, so the caller's
  atexit handlers and buffered output are not run or written twice (share()
  flushes sys.stdout and sys.stderr before forking).
- Lifetime. The producer pauses while no consumer is attached and ends
  ``idle_timeout`` seconds after the last consumer left the ring (default
  60 s), or, with ``epochs=N``, once its consumers have read its N epochs. It
  removes its segment, socket, lock and log files as it ends. SIGTERM tears it
  down cleanly too, but keeps its log (it was stopped from outside: the log says
  where it was); ``tensorsocket clean`` removes the logs of producers that no
  longer run.

Fork caveats (share() is meant to be called early in a training script,
before the model is built):

- CUDA: a process that has initialised CUDA cannot fork a child that uses
  it, so share() raises if ``torch.cuda.is_initialized()``. Call share()
  before ``model.cuda()`` / ``.to("cuda")`` or anything else that touches the
  GPU (it is checked in every caller, not only the one that forks, so a
  script behaves the same whichever caller comes first).
- Threads: only the calling thread exists in the producer. share() forks
  before it creates any socket or thread of its own, but threads the caller
  started earlier (and locks they held) do not come along. In particular
  torch's OpenMP thread pool cannot be used after a fork once the caller has
  used it (GNU OpenMP then hangs), so the producer runs with
  ``torch.set_num_threads(1)``, as DataLoader workers do: use the loader's
  ``num_workers=`` for parallel loading.
- The producer is a copy of the caller at the moment of the call (memory is
  shared copy-on-write): call share() before loading large models. A loader
  with ``persistent_workers=True`` that was already iterated cannot be
  shared (its workers belong to the caller).
"""
from __future__ import annotations

import collections.abc
import inspect
import logging
import time
from pathlib import Path
from typing import Any

import torch
import zmq

from .. import config
from ..config import UNSET
from ..consumer import SharedLoader, TensorConsumer
from ..consumer.surface import ForwardsLoaderAttributes
from ..control.auth import ClientSecret
from ..control.client import ControlClient
from ..control.endpoints import Endpoint, resolve
from ..errors import (
    ProducerFailed,
    ProducerFinished,
    ProducerGone,
    ProducerNotFound,
    TensorSocketError,
)
from ..loader.loader_info import (
    LoaderShape,
    batch_size_of,
    data_identity,
    drop_last_of,
    is_iterable,
)
from ..producer import TensorProducer
# (Imported here, not at the first share(store=True): a framework that patches the
# DataLoader classes that exist when it builds a loader, Lightning's hooks recording their
# arguments, must find StoreLoader among them.)
from ..store import store_loader
from ..ring import MAX_CONSUMERS, cuda_loaded
from .election import (
    lock_holder,
    producer_live,
    producer_log_path,
    release_lock,
    share_lock_path,
    take_lock,
)
from .shared_producer import start_producer

__all__ = ["share"]

log = logging.getLogger("tensorsocket")

# Keywords share() decides itself, for the producer and the consumers.
_RENDEZVOUS = frozenset({"port", "ack_port", "heart_ports", "name", "address"})
_MANAGED = frozenset({"start_timeout"})
_GROUP = frozenset({"rank", "world_size", "group"})

def share(
    loader: Any,
    name: str | None = None,
    *,
    epochs: int | None = None,
    idle_timeout: float | None = UNSET,
    min_consumers: int = UNSET,
    start_grace: float = UNSET,
    cache_bytes: int | str = UNSET,
    store: bool = False,
    producer_options: dict | None = None,
    **consumer_options: Any,
) -> Any:
    """Share ``loader`` between the processes that call share() with the same name.

    (Long: this docstring is the reference of every argument.)

    The first caller of ``name`` (elected under a file lock, race-free across
    processes) starts a producer process that runs ``loader``; every caller,
    the first included, gets a TensorConsumer attached to it, to iterate like
    the loader: ``for batch in consumer`` is one epoch, ``len(consumer)`` its
    number of batches. The other callers' loaders are not run (only their
    ``batch_size``, ``drop_last`` and ``dataset`` are looked at), so every
    caller should pass the same loader; each may use its own batch size.

    loader: a torch DataLoader or any re-iterable of batches (or a callable
      returning a fresh iterable per epoch; an iterator only with epochs=1).
    name: rendezvous name (default ``"default"``, or ``$TENSORSOCKET_NAME``).

    Producer (these apply when this call starts the producer; a producer that
    is already running keeps the settings of the caller that started it):

    epochs: epochs the producer runs (default None: as long as it has consumers).
    min_consumers: consumers (jobs, or ranks of data-parallel jobs) that must be
      attached before the first batch (default 1, ``$TENSORSOCKET_MIN_CONSUMERS``);
      with more, the producer waits for them, within the first caller's ``timeout``
      (a sweep of N jobs passing N begins together however far apart they start).
    start_grace: seconds the producer waits more, once min_consumers are attached,
      before its first batch (default 3, ``$TENSORSOCKET_START_GRACE``).
    cache_bytes: memory for the decoded samples, to run later epochs without the loader
      (default 0: off, ``$TENSORSOCKET_CACHE_BYTES``; see TensorProducer).
    idle_timeout: seconds without any consumer attached after which the
      producer ends (default 60, or ``$TENSORSOCKET_IDLE_TIMEOUT``; None:
      never, it then ends only after ``epochs``). A consumer that leaves the
      ring (break out of an epoch, close(), exit) and comes back later than
      this finds it gone.
    store: True: jobs share a store of decoded samples instead of a producer's ring
      (docs/decoded-store.md, docs/usage.md). Each job runs its own DataLoader (its
      sampler, subset, seed, batch size, speed and start time: its batches are exactly
      those of its own loader), over its dataset read through a shared-memory store of
      the samples' deterministic part (the decode and the leading deterministic steps of
      the dataset's transform); the random rest runs in the job, seeded per sample. The
      returned object is that DataLoader (a StoreLoader). Needs a DataLoader over a
      map-style dataset; cache_bytes is the store's budget (default: what every sample
      takes, within half of the memory the machine has free); ``transform=`` (and
      ``seed=``) is the job's own part, run on each sample's inputs after the store, seeded
      per (seed, epoch, sample) as with the ring. The other options of this call
      (producer and consumer ones, epochs) are the ring's and are refused with it.
    producer_options: further TensorProducer keywords (``max_lag``,
      ``ring_slots``, ``rubber_band``, ``device``, ...). share() sets
      ``name``, ``min_consumers`` and the pause itself.

    Consumer (each caller's own): the TensorConsumer keywords (``batch_size``,
    ``drop_last``, ``timeout``, ``batch_timeout``, ``copy``, ``device``,
    ``pin_memory``, ``with_index``, ``unpack_fn``, ``transform``, ...). ``batch_size`` and
    ``drop_last`` default to the caller's loader's, so each caller gets the
    batches its own DataLoader would have made (``len(consumer)`` equals
    ``len(loader)``); ``batch_size=None`` takes the producer's batches as
    they are. ``timeout`` (default 60 s) also bounds the wait for the first
    batch of a producer this call starts and for a concurrent caller that is
    starting one.

    The returned consumer also carries ``dataset`` (the caller's
    ``loader.dataset``, for ``len(loader.dataset)``), ``producer_log`` (the
    producer's log file) and ``started_producer`` (whether this call started
    it). Errors: TensorSocketError if the producer failed before its first
    batch (with its error and the log's path); ProducerNotFound if it did not
    publish its first batch within ``timeout``; TypeError / ValueError for a
    bad argument, naming it; RuntimeError if CUDA is initialised here.
    """
    if store:
        return _share_store(loader, name, cache_bytes, epochs=epochs,
                            idle_timeout=idle_timeout, min_consumers=min_consumers,
                            start_grace=start_grace, producer_options=producer_options,
                            **consumer_options)
    producer_kw, consumer_kw = _check_options(producer_options, consumer_options)
    name = _check_arguments(loader, name, epochs, min_consumers, start_grace, cache_bytes,
                            producer_kw, consumer_kw)
    idle_timeout = config.get("idle_timeout", idle_timeout)
    _refuse_initialised_cuda()
    endpoint = resolve(name)
    consumer, started = _elect_and_attach(loader, endpoint, epochs, idle_timeout,
                                          producer_kw, consumer_kw)
    if not started:
        try:
            _check_same_data(consumer, loader, endpoint, idle_timeout)
        except BaseException:
            consumer.close()
            raise
    return consumer


def _share_store(loader: Any, name: str | None, cache_bytes: Any, **options: Any) -> Any:
    """share(..., store=True): the job's own DataLoader over the decoded-sample store of
    `name` (store.store_loader), with the job's own ``transform=`` and ``seed=``. The
    ring's options are refused, naming the first."""
    transform, seed = options.pop("transform", None), options.pop("seed", None)
    defaults = {"epochs": None, "idle_timeout": UNSET, "min_consumers": UNSET,
                "start_grace": UNSET, "producer_options": None}
    for key, value in options.items():
        if value is not defaults.get(key, UNSET) and not (key == "producer_options"
                                                          and not value):
            raise TypeError(
                f"share(..., store=True) takes no {key}=: with the store each job runs its "
                "own DataLoader as it is (batch size, epochs and all); that option is the "
                "producer's ring's (leave store= off to use it)")
    if transform is not None and not callable(transform):
        raise TypeError(f"transform= must be callable, got {type(transform).__name__}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed= must be an int, got {type(seed).__name__}")
    budget = config.get("cache_bytes", cache_bytes)
    return store_loader(loader, resolve(name).name, int(budget or 0), transform=transform,
                        seed=seed)


def _check_arguments(loader: Any, name: str | None, epochs: int | None, min_consumers: int,
                     start_grace: float, cache_bytes: Any, producer_kw: dict,
                     consumer_kw: dict) -> str | None:
    """Check share()'s own arguments, put the producer's into producer_kw and the
    consumer group of a data-parallel job into consumer_kw; the name to share under."""
    given = min_consumers is not UNSET
    min_consumers = config.get("min_consumers", min_consumers)
    if isinstance(min_consumers, bool) or not isinstance(min_consumers, int) or \
            not 1 <= min_consumers <= MAX_CONSUMERS:
        knob = "min_consumers" if given else "$TENSORSOCKET_MIN_CONSUMERS"
        raise ValueError(f"{knob} must be an int in 1..{MAX_CONSUMERS} for share() "
                         f"(a shared producer always waits for one consumer), got "
                         f"{min_consumers!r}")
    producer_kw["min_consumers"] = min_consumers
    if start_grace is not UNSET:
        producer_kw["start_grace"] = start_grace
    if cache_bytes is not UNSET:  # checked here: a bad value raises in the caller
        producer_kw["cache_bytes"] = config.get("cache_bytes", cache_bytes)
    name, group = _data_parallel(loader, name, consumer_kw)
    consumer_kw.update(group)
    _check_loader(loader, epochs)
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int)
                               or epochs < 1):
        raise ValueError(f"epochs must be a positive integer or None, got {epochs!r}")
    return name


def _refuse_initialised_cuda() -> None:
    """RuntimeError if CUDA is initialised in this process (a forked child cannot use
    it; see the module docstring)."""
    if torch.cuda.is_initialized() or cuda_loaded():
        by = "torch" if torch.cuda.is_initialized() else \
            "tensorsocket (a GPU consumer, pin_memory=True or gpu_status())"
        raise RuntimeError(
            f"tensorsocket.share() forks a producer process, and CUDA is already initialised "
            f"in this process by {by} (a forked child cannot use it): call share() before "
            "anything touches the GPU (model.cuda(), .to('cuda'), torch.cuda calls, an "
            "earlier share() whose consumer reads a GPU ring), or run a TensorProducer in a "
            "script of its own and use TensorConsumer(name=...) here"
        )


def _elect_and_attach(loader: Any, endpoint: Endpoint, epochs: int | None,
                      idle_timeout: float | None, producer_kw: dict,
                      consumer_kw: dict) -> tuple[TensorConsumer, bool]:
    """Under the name's election lock: start the producer unless one is live, and attach
    this caller's consumer to it; returns the consumer and whether this call started the
    producer. A rank of a group says ready outside the lock: it waits there for the
    other ranks, which need the lock to attach."""
    timeout = config.get("timeout", consumer_kw.get("timeout", UNSET))
    deadline = None if timeout is None else time.monotonic() + float(timeout)
    want_bs = consumer_kw.pop("batch_size", batch_size_of(loader))
    want_dl = bool(consumer_kw.pop("drop_last", drop_last_of(loader)))
    lock_path = share_lock_path(endpoint)
    log_path = producer_log_path(endpoint)
    fd = take_lock(lock_path, deadline)
    if fd is None:
        holder = lock_holder(lock_path)
        raise ProducerNotFound(
            f"another process (pid {holder}) has been starting the shared producer "
            f"{endpoint.name!r} for more than timeout={timeout} s; its log is {log_path}. "
            "Raise share(..., timeout=) for a loader that is slow to start"
        )
    lock = _ElectionLock(fd, lock_path)
    started = False
    try:
        if not producer_live(endpoint):
            start_producer(loader, endpoint, epochs, idle_timeout, producer_kw, fd, lock_path,
                           log_path, timeout, deadline)
            started = True
        rank = (consumer_kw.get("world_size") or 1) > 1
        shared = SharedLoader(loader, want_dl, started, log_path,
                              before_ready=lock.release if rank else None)
        consumer = _attach(endpoint, want_bs, shared, consumer_kw)
    finally:
        lock.release()
    return consumer, started


class _ElectionLock:
    """The name's election lock, held by this share() call until release() (once)."""

    def __init__(self, fd: int, path: Path) -> None:
        """The lock take_lock() gave: its file descriptor and path."""
        self._fd: int | None = fd
        self._path = path

    def release(self) -> None:
        """Let go of the lock (again: nothing)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            release_lock(fd, self._path)


# -- arguments ------------------------------------------------------------------------


def _keywords(cls: type, skip: set[str]) -> set[str]:
    """Keyword parameters of cls's constructor, less `skip`."""
    params = inspect.signature(cls).parameters.values()
    return {p.name for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - skip


def _check_options(producer_options: dict | None,
                   consumer_options: dict) -> tuple[dict, dict]:
    """Check the keywords meant for either side; errors name the right place."""
    producer_names = _keywords(TensorProducer, {"self", "data_loader", "producer_batch_size"})
    consumer_names = _keywords(TensorConsumer, {"self", "shared"}) - _RENDEZVOUS
    for key in consumer_options:
        if key in _RENDEZVOUS:
            raise TypeError(
                f"share() rendezvous is by name: pass name=, not {key}= (the address, if "
                "any, comes from $TENSORSOCKET_ADDRESS)")
        if key in consumer_names:
            continue
        if key in _MANAGED:
            raise TypeError(_managed_message(key))
        if key in producer_names:
            raise TypeError(
                f"{key}= is a TensorProducer option: pass share(..., producer_options="
                f"{{{key!r}: ...}}) (it applies when this call starts the producer)")
        raise TypeError(
            f"share() got an unexpected keyword argument {key!r}; consumer options are "
            f"{', '.join(sorted(consumer_names))}; producer options go in producer_options=")
    if not isinstance(producer_options, (dict, type(None))):
        raise TypeError(f"producer_options must be a dict, got {type(producer_options).__name__}")
    options = dict(producer_options or {})
    for key in options:
        if key in _MANAGED:
            raise TypeError(_managed_message(key))
        if key in _RENDEZVOUS:
            raise TypeError(f"producer_options={{{key!r}: ...}}: share() rendezvous is by "
                            "name: pass share(..., name=)")
        if key not in producer_names:
            raise TypeError(
                f"producer_options has an unknown TensorProducer option {key!r}; they are "
                f"{', '.join(sorted(producer_names - _MANAGED - _RENDEZVOUS))}")
    return options, dict(consumer_options)


def _data_parallel(loader: Any, name: str | None,
                   consumer_kw: dict) -> tuple[str | None, dict]:
    """The name and the consumer group of a caller that is a rank of a data-parallel job
    (torchrun, torch.distributed, Lightning, accelerate: RANK / WORLD_SIZE and
    LOCAL_RANK / LOCAL_WORLD_SIZE in the environment, or an initialised process group).

    - A loader sharded by a DistributedSampler over the job's ranks already gives each
      rank its own part: each rank shares its loader under a name of its own
      (``<name>.rank<R>of<W>``), with the same rank of other jobs.
    - A loader sharded by a DistributedSampler over the nodes (one replica per node) is
      this node's part: the ranks on this node split it (one producer per node).
    - Any other loader reads the whole data: the ranks on this machine split its stream
      between them (``rank=``, ``world_size=`` of the consumers), each sample to one of
      them; on more than one node that would give every node all of it, so it is
      refused, naming the fix.

    Explicit ``rank=`` / ``world_size=`` consumer options win over the environment."""
    if _GROUP & consumer_kw.keys():
        return name, {}
    rank, world, local_rank, local_world = _ranks()
    if world <= 1:
        return name, {}
    sampler = getattr(loader, "sampler", None)
    replicas = getattr(sampler, "num_replicas", None)
    if _is_distributed_sampler(sampler) and replicas == world:
        base = resolve(name).name
        return f"{base}.rank{rank}of{world}", {}
    nodes = world // max(1, local_world)
    group = {"rank": local_rank, "world_size": local_world, "group": _job_id()}
    if _is_distributed_sampler(sampler) and replicas == nodes and nodes > 1:
        return name, group
    if local_world != world:
        raise ValueError(
            f"share() in a data-parallel job over {nodes} nodes ({world} ranks, "
            f"{local_world} on this node): each node needs a producer over its own part of "
            "the data, and this loader reads all of it. Give the loader a "
            f"DistributedSampler(dataset, num_replicas={nodes}, rank=<this node's rank>) so "
            "that the ranks on each node split that node's part, or a "
            f"DistributedSampler(dataset) over all {world} ranks so that each rank shares "
            "its own part")
    if _is_distributed_sampler(sampler):
        raise ValueError(
            f"the loader's DistributedSampler has num_replicas={replicas}, but the job has "
            f"{world} ranks: give it num_replicas={world}, or no DistributedSampler (the "
            "ranks then split the shared stream)")
    return name, group


def _job_id() -> str | None:
    """What tells the ranks of one data-parallel job from those of another on this
    machine: its rendezvous address (torchrun, Lightning and accelerate set it)."""
    import os

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if port:
        return f"{addr or 'localhost'}:{port}"
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    return run if run and run != "none" else None


def _ranks() -> tuple[int, int, int, int]:
    """(rank, world size, local rank, local world size) of this process in a
    data-parallel job; (0, 1, 0, 1) outside one."""
    import os

    def env(key: str) -> int | None:
        try:
            return int(os.environ[key])
        except (KeyError, ValueError):
            return None

    rank, world = env("RANK"), env("WORLD_SIZE")
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:  # a torch without distributed support
        pass
    if rank is None or world is None or world <= 1:
        return 0, 1, 0, 1
    local_rank = env("LOCAL_RANK")
    local_world = env("LOCAL_WORLD_SIZE")
    if local_rank is None:
        local_rank = rank
    if local_world is None:
        local_world = world
    return rank, world, local_rank, local_world


def _is_distributed_sampler(sampler: Any) -> bool:
    """Whether sampler is a torch DistributedSampler (or a subclass)."""
    try:
        from torch.utils.data.distributed import DistributedSampler
    except ImportError:  # pragma: no cover
        return False
    return isinstance(sampler, DistributedSampler)


def _managed_message(key: str) -> str:
    """The error for a keyword share() sets itself."""
    return (f"share() sets {key}= itself: the producer waits for its first consumer, pauses "
            "while none is attached and ends idle_timeout= seconds after the last one left; "
            "pass share(..., idle_timeout=) instead")


def _check_same_data(consumer: TensorConsumer, loader: Any, endpoint: Endpoint,
                     idle_timeout: float | None) -> None:
    """Refuse a producer this call did not start if it serves other data than this caller's
    loader would: another dataset (type, length) or another pipeline (transforms,
    collate_fn, sampler, first sample's structure: tensorsocket.loader.fingerprint), where both
    sides are known; else a script edited and run again while the last run's producer
    idles would silently train on the old pipeline. Batch size and drop_last may differ
    (the consumer re-batches)."""
    from ..loader.fingerprint import describe, differences, records_first_sample

    if not is_iterable(loader):
        return  # a factory of loaders: nothing to compare before it runs
    kind, size = data_identity(loader)
    theirs, their_size = consumer.producer_dataset, consumer.producer_dataset_len
    differs = []
    if kind is not None and theirs is not None and kind != theirs:
        differs.append(f"it reads a {theirs}, this script's loader a {kind}")
    if size is not None and their_size is not None and size != their_size:
        differs.append(f"its dataset has {their_size} samples, this script's {size}")
    their_pipeline = getattr(consumer, "producer_fingerprint", None)
    if their_pipeline is not None:  # None: a producer that does not say
        mine = describe(loader, first_sample=records_first_sample(their_pipeline))
        differs += differences(mine, their_pipeline,
                               ignore=("dataset", "len", "batch_size", "drop_last"))
    if not differs:
        return
    pid = consumer.producer_pid
    idle = "wait for it to end" if idle_timeout is None else \
        f"wait for it to end (idle_timeout={idle_timeout} s after its last consumer leaves)"
    raise TensorSocketError(
        f"the shared producer {endpoint.name!r} (pid {pid}) serves other data than this "
        f"script's loader: {'; '.join(differs)}. It was started by an earlier share() call "
        f"with another loader. Share this loader under another name= (it starts a producer "
        f"of its own), stop the old producer (kill {pid}) and run again, or {idle}; "
        "`tensorsocket status` lists the producers")


def _check_loader(loader: Any, epochs: int | None) -> None:
    """Refuse loaders a forked producer cannot serve, naming the fix."""
    if not is_iterable(loader) and not callable(loader):
        raise TypeError(f"share() needs a DataLoader or another iterable of batches, not "
                        f"{type(loader).__name__!r}")
    if isinstance(loader, collections.abc.Iterator) and epochs != 1:
        raise TypeError(
            f"share() got an iterator ({type(loader).__name__!r}), which serves one epoch "
            "only: pass a DataLoader or another re-iterable, a callable that returns a fresh "
            "iterable per epoch, or epochs=1")
    if getattr(loader, "persistent_workers", False) and \
            getattr(loader, "_iterator", None) is not None:
        raise ValueError(
            "this DataLoader has persistent_workers=True and was already iterated: its "
            "worker processes belong to this process and cannot serve the forked producer; "
            "call share() before iterating the loader")



# -- the caller's side ----------------------------------------------------------------


def _attach(endpoint: Endpoint, want_bs: int | None, shared: SharedLoader,
            options: dict) -> TensorConsumer:
    """The caller's consumer: the producer's batches as they are when they are what
    this caller's loader would make, else re-cut to its batch size."""
    kwargs = dict(options, name=endpoint.name, address=endpoint.address, shared=shared)
    if want_bs is not None and not _same_batches(endpoint, want_bs, shared.drop_last,
                                                 options):
        kwargs.update(batch_size=want_bs, drop_last=shared.drop_last)
    return _SharedConsumer(**kwargs)


def _same_batches(endpoint: Endpoint, want_bs: int, want_dl: bool, options: dict) -> bool:
    """Whether the producer's batches are batches of want_bs with drop_last=want_dl. Asks
    the producer what its loader is (info: no place in its ring is taken for it)."""
    timeout = config.get("timeout", options.get("timeout", UNSET))
    context = zmq.Context()
    client = ControlClient(context, endpoint.address, timeout,
                           ClientSecret(endpoint, options.get("auth_token")))
    try:
        about = client.info()
    finally:
        client.close(say_bye=False)
        context.term()
    return LoaderShape.of_reply(about).same_batches(want_bs, want_dl)


class _SharedConsumer(ForwardsLoaderAttributes, TensorConsumer):
    """A TensorConsumer from share(): its end-of-stream errors name the producer's log."""

    started_producer: bool = False
    producer_log: Path | None = None

    def __iter__(self) -> Any:
        """One epoch, with the shared producer named in its end-of-stream errors."""
        return _SharedEpoch(super().__iter__(), self)


class _SharedEpoch:
    """One epoch of a shared consumer: the consumer's epoch iterator, with the shared
    producer's log named in ProducerFinished / ProducerGone."""

    __slots__ = ("_consumer", "_it")

    def __init__(self, it: Any, consumer: _SharedConsumer) -> None:
        """Wrap the epoch iterator `it` of `consumer`."""
        self._it = it
        self._consumer = consumer

    def __iter__(self) -> _SharedEpoch:
        """One epoch, with the shared producer named in its end-of-stream errors."""
        return self

    def __next__(self) -> Any:
        """The next batch; ProducerFinished / ProducerGone name the log."""
        try:
            return next(self._it)
        except (ProducerFinished, ProducerGone) as e:
            log_path = self._consumer.producer_log
            log_note = (f"having ended cleanly, it removes its log {log_path}"
                        if isinstance(e, ProducerFinished) else f"its log is {log_path}")
            named = type(e)(
                f"{e} (shared producer {self._consumer.endpoint.name!r}: it stops when its "
                "loader fails, after the epochs= of the share() call that started it, or "
                f"idle_timeout= seconds after its last consumer left; {log_note})")
            if isinstance(e, ProducerFailed) and isinstance(named, ProducerFailed):
                named.cause = e.cause
            raise named from None

    def __len__(self) -> int:
        """Batches in this epoch."""
        return len(self._it)

    def close(self) -> None:
        """Leave the epoch early (as the consumer iterator does)."""
        self._it.close()
