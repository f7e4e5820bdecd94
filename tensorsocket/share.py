"""share(): the one-line shared loader.

Every collocated training script calls::

    loader = tensorsocket.share(DataLoader(dataset, batch_size=64, ...), name="cifar")

instead of iterating its own DataLoader. The first caller of a name (across
processes, elected under a file lock) forks a producer process that runs its
loader; every caller, the first included, gets a TensorConsumer attached to
it. No separate producer script is needed.

How it works:

- Election. ``<runtime dir>/<name>.share.lock`` is flocked around "is a
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
  (truncated by each new producer of the name, kept after it ends). It never
  returns into the caller's code: it leaves with ``os._exit``, so the caller's
  atexit handlers and buffered output are not run or written twice (share()
  flushes sys.stdout and sys.stderr before forking).
- Lifetime. The producer pauses while no consumer is attached and ends
  ``idle_timeout`` seconds after the last consumer left the ring (default
  60 s), or, with ``epochs=N``, once its consumers have read its N epochs. It
  removes its segment, socket and lock files as it ends (its log stays, for
  the next look). SIGTERM ends it cleanly too.

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
import faulthandler
import fcntl
import inspect
import json
import logging
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import zmq

from . import _core, config
from .config import UNSET
from .consumer import TensorConsumer
from .control import ControlClient
from .endpoints import Endpoint, resolve
from .errors import ProducerFinished, ProducerGone, ProducerNotFound, TensorSocketError
from .producer import TensorProducer
from .rebatch import consumer_len

__all__ = ["share"]

log = logging.getLogger("tensorsocket")

# Keywords share() decides itself, for the producer and the consumers.
_RENDEZVOUS = frozenset({"port", "ack_port", "heart_ports", "name", "address"})
_MANAGED = frozenset({"min_consumers", "start_timeout"})
_POLL = 0.1  # seconds between the producer's idle checks
_KILL_GRACE = 5.0  # seconds a producer stopped with SIGTERM gets before SIGKILL
_LOG_TAIL_LINES = 12


def share(
    loader: Any,
    name: str | None = None,
    *,
    epochs: int | None = None,
    idle_timeout: float | None = UNSET,
    producer_options: dict | None = None,
    **consumer_options: Any,
) -> TensorConsumer:
    """Share ``loader`` between the processes that call share() with the same name.

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

    epochs: epochs the producer runs (default None: as long as it has
      consumers). A consumer asking for more gets ProducerFinished.
    idle_timeout: seconds without any consumer attached after which the
      producer ends (default 60, or ``$TENSORSOCKET_IDLE_TIMEOUT``; None:
      never, it then ends only after ``epochs``). A consumer that leaves the
      ring (break out of an epoch, close(), exit) and comes back later than
      this finds it gone.
    producer_options: further TensorProducer keywords (``max_lag``,
      ``ring_slots``, ``rubber_band``, ``device``, ...). share() sets
      ``name``, ``min_consumers=1`` and the pause itself.

    Consumer (each caller's own): the TensorConsumer keywords (``batch_size``,
    ``drop_last``, ``timeout``, ``batch_timeout``, ``copy``, ``device``,
    ``pin_memory``, ``with_index``, ``unpack_fn``, ...). ``batch_size`` and
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
    producer_kw, consumer_kw = _check_options(producer_options, consumer_options)
    _check_loader(loader, epochs)
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int)
                               or epochs < 1):
        raise ValueError(f"epochs must be a positive integer or None, got {epochs!r}")
    idle_timeout = config.get("idle_timeout", idle_timeout)
    if idle_timeout is not None and (isinstance(idle_timeout, bool) or not isinstance(
            idle_timeout, (int, float)) or not idle_timeout > 0):
        raise ValueError(f"idle_timeout must be a number of seconds > 0 or None, got "
                         f"{idle_timeout!r}")
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "tensorsocket.share() forks a producer process, and CUDA is already initialised "
            "in this process (a forked child cannot use it): call share() before anything "
            "touches the GPU (model.cuda(), .to('cuda'), torch.cuda calls), or run a "
            "TensorProducer in a script of its own and use TensorConsumer(name=...) here"
        )
    endpoint = resolve(name)
    timeout = config.get("timeout", consumer_kw.get("timeout", UNSET))
    deadline = None if timeout is None else time.monotonic() + float(timeout)
    want_bs = consumer_kw.pop("batch_size", _loader_batch_size(loader))
    want_dl = bool(consumer_kw.pop("drop_last", getattr(loader, "drop_last", False)))
    lock_path = _share_lock_path(endpoint)
    log_path = _log_path(endpoint)

    fd = _lock(lock_path, deadline)
    if fd is None:
        holder = _lock_holder(lock_path)
        raise ProducerNotFound(
            f"another process (pid {holder}) has been starting the shared producer "
            f"{endpoint.name!r} for more than timeout={timeout} s; its log is {log_path}. "
            "Raise share(..., timeout=) for a loader that is slow to start"
        )
    started = False
    try:
        if not _producer_live(endpoint):
            _start_producer(loader, endpoint, epochs, idle_timeout, producer_kw, fd, lock_path,
                            log_path, timeout, deadline)
            started = True
        consumer = _attach(endpoint, want_bs, want_dl, consumer_kw)
    finally:
        _unlock(fd, lock_path)
    consumer.started_producer = started
    consumer.producer_log = log_path
    if hasattr(loader, "dataset"):
        consumer.dataset = loader.dataset
    return consumer


