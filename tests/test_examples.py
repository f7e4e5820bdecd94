"""Run every script in examples/ as a user would, and check what it prints.

Each test runs the scripts with ``sys.executable`` from the repository root, small settings
(the examples' --quick / size flags) and a fresh private XDG_RUNTIME_DIR, so that the
producers' sockets and locks are the test's own. Every process a test starts, and every
process those start (DataLoader workers, the producer share() forks into its own session),
carries a marker in its environment; at the end the test kills whatever still carries it
and fails if anything did. It also fails if a shared-memory segment of the examples'
producers was left in /dev/shm.
"""

from __future__ import annotations

import difflib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
MARK = "TENSORSOCKET_EXAMPLE_TEST"
# Producer names the examples use (segments are tensorsocket-<uid>-<name>-<pid>).
NAMES = ("resnet18", "example", "sweep-", "generator-", "iterable-", "once-")
# Small images for the training examples: 10 classes x 8 JPEGs of 96 px, 32 px crops.
SMALL = ("--images", "8", "--image-size", "96", "--crop", "32")


def _segments() -> set[str]:
    prefix = f"tensorsocket-{os.getuid()}-"
    return {e for e in os.listdir("/dev/shm")
            if e.startswith(prefix) and e[len(prefix):].startswith(NAMES)}


def _marked(token: str) -> list[int]:
    """Pids of live processes whose environment carries MARK=token."""
    pids = []
    needle = f"{MARK}={token}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env.split(b"\0") and state != "Z":
            pids.append(int(entry))
    return pids


def _wait_gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


