"""The producer process that share() forks, and the caller's handling of it: start it,
wait for its first batch or its error, stop it.

See tensorsocket/sharing/share.py for the design (double fork, its log file, its lifetime).
"""

from __future__ import annotations

import faulthandler
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

from ..ring import process_alive, process_start_time, set_process_name
from .election import (FAILED_LOGS_KEPT, STAGED_SUFFIX, failed_log_owner, failed_log_path,
                        failed_older_path, log_owner, older_log_path, release_lock,
                        take_lock)
from ..control.endpoints import Endpoint
from ..errors import ProducerNotFound, TensorSocketError
from ..producer import TensorProducer

log = logging.getLogger("tensorsocket")

_POLL = 0.1  # seconds between the producer's idle checks
_KILL_GRACE = 5.0  # seconds a producer stopped with SIGTERM gets before SIGKILL
_LOG_TAIL_LINES = 12
LOG_MAX_BYTES = 10 * 1024 * 1024  # a producer log this big moves to <log>.1 (docs/usage.md)

# -- starting it from the caller -----------------------------------------------------


def start_producer(loader: Any, endpoint: Endpoint, epochs: int | None,
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
            gone = eof or (pid is not None and start is not None
                           and not process_alive(pid, start))
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
    if pid is None or start is None or not process_alive(pid, start):
        return
    os.kill(pid, signal.SIGTERM)
    if not _wait_gone(pid, start, _KILL_GRACE):
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, start, _KILL_GRACE)


def _wait_gone(pid: int | None, start: int | None, timeout: float = 10.0) -> bool:
    """Wait until the producer has exited (its name lock is free then)."""
    if pid is None or start is None:  # both come in the producer's first report
        return True
    end = time.monotonic() + timeout
    while process_alive(pid, start):
        if time.monotonic() >= end:
            return False
        time.sleep(0.02)
    return True


def _log_tail(path: Path) -> str:
    """The last lines of the producer log, indented, for error messages."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(cannot read it: {e})"
    return "\n".join(lines[-_LOG_TAIL_LINES:]) or "(it is empty)"


# -- the producer process -------------------------------------------------------------


class _Reporter:
    """The producer's side of the pipe to the caller that started it."""

    def __init__(self, fd: int) -> None:
        """Set up; see the class docstring."""
        self._fd: int | None = fd
        self.take_lock = threading.Lock()
        self.ok_sent = False

    def send(self, msg: dict, final: bool = False) -> bool:
        """Write one message to the caller; False once the pipe is closed."""
        with self.take_lock:
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
        """True once the final message went out."""
        return self._fd is None

    def ok(self) -> None:
        """Tell the caller the first batch is in the ring."""
        if self.send({"ok": True}, final=True):
            self.ok_sent = True

    def error(self, text: str) -> None:
        """Tell the caller the producer failed, with the error text."""
        self.send({"error": text[:4000]}, final=True)


def _producer_process(loader: Any, endpoint: Endpoint, epochs: int | None,
                      idle_timeout: float | None, producer_kw: dict, wfd: int,
                      lock_path: Path, log_path: Path, caller: int) -> None:
    """The forked producer: serve, then os._exit (never return to the caller's code)."""
    status = 1
    try:
        reporter = _Reporter(wfd)
        reporter.send({"pid": os.getpid(), "start": process_start_time(os.getpid())})
        producer_log = ProducerLog(log_path)
        try:
            _setup_process(producer_log)
            set_process_name(f"ts:{endpoint.name}")  # what ps and top show (15 bytes)
        except BaseException as e:
            reporter.error(f"cannot set up the producer process: {type(e).__name__}: {e}")
            raise
        status = _serve(loader, endpoint, epochs, idle_timeout, producer_kw, reporter,
                        lock_path, caller, producer_log)
    finally:
        os._exit(status)


def _raise_exit(signum: int, frame: Any) -> None:
    """SIGTERM handler of the producer process: unwind and tear down cleanly."""
    raise SystemExit(128 + signum)