# -- arguments ------------------------------------------------------------------------


def _keywords(cls: type, skip: set[str]) -> set[str]:
    """Keyword parameters of cls.__init__, less `skip`."""
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - skip


def _check_options(producer_options: dict | None,
                   consumer_options: dict) -> tuple[dict, dict]:
    """Check the keywords meant for either side; errors name the right place."""
    producer_names = _keywords(TensorProducer, {"self", "data_loader", "producer_batch_size"})
    consumer_names = _keywords(TensorConsumer, {"self"}) - _RENDEZVOUS
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


def _managed_message(key: str) -> str:
    return (f"share() sets {key}= itself: the producer waits for its first consumer, pauses "
            "while none is attached and ends idle_timeout= seconds after the last one left; "
            "pass share(..., idle_timeout=) instead")


def _check_loader(loader: Any, epochs: int | None) -> None:
    iterable = hasattr(type(loader), "__iter__") or hasattr(type(loader), "__getitem__")
    if not iterable and not callable(loader):
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


def _loader_batch_size(loader: Any) -> int | None:
    bs = getattr(loader, "batch_size", None)
    return bs if isinstance(bs, int) and not isinstance(bs, bool) else None


# -- files and locks ------------------------------------------------------------------


def _share_lock_path(endpoint: Endpoint) -> Path:
    return endpoint.runtime_dir / f"{endpoint.name}.share.lock"


def _log_path(endpoint: Endpoint) -> Path:
    return endpoint.runtime_dir / f"{endpoint.name}.producer.log"


