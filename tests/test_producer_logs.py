"""The log of share()'s producer, ``<runtime dir>/<name>.producer.log``: removed when the
producer ends cleanly, kept when it fails (for the user, until ``tensorsocket clean``
removes it; the next producer of the name moves it to a name of its own), rotated when it
grows; clean never removes the log of a producer that runs
or is being started, nor a file under such a name that is not ours.

Real share() producers forked from the test process, each test in a runtime directory of
its own (clean, run as a user would as a subprocess, then sees no other test's files).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import tensorsocket
from tensorsocket import _core
from tensorsocket.sharing import election as _election, shared_producer as _shared_producer
from tensorsocket.sharing.election import older_log_path, release_lock, share_lock_file, take_lock
from tensorsocket.errors import ProducerFailed, TensorSocketError

from conftest import ROOT, run as run_python

WAIT = 60 * float(os.environ.get("TS_TEST_TIMEOUT_SCALE", "1"))  # seconds, for any wait


@pytest.fixture
def rdir(short_tmp, monkeypatch):
    """This test's runtime directory, for its producers and its `tensorsocket clean`."""
    path = short_tmp / "rt"
    path.mkdir(mode=0o700)
    monkeypatch.setenv("TENSORSOCKET_RUNTIME_DIR", str(path))
    return path


def cli(*args: str):
    """`python -m tensorsocket ARGS` with this test's environment (its runtime dir)."""
    return run_python([sys.executable, "-m", "tensorsocket", *args], capture_output=True,
                      text=True, timeout=WAIT, cwd=ROOT, env=dict(os.environ))


class Producer:
    """The process of a consumer's producer, known while it runs (pid and start time)."""

    def __init__(self, consumer) -> None:
        self.pid = consumer.producer_pid
        self.start = _core.process_start_time(self.pid)
        assert self.start is not None, "the producer is gone already"

    def alive(self) -> bool:
        """Whether the process still runs."""
        return _core.process_alive(self.pid, self.start)

    def wait_gone(self) -> None:
        """Until the process has exited (it removes or keeps its log before that)."""
        deadline = time.monotonic() + WAIT
        while self.alive():
            assert time.monotonic() < deadline, f"producer pid {self.pid} still runs"
            time.sleep(0.02)


@pytest.fixture
def producers(rdir):
    """Producer(consumer) of this test's producers; any still running at the end (a test
    that failed half-way) is stopped before its runtime directory goes."""
    started: list[Producer] = []

    def of(consumer) -> Producer:
        started.append(Producer(consumer))
        return started[-1]

    yield of
    for producer in started:
        if producer.alive():
            os.kill(producer.pid, signal.SIGKILL)
            producer.wait_gone()


class Chatty(Dataset):
    """Sample i is i; reading it prints a line of `width` bytes (in the producer process,
    which loads with num_workers=0) and raises at index `fail_at`."""

    def __init__(self, n: int, width: int = 0, fail_at: int | None = None) -> None:
        self.n, self.width, self.fail_at = n, width, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.fail_at:
            raise RuntimeError(f"sample {i} is unreadable")
        if self.width:
            print(f"sample {i:06d} ".ljust(self.width - 1, "."), flush=True)
        return torch.tensor(i)


def read_ids(consumer) -> list[int]:
    """The sample ids of the consumer's batches, until its epoch ends."""
    return [int(i) for batch in consumer for i in batch]


def test_clean_end_removes_the_log(rdir, name, producers):
    """A producer that serves its epochs and ends leaves no log (nor an older part)."""
    c = tensorsocket.share(DataLoader(TensorDataset(torch.arange(32)), batch_size=8),
                           name=name, epochs=1, timeout=WAIT)
    producer = producers(c)
    log = c.producer_log
    assert log == rdir / f"{name}.producer.log" and log.exists()  # written while it runs
    assert sorted(int(i) for b in c for i in b[0]) == list(range(32))
    c.close()
    producer.wait_gone()
    assert sorted(p.name for p in rdir.iterdir() if "producer.log" in p.name) == []


