"""Issue 36, item 5: ``split_transform()`` on pipelines whose deterministic prefix leaves
PIL images (torchvision v1 and v2 eval pipelines, timm's ``create_transform(64,
is_training=False)``: ``Resize, CenterCrop, ToTensor, Normalize``).

The shared part must end in a tensor (the producer's DataLoader collates it; PIL images
fail default_collate before the first batch), and the job's part, applied to that tensor,
must give what the whole pipeline gives on the same PIL image, bit for bit.

torchvision and timm import only in child interpreters here (tools/torchvision_cpu: the
torchvision_env fixture), so this file is also the children's script:

    python test_split_pil.py unit          one JSON line: each pipeline's split, checked
    python test_split_pil.py e2e ROOT      a job over share(): every sample checked

- unit: each case of CASES on real PIL images (RGB and L, odd sizes): the shared part's
  output type and dtype, whether default_collate takes it, the step names on each side,
  and the largest difference from the whole pipeline's output;
- e2e: a v1 eval pipeline split, its shared part the transform of a torchvision
  ImageFolder of JPEGs in a real producer (share() starts it), the job part the
  consumer's ``transform=``; every delivered sample compared with the whole pipeline on
  the file's PIL image.
"""

from __future__ import annotations

import json
import subprocess
import time
import sys
from pathlib import Path
from typing import Any, Callable

import psutil
import pytest

HERE = Path(__file__).resolve().parent
CHILD_TIMEOUT = 300  # s: a fresh interpreter importing torch and torchvision, on a loaded machine
N_IMAGES = 12
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


# -- the children's side ------------------------------------------------------------------

def make_cases() -> dict[str, Any]:
    """The pipelines split by the unit child, by case name."""
    import timm.data
    import torch
    import torchvision.transforms as T
    from torchvision.transforms import v2

    return {
        # The eval pipelines of the issue: the prefix (Resize, CenterCrop) leaves PIL.
        "v1_eval": T.Compose([T.Resize(72), T.CenterCrop(64), T.ToTensor(),
                              T.Normalize(MEAN, STD)]),
        "v2_eval": v2.Compose([v2.Resize(72), v2.CenterCrop(64), v2.ToTensor(),
                               v2.Normalize(MEAN, STD)]),
        "timm_eval": timm.data.create_transform(64, is_training=False),
        # A PIL step between the prefix and ToTensor: the job's part must run it on PIL.
        "v1_pil_step": T.Compose([T.Resize(72), T.CenterCrop(64), T.RandomHorizontalFlip(1.0),
                                  T.ToTensor()]),
        # A prefix that converts already: the split is as it was.
        "v2_converted": v2.Compose([v2.Resize(72), v2.CenterCrop(64), v2.ToImage(),
                                    v2.ToDtype(torch.float32, scale=True),
                                    v2.Normalize(MEAN, STD)]),
        # No tensor conversion at all: the original gives PIL, the split a tensor of it.
        "v2_no_conversion": v2.Compose([v2.Resize(72), v2.CenterCrop(64),
                                        v2.RandomHorizontalFlip(1.0)]),
    }


# The cases without Normalize (3 channels), run on a grayscale (mode L) image too.
GRAY_CASES = frozenset({"v1_pil_step", "v2_no_conversion"})


def pil_images() -> list[Any]:
    """Real PIL images: 3 RGB, then one L; odd sizes, noise (every pixel matters)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(36)
    rgb = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
           for h, w in ((97, 131), (80, 80), (150, 91))]
    gray = Image.fromarray(rng.integers(0, 256, (101, 77), dtype=np.uint8), "L")
    return rgb + [gray]


def as_tensor(output: Any) -> Any:
    """The original pipeline's output as a tensor (a PIL output: its PILToTensor)."""
    import torch
    from torchvision.transforms.functional import pil_to_tensor

    return output if isinstance(output, torch.Tensor) else pil_to_tensor(output)


