"""Build and run the C-level unit tests of the GPU ring (csrc/tests/test_gpu.c).

The test program is compiled together with every file of csrc/base, csrc/device and csrc/ring, not the Python
binding (ts_module.c, ts_py_*.c), with the compiler named by $CC (default ``cc``), and runs
on the CUDA driver test double (csrc/tests/fake_cuda.c, built by tests/fakecuda.py)
named by TENSORSOCKET_LIBCUDA. TENSORSOCKET_SANITIZE=1 adds AddressSanitizer and
UndefinedBehaviorSanitizer to both, with leak detection on in the test processes.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest
from c_sources import core_sources

import fakecuda

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
TEST_SRC = CSRC / "tests" / "test_gpu.c"
BASE_FLAGS = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-g", "-pthread", "-Icsrc"]
ASAN_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed$", re.MULTILINE)
GROUPS = 18  # the groups of csrc/tests/test_gpu.c
RUN_TIMEOUT = 300




def _build(out_dir: Path, sanitize: bool) -> Path:
    """Compile test_gpu.c with the core; fail the test with the compiler output."""
    binary = out_dir / "test_gpu"
    cmd = [
        *fakecuda.compiler(), *BASE_FLAGS, *(ASAN_FLAGS if sanitize else []),
        str(TEST_SRC.relative_to(ROOT)), *core_sources(), "-o", str(binary), "-lrt", "-ldl",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    if proc.returncode != 0:
        pytest.fail(
            f"compiling the C GPU tests failed:\n{shlex.join(cmd)}\n{proc.stdout}{proc.stderr}"
        )
    return binary


def _segments(pid: int) -> list[Path]:
    return sorted(Path("/dev/shm").glob(f"tensorsocket-ctest-{pid}-*"))


def test_c_gpu(tmp_path_factory: pytest.TempPathFactory) -> None:
    sanitize = os.environ.get("TENSORSOCKET_SANITIZE") == "1"
    work = tmp_path_factory.mktemp("c_gpu")
    try:
        lib = fakecuda.build(work, sanitize=sanitize)
    except fakecuda.NoCompiler as e:
        pytest.skip(str(e))
    binary = _build(work, sanitize)

    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKECUDA_")}
    env["TENSORSOCKET_LIBCUDA"] = str(lib)
    env["FAKECUDA_OP_DELAY_US"] = "200"  # stream operations take time: asynchrony shows
    if sanitize:
        # The program links the sanitizer runtimes itself (scripts/test-sanitized.sh
        # preloads them for Python and turns leak detection off there).
        env.pop("LD_PRELOAD", None)
        env["ASAN_OPTIONS"] = "detect_leaks=1:halt_on_error=1"
        env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1"
    with subprocess.Popen(
        [str(binary)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    ) as proc:
        try:
            out, _ = proc.communicate(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its producer and consumer processes too
            out, _ = proc.communicate()
            out += f"\n[killed after {RUN_TIMEOUT} s]"
        finally:
            leaked = _segments(proc.pid)
            for seg in leaked:
                seg.unlink(missing_ok=True)
    # The program checks itself that its processes leave no device memory or events
    # (fakecuda shm objects) behind, and removes those of the consumer it SIGKILLs.
    print(out)  # shown by pytest on failure
    assert proc.returncode == 0, f"test_gpu exited with status {proc.returncode}:\n{out}"
    m = SUMMARY.search(out)
    assert m is not None, f"no 'N passed, M failed' line in the output:\n{out}"
    assert (int(m.group(1)), int(m.group(2))) == (GROUPS, 0), out
    assert "Sanitizer" not in out and "runtime error" not in out, out
    assert leaked == [], f"segments left behind: {leaked}"
