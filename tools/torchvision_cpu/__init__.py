"""Real torchvision (and timm) for the tests on a machine with a CPU-only torch.

PyPI has one torchvision wheel per torch release, built for CUDA: torchvision 0.28.0 beside
torch 2.13.0+cpu fails at import ("operator torchvision::nms does not exist") because
its ops library, torchvision/_C.so, names CUDA libraries (libcudart.so.13, libc10_cuda.so,
libtorch_cuda.so) that a CPU-only torch does not have. The CPU ops it registers need none
of them. ``ensure()`` makes it importable, in a directory of its own (nothing is
installed into the interpreter):

- ``<dir>/site``: torchvision and timm, pip-installed there with --no-deps (their
  dependencies, torch, pillow, numpy, huggingface_hub, safetensors, pyyaml, come from the
  interpreter);
- ``<dir>/stubs``: the three CUDA libraries as stubs, built with gcc from ``stubs/*.c``;
- ``<dir>/site/sitecustomize.py``: preloads the stubs and _C.so before the first import
  of torchvision (see sitecustomize_template.py);
- ``<dir>/ready.json``: written last, once a fresh interpreter imported both packages;
  with the digest of the recipe (pins, stub sources, sitecustomize): a change to them
  makes the next ensure() do it again.

A process gets them with ``environment()`` in its environment (``<dir>/site`` first on
PYTHONPATH). Where torchvision already imports natively, nothing is done. The command
line: ``python3 -m tools.torchvision_cpu ensure [--dir D]``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping

__all__ = ["DEFAULT_DIR", "TIMM", "TORCHVISION", "Unavailable", "ensure", "environment",
           "why_not"]

# The torchvision release built against this torch series; timm's release the tests use.
TORCH_SERIES = "2.13"
TORCHVISION = "0.28.0"
TIMM = "1.0.29"

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / ".cache" / "torchvision-cpu"
STUB_SOURCES = Path(__file__).resolve().parent / "stubs"
SITECUSTOMIZE = Path(__file__).resolve().parent / "sitecustomize_template.py"
LOCAL_WHEELS = Path("/opt/wheels")  # a local wheel directory, where the machine has one

# Each stub library: its file (= soname), its source, the extra linker flags.
STUBS = (
    ("libcudart.so.13", "cudart.c", ("-Wl,--version-script=" + str(STUB_SOURCES / "cudart.map"),)),
    ("libc10_cuda.so", "c10_cuda.c", ()),
    ("libtorch_cuda.so", "torch_cuda.c", ()),
)
CFLAGS = ("-std=c11", "-Wall", "-Wextra", "-Werror", "-O2", "-fPIC", "-shared")

# What a fresh interpreter must be able to do for the packages to count as there.
IMPORT_CHECK = ("import json, importlib\n"
                "ok = {}\n"
                "for name in ('torchvision', 'timm'):\n"
                "    try:\n"
                "        importlib.import_module(name)\n"
                "        ok[name] = True\n"
                "    except Exception as e:\n"
                "        ok[name] = f'{type(e).__name__}: {e}'\n"
                "print(json.dumps(ok))\n")


class Unavailable(RuntimeError):
    """torchvision cannot be made importable here; the message says why."""


def ensure(dir: str | os.PathLike[str] | None = None, *, timeout: float = 600,
           log: Callable[[str], None] = print) -> dict[str, str]:
    """Make torchvision and timm importable; return the environment variables a child
    process needs for them (PYTHONPATH, merged with this process's; {} where nothing is
    needed). Idempotent: a second call finds <dir>/ready.json and returns at once.
    Concurrent calls (pytest-xdist workers) take turns on a lock. Raises Unavailable with
    the reason (also kept for why_not()) where it cannot: no network, no gcc, another
    torch release."""
    base = Path(dir) if dir is not None else DEFAULT_DIR
    deadline = time.monotonic() + timeout
    if _ready(base) is not None:
        log(f"torchvision-cpu: ready in {base}")
        return _site_env(base, os.environ)
    if not _natively_missing():
        log("torchvision-cpu: torchvision and timm import natively; nothing to do")
        return {}
    base.mkdir(parents=True, exist_ok=True)
    with _locked(base / ".lock"):
        if _ready(base) is None:  # else another process made it ready while we waited
            try:
                _install(base, deadline, log)
            except Unavailable as e:
                (base / "error.txt").write_text(str(e) + "\n")
                raise
    env = _site_env(base, os.environ)
    log(f"torchvision-cpu: ready in {base}; the environment to use:")
    for key, value in env.items():
        log(f"  export {key}={value}")
    return env


def environment(dir: str | os.PathLike[str] | None = None,
                base_env: dict[str, str] | None = None) -> dict[str, str] | None:
    """The variables to set for a child process to import torchvision and timm, computed
    against base_env (default: os.environ): {"PYTHONPATH": "<dir>/site:<its PYTHONPATH>"}
    once ensure() made <dir> ready; {} where both import natively; else None."""
    base = Path(dir) if dir is not None else DEFAULT_DIR
    if _ready(base) is not None:
        return _site_env(base, os.environ if base_env is None else base_env)
    return {} if not _natively_missing() else None


def _site_env(base: Path, env: Mapping[str, str]) -> dict[str, str]:
    """{"PYTHONPATH": base/site first, then env's PYTHONPATH}."""
    site = str(base / "site")
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
    return {"PYTHONPATH": os.pathsep.join([site, *parts])}


def why_not(dir: str | os.PathLike[str] | None = None) -> str:
    """Why environment() gives None: the reason the last ensure() failed, or a missing
    prerequisite; "" where it does not."""
    base = Path(dir) if dir is not None else DEFAULT_DIR
    if environment(base) is not None:
        return ""
    error = base / "error.txt"
    if error.is_file():
        return f"torchvision-cpu: {error.read_text().strip()} (in {base})"
    return _missing_prerequisite() or (
        f"torchvision-cpu: not set up in {base}: run `python3 -m tools.torchvision_cpu ensure`")


# -- the steps ---------------------------------------------------------------------------


def _install(base: Path, deadline: float, log: Callable[[str], None]) -> None:
    """Install what is missing into base/site, build the stubs, check in a fresh
    interpreter, write base/ready.json (last)."""
    missing = _natively_missing()
    problem = _missing_prerequisite(needs_stubs="torchvision" in missing)
    if problem:
        raise Unavailable(problem)
    for stale in ("ready.json", "error.txt"):
        (base / stale).unlink(missing_ok=True)
    # torchvision's pin matches this torch; timm is installed beside it so that the pair
    # is the one checked (a timm of the interpreter might want another torchvision).
    pins = ([f"torchvision=={TORCHVISION}", f"timm=={TIMM}"] if "torchvision" in missing
            else [f"timm=={TIMM}"])
    log(f"torchvision-cpu: pip install --no-deps {' '.join(pins)} into {base / 'site'}")
    _replace_dir(base / "site", lambda tmp: _pip_install(pins, tmp, deadline))
    if "torchvision" in missing:
        log(f"torchvision-cpu: building the CUDA stubs into {base / 'stubs'}")
        _replace_dir(base / "stubs", lambda tmp: _build_stubs(tmp, deadline))
        shutil.copyfile(SITECUSTOMIZE, base / "site" / "sitecustomize.py")
    ready = {**_check_imports(base, deadline), "recipe": _recipe()}
    (base / "ready.json").write_text(json.dumps(ready, indent=1) + "\n")


def _pip_install(pins: list[str], target: Path, deadline: float) -> None:
    """pip install --no-deps --target `target` the pinned packages (PyPI, or a local wheel
    directory where there is one)."""
    # --timeout/--retries: without a network pip fails in about a minute, not after its
    # configured retries (a test session waits for this before it skips).
    argv = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-input",
            "--disable-pip-version-check", "--timeout", "30", "--retries", "1",
            "--target", str(target), *pins]
    if LOCAL_WHEELS.is_dir():
        argv += ["--find-links", str(LOCAL_WHEELS)]
    _run(argv, deadline, what="pip install " + " ".join(pins))


