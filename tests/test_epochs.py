"""Aligned epochs: every epoch of every job is a whole pass over the data, whatever the
moment the job attached and however its loop iterates (issue: real training stacks).

The jobs are real processes calling tensorsocket.share() (tests/epoch_job.py); each
prints the sample ids it received per epoch, and the assertions are on those ids."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import tensorsocket
from conftest import ROOT, alive as _alive, popen
from tensorsocket import TensorConsumer, TensorProducer
from tensorsocket.control.endpoints import runtime_dir
from tensorsocket.errors import TensorSocketError, TensorSocketWarning

JOB = ROOT / "tests" / "epoch_job.py"
JOB_TIMEOUT = 150  # seconds; a hang fails the test with the job's output
IDLE = 1.0  # idle_timeout of the shared producers the jobs start


def start_job(name: str, mode: str, *args: str, grace: float = 3.0) -> subprocess.Popen:
    """One job process (see tests/epoch_job.py)."""
    env = {**os.environ, "TENSORSOCKET_START_GRACE": str(grace),
           "TENSORSOCKET_IDLE_TIMEOUT": str(IDLE)}
    return popen([sys.executable, str(JOB), name, mode, *args], cwd=ROOT,
                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 text=True)


def job_result(p: subprocess.Popen) -> dict:
    """The job's JSON line; fails with its output if it fails or hangs."""
    try:
        out, err = p.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"job hung for {JOB_TIMEOUT} s\nstdout: {out[-2000:]}\nstderr: "
                    f"{err[-4000:]}")
    assert p.returncode == 0, f"exit {p.returncode}\nstdout: {out}\nstderr: {err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


def assert_whole_epochs(epochs: list[list[int]], samples: int) -> None:
    """Each epoch holds every sample id exactly once."""
    for e, ids in enumerate(epochs):
        assert sorted(ids) == list(range(samples)), (
            f"epoch {e}: {len(ids)} ids, {len(set(ids))} distinct of {samples}")