def check_split(pipeline: Any, images: list[Any]) -> dict:
    """What split_transform(pipeline) gives on `images` (see the module's docstring)."""
    import torch
    from torch.utils.data import default_collate

    import tensorsocket

    shared, job = tensorsocket.split_transform(pipeline)
    record: dict[str, Any] = {
        "shared_steps": [type(t).__name__ for t in shared.transforms],
        "job_steps": [type(t).__name__ for t in job.transforms],
        "shared_types": sorted({type(shared(img)).__name__ for img in images}),
        "shared_dtypes": sorted({str(getattr(shared(img), "dtype", None)) for img in images}),
        "max_diff": 0.0, "equal": True}
    try:  # the producer's DataLoader collates the shared outputs (same size: the RGB ones)
        default_collate([shared(img) for img in images[:3]])
        record["collates"] = True
    except TypeError as e:
        record["collates"] = f"{type(e).__name__}: {e}"
    for img in images:
        want, got = as_tensor(pipeline(img)), as_tensor(job(shared(img)))
        same = want.dtype == got.dtype and want.shape == got.shape
        record["equal"] &= same and torch.equal(want, got)
        if same:
            diff = (want.double() - got.double()).abs().max().item()
            record["max_diff"] = max(record["max_diff"], diff)
    return record


def unit_main() -> None:
    """The unit child: one JSON line, each case's check_split() record (or its error)."""
    import warnings

    warnings.simplefilter("ignore")  # v2.ToTensor's deprecation: the case is deliberate
    images, out = pil_images(), {}
    for case, pipeline in make_cases().items():
        try:
            out[case] = check_split(pipeline, images if case in GRAY_CASES else images[:3])
        except Exception as e:  # noqa: BLE001 - reported per case, asserted by the test
            out[case] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)


def e2e_main(root: str, name: str) -> None:
    """The e2e child: a v1 eval pipeline split over share(); every sample of one epoch
    compared with the whole pipeline on its file. One JSON line."""
    import torch
    import torchvision.transforms as T
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder
    from torchvision.datasets.folder import pil_loader

    import tensorsocket

    pipeline = T.Compose([T.Resize(72), T.CenterCrop(64), T.ToTensor(), T.Normalize(MEAN, STD)])
    shared, job = tensorsocket.split_transform(pipeline)

    class Indexed(ImageFolder):
        """ImageFolder whose samples also carry their index."""

        def __getitem__(self, index: int) -> tuple[Any, int, int]:
            return (*super().__getitem__(index), index)

    dataset = Indexed(root, transform=shared)
    loader = tensorsocket.share(DataLoader(dataset, batch_size=4, shuffle=True),
                                name=name, transform=job, seed=1, epochs=1)
    seen, unequal, shapes = [], [], set()
    for x, _, index in loader:
        shapes.add(f"{tuple(x.shape[1:])} {x.dtype}")
        for row, i in enumerate(index.tolist()):
            seen.append(i)
            want = pipeline(pil_loader(dataset.samples[i][0]))
            if not torch.equal(x[row], want):
                unequal.append(i)
    print(json.dumps({"seen": sorted(seen), "unequal": unequal, "shapes": sorted(shapes),
                      "producer_pid": getattr(loader, "producer_pid", None)}), flush=True)


# -- the tests' side ----------------------------------------------------------------------

def child_env(torchvision_env: dict[str, str], **extra: str) -> dict[str, str]:
    """A child's environment: this checkout and the real torchvision importable."""
    from tools import harness

    return harness.child_env({**torchvision_env, **extra}, threads=1)


