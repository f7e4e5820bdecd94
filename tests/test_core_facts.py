"""Facts the C core computes once, and the binding hands to Python as they are.

- Which slot the producer reuses next, and who holds it: ts_ring_next_slot (Ring.next_slot),
  read by data/diagnosis.py instead of recomputed there from the header.
- What /proc/<pid>/stat says of a process: ts_proc_read_stat (_core.process_stat), the one
  parser of that file, used by the CLI's status and by tools/harness.py.
- How the binding takes arguments (ts_py_args and its converters), how long a blocking call
  sleeps at once (TS_SLICE_NS), and what the binding and the export read of a ring
  (accessors of ts_ring.h, never its fields): one way each, guarded on the sources.

Producer and consumer handles of one ring live in this process (as in test_dlpack): what is
tested is what the core answers, not the processes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from tensorsocket import _core
from tensorsocket.cli import status
from tensorsocket.data import diagnosis
from tools import harness

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
SLOTS = 4


@pytest.fixture
def ring_pair():
    """(producer ring, consumer ring, consumer index, token): a ring of SLOTS slots, one
    consumer (this process) receiving, nothing published yet."""
    seg = f"/tensorsocket-{os.getuid()}-facts{uuid.uuid4().hex[:8]}-{os.getpid()}"
    prod = _core.Ring.create(seg, SLOTS, 1 << 12, 2)
    try:
        index, token = prod.reserve(os.getpid(), _core.process_start_time(os.getpid()))
        cons = _core.Ring.open(seg)
        cons.bind(index, token)
        prod.activate(index)
        yield prod, cons, index, token
        cons.close()
    finally:
        prod.close()
        _core.Ring.unlink_name(seg)


def _publish(prod: _core.Ring, i: int, timeout: float | None = None) -> int:
    """Publish batch i (one small tensor)."""
    return prod.publish([(np.full(4, i, dtype=np.int32), (0, 32, 1))], b"m", index=i,
                        timeout=timeout)


def test_an_acquire_past_its_deadline_at_the_first_look_times_out(ring_pair):
    """acquire() with nothing published, its deadline passed by the time it first looks
    (timeout=0, or a GPU consumer's 50 ms step on a machine that did not run it for that
    long): TimeoutError saying what it waited for, which the consumer's wait loop takes as
    a step's end. Before, an empty TensorSocketError, which ended the consumer."""
    _, cons, _, _ = ring_pair
    for timeout in (0, 1e-9):
        with pytest.raises(TimeoutError, match="timed out waiting for the next batch"):
            cons.acquire(timeout)


# -- which slot is reused next ---------------------------------------------------------------


def test_next_slot_before_the_ring_wraps(ring_pair):
    """Until every slot was used once, the next slot is a new one: nobody holds it."""
    prod, cons, _, _ = ring_pair
    assert prod.next_slot() == {"published": 0, "slot": 0, "seq": None, "readers": 0}
    for i in range(SLOTS - 1):
        _publish(prod, i)
    assert prod.next_slot() == {"published": SLOTS - 1, "slot": SLOTS - 1, "seq": None,
                                "readers": 0}
    assert cons.next_slot() == prod.next_slot(), "every handle reads the same answer"
    assert diagnosis.next_slot_holders(prod) == [] and diagnosis.holding_back(prod) == []


def test_next_slot_names_who_holds_it_back(ring_pair):
    """Once the ring wrapped, the next slot is the one of entry published - SLOTS: unread, the
    consumer holds the producer back (lag, no kept batch); read and kept alive, it keeps a
    batch (next_slot_holders, Ring.held_blocking); released, the producer goes on."""
    prod, cons, index, token = ring_pair
    me = 1 << index
    for i in range(SLOTS):
        _publish(prod, i)
    nxt = prod.next_slot()
    assert nxt == {"published": SLOTS, "slot": 0, "seq": 0, "readers": me}
    assert [e["index"] for e in diagnosis.holding_back(prod)] == [index]
    assert diagnosis.next_slot_holders(prod) == [], "unread is lag, not a kept batch"
    assert cons.held_blocking() == 0

    kept = cons.acquire(1)  # entry 0, in the next slot, kept alive
    assert prod.next_slot()["readers"] == me
    assert [e["index"] for e in diagnosis.next_slot_holders(prod)] == [index]
    assert cons.held_blocking() == 1
    with pytest.raises(TimeoutError):
        _publish(prod, SLOTS, timeout=0.05)  # the producer waits for exactly that slot
    assert prod.next_slot()["published"] == SLOTS, "a publish that timed out wrote nothing"

    kept.release()
    assert prod.next_slot()["readers"] == 0
    assert diagnosis.next_slot_holders(prod) == [] and diagnosis.holding_back(prod) == []
    assert _publish(prod, SLOTS, timeout=1) == SLOTS
    assert prod.next_slot() == {"published": SLOTS + 1, "slot": 1, "seq": 1, "readers": me}


