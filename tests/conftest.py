"""Shared fixtures: unique producer names, role processes, leak checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

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
    parser.addoption("--run-slow", action="store_true", help="run long soak tests")
    parser.addoption("--fault-table", metavar="PATH",
                     help="write the fault table of tests/test_faults.py to PATH (Markdown)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="long run: pass --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


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
    from tensorsocket.endpoints import runtime_dir

    for path in runtime_dir().glob(n + ".*"):
        path.unlink()
    for seg in leaked:
        os.unlink(f"/dev/shm/{seg}")
    assert leaked == [], f"leaked segments: {leaked}"


class Procs:
    """Role processes started by one test; those still running at teardown are killed,
    and the rings of the ones killed so are removed (see kill_all)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, role: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        """Run tests/roles.py as `role` (producer, consumer) with these options."""
        return self._run([str(ROLES), role, *args], env)

    def script(self, code: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        """Run `python -c code args`."""
        return self._run(["-c", code, *args], env)

    def _run(self, argv: list[str], env: dict | None) -> subprocess.Popen:
        p = subprocess.Popen(
            [sys.executable, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, **env} if env else None,
        )
        self.procs.append(p)
        return p

    def wait_ready(self, p: subprocess.Popen, timeout: float = 60) -> dict:
        """Read the producer's first JSON line ('ready')."""
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(p.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError("process did not become ready")
        line = p.stdout.readline()
        if not line:
            raise AssertionError(f"process exited: {p.stderr.read()}")
        return json.loads(line)

    def result(self, p: subprocess.Popen, timeout: float = 120) -> dict:
        """Wait for the process and parse its last JSON line."""
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"exit {p.returncode}\nstdout:{out}\nstderr:{err}"
        return json.loads(out.strip().splitlines()[-1])

    def kill_all(self) -> None:
        """SIGKILL the processes still running, then remove the segments of those that
        were producers: a SIGKILLed producer cannot, and whether one of its consumers
        noticed its death and removed the segment (the last one out does) must not depend
        on the order of the kills. A producer that ended by itself is not touched here,
        so the `name` fixture still finds a segment it leaked."""
        killed = []
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                killed.append(p.pid)
            try:
                p.communicate(timeout=10)
            except Exception:
                pass
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


# The test files that add rows to the fault table (docs/faults.md).
FAULT_TABLE_FILES = ("tests/test_faults.py", "tests/test_fork.py", "tests/test_kept_batches.py")


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