@pytest.fixture(scope="module")
def split_records(torchvision_env) -> dict[str, dict]:
    """The unit child's records, by case (one interpreter for every case: each start
    imports torch, torchvision and timm)."""
    done = subprocess.run([sys.executable, __file__, "unit"], capture_output=True, text=True,
                          env=child_env(torchvision_env), timeout=CHILD_TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_tensor_split(record: dict, shared_end: str, job_start: str) -> None:
    """A split whose shared part ends in a uint8 tensor that collates (its last step
    `shared_end`, the job's first `job_start`), the job giving the pipeline's output bit
    for bit."""
    assert "error" not in record, record
    assert record["shared_types"] == ["Tensor"], record
    assert record["shared_dtypes"] == ["torch.uint8"], record
    assert record["collates"] is True, record
    assert record["shared_steps"][-1] == shared_end, record
    assert record["job_steps"][0] == job_start, record
    assert record["equal"] and record["max_diff"] == 0.0, record


def test_v1_eval_pipeline_shares_a_tensor(split_records):
    """torchvision v1: Resize, CenterCrop, ToTensor, Normalize: the shared part ends in a
    uint8 tensor, ToTensor becomes its exact scaling; a PIL step before ToTensor runs in
    the job on the PIL image the tensor was made from."""
    check_tensor_split(split_records["v1_eval"], "AsTensor", "ScaleLikeToTensor")
    assert split_records["v1_eval"]["job_steps"] == ["ScaleLikeToTensor", "Normalize"]
    check_tensor_split(split_records["v1_pil_step"], "AsTensor", "TensorToPIL")
    assert split_records["v1_pil_step"]["job_steps"] == \
        ["TensorToPIL", "RandomHorizontalFlip", "ToTensor"]


def test_v2_pipelines_share_a_tensor(split_records):
    """torchvision v2: the eval pipeline with v2.ToTensor as v1's; one that converts in
    its prefix (ToImage) is split as before; one with no conversion at all shares a
    tensor and gives the tensor of the pipeline's PIL output."""
    check_tensor_split(split_records["v2_eval"], "AsTensor", "ScaleLikeToTensor")
    converted = split_records["v2_converted"]
    assert converted["shared_steps"] == ["Resize", "CenterCrop", "ToImage"], converted
    assert converted["job_steps"] == ["ToDtype", "Normalize"], converted
    assert converted["collates"] is True and converted["equal"], converted
    check_tensor_split(split_records["v2_no_conversion"], "AsTensor", "RandomHorizontalFlip")


def test_timm_eval_transform_shares_a_tensor(split_records):
    """timm's create_transform(64, is_training=False) (Resize, CenterCrop, MaybeToTensor,
    Normalize: MaybeToTensor passes a tensor through unscaled, so it is replaced too)."""
    check_tensor_split(split_records["timm_eval"], "AsTensor", "ScaleLikeToTensor")


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    """An ImageFolder of N_IMAGES JPEGs of 80..140 px a side (tests/clients/tv_augment.py)."""
    root = tmp_path_factory.mktemp("pil-images")
    subprocess.run([sys.executable, str(HERE / "clients" / "tv_augment.py"), "--write-images",
                    str(root), "--count", str(N_IMAGES)], check=True, timeout=120)
    return root


def test_split_eval_pipeline_through_a_producer(procs, torchvision_env, short_tmp, name,
                                                image_folder):
    """A job over share(): the producer's DataLoader reads an ImageFolder of JPEGs through
    the v1 eval pipeline's shared part (before the fix it failed at its first batch:
    default_collate found PIL images), the job applies its part: every sample once,
    3x64x64 float32, each equal to the whole pipeline on its file."""
    from tools import harness

    env = child_env(torchvision_env, TENSORSOCKET_RUNTIME_DIR=str(short_tmp))
    job = procs.children.spawn(harness.python_argv(__file__, "e2e", image_folder, name),
                               label="e2e", env=env, fork_server=None)
    got = job.result(CHILD_TIMEOUT)
    assert got["seen"] == list(range(N_IMAGES)), got
    assert got["unequal"] == [], got
    assert got["shapes"] == ["(3, 64, 64) torch.float32"], got
    wait_gone(got["producer_pid"], timeout=60)  # its ring removed before `name` checks


def wait_gone(pid: int, timeout: float) -> None:
    """Wait until process pid has ended (a producer ends after its epochs)."""
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"producer {pid} still runs {timeout} s after its job"
        time.sleep(0.05)


CHILDREN: dict[str, Callable[..., None]] = {"unit": unit_main, "e2e": e2e_main}

if __name__ == "__main__":
    CHILDREN[sys.argv[1]](*sys.argv[2:])
