"""Child processes for the tests, the benchmarks, the examples and the demo.

One way to start a Python child, talk to it and get rid of it, used by everything in this
repository that runs producers and consumers as real processes:

- ``spawn(argv, ...)`` starts a child and returns a ``ChildProcess``: a
  ``subprocess.Popen`` (pid, pipes, ``wait``, ``communicate``, ``send_signal``) with a
  label and the helpers below. ``python_argv()`` builds the argv of a Python child and
  ``child_env()`` its environment (this tree first on ``PYTHONPATH``, so that a child
  imports the same tensorsocket as its parent; optionally one thread per library).
- The JSON-line protocol: a child reports by printing one JSON object per stdout line
  (optionally after a marker string; ``emit()``). ``read_json()`` / ``wait_ready()`` read the next
  one (the first one is the child's "ready"), ``result()`` waits for the child and
  returns the last one, raising ``ChildFailed`` with the tails of its output if it
  failed; ``follow()`` hands every event to a queue from reader threads, for a parent
  that watches several children at once (the demo, examples/sweep.py).
- ``kill_tree()`` / ``stop()``: a child and every process it started (its process tree,
  read from /proc), SIGKILLed at once or SIGTERMed with a grace period; ``Children``
  keeps the children of one test or run and does this to all of them at the end.
- ``machine_info()``: cores, load, CPU model, memory and the versions that a benchmark
  result should carry.
- ``spawn(..., fork_server=...)``: a launcher that forks Python children from a process
  that imported torch once, instead of starting each afresh (the test suite's, in
  tests/fork_server.py: it starts hundreds of short children).

Linux only, like the rest of tensorsocket; no dependency beyond the standard library, and
tensorsocket's own /proc parser for process trees (its built C extension, loaded alone on
the first walk of a tree: see ``_process_stat``).
"""

from __future__ import annotations

import collections
import functools
import importlib.machinery
import importlib.util
import json
import os
import platform
import queue
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = [
    "ChildFailed",
    "ChildProcess",
    "Children",
    "ROOT",
    "child_env",
    "descendants",
    "emit",
    "json_lines",
    "kill_tree",
    "loadavg",
    "machine_info",
    "meminfo_gb",
    "python_argv",
    "spawn",
]

ROOT = Path(__file__).resolve().parent.parent
"""The directory that holds this tensorsocket package (the repository root in a checkout)."""

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT


class ChildFailed(AssertionError):
    """A child exited with a non-zero status, said nothing in time, or closed its stdout
    before saying what was asked of it. The message holds the tails of its output."""


def python_argv(*args: str | os.PathLike[str]) -> list[str]:
    """``[sys.executable, *args]``: a script and its arguments, ``"-c", code, ...`` or
    ``"-m", module, ...``."""
    return [sys.executable, *[os.fspath(a) for a in args]]