class Runner:
    """Starts example scripts in one private runtime dir; cleans up after them."""

    def __init__(self, tmp: Path) -> None:
        self.token = uuid.uuid4().hex
        self.tmp = tmp
        runtime = tmp / "runtime"
        runtime.mkdir(mode=0o700)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORSOCKET_")}
        env.update({MARK: self.token, "XDG_RUNTIME_DIR": str(runtime), "PYTHONUNBUFFERED": "1"})
        self.env = env
        self.procs: list[subprocess.Popen] = []

    def start(self, script: str, *args: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, str(EXAMPLES / script), *args], cwd=ROOT,
                             env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        self.procs.append(p)
        return p

    def finish(self, p: subprocess.Popen, timeout: float = 60) -> str:
        """The output of p, which must exit 0 within timeout seconds."""
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            raise AssertionError(f"{p.args} ran over {timeout} s; output:\n{out}") from None
        assert p.returncode == 0, f"{p.args} exited {p.returncode}; output:\n{out}"
        return out

    def run(self, script: str, *args: str, timeout: float = 60) -> str:
        return self.finish(self.start(script, *args), timeout)

    def cleanup(self) -> list[int]:
        """Kill what the test left running; the pids that were still alive."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
        end = time.monotonic() + 6  # a DataLoader worker notices its parent is gone within 5 s
        while _marked(self.token) and time.monotonic() < end:
            time.sleep(0.1)
        left = _marked(self.token)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


@pytest.fixture
def runner(tmp_path):
    before = _segments()
    r = Runner(tmp_path)
    yield r
    left = r.cleanup()
    assert not left, f"processes left running: {left}"
    end = time.monotonic() + 5
    while _segments() - before and time.monotonic() < end:  # teardown may still be going on
        time.sleep(0.1)
    leaked = _segments() - before
    assert not leaked, f"shared memory left behind: {leaked}"


def _epochs(out: str, pattern: str) -> list[tuple[str, ...]]:
    return re.findall(pattern, out)


# -- the tests -----------------------------------------------------------------------------


def test_train_files_differ_in_one_line():
    """The README shows this diff: the loader line, and nothing else."""
    alone = (EXAMPLES / "train_alone.py").read_text().splitlines()
    shared = (EXAMPLES / "train_shared.py").read_text().splitlines()
    changed = [line for line in difflib.unified_diff(alone, shared, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert len(changed) == 2, changed
    before, after = changed[0][1:].strip(), changed[1][1:].strip()
    assert before.startswith("loader = DataLoader(")
    dataloader = before[len("loader = "):]
    assert after.startswith(f"loader = share({dataloader}, name=")


def test_train_alone(runner, tmp_path):
    out = runner.run("train_alone.py", *SMALL, "--data", str(tmp_path / "jpegs"))
    assert "vision: " in out
    assert "loader: DataLoader, 3 batches per epoch" in out
    epochs = _epochs(out, r"epoch (\d)/2: (\d+) batches, (\d+) samples, loss ([\d.]+)")
    assert [(e, b, s) for e, b, s, _ in epochs] == [("1", "3", "80"), ("2", "3", "80")], out
    assert "done: 2 epochs" in out


def test_train_shared_three_trainings_one_producer(runner, tmp_path):
    data = str(tmp_path / "jpegs")
    runner.env["TENSORSOCKET_IDLE_TIMEOUT"] = "2"  # the producer ends 2 s after the last
    procs = [runner.start("train_shared.py", *SMALL, "--data", data, "--lr", lr)
             for lr in ("0.1", "0.05", "0.02")]
    outs = [runner.finish(p, timeout=90) for p in procs]
    producers, starters = set(), 0
    for out in outs:
        found = re.search(r"loader: TensorConsumer, 3 batches per epoch, from producer pid "
                          r"(\d+) \((started by this process|already running)", out)
        assert found, out
        producers.add(int(found.group(1)))
        starters += found.group(2) == "started by this process"
        epochs = _epochs(out, r"epoch (\d)/2: (\d+) batches, (\d+) samples")
        assert epochs == [("1", "3", "80"), ("2", "3", "80")], out
        assert "done: 2 epochs" in out
    assert len(producers) == 1 and starters == 1, outs  # exactly one producer, shared by all
    producer = producers.pop()
    assert producer not in {p.pid for p in procs}
    # The producer outlives the trainings by share()'s idle_timeout (2 s from the
    # environment here, 60 s by default), then ends by itself and removes its segment
    # (checked by the fixture), socket and lock.
    assert _wait_gone(producer, 20), "the shared producer did not end after its idle_timeout"
    runtime = Path(runner.env["XDG_RUNTIME_DIR"]) / "tensorsocket"
    assert sorted(p.name for p in runtime.iterdir()) == ["resnet18.producer.log"]


def test_sweep(runner, tmp_path):
    out = runner.run("sweep.py", "--quick", "--images", "8", "--data", str(tmp_path / "jpegs"),
                     timeout=90)
    # (trial, lr, batch size, epochs) of the quick schedule; 80 samples per epoch.
    for number, lr, bs, epochs in ((1, "0.1", 32, 3), (2, "0.03", 64, 2), (3, "0.01", 48, 2)):
        seen = _epochs(out, rf"\[trial {number} lr {lr} batch {bs}\] epoch (\d)/{epochs}: "
                            rf"loss [\d.]+ \((\d+) samples\)")
        assert seen == [(str(e), "80") for e in range(1, epochs + 1)], out
        row = rf"\n\s+{number}\s+{lr}\s+{bs}\s+{epochs}\s+[\d.]+\s+{80 * epochs}\s+\+[\d.]+s"
        assert re.search(row, out), out
    assert re.search(r"the trials used 560 samples", out), out
    assert re.search(r"shared loader: \d+ samples loaded once", out), out


def test_not_a_dataloader(runner):
    out = runner.run("not_a_dataloader.py")
    gen = _epochs(out, r"\[consumer generator-\w+\] epoch (\d): (\d+) batches, (\d+) samples")
    assert gen == [("1", "6", "192"), ("2", "6", "192")], out
    assert "input_ids: torch int64 [32, 64]" in out and "shard: str 'shard-0'" in out
    it = _epochs(out, r"\[consumer iterable-\w+\] epoch (\d): (\d+) batches, (\d+) samples")
    assert it == [("1", "10", "160"), ("2", "10", "160")], out
    assert "text: list of 16 str, label: numpy int64 [16], embedding: numpy float32 [16, 16]" \
        in out
    assert "len(consumer): unknown" in out
    assert "a generator object asked for a 2nd epoch: TypeError:" in out


def test_shared_producer_and_consumers(runner):
    producer = runner.start("shared_producer.py")
    consumers = [runner.start("shared_consumer.py", "--lr", lr) for lr in ("0.1", "0.01")]
    for c, lr in zip(consumers, ("0.1", "0.01"), strict=True):
        out = runner.finish(c, timeout=90)
        assert _epochs(out, rf"lr {lr}: epoch (\d) loss [\d.]+ \((\d+) samples\)") == \
            [("0", "2048"), ("1", "2048"), ("2", "2048")], out
    out = runner.finish(producer, timeout=30)
    assert _epochs(out, r"producer: epoch (\d) published \((\d+) batches\)") == \
        [("0", "32"), ("1", "32"), ("2", "32")], out
