"""Shared fixtures: unique producer names, role processes, leak checks."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import uuid
from typing import Any
from pathlib import Path

import pytest

from tools import harness

from fork_server import ForkServer

# Most tests start one producer after another and attach their consumers before the first
# batch on purpose: the 3 s start grace (jobs started together begin at batch 0) would
# only slow them down. Tests of the grace itself, and of jobs started together (the real
# framework clients), set it explicitly.
os.environ.setdefault("TENSORSOCKET_START_GRACE", "0")

# A suite started in the background of a non-interactive shell (`cmd &`, nohup) inherits
# SIGINT ignored, and so would every process it starts: the Ctrl-C tests would see their
# SIGINT vanish. The test processes start as they would from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).resolve().parent.parent
ROLES = Path(__file__).resolve().parent / "roles.py"

# Processes the tests start import the tensorsocket of this tree, whatever an editable
# install elsewhere (another checkout) says.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))


def pytest_addoption(parser):
    parser.addoption("--fault-table", metavar="PATH",
                     help="write the fault table of tests/test_faults.py to PATH (Markdown); "
                          "runs the tests in this process (no -n workers)")


def pytest_configure(config):
    # The fault table is one session's rows: with pytest-xdist's workers each would write
    # its own part. (xdist starts its workers in a later pytest_configure.)
    if config.getoption("--fault-table") and getattr(config.option, "numprocesses", None):
        config.option.numprocesses = 0
        config.option.dist = "no"


@pytest.fixture
def short_tmp():
    """A private temporary directory with a short path, for runtime directories: under
    pytest-xdist tmp_path is too long for the ipc:// socket paths in it (108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ts-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


# Seconds the torchvision_env fixture may spend installing (pip from PyPI, gcc) once.
TORCHVISION_SETUP_TIMEOUT = float(os.environ.get("TS_TEST_TORCHVISION_TIMEOUT", "600"))


@pytest.fixture(scope="session")
def torchvision_env() -> dict[str, str]:
    """The environment variables under which a child process imports real torchvision and
    timm (tools/torchvision_cpu: installed into .cache/ on first use, PyPI's CUDA build
    made to load beside a CPU-only torch; {} where they import natively). Skips the test
    with the reason where they cannot be had (no network, no gcc, another torch)."""
    from tools import torchvision_cpu

    try:
        return torchvision_cpu.ensure(timeout=TORCHVISION_SETUP_TIMEOUT, log=lambda line: None)
    except torchvision_cpu.Unavailable as e:
        pytest.skip(f"real torchvision unavailable: {e}")


def hello_message(pid: int, **fields) -> bytes:
    """A well-formed hello of the control protocol claiming `pid` (a forger's, in the tests
    of who may attach); every field not given (the secret, which another user does not
    know) is left empty."""
    from tensorsocket import _core
    from tensorsocket.control import protocol

    msg = dict(protocol=protocol.PROTOCOL_VERSION, pid=pid,
               start_time=_core.process_start_time(pid), batch_size=None, group=None,
               rank=0, world_size=1)
    msg.update(fields)
    for field in protocol.SCHEMAS["hello"]:
        msg.setdefault(field, None)
    return protocol.encode("hello", **msg)


