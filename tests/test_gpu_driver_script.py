"""The issue-34 real-GPU checks (benchmarks/gpu_driver_checks.py), in their quick form, on
the CUDA driver double: the script a lent GPU runs (``gpu_check.py --quick``) runs in CI
too, without one (``gpu_check.py --fake``).

Each check is called here with the fake backend (its role processes are new
interpreters on the double), and must pass; the only one that may skip is the one that
needs torch's CUDA caching allocator. Their verdicts on the double do not depend on
timing: queued work that a release must wait for is held by a gate, and a gate the
correct core waits for opens by itself only when the bug would have shown.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from test_gpu import fake_lib  # noqa: F401  (fixture: the double, built once per worker)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_driver_checks  # noqa: E402  (imports no torch, needs no GPU)

FAKE_SKIPS = {"copy_cache_95"}  # checks that make no sense on the double
SCRIPT_TIMEOUT = 180

# slow: about 30 s of two cores' time; the default suite has each item's own test on the
# double (tests/test_gpu_driver_rules.py), and .ci/run runs the slow suite too.
pytestmark = [pytest.mark.slow] + \
    ([pytest.mark.timeout(300)] if importlib.util.find_spec("pytest_timeout") else [])


@pytest.mark.parametrize("check_name", list(gpu_driver_checks.CHECKS))
def test_issue34_check_on_the_double(fake_lib, check_name):  # noqa: F811
    """One check of benchmarks/gpu_driver_checks.py (its docstring says what it proves),
    quick form, on the double: it passes, or it is one that cannot run there and says so."""
    res = gpu_driver_checks.CHECKS[check_name](gpu_driver_checks.fake_options(fake_lib))
    if check_name in FAKE_SKIPS:
        assert res.ok is None and "driver double" in (res.skipped or ""), res
        return
    assert res.ok, f"{res.name}: {res.figure}\n{res.detail}"


def test_gpu_check_fake_prints_the_table(fake_lib):  # noqa: F811
    """``gpu_check.py --fake LIB --checks ...`` runs the named issue-34 checks on the
    double and prints the --quick table and the verdict, exit status 0."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--fake", str(fake_lib),
         "--checks", "consumer_in_producer_process,copy_cache_95"],
        capture_output=True, text=True, timeout=SCRIPT_TIMEOUT, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split()[0]: line.split()[1] for line in proc.stdout.splitlines()
            if line.split()[:1] in (["consumer_in_producer_process"], ["copy_cache_95"])
            and len(line.split()) > 2}
    assert rows == {"consumer_in_producer_process": "OK", "copy_cache_95": "SKIP"}, proc.stdout
    assert "PASSED" in proc.stdout