def _build_stubs(out: Path, deadline: float) -> None:
    """gcc each stub library of STUBS into `out`."""
    for filename, source, extra in STUBS:
        _run(["gcc", *CFLAGS, f"-Wl,-soname,{filename}", *extra, "-o", str(out / filename),
              str(STUB_SOURCES / source)], deadline, what=f"gcc {source}")


def _check_imports(base: Path, deadline: float) -> dict[str, str]:
    """Import torchvision and timm in a fresh interpreter with the environment of base;
    their versions, or Unavailable with what failed."""
    env = {**os.environ, **_site_env(base, os.environ)}
    code = ("import json, torch, torchvision, timm\n"
            "print(json.dumps({'torch': torch.__version__, "
            "'torchvision': torchvision.__version__, 'timm': timm.__version__, "
            "'torchvision_file': torchvision.__file__}))\n")
    out = _run([sys.executable, "-c", code], deadline, what="import torchvision, timm", env=env)
    versions = json.loads(out.strip().splitlines()[-1])
    versions["python"] = sys.version.split()[0]
    return versions


def _ready(base: Path) -> dict | None:
    """base/ready.json if it was written for this interpreter and this torch, else None."""
    try:
        ready = json.loads((base / "ready.json").read_text())
    except (OSError, ValueError):
        return None
    if not (base / "site").is_dir():
        return None
    if ready.get("python") != sys.version.split()[0] or ready.get("torch") != _torch_version() \
            or ready.get("recipe") != _recipe():
        return None
    return ready


