"""Who installs the SIGSEGV handler of copy on write (csrc/base/ts_fault.c): a consumer, when it
takes its first batch of a host ring; never a process that only imports tensorsocket,
produces, or maps rings to read their headers (`tensorsocket status`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from conftest import ROOT

# The child reports, after each step, whether SIGSEGV is caught at the C level: bit 10
# (SIGSEGV - 1) of SigCgt in /proc/self/status. signal.getsignal() would not see a handler
# installed by C code, and Python's faulthandler is kept off in the child.
CHILD = textwrap.dedent("""
    import io, json, os, sys, contextlib
    import numpy as np

    def caught():
        for line in open("/proc/self/status"):
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> 10 & 1)
        raise AssertionError("no SigCgt line")

    steps = {"start": caught()}
    import tensorsocket
    from tensorsocket import _core
    from tensorsocket.__main__ import main
    steps["import"] = caught()
    pid = os.getpid()
    name = f"sigtest{pid}"
    seg = f"/tensorsocket-{os.getuid()}-{name}-{pid}"
    prod = _core.Ring.create(seg, 4, 1 << 16, 4)
    try:
        index, token = prod.reserve(pid, _core.process_start_time(pid))  # pending: no cursor
        prod.publish([(np.zeros(8, dtype=np.float32), (2, 32, 1))], b"m")
        steps["produce"] = caught()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(["status", "--json", "--interval", "0", "--name", name])
        doc = json.loads(out.getvalue())
        steps["status"] = caught()
        cons = _core.Ring.open(seg)
        cons.bind(index, token)
        prod.activate(index, True)
        steps["open"] = caught()
        slot = cons.acquire(5)
        steps["acquire"] = caught()
        slot.release()
        cons.close()
    finally:
        _core.Ring.unlink_name(seg)
    print(json.dumps({"steps": steps, "status_rc": rc, "status": doc}))
""")


def test_only_a_consumer_taking_a_batch_installs_the_sigsegv_handler():
    """Importing tensorsocket, producing, `tensorsocket status` (which maps every ring of
    the user) and opening a consumer handle leave SIGSEGV alone; the first batch a
    consumer takes installs the handler (a write into it becomes a private copy)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    # Sanitizer runtimes (scripts/test-sanitized.sh) catch SIGSEGV themselves by default.
    for var in ("ASAN_OPTIONS", "UBSAN_OPTIONS"):
        env[var] = ":".join(filter(None, [env.get(var), "handle_segv=0"]))
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    steps = report["steps"]
    assert steps == {"start": False, "import": False, "produce": False, "status": False,
                     "open": False, "acquire": True}, steps
    # The status document lists the producer and its consumer, pending (no cursor yet).
    assert report["status_rc"] == 0
    (producer,) = report["status"]["producers"]
    (consumer,) = producer["consumers"]
    assert consumer["cursor"] is None and consumer["state"] == "joining"
