"""Build and run the C-level unit tests of the shared-memory ring (csrc/tests/test_ring.c).

The test program is compiled together with every file of csrc/base, csrc/device and csrc/ring, not the Python
binding (ts_module.c, ts_py_*.c), with the compiler named by $CC (default ``cc``).
TENSORSOCKET_SANITIZE=1 adds AddressSanitizer and UndefinedBehaviorSanitizer.
A second test builds with ThreadSanitizer and runs only the tests that use two threads;
it is skipped where the toolchain or the kernel cannot run TSan binaries.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from c_sources import core_sources

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
TEST_SRC = CSRC / "tests" / "test_ring.c"
BASE_FLAGS = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-g", "-pthread", "-Icsrc"]
ASAN_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
TSAN_FLAGS = ["-fsanitize=thread"]
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed$", re.MULTILINE)
RUN_TIMEOUT = 300


def _cc() -> list[str]:
    cc = shlex.split(os.environ.get("CC", "cc"))
    if not cc or shutil.which(cc[0]) is None:
        pytest.skip(f"no C compiler {cc[0] if cc else '(empty $CC)'!r}")
    return cc




def _compile(sources: list[str], out: Path, extra: list[str]) -> subprocess.CompletedProcess:
    cmd = [*_cc(), *BASE_FLAGS, *extra, *sources, "-o", str(out), "-lrt", "-ldl"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT)


def _build(out_dir: Path, extra: list[str], source: Path = TEST_SRC) -> Path:
    """Compile a C test program (test_ring.c unless `source` says) with the core; fail the
    test with the compiler output."""
    binary = out_dir / source.stem
    proc = _compile([str(source.relative_to(ROOT)), *core_sources()], binary, extra)
    if proc.returncode != 0:
        pytest.fail(
            f"compiling {source.name} failed:\n{shlex.join(proc.args)}\n"
            f"{proc.stdout}{proc.stderr}"
        )
    return binary


def _run(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run argv; return its status and output (stderr merged into stdout)."""
    with subprocess.Popen(
        argv,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        try:
            out, _ = proc.communicate(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            out += f"\n[killed after {RUN_TIMEOUT} s]"
        finally:
            # A crashed run leaves its segments behind: they are named after its pid.
            for seg in Path("/dev/shm").glob(f"tensorsocket-ctest-{proc.pid}-*"):
                seg.unlink(missing_ok=True)
    return proc.returncode, out


def _check_output(rc: int, out: str, expect_passed: int | None = None) -> None:
    print(out)  # shown by pytest on failure
    assert rc == 0, f"test_ring exited with status {rc}:\n{out}"
    m = SUMMARY.search(out)
    assert m is not None, f"no 'N passed, M failed' line in the output:\n{out}"
    passed, failed = int(m.group(1)), int(m.group(2))
    assert failed == 0, out
    assert passed > 0, out
    if expect_passed is not None:
        assert passed == expect_passed, out


def test_c_ring(tmp_path_factory: pytest.TempPathFactory) -> None:
    sanitize = os.environ.get("TENSORSOCKET_SANITIZE") == "1"
    binary = _build(tmp_path_factory.mktemp("c_ring"), ASAN_FLAGS if sanitize else [])
    env = {}
    if sanitize:
        env["UBSAN_OPTIONS"] = os.environ.get("UBSAN_OPTIONS", "halt_on_error=1:print_stacktrace=1")
    rc, out = _run([str(binary)], env)
    _check_output(rc, out)


def _tsan_runner(work: Path) -> list[str]:
    """The command prefix that runs a TSan binary here; skips if there is none."""
    probe_src = work / "probe.c"
    probe_src.write_text(
        "#include <pthread.h>\n"
        "static void *f(void *p) { return p; }\n"
        "int main(void) { pthread_t t; pthread_create(&t, 0, f, 0); "
        "return pthread_join(t, 0); }\n"
    )
    probe = work / "probe"
    proc = _compile([str(probe_src)], probe, TSAN_FLAGS)
    if proc.returncode != 0:
        pytest.skip(f"the compiler cannot build with -fsanitize=thread:\n{proc.stderr}")
    candidates = [[]]
    if shutil.which("setarch"):
        # High mmap ASLR entropy breaks older TSan runtimes; setarch -R disables ASLR.
        candidates.append(["setarch", platform.machine(), "-R"])
    errors = []
    for prefix in candidates:
        rc, out = _run([*prefix, str(probe)])
        if rc == 0:
            return prefix
        errors.append(f"{shlex.join([*prefix, str(probe)])}: status {rc}\n{out}")
    pytest.skip("TSan binaries do not run here:\n" + "\n".join(errors))


@pytest.mark.slow  # a sanitizer variant
@pytest.mark.parametrize("name", ["cross_thread", "late_release_race"])
def test_c_ring_cross_thread_tsan(tmp_path_factory: pytest.TempPathFactory, name: str) -> None:
    work = tmp_path_factory.mktemp("c_ring_tsan")
    prefix = _tsan_runner(work)
    binary = _build(work, TSAN_FLAGS)
    rc, out = _run(
        [*prefix, str(binary), name],
        {"TSAN_OPTIONS": os.environ.get("TSAN_OPTIONS", "halt_on_error=1:second_deadlock_stack=1")},
    )
    assert "WARNING: ThreadSanitizer" not in out, out
    _check_output(rc, out, expect_passed=1)
