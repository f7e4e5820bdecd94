"""Issue 27's real-client test: jobs with different torchvision augmentations share one
decode.

Every job is tests/clients/tv_augment.py, a training script as a user writes it: its
whole torchvision pipeline cut by ``tensorsocket.split_transform()`` into the shared,
deterministic prefix (``v2.Resize((72, 72))``, ``v2.PILToTensor()``), the transform of a
torchvision ImageFolder of generated JPEGs, and its own augmentation:
``share(DataLoader(ds, batch_size=8, shuffle=True, num_workers=1), name=...,
transform=<its own v2 augmentation>, seed=...)``. The jobs are real processes (fresh
interpreters with the real torchvision of tools/torchvision_cpu: the torchvision_env
fixture), started together; the first one's share() starts the producer.

What is asserted, from the jobs' records and the log of loads ($TS_TEST_LOADS: every
load writes the pid of the process running the DataLoader):
- one producer for all the jobs, and every load in it: the consumers decode nothing,
  and each sample is decoded once per epoch however many jobs there are;
- every sample once per job and epoch;
- each job's samples went through its own transform: its output size (A 64, B 56,
  C 48 px), and what it leaves (A normalised: values below 0; B and C in [0, 1]; C's
  three channels equal, RandomGrayscale, where A's and B's differ: the JPEGs are colour
  gradients);
- the same job seed gives the same output per sample id in a second run (another
  producer, another shuffle order), and another epoch gives other outputs;
- timm's create_transform, on PIL images (transform_input="pil");
- a transform that cannot run on the shared samples (Normalize on uint8) fails the job
  at its first batch with a TransformError naming both sides;
- the decoded-sample cache (cache_bytes=): with room for the dataset, 3 epochs load each
  sample once (epochs 2 and 3 are served from the cache); with too little room, every
  epoch loads again and the producer's log says why, as a WARNING. Its cleanup after a
  SIGKILLed producer is tested with the cache itself (the producer's memfd).
"""

from __future__ import annotations

import collections
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import run
from tensorsocket.producer.sample_cache import CHECKED_SAMPLES
from tools import harness

CLIENT = Path(__file__).resolve().parent / "clients" / "tv_augment.py"
N_IMAGES = 96
JOB_TIMEOUT = 300  # s: a fresh interpreter importing torch and torchvision, on a loaded machine


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """The ImageFolder: 96 JPEGs of 80..140 px a side, in 3 class folders."""
    root = tmp_path_factory.mktemp("imagefolder")
    run([sys.executable, str(CLIENT), "--write-images", str(root), "--count", str(N_IMAGES)],
        check=True, timeout=120)
    return root


@dataclass
class Job:
    label: str
    proc: harness.ChildProcess
    out: Path
    loads: Path