@pytest.fixture
def jobs(name):
    """The job processes of a test; after it, their shared producers must end by
    themselves (idle_timeout after the last job left), removing their segments."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.communicate()
    lingering = []
    for lock in runtime_dir().glob(f"{name}*.lock"):
        try:
            pid = int(lock.read_text().strip() or 0)
        except (OSError, ValueError):
            continue
        deadline = time.monotonic() + IDLE + 20
        while pid and _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)
            lingering.append(pid)
    assert not lingering, f"shared producers {lingering} did not end after their jobs"


def test_jobs_started_together_get_whole_epochs(name, jobs):
    """Three jobs started together (as one shell line starts them) each get every sample
    exactly once per epoch; the loader ran once for all of them."""
    jobs += [start_job(name, "plain", "--epochs", "3") for _ in range(3)]
    results = [job_result(p) for p in jobs]
    for r in results:
        assert r["len"] == 8
        assert_whole_epochs(r["train"], 256)
    # One shuffling loader: jobs that began together received the same permutations.
    firsts = {tuple(r["train"][0]) for r in results}
    assert len(firsts) <= 2, "the jobs read more than two different first epochs"


@pytest.mark.parametrize("mode", ["iter-first", "exact-len", "break"])
def test_iteration_patterns_lose_and_repeat_nothing(name, jobs, mode):
    """iter() dropped without next(), loops that stop after exactly len() batches, and a
    break out of the first epoch: every later epoch is still a whole pass."""
    jobs.append(start_job(name, mode, "--epochs", "3", grace=0))
    result = job_result(jobs[0])
    assert_whole_epochs(result["train"], 256)


def test_two_jobs_alternating_train_and_validation_loaders(name, jobs):
    """Two jobs, each alternating a training epoch of one shared loader and a validation
    epoch of another (Lightning's fit loop), never wait on each other across the two
    loaders, and every epoch of each is whole."""
    jobs += [start_job(name, "alternate", "--epochs", "3", "--step", "0.01")
             for _ in range(2)]
    for r in (job_result(p) for p in jobs):
        assert_whole_epochs(r["train"], 256)
        assert_whole_epochs(r["val"], 128)


def test_alternating_jobs_read_the_same_epochs(name, jobs):
    """Two jobs alternating training and validation loaders, one of them 1.5 s slower
    after each validation: the training consumer it left between epochs keeps its place
    (park_hold), so both jobs read the same training epochs, batch for batch, instead
    of the slower one starting a later epoch than the other."""
    jobs.append(start_job(name, "alternate", "--epochs", "3", "--step", "0.01"))
    jobs.append(start_job(name, "alternate", "--epochs", "3", "--step", "0.01",
                          "--val-pause", "1.5"))
    fast, slow = (job_result(p) for p in jobs)
    for r in (fast, slow):
        assert_whole_epochs(r["train"], 256)
        assert_whole_epochs(r["val"], 128)
    assert fast["train"] == slow["train"], "the jobs read different training epochs"


def test_a_place_kept_too_long_is_given_up(name):
    """A consumer parked between epochs with its place kept holds the others back for
    park_hold seconds at most: then its place is given up, the others read on, and it
    starts at a later epoch, still whole."""
    batches = [torch.arange(i * 4, i * 4 + 4) for i in range(6)]
    producer = TensorProducer(batches, name=name, ring_slots=4, start_grace=0,
                              min_consumers=2, park_hold=0.5)

    def produce() -> None:
        """Epochs until the test closes the producer (which ends the wait in it)."""
        try:
            for _ in range(12):
                for _ in producer:
                    pass
        except TensorSocketError:  # closed by the test while waiting for consumers
            pass

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        reader = TensorConsumer(name=name, timeout=30)
        parked = TensorConsumer(name=name, timeout=30)
        first: list[list[int]] = [[], []]
        for a, b in zip(reader, parked):  # both read epoch 0, step by step
            first[0] += a.tolist()
            first[1] += b.tolist()
        del a, b  # kept batches would hold their slots
        parked._place.park(hold=True)  # between epochs, as when its job reads another loader
        later = [[int(i) for b in reader for i in b] for _ in range(3)]  # never waits long
        assert reader.epoch == 4
        reader.close()  # attached and not reading, it would hold the ring now
        resumed = [int(i) for b in parked for i in b]
        for ids in first + later + [resumed]:
            assert sorted(ids) == list(range(24))
        assert parked.epoch == 2
    finally:
        for c in ("reader", "parked"):
            if c in locals():
                locals()[c].close()
        producer.close()
        thread.join(30)


def test_ranks_of_a_group_split_the_stream(name, jobs):
    """The two ranks of a data-parallel job split each epoch (each sample to one of them,
    the same number of batches each), while a job of its own beside them gets all."""
    jobs += [start_job(name, "group", "--rank", str(r), "--world-size", "2", "--epochs", "2")
             for r in range(2)]
    jobs.append(start_job(name, "plain", "--epochs", "2"))
    rank0, rank1, alone = (job_result(p) for p in jobs)
    assert rank0["len"] == rank1["len"] == 4
    for e in range(2):
        a, b = rank0["train"][e], rank1["train"][e]
        assert len(a) == len(b) == 128
        assert sorted(a + b) == list(range(256)), f"epoch {e}: the ranks overlap or miss"
    assert_whole_epochs(alone["train"], 256)


def _producer_thread(producer: TensorProducer, epochs: int) -> threading.Thread:
    def run() -> None:
        try:
            for _ in range(epochs):
                for _ in producer:
                    pass
            producer.join(timeout=60)
        except TensorSocketError:  # closed by the test while waiting for consumers
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_late_joiner_waits_for_the_next_epoch_start(name):
    """A consumer that attaches mid-epoch (the epoch's first batch already overwritten)
    starts at the next epoch's first batch: its first epoch is whole."""
    batches = [(torch.full((4,), i),) for i in range(12)]
    producer = TensorProducer(batches, name=name, ring_slots=4, start_grace=0)
    t = _producer_thread(producer, 2)
    first = TensorConsumer(name=name, timeout=30)
    it = iter(first)
    early = [int(next(it)[0][0]) for _ in range(6)]  # the producer is past batch 0 now
    late = TensorConsumer(name=name, timeout=30)
    late_epochs: list = []
    # The late one reads in a thread of its own, as another job would: it skips the rest
    # of epoch 0 (which `first` reads meanwhile), then reads epoch 1 whole.
    reader = threading.Thread(target=lambda: late_epochs.extend(int(b[0][0]) for b in late))
    reader.start()
    rest = [int(b[0][0]) for b in it]
    assert [int(b[0][0]) for b in first] == list(range(12))  # first's epoch 1
    reader.join(30)
    assert early + rest == list(range(12))
    assert late_epochs == list(range(12))
    assert late.epoch == 1 and first.epoch == 2
    late.close()
    first.close()
    t.join(timeout=60)


def test_start_grace_lets_jobs_started_together_begin_at_batch_zero(name):
    """With start_grace, a consumer that attaches just after the first still gets batch 0
    of epoch 0 (without it, it would be a late joiner)."""
    batches = [(torch.full((2,), i),) for i in range(30)]
    producer = TensorProducer(batches, name=name, ring_slots=4, start_grace=5)
    t = _producer_thread(producer, 1)
    a = TensorConsumer(name=name, timeout=30)
    b = TensorConsumer(name=name, timeout=30)  # attaches well inside the 5 s grace
    got = [(int(x[0][0]), int(y[0][0])) for x, y in zip(a, b)]
    assert got == [(i, i) for i in range(30)]
    a.close()
    b.close()
    t.join(timeout=60)


def test_start_grace_is_checked():
    with pytest.raises(ValueError, match="start_grace"):
        TensorProducer([1], name="grace-check", start_grace=-1)
    with pytest.raises(ValueError, match="TENSORSOCKET_START_GRACE"):
        tensorsocket.config.get("start_grace", environ={"TENSORSOCKET_START_GRACE": "soon"})


def test_state_dict_resumes_mid_epoch(name):
    """state_dict() mid-epoch, load_state_dict() into a new consumer: its next epoch yields
    the rest of the epoch (len() minus the batches taken), and the epoch count goes on."""
    batches = [(torch.full((2,), i),) for i in range(10)]
    producer = TensorProducer(batches, name=name, start_grace=0)
    t = _producer_thread(producer, 3)
    c = TensorConsumer(name=name, timeout=30)
    assert [int(b[0][0]) for b in c] == list(range(10))  # epoch 0
    it = iter(c)
    taken = [int(next(it)[0][0]) for _ in range(3)]
    state = c.state_dict()
    assert state["epoch"] == 1 and state["batches_in_epoch"] == 3
    c2 = TensorConsumer(name=name, timeout=30)
    c2.load_state_dict({})  # ignored, as StatefulDataLoader ignores it
    assert c2.epoch == 0 and c2.state_dict()["batches_in_epoch"] == 0
    # A list of batches tells no sample ids: the resume is by count, and says so.
    with pytest.warns(TensorSocketWarning, match="skips its first 3 batches by count"):
        c2.load_state_dict(state)
    assert c2.epoch == 1
    del it
    c.close()
    resumed = [int(b[0][0]) for b in c2]
    assert taken == [0, 1, 2] and resumed == list(range(3, 10))
    assert c2.epoch == 2
    with pytest.raises(ValueError, match="not a tensorsocket consumer state"):
        c2.load_state_dict({"epoch": 1})
    c2.close()
    # (Epoch 2 has no reader: the producer, left with none, may be waiting for one.)
    producer.close()
    t.join(timeout=60)
    assert not t.is_alive()


def test_set_epoch_back_warns_where_order_is_by_epoch(name, jobs):
    """A producer whose loader orders its samples by epoch (a DistributedSampler, whose
    set_epoch the producer calls itself): set_epoch going back to an earlier epoch asks
    for an order the producer cannot give again, and warns, once; going on does not."""
    data = TensorDataset(torch.arange(32))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0)
    c = tensorsocket.share(DataLoader(data, batch_size=8, sampler=sampler), name=name,
                           timeout=60, start_grace=0, idle_timeout=IDLE)
    try:
        assert sorted(int(i) for b in c for i in b[0]) == list(range(32))
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for epoch in (1, 1, 3, 2, 1):
                c.sampler.set_epoch(epoch)
        assert [(w.category, str(w.message).split(" cannot")[0]) for w in said] == \
            [(TensorSocketWarning, "set_epoch(2) after set_epoch(3)")]
    finally:
        c.close()


class MixupLoader(DataLoader):
    """A DataLoader with an attribute of its own, as timm's loaders have."""

    mixup_enabled = True


def test_consumer_has_what_training_code_reads_from_a_dataloader(name, jobs, monkeypatch):
    """dataset, batch_size, drop_last, sampler / batch_sampler with set_epoch, num_workers,
    and the caller's own loader attributes (reading passes through; setting warns)."""
    data = TensorDataset(torch.arange(64))
    loader = MixupLoader(data, batch_size=16, shuffle=True, drop_last=True)
    c = tensorsocket.share(loader, name=name, timeout=60, start_grace=0, idle_timeout=IDLE)
    try:
        assert c.dataset is data and c.batch_size == 16 and c.drop_last is True
        assert len(c) == 4 and len(c.batch_sampler) == 4 and len(c.sampler) == 64
        assert c.batch_sampler.batch_size == 16 and c.batch_sampler.drop_last is True
        assert c.num_workers == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            # A loop's epochs, as frameworks set them (the same one again, a jump, on
            # sampler and batch_sampler.sampler): each is a new pass, nothing to say.
            for epoch in (3, 3, 4, 6):
                c.sampler.set_epoch(epoch)
                c.batch_sampler.sampler.set_epoch(epoch)
            # Back to an earlier epoch (a second Trainer.fit counts from 0 again): the
            # loader's RandomSampler reshuffles every pass whatever the number, so
            # nothing is lost either (test_set_epoch_back_warns_where_order_is_by_epoch).
            c.sampler.set_epoch(0)
        assert c.mixup_enabled is True
        with pytest.warns(TensorSocketWarning, match="not on the shared producer"):
            c.mixup_enabled = False
        assert loader.mixup_enabled is False
        with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
            c.no_such_thing  # noqa: B018
        assert sorted(int(i) for b in c for i in b[0]) == list(range(64))
    finally:
        c.close()