def alive(pid: int) -> bool:
    """Whether process pid exists and is not a zombie (waiting for its parent's wait)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def shm_segments(name: str | None = None) -> list[str]:
    """tensorsocket segments in /dev/shm (of producer `name` if given)."""
    prefix = f"tensorsocket-{os.getuid()}-" + (f"{name}-" if name else "")
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(prefix))


@pytest.fixture
def name():
    """A producer name unique to this test; asserts no segment of it is left behind."""
    n = f"t-{uuid.uuid4().hex[:10]}"
    yield n
    leaked = shm_segments(n)
    # A SIGKILLed producer cannot remove its socket and lock files (a later producer of
    # the same name reuses them); test_nothing_left_behind checks a clean exit does.
    from tensorsocket.control.endpoints import runtime_dir

    for path in runtime_dir().glob(n + "[.-]*"):  # (the test's names, and n-<suffix>)
        path.unlink()
    for seg in leaked:
        os.unlink(f"/dev/shm/{seg}")
    assert leaked == [], f"leaked segments: {leaked}"


# -- child processes ---------------------------------------------------------------------
#
# Every test that starts Python children goes through tools.harness: procs.start()
# and procs.script() below, or popen() / run() (subprocess.Popen / subprocess.run for a
# Python argv). They are forked from one fork server per test process, which imported
# torch and tensorsocket once (a fresh interpreter spends 1-3 s of CPU on that, and the
# suite starts hundreds of children); what a fork cannot give exactly (interpreter flags,
# a changed LD_PRELOAD, ...) starts a fresh interpreter, see tests/fork_server.py.
# TS_TEST_FORK_SERVER=0 starts every child afresh.

_FORK_SERVER: list = []  # [ForkServer] once started (one per pytest process)
_FORK_SERVER_LOCK = threading.Lock()


def fork_server():
    """This process's ForkServer (started at first use), or None where it is off."""
    if os.environ.get("TS_TEST_FORK_SERVER", "1") == "0":
        return None
    with _FORK_SERVER_LOCK:
        if not _FORK_SERVER:
            _FORK_SERVER.append(ForkServer(cwd=ROOT))
        return _FORK_SERVER[0]


def pytest_unconfigure(config):
    for server in _FORK_SERVER:
        server.close()
        if os.environ.get("TS_TEST_FORK_LOG"):  # how many children were forked, and why not
            import json

            with open(os.environ["TS_TEST_FORK_LOG"], "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "forked": server.forked,
                                    "declined": dict(server.declined)}) + "\n")


def _server(fork: bool | str):
    """The fork server for a child: fork=True, False, or "identity": only where a forked
    child's /proc/PID/cmdline and environ show its own (a test that finds its processes by
    their environment or command line; ForkServer.proc_identity)."""
    server = fork_server() if fork else None
    if server is not None and fork == "identity" and not server.proc_identity:
        return None
    return server


def popen(args, *, fork: bool | str = True, **kw) -> harness.ChildProcess:
    """subprocess.Popen(args, **kw) of a Python child, forked from the fork server unless
    fork=False (a test of what a fresh interpreter does: its heap, its imports); see
    _server() for fork="identity"."""
    text = kw.pop("text", False) or kw.pop("universal_newlines", False)
    return harness.spawn(args, stdin=kw.pop("stdin", None), stdout=kw.pop("stdout", None),
                         stderr=kw.pop("stderr", None), text=text,
                         new_session=kw.pop("start_new_session", False),
                         fork_server=_server(fork), **kw)


