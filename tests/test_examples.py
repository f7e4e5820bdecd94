"""Run every script in examples/ as a user would, and check what it prints.

Each test runs the scripts with ``sys.executable`` from the repository root, small settings
(the examples' --quick / size flags) and a fresh private XDG_RUNTIME_DIR, so that the
producers' sockets and locks are the test's own. Every process a test starts, and every
process those start (DataLoader workers, the producer share() forks into its own session),
carries a marker in its environment; at the end the test kills whatever still carries it
and fails if anything did. It also fails if a shared-memory segment of the examples'
producers was left in /dev/shm: a segment is named after its producer's pid, and the test
notes the pids of its marked processes while it waits for them, so that segments of
other test runs on the machine (the examples' producer names are fixed) are not taken for
its own.
"""

from __future__ import annotations

import difflib
import io
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import popen

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
MARK = "TENSORSOCKET_EXAMPLE_TEST"
# Producer names the examples use (segments are tensorsocket-<uid>-<name>-<pid>).
NAMES = ("resnet18", "example", "sweep-", "generator-", "iterable-", "once-", "demo-")
# Small images for the training examples: 10 classes x 8 JPEGs of 96 px, 32 px crops.
SMALL = ("--images", "8", "--image-size", "96", "--crop", "32")


def _segments(pids: set[int] | None = None) -> set[str]:
    """The examples' segments in /dev/shm (of producers with these pids, if given)."""
    prefix = f"tensorsocket-{os.getuid()}-"
    found = {e for e in os.listdir("/dev/shm")
             if e.startswith(prefix) and e[len(prefix):].startswith(NAMES)}
    if pids is None:
        return found
    return {e for e in found if e.rsplit("-", 1)[-1].split(".")[0].isdigit()
            and int(e.rsplit("-", 1)[-1].split(".")[0]) in pids}


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
        self.seen: set[int] = set()  # pids of this test's processes (see note())

    def note(self) -> None:
        """Remember the pids of this test's live processes (producers among them)."""
        self.seen.update(_marked(self.token))
        self.seen.update(p.pid for p in self.procs)

    def start(self, script: str, *args: str) -> subprocess.Popen:
        # fork="identity": the check for processes left running reads MARK from
        # /proc/PID/environ (conftest._server).
        p = popen([sys.executable, str(EXAMPLES / script), *args], cwd=ROOT, fork="identity",
                  env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(p)
        return p

    def finish(self, p: subprocess.Popen, timeout: float = 60) -> str:
        """The output of p, which must exit 0 within timeout seconds."""
        out = self._wait(p, timeout)
        assert p.returncode == 0, f"{p.args} exited {p.returncode}; output:\n{out}"
        return out

    def _wait(self, p: subprocess.Popen, timeout: float) -> str:
        """p's output once it exited (noting pids meanwhile); AssertionError after timeout."""
        deadline = time.monotonic() + timeout
        while True:
            self.note()
            try:
                out, _ = p.communicate(timeout=0.2)
                return out
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    p.kill()
                    out, _ = p.communicate()
                    raise AssertionError(f"{p.args} ran over {timeout} s; output:\n{out}") \
                        from None

    def run(self, script: str, *args: str, timeout: float = 60) -> str:
        return self.finish(self.start(script, *args), timeout)

    def fail(self, script: str, *args: str, timeout: float = 60) -> tuple[int, str]:
        """(exit status, output) of a run that must fail."""
        p = self.start(script, *args)
        out = self._wait(p, timeout)
        return p.returncode, out

    def cleanup(self) -> list[int]:
        """Kill what the test left running; the pids that were still alive."""
        self.note()
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
def runner(short_tmp):
    r = Runner(short_tmp)
    yield r
    left = r.cleanup()
    assert not left, f"processes left running: {left}"
    end = time.monotonic() + 5
    while _segments(r.seen) and time.monotonic() < end:  # teardown may still be going on
        time.sleep(0.1)
    leaked = _segments(r.seen)
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


@pytest.mark.slow  # no tensorsocket in it; the one-line swap: test_train_files_differ...
def test_train_alone(runner, tmp_path):
    out = runner.run("train_alone.py", *SMALL, "--data", str(tmp_path / "jpegs"))
    assert "vision: " in out
    assert "loader: DataLoader, 3 batches per epoch" in out
    epochs = _epochs(out, r"epoch (\d)/2: (\d+) batches, (\d+) samples, loss ([\d.]+)")
    assert [(e, b, s) for e, b, s, _ in epochs] == [("1", "3", "80"), ("2", "3", "80")], out
    assert "done: 2 epochs" in out


@pytest.mark.slow  # 30 s: three trainings; the swap itself: test_train_files_differ_by_one_line
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
    # (checked by the fixture), socket, lock and log.
    assert _wait_gone(producer, 20), "the shared producer did not end after its idle_timeout"
    runtime = Path(runner.env["XDG_RUNTIME_DIR"]) / "tensorsocket"
    assert sorted(p.name for p in runtime.iterdir()) == []


@pytest.mark.slow  # trains a ResNet-18; late joiners also in test_flexible and test_sweep_order
def test_sweep(runner, tmp_path):
    # About 40 CPU-seconds in all (four processes importing torch, three training a
    # ResNet-18), so the limit is for a machine that the rest of the slow suite loads too:
    # CI once cut it off at 90 s while it was still making progress. A stall would not
    # need the limit: each trial's consumer raises after 60 s without a batch, and the
    # driver then fails.
    out = runner.run("sweep.py", "--quick", "--images", "8", "--data", str(tmp_path / "jpegs"),
                     timeout=300)
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


@pytest.mark.slow  # 18 s: the same API as test_endtoend's, run from the example
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


def _runtime_leftovers(runner: Runner, name: str) -> list[str]:
    """Files of producer `name` in the runner's runtime directory."""
    runtime = Path(runner.env["XDG_RUNTIME_DIR"]) / "tensorsocket"
    return sorted(p.name for p in runtime.glob(name + ".*")) if runtime.is_dir() else []


@pytest.mark.slow  # 45 s: the Quickstart's demo, which fresh-clone-check runs too
def test_demo_runs_both_and_every_job_gets_every_sample(runner, tmp_path):
    """The demo of the README's Quickstart in a short mode: a baseline run (a DataLoader
    per job) and a shared run both happen; in each, every job trained on every sample
    exactly once per epoch (its ids as it trained on them); the shared jobs saw one
    stream (the same ids in the same order), the producer published each batch once; the
    comparison is printed; exit 0 and nothing left in /dev/shm (the fixture) or the
    runtime directory."""
    figures = tmp_path / "demo.json"
    out = runner.run("demo.py", "--jobs", "2", "--epochs", "2", "--images", "64",
                     "--no-live", "--json", str(figures), timeout=240)
    assert "Traceback" not in out, out
    doc = json.loads(figures.read_text())
    for mode in ("baseline", "shared"):
        jobs = doc["runs"][mode]["jobs"]
        assert sorted(j["rank"] for j in jobs) == [1, 2], jobs
        for job in jobs:
            assert job["samples"] == 2 * 64
            assert [sorted(e["ids"]) for e in job["epochs"]] == [list(range(64))] * 2, mode
    shared = doc["runs"]["shared"]
    assert shared["jobs"][0]["epochs"] == shared["jobs"][1]["epochs"]
    assert shared["producer"]["batches"] == 2 * 2  # 64 samples in batches of 32, 2 epochs
    assert "producer" not in doc["runs"]["baseline"]
    assert all(doc["runs"][m]["other_cpu_s"] >= 0 for m in ("baseline", "shared"))
    for row in ("a DataLoader each", "one shared loader", "samples/s, all jobs",
                "CPU seconds while training", "CPU seconds of other processes meanwhile",
                "every sample once per epoch (2 jobs x 2)"):
        assert row in out, out
    ratio = doc["runs"]["shared"]["samples_per_s"] / doc["runs"]["baseline"]["samples_per_s"]
    assert f"trained the 2 jobs {ratio:.2f}x as fast" in out, out
    demo_name = re.search(r"producer name '(demo-\d+)'", out).group(1)
    assert _runtime_leftovers(runner, demo_name) == []


@pytest.mark.slow  # 40 s: 30 epochs of the baseline first, so that the shared run is long
def test_demo_terminated_in_its_shared_run_leaves_nothing(runner):
    """SIGTERM to the demo once its shared run is publishing: exit 143 with one line, the
    producer and the jobs stopped (the fixture: no process, no segment) and nothing left
    in the runtime directory."""
    p = runner.start("demo.py", "--jobs", "2", "--images", "64", "--epochs", "30",
                     "--no-live")
    seen, deadline = [], time.monotonic() + 180
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    while not any("producer  epoch 1/30 published" in line for line in seen):
        assert time.monotonic() < deadline and p.poll() is None, "".join(seen)
        runner.note()
        if sel.select(timeout=0.5):
            seen.append(p.stdout.readline())
    sel.close()
    p.send_signal(signal.SIGTERM)
    out = "".join(seen) + runner._wait(p, 60)
    assert p.returncode == 143, out
    assert out.rstrip().splitlines()[-1] == "demo.py: terminated", out
    demo_name = re.search(r"producer name '(demo-\d+)'", out).group(1)
    assert _runtime_leftovers(runner, demo_name) == []


def test_demo_failure_is_one_line_and_cleans_up(runner):
    """A demo whose runs cannot finish in --timeout: one error line and a hint, no
    traceback, exit 1, every child stopped (the fixture) and nothing left behind."""
    code, out = runner.fail("demo.py", "--jobs", "2", "--images", "64", "--timeout", "1",
                            timeout=120)
    assert code == 1, out
    errors = [line for line in out.splitlines() if line.startswith(("demo.py: error", "hint"))]
    assert errors[0].startswith("demo.py: error: the demo did not finish within 1 s"), out
    assert errors[1].startswith("hint: ") and "Traceback" not in out, out
    demo_name = re.search(r"producer name '(demo-\d+)'", out).group(1)
    assert _runtime_leftovers(runner, demo_name) == []


def _block_import(runner, tmp_path: Path, package: str) -> None:
    """Make `package` fail to import in the runner's children."""
    blocker = tmp_path / f"block-{package}" / package
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(f"raise ImportError('no {package} here')\n")
    runner.env["PYTHONPATH"] = os.pathsep.join(
        [str(blocker.parent)] + [p for p in [runner.env.get("PYTHONPATH")] if p])


def test_demo_plot_without_matplotlib_says_so_first(runner, tmp_path):
    """--plot where matplotlib does not import: a usage error naming the option, the
    package and the way out, exit 2, before anything runs."""
    _block_import(runner, tmp_path, "matplotlib")
    code, out = runner.fail("demo.py", "--plot", str(tmp_path / "out.png"), timeout=60)
    assert code == 2, out
    assert "--plot" in out and "needs matplotlib" in out and "pip install matplotlib" in out
    assert "tensorsocket demo" not in out and not (tmp_path / "out.png").exists()


def test_demo_without_pillow_says_what_to_install(runner, tmp_path):
    """The demo decodes JPEGs: without Pillow, one error line and the install command."""
    _block_import(runner, tmp_path, "PIL")
    code, out = runner.fail("demo.py", timeout=60)
    assert code == 1 and "Traceback" not in out, out
    assert out.splitlines() == [
        "demo.py: error: the demo decodes JPEGs with Pillow, which is not installed",
        "hint: pip install -e '.[demo]' (or pip install pillow)"], out


def test_demo_plot_draws_both_runs(tmp_path):
    """The comparison drawn from a run's figures (where matplotlib is installed)."""
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(EXAMPLES))
    try:
        import _demo_report
    finally:
        sys.path.remove(str(EXAMPLES))
    runs = {m: {"samples_per_s": r, "train_cpu_s": c}
            for m, r, c in (("baseline", 100.0, 30.0), ("shared", 230.0, 12.0))}
    _demo_report.plot(runs, 2.4, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_model_follows_the_bottleneck():
    """The model's ratio the demo prints: N (L + T) / (L + N T) when every core is busy, the
    loader's workers' limit where cores are many (and it says which)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from _demo_report import model_speedup
    finally:
        sys.path.remove(str(EXAMPLES))
    L, T = 0.13, 0.015
    ratio, cores_bound = model_speedup(L, T, 3, 2, 1, 2)
    assert ratio == pytest.approx(3 * (L + T) / (L + 3 * T)) and cores_bound
    # 64 cores: each baseline job runs at its one worker's pace (1/L), the shared loader's
    # 3 workers make batches 3 times as fast, each consumer takes all of them.
    ratio, cores_bound = model_speedup(L, T, 3, 64, 1, 3)
    assert ratio == pytest.approx(3.0) and not cores_bound


def test_demo_checks_the_environment_first(runner, tmp_path):
    """A runtime directory that cannot be used, or a TENSORSOCKET_* value that does not
    parse: one line saying what to fix, exit 1, before any child starts."""
    a_file = tmp_path / "file"
    a_file.write_text("")
    for var, value, says in (("TENSORSOCKET_RUNTIME_DIR", str(a_file), "is not a directory"),
                             ("TENSORSOCKET_MAX_LAG", "lots",
                              "TENSORSOCKET_MAX_LAG='lots' is not valid")):
        runner.env[var] = value
        code, out = runner.fail("demo.py", "--no-live")
        del runner.env[var]
        lines = out.strip().splitlines()
        assert code == 1 and len(lines) == 1, out
        assert lines[0].startswith("demo.py: error: ") and says in lines[0], out


def test_demo_panel_counts_batches_not_epoch_ends():
    """The demo's live panel: a consumer that took every entry of 2 epochs of 32 batches
    (and their 2 end markers) has taken 64 of 64 batches; a finished one is shown full."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from _demo_panel import LivePanel
    finally:
        sys.path.remove(str(EXAMPLES))

    out = io.StringIO()
    panel = LivePanel("demo-x", 32, 2, out)
    assert panel.total == 64
    assert [panel.batches_taken(n) for n in (0, 32, 33, 34, 65, 66)] == [0, 32, 32, 33, 64, 64]
    panel.finished(4242, 64, {4242: "consumer 1"})
    assert f"[{'#' * 24}]   64/64 batches" in out.getvalue()


def test_store_text_three_selections_share_the_tokenization(runner, tmp_path):
    """examples/store_text.py: three fine-tuning jobs on all, a random half and a fixed
    quarter of one corpus, each its own DataLoader through share(..., store=True): each
    job's batches are its own loader's, and the jobs together tokenized each line about
    once (the check decodes a few again at each epoch start; a job that started after the
    others had left would tokenize its own), far fewer than three jobs on their own."""
    pytest.importorskip("tokenizers")
    summary = tmp_path / "summary.json"
    out = runner.run("store_text.py", "--lines", "600", "--epochs", "2", "--stagger", "0",
                     "--json", str(summary), timeout=300)
    doc = json.loads(summary.read_text())
    assert [j["ids_equal"] for j in doc["jobs"]] == [True] * 3, out
    assert [j["samples"] for j in doc["jobs"]] == [1200, 600, 300], out
    assert doc["tokenizations_own"] == 2100
    assert 600 <= doc["tokenizations_shared"] <= 600 + 3 * 2 * 4 + 300, out
    assert "tokenizations:" in out