def child_env(extra: dict[str, str] | None = None, *, threads: int | None = None,
              base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a Python child: `base` (os.environ) with, where this tensorsocket
    is a checkout (not an installed package), the checkout first on PYTHONPATH, `extra` on
    top; with `threads`, OMP/MKL/OpenBLAS thread counts unless set already."""
    env = dict(os.environ if base is None else base)
    if (ROOT / "setup.py").is_file():
        parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(ROOT) not in parts:
            parts.insert(0, str(ROOT))
        env["PYTHONPATH"] = os.pathsep.join(parts)
    if threads is not None:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env.setdefault(var, str(threads))
    if extra:
        env.update(extra)
    return env


def emit(obj: dict, marker: str = "", file: Any = None) -> None:
    """The child's side of the JSON-line protocol: print `obj` as one JSON line (after
    `marker`) on stdout, flushed."""
    out = sys.stdout if file is None else file
    out.write(marker + json.dumps(obj, separators=(",", ":")) + "\n")
    out.flush()


def keep_log_and_warnings(logger: str = "tensorsocket") -> tuple[list, list]:
    """In a child: from now on, every record of `logger` (INFO and up) as [level, message]
    and every warning as [category, message], in the two lists returned (for emit())."""
    import logging
    import warnings

    records: list = []
    caught: list = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append([record.levelname, record.getMessage()])

    log = logging.getLogger(logger)
    log.setLevel(logging.INFO)
    log.addHandler(Keep())
    warnings.simplefilter("always")
    warnings.showwarning = lambda message, category, *a, **k: caught.append(
        [category.__name__, str(message)])
    return records, caught


def json_lines(text: str, marker: str = "") -> list[dict]:
    """The JSON objects among the lines of `text` (those after `marker`, if given)."""
    out = []
    for line in text.splitlines():
        obj = _parse_line(line, marker)
        if obj is not None:
            out.append(obj)
    return out


def _parse_line(line: str, marker: str = "") -> dict | None:
    line = line.strip()
    if marker:
        if not line.startswith(marker):
            return None
        line = line[len(marker):].strip()
    if not line.startswith("{"):
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _tail(text: str | bytes | None, lines: int = 30, chars: int = 4000) -> str:
    """The last `lines` lines of `text` (at most `chars` characters)."""
    if not text:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join(text.rstrip().splitlines()[-lines:])[-chars:]


def _ends(text: str | bytes | None, head: int = 25, tail: int = 30) -> str:
    """`text`'s first `head` and last `tail` lines: a child's first traceback (what went
    wrong) and its last (how it ended), with how many lines lie between them."""
    if not text:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    rows = text.rstrip().splitlines()
    if len(rows) <= head + tail:
        return _tail(text, head + tail, 8000)
    return "\n".join(rows[:head])[:4000] + f"\n[... {len(rows) - head - tail} lines ...]\n" \
        + _tail(text, tail)


# -- process trees ------------------------------------------------------------------------


@functools.cache
def _process_stat() -> Any:
    """tensorsocket's parser of /proc/<pid>/stat, ``_core.process_stat`` (csrc/base/ts_proc.c,
    the one parser of that file in this repository): the extension already imported here,
    else the one built in this tree, loaded by itself. Importing the package would import
    torch into every process that walks a tree (benchmark orchestrators among them); the
    extension alone has no import and no side effect beyond its module. Loaded on the first
    walk, never at import: children that import the harness without walking a tree never
    load it."""
    core = sys.modules.get("tensorsocket._core")
    if core is None:
        package = ROOT / "tensorsocket"
        built = [package / f"_core{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
        path = next((p for p in built if p.is_file()), None)
        if path is None:
            raise RuntimeError(f"the harness reads process trees with tensorsocket's /proc "
                               f"parser, and {package} has no built extension: run "
                               "`python3 setup.py build_ext --inplace` first")
        spec = importlib.util.spec_from_file_location("tensorsocket._core", path)
        assert spec is not None and spec.loader is not None
        core = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(core)
    return core.process_stat


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) of process pid itself, None if it is gone."""
    stat = _process_stat()(pid)
    if stat is None:
        return None
    return (stat["utime"] + stat["stime"]) / os.sysconf("SC_CLK_TCK")


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (from /proc)."""
    process_stat = _process_stat()
    out = {}
    for entry in os.listdir("/proc"):
        stat = process_stat(int(entry)) if entry.isdigit() else None
        if stat is not None:  # else not a process, or gone meanwhile
            out[int(entry)] = stat["ppid"]
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children first, then theirs), from /proc."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for child, parent in _parents().items():
        children[parent].append(child)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), ()):
            if child not in out:
                out.append(child)
                todo.append(child)
    return out


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kill_tree(pid: int, sig: int = signal.SIGKILL, *, include_root: bool = True) -> list[int]:
    """Send `sig` to `pid` and every process below it; the pids signalled.

    For SIGKILL the tree is frozen first (SIGSTOP until no new process appears), so that
    nothing it forks meanwhile escapes, and nothing is reparented before it is found.
    A process that left the tree before (a double-forked daemon) is not in it."""
    if sig == signal.SIGKILL:
        frozen: list[int] = []
        for _ in range(20):
            tree = ([pid] if include_root else []) + descendants(pid)
            new = [p for p in tree if p not in frozen]
            if not new:
                break
            for p in new:
                _signal(p, signal.SIGSTOP)
            frozen += new
        return [p for p in frozen if _signal(p, signal.SIGKILL)]
    tree = ([pid] if include_root else []) + descendants(pid)
    return [p for p in tree if _signal(p, sig)]


# -- one child ----------------------------------------------------------------------------


class ChildProcess(subprocess.Popen):
    """A child started by ``spawn()``: a Popen with a label, the JSON-line protocol and
    process-tree termination."""

    label: str = ""
    _pending: bytes = b""  # stdout bytes read by read_json() past its line

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.label or self.args!r} pid {self.pid}>"

    # -- the JSON-line protocol

    def read_json(self, timeout: float = 60, *, marker: str = "",
                  what: str = "a JSON line") -> dict:
        """The next JSON object the child prints on stdout (after `marker`); other lines
        are kept in ``chatter``. ChildFailed if none comes within `timeout` or stdout
        closes first (with the child's stderr if it exited)."""
        if self.stdout is None:
            raise ValueError("read_json() needs stdout=PIPE")
        fd = self.stdout.fileno()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                while b"\n" in self._pending:
                    raw, self._pending = self._pending.split(b"\n", 1)
                    line = raw.decode(errors="replace")
                    obj = _parse_line(line, marker)
                    if obj is not None:
                        return obj
                    self.chatter.append(line)
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise ChildFailed(f"{self._name()} printed no {what} within {timeout:g} s"
                                      + self._said())
                data = os.read(fd, 65536)
                if not data:
                    err = ""
                    try:
                        self.wait(timeout=min(10.0, max(1.0, deadline - time.monotonic())))
                        err = self.stderr.read() if self.stderr is not None else ""
                    except subprocess.TimeoutExpired:
                        pass
                    raise ChildFailed(f"{self._name()} closed its stdout before {what} "
                                      f"(exit {self.returncode})" + self._said(err=err))
                self._pending += data

    def wait_ready(self, timeout: float = 60, *, marker: str = "") -> dict:
        """The child's first JSON line (by convention it says it is ready)."""
        return self.read_json(timeout, marker=marker, what="its ready line")

    @property
    def chatter(self) -> list[str]:
        """The stdout lines read by read_json() that were not JSON."""
        if "_chatter" not in self.__dict__:
            self._chatter: list[str] = []
        return self._chatter

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple:
        out, err = super().communicate(input, timeout)
        if self._pending and out is not None:
            pending, self._pending = self._pending, b""
            out = (pending.decode(errors="replace") if isinstance(out, str) else pending) + out
        return out, err

    def result(self, timeout: float = 120, *, marker: str = "", check: bool = True) -> dict:
        """Wait for the child (at most `timeout`) and return the last JSON line it printed.
        ChildFailed if it exited non-zero (with `check`), printed none, or did not exit
        in time (it is then left running; Children.kill_all() ends it)."""
        try:
            out, err = self.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ChildFailed(f"{self._name()} did not exit within {timeout:g} s") from None
        if check and self.returncode != 0:
            raise ChildFailed(f"{self._name()} exited with {self.returncode}"
                              + self._said(out, err))
        found = json_lines(out or "", marker)
        if not found:
            raise ChildFailed(f"{self._name()} printed no JSON line (exit {self.returncode})"
                              + self._said(out, err))
        return found[-1]

    # -- watching from threads

    def follow(self, events: "queue.Queue[tuple[Any, dict]]", *, marker: str = "",
               tag: Any = None, echo: Any = None) -> None:
        """Read the child's output in two daemon threads: every JSON line of stdout (after
        `marker`) goes to `events` as ``(tag, obj)`` (tag: this child unless given), then
        ``(tag, {"event": "eof"})`` when stdout closes; every other line, and stderr, is
        kept in ``tail`` (the last 40), and stdout's are passed to `echo(line)` if given."""
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        who = self if tag is None else tag

        def read_stdout() -> None:
            assert self.stdout is not None
            for line in self.stdout:
                obj = _parse_line(line, marker)
                if obj is None:
                    self.tail.append(line.rstrip("\n"))
                    if echo is not None:
                        echo(line.rstrip("\n"))
                else:
                    events.put((who, obj))
            events.put((who, {"event": "eof"}))

        def read_stderr() -> None:
            assert self.stderr is not None
            for line in self.stderr:
                self.tail.append(line.rstrip("\n"))

        self.readers = [threading.Thread(target=read_stdout, daemon=True)]
        if self.stderr is not None:
            self.readers.append(threading.Thread(target=read_stderr, daemon=True))
        for t in self.readers:
            t.start()

    # -- ending it

    def kill_tree(self, sig: int = signal.SIGKILL) -> list[int]:
        """Send `sig` to the child and every process below it (see kill_tree()); the pids
        signalled. Nothing if the child was reaped already."""
        if self.poll() is not None:
            return []
        return kill_tree(self.pid, sig)

    def stop(self, grace: float = 3.0) -> int | None:
        """SIGTERM the child's tree, SIGKILL what is left of it after `grace` s, reap the
        child; its exit status."""
        tree = [self.pid] + descendants(self.pid) if self.poll() is None else []
        for pid in tree:
            _signal(pid, signal.SIGTERM)
        try:
            self.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        for pid in tree + (descendants(self.pid) if self.poll() is None else []):
            if pid == self.pid and self.returncode is not None:
                continue
            _signal(pid, signal.SIGKILL)
        try:
            self.wait(timeout=max(grace, 10.0))
        except subprocess.TimeoutExpired:
            pass
        for t in getattr(self, "readers", ()):
            t.join(timeout=1.0)
        return self.returncode

    def _name(self) -> str:
        return f"{self.label or 'child'} (pid {self.pid})"

    def _said(self, out: str | None = None, err: str | None = None) -> str:
        parts = []
        if self.chatter:
            parts.append("stdout before:\n" + _tail("\n".join(self.chatter)))
        if out:
            parts.append("stdout:\n" + _tail(out))
        if err:
            parts.append("stderr:\n" + _ends(err))
        return ("\n" + "\n".join(parts)) if parts else ""


def spawn(argv: Sequence[str | os.PathLike], *, env: dict[str, str] | None = None,
          cwd: str | os.PathLike | None = None, stdin: Any = DEVNULL, stdout: Any = PIPE,
          stderr: Any = PIPE, text: bool = True, new_session: bool = False,
          label: str = "", fork_server: Any = None,
          **popen_kw: Any) -> ChildProcess:
    """Start `argv` (see python_argv()) as a ChildProcess, by default with stdout and
    stderr piped and no stdin. `fork_server`: a launcher (``serves(argv, env, popen_kw)``
    and ``popen_class``, a ChildProcess subclass) that starts the children it serves in
    its own way, e.g. forked from a process that imported torch once."""
    argv = [os.fspath(a) for a in argv]
    kw = dict(env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
              start_new_session=new_session, **popen_kw)
    cls: type[ChildProcess] = ChildProcess
    if fork_server is not None and fork_server.serves(argv, env, popen_kw):
        cls = fork_server.popen_class
    p = cls(argv, **kw)
    p.label = label
    return p


class Children:
    """The children of one test or run: ``spawn()`` them here, and ``kill_all()`` (or
    leaving the ``with`` block) SIGKILLs the process tree of each one still running and
    reaps them."""

    def __init__(self, *, fork_server: Any = None, **defaults: Any) -> None:
        self.procs: list[ChildProcess] = []
        self.fork_server = fork_server
        self.defaults = defaults

    def spawn(self, argv: Sequence[str | os.PathLike], **kw: Any) -> ChildProcess:
        p = spawn(argv, **{"fork_server": self.fork_server, **self.defaults, **kw})
        self.procs.append(p)
        return p

    def kill_all(self) -> list[int]:
        """SIGKILL the tree of every child still running, then reap every child and close
        its pipes; the pids killed."""
        killed = []
        for p in self.procs:
            if p.poll() is None:
                killed += kill_tree(p.pid, signal.SIGKILL)
        for p in self.procs:
            try:
                p.communicate(timeout=10)
            except Exception:  # noqa: BLE001 - teardown: the others still get reaped
                pass
        return killed

    def stop_all(self, grace: float = 3.0) -> None:
        """SIGTERM every child's tree, then SIGKILL what is left after `grace` s."""
        for p in self.procs:
            if p.poll() is None:
                for pid in [p.pid] + descendants(p.pid):
                    _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:  # SIGKILL what is left (any Popen); reap; join follow()'s readers
            if p.poll() is None:
                kill_tree(p.pid, signal.SIGKILL)
            try:
                p.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                pass
            for t in getattr(p, "readers", ()):
                t.join(timeout=1.0)

    def __enter__(self) -> "Children":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill_all()


# -- the machine --------------------------------------------------------------------------


def machine_busy_seconds() -> float | None:
    """CPU-seconds the CPUs this process may run on spent busy since boot (/proc/stat's
    per-CPU lines: user, nice, system, irq, softirq; not idle, iowait, nor steal, the
    time a hypervisor gave to other guests); None where it cannot be read. On a shared
    host the other CPUs' work is not this machine's business."""
    mine = {f"cpu{n}" for n in os.sched_getaffinity(0)}
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu")]
    except OSError:
        return None
    busy = 0
    for fields in lines:
        if fields[0] in mine:
            ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
            busy += ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]
    return busy / os.sysconf("SC_CLK_TCK")


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def meminfo_gb(field: str) -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return round(int(line.split()[1]) * 1024 / 1e9, 2)
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine_info(packages: Iterable[str] = ("torch", "numpy", "zmq")) -> dict:
    """This machine (cores, usable cores, CPU model, memory, load now) and the versions of
    Python and of `packages` (imported here; None where one does not import)."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "cpu_model": _cpu_model(),
        "mem_total_gb": meminfo_gb("MemTotal"),
        "mem_available_gb": meminfo_gb("MemAvailable"),
        "loadavg_start": loadavg(),
    }
    for mod in packages:
        key = "pyzmq" if mod == "zmq" else mod
        try:
            info[key] = __import__(mod).__version__
        except Exception:  # an informational field only
            info[key] = None
    return info