class ProducerLog:
    """The log file of the producer process, ``<runtime dir>/<name>.producer.log``: its
    file descriptors 1 and 2, so its stdout, stderr, logging, faulthandler's tracebacks
    and what C code and loader workers print.

    - Opened as the producer starts, while the caller that starts it holds the share lock
      (no other producer of the name is live): a log already there, and its older part,
      are those of an earlier producer of the name that failed or was killed (one that
      ended cleanly removed its own). They move to names of their own for the user to
      read, ``<name>.producer.log.failed-<time of its last write>`` and that with
      ``.1`` after (failed_log_path), which this producer never writes; only the logs of
      the last FAILED_LOGS_KEPT failed producers of the name are kept.
    - Rotated: once it holds LOG_MAX_BYTES or more (checked after each published batch)
      it moves to ``.1`` likewise and a new log goes on, so the output of one producer
      takes at most about twice that. Loader workers started before the move write on
      into the moved file until they are started again (each epoch, unless
      ``persistent_workers=True``).
    - Removed, with the older part where this producer wrote it, when the producer ends
      cleanly (its epochs read, or idle_timeout), under the share lock, so that it never
      removes the log of the next producer of the name (which opens its own under that
      lock). A producer that failed, or was stopped by a signal, leaves its log for the
      user; ``tensorsocket clean`` removes it once no producer of the name runs."""

    _FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW

    def __init__(self, path: Path) -> None:
        """Set up; see the class docstring."""
        self.path = path
        self.older = older_log_path(path)
        self._mutex = threading.Lock()  # the main thread rotates, the idle watch removes
        self._older_id: tuple[int, int] | None = None  # the older part, if this one's own
        self._done = False  # removed, or rotation failed: leave the files as they are

    def open(self) -> None:
        """Move a log left at the path aside; a new one becomes this process's fd 1 and 2."""
        self._move_aside()
        self._redirect()

    def rotate_if_full(self) -> None:
        """Move the log to the older part and go on in a new one, once it is full."""
        with self._mutex:
            if self._done or os.fstat(2).st_size < LOG_MAX_BYTES:
                return
            try:
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                full = _file_id(os.fstat(2))
                self._swap()
                self._older_id = full
            except OSError as e:  # the log is not worth the producer: keep writing
                self._done = True
                log.warning("cannot rotate the producer log %s (%s): it grows on", self.path, e)
                return
        log.info("the log reached %d bytes; its earlier part is in %s", LOG_MAX_BYTES,
                 self.older)

    def remove(self) -> None:
        """The producer ended cleanly: unlink its log, and the older part if its own."""
        with self._mutex:
            self._done = True
            _unlink_if_same(self.path, _file_id(os.fstat(2)))
            if self._older_id is not None:
                _unlink_if_same(self.older, self._older_id)

    def _move_aside(self) -> None:
        """Keep the log and older part an earlier producer left under a failed log's
        names, then remove failed logs beyond the last FAILED_LOGS_KEPT."""
        left = {}
        for part in (self.path, self.older):
            try:
                left[part] = os.lstat(part).st_mtime
            except FileNotFoundError:
                pass
        if not left:
            return
        kept = self._free_failed_path(max(left.values()))
        for part in left:
            os.replace(part, kept if part == self.path else failed_older_path(kept))
        self._drop_old_failed_logs()

    def _free_failed_path(self, when: float) -> Path:
        """A failed log's path for a log last written at `when` that no file has yet."""
        nth = 1
        while True:
            path = failed_log_path(self.path, when, nth)
            if not any(os.path.lexists(p) for p in (path, failed_older_path(path))):
                return path
            nth += 1

    def _drop_old_failed_logs(self) -> None:
        """Unlink the failed logs of this name (and their older parts) but the last
        FAILED_LOGS_KEPT; one that cannot be unlinked stays for ``tensorsocket clean``."""
        name = log_owner(self.path.name)
        failed: dict[tuple[str, int], list[Path]] = {}
        for entry in self.path.parent.iterdir():
            owner = failed_log_owner(entry.name)
            if owner is not None and owner[0] == name:
                failed.setdefault(owner[1], []).append(entry)
        for when in sorted(failed)[:-FAILED_LOGS_KEPT]:
            for path in failed[when]:
                try:
                    path.unlink(missing_ok=True)
                except OSError as e:
                    log.warning("cannot remove the failed producer log %s: %s", path, e)

    def _redirect(self, path: Path | None = None) -> None:
        """Create the log (or `path`) afresh and make it fd 1 and 2."""
        fd = os.open(path or self.path, self._FLAGS, 0o600)
        try:
            os.dup2(fd, 1)
            os.dup2(fd, 2)
        finally:
            os.close(fd)

    def _swap(self) -> None:
        """The log becomes the older part and a new log goes on, with no moment when
        either name is missing (for a reader, ``tail -F``): the new log and a second name
        of the full one are made under temporary names, then renamed over the two."""
        new, full = (p.with_name(p.name + STAGED_SUFFIX) for p in (self.path, self.older))
        for staged in (new, full):
            staged.unlink(missing_ok=True)  # a rotation cut short by a kill, say
        os.link(self.path, full)
        os.replace(full, self.older)
        self._redirect(new)
        os.replace(new, self.path)


