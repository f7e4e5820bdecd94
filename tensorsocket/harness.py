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
- ``ForkServer``: a "zygote" that has imported torch and tensorsocket once and forks a
  child per request, with its own pid, pipes, session, signals and exit status, so that a
  test suite that starts hundreds of short children does not pay for importing torch in
  each one (``spawn(..., fork_server=...)``; requests it cannot serve exactly as a fresh
  interpreter would, such as interpreter flags or a changed ``LD_PRELOAD``, start a
  fresh interpreter as usual).

Linux only, like the rest of tensorsocket; no dependency beyond the standard library.
"""

from __future__ import annotations

import array
import collections
import errno
import json
import os
import platform
import queue
import selectors
import signal
import socket
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
    "ForkServer",
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

# Variables a Python process reads as it starts (or that change what the dynamic loader,
# the allocator or the thread pools do): a request whose environment changes one of them
# gets a fresh interpreter from a ForkServer, never a fork of one started without it.
_STARTUP_VARIABLES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "OMP_", "KMP_", "GOMP_", "MKL_",
                      "OPENBLAS_", "ASAN_", "UBSAN_", "TSAN_", "LSAN_", "TORCH_", "PYTORCH_",
                      "NVIDIA_", "LANG", "LC_", "PATH", "TZ")
# ... except these, which are read later (PyTorch sizes its intra-op thread pool from
# OMP_NUM_THREADS at its first parallel op), or which the child sets its streams up for.
_LATE_VARIABLES = {"PYTHONUNBUFFERED", "PYTORCH_NVML_BASED_CUDA_CHECK",
                   "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS"}


class ChildFailed(AssertionError):
    """A child exited with a non-zero status, said nothing in time, or closed its stdout
    before saying what was asked of it. The message holds the tails of its output."""


def python_argv(*args: str | os.PathLike) -> list[str]:
    """``[sys.executable, *args]``: a script and its arguments, ``"-c", code, ...`` or
    ``"-m", module, ...``."""
    return [sys.executable, *map(os.fspath, args)]


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
    if not text:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join(text.rstrip().splitlines()[-lines:])[-chars:]


# -- process trees ------------------------------------------------------------------------


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (from /proc)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses.
        try:
            out[int(entry)] = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (ValueError, IndexError):
            continue
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
            parts.append("stderr:\n" + _tail(err))
        return ("\n" + "\n".join(parts)) if parts else ""


def spawn(argv: Sequence[str | os.PathLike], *, env: dict[str, str] | None = None,
          cwd: str | os.PathLike | None = None, stdin: Any = DEVNULL, stdout: Any = PIPE,
          stderr: Any = PIPE, text: bool = True, new_session: bool = False,
          label: str = "", fork_server: "ForkServer | None" = None,
          **popen_kw: Any) -> ChildProcess:
    """Start `argv` (see python_argv()) as a ChildProcess, by default with stdout and
    stderr piped and no stdin. With `fork_server`, a Python child it can serve is forked
    from it instead of started afresh (see ForkServer)."""
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

    def __init__(self, *, fork_server: "ForkServer | None" = None, **defaults: Any) -> None:
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


# -- the fork server ----------------------------------------------------------------------


def _send(sock: socket.socket, obj: Any, fds: Sequence[int] = ()) -> None:
    data = json.dumps(obj).encode()
    payload = len(data).to_bytes(4, "little") + data
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([payload], anc)
    if sent < len(payload):
        sock.sendall(payload[sent:])


def _recv(sock: socket.socket, max_fds: int = 0) -> tuple[Any, list[int]]:
    """One message of _send(); (None, []) at EOF."""
    if max_fds:
        data, fds, _, _ = socket.recv_fds(sock, 65536, max_fds)
    else:
        data, fds = sock.recv(65536), []
    if not data:
        return None, list(fds)
    while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "little"):
        more = sock.recv(65536)
        if not more:
            raise EOFError("fork server message cut short")
        data += more
    n = int.from_bytes(data[:4], "little")
    return json.loads(data[4:4 + n]), list(fds)


class ForkServer:
    """A process that imports `preload` once and then forks a Python child per request.

    The child is a real process of its own: its own pid (a child of the server, not of
    the caller), the caller's pipes as its stdin, stdout and stderr, a new session if
    asked, the caller's environment and working directory, Python's default signal
    handlers, and the argv of ``python script.py ...``, ``python -c code ...`` or
    ``python -m module ...``, run as that command would run it (``__main__``, sys.argv,
    sys.path[0], SystemExit, an uncaught exception, KeyboardInterrupt, non-daemon
    threads and atexit at the end). The caller gets a Popen whose wait(), poll() and
    returncode come from the server, which reaps the child (the raw wait status, so a
    death by signal reads as with Popen: -signal).

    What a fork cannot give is sent to a fresh interpreter instead (``serves()``):
    interpreter flags, preexec_fn, pass_fds, a changed variable that a process reads as
    it starts (PYTHON*, LD_*, MALLOC_*, OMP_*, ...). Modules imported by the server stay
    imported in the child (with the state they had after their import), and the child's
    heap is the server's: a test of the allocator's behaviour in a fresh process, or of
    what importing a module does, must not use it.

    The server lives as long as the process that started it (it exits when that one
    does, or on close()).
    """

    def __init__(self, preload: Sequence[str] = ("torch", "numpy", "zmq", "tensorsocket"),
                 *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
                 start_timeout: float = 300.0) -> None:
        self.preload = tuple(preload)
        self.env = dict(child_env() if env is None else env)
        self.address = f"\0tensorsocket-forkserver-{os.getpid()}-{os.urandom(6).hex()}"
        self._lock = threading.Lock()
        self.forked = 0  # children forked
        self.declined: collections.Counter[str] = collections.Counter()  # why not, how often
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.address)
        listener.listen(64)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from tensorsocket.harness import _serve; _serve()",
                 str(listener.fileno()), json.dumps(self.preload)],
                env=self.env, cwd=cwd, stdin=PIPE, stdout=DEVNULL, stderr=PIPE,
                pass_fds=[listener.fileno()], start_new_session=True)
        finally:
            listener.close()
        ready = self.proc.stderr.readline() if self.proc.stderr else b""
        if not ready.startswith(b"ready "):
            rest = ready + (self.proc.stderr.read() if self.proc.poll() is not None else b"")
            raise RuntimeError(f"the fork server did not start: {_tail(rest)}")
        # Whether /proc/PID/cmdline and environ of a forked child show its own argv and
        # environment (as ps and psutil read them), not the server's.
        self.proc_identity = ready.split()[1] == b"1"
        # Its stderr is not read any more: a message of a dying server must not block it.
        server = self

        class Forked(_ForkedPopen):
            fork_server = server

        self.popen_class: type[ChildProcess] = Forked

    def serves(self, argv: Sequence[str], env: dict[str, str] | None,
               popen_kw: dict[str, Any]) -> bool:
        """Whether a fork gives this request what a fresh interpreter would (if not, the
        reason is counted in ``declined``)."""
        why = self._why_not(argv, env, popen_kw)
        if why is not None:
            with self._lock:
                self.declined[why] += 1
        return why is None

    def _why_not(self, argv: Sequence[str], env: dict[str, str] | None,
                 popen_kw: dict[str, Any]) -> str | None:
        if self.proc.poll() is not None:
            return "the server exited"
        if len(argv) < 2 or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
            return "not this Python"
        if argv[1] in ("-c", "-m"):
            if len(argv) < 3:
                return "no code or module"
        elif argv[1].startswith("-"):
            return "interpreter flags"
        for key in ("preexec_fn", "pass_fds", "executable", "shell", "user", "group",
                    "extra_groups", "umask", "process_group"):
            if popen_kw.get(key) not in (None, (), [], False, -1):
                return key
        if popen_kw.get("close_fds") is False:
            return "close_fds=False"
        requested = os.environ if env is None else env
        for key in sorted(set(requested) | set(self.env)):
            if requested.get(key) != self.env.get(key) and key.startswith(_STARTUP_VARIABLES) \
                    and key not in _LATE_VARIABLES:
                return f"environment: {key}"
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stderr):
            if f is not None:
                f.close()


class _ForkedPopen(ChildProcess):
    """A Popen whose child is forked by a ForkServer (its class attribute)."""

    fork_server: ForkServer

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                       startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                       c2pwrite, errread, errwrite, *rest):
        # rest: restore_signals, gid, gids, uid, umask, start_new_session[, process_group]
        start_new_session = rest[5]
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
               errwrite if errwrite != -1 else 2]
        request = {"argv": [os.fspath(a) for a in args][1:],
                   "env": dict(os.environ if env is None else
                               {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()}),
                   "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
                   "new_session": bool(start_new_session)}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.fork_server.address)
            _send(conn, request, fds)
            reply, _ = _recv(conn)
            if reply is None or "pid" not in reply:
                raise OSError(errno.ECHILD, f"the fork server refused {args!r}: {reply}")
        except BaseException:
            conn.close()
            raise
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self.pid = reply["pid"]
        self._conn = conn
        self._child_created = True
        with self.fork_server._lock:
            self.fork_server.forked += 1

    def _try_wait(self, wait_flags):
        """(pid, raw status) from the server, or (0, 0) if it has not exited (WNOHANG)."""
        conn = self._conn
        if conn is None:
            return (self.pid, 0)
        if wait_flags & os.WNOHANG:
            r, _, _ = select_([conn], 0)
            if not r:
                return (0, 0)
        try:
            msg, _ = _recv(conn)
        except (OSError, EOFError, ValueError):
            msg = None
        conn.close()
        self._conn = None
        if msg is None:  # the server is gone: the child's status with it
            return (self.pid, 0)
        return (self.pid, int(msg["status"]))

    def _internal_poll(self, _deadstate=None, _waitpid=None, _WNOHANG=None, _ECHILD=None):
        if self.returncode is None:
            if not self._waitpid_lock.acquire(False):
                return None
            try:
                if self.returncode is not None:
                    return self.returncode
                pid, sts = self._try_wait(os.WNOHANG)
                if pid == self.pid:
                    self._handle_exitstatus(sts)
            except OSError:
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode


def select_(socks: list, timeout: float) -> tuple[list, list, list]:
    import select

    return select.select(socks, [], [], timeout)


# -- the server's side --------------------------------------------------------------------


def _serve() -> None:
    """Main of the fork server process: argv = [listening fd, JSON list of modules]."""
    import ctypes
    import importlib

    listen_fd, preload = int(sys.argv[1]), json.loads(sys.argv[2])
    try:  # end with the process that started us (PR_SET_PDEATHSIG)
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in preload:
        importlib.import_module(name)
    import gc

    gc.collect()
    gc.freeze()  # the children's collections leave these alone (no copy-on-write of them)
    listener = socket.socket(fileno=listen_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    conns: dict[int, socket.socket] = {}  # child pid -> the caller's connection
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "reap")
    sel.register(sys.stdin, selectors.EVENT_READ, "parent")
    # Whether a child can show its own argv and environment in /proc (see _set_identity):
    # tried on this process, with its own.
    identity = _set_identity(getattr(sys, "orig_argv", [sys.executable, *sys.argv]),
                             dict(os.environ))
    sys.stderr.write(f"ready {int(identity)}\n")
    sys.stderr.flush()

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = conns.pop(pid, None)
            if conn is not None:
                try:
                    _send(conn, {"status": status})
                except OSError:
                    pass
                sel.unregister(conn)
                conn.close()

    while True:
        for key, _ in sel.select():
            if key.data == "parent":  # our parent closed its end: it is gone
                os._exit(0)
            if key.data == "reap":
                try:
                    while os.read(wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                reap()
            elif key.data == "accept":
                conn, _ = listener.accept()
                try:
                    request, fds = _recv(conn, max_fds=3)
                except (OSError, EOFError, ValueError):
                    conn.close()
                    continue
                if request is None or len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    keep = set(fds)
                    closing = [listener.fileno(), wake_r, wake_w, sel.fileno()] + \
                        [c.fileno() for c in conns.values()] + [conn.fileno()]
                    signal.set_wakeup_fd(-1)
                    for fd in closing:
                        if fd not in keep and fd > 2:
                            try:
                                os.close(fd)
                            except OSError:
                                pass
                    _child(request, fds)  # never returns
                for fd in fds:
                    os.close(fd)
                conns[pid] = conn
                try:
                    _send(conn, {"pid": pid})
                except OSError:
                    pass
                sel.register(conn, selectors.EVENT_READ, "conn")
                reap()  # a child may have been quicker than its registration
            else:  # a caller closed its connection (it will not wait): forget it
                conn = key.fileobj
                try:
                    if conn.recv(1, socket.MSG_PEEK):
                        continue
                except OSError:
                    pass
                sel.unregister(conn)
                for pid, c in list(conns.items()):
                    if c is conn:
                        del conns[pid]
                conn.close()


_IDENTITY: list = []  # the buffers /proc/self/cmdline and environ point into now


def _set_identity(argv: list[str], env: dict[str, str]) -> bool:
    """Make /proc/self/cmdline and /proc/self/environ show `argv` and `env` (what ps,
    psutil and a test that looks for its processes by their environment read), as after
    an exec: prctl(PR_SET_MM, PR_SET_MM_MAP). False where the kernel does not allow it
    (no CONFIG_CHECKPOINT_RESTORE): they show the fork server's then."""
    import ctypes

    class MMMap(ctypes.Structure):  # struct prctl_mm_map
        _fields_ = [(n, ctypes.c_uint64) for n in (
            "start_code", "end_code", "start_data", "end_data", "start_brk", "brk",
            "start_stack", "arg_start", "arg_end", "env_start", "env_end", "auxv")] + \
            [("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sbrk.restype = ctypes.c_void_p
        libc.sbrk.argtypes = (ctypes.c_ssize_t,)
        with open("/proc/self/stat") as f:
            stat = f.read()
        fields = stat[stat.rindex(")") + 2:].split()

        def field(n: int) -> int:  # proc(5) numbers the fields from 1; fields[0] is 3
            return int(fields[n - 3])

        args = b"".join(os.fsencode(a) + b"\0" for a in argv)
        environ = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0"
                           for k, v in env.items())
        block = ctypes.create_string_buffer(args + environ, len(args) + len(environ))
        with open("/proc/self/auxv", "rb") as f:
            auxv_bytes = f.read()
        auxv = ctypes.create_string_buffer(auxv_bytes, len(auxv_bytes))
        base = ctypes.addressof(block)
        m = MMMap(start_code=field(26), end_code=field(27), start_data=field(45),
                  end_data=field(46), start_brk=field(47), brk=libc.sbrk(0) or 0,
                  start_stack=field(28), arg_start=base, arg_end=base + len(args),
                  env_start=base + len(args), env_end=base + len(args) + len(environ),
                  auxv=ctypes.addressof(auxv), auxv_size=len(auxv_bytes),
                  exe_fd=0xFFFFFFFF)
        if libc.prctl(35, 14, ctypes.byref(m), ctypes.sizeof(m), 0) != 0:  # PR_SET_MM_MAP
            return False
    except (OSError, ValueError, IndexError, AttributeError):
        return False
    _IDENTITY[:] = [block, auxv]
    return True


def _child(request: dict, fds: list[int]) -> None:
    """In a forked child of the server: become `python argv...` and exit as it would."""
    import io
    import tempfile
    import types

    code = 1
    try:
        if request["new_session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target, inheritable=True)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                    signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it at start-up
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _set_identity([sys.executable, *request["argv"]], request["env"])
        tempfile.tempdir = None
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                     encoding=sys.stdin.encoding, errors="strict") \
            if sys.stdin is not None else None
        unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))  # as python -u

        def writer(fd: int, errors: str, line_buffering: bool) -> io.TextIOWrapper:
            raw = io.FileIO(fd, "w", closefd=False)
            return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw),
                                    encoding="utf-8", errors=errors,
                                    line_buffering=line_buffering, write_through=unbuffered)

        sys.stdout = writer(1, "strict", os.isatty(1))
        sys.stderr = writer(2, "backslashreplace", True)
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        argv = request["argv"]
        main = types.ModuleType("__main__")
        main.__dict__.update(__builtins__=__builtins__, __spec__=None, __package__=None,
                             __loader__=None)
        sys.modules["__main__"] = main
        sys.orig_argv = [sys.executable, *argv]
        code = _run_main(argv, main)
    except SystemExit as e:
        code = _exit_status(e)
    except BaseException:  # noqa: BLE001 - as the interpreter would report it
        try:
            sys.excepthook(*sys.exc_info())
        except BaseException:  # noqa: BLE001
            pass
        code = 1
    os._exit(code)


