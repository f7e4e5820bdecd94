"""Issue 38's real-client tests: jobs with their own sampler, subset, seed and speed share
the decode of one torchvision ImageFolder through the store of decoded samples.

Every job is tests/clients/store_job.py, a training script as a user writes it:
``share(DataLoader(ImageFolder(root, transform=<its whole pipeline>), ...), name=...,
store=True)``. It runs its own DataLoader first (the baseline) and checks every batch of
the shared run against it, index for index, and every image against the whole pipeline
run privately under the job's per-sample seed (the client's docstring). The jobs are real
processes with the real torchvision of tools/torchvision_cpu (the torchvision_env
fixture), each with its DataLoader workers; every decode of the folder is logged
($TS_TEST_LOADS), so the test counts them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import run
from test_augment_clients import N_IMAGES, images  # noqa: F401 - the ImageFolder fixture
from tensorsocket.store.dataset import CHECKED_SAMPLES
from tensorsocket.store.segment import store_keys
from tools import harness

CLIENT = Path(__file__).resolve().parent / "clients" / "store_job.py"
JOB_TIMEOUT = 300  # s: a fresh interpreter importing torch and torchvision, loaded machine
BLOCK = 8192  # the store's block of one sample: 3 x 40 x 40 bytes and the header, rounded


class Jobs:
    """store_job.py jobs of one test, in a runtime directory of the test's own; no store
    of theirs may be left in /dev/shm once they ended."""

    def __init__(self, procs: Any, env: dict[str, str], tmp: Path, runtime: Path,
                 images: Path) -> None:
        self.procs, self.tmp, self.images = procs, tmp, images
        self.loads = tmp / "loads.txt"
        self.env = harness.child_env({**env, "TENSORSOCKET_RUNTIME_DIR": str(runtime),
                                      "TS_TEST_LOADS": str(self.loads)}, threads=1)
        self.keys: set[str] = set()  # of the stores the jobs used

    def start(self, label: str, **options: Any) -> harness.ChildProcess:
        argv = [str(CLIENT), "--root", str(self.images)]
        for key, value in options.items():
            flag = f"--{key.replace('_', '-')}"
            argv += [flag] if value is True else [flag, str(value)]
        return self.procs.children.spawn(harness.python_argv(*argv), label=label,
                                         env=self.env)

    def event(self, job: harness.ChildProcess, name: str) -> dict:
        """The job's next JSON line that is event `name` (batch lines before it skipped)."""
        while True:
            line = job.read_json(JOB_TIMEOUT)
            if line.get("event") == name:
                return line

    def done(self, job: harness.ChildProcess) -> dict:
        """The job's record, once it ended (exit status 0), checked: every batch its own
        loader's, every image and target right."""
        record = job.result(JOB_TIMEOUT)
        assert record["event"] == "done", record
        assert record["ids_equal"], (job.label, record["ids"][:2], record["expected"][:2])
        assert record["wrong_images"] == 0 and record["wrong_targets"] == 0, record
        self.keys.add(record["key"])
        return record

    def decodes(self) -> int:
        """Decodes of the folder so far, by every process of every job."""
        return len(self.loads.read_text().splitlines()) if self.loads.exists() else 0

    def check_nothing_left(self) -> None:
        """The stores the jobs used are gone (other tests' may run meanwhile)."""
        left = self.keys & set(store_keys())
        assert self.keys and not left, f"stores left in /dev/shm after the jobs: {left}"


@pytest.fixture
def jobs(procs, torchvision_env, tmp_path, short_tmp, images) -> Jobs:
    return Jobs(procs, torchvision_env, tmp_path, short_tmp, images)