def fail_a_producer(name: str, producers) -> None:
    """A share() producer of `name` whose loader raises at sample 20, read until it fails
    and gone."""
    c = tensorsocket.share(DataLoader(Chatty(32, fail_at=20), batch_size=8), name=name,
                           timeout=WAIT)
    producer = producers(c)
    with pytest.raises(ProducerFailed):
        read_ids(c)
    c.close()
    producer.wait_gone()


def test_failed_producer_keeps_its_log_until_clean(rdir, name, producers):
    """A producer whose loader raises keeps its log, with the error; `clean --dry-run`
    lists it and removes nothing, `clean` removes it, and then there is nothing to clean."""
    fail_a_producer(name, producers)
    log = rdir / f"{name}.producer.log"
    assert "sample 20 is unreadable" in log.read_text()

    dry = cli("clean", "--dry-run", "--name", name)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert f"would remove log     {log}" in dry.stdout and "1 item(s)" in dry.stdout
    assert log.exists()
    done = cli("clean", "--name", name)
    assert done.returncode == 0 and f"removed log     {log}" in done.stdout, done.stdout
    assert not log.exists()
    again = cli("clean", "--name", name)
    assert again.returncode == 0 and "nothing to clean" in again.stdout, again.stdout


def test_producer_stopped_by_a_signal_keeps_its_log(rdir, name, producers):
    """SIGTERM tears the producer down (segment, socket, lock) but it did not end by
    itself: its log stays, saying so, for the user to read."""
    c = tensorsocket.share(DataLoader(TensorDataset(torch.arange(64)), batch_size=8),
                           name=name, timeout=WAIT)
    producer = producers(c)
    assert next(iter(c)) is not None
    os.kill(producer.pid, signal.SIGTERM)
    producer.wait_gone()
    c.close()
    assert sorted(p.name for p in rdir.iterdir()) == [f"{name}.producer.log"]
    assert "SystemExit: 143" in c.producer_log.read_text()


def test_clean_never_removes_a_live_or_starting_producers_log(rdir, name, producers):
    """clean leaves the log of a running producer, the log of a name whose share()
    election is under way (a producer starting: its log is open before it takes its name
    lock), and a link under a log's name; the same stale log goes once nothing holds it.
    The running producer ends by idle_timeout, cleanly: it removes its log itself."""
    live = tensorsocket.share(DataLoader(TensorDataset(torch.arange(64)), batch_size=8),
                              name=name, timeout=WAIT, idle_timeout=0.5)
    producer = producers(live)
    starting, linked = f"{name}-s", f"{name}-l"
    starting_log = rdir / f"{starting}.producer.log"
    starting_log.write_text("a producer starting\n")
    target = rdir.parent / "not-a-log"
    target.write_text("not ours to remove\n")
    (rdir / f"{linked}.producer.log").symlink_to(target)
    election = share_lock_file(rdir, starting)
    fd = take_lock(election, None)  # as share() holds it while its producer starts
    try:
        for args in (["clean", "--dry-run"], ["clean"]):
            r = cli(*args, "--name", name)
            assert r.returncode == 0 and "nothing to clean" in r.stdout, r.stdout
            r = cli(*args, "--name", starting)
            assert r.returncode == 0 and "nothing to clean" in r.stdout, r.stdout
            r = cli(*args, "--name", linked)
            assert r.returncode == 0 and "nothing to clean" in r.stdout, r.stdout
        assert live.producer_log.exists() and starting_log.exists() and target.exists()
        assert next(iter(live)) is not None  # still serving
    finally:
        release_lock(fd, election)
        live.close()
    producer.wait_gone()
    assert not live.producer_log.exists()
    r = cli("clean", "--name", starting)  # the election is over and nobody took the name
    assert r.returncode == 0 and f"removed log     {starting_log}" in r.stdout, r.stdout
    assert not starting_log.exists() and target.exists()


