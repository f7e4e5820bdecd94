"""tools/torchvision_cpu: real torchvision and timm for the tests on a CPU-only torch.

The torchvision_env fixture (tests/conftest.py) installs them on first use; these tests
check that a second ensure() does nothing, and that a fresh interpreter with that
environment runs what the tests of issue 27 use: transforms.v2 on a uint8 CHW tensor,
ImageFolder over JPEGs, timm's create_transform on a PIL image.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run
from tools import torchvision_cpu

CLIENT = Path(__file__).resolve().parent / "clients" / "tv_augment.py"


CHECK = r"""
import json, sys
import torch, torchvision, timm, timm.data
from PIL import Image
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

torch.manual_seed(0)
augment = v2.Compose([v2.RandomResizedCrop(64), v2.RandomHorizontalFlip(),
                      v2.ColorJitter(0.4, 0.4, 0.4), v2.ToDtype(torch.float32, scale=True),
                      v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
out = augment(torch.randint(0, 256, (3, 90, 110), dtype=torch.uint8))
folder = ImageFolder(sys.argv[1], transform=v2.Compose([v2.Resize((72, 72)), v2.PILToTensor()]))
img, target = folder[len(folder) - 1]
timm_out = timm.data.create_transform(48, is_training=True)(Image.open(folder.samples[0][0]))
print(json.dumps({
    "torchvision": torchvision.__version__, "torchvision_file": torchvision.__file__,
    "timm": timm.__version__, "v2": [list(out.shape), str(out.dtype), float(out.min())],
    "folder": [len(folder), folder.classes, list(img.shape), str(img.dtype), target],
    "timm_out": [list(timm_out.shape), str(timm_out.dtype)],
    "nms": torchvision.ops.nms(torch.tensor([[0, 0, 1, 1.], [0, 0, 1, 1.]]),
                               torch.tensor([1., .5]), .5).tolist()}))
"""


def test_ensure_is_idempotent(torchvision_env, tmp_path):
    """A second ensure() finds the directory ready: same environment, nothing rebuilt,
    and it says so."""
    said: list[str] = []
    before = _snapshot(torchvision_cpu.DEFAULT_DIR)
    again = torchvision_cpu.ensure(log=said.append)
    assert again == torchvision_env
    assert _snapshot(torchvision_cpu.DEFAULT_DIR) == before
    assert torchvision_env == {} or said == [
        f"torchvision-cpu: ready in {torchvision_cpu.DEFAULT_DIR}"], said
    assert torchvision_cpu.environment() == torchvision_env
    assert torchvision_cpu.why_not() == ""


def _snapshot(base: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of ready.json and of each entry of site/ and stubs/."""
    paths = [base / "ready.json"] + [p for d in ("site", "stubs") if (base / d).is_dir()
                                     for p in sorted((base / d).iterdir())]
    return {str(p): (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths if p.exists()}


@pytest.mark.slow  # 30 s: installs and imports torchvision and timm; used by test_augment_clients
def test_real_torchvision_and_timm_in_a_fresh_interpreter(torchvision_env, tmp_path):
    """transforms.v2 on a uint8 CHW tensor, ImageFolder over JPEGs, timm's
    create_transform on a PIL image, torchvision's C++ ops (nms): in a fresh
    interpreter with the fixture's environment (and the real torchvision, not a stand-in)."""
    run([sys.executable, str(CLIENT), "--write-images", str(tmp_path / "images"), "--count", "9"],
        check=True, timeout=120)
    done = run([sys.executable, "-c", CHECK, str(tmp_path / "images")], env={**os.environ, **torchvision_env},
               capture_output=True, text=True, timeout=180, fork=False)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if torchvision_env:
        assert got["torchvision"].startswith(torchvision_cpu.TORCHVISION), got
        assert got["timm"] == torchvision_cpu.TIMM, got
        assert got["torchvision_file"].startswith(str(torchvision_cpu.DEFAULT_DIR)), got
    assert got["v2"][:2] == [[3, 64, 64], "torch.float32"] and got["v2"][2] < 0, got
    assert got["folder"] == [9, ["class0", "class1", "class2"], [3, 72, 72], "torch.uint8", 2]
    assert got["timm_out"] == [[3, 48, 48], "torch.float32"], got
    assert got["nms"] == [0], got


def test_without_gcc_it_says_why(tmp_path, monkeypatch):
    """Where the stubs cannot be built (no gcc on PATH), ensure() raises Unavailable
    naming it, and why_not() gives the same reason for a skip; nothing is installed."""
    if torchvision_cpu.environment(tmp_path / "none") == {}:
        pytest.skip("torchvision imports natively here: ensure() needs no gcc")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    base = tmp_path / "tv"
    with pytest.raises(torchvision_cpu.Unavailable, match="no gcc"):
        torchvision_cpu.ensure(base, log=lambda line: None)
    assert "no gcc" in torchvision_cpu.why_not(base)
    assert torchvision_cpu.environment(base) is None
    assert not (base / "site").exists()


def test_command_line_prints_the_environment(torchvision_env):
    """`python3 -m tools.torchvision_cpu env` prints the exports ensure() made ready."""
    done = subprocess.run([sys.executable, "-m", "tools.torchvision_cpu", "env"],
                          capture_output=True, text=True, timeout=120,
                          cwd=torchvision_cpu.ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"export {k}={v}" for k, v in torchvision_env.items()]