def _lock(path: Path, deadline: float | None) -> int | None:
    """flock `path` exclusively, waiting until `deadline` (None: forever); the fd, or
    None on timeout. The file may be unlinked by a holder (who then holds it no more
    once closed): a lock on a file that is no longer at `path` is dropped and taken
    again on the new one."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline is not None and time.monotonic() >= deadline:
                        os.close(fd)
                        return None
                    time.sleep(0.02)
            mine = os.fstat(fd)
            try:
                now = os.stat(path)
                same = (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            return fd
        os.close(fd)


def _unlock(fd: int, path: Path) -> None:
    """Release a lock from _lock(), removing its file while still holding it (waiters
    that opened it notice and take the lock on a new file), so none is left behind."""
    try:
        path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _lock_holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


def _producer_live(endpoint: Endpoint) -> bool:
    """True while some process holds the producer's name lock (it is alive)."""
    try:
        fd = os.open(endpoint.lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops our shared lock at once
    return False


# -- the caller's side ----------------------------------------------------------------


def _attach(endpoint: Endpoint, want_bs: int | None, want_dl: bool,
            options: dict) -> TensorConsumer:
    """The caller's consumer: the producer's batches as they are when they are what
    this caller's loader would make, else re-cut to its batch size."""
    kwargs = dict(options, name=endpoint.name, address=endpoint.address)
    if want_bs is not None and not _same_batches(endpoint, want_bs, want_dl, options):
        kwargs.update(batch_size=want_bs, drop_last=want_dl)
    return _SharedConsumer(**kwargs)


def _same_batches(endpoint: Endpoint, want_bs: int, want_dl: bool, options: dict) -> bool:
    """Whether the producer's batches are batches of want_bs with drop_last=want_dl. Asks
    the producer (a handshake without joining its ring, so nothing is published for it)."""
    timeout = config.get("timeout", options.get("timeout", UNSET))
    context = zmq.Context()
    client = ControlClient(context, endpoint.address, timeout)
    try:
        welcome = client.hello(None)
    finally:
        client.close(say_bye=client.consumer >= 0, wait=0.5)
        context.term()
    if welcome.get("loader_batch_size") != want_bs:
        return False
    length, samples = welcome.get("length"), welcome.get("samples")
    if length is None or samples is None:
        return not want_dl
    return consumer_len(samples, want_bs, want_dl) == length


class _SharedConsumer(TensorConsumer):
    """A TensorConsumer from share(): its end-of-stream errors name the producer's log."""

    started_producer: bool = False
    producer_log: Path | None = None

    def __iter__(self) -> Any:
        return _SharedEpoch(super().__iter__(), self)


class _SharedEpoch:
    """One epoch of a shared consumer: the consumer's epoch iterator, with the shared
    producer's log named in ProducerFinished / ProducerGone."""

    __slots__ = ("_it", "_consumer")

    def __init__(self, it: Any, consumer: _SharedConsumer) -> None:
        self._it = it
        self._consumer = consumer

    def __iter__(self) -> "_SharedEpoch":
        return self

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except (ProducerFinished, ProducerGone) as e:
            raise type(e)(
                f"{e} (shared producer {self._consumer.endpoint.name!r}: it stops when its "
                "loader fails, after the epochs= of the share() call that started it, or "
                "idle_timeout= seconds after its last consumer left; its log is "
                f"{self._consumer.producer_log})") from None

    def __len__(self) -> int:
        return len(self._it)

    def close(self) -> None:
        self._it.close()


def _start_producer(loader: Any, endpoint: Endpoint, epochs: int | None,
                    idle_timeout: float | None, producer_kw: dict, lock_fd: int,
                    lock_path: Path, log_path: Path, timeout: float | None,
                    deadline: float | None) -> None:
    """Fork the producer; return once it published its first batch (it then waits for a
    consumer), or raise with its error."""
    caller = os.getpid()
    rfd, wfd = os.pipe()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or odd stream: nothing to write twice
            pass
    try:
        pid = os.fork()
    except BaseException:
        os.close(rfd)
        os.close(wfd)
        raise
    if pid == 0:  # the intermediate child: a new session, fork again, leave
        status = 1
        try:
            os.close(rfd)
            os.close(lock_fd)  # close only: flock(LOCK_UN) would unlock the caller's lock
            os.setsid()
            if os.fork() == 0:
                _producer_process(loader, endpoint, epochs, idle_timeout, producer_kw, wfd,
                                  lock_path, log_path, caller)
            status = 0
        finally:
            os._exit(status)
    os.close(wfd)
    try:
        os.waitpid(pid, 0)  # the intermediate child exits at once
    except ChildProcessError:
        pass
    try:
        _wait_ready(rfd, endpoint, log_path, timeout, deadline)
    finally:
        os.close(rfd)


def _wait_ready(rfd: int, endpoint: Endpoint, log_path: Path, timeout: float | None,
                deadline: float | None) -> None:
    """Read the producer's reports: {"pid"}, then {"ok"} or {"error"}."""
    buf = b""
    pid = start = None
    eof = False
    try:
        while True:
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                if "pid" in msg:
                    pid, start = msg["pid"], msg["start"]
                elif "ok" in msg:
                    return
                elif "error" in msg:
                    _wait_gone(pid, start)
                    raise TensorSocketError(
                        f"the shared producer {endpoint.name!r} failed before its first batch: "
                        f"{msg['error']} (its log, with the traceback: {log_path})")
            gone = eof or (pid is not None and not _core.process_alive(pid, start))
            if gone:
                _wait_gone(pid, start)
                raise TensorSocketError(
                    f"the shared producer {endpoint.name!r} (pid {pid}) ended before its first "
                    f"batch without a word; its log {log_path} ends with:\n{_log_tail(log_path)}")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                _stop(pid, start)
                raise ProducerNotFound(
                    f"the shared producer {endpoint.name!r} (pid {pid}) did not publish its "
                    f"first batch within timeout={timeout} s, so it was stopped: raise "
                    f"share(..., timeout=) for a loader that is slow to start; its log is "
                    f"{log_path}")
            ready, _, _ = select.select([rfd], [], [], _POLL if left is None else
                                        max(0.0, min(_POLL, left)))
            if ready:
                chunk = os.read(rfd, 65536)
                eof = not chunk
                buf += chunk
    except BaseException as e:
        if not isinstance(e, TensorSocketError):  # Ctrl-C here, say: stop what we started
            _stop(pid, start)
        raise


def _stop(pid: int | None, start: int | None) -> None:
    """SIGTERM the producer (it tears down cleanly), SIGKILL if it lingers."""
    if pid is None or not _core.process_alive(pid, start):
        return
    os.kill(pid, signal.SIGTERM)
    if not _wait_gone(pid, start, _KILL_GRACE):
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, start, _KILL_GRACE)