@functools.lru_cache(maxsize=None)
def _recipe() -> str:
    """A digest of what ensure() installs and builds (the pins, the stub sources, the
    sitecustomize): a directory made from another recipe is made again."""
    digest = hashlib.sha256(f"{TORCHVISION} {TIMM}".encode())
    for path in sorted(STUB_SOURCES.iterdir()) + [SITECUSTOMIZE]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _natively_missing() -> tuple[str, ...]:
    """Which of torchvision and timm a fresh interpreter with this environment cannot
    import (once per process: it takes a few seconds)."""
    try:
        done = subprocess.run([sys.executable, "-c", IMPORT_CHECK], capture_output=True,
                              text=True, timeout=120)
        ok = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return ("torchvision", "timm")
    return tuple(name for name, result in ok.items() if result is not True)


def _missing_prerequisite(needs_stubs: bool = True) -> str:
    """What this machine lacks for ensure(), or ""."""
    if not needs_stubs:
        return ""
    torch_version = _torch_version()
    if torch_version is None:
        return "torch is not importable"
    if not torch_version.startswith(TORCH_SERIES + "."):
        return (f"torch {torch_version} is not the {TORCH_SERIES} series that torchvision "
                f"{TORCHVISION} is built for")
    if shutil.which("gcc") is None:
        return "no gcc to build the CUDA stub libraries"
    return ""


@functools.lru_cache(maxsize=None)
def _torch_version() -> str | None:
    """This interpreter's torch version (read from its metadata: no import), or None."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


# -- plumbing ----------------------------------------------------------------------------


def _run(argv: list[str], deadline: float, *, what: str,
         env: dict[str, str] | None = None) -> str:
    """Run argv to completion before the deadline; its stdout, or Unavailable naming
    `what` with the tail of its output."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise Unavailable(f"{what}: no time left")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=left, env=env)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"{what}: timed out after {left:.0f} s") from None
    except OSError as e:
        raise Unavailable(f"{what}: {e}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise Unavailable(f"{what} failed (exit status {done.returncode}): "
                          + " / ".join(tail))
    return done.stdout


def _replace_dir(final: Path, fill: Callable[[Path], None]) -> None:
    """Fill a fresh temporary directory beside `final`, then put it in final's place (an
    interrupted run leaves no half-filled `final` behind; its leftovers are removed here,
    under the lock)."""
    for stale in final.parent.glob(f"{final.name}.tmp*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` for the block (taken in turns by concurrent ensure())."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