# -- /proc/<pid>/stat ------------------------------------------------------------------------

# A child that names itself with what trips a naive parser of /proc/<pid>/stat (its comm,
# field 2, in parentheses that it contains too), says so, and waits until stdin closes.
NAMED_CHILD = """
import ctypes, sys
ctypes.CDLL(None, use_errno=True).prctl(15, b") x (y) ", 0, 0, 0)  # PR_SET_NAME
print("named", flush=True)
sys.stdin.read()
"""


def test_process_stat_reads_this_process():
    stat = _core.process_stat(os.getpid())
    assert stat is not None
    assert stat["ppid"] == os.getppid()
    assert stat["start_time"] == _core.process_start_time(os.getpid())
    assert stat["state"] == "R", "this process reads its own stat while running"
    times = os.times()
    tick = os.sysconf("SC_CLK_TCK")
    assert abs(stat["utime"] / tick - times.user) < 1 and abs(stat["stime"] / tick
                                                              - times.system) < 1


def test_process_stat_of_a_child_named_with_parentheses():
    """comm may hold spaces and parentheses: fields are counted from the last ')'. The CLI
    (process_tree_cpu) and the harness (descendants) see the child under this process."""
    child = subprocess.Popen([sys.executable, "-c", NAMED_CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "named\n"
        stat = _core.process_stat(child.pid)
        assert stat is not None and stat["ppid"] == os.getpid()
        assert stat["state"] in "RS"
        with open(f"/proc/{child.pid}/comm") as f:
            assert f.read() == ") x (y) \n", "the name that trips a naive parser is set"
        assert child.pid in harness.descendants(os.getpid())
        assert status.process_tree_cpu(os.getpid()) is not None
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=60)
    assert _core.process_stat(child.pid) is None, "a reaped process has no stat"
    assert status.process_tree_cpu(child.pid) is None


def test_harness_walks_trees_without_importing_the_package():
    """The harness loads tensorsocket's parser, the C extension alone: a process that walks
    a tree (a benchmark's orchestrator) imports neither tensorsocket nor torch for it."""
    code = ("import sys, os; sys.path.insert(0, sys.argv[1]); from tools import harness; "
            "harness.descendants(os.getppid()); "
            "print(sorted(m for m in ('tensorsocket', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)],
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_proc_stat_is_parsed_in_one_place():
    """Only csrc/base/ts_proc.c opens /proc/<pid>/stat; only tools/harness.py the machine's
    /proc/stat (machine_busy_seconds: the demo and the collocated benchmark)."""
    readers, machine = [], []
    for path in [*ROOT.joinpath("tensorsocket").rglob("*.py"), ROOT / "tools" / "harness.py",
                 *ROOT.joinpath("benchmarks").glob("*.py"),
                 *ROOT.joinpath("examples").glob("*.py"), *CSRC.rglob("*.c")]:
        if path.parent.name == "tests":
            continue
        text = path.read_text()
        if re.search(r'(?<!/proc)/stat["\'][,)]', text):  # a process's, as an argument
            readers.append(str(path.relative_to(ROOT)))
        if re.search(r'["\']/proc/stat["\']', text):
            machine.append(str(path.relative_to(ROOT)))
    assert readers == ["csrc/base/ts_proc.c"]
    assert machine == ["tools/harness.py"]


# -- the binding: arguments, slices, accessors ------------------------------------------------


def test_arguments_bind_by_position_or_by_name(ring_pair):
    """Every argument takes the name the stub (_core.pyi) gives it; wrong calls raise
    TypeError naming the function."""
    prod, cons, index, _ = ring_pair
    i2, t2 = prod.reserve(pid=os.getpid(), start_time=_core.process_start_time(os.getpid()),
                          batch_size=3)
    assert prod.consumer(index=i2)["batch_size"] == 3
    prod.set_policy(window=0, max_lag=0)
    assert prod.wait_consumers(n=1, timeout=0) is True
    assert prod.activate(index=i2, align=False, start=None) == 0
    prod.retire(index=i2)
    assert _core.segment_bytes(slot_count=SLOTS, slot_bytes=1 << 12, max_leaves=2) == \
        _core.segment_bytes(SLOTS, 1 << 12, 2)
    assert _core.process_alive(pid=os.getpid(), start_time=_core.process_start_time(
        os.getpid())) is True
    with pytest.raises(TypeError, match=r"reserve\(\) missing required argument 'start_time'"):
        prod.reserve(os.getpid())
    with pytest.raises(TypeError, match=r"consumer\(\) got an unexpected keyword argument"):
        prod.consumer(idx=0)
    with pytest.raises(TypeError, match=r"acquire\(\) takes at most 2 positional"):
        cons.acquire(0, None, None)
    with pytest.raises(TypeError, match="multiple values"):
        prod.retire(0, index=0)
    with pytest.raises(TypeError, match="integer"):
        prod.retire("0")
    with pytest.raises(TypeError, match="str"):
        _core.Ring.open(b"/name")
    with pytest.raises(ValueError, match="null"):
        _core.Ring.open("/a\0b")
    with pytest.raises(TypeError, match=r"tuple of 3 ints"):
        prod.publish([(np.zeros(2, np.int32), (0, 32))], b"")


def _binding_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((CSRC / "binding").glob("*.c"))}


def test_the_binding_parses_arguments_one_way():
    """No PyArg_Parse*, no METH_VARARGS or METH_O: every function with arguments is
    METH_FASTCALL | METH_KEYWORDS over ts_py_args (ts_py.h)."""
    for name, text in _binding_sources().items():
        assert "PyArg_Parse" not in text, name
        assert not re.search(r"METH_VARARGS|METH_O\b", text), name


def test_one_slice_and_one_wait():
    """The slice is defined once (base/ts_clock.h), and the ring sleeps in one place (its
    ts_wait_for): the binding slices with ts_slice_end, not a constant of its own. (The
    exit handler's waits for work under way use ts_futex_wait_zero of base/ts_futex.c.)"""
    defined = {p.relative_to(CSRC).as_posix() for p in CSRC.rglob("*.[ch]")
               if p.parent.name != "tests" and "100000000ULL" in p.read_text()}
    assert defined == {"base/ts_clock.h"}
    sleeps = [p.name for p in CSRC.rglob("*.c") if p.parent.name != "tests"
              for _ in re.finditer(r"\bts_futex_wait\(", p.read_text())
              if p.name != "ts_futex.c"]
    assert sleeps == ["ts_ring.c"]
    assert "ts_slice_end(deadline)" in _binding_sources()["ts_py_ring.c"]


def test_the_binding_and_the_export_read_rings_through_accessors():
    """ring->hdr, ring->dev and the handle's other fields are ts_ring.c's: the binding and
    the export call the accessors of ts_ring.h."""
    texts = {**_binding_sources(), "ts_export.c": (CSRC / "ring" / "ts_export.c").read_text()}
    for name, text in texts.items():
        fields = re.findall(r"\bring->(\w+)", text)
        assert fields == [], f"{name} reads {sorted(set(fields))} of a ring"


def _stub_parameters() -> dict[str, list[str]]:
    """Function or method name (and "Class.method") -> its parameter names in
    tensorsocket/_core.pyi."""
    import ast

    tree = ast.parse((ROOT / "tensorsocket" / "_core.pyi").read_text())
    out: dict[str, list[str]] = {}

    def params(node: ast.FunctionDef) -> list[str]:
        args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
        return args + [a.arg for a in node.args.kwonlyargs]

    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            out[node.name] = params(node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    out[f"{node.name}.{item.name}"] = params(item)
    return out


def test_argument_names_are_the_stubs():
    """The names each function binds (its names[] for ts_py_args) are the parameters the
    stub gives it, in order: a keyword call type-checked against the stub binds."""
    bound = {}
    for name, text in _binding_sources().items():
        owner = _ONE_TYPE_FILES.get(name)  # (a method name two types share: create)
        for m in re.finditer(r"names\[\] = \{(.*?)\};.*?ts_py_args\(\"(\w+)\"", text, re.S):
            fn = f"{owner}.{m.group(2)}" if owner else m.group(2)
            bound[fn] = re.findall(r'"(\w+)"', m.group(1))
    stubs = _stub_parameters()
    assert len(bound) >= 25, sorted(bound)
    assert bound == {fn: stubs.get(fn) for fn in bound}


# The binding files that define the methods of one type (their names are checked against
# that class's stubs).
_ONE_TYPE_FILES = {"ts_py_ring.c": "Ring", "ts_py_store.c": "Store",
                   "ts_py_watch.c": "ProcessWatch", "ts_py_lane.c": "Lane"}