def _wait_gone(pid: int | None, start: int | None, timeout: float = 10.0) -> bool:
    """Wait until the producer has exited (its name lock is free then)."""
    if pid is None:
        return True
    end = time.monotonic() + timeout
    while _core.process_alive(pid, start):
        if time.monotonic() >= end:
            return False
        time.sleep(0.02)
    return True


def _log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(cannot read it: {e})"
    return "\n".join(lines[-_LOG_TAIL_LINES:]) or "(it is empty)"


# -- the producer process -------------------------------------------------------------


class _Reporter:
    """The producer's side of the pipe to the caller that started it."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        self._lock = threading.Lock()
        self.ok_sent = False

    def send(self, msg: dict, final: bool = False) -> bool:
        with self._lock:
            if self._fd is None:
                return False
            try:
                os.write(self._fd, (json.dumps(msg) + "\n").encode())
            except OSError:  # the caller is gone: nobody to tell
                pass
            if final:
                os.close(self._fd)
                self._fd = None
            return True

    @property
    def done(self) -> bool:
        return self._fd is None

    def ok(self) -> None:
        if self.send({"ok": True}, final=True):
            self.ok_sent = True

    def error(self, text: str) -> None:
        self.send({"error": text[:4000]}, final=True)


def _producer_process(loader: Any, endpoint: Endpoint, epochs: int | None,
                      idle_timeout: float | None, producer_kw: dict, wfd: int,
                      lock_path: Path, log_path: Path, caller: int) -> None:
    """The forked producer: serve, then os._exit (never return to the caller's code)."""
    status = 1
    try:
        reporter = _Reporter(wfd)
        reporter.send({"pid": os.getpid(), "start": _core.process_start_time(os.getpid())})
        try:
            _setup_process(log_path)
        except BaseException as e:
            reporter.error(f"cannot set up the producer process: {type(e).__name__}: {e}")
            raise
        status = _serve(loader, endpoint, epochs, idle_timeout, producer_kw, reporter,
                        lock_path, caller)
    finally:
        os._exit(status)


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _setup_process(log_path: Path) -> None:
    """stdin from /dev/null; stdout, stderr and logging to the log; clean SIGTERM."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(null)
    os.close(fd)
    # The caller's sys.std* may be anything (a pytest capture, a tqdm wrapper): new ones.
    sys.stdin = open(os.devnull)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    faulthandler.enable(file=sys.stderr)
    signal.signal(signal.SIGTERM, _raise_exit)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Logging of this process goes to its log only, not to the caller's handlers.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().handlers = [handler]
    ts_log = logging.getLogger("tensorsocket")
    ts_log.handlers = []
    ts_log.setLevel(logging.INFO)
    ts_log.propagate = True
    # GNU OpenMP hangs in a forked child once the parent used its thread pool.
    torch.set_num_threads(1)


def _serve(loader: Any, endpoint: Endpoint, epochs: int | None, idle_timeout: float | None,
           producer_kw: dict, reporter: _Reporter, lock_path: Path, caller: int) -> int:
    """Run the producer; the exit status."""
    log.info("shared producer %r: pid %d, started by share() in pid %d; epochs=%s, "
             "idle_timeout=%s", endpoint.name, os.getpid(), caller, epochs, idle_timeout)
    try:
        producer = TensorProducer(loader, name=endpoint.name, address=endpoint.address,
                                  min_consumers=1, start_timeout=None, **producer_kw)
    except BaseException as e:
        log.exception("cannot start the producer")
        reporter.error(f"{type(e).__name__}: {e}")
        return 1
    guard = _Guard(producer, reporter, idle_timeout, lock_path)
    status = 1
    try:
        epoch = 0
        while epochs is None or epoch < epochs:
            batches = 0
            for _ in producer:
                batches += 1
            if batches == 0:
                raise ValueError(
                    f"the loader yielded no batch in epoch {epoch}: an empty dataset, or an "
                    "iterable that cannot be iterated again")
            epoch += 1
            log.info("epoch %d published (%d batches)", epoch, batches)
        log.info("all %d epochs published; waiting until the consumers have read them", epochs)
        producer.ring.wait_drained(None)
        status = 0
    except BaseException as e:
        if guard.retired:
            status = 0
        else:
            log.error("the shared producer failed", exc_info=True)
            reporter.error(f"{type(e).__name__}: {e}")
    finally:
        guard.close()
    log.info("shared producer %r ended", endpoint.name)
    return status


class _Guard:
    """A thread of the producer process: tells the caller that started it once the first
    batch is in the ring, and ends the producer after idle_timeout without consumers.

    The producer runs with start_timeout=None (it pauses while no consumer is attached)
    and this thread decides when the pause has lasted too long, under the share lock: no
    caller is attaching then (they attach while holding it), so none can attach to a
    producer on its way out. (The producer's own start_timeout would end its epoch
    without that lock, racing a caller attaching at that moment.)"""

    def __init__(self, producer: TensorProducer, reporter: _Reporter,
                 idle_timeout: float | None, lock_path: Path) -> None:
        self._producer = producer
        self._reporter = reporter
        self._idle_timeout = idle_timeout
        self._lock_path = lock_path
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self.retired = False
        self._thread = threading.Thread(target=self._run, name="tensorsocket-share",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._reporter.done:  # until the first batch is in the ring
                if self._stop.wait(0.01):
                    return
                if self._producer.ring is not None:
                    self._reporter.ok()
        except Exception:
            log.exception("the shared producer's watch failed before the first batch")
            return
        idle_since: float | None = None
        failures = 0
        while not self._stop.wait(_POLL):
            try:
                if self._idle_timeout is None:
                    continue
                if self._producer.stats()["consumers"] > 0:
                    idle_since = None
                    continue
                now = time.monotonic()
                if idle_since is None:
                    idle_since = now
                elif now - idle_since >= self._idle_timeout:
                    if self._retire():
                        return
                    idle_since = None  # a caller was attaching
            except Exception:
                if self._stop.is_set():
                    return
                failures += 1  # keep watching: without it the producer could outlive all
                if failures <= 3:
                    log.exception("the shared producer's idle watch failed; retrying")

    def _retire(self) -> bool:
        """End the producer if still nobody is attached; False if somebody is."""
        with self._mutex:
            if self._closed:
                return True
            fd = _lock(self._lock_path, time.monotonic())  # one try: a caller may hold it
            if fd is None:
                return False
            try:
                if self._producer.stats()["consumers"] > 0:
                    return False
                log.info("no consumer for idle_timeout=%s s: ending", self._idle_timeout)
                self.retired = True
                self._producer.close()  # the main thread's wait ends with an error
                self._closed = True
            finally:
                _unlock(fd, self._lock_path)
            return True

    def close(self) -> None:
        """Stop the thread; close the producer (under the share lock once consumers may
        have attached, so that no caller attaches to it meanwhile)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        with self._mutex:
            if self._closed:
                return
            fd = None
            if self._reporter.ok_sent:
                # Callers hold it for at most their timeout; do not wait forever.
                fd = _lock(self._lock_path, time.monotonic() + 300)
            try:
                self._producer.close()
                self._closed = True
            finally:
                if fd is not None:
                    _unlock(fd, self._lock_path)