def baseline_decodes(subset: str, epochs: int) -> int:
    """Decodes of a job's own DataLoader run (the client's baseline, before the shared
    run): every sample of its subset, each epoch."""
    per_epoch = {"all": N_IMAGES, "half": N_IMAGES // 2, "quarter": N_IMAGES // 4}[subset]
    return per_epoch * epochs


def test_three_jobs_with_their_own_subsets_seeds_and_speeds(jobs, name, tmp_path):
    """Jobs on all, a random half (a Subset) and every fourth sample (a
    SubsetRandomSampler), seeds of their own, steps of 1x, 2x and 4x the cost, workers
    2, 1 and 0, 3 epochs each. The first is held in its first epoch until the others
    came; the second starts while the first runs, the third joins late, while both are
    in their first epoch. Each job's batches are its own loader's; the samples they have
    in common were decoded once: the union (all 96) once each, plus the few samples each
    job decodes again at an epoch's start (the check) and the decodes that came to the
    store second (races: each job's first look at the dataset, its first and last
    samples, and the samples two jobs missed together) or without it (busy: the lock
    held by a process the loaded machine did not run for a while)."""
    go = tmp_path / "go"
    a = jobs.start("all", name=name, subset="all", seed=1, epochs=3, workers=2, step=0.01,
                   hold=go)
    jobs.event(a, "held")
    b = jobs.start("half", name=name, subset="half", seed=2, epochs=3, workers=1, step=0.02,
                   hold=go)
    jobs.event(b, "held")
    c = jobs.start("quarter", name=name, subset="quarter", seed=3, epochs=3, step=0.04)
    jobs.event(c, "batch")
    go.touch()
    records = {label: jobs.done(job) for label, job in (("a", a), ("b", b), ("c", c))}
    own = sum(baseline_decodes(s, 3) for s in ("all", "half", "quarter"))
    shared = jobs.decodes() - own
    # (The store's counters only grow: the job that ended last saw them all.)
    races, busy = (max(r["info"][k] for r in records.values()) for k in ("races", "busy"))
    checks = 3 * 3 * CHECKED_SAMPLES
    assert races + busy >= 2 * 2, (races, busy)  # the later two jobs' first looks
    assert N_IMAGES <= shared <= N_IMAGES + checks + races + busy, (shared, races, busy)
    # Without the store the three jobs would have decoded 3 x (96 + 48 + 24) = 504.
    assert shared < 0.5 * own
    last = max(records.values(), key=lambda r: r["info"]["commits"])
    assert last["info"]["commits"] == N_IMAGES and last["info"]["evictions"] == 0
    jobs.check_nothing_left()


def test_store_at_half_the_union(jobs, name):
    """A budget of half the union's blocks: samples are evicted (those no job needs again
    this epoch first) and decoded again when needed; every batch is still right, no job
    waits for room, and the store never holds more than its budget."""
    budget = N_IMAGES * BLOCK // 2
    a = jobs.start("all", name=name, subset="all", seed=4, epochs=2, workers=1,
                   cache_bytes=budget)
    jobs.event(a, "batch")
    b = jobs.start("half", name=name, subset="half", seed=5, epochs=2, cache_bytes=budget)
    ra, rb = jobs.done(a), jobs.done(b)
    for record in (ra, rb):
        info = record["info"]
        assert info["budget"] == budget and info["used_bytes"] <= budget, info
    assert max(ra["info"]["evictions"], rb["info"]["evictions"]) > 0
    jobs.check_nothing_left()


def test_a_job_killed_mid_epoch_and_restarted(jobs, name, tmp_path, fault_table):
    """A job SIGKILLed in its first epoch (its workers too, one of them maybe mid-insert)
    and started again: it gets its own loader's batches from the start; the job that ran
    beside it all along did not stop nor get a wrong sample; the dead job's pins, needs
    and half-written samples are reaped; nothing is left once both ended."""
    a = jobs.start("all", name=name, subset="all", seed=6, epochs=3, workers=1, step=0.03)
    jobs.event(a, "batch")
    hold = tmp_path / "never"
    b = jobs.start("quarter-killed", name=name, subset="half", seed=7, epochs=2, workers=2,
                   hold=hold)
    jobs.event(b, "held")
    b.kill_tree()
    b.wait(30)
    b2 = jobs.start("quarter-again", name=name, subset="half", seed=7, epochs=2, workers=2)
    again = jobs.done(b2)
    survivor = jobs.done(a)
    jobs.check_nothing_left()
    fault_table.add(
        "decoded-sample store: a job SIGKILLed in its first epoch with its 2 DataLoader "
        "workers (one maybe mid-insert), then started again, while another job runs",
        "- (no one waits for a dead job: its slot, pins, needs and half-written samples "
        "are reaped when an insert finds no room, or a job joins or leaves)",
        f"the other job: every batch its own loader's, its longest next() "
        f"{survivor['longest_next']:.2f} s; the restarted job: every batch its own "
        f"loader's from the start ({again['info']['hits']} hits)",
        "nothing: the store removed by the last job out")


def test_a_paused_job_costs_the_others_nothing(jobs, name, tmp_path, fault_table):
    """A job stopped (SIGSTOP: Ctrl-Z, a debugger) in its first epoch, its workers too,
    for as long as the other job takes to run all its epochs: the other finishes with its
    own loader's batches; the stopped one, continued, finishes too, with its own."""
    a = jobs.start("paused", name=name, subset="half", seed=10, epochs=2, workers=1,
                   step=0.02)
    jobs.event(a, "batch")
    stopped = [a.pid, *harness.descendants(a.pid)]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        b = jobs.start("running", name=name, subset="all", seed=11, epochs=2, workers=1)
        running = jobs.done(b)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    paused = jobs.done(a)
    jobs.check_nothing_left()
    fault_table.add(
        "decoded-sample store: a job SIGSTOPped with its DataLoader worker in its first "
        "epoch, for as long as another job takes to run its 2 epochs",
        "- (nothing waits for it: no job waits for another's decode or room; a lock it "
        "held when stopped is waited for 200 ms, then the store is skipped for 1 s)",
        f"the running job: every batch its own loader's, its longest next() "
        f"{running['longest_next']:.2f} s; the paused one, continued: every batch its own "
        f"loader's", "nothing: the store removed by the last job out")
    assert paused["ids_equal"]


def test_a_dataset_with_random_draws_is_refused(jobs, name, fault_table):
    """Noise drawn in ``__getitem__`` (after the transform): the job's check at its second
    epoch decodes stored samples again and gets other bytes: the store is dropped, the job
    warns (a TensorSocketWarning naming the sample), and goes on decoding its samples
    itself, its batches its own loader's."""
    job = jobs.start("noisy", name=name, subset="half", seed=8, epochs=2, workers=1,
                     random_getitem=True)
    record = jobs.done(job)
    said = [m for kind, m in record["warnings"] if kind == "TensorSocketWarning"]
    assert len(said) == 1 and "not deterministic" in said[0] and "sample" in said[0], said
    assert record["info"]["dropped"]
    jobs.check_nothing_left()
    fault_table.add(
        "decoded-sample store: a dataset whose __getitem__ draws random numbers (noise "
        "from torch's generator), a job of 2 epochs with 1 DataLoader worker",
        f"at the start of epoch 2: up to {CHECKED_SAMPLES} stored samples decoded again "
        "give other bytes; the store dropped for every job, a TensorSocketWarning naming "
        "the sample", "the job: every batch its own loader's, each sample decoded where "
        "it is read from then on", "nothing: the store removed by the last job out")


def test_status_shows_the_store_and_each_job(jobs, name, tmp_path):
    """While two jobs run (one held in its first epoch), ``tensorsocket status`` shows the
    store (its samples, bytes, hit rate, decodes saved) and where each job is."""
    hold = tmp_path / "go"
    a = jobs.start("held", name=name, subset="all", seed=9, epochs=1, hold=hold)
    jobs.event(a, "held")
    out = run([sys.executable, "-m", "tensorsocket", "status", "--json"], env=jobs.env,
              check=True, timeout=60, capture_output=True).stdout
    stores = json.loads(out)["stores"]
    mine = [s for s in stores if a.pid in [job["pid"] for job in s["jobs"]]]
    assert len(mine) == 1, stores  # (other tests' stores may be there beside it)
    store = mine[0]
    assert store["samples"] == N_IMAGES and store["stored"] >= 3 * 8 and store["budget"] > 0
    assert "hit_rate" in store
    assert [job["epoch"] for job in store["jobs"]] == [0] and store["jobs"][0]["position"] >= 2
    text = run([sys.executable, "-m", "tensorsocket", "status"], env=jobs.env, check=True,
               timeout=60, capture_output=True).stdout.decode()
    assert "decoded-sample store" in text and "epoch 0" in text, text
    hold.touch()
    jobs.done(a)
    jobs.check_nothing_left()