class Jobs:
    """tv_augment.py jobs of one test, in a runtime directory of the test's own."""

    def __init__(self, procs: Any, env: dict[str, str], tmp: Path, runtime: Path,
                 images: Path) -> None:
        self.procs, self.tmp, self.images = procs, tmp, images
        # TENSORSOCKET_TIMEOUT: the first job's share() waits that long for the others
        # (min_consumers), fresh interpreters that import torch and torchvision.
        self.env = harness.child_env({**env, "TENSORSOCKET_RUNTIME_DIR": str(runtime),
                                      "TENSORSOCKET_TIMEOUT": str(JOB_TIMEOUT // 2)},
                                     threads=1)

    def start(self, label: str, variant: str, name: str, *, seed: int, epochs: int,
              min_consumers: int = 1, loads: str = "loads", env: dict | None = None,
              **options: Any) -> Job:
        """Start a job; `loads`: the name of its log of loads (jobs of one producer share
        one); env: more variables; options: further flags (cache_bytes=...,
        transform_workers=...)."""
        out, loads_path = self.tmp / label, self.tmp / f"{loads}.txt"
        argv = [str(CLIENT), "--root", str(self.images), "--name", name, "--out", str(out),
                "--variant", variant, "--seed", str(seed), "--epochs", str(epochs),
                "--min-consumers", str(min_consumers)]
        for key, value in options.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        proc = self.procs.children.spawn(harness.python_argv(*argv), label=label,
                                         env={**self.env, "TS_TEST_LOADS": str(loads_path),
                                              **(env or {})})
        return Job(label, proc, out, loads_path)

    def finish(self, *jobs: Job) -> dict[str, dict]:
        """Wait for the jobs (exit status 0) and for their producers to end; their records
        by label."""
        records = {}
        for job in jobs:
            job.proc.result(JOB_TIMEOUT)
            records[job.label] = json.loads(Path(f"{job.out}.rank0.json").read_text())
            assert records[job.label].get("done"), records[job.label]
        for pid in {r["producer_pid"] for r in records.values()}:
            wait_gone(pid, timeout=60)
        return records


def wait_gone(pid: int, timeout: float) -> None:
    """Wait until process pid has ended (a producer ends after its epochs)."""
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"producer {pid} still runs {timeout} s after its jobs"
        time.sleep(0.05)


@pytest.fixture
def jobs(procs, torchvision_env, tmp_path, short_tmp, images) -> Jobs:
    return Jobs(procs, torchvision_env, tmp_path, short_tmp, images)


def loads_by_owner(path: Path) -> collections.Counter:
    """Loads per process that ran the DataLoader ({pid: count})."""
    if not path.exists():
        return collections.Counter()
    return collections.Counter(int(line.split()[0]) for line in path.read_text().splitlines())


def check_one_producer(records: dict[str, dict]) -> int:
    """The jobs' common producer: started by exactly one of them, none of them."""
    producers = {label: r["producer_pid"] for label, r in records.items()}
    assert len(set(producers.values())) == 1 and None not in producers.values(), producers
    assert sorted(r["started_producer"] for r in records.values()) == \
        [False] * (len(records) - 1) + [True], records
    pid = next(iter(producers.values()))
    assert pid not in {r["pid"] for r in records.values()}
    return pid


def check_every_sample_once(record: dict, epochs: int) -> None:
    """Each epoch of the job held every sample id exactly once, in len(loader) batches
    of at most 8, with the right labels."""
    assert sorted(record["epochs"]) == [str(e) for e in range(epochs)], record["epochs"].keys()
    for epoch, got in record["epochs"].items():
        ids = [i for batch in got["batches"] for i in batch]
        assert sorted(ids) == list(range(N_IMAGES)), (record["variant"], epoch, ids)
        assert len(got["batches"]) == record["len"] and max(map(len, got["batches"])) <= 8
        assert got["wrong_targets"] == 0, (record["variant"], epoch)


# What each variant's transform leaves in its outputs: size, range, grayscale or not.
EXPECTED = {
    "A": dict(size=64, normalised=True, gray=False),
    "B": dict(size=56, normalised=False, gray=False),
    "C": dict(size=48, normalised=False, gray=True),
    "timm": dict(size=48, normalised=True, gray=None),
}


def wait_gone_after(job: Job) -> dict:
    """A failed job's record (written once share() returned), once its producer ended."""
    record = json.loads(Path(f"{job.out}.rank0.json").read_text())
    wait_gone(record["producer_pid"], timeout=60)
    return record


# The job's own steps, as split_transform() left them after the shared part.
OWN_STEPS = {
    "A": ["RandomResizedCrop", "RandomHorizontalFlip", "ToDtype", "Normalize"],
    "B": ["RandomResizedCrop", "ColorJitter", "ToDtype"],
    "C": ["RandomResizedCrop", "RandomGrayscale", "ToDtype"],
}


def check_own_transform(record: dict) -> None:
    """The job's pipeline was split after the shared prefix, and its outputs carry its
    own transform's marks (EXPECTED)."""
    shared, own = record["split"]
    assert shared == ["Resize", "PILToTensor"], record["split"]
    if record["variant"] in OWN_STEPS:
        assert own == OWN_STEPS[record["variant"]], record["split"]
    want = EXPECTED[record["variant"]]
    for epoch, got in record["epochs"].items():
        where = (record["variant"], epoch)
        assert got["shapes"] == [[3, want["size"], want["size"]]], (where, got["shapes"])
        assert got["dtypes"] == ["torch.float32"], (where, got["dtypes"])
        if want["normalised"]:
            assert got["min"] < 0, (where, got["min"])
        else:
            assert 0 <= got["min"] and got["max"] <= 1, (where, got["min"], got["max"])
        if want["gray"] is not None:
            assert got["equal_channels"] == (N_IMAGES if want["gray"] else 0), \
                (where, got["equal_channels"])


def check_decoded_by(loads: Path, producer: int, records: dict[str, dict],
                     decodes: int) -> None:
    """Every load ran in the producer (none in the jobs), `decodes` in all."""
    owners = loads_by_owner(loads)
    assert set(owners) == {producer}, (owners, producer)
    assert sum(owners.values()) == decodes, (owners, decodes)
    assert all(r["own_loads"] == 0 for r in records.values()), records


def check_shared_jobs(started: list, records: dict, epochs: int) -> int:
    """The jobs of one shared loader: one producer (its pid returned), every sample once
    per job and epoch, each job's own transform, every decode in the producer."""
    producer = check_one_producer(records)
    for record in records.values():
        check_every_sample_once(record, epochs=epochs)
        check_own_transform(record)
    check_decoded_by(started[0].loads, producer, records, decodes=epochs * N_IMAGES)
    return producer


def test_two_jobs_one_epoch(jobs, name):
    """The short run: jobs A and C (crop 64 + flip + normalise; crop 48 + grayscale) over
    one producer, one epoch: one decode of each sample for both, each job its own
    outputs."""
    started = [jobs.start("A", "A", name, seed=11, epochs=1, min_consumers=2),
               jobs.start("C", "C", name, seed=33, epochs=1, min_consumers=2)]
    records = jobs.finish(*started)
    check_shared_jobs(started, records, epochs=1)


@pytest.mark.slow
def test_three_jobs_three_augmentations(jobs, name):
    """Issue 27's scenario: 3 jobs started together (A: crop 64, flip, normalise; B: crop
    56, colour jitter, its transform in a worker process; C: crop 48, grayscale), 2
    epochs over one producer; then job A alone again with the same seed (a new
    producer, another order): the same output for each sample id."""
    started = [jobs.start("A", "A", name, seed=11, epochs=2, min_consumers=3),
               jobs.start("B", "B", name, seed=22, epochs=2, min_consumers=3,
                          transform_workers=1),
               jobs.start("C", "C", name, seed=33, epochs=2, min_consumers=3)]
    records = jobs.finish(*started)
    producer = check_shared_jobs(started, records, epochs=2)

    again = jobs.finish(jobs.start("A2", "A", f"{name}-again", seed=11, epochs=2,
                                   loads="loads-again"))["A2"]
    check_every_sample_once(again, epochs=2)
    assert again["producer_pid"] != producer
    first = records["A"]["epochs"]
    assert [b for e in again["epochs"].values() for b in e["batches"]] != \
        [b for e in first.values() for b in e["batches"]], "the same order: a weak check"
    for epoch in ("0", "1"):
        assert again["epochs"][epoch]["checksums"] == first[epoch]["checksums"], epoch
    # The epoch is part of each sample's seed: another epoch, other crops.
    same = [i for i, c in first["0"]["checksums"].items() if first["1"]["checksums"][i] == c]
    assert len(same) < N_IMAGES // 4, same


@pytest.mark.slow
def test_timm_transform_on_pil_images(jobs, name):
    """A job whose transform is timm's create_transform(48, is_training=True), handed PIL
    images (transform_input="pil"): normalised 3x48x48 float outputs, every sample once,
    decoded in the producer."""
    job = jobs.start("timm", "timm", name, seed=5, epochs=1)
    records = jobs.finish(job)
    producer = check_one_producer(records)
    check_every_sample_once(records["timm"], epochs=1)
    check_own_transform(records["timm"])
    check_decoded_by(job.loads, producer, records, decodes=N_IMAGES)


@pytest.mark.slow
def test_decoded_cache_hit_and_budget(jobs, name):
    """Two producers at once, 3 epochs each: with cache_bytes= room for the dataset (96 x
    (3x72x72 + two int64) bytes = 1.5 MB), each sample is loaded once, epochs 2 and 3
    come from the cache, less the CHECKED_SAMPLES loaded again before each cached epoch
    (the content check); with 100 kB, the cache is off, every epoch loads every sample,
    and the producer's log says so as a WARNING."""
    fits = jobs.start("fits", "A", f"{name}-fits", seed=1, epochs=3, loads="loads-fits",
                      cache_bytes=8 << 20)
    small = jobs.start("small", "C", f"{name}-small", seed=2, epochs=3, loads="loads-small",
                       cache_bytes=100_000)
    records = jobs.finish(fits, small)
    cached = N_IMAGES + 2 * CHECKED_SAMPLES
    for label, job, decodes in (("fits", fits, cached), ("small", small, 3 * N_IMAGES)):
        record = records[label]
        check_every_sample_once(record, epochs=3)
        check_own_transform(record)
        check_decoded_by(job.loads, record["producer_pid"], {label: record}, decodes)
    # The producers' logs as the jobs read them after their first epoch (the cache was
    # decided at the first batch; a producer that ends cleanly removes its log).
    small_log = records["small"]["producer_log_text"]
    assert small_log is not None, records["small"]["producer_log"]
    assert [line for line in small_log.splitlines()
            if " WARNING " in line and "decoded cache off" in line], small_log
    fits_log = records["fits"]["producer_log_text"]
    assert fits_log is not None, records["fits"]["producer_log"]
    assert not [line for line in fits_log.splitlines()
                if " WARNING " in line and "cache" in line], fits_log


@pytest.mark.slow
def test_transform_that_cannot_run_on_the_shared_samples(jobs, name):
    """A job whose transform wants floats (Normalize without ToDtype) over the shared
    uint8 samples fails at its first batch with TransformError naming the transform and
    the samples' dtype and shape; its producer ends by itself (idle timeout)."""
    job = jobs.start("wrong", "wrong", name, seed=1, epochs=1,
                     env={"TENSORSOCKET_IDLE_TIMEOUT": "2"})
    with pytest.raises(harness.ChildFailed) as failed:
        job.proc.result(JOB_TIMEOUT)
    said = str(failed.value)
    # Both sides: the transform (and what it raised), the samples' dtype and shape.
    assert "TransformError(TypeError): transform=Compose" in said, said  # (issue 36: both types)
    assert "should be a float tensor" in said, said
    assert "uint8" in said and "(3, 72, 72)" in said, said
    assert wait_gone_after(job)["epochs"] == {}
