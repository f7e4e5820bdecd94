"""A cached virtual environment with the original TensorSocket (PyPI tensorsocket 0.0.5).

The original package has the same import name as this project, so it lives in a
virtual environment of its own, created on first use under
``benchmarks/.cache/venv-original`` (or ``$TENSORSOCKET_ORIGINAL_VENV``). The venv
sees this interpreter's site-packages (torch, numpy, pyzmq, pillow: no second torch
install), and its own site-packages, which come first on sys.path, hold
tensorsocket 0.0.5 and tornado. ``ensure_venv()`` checks that ``import tensorsocket``
there really is the original before it returns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

ORIGINAL_VERSION = "0.0.5"
_DEFAULT = Path(__file__).resolve().parent / ".cache" / "venv-original"
_PROBE = (
    "import json, importlib.metadata as m, tensorsocket, tensorsocket.producer;"
    "print(json.dumps({'file': tensorsocket.__file__, "
    "'version': m.version('tensorsocket')}))"
)


class OriginalUnavailable(RuntimeError):
    """The original TensorSocket could not be installed or imported."""


def venv_dir() -> Path:
    return Path(os.environ.get("TENSORSOCKET_ORIGINAL_VENV", _DEFAULT))


def _python(root: Path) -> Path:
    return root / "bin" / "python"


def _probe(python: Path) -> dict:
    """What `import tensorsocket` is in that interpreter (run from a neutral directory,
    so this checkout's package is not picked up from the working directory)."""
    out = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True,
                         cwd="/", timeout=120)
    if out.returncode != 0:
        raise OriginalUnavailable(f"importing the original tensorsocket failed: "
                                  f"{out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ensure_venv(progress=print) -> Path:
    """The venv's python, creating and filling the venv on first use."""
    root = venv_dir()
    python = _python(root)
    if python.exists():
        try:
            info = _probe(python)
            if info["version"] == ORIGINAL_VERSION and str(root) in info["file"]:
                return python
        except (OriginalUnavailable, subprocess.TimeoutExpired, ValueError):
            pass
    progress(f"creating {root} with tensorsocket=={ORIGINAL_VERSION} (once)")
    venv.EnvBuilder(system_site_packages=True, clear=True, with_pip=True).create(root)
    # --no-deps for torch: the base interpreter's torch is used (never resolve a torch).
    cmds = [
        [str(python), "-m", "pip", "install", "-q", "--no-deps",
         f"tensorsocket=={ORIGINAL_VERSION}"],
        [str(python), "-m", "pip", "install", "-q", "tornado>=6.0.0"],
    ]
    for cmd in cmds:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise OriginalUnavailable(f"{' '.join(cmd[3:])} failed: {out.stderr.strip()[-500:]}")
    info = _probe(python)
    if info["version"] != ORIGINAL_VERSION or str(root) not in info["file"]:
        raise OriginalUnavailable(
            f"the venv imports tensorsocket from {info['file']} (version {info['version']}), "
            "not the original: another install shadows it")
    return python


if __name__ == "__main__":
    print(ensure_venv(lambda msg: print(msg, file=sys.stderr)))