def _run_main(argv: list[str], main: Any) -> int:
    """Run argv as the interpreter would, then finish as it does; the exit status."""
    import atexit
    import gc
    import runpy

    interrupted = False
    try:
        try:
            if argv[0] == "-c":
                sys.argv = ["-c", *argv[2:]]
                sys.path[0] = ""
                exec(compile(argv[1], "<string>", "exec"), main.__dict__)
            elif argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                sys.path[0] = os.getcwd()
                runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore
            else:
                path = argv[0]
                sys.argv = list(argv)
                sys.path[0] = os.path.dirname(os.path.realpath(path))
                main.__dict__.update(__file__=path, __cached__=None)
                with open(path, "rb") as f:
                    source = f.read()
                exec(compile(source, path, "exec"), main.__dict__)
            code = 0
        except SystemExit as e:
            code = _exit_status(e)
        except KeyboardInterrupt:
            _report(*sys.exc_info())
            interrupted, code = True, 1
        except BaseException:  # noqa: BLE001 - as the interpreter would report it
            _report(*sys.exc_info())
            code = 1
        # The end of Py_FinalizeEx: non-daemon threads, atexit, module globals.
        try:
            threading._shutdown()  # type: ignore[attr-defined]
        except BaseException:  # noqa: BLE001
            pass
        atexit._run_exitfuncs()
        main.__dict__.clear()
        gc.collect()
    except SystemExit as e:  # raised by a thread's or atexit's code
        code = _exit_status(e)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - Python exits with 120 when it cannot flush
            code = 120 if code == 0 else code
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _report(kind: Any, value: Any, tb: Any) -> None:
    """sys.excepthook without the frame of _run_main (not the program's)."""
    sys.excepthook(kind, value, tb.tb_next if tb is not None and tb.tb_next else tb)


def _exit_status(e: SystemExit) -> int:
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except BaseException:  # noqa: BLE001
        pass
    return 1
