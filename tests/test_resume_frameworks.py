"""Training frameworks' own resume paths over a shared loader, run as a user runs them.

A job is interrupted mid-epoch and resumed in a new process, each framework its own way;
every sample carries its id, and what the two runs received together is counted:

- PyTorch Lightning (``lightning_resume.py``): a run stops after K steps of epoch 0 with
  a checkpoint saved there (``ModelCheckpoint(every_n_train_steps=K)``, ``max_steps=K``;
  Lightning puts the loader's ``state_dict()`` in it), then ``trainer.fit(model,
  ckpt_path=...)`` in a new process. The two runs together must hold every sample of
  epoch 0 exactly once, and the resumed run's epoch 1 every sample once; Lightning must
  not warn that the loader is not resumable (it does for a plain DataLoader: the slow
  baseline test shows the client meets the warning's conditions).
- Hugging Face Accelerate under ``accelerate launch --multi_gpu --num_processes 2`` on
  the CPU (``accelerate_resume.py``): ``accelerator.skip_first_batches(loader, k)`` on
  each rank must give the rest of that rank's part of the epoch (the loader it builds
  from the consumer's ``batch_sampler`` must describe that rank's batches); and
  ``register_for_checkpointing(loader)`` with ``save_state`` / ``load_state`` across two
  launches must give every sample of the interrupted epoch once over the ranks.

The processes, deadlines and checks are those of tests/test_frameworks.py (the ``jobs``
fixture; ``TS_TEST_TIMEOUT_SCALE`` scales every deadline). ``TS_TEST_NO_SHARE=1`` runs
the scripts on plain DataLoaders: the skip_first_batches test passes (accelerate shards a
DataLoader it prepared), Lightning's resume test fails as it should (a plain DataLoader's
resumed epoch starts over: 96 of 256 samples twice, 96 never), which is the difference
these tests are about.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from tensorsocket.consumer.surface import SamplerView

from test_frameworks import (  # noqa: F401  (jobs: the fixture)
    CLIENTS, BASELINE, Job, Jobs, _free_port, _ids_problem, assert_no_problems, check_loads,
    jobs, producer_pids)

NOT_RESUMABLE = "your dataloader is not resumable"  # Lightning's PossibleUserWarning


def _ids(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def _epoch(job: Job, epoch: int, key: str = "train") -> dict[int, list[list[int]]]:
    """{rank: batches} of one epoch of a job (no entry for a rank that recorded none)."""
    return {rank: r[key][str(epoch)] for rank, r in sorted(job.records().items())
            if str(epoch) in r.get(key, {})}


def check_resumed(first: Job, second: Job, samples: int, stop_after: int) -> list[str]:
    """Problems unless `second`, resumed from the state `first` saved after `stop_after`
    batches of epoch 0 on each rank, took the rest: with those `stop_after` batches every
    sample of epoch 0 exactly once, the same number of batches on every rank; and
    `second`'s epoch 1 every sample once, each rank len(loader) batches. (`first` may have
    gone on after saving: what it took after is lost, as in a job that died later.)"""
    problems = []
    expected = range(samples)
    world = max(int(r.get("world", 1)) for r in first.records().values())
    before = {rank: b[:stop_after] for rank, b in _epoch(first, 0).items()}
    after, whole = _epoch(second, 0), _epoch(second, 1)
    for label, got in (("interrupted run, epoch 0", before),
                       ("resumed run, rest of epoch 0", after), ("resumed run, epoch 1", whole)):
        if sorted(got) != list(range(world)):
            problems.append(f"{label}: batches recorded on ranks {sorted(got)} of {world}")
        counts = {rank: len(b) for rank, b in got.items()}
        if len(set(counts.values())) > 1:
            problems.append(f"{label}: unequal batch counts per rank {counts}")
    taken = {rank: len(b) for rank, b in before.items()}
    if set(taken.values()) != {stop_after}:
        problems.append(f"the interrupted run took {taken} batches per rank, not {stop_after}")
    union = [i for got in (before, after) for b in got.values() for i in _ids(b)]
    problem = _ids_problem(f"epoch 0 over both runs ({len(_ids(sum(before.values(), [])))} "
                           f"samples before the interruption, "
                           f"{len(_ids(sum(after.values(), [])))} after)", union, expected)
    if problem:
        problems.append(problem)
    problem = _ids_problem("the resumed run's epoch 1",
                           [i for b in whole.values() for i in _ids(b)], expected)
    if problem:
        problems.append(problem)
    for rank, r in second.records().items():
        said = r["meta"].get("train", r["meta"]).get("len")
        if rank in whole and len(whole[rank]) != said:
            problems.append(f"resumed run epoch 1 rank {rank}: {len(whole[rank])} batches, "
                            f"len(loader) said {said!r}")
        if not r.get("done"):
            problems.append(f"resumed run rank {rank}: did not finish")
    return problems


def keep_producers(jobs: Jobs) -> None:
    """The producers of this test wait for the resumed run however long it takes to start
    (the test stops them at its end): the resumed run must meet the producer that has
    moved on since the interruption, the case under test (a new producer would start a
    stream of its own)."""
    jobs.env["TENSORSOCKET_IDLE_TIMEOUT"] = "3600"


def check_same_producer(first: Job, second: Job) -> list[str]:
    """Problems unless every rank of both runs read from one producer process."""
    if BASELINE:
        return []
    pids = {f"{job.label} rank {rank}": r["meta"].get("train", r["meta"]).get("producer_pid")
            for job in (first, second) for rank, r in job.records().items()}
    if len(set(pids.values())) != 1 or None in pids.values():
        return [f"the resumed run did not read from the interrupted run's producer: {pids}"]
    return []


# -- PyTorch Lightning ---------------------------------------------------------------------


def run_lightning_twice(jobs: Jobs, name: str, stop_after: int, *extra: str,
                        run_on: int | None = None, timeout: float = 120) -> tuple[Job, Job]:
    """lightning_resume.py with a checkpoint after `stop_after` steps, stopped there (or
    at step `run_on`), then resumed from that checkpoint in a new process."""
    keep_producers(jobs)
    ckpt_dir = jobs.tmp / "checkpoints"
    more = ("--run-on", str(run_on)) if run_on else ()
    first = jobs.python("interrupted", "lightning_resume.py", "--name", name, "--ckpt-dir",
                        str(ckpt_dir), "--stop-after", str(stop_after), *more, *extra)
    jobs.wait(timeout=timeout)
    second = jobs.python("resumed", "lightning_resume.py", "--name", name, "--resume",
                         str(ckpt_dir / f"step={stop_after}.ckpt"), *extra)
    jobs.wait(timeout=timeout)
    return first, second


def lightning_warned(job: Job) -> list[str]:
    """The "not resumable" warnings Lightning printed in a job (any rank)."""
    return [w for r in job.records().values() for w in r.get("warnings", [])
            if NOT_RESUMABLE in w]


@pytest.mark.slow  # 30 s: two Lightning interpreters; resume itself: test_resume*
def test_lightning_fit_resumes_mid_epoch(jobs, name):
    """Trainer.fit stopped after 3 of 8 steps with a checkpoint, then trainer.fit(model,
    ckpt_path=...) in a new process over the same shared shuffling loader: the two runs
    hold every sample of epoch 0 exactly once (the resumed run its 160 unseen samples),
    epoch 1 is whole, the checkpoint holds the loader's state, and Lightning does not warn
    that the loader is not resumable."""
    pytest.importorskip("lightning")
    n, stop_after = 256, 3
    jobs.env["TENSORSOCKET_START_GRACE"] = "0"  # one job: no other to wait for
    first, second = run_lightning_twice(jobs, name, stop_after, "--samples", str(n))
    problems = check_resumed(first, second, n, stop_after) + check_same_producer(first, second)
    saved = second.records()[0].get("checkpoint_loader_state")
    if not BASELINE:
        if not saved:
            problems.append(f"the checkpoint holds no loader state: {saved!r}")
        if lightning_warned(second):
            problems.append(f"Lightning warned on resume: {lightning_warned(second)}")
    problems += check_loads(jobs, producer_pids([first, second]))
    assert_no_problems(problems, jobs)
    jobs.stop_producers()


@pytest.mark.slow  # four Lightning interpreters
def test_lightning_warns_for_a_plain_dataloader(jobs, name):
    """The baseline of the test above: the same two runs on a plain DataLoader (no
    share()) make Lightning print its "dataloader is not resumable" warning, so the
    absence of the warning above means something."""
    pytest.importorskip("lightning")
    first, second = run_lightning_twice(jobs, name, 3, "--samples", "256", "--no-share")
    assert lightning_warned(second), (
        "Lightning did not warn about a plain DataLoader resumed mid-epoch; warnings "
        f"printed: {[w for r in second.records().values() for w in r.get('warnings', [])]}")


@pytest.mark.slow  # DDP: four Lightning interpreters and their process group
def test_lightning_ddp_fit_resumes_mid_epoch(jobs, name):
    """strategy="ddp", devices=2 (gloo): a checkpoint after 2 of each rank's 4 steps,
    the job dies at step 5 (in epoch 1: the producer has moved past the interrupted
    epoch), resumed with ckpt_path (Lightning saves rank 0's loader state only; each rank
    loads it): the resumed run and the 2 steps before the checkpoint hold every sample of
    epoch 0 once over both ranks, each rank the same number of batches; epoch 1 whole."""
    pytest.importorskip("lightning")
    import torch.distributed

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    n, stop_after = 256, 2
    first, second = run_lightning_twice(jobs, name, stop_after, "--samples", str(n),
                                        "--devices", "2", run_on=5, timeout=180)
    problems = check_resumed(first, second, n, stop_after) + check_same_producer(first, second)
    if not BASELINE and lightning_warned(second):
        problems.append(f"Lightning warned on resume: {lightning_warned(second)}")
    problems += check_loads(jobs, producer_pids([first, second]))
    assert_no_problems(problems, jobs)
    jobs.stop_producers()


# -- Hugging Face Accelerate ---------------------------------------------------------------


def accelerate_launch(jobs: Jobs, label: str, script: str, *args: str) -> Job:
    """`accelerate launch --multi_gpu --num_processes 2` of `script` on the CPU (gloo),
    on a port of its own, with --out <tmp>/<label>."""
    out = jobs.tmp / label
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
            str(CLIENTS / script), *args, "--out", str(out)]
    return jobs._start(label, argv, out)


def rank_batches(samples: int, batch_size: int, rank: int, world: int) -> list[list[int]]:
    """The batches of an unshuffled loader that rank `rank` of `world` takes in an epoch:
    loader batches rank, rank + world, ... of the first len // world * world (as
    accelerate's own sharding and DistributedSampler(drop_last=True) split them)."""
    batches = [list(range(i, min(i + batch_size, samples)))
               for i in range(0, samples, batch_size)]
    return batches[rank:len(batches) // world * world:world]


@pytest.mark.slow  # 24 s each: an accelerate launch of two processes
@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
def test_accelerate_skip_first_batches_per_rank(jobs, name, shuffle):
    """accelerate launch, 2 processes, a shared loader of 256 samples in batches of 32, no
    state: skip_first_batches(loader, 2) gives each rank the rest of its own part (its 3rd
    and 4th batches: 64 samples, none on the other rank), as a plain DataLoader prepared
    by accelerate does; not the rest of the whole dataset (192 per rank). Shuffled, the
    part is the rank's share of the one permutation the producer delivers for the epoch
    the consumer reads first (each rank's own sampler would draw another one: 12-18
    samples on both ranks before issue 36): iterated after the skip, the loader gives
    exactly the batches its batch_sampler listed."""
    pytest.importorskip("accelerate")
    n, batch_size, skip, world = 256, 32, 2, 2
    job = accelerate_launch(jobs, "skip", "accelerate_resume.py", "--name", name, "--mode",
                            "skip", "--samples", str(n), "--batch-size", str(batch_size),
                            "--skip", str(skip), *(["--shuffle"] if shuffle else []))
    jobs.wait(timeout=90)
    records = job.records()
    problems = [] if sorted(records) == list(range(world)) else \
        [f"records of ranks {sorted(records)}, not of {world}"]
    got = {}
    for rank, r in sorted(records.items()):
        if "skip_error" in r:
            problems.append(f"rank {rank}: skip_first_batches raised {r['skip_error']}\n"
                            f"{r.get('skip_traceback', '')}")
            continue
        got[rank] = _ids(r["skipped"])
        listed = r["listed"]
        want = listed[skip:] if shuffle else rank_batches(n, batch_size, rank, world)[skip:]
        if shuffle and len(listed) != n // batch_size // world:
            problems.append(f"rank {rank}: batch_sampler listed {len(listed)} batches, want "
                            f"{n // batch_size // world}")
        if r["skipped"] != want:
            problems.append(
                f"rank {rank}: skip_first_batches(loader, {skip}) gave {len(r['skipped'])} "
                f"batches, {len(got[rank])} samples (first ids {[b[:1] for b in r['skipped']]})"
                f"; want this rank's last {len(want)} batches, {len(_ids(want))} samples "
                f"(first ids {[b[:1] for b in want]})")
        if r.get("skip_meta", {}).get("len") != len(want):
            problems.append(f"rank {rank}: len() of the skipping loader is "
                            f"{r.get('skip_meta', {}).get('len')}, want {len(want)}")
        if shuffle and not BASELINE and r["train"].get("0") != listed:
            problems.append(f"rank {rank}: its first epoch through the producer (first ids "
                            f"{[b[:1] for b in r['train'].get('0', [])]}) is not what its "
                            f"batch_sampler listed (first ids {[b[:1] for b in listed]})")
    if len(got) == world:
        overlap = set(got[0]) & set(got[1])
        if overlap:
            problems.append(f"{len(overlap)} samples on both ranks, e.g. {sorted(overlap)[:8]}")
        if len(set(got[0]) | set(got[1])) != world * (n // batch_size // world - skip) * \
                batch_size:
            problems.append(f"the ranks' skipped loaders gave {len(got[0])} + {len(got[1])} "
                            "samples, not the rest of their parts")
    assert_no_problems(problems, jobs)
    jobs.stop_producers()


@pytest.mark.parametrize("own_batch_size,drop_last", [(None, False), (48, False), (48, True)])
def test_batch_sampler_view_is_the_ranks_part(own_batch_size, drop_last):
    """What skip_first_batches rebuilds a loader from, for rank 1 of 2 with no record of
    the epoch: the caller's loader's batches 1, 3, 5, 7 (the first len // 2 * 2 of 9),
    cut into the consumer's own batches where it has a batch_size (the last one short
    unless drop_last); the sampler view is the same indices one by one."""
    loader = DataLoader(torch.arange(288), batch_size=32)  # 9 batches: the 9th to no rank
    surface = SimpleNamespace(local_loader=loader, rank=1, world_size=2,
                              own_batch_size=own_batch_size, drop_last=drop_last,
                              known_batches=lambda: None,
                              first_epoch_listing=lambda: "not listed (a test)")
    part = [i for b in rank_batches(288, 32, 1, 2) for i in b]
    size = own_batch_size or 32
    want = [part[i:i + size] for i in range(0, len(part), size)]
    if drop_last and len(want[-1]) < size:
        want.pop()
    assert list(iter(SamplerView(surface, batches=True))) == want
    assert list(iter(SamplerView(surface, batches=False))) == [i for b in want for i in b]


@pytest.mark.slow  # three accelerate launches of two processes each
def test_accelerate_save_and_load_state(jobs, name):
    """register_for_checkpointing(loader); 2 of each rank's 4 batches of epoch 0, then
    accelerator.save_state and exit; a new accelerate launch does load_state and trains
    on: over both launches and both ranks, every sample of epoch 0 exactly once, each
    rank the same number of batches; epoch 1 whole. A third launch resumes from the same
    state as accelerate's examples do, load_state then skip_first_batches(loader, 2):
    with the 2 batches before, every sample of epoch 0 once too."""
    pytest.importorskip("accelerate")
    n, stop_after = 256, 2
    keep_producers(jobs)
    common = ("--name", name, "--samples", str(n), "--shuffle", "--state-dir",
              str(jobs.tmp / "state"))
    first = accelerate_launch(jobs, "interrupted", "accelerate_resume.py", *common,
                              "--mode", "interrupt", "--stop-after", str(stop_after))
    jobs.wait(timeout=90)
    second = accelerate_launch(jobs, "resumed", "accelerate_resume.py", *common,
                               "--mode", "resume")
    jobs.wait(timeout=90)
    problems = check_resumed(first, second, n, stop_after) + check_same_producer(first, second)
    third = accelerate_launch(jobs, "resumed-by-skip", "accelerate_resume.py", *common,
                              "--mode", "resume-skip", "--stop-after", str(stop_after))
    jobs.wait(timeout=90)
    before = [b for r in first.records().values() for b in r["train"]["0"][:stop_after]]
    after = _epoch(third, 0)
    counts = {rank: len(b) for rank, b in after.items()}
    if sorted(counts) != [0, 1] or len(set(counts.values())) != 1:
        problems.append(f"load_state + skip_first_batches: batches per rank {counts}")
    problem = _ids_problem("epoch 0, the interrupted launch's batches and load_state + "
                           "skip_first_batches", _ids(before) + [
                               i for b in after.values() for i in _ids(b)], range(n))
    if problem:
        problems.append(problem)
    problems += check_loads(jobs, producer_pids([first, second]) | {
        r["meta"]["pid"] for r in third.records().values()})
    assert_no_problems(problems, jobs)
    jobs.stop_producers()
