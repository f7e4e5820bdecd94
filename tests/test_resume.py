"""Checkpoint and restart over a shared stream (issue 24, item 1): a job interrupted
mid-epoch saves ``state_dict()``; a new process that loads it gets exactly the samples of
that epoch not yet taken, then whole epochs. Real processes (tests/resume_job.py) over
shared() producers; every sample counted by id."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pytest

from conftest import ROOT, popen
from tensorsocket.control.endpoints import runtime_dir
from tensorsocket.data.resume import EpochShape, EpochTaken, SavedPlace, decode, encode
from tensorsocket.data.sample_ids import IdMask, split, with_ids

JOB = ROOT / "tests" / "resume_job.py"
SCALE = float(os.environ.get("TS_TEST_TIMEOUT_SCALE", "1"))
JOB_TIMEOUT = 150 * SCALE
# idle_timeout of the shared producers the jobs start: they wait for the resumed job
# however long it takes to start (it must meet the producer that moved on since the
# interruption, the case under test), and the test stops them at its end.
IDLE = 3600.0


def run_job(name: str, *args: str, state_in=None, state_out=None) -> dict:
    """Run one job to its end; its JSON line."""
    argv = [sys.executable, str(JOB), name, *args]
    if state_in is not None:
        argv += ["--state-in", str(state_in)]
    if state_out is not None:
        argv += ["--state-out", str(state_out)]
    return wait_job(start_job(argv))


def start_job(argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "TENSORSOCKET_START_GRACE": "0",
           "TENSORSOCKET_IDLE_TIMEOUT": str(IDLE)}
    return popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 text=True)


def wait_job(p: subprocess.Popen) -> dict:
    try:
        out, err = p.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"job hung\nstdout: {out[-2000:]}\nstderr: {err[-4000:]}")
    assert p.returncode == 0, f"exit {p.returncode}\nstdout: {out}\nstderr: {err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


def flat(epoch: list[list[int]]) -> list[int]:
    return [i for batch in epoch for i in batch]


def assert_once(ids: list[int], samples: int, what: str) -> None:
    """`ids` holds every sample id in range(samples) exactly once."""
    counts = Counter(ids)
    twice = sorted(i for i, c in counts.items() if c > 1)
    missing = sorted(set(range(samples)) - set(counts))
    assert not twice and not missing, (
        f"{what}: {len(ids)} ids, {len(counts)} distinct of {samples}; "
        f"twice {twice[:10]}..., missing {missing[:10]}...")


@pytest.fixture
def producers_end(name):
    """After the test, the shared producers of `name` are stopped with SIGTERM, which ends
    them cleanly (segment, socket and lock removed), and must be gone."""
    yield
    for pid in _live_producers(name):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30 * SCALE
    while _live_producers(name):
        if time.monotonic() > deadline:
            pytest.fail(f"the producers of {name} did not end")
        time.sleep(0.05)


def _live_producers(name: str) -> list[int]:
    """The pids of the running producers of `name` (from their lock files)."""
    pids = []
    for lock in runtime_dir().glob(f"{name}*.lock"):
        try:
            pid = int(lock.read_text().strip() or 0)
            if pid:
                os.kill(pid, 0)
                pids.append(pid)
        except (OSError, ValueError):
            continue
    return pids


def same_producer(*jobs: dict) -> None:
    """Every job read from one producer process."""
    pids = {job["producer_pid"] for job in jobs}
    assert len(pids) == 1, f"the jobs read from several producers: {pids}"


# -- one job, interrupted and resumed --------------------------------------------------

@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffle", "in-order"])
def test_resumed_epoch_holds_exactly_the_samples_not_taken(name, tmp_path, producers_end,
                                                           shuffle):
    """3 of the 8 batches of epoch 0, state saved after the break (in the loop, in-order
    case), the job exits; a new job loads the state: its epoch 0 is exactly the 160 samples not taken, in 5 batches
    of 32, and its epoch 1 is whole. (On the old main: 60 of the 160 were seen before,
    union 196 of 256.)"""
    opts = [] if shuffle else ["--no-shuffle", "--save-inside"]
    state = tmp_path / "state.json"
    first = run_job(name, "--take", "3", *opts, state_out=state)
    assert first["state"]["epoch"] == 0 and first["state"]["batches_in_epoch"] == 3
    second = run_job(name, "--epochs", "2", *opts, state_in=state)
    same_producer(first, second)
    assert second["state_after_load"] == first["state"]
    before, rest = flat(first["epochs"][0]), flat(second["epochs"][0])
    assert len(before) == 96 and len(rest) == 160
    assert [len(b) for b in second["epochs"][0]] == [32] * 5
    assert_once(before + rest, 256, "the interrupted epoch, both runs")
    assert_once(flat(second["epochs"][1]), 256, "the epoch after")
    assert not second["warnings"], second["warnings"]


def test_a_dataloader_subclass_with_a_generator_iter_resumes_exactly(name, tmp_path,
                                                                     producers_end):
    """A DataLoader subclass whose __iter__ is a generator (as accelerate's DataLoaderShard)
    draws its indices only at its first next(): they are still recorded, and the resume
    is exact."""
    state = tmp_path / "state.json"
    first = run_job(name, "--take", "3", "--generator-iter", state_out=state)
    assert first["state"]["taken"] is not None
    second = run_job(name, "--epochs", "1", "--generator-iter", state_in=state)
    assert_once(flat(first["epochs"][0]) + flat(second["epochs"][0]), 256, "epoch 0")


def test_persistent_workers_resume_exactly_in_a_later_epoch(name, tmp_path, producers_end):
    """A DataLoader with persistent workers keeps the sampler its first iterator took
    and draws every later epoch from it: the ids are still recorded there, so a job
    interrupted in epoch 1 resumes exactly."""
    state = tmp_path / "state.json"
    opts = ["--workers", "2"]
    first = run_job(name, "--warm-epochs", "1", "--take", "3", *opts, state_out=state)
    assert first["state"]["epoch"] == 1 and first["state"]["taken"] is not None
    second = run_job(name, "--epochs", "1", *opts, state_in=state)
    same_producer(first, second)
    assert_once(flat(first["epochs"][1]) + flat(second["epochs"][0]), 256, "epoch 1")


def test_chain_of_interruptions_reads_each_sample_once(name, tmp_path, producers_end):
    """a takes 3 batches, b resumes and takes 2, c resumes to the end: every sample of
    epoch 0 once across the three (the old main read 416 samples, 256 distinct)."""
    s1, s2 = tmp_path / "a.json", tmp_path / "b.json"
    a = run_job(name, "--take", "3", state_out=s1)
    b = run_job(name, "--take", "2", state_in=s1, state_out=s2)
    assert b["state"]["epoch"] == 0 and b["state"]["batches_in_epoch"] == 5
    c = run_job(name, "--epochs", "1", state_in=s2)
    same_producer(a, b, c)
    parts = [flat(a["epochs"][0]), flat(b["epochs"][0]), flat(c["epochs"][0])]
    assert [len(p) for p in parts] == [96, 64, 96]
    assert_once(parts[0] + parts[1] + parts[2], 256, "epoch 0 over three runs")


def test_own_batch_size_resumes_its_own_batches(name, tmp_path, producers_end):
    """batch_size=20 over a loader of 32: 3 batches (60 samples) taken, then the resumed
    epoch is the other 196 in batches of 20 (the last 16), len() - 3 of them."""
    state = tmp_path / "state.json"
    first = run_job(name, "--take", "3", "--own-batch-size", "20", state_out=state)
    second = run_job(name, "--epochs", "2", "--own-batch-size", "20", state_in=state)
    assert second["len"] == 13
    assert [len(b) for b in second["epochs"][0]] == [20] * 9 + [16]
    assert_once(flat(first["epochs"][0]) + flat(second["epochs"][0]), 256, "epoch 0")
    assert_once(flat(second["epochs"][1]), 256, "epoch 1")


def test_state_after_a_break_is_the_place_left(name, tmp_path, producers_end):
    """state_dict() after break records the epoch broken out of and its samples taken
    (the old main recorded {'epoch': 1, 'batches_in_epoch': 0})."""
    state = tmp_path / "state.json"
    first = run_job(name, "--take", "2", state_out=state)
    saved = decode(first["state"], EpochShape())
    assert (saved.epoch, saved.batches) == (0, 2)
    assert saved.taken is not None
    assert sorted(np.flatnonzero(saved.taken.bits).tolist()) == sorted(flat(first["epochs"][0]))


def test_a_loader_without_a_sampler_resumes_by_count_with_a_warning(name, tmp_path,
                                                                    producers_end):
    """A plain list of batches tells no sample indices: the state has none, and the
    resumed epoch skips the batches taken, with a warning that says so."""
    state = tmp_path / "state.json"
    first = run_job(name, "--take", "3", "--iterable", state_out=state)
    assert first["state"]["taken"] is None
    second = run_job(name, "--epochs", "1", "--iterable", state_in=state)
    assert second["state_after_load"]["batches_in_epoch"] == 3  # the state loaded
    assert len(second["epochs"][0]) == 5
    assert any("skips its first 3 batches by count" in w for w in second["warnings"])


PRODUCER = """
import sys, torch
from torch.utils.data import DataLoader, TensorDataset
from tensorsocket import TensorProducer
loader = DataLoader(TensorDataset(torch.arange(256)), batch_size=32, shuffle=True,
                    num_workers=2, persistent_workers=True)
producer = TensorProducer(loader, name=sys.argv[1], start_grace=0, ring_slots=4)
print("ready", flush=True)
while True:
    for _ in producer:
        pass
"""


@pytest.mark.slow  # a fresh interpreter with two loader workers; share()d ones cover the rest
def test_separate_producer_script_with_workers(name, tmp_path):
    """A TensorProducer script of its own (a DataLoader with 2 workers, shuffling, its
    sample ids drawn ahead by the workers): the job interrupted and the one resumed attach
    to it by name; the resumed epoch is exactly the samples not taken."""
    producer = popen([sys.executable, "-c", PRODUCER, name], cwd=ROOT,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert producer.stdout.readline().strip() == "ready"
        state = tmp_path / "state.json"
        first = run_job(name, "--take", "3", "--producer-name", name, state_out=state)
        assert first["state"]["taken"] is not None
        second = run_job(name, "--epochs", "2", "--producer-name", name, state_in=state)
    finally:
        producer.terminate()
        producer.communicate(timeout=60 * SCALE)
    assert_once(flat(first["epochs"][0]) + flat(second["epochs"][0]), 256, "epoch 0")
    assert [len(b) for b in second["epochs"][0]] == [32] * 5
    assert_once(flat(second["epochs"][1]), 256, "epoch 1")


# -- a data-parallel group -----------------------------------------------------------

def start_rank(name: str, rank: int, *args: str, state_in=None, state_out=None):
    argv = [sys.executable, str(JOB), name, "--rank", str(rank), "--world-size", "2",
            *args]
    if state_in is not None:
        argv += ["--state-in", str(state_in)]
    if state_out is not None:
        argv += ["--state-out", str(state_out)]
    return start_job(argv)


def test_group_state_at_the_last_batch_resumes_with_nothing_left(name, tmp_path,
                                                                 producers_end):
    """Rank 0's state saved in the loop at its last batch of the epoch (a checkpoint at
    the epoch's last step): the group's epoch is all taken, so the resumed ranks get no
    batch of it, then a whole epoch, with no warning."""
    s0 = tmp_path / "r0.json"
    ranks = [start_rank(name, r, "--take", "4", "--save-inside",
                        state_out=s0 if r == 0 else tmp_path / "x") for r in (0, 1)]
    first = [wait_job(p) for p in ranks]
    assert first[0]["state"]["taken"] is not None
    ranks = [start_rank(name, r, "--epochs", "2", state_in=s0) for r in (0, 1)]
    second = [wait_job(p) for p in ranks]
    assert [len(s["epochs"][0]) for s in second] == [0, 0]
    assert_once(flat(second[0]["epochs"][1]) + flat(second[1]["epochs"][1]), 256, "epoch 1")
    assert not second[0]["warnings"] and not second[1]["warnings"]


@pytest.mark.parametrize("where", ["after-break", "inside"])
def test_group_resumes_each_rank_its_part_from_rank_zeros_state(name, tmp_path,
                                                               producers_end, where):
    """Two ranks take 2 batches each (the group: 4 of 8), rank 0's state is saved (as
    Lightning saves rank 0's loader state only); two new ranks load that one state: each
    gets 2 batches of 32, no sample twice, and with the 128 taken before, every sample of
    the epoch once."""
    s0, s1 = tmp_path / "r0.json", tmp_path / "r1.json"
    inside = ["--save-inside"] if where == "inside" else []
    ranks = [start_rank(name, r, "--take", "2", *inside, state_out=s)
             for r, s in ((0, s0), (1, s1))]
    first = [wait_job(p) for p in ranks]
    assert first[0]["state"]["taken"] == first[1]["state"]["taken"]
    ranks = [start_rank(name, r, "--epochs", "2", state_in=s0) for r in (0, 1)]
    second = [wait_job(p) for p in ranks]
    same_producer(*first, *second)
    taken = flat(first[0]["epochs"][0]) + flat(first[1]["epochs"][0])
    rest = [flat(s["epochs"][0]) for s in second]
    assert [[len(b) for b in s["epochs"][0]] for s in second] == [[32, 32]] * 2
    assert_once(taken + rest[0] + rest[1], 256, "the group's epoch 0 over two runs")
    assert_once(flat(second[0]["epochs"][1]) + flat(second[1]["epochs"][1]), 256,
                "the group's epoch 1")


def test_interrupt_in_a_resumed_group_epoch_loses_and_repeats_nothing(name, tmp_path,
                                                                       producers_end):
    """A KeyboardInterrupt lands in rank 0's next() as the deal of its resumed epoch is
    decided (the loop catches it and goes on): rank 0 still gets only its own batches."""
    s0 = tmp_path / "r0.json"
    ranks = [start_rank(name, r, "--take", "1", state_out=s0 if r == 0 else tmp_path / "x")
             for r in (0, 1)]
    first = [wait_job(p) for p in ranks]
    ranks = [start_rank(name, r, "--epochs", "1", *(["--interrupt-deal", "1"] if r == 0
                                                   else []), state_in=s0) for r in (0, 1)]
    second = [wait_job(p) for p in ranks]
    assert second[0]["interrupts"] == 1
    assert [len(s["epochs"][0]) for s in second] == [3, 3]
    assert_once(sum((flat(j["epochs"][0]) for j in first + second), []), 256, "epoch 0")


@pytest.mark.parametrize("own", [None, "20"], ids=["loader-batches", "own-batch-size"])
def test_group_chain_of_breaks_reads_each_sample_once(name, tmp_path, producers_end, own):
    """A group interrupted twice by a break (states saved after it, rank 0's loaded by
    both ranks each time, the second inside a resumed epoch), then run to the end: every
    sample of epoch 0 once over the three runs."""
    opts = [] if own is None else ["--own-batch-size", own]
    seen: list[int] = []
    state_in = None
    for run, take in enumerate(("1", "1", None)):
        out = [tmp_path / f"run{run}-r{r}.json" for r in (0, 1)]
        args = ["--take", take] if take else ["--epochs", "1"]
        ranks = [start_rank(name, r, *args, *opts, state_in=state_in,
                            state_out=out[r] if take else None) for r in (0, 1)]
        jobs = [wait_job(p) for p in ranks]
        if take:
            assert jobs[0]["state"]["taken"] == jobs[1]["state"]["taken"] is not None
        seen += flat(jobs[0]["epochs"][0]) + flat(jobs[1]["epochs"][0])
        state_in = out[0]
    counts = Counter(seen)
    assert max(counts.values()) == 1, f"{sum(c > 1 for c in counts.values())} twice"
    if own is None:
        assert sorted(counts) == list(range(256))


def test_group_with_own_batch_size_resumes_each_rank_its_part(name, tmp_path,
                                                              producers_end):
    """The same with batch_size=20 over loader batches of 32: each rank took 2 batches of
    20 (40 of its own loader batches' samples); rank 0's state resumes both: each gets
    len() - 2 batches, and no sample of the epoch comes twice."""
    s0, s1 = tmp_path / "r0.json", tmp_path / "r1.json"
    own = ["--own-batch-size", "20"]
    ranks = [start_rank(name, r, "--take", "2", *own, state_out=s) for r, s in
             ((0, s0), (1, s1))]
    first = [wait_job(p) for p in ranks]
    assert first[0]["state"]["taken"] == first[1]["state"]["taken"]
    ranks = [start_rank(name, r, "--epochs", "1", *own, state_in=s0) for r in (0, 1)]
    second = [wait_job(p) for p in ranks]
    per_rank = second[0]["len"]  # 128 samples per rank: 7 batches of 20 (the last 8)
    assert [len(s["epochs"][0]) for s in second] == [per_rank - 2] * 2
    taken = flat(first[0]["epochs"][0]) + flat(first[1]["epochs"][0])
    resumed = flat(second[0]["epochs"][0]) + flat(second[1]["epochs"][0])
    assert len(taken) == 80
    # Each rank's part of a whole epoch is 128 samples (7 batches of 20, the last 8):
    # the deal hands out the 176 not taken, 88 to each rank (4 of 20, then 8).
    assert [[len(b) for b in s["epochs"][0]] for s in second] == [[20] * 4 + [8]] * 2
    assert_once(taken + resumed, 256, "the group's epoch 0 over two runs")


# -- units -----------------------------------------------------------------------------

def test_ids_ride_in_the_meta_blob():
    structure = b"\x92\x01\x02"  # a msgpack array
    ids = np.array([5, 3, 9])
    meta = with_ids(structure, ids)
    got_structure, got_ids = split(meta)
    assert got_structure == structure and got_ids.tolist() == [5, 3, 9]
    assert split(structure) == (structure, None)


def test_state_is_small_and_json_at_imagenet_scale():
    """1.28 M samples: the state of a shuffled epoch 3/8 taken stays JSON and under
    ceil(N / 8) * 4 / 3 bytes (the bitmap, base64); an unshuffled one is tiny."""
    n = 1_281_167
    rng = np.random.default_rng(0)
    taken = IdMask(n)
    taken.add(rng.permutation(n)[: n * 3 // 8])
    state = encode(SavedPlace(4, 1876, taken, n), EpochShape())
    text = json.dumps(state)
    assert len(text) < (n + 7) // 8 * 4 / 3 + 400
    back = decode(json.loads(text), EpochShape())
    assert np.array_equal(back.taken.bits, taken.bits)
    ordered = IdMask(n)
    ordered.add(np.arange(n * 3 // 8))
    assert len(json.dumps(encode(SavedPlace(4, 1876, ordered, n), EpochShape()))) < 2000


def test_bad_states_are_refused_with_the_field_named():
    good = encode(SavedPlace(0, 3, None, 256), EpochShape())
    with pytest.raises(ValueError, match="batch_size=20"):
        decode(good, EpochShape(batch_size=20))
    with pytest.raises(ValueError, match="world_size=1"):
        decode(good, EpochShape(world_size=2))
    with pytest.raises(ValueError, match="'taken' field"):
        decode({**good, "taken": "not base64!"}, EpochShape())
    with pytest.raises(ValueError, match="not a tensorsocket consumer state"):
        decode({"epoch": 1}, EpochShape())
    with pytest.raises(ValueError, match="dataset of 256 samples it must hold 256"):
        decode({**good, "taken": IdMask(8).to_text(8)}, EpochShape())


def test_group_state_needs_every_rank_batch_seen():
    taken = EpochTaken(2)
    taken.begin(None)
    taken.group_batch(0, np.array([1, 2]))
    taken.delivered(np.array([1, 2]))
    assert taken.taken(1) is None  # batch 1 (rank 1's) not seen yet
    taken.group_batch(1, np.array([7, 8]))
    assert sorted(np.flatnonzero(taken.taken(1).bits).tolist()) == [1, 2, 7, 8]
