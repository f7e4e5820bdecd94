"""A fork server for the test suite: a process that imported torch, numpy, zmq and
tensorsocket once and forks a Python child per request (tools.harness.spawn's
`fork_server`). A fresh interpreter spends 1-3 s of CPU importing torch; the suite starts
hundreds of short children. Test support only: it rewrites what /proc shows of a child
(prctl PR_SET_MM_MAP) and replays the interpreter's start and end in Python.

Linux only; no dependency beyond the standard library and tools.harness.
"""

from __future__ import annotations

import array
import collections
import errno
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

from tools.harness import ChildProcess, _tail, child_env

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
HERE = Path(__file__).resolve().parent

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
                [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); "
                 "from fork_server import _serve; _serve()",
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