def _file_id(st: os.stat_result) -> tuple[int, int]:
    """What tells one file from another: device and inode."""
    return st.st_dev, st.st_ino


def _unlink_if_same(path: Path, file_id: tuple[int, int]) -> None:
    """Unlink `path` if it is still the file `file_id` (nobody moved it, or put another)."""
    try:
        if _file_id(os.lstat(path)) == file_id:
            path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("cannot remove the producer log %s: %s", path, e)


def _setup_process(producer_log: ProducerLog) -> None:
    """stdin from /dev/null; stdout, stderr and logging to the log; clean SIGTERM."""
    producer_log.open()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
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
           producer_kw: dict, reporter: _Reporter, lock_path: Path, caller: int,
           producer_log: ProducerLog) -> int:
    """Run the producer; the exit status."""
    log.info("shared producer %r: pid %d, started by share() in pid %d; epochs=%s, "
             "idle_timeout=%s", endpoint.name, os.getpid(), caller, epochs, idle_timeout)
    try:
        producer = TensorProducer(loader, name=endpoint.name, address=endpoint.address,
                                  start_timeout=None, **{"min_consumers": 1, **producer_kw})
    except BaseException as e:
        log.exception("cannot start the producer")
        reporter.error(f"{type(e).__name__}: {e}")
        return 1
    guard = _Guard(producer, reporter, idle_timeout, lock_path, producer_log)
    status = 1
    try:
        epoch = 0
        while epochs is None or epoch < epochs:
            batches = 0
            for _ in producer:
                batches += 1
                producer_log.rotate_if_full()
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
        guard.close(ended_cleanly=status == 0)
    log.info("shared producer %r ended", endpoint.name)
    return status


class _Guard:
    """A thread of the producer process: tells the caller that started it once the first
    batch is in the ring, and ends the producer after idle_timeout without consumers.

    The producer runs with start_timeout=None (it pauses while no consumer is attached)
    and this thread decides when the pause has lasted too long, under the share lock: no
    caller is attaching then (they attach while holding it), so none can attach to a
    producer on its way out. (The producer's own start_timeout would end its epoch
    without that lock, racing a caller attaching at that moment.) A producer that ends
    cleanly removes its log under that lock too (see ProducerLog)."""

    def __init__(self, producer: TensorProducer, reporter: _Reporter,
                 idle_timeout: float | None, lock_path: Path,
                 producer_log: ProducerLog) -> None:
        """Set up; see the class docstring."""
        self._producer = producer
        self._reporter = reporter
        self._idle_timeout = idle_timeout
        self._lock_path = lock_path
        self._log = producer_log
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self.retired = False
        self._thread = threading.Thread(target=self._run, name="tensorsocket-share",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """Report the first batch, then end the producer once idle for idle_timeout."""
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
                if self._producer.consumers_present() > 0:
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
            fd = take_lock(self._lock_path, time.monotonic())  # one try: a caller may hold it
            if fd is None:
                return False
            try:
                if self._producer.consumers_present() > 0:
                    return False
                log.info("no consumer for idle_timeout=%s s: ending", self._idle_timeout)
                self.retired = True
                self._producer.close()  # the main thread's wait ends with an error
                self._closed = True
                self._log.remove()
            finally:
                release_lock(fd, self._lock_path)
            return True

    def close(self, ended_cleanly: bool) -> None:
        """Stop the thread; close the producer (under the share lock once consumers may
        have attached, so that no caller attaches to it meanwhile), and remove its log if
        it `ended_cleanly` after its first batch (a caller still waiting for that batch
        is told to read the log)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        with self._mutex:
            if self._closed:
                return
            fd = None
            if self._reporter.ok_sent:
                # Callers hold it for at most their timeout; do not wait forever.
                fd = take_lock(self._lock_path, time.monotonic() + 300)
            try:
                self._producer.close()
                self._closed = True
                if ended_cleanly and fd is not None:
                    self._log.remove()
            finally:
                if fd is not None:
                    release_lock(fd, self._lock_path)