def run(args, *, input=None, capture_output: bool = False, timeout: float | None = None,
        check: bool = False, fork: bool | str = True, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(args, ...) of a Python child, through popen()."""
    if capture_output:
        kw["stdout"] = kw["stderr"] = subprocess.PIPE
    if input is not None:
        kw["stdin"] = subprocess.PIPE
    with popen(args, fork=fork, **kw) as p:
        try:
            out, err = p.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill_tree()
            p.communicate()
            raise
    if check and p.returncode:
        raise subprocess.CalledProcessError(p.returncode, args, out, err)
    return subprocess.CompletedProcess(args, p.returncode, out, err)


class Procs:
    """Role processes started by one test; those still running at teardown are killed
    with their process trees, and the rings of the ones killed so are removed (see
    kill_all)."""

    def __init__(self) -> None:
        self.children = harness.Children(fork_server=fork_server(), cwd=ROOT, stdin=None)

    @property
    def procs(self) -> list[harness.ChildProcess]:
        return self.children.procs

    def start(self, role: str, *args: str, env: dict | None = None,
              fork: bool = True) -> harness.ChildProcess:
        """Run tests/roles.py as `role` (producer, consumer) with these options."""
        return self._run([str(ROLES), role, *args], env, fork, role)

    def script(self, code: str, *args: str, env: dict | None = None,
               fork: bool = True) -> harness.ChildProcess:
        """Run `python -c code args`."""
        return self._run(["-c", code, *args], env, fork, "script")

    def _run(self, argv: list[str], env: dict | None, fork: bool,
             label: str) -> harness.ChildProcess:
        return self.children.spawn(harness.python_argv(*argv), label=label,
                                   env={**os.environ, **env} if env else None,
                                   **({} if fork else {"fork_server": None}))

    def wait_ready(self, p: harness.ChildProcess, timeout: float = 60) -> dict:
        """Read the process's first JSON line ('ready')."""
        return p.wait_ready(timeout)

    def result(self, p: harness.ChildProcess, timeout: float = 120) -> dict:
        """Wait for the process (exit status 0) and parse its last JSON line."""
        return p.result(timeout)

    def kill_all(self) -> None:
        """SIGKILL the processes still running (and everything they started), then remove
        the segments of those that were producers: a SIGKILLed producer cannot, and
        whether one of its consumers noticed its death and removed the segment (the last
        one out does) must not depend on the order of the kills. A producer that ended by
        itself is not touched here, so the `name` fixture still finds a segment it
        leaked."""
        killed = self.children.kill_all()
        prefix = f"tensorsocket-{os.getuid()}-"
        for seg in os.listdir("/dev/shm"):
            if seg.startswith(prefix) and any(seg.endswith(f"-{pid}") for pid in killed):
                try:
                    os.unlink(f"/dev/shm/{seg}")
                except FileNotFoundError:
                    pass  # its last consumer removed it after all


@pytest.fixture
def procs(name):
    """Starts processes for the test (see Procs). It depends on `name` so that it is torn
    down first: the processes are gone when `name` checks for leaked segments."""
    ps = Procs()
    yield ps
    ps.kill_all()


class Producing(threading.Thread):
    """Iterate a producer in a thread: one epoch, or (forever) epochs until stop(); errors
    are kept for the test."""

    def __init__(self, producer: Any, forever: bool = False) -> None:
        super().__init__(daemon=True, name="producer")
        self.producer = producer
        self.forever = forever
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while True:
                for _ in self.producer:
                    pass
                if not self.forever or self.stopping.is_set():
                    break
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def stop(self) -> None:
        """No epoch after the one running (forever)."""
        self.stopping.set()


# The test files that add rows to the fault table (docs/faults.md).
FAULT_TABLE_FILES = ("tests/test_faults.py", "tests/test_fork.py", "tests/test_kept_batches.py",
                     "tests/test_interrupted_pulls.py", "tests/test_hostile_tcp.py",
                     "tests/test_tcp_flood.py", "tests/test_transform_faults.py",
                     "tests/test_cache_faults.py", "tests/test_store.py")


class FaultTable:
    """Rows of the fault table, filled by the tests of FAULT_TABLE_FILES."""

    HEADER = ("| fault | detection | what the others saw | left behind |\n"
              "|---|---|---|---|\n")

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []

    def add(self, fault: str, detection: str, survivors: str, left: str) -> None:
        self.rows.append((fault, detection, survivors, left))

    def markdown(self) -> str:
        import platform

        lines = [f"| {' | '.join(row)} |" for row in self.rows]
        return (
            "# Fault table\n\n"
            f"Written by `python -m pytest {' '.join(FAULT_TABLE_FILES)} "
            "--fault-table docs/faults.md`"
            f" on a {os.cpu_count()}-CPU {platform.machine()} "
            f"Linux {platform.release()}, Python {platform.python_version()}. Times are "
            "measured by the tests (CLOCK_MONOTONIC) from the fault to its detection.\n\n"
            + self.HEADER + "\n".join(lines) + "\n"
        )


@pytest.fixture(scope="session")
def fault_table(request):
    table = FaultTable()
    yield table
    path = request.config.getoption("--fault-table")
    if path and table.rows:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(table.markdown())