def test_a_growing_log_is_rotated(rdir, name, producers, monkeypatch):
    """A producer whose log reaches LOG_MAX_BYTES moves it to <name>.producer.log.1 and
    goes on in a new one: neither holds much more than the cap (one batch's output), while
    the producer printed several times as much; a clean end removes both."""
    cap, width, batch = 16384, 256, 8
    monkeypatch.setattr(_shared_producer, "LOG_MAX_BYTES", cap)  # the fork inherits it
    n = 8 * cap // width  # 8 caps of output
    c = tensorsocket.share(DataLoader(Chatty(n, width=width), batch_size=batch), name=name,
                           epochs=1, timeout=WAIT)
    producer = producers(c)
    log, older = c.producer_log, older_log_path(c.producer_log)
    ids = []
    for b in c:
        ids += [int(i) for i in b]
        if len(ids) == n - batch:  # the producer is at its last batch or past it
            sizes = [log.stat().st_size, older.stat().st_size]
            older_samples = [int(line.split()[1]) for line in older.read_text().splitlines()
                             if line.startswith("sample ")]
    assert ids == list(range(n))
    bound = cap + batch * width + 2048  # one batch past the cap, and a few log lines
    assert all(size <= bound for size in sizes), sizes
    assert older_samples and older_samples[-1] > n // 2, older_samples  # a recent part
    c.close()
    producer.wait_gone()
    assert not log.exists() and not older.exists()


def failed_logs(rdir, name: str) -> list:
    """The logs that failed producers of `name` left, as the next producer moved them."""
    return sorted(rdir.glob(f"{name}.producer.log.failed-*"))


def test_a_failed_producers_log_survives_the_next_producer(rdir, name, producers,
                                                           monkeypatch):
    """The next producer of the name moves a failed producer's log to
    <name>.producer.log.failed-<time>, which it never writes: its rotation (to .1) and its
    clean end (removing its own log and .1) leave the failure there for the user."""
    fail_a_producer(name, producers)
    cap, width, batch = 16384, 256, 8
    monkeypatch.setattr(_shared_producer, "LOG_MAX_BYTES", cap)  # the fork inherits it
    n = 3 * cap // width  # 3 caps of output: its log rotates
    c = tensorsocket.share(DataLoader(Chatty(n, width=width), batch_size=batch), name=name,
                           epochs=1, timeout=WAIT)
    producer = producers(c)
    ids, rotated = [], False
    for b in c:
        ids += [int(i) for i in b]
        rotated = rotated or older_log_path(c.producer_log).exists()
    assert ids == list(range(n)) and rotated
    c.close()
    producer.wait_gone()
    kept, left = failed_logs(rdir, name), sorted(p.name for p in rdir.iterdir())
    assert len(kept) == 1 and "sample 20 is unreadable" in kept[0].read_text(), left
    assert left == [kept[0].name], left  # and the clean end removed its own log and .1


def test_the_last_failed_logs_are_kept_and_clean_removes_them(rdir, name, producers):
    """Of failed producers of a name, the logs of the last FAILED_LOGS_KEPT stay (each
    under a name of its own); `clean` removes them even while a producer of the name runs,
    and leaves that producer's log."""
    kept = _election.FAILED_LOGS_KEPT
    for k in range(kept + 1):  # each fails on its first batch: share() raises
        with pytest.raises(TensorSocketError, match=f"sample {k} is unreadable"):
            tensorsocket.share(DataLoader(Chatty(8, fail_at=k), batch_size=8), name=name,
                               timeout=WAIT)
    live = tensorsocket.share(DataLoader(TensorDataset(torch.arange(64)), batch_size=8),
                              name=name, timeout=WAIT, idle_timeout=0.5)
    producer = producers(live)
    try:
        failed = failed_logs(rdir, name)
        failures = sorted(k for k in range(kept + 1) for p in failed
                          if f"sample {k} is unreadable" in p.read_text())
        assert failures == list(range(1, kept + 1)), failed  # the first one's log is gone

        r = cli("clean", "--name", name)
        assert r.returncode == 0, r.stdout + r.stderr
        assert all(f"removed log     {p}  " in r.stdout for p in failed), r.stdout
        assert r.stdout.count("removed ") == len(failed) and failed_logs(rdir, name) == []
        assert live.producer_log.exists() and next(iter(live)) is not None  # still serving
    finally:
        live.close()
    producer.wait_gone()
    assert sorted(p.name for p in rdir.iterdir()) == []
