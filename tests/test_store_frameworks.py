"""share(..., store=True) inside the training stacks users run: the scripts of
tests/test_frameworks.py (tests/clients/) with ``TS_TEST_STORE=1`` (their one-line swap
becomes ``share(loader, name=..., store=True)``), each run twice: through the store, and
without tensorsocket (``--no-share``, the baseline). With the store each job keeps its own
DataLoader, so every rank's batches of every epoch must be the baseline's, id for id:
Lightning's fit with a train and a val loader (and its sanity check), Lightning's DDP
(which rebuilds the loader with a DistributedSampler: a StoreLoader again), torchrun DDP
with a DistributedSampler per rank, a Hugging Face ``datasets.Dataset`` in torch format,
and Accelerate's prepare() and skip_first_batches(), in one process and under
``accelerate launch`` (which make DataLoaders of their own over the store's dataset and
the user's batch sampler)."""

from __future__ import annotations

import pytest

from test_frameworks import Jobs, assert_no_problems, check_epochs, jobs  # noqa: F401 - fixture
from test_resume_frameworks import accelerate_launch

VAL_OFFSET = 10000


def _run_both(jobs: Jobs, label: str, start, timeout: float) -> tuple[dict, dict]:
    """Start the job through the store and its baseline (start(label, store) -> Job), one
    after the other; their records by rank."""
    jobs.env["TS_TEST_STORE"] = "1"
    shared = start(f"{label}-store", True)
    jobs.wait(timeout=timeout)
    del jobs.env["TS_TEST_STORE"]
    baseline = start(f"{label}-own", False)
    jobs.wait(timeout=timeout)
    got = shared.records()
    for rank, record in got.items():  # (the swap made StoreLoaders: the store was read)
        metas = record["meta"].values() if "train" in record["meta"] else [record["meta"]]
        types = [m["type"] for m in metas]
        assert types and all(t.endswith(".StoreLoader") for t in types), (label, rank, types)
    return got, baseline.records()


def _same_as_without(jobs: Jobs, label: str, start, timeout: float, keys: tuple[str, ...],
                     samples: int | None = None) -> None:
    """Run the job through the store and without tensorsocket (_run_both): every rank's
    batches of each key the same; with `samples`, the store's run's two train epochs each
    every sample once."""
    got, want = _run_both(jobs, label, start, timeout)
    problems = _same_batches(label, got, want, keys)
    if samples is not None:
        problems += check_epochs(jobs.jobs[0], "train", samples, 2)
    assert_no_problems(problems, jobs)


def _same_batches(label: str, got: dict, want: dict, keys: tuple[str, ...]) -> list[str]:
    """Problems unless every rank's batches of every epoch of each key are the
    baseline's."""
    problems = []
    if sorted(got) != sorted(want) or not want:
        return [f"{label}: ranks {sorted(got)} through the store, {sorted(want)} without"]
    for rank in sorted(want):
        for key in keys:
            mine, theirs = got[rank].get(key), want[rank].get(key)
            if not theirs or mine != theirs:
                problems.append(f"{label} rank {rank} {key}: through the store {mine}, its "
                                f"own DataLoader {theirs}")
    return problems


def test_lightning_fit_train_and_val(jobs, name):
    """Lightning's fit with a shuffled train loader and an unshuffled val loader, both
    through the store: every train and val epoch, and the sanity check, the batches of
    the job's own loaders."""
    pytest.importorskip("lightning")
    n, nv = 64, 48

    def start(label: str, store: bool):
        return jobs.python(label, "lightning_fit.py", "--name", name, "--val-name",
                           f"{name}-val", "--samples", str(n), "--val-samples", str(nv),
                           *([] if store else ["--no-share"]))

    _same_as_without(jobs, "lightning", start, 120, ("train", "val", "sanity"), samples=n)


@pytest.mark.slow  # two DDP runs of Lightning: a dozen fresh interpreters
def test_lightning_ddp_rebuilds_the_loader(jobs, name):
    """strategy="ddp", devices=2: Lightning rebuilds the train and val loaders with a
    DistributedSampler per rank; through the store each rank's shard is the one it has
    without tensorsocket, epoch by epoch."""
    pytest.importorskip("lightning")
    n, nv = 128, 48

    def start(label: str, store: bool):
        return jobs.python(label, "lightning_fit.py", "--name", name, "--val-name",
                           f"{name}-val", "--devices", "2", "--samples", str(n),
                           "--val-samples", str(nv), *([] if store else ["--no-share"]))

    _same_as_without(jobs, "lightning-ddp", start, 180, ("train", "val"), samples=n)


@pytest.mark.slow  # two torchrun jobs of two ranks
def test_torchrun_ddp_shards(jobs, name):
    """torchrun, 2 ranks, a DistributedSampler each (set_epoch per epoch): each rank's
    shard through the store is its own loader's."""
    import torch.distributed

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    n = 64

    def start(label: str, store: bool):
        return jobs.torchrun(label, 2, "ddp_torchrun.py", "--name", name, "--samples", str(n),
                             *([] if store else ["--no-share"]))

    _same_as_without(jobs, "torchrun", start, 180, ("train",), samples=n)


def test_hf_datasets(jobs, name):
    """A datasets.Dataset in torch format (dict samples; its own __getitems__, which the
    store's dataset leaves for __getitem__): every epoch the job's own loader's batches."""
    pytest.importorskip("datasets")
    n = 64

    def start(label: str, store: bool):
        return jobs.python(label, "hf_datasets.py", "--name", name, "--samples", str(n),
                           *([] if store else ["--no-share"]))

    _same_as_without(jobs, "hf", start, 120, ("train",), samples=n)


def test_accelerate_prepare_and_skip_first_batches(jobs, name):
    """accelerator.prepare(model, optimizer, loader) through the store, two epochs, then
    accelerator.skip_first_batches(loader, 3) for a third: every batch the baseline's."""
    pytest.importorskip("accelerate")
    n = 64

    def start(label: str, store: bool):
        return jobs.python(label, "accelerate_prepare.py", "--name", name, "--samples",
                           str(n), *([] if store else ["--no-share"]))

    _same_as_without(jobs, "accelerate", start, 120, ("train", "skipped"), samples=n)


@pytest.mark.slow  # two accelerate launches of two processes
def test_accelerate_launch_shards(jobs, name):
    """accelerate launch, 2 processes, a shuffled loader through the store (both ranks in
    one store): each rank's shard of its first epoch and of skip_first_batches(loader, 2)
    the one it has without tensorsocket."""
    pytest.importorskip("accelerate")
    n = 128

    def start(label: str, store: bool):
        return accelerate_launch(jobs, label, "accelerate_resume.py", "--name", name,
                                 "--mode", "skip", "--samples", str(n), "--batch-size",
                                 "16", "--skip", "2", "--shuffle",
                                 *([] if store else ["--no-share"]))

    _same_as_without(jobs, "accelerate-launch", start, 180, ("listed", "skipped", "train"))
