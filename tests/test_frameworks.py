"""The one-line swap inside real training stacks: every sample exactly once per epoch.

Each test starts the training scripts of tests/clients/ as real processes, several at once
as a shell starts them (``a & b & c``), each with
``loader = tensorsocket.share(DataLoader(...), name=...)``:

- PyTorch Lightning ``Trainer.fit`` (``lightning_fit.py``): three jobs on one device;
  two jobs with a train and a val loader each; one job with ``strategy="ddp"`` on two
  devices (Lightning starts rank 1 itself);
- Hugging Face Accelerate (``accelerate_prepare.py``): ``accelerator.prepare(model,
  optimizer, loader)`` in two jobs, then ``accelerator.skip_first_batches``;
- torchrun DDP (``ddp_torchrun.py``): two jobs of two ranks each and one single-process
  job on the same name; ``loader.sampler.set_epoch(epoch)`` every epoch and an
  all-reduce every step;
- Hugging Face ``datasets`` (``hf_datasets.py``): dict batches, two jobs;
- a plain loop (``plain_loop.py``): ``iter()`` without ``next()`` and
  ``itertools.islice(loader, len(loader))`` between full epochs, two jobs.

What is asserted, from the JSON records the scripts write (sample i carries id i):

- per job (a DDP job: the union over its ranks), every epoch holds every sample exactly
  once; each rank takes as many batches as ``len(loader)`` said, the same on every rank;
- jobs started together share one stream: one producer per name, epochs aligned (every
  single-process job sees the same batches in the same order), and only the producer
  loads samples (IdDataset logs the pid of every load).

Every process carries a marker in its environment (the producer share() forks inherits
it). A test gives its processes one deadline: past it, or a few seconds after one of them
failed, every marked process is sent SIGUSR1 (the clients' faulthandler writes every
thread's stack to their output, a producer's to its log), then killed, and the test fails
with the tail of each one's output and of the producers' logs, and what each rank had
received; nothing can hang the suite. Each test has a private
TENSORSOCKET_RUNTIME_DIR and unique producer names (the ``name`` fixture).

``TS_TEST_TIMEOUT_SCALE=2`` doubles every test's deadline (a slow machine).
``TS_TEST_NO_SHARE=1 python -m pytest tests/test_frameworks.py`` runs the same scripts
without tensorsocket (``--no-share``: each on its own DataLoader, with a DistributedSampler
under torchrun) and only the per-job checks: the baseline, which passes.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import popen

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = Path(__file__).resolve().parent / "clients"
MARK = "TENSORSOCKET_FRAMEWORK_TEST"
IDLE = 20  # TENSORSOCKET_IDLE_TIMEOUT of the producers (they are stopped at the end)
FAIL_GRACE = 5.0  # seconds the others get once one process failed
VAL_OFFSET = 10000  # lightning_fit.py's validation ids start here
BASELINE = os.environ.get("TS_TEST_NO_SHARE") == "1"  # the scripts run without tensorsocket
# Every test's deadline is multiplied by this (a slow machine: more; probing for hangs: less).
TIMEOUT_SCALE = float(os.environ.get("TS_TEST_TIMEOUT_SCALE", "1"))


# -- processes -------------------------------------------------------------------------


def _marked(token: str) -> list[int]:
    """Pids of live processes whose environment carries MARK=token."""
    pids = []
    needle = f"{MARK}={token}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env.split(b"\0") and state != "Z":
            pids.append(int(entry))
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "    (none)"
    return "\n".join("    " + line for line in text[-lines:]) or "    (empty)"


class Job:
    """One command (a python script, or torchrun running one) and its output file."""

    def __init__(self, label: str, argv: list[str], proc: subprocess.Popen, log: Path,
                 out: Path) -> None:
        self.label, self.argv, self.proc, self.log, self.out = label, argv, proc, log, out
        self.started = time.monotonic()
        self.ended: float | None = None
        self.killed = False

    def records(self) -> dict[int, dict]:
        """{rank: record} of the JSON files its processes wrote."""
        found = {}
        for path in sorted(self.out.parent.glob(self.out.name + ".rank*.json")):
            record = json.loads(path.read_text())
            found[int(record["rank"])] = record
        return found


class Jobs:
    """The training processes of one test: started together, waited for with one
    deadline, killed (with every process they started) at the end."""

    def __init__(self, tmp: Path, name: str) -> None:
        self.tmp, self.name = tmp, name
        self.token = uuid.uuid4().hex
        self.runtime = tmp / "runtime"
        self.runtime.mkdir(mode=0o700)
        self.loads = tmp / "loads.txt"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORSOCKET_")}
        env.update({MARK: self.token, "TENSORSOCKET_RUNTIME_DIR": str(self.runtime),
                    "TENSORSOCKET_IDLE_TIMEOUT": str(IDLE), "TS_TEST_LOADS": str(self.loads),
                    "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        if env.get("PYTHONPATH", "").split(os.pathsep)[0] != str(ROOT):  # conftest puts it first
            env["PYTHONPATH"] = os.pathsep.join(
                [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.env = env
        self.jobs: list[Job] = []
        self.killed_any = False  # some process had to be killed: its segments may be left
        self.node_runtimes: list[Path] = []  # runtime directories of simulated nodes

    # -- starting ----------------------------------------------------------------------

    def together(self, consumers: int) -> None:
        """The jobs started next are `consumers` consumers of each shared loader, which the
        tests want aligned (every job's epoch k the same batches): their producer waits for
        all of them before batch 0 (min_consumers), as a user who starts a known number of
        jobs would ask. The default start_grace (3 s) aligns only jobs whose share() calls
        fall within it, and on a loaded machine Lightning's imports alone spread them wider
        (a CI run saw 5.7 s)."""
        self.env["TENSORSOCKET_MIN_CONSUMERS"] = str(consumers)
        self.env["TENSORSOCKET_START_GRACE"] = "0"  # no one else is coming

    def python(self, label: str, script: str, *args: str) -> Job:
        """Run `script` of tests/clients with --out <tmp>/<label>."""
        out = self.tmp / label
        return self._start(label, [sys.executable, str(CLIENTS / script), *args,
                                   "--out", str(out)], out)

    def torchrun(self, label: str, nproc: int, script: str, *args: str) -> Job:
        """Run `script` under torchrun with nproc ranks on a port of its own."""
        out = self.tmp / label
        return self._start(label, [sys.executable, "-m", "torch.distributed.run",
                                   "--nproc_per_node", str(nproc), "--master_addr",
                                   "127.0.0.1", "--master_port", str(_free_port()),
                                   str(CLIENTS / script), *args, "--out", str(out)], out)

    def torchrun_node(self, label: str, nodes: int, node: int, nproc: int, port: int,
                      script: str, *args: str, out: Path) -> Job:
        """Node `node` of a torchrun over `nodes` simulated nodes on this machine: each node
        has a runtime directory of its own (as separate machines would have)."""
        runtime = self.tmp / f"runtime-{label}"
        runtime.mkdir(mode=0o700)
        self.node_runtimes.append(runtime)
        return self._start(label, [sys.executable, "-m", "torch.distributed.run",
                                   "--nnodes", str(nodes), "--node_rank", str(node),
                                   "--nproc_per_node", str(nproc), "--master_addr",
                                   "127.0.0.1", "--master_port", str(port),
                                   str(CLIENTS / script), *args, "--out", str(out)], out,
                           env={"TENSORSOCKET_RUNTIME_DIR": str(runtime)})

    def _start(self, label: str, argv: list[str], out: Path,
               env: dict[str, str] | None = None) -> Job:
        log = self.tmp / f"{label}.log"
        with open(log, "wb") as f:
            # fork="identity": _marked() and _cmdline() read /proc/PID/environ and cmdline
            # (conftest._server).
            proc = popen(argv, cwd=ROOT, env={**self.env, **(env or {})}, stdout=f,
                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True, fork="identity")
        job = Job(label, argv, proc, log, out)
        self.jobs.append(job)
        return job

    # -- waiting -----------------------------------------------------------------------

    def wait(self, timeout: float) -> None:
        """Every job must exit 0 within timeout seconds (from now). Once one failed, the
        others get FAIL_GRACE seconds (a DDP peer of a dead rank would wait forever)."""
        timeout *= TIMEOUT_SCALE
        deadline = time.monotonic() + timeout
        failed_at = None
        while True:
            for job in self.jobs:
                if job.ended is None and job.proc.poll() is not None:
                    job.ended = time.monotonic()
                    if job.proc.returncode != 0 and failed_at is None:
                        failed_at = job.ended
            running = [j for j in self.jobs if j.ended is None]
            if not running:
                break
            now = time.monotonic()
            if now > deadline or (failed_at is not None and now > failed_at + FAIL_GRACE):
                for job in running:
                    job.killed = True
                self.dump_stacks()
                self.kill_all()
                for job in running:
                    job.proc.wait(10)
                    job.ended = time.monotonic()
                why = (f"HUNG: still running {timeout:.0f} s after the start" if now > deadline
                       else f"another job failed; these were still running {FAIL_GRACE:.0f} s "
                            "later (killed)")
                pytest.fail(f"{why}: {', '.join(j.label for j in running)}\n\n"
                            + self.describe(), pytrace=False)
            time.sleep(0.05)
        bad = [j for j in self.jobs if j.proc.returncode != 0]
        if bad:
            pytest.fail(f"exited with an error: {', '.join(j.label for j in bad)}\n\n"
                        + self.describe(), pytrace=False)

    def dump_stacks(self) -> None:
        """SIGUSR1 to every process of the jobs still running: the clients (and the
        producers forked from them) write every thread's stack to their output."""
        for pid in _marked(self.token):
            if "torch.distributed.run" not in _cmdline(pid):  # SIGUSR1 would end torchrun
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(1.5)

    def describe(self) -> str:
        """Each job's exit, run time, output tail and records; the producers' logs."""
        parts = []
        for job in self.jobs:
            rc = "killed" if job.killed else job.proc.returncode
            took = (job.ended or time.monotonic()) - job.started
            parts.append(f"--- {job.label}: exit {rc} after {took:.1f} s; "
                         f"{' '.join(Path(a).name if '/' in a else a for a in job.argv[1:])}")
            try:
                records = job.records()
            except (OSError, ValueError) as e:
                records = {}
                parts.append(f"  (records unreadable: {e})")
            for rank, record in sorted(records.items()):
                parts.append(f"  rank {rank}: {_summary(record)}")
            parts.append("  output tail:\n" + _tail(job.log, 80 if job.killed else 25))
        for log in sorted(p for d in [self.runtime, *self.node_runtimes]
                          for p in d.glob("*.producer.log")):
            parts.append(f"--- {log.name}:\n" + _tail(log, 40))
        return "\n".join(parts)

    # -- the end -------------------------------------------------------------------------

    def stop_producers(self) -> None:
        """The jobs are done: stop the producers they left (idle for IDLE s otherwise)
        with SIGTERM, which ends them cleanly (segment, socket and lock removed)."""
        for pid in _marked(self.token):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 10
        while _marked(self.token) and time.monotonic() < end:
            time.sleep(0.05)

    def kill_all(self) -> list[int]:
        """SIGKILL every process of this test (the jobs' groups, then anything marked:
        the producers, which run in sessions of their own); the pids killed."""
        for job in self.jobs:
            if job.proc.poll() is None:
                try:
                    os.killpg(job.proc.pid, signal.SIGKILL)
                    self.killed_any = True
                except ProcessLookupError:
                    pass
        killed = []
        for _ in range(3):
            left = _marked(self.token)
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            self.killed_any = True
            time.sleep(0.1)
        for job in self.jobs:
            try:
                job.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        return killed

    def cleanup(self) -> None:
        """Teardown: nothing of this test may run on; the segments of producers that had
        to be killed are removed (a producer that ended by itself must remove its own:
        the `name` fixture checks that)."""
        self.stop_producers()
        self.kill_all()
        if self.killed_any:
            prefix = f"tensorsocket-{os.getuid()}-{self.name}"
            for entry in os.listdir("/dev/shm"):
                if entry.startswith(prefix):
                    try:
                        os.unlink(f"/dev/shm/{entry}")
                    except FileNotFoundError:
                        pass


@pytest.fixture
def jobs(short_tmp, name):
    j = Jobs(short_tmp, name)
    yield j
    j.cleanup()


# -- checks --------------------------------------------------------------------------------


def _meta(record: dict, key: str) -> dict:
    """What the script recorded about its `key` loader (lightning_fit.py records one per
    loader, the other scripts one for their only loader)."""
    meta = record.get("meta", {})
    return meta[key] if isinstance(meta.get(key), dict) else meta


def _metas(record: dict) -> list[dict]:
    """Every loader record of a process."""
    meta = record.get("meta", {})
    nested = [v for v in meta.values() if isinstance(v, dict) and "pid" in v]
    return nested or [meta]


def _summary(record: dict) -> str:
    """One line: batches and samples per epoch of a record."""
    parts = []
    for key in ("train", "val"):
        epochs = record.get(key) or {}
        if epochs:
            parts.append(key + " " + ", ".join(
                f"e{e}: {len(b)} batches/{sum(map(len, b))} samples"
                for e, b in sorted(epochs.items(), key=lambda kv: int(kv[0]))))
    for key in ("set_epoch_error", "skip_error"):
        if key in record:
            parts.append(f"{key}: {record[key]}")
    meta = _meta(record, "train")
    if meta:
        parts.append(f"len(loader)={meta.get('len')} producer={meta.get('producer_pid')} "
                     f"started={meta.get('started_producer')}")
    parts.append("done" if record.get("done") else "NOT done")
    return "; ".join(parts)


def _ids_problem(where: str, ids: list[int], expected: range) -> str | None:
    """None if ids hold every id of `expected` exactly once; else what is wrong."""
    counts = collections.Counter(ids)
    missing = sorted(set(expected) - set(counts))
    dups = sorted(i for i, c in counts.items() if c > 1)
    strange = sorted(i for i in counts if i not in expected)
    if not (missing or dups or strange):
        return None
    text = f"{where}: {len(ids)} samples for {len(expected)}"
    if missing:
        text += f"; {len(missing)} missing {missing[:12]}{' ...' if len(missing) > 12 else ''}"
    if dups:
        extra = sum(counts[i] - 1 for i in dups)
        text += (f"; {len(dups)} duplicated ({extra} extra copies) "
                 f"{dups[:12]}{' ...' if len(dups) > 12 else ''}")
    if strange:
        text += f"; {len(strange)} ids not in the dataset {strange[:12]}"
    return text


def check_epochs(job: Job, key: str, samples: int, epochs: int, *,
                 offset: int = 0) -> list[str]:
    """Problems with job's `key` epochs: each of `epochs` epochs must hold every sample of
    range(offset, offset + samples) exactly once over the job's ranks, every rank taking
    len(loader) batches, the same number on every rank."""
    problems = []
    records = job.records()
    if not records:
        return [f"{job.label}: no record written"]
    world = max(int(r.get("world", 1)) for r in records.values())
    if sorted(records) != list(range(world)):
        problems.append(f"{job.label}: records of ranks {sorted(records)}, world size {world}")
    expected = range(offset, offset + samples)
    for e in range(epochs):
        per_rank = {rank: r.get(key, {}).get(str(e)) for rank, r in sorted(records.items())}
        absent = [rank for rank, b in per_rank.items() if b is None]
        if absent:
            problems.append(f"{job.label} {key} epoch {e}: no batches recorded on rank(s) "
                            f"{absent}")
            continue
        ids = [i for batches in per_rank.values() for b in batches for i in b]
        where = f"{job.label} {key} epoch {e}" + (f" (union of {world} ranks)" if world > 1
                                                   else "")
        problem = _ids_problem(where, ids, expected)
        if problem:
            problems.append(problem)
        counts = {rank: len(b) for rank, b in per_rank.items()}
        if len(set(counts.values())) > 1:
            problems.append(f"{job.label} {key} epoch {e}: unequal batch counts per rank "
                            f"{counts}")
        for rank, n in counts.items():
            said = _meta(records[rank], key).get("len")
            if said != n:
                problems.append(f"{job.label} {key} epoch {e} rank {rank}: {n} batches, "
                                f"len(loader) said {said!r}")
    for rank, r in records.items():
        extra = sorted(set(r.get(key, {})) - {str(e) for e in range(epochs)}, key=int)
        if extra:
            problems.append(f"{job.label} rank {rank} {key}: epochs {extra} beyond the "
                            f"{epochs} expected")
    return problems


def check_one_stream(jobs_: list[Job], key: str = "train", epochs: int = 2) -> list[str]:
    """Problems unless the jobs share one producer and (single-process jobs) saw the same
    batches in the same order in every epoch: their epochs are aligned."""
    problems: list[str] = []
    if BASELINE:
        return problems
    producers = {}
    for job in jobs_:
        for rank, r in job.records().items():
            meta = _meta(r, key)
            producers[f"{job.label}/rank{rank}"] = (meta.get("producer_pid"),
                                                    meta.get("started_producer"),
                                                    meta.get("wall_start"))
    pids = {p for p, _, _ in producers.values()}
    if len(pids) != 1 or None in pids:
        problems.append(f"{key}: not one producer for all: {producers}")
    starters = [k for k, (_, s, _) in producers.items() if s]
    if len(starters) != 1:
        problems.append(f"{key}: {len(starters)} callers started a producer: {starters}")
    singles = [j for j in jobs_ if set(j.records()) == {0}
               and j.records()[0].get("world", 1) == 1]
    for e in range(epochs):
        seqs = {j.label: j.records()[0].get(key, {}).get(str(e)) for j in singles}
        seqs = {k: v for k, v in seqs.items() if v is not None}
        if len({json.dumps(v) for v in seqs.values()}) > 1:
            first = {k: [b[:3] for b in v[:3]] for k, v in seqs.items()}
            problems.append(f"{key} epoch {e}: jobs started together saw different batches "
                            f"(epochs not aligned; first 3 batches, 3 ids each: {first})")
    starts = [w for _, _, w in producers.values() if w is not None]
    if problems and starts:
        problems.append(f"(share() was called {max(starts) - min(starts):.2f} s apart, first "
                        "to last)")
    return problems


def check_loads(jobs_obj: Jobs, producer_pids: set[int]) -> list[str]:
    """Problems unless every sample was loaded by a producer process."""
    if BASELINE or not jobs_obj.loads.exists():
        return []
    by_pid = collections.Counter(int(line.split()[0])
                                 for line in jobs_obj.loads.read_text().splitlines())
    others = {pid: n for pid, n in by_pid.items() if pid not in producer_pids}
    if not others:
        return []
    return [f"samples loaded outside the producer(s) {sorted(producer_pids)}: "
            f"{ {pid: f'{n} loads ({_pid_role(pid, jobs_obj)})' for pid, n in others.items()} }"]


def _pid_role(pid: int, jobs_obj: Jobs) -> str:
    for job in jobs_obj.jobs:
        for rank, r in job.records().items():
            for meta in _metas(r):
                if meta.get("pid") == pid:
                    return f"{job.label} rank {rank}"
    return "unknown process"


def producer_pids(jobs_: list[Job]) -> set[int]:
    pids = set()
    for job in jobs_:
        for r in job.records().values():
            for meta in _metas(r):
                if meta.get("producer_pid"):
                    pids.add(meta["producer_pid"])
    return pids


def touched(jobs_: list[Job]) -> str:
    """Which attributes of the loader object the frameworks read (for failure messages)."""
    seen: dict[str, set[str]] = {}
    for job in jobs_:
        for r in job.records().values():
            for meta in _metas(r):
                for attr, places in (meta.get("touched") or {}).items():
                    for place, found in places.items():
                        seen.setdefault(f"{attr}{'' if found else ' (MISSING)'}",
                                        set()).add(place)
    return "\n".join(f"    {attr}: {', '.join(sorted(places))}"
                     for attr, places in sorted(seen.items()))


def assert_no_problems(problems: list[str], jobs_obj: Jobs) -> None:
    if problems:
        pytest.fail("\n".join(problems) + "\n\nattributes of the loader read outside "
                    "tensorsocket:\n" + touched(jobs_obj.jobs) + "\n\n" + jobs_obj.describe(),
                    pytrace=False)


# -- PyTorch Lightning ---------------------------------------------------------------------


def assert_trained_together(jobs_obj: Jobs, started: list, n: int) -> None:
    """Jobs that trained 2 epochs on one shared loader of n samples: every sample once per
    epoch per job, one stream, only the producer loading; then the producers end."""
    problems = []
    for job in started:
        problems += check_epochs(job, "train", n, 2)
    problems += check_one_stream(started)
    problems += check_loads(jobs_obj, producer_pids(started))
    assert_no_problems(problems, jobs_obj)
    jobs_obj.stop_producers()


@pytest.mark.slow  # a dozen fresh interpreters; DDP splits also in test_epochs
def test_lightning_three_jobs(jobs, name):
    """Three Trainer.fit jobs on one device each, started together: each trains on every
    sample exactly once per epoch, from one producer, epochs aligned."""
    pytest.importorskip("lightning")
    n = 64
    jobs.together(3)
    started = [jobs.python(f"lightning{k}", "lightning_fit.py", "--name", name,
                           "--samples", str(n)) for k in range(3)]
    jobs.wait(timeout=120)
    assert_trained_together(jobs, started, n)


@pytest.mark.slow  # 29 s: two Lightning jobs; plain loops, HF and accelerate stay in the default suite
def test_lightning_train_and_val(jobs, name):
    """Two jobs with a shared train and a shared val loader: every train and val epoch
    exactly once; the val loader does not shuffle, so each val epoch is its batches in
    order, and the sanity check (two val batches, then Lightning leaves the epoch) gets
    its first two. Lightning's own set_epoch calls on the loaders (the fit loop's epoch,
    also on the val loader after the sanity check took its epoch 0) warn nothing."""
    pytest.importorskip("lightning")
    n, nv = 64, 48
    jobs.together(2)
    started = [jobs.python(f"lightning{k}", "lightning_fit.py", "--name", name, "--val-name",
                           f"{name}-val", "--samples", str(n), "--val-samples", str(nv))
               for k in range(2)]
    jobs.wait(timeout=120)
    problems = []
    for job in started:
        problems += check_epochs(job, "train", n, 2)
        problems += check_epochs(job, "val", nv, 2, offset=VAL_OFFSET)
        problems += check_in_order(job, "val", nv, 2, VAL_OFFSET)
        for rank, r in job.records().items():
            sanity = [i for b in r.get("sanity", []) for i in b]
            if len(r.get("sanity", [])) != 2 or len(set(sanity)) != len(sanity) or \
                    not all(VAL_OFFSET <= i < VAL_OFFSET + nv for i in sanity):
                problems.append(f"{job.label} rank {rank}: sanity check batches {r.get('sanity')}")
        # Lightning prints warnings as "file:line: message", without their category.
        problems += [f"{job.label}: a standard flow warned: {line.strip()}"
                     for line in job.log.read_text(errors="replace").splitlines()
                     if "set_epoch(" in line]
    problems += check_one_stream(started, "train")
    problems += check_one_stream(started, "val")
    problems += check_loads(jobs, producer_pids(started))
    assert_no_problems(problems, jobs)
    jobs.stop_producers()


def check_in_order(job: Job, key: str, samples: int, epochs: int, offset: int,
                   batch_size: int = 8) -> list[str]:
    """Problems unless each `key` epoch of a single-process job is the unshuffled loader's
    epoch itself: batch k holds ids offset + 8k .. offset + 8k + 7. (An epoch that starts
    mid-way through the producer's and wraps into its next one holds every sample once
    too, when the loader does not shuffle; this tells them apart.)"""
    problems = []
    want = [list(range(offset + k, min(offset + k + batch_size, offset + samples)))
            for k in range(0, samples, batch_size)]
    for rank, r in job.records().items():
        for e in range(epochs):
            got = r.get(key, {}).get(str(e))
            if got is not None and got != want:
                firsts = [b[0] if b else None for b in got]
                problems.append(f"{job.label} {key} epoch {e}: not the loader's epoch in order "
                                f"(first id of each batch: {firsts}; want "
                                f"{[b[0] for b in want]})")
        sanity = r.get("sanity")
        if sanity is not None and sanity != want[:2]:
            problems.append(f"{job.label} sanity check: first ids {[b[:1] for b in sanity]}, "
                            f"want the loader's first two batches {[b[:1] for b in want[:2]]}")
    return problems


@pytest.mark.slow  # a dozen fresh interpreters; DDP splits also in test_epochs
def test_lightning_ddp_two_devices(jobs, name):
    """strategy="ddp", devices=2 on the CPU (gloo): the two ranks of the job split each
    train and val epoch between them (their union: every sample exactly once), with the
    same number of batches on both ranks, as Lightning's DistributedSampler would."""
    pytest.importorskip("lightning")
    import torch.distributed

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    n, nv = 128, 48
    job = jobs.python("lightning-ddp", "lightning_fit.py", "--name", name, "--val-name",
                      f"{name}-val", "--devices", "2", "--samples", str(n),
                      "--val-samples", str(nv))
    jobs.wait(timeout=120)
    problems = check_epochs(job, "train", n, 2) + \
        check_epochs(job, "val", nv, 2, offset=VAL_OFFSET)
    problems += check_one_stream([job], "train") + check_one_stream([job], "val")
    problems += check_loads(jobs, producer_pids([job]))
    assert_no_problems(problems, jobs)
    jobs.stop_producers()


# -- Hugging Face Accelerate ---------------------------------------------------------------


def test_accelerate_prepare_two_jobs(jobs, name):
    """accelerator.prepare(model, optimizer, shared loader) in two jobs: two epochs of
    every sample once, from one producer; then accelerator.skip_first_batches(loader, 3)
    yields the epoch's other len(loader) - 3 batches, all distinct samples."""
    pytest.importorskip("accelerate")
    n, skip = 64, 3
    jobs.together(2)
    started = [jobs.python(f"accelerate{k}", "accelerate_prepare.py", "--name", name,
                           "--samples", str(n), "--skip", str(skip)) for k in range(2)]
    jobs.wait(timeout=90)
    problems = []
    for job in started:
        problems += check_epochs(job, "train", n, 2)
        for rank, r in job.records().items():
            if r.get("own_loads_before_skip") and not BASELINE:
                problems.append(f"{job.label}: loaded {r['own_loads_before_skip']} samples "
                                "itself in its two epochs (not shared)")
            if "skip_error" in r:
                problems.append(f"{job.label}: accelerator.skip_first_batches(loader, {skip}) "
                                f"raised {r['skip_error']}\n{r.get('skip_traceback', '')}")
                continue
            skipped = r.get("skipped", [])
            ids = [i for b in skipped for i in b]
            want = r["meta"]["len"] - skip if isinstance(r["meta"]["len"], int) else None
            if want is None or len(skipped) != want or len(set(ids)) != len(ids) or \
                    len(ids) != n - skip * 8 or not all(0 <= i < n for i in ids):
                problems.append(
                    f"{job.label}: skip_first_batches(loader, {skip}) gave {len(skipped)} "
                    f"batches, {len(ids)} samples ({len(ids) - len(set(ids))} repeated); "
                    f"want {want} batches of {n - skip * 8} distinct samples; it made a "
                    f"{r.get('skip_meta', {}).get('type')}")
    problems += check_one_stream(started)
    # skip_first_batches builds a DataLoader of its own, which loads in the job's process:
    # that is allowed (its two epochs before must not, checked above).
    problems += check_loads(jobs, producer_pids(started) | {
        r["meta"]["pid"] for j in started for r in j.records().values()})
    assert_no_problems(problems, jobs)
    jobs.stop_producers()


# -- torchrun DDP --------------------------------------------------------------------------


@pytest.mark.slow  # a dozen fresh interpreters; DDP splits also in test_epochs
def test_torchrun_two_ddp_jobs_and_one_single(jobs, name):
    """Two torchrun jobs of two ranks and one plain process share one name: the ranks of
    each torchrun job split every epoch between them (union exactly once, equal batch
    counts: else the per-step all-reduce hangs), loader.sampler.set_epoch() works, and
    the single process gets every sample once per epoch."""
    import torch.distributed

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    n = 128
    started = [jobs.torchrun("torchrun-a", 2, "ddp_torchrun.py", "--name", name,
                             "--samples", str(n)),
               jobs.torchrun("torchrun-b", 2, "ddp_torchrun.py", "--name", name,
                             "--samples", str(n)),
               jobs.python("single", "ddp_torchrun.py", "--name", name, "--samples", str(n))]
    jobs.wait(timeout=120)
    assert_trained_together(jobs, started, n)


@pytest.mark.slow  # a dozen fresh interpreters; DDP splits also in test_epochs
def test_torchrun_two_simulated_nodes(jobs, name):
    """torchrun --nnodes 2 on this machine, 2 ranks per node, each node with a runtime
    directory of its own: each node's producer reads that node's part of the data (a
    DistributedSampler over the nodes in the loader), its 2 ranks split it; over the 4
    ranks every sample comes exactly once per epoch, the same number of batches each."""
    n = 128
    port = _free_port()
    out = jobs.tmp / "nodes"
    started = [jobs.torchrun_node(f"node{k}", 2, k, 2, port, "ddp_torchrun.py", "--name", name,
                                  "--samples", str(n), "--node-shard", out=out)
               for k in range(2)]
    jobs.wait(timeout=150)
    problems = check_epochs(started[0], "train", n, 2)
    records = started[0].records()
    if sorted(records) != [0, 1, 2, 3]:
        problems.append(f"records of ranks {sorted(records)}, not of all 4")
    assert_no_problems(problems, jobs)
    jobs.stop_producers()


# -- Hugging Face datasets -----------------------------------------------------------------


def test_hf_datasets_two_jobs(jobs, name):
    """A datasets.Dataset in torch format, dict batches: every id once per epoch."""
    pytest.importorskip("datasets")
    n = 64
    jobs.together(2)
    started = [jobs.python(f"hf{k}", "hf_datasets.py", "--name", name, "--samples", str(n))
               for k in range(2)]
    jobs.wait(timeout=90)
    problems = []
    for job in started:
        problems += check_epochs(job, "train", n, 2)
    problems += check_one_stream(started)
    assert_no_problems(problems, jobs)
    jobs.stop_producers()


# -- the plain loop ------------------------------------------------------------------------


def test_plain_loop_two_jobs(jobs, name):
    """Plain loops: full epochs, an iter() dropped without next(), and an epoch cut by
    itertools.islice(loader, len(loader)) (no StopIteration asked for): all four epochs
    hold every sample once, in len(loader) batches."""
    n = 64
    jobs.together(2)
    started = [jobs.python(f"plain{k}", "plain_loop.py", "--name", name, "--samples", str(n))
               for k in range(2)]
    jobs.wait(timeout=90)
    problems = []
    for job in started:
        problems += check_epochs(job, "train", n, 4)
    problems += check_one_stream(started, epochs=4)
    problems += check_loads(jobs, producer_pids(started))
    assert_no_problems(problems, jobs)
    jobs.stop_producers()


# -- alternating loaders under DDP ---------------------------------------------------------


HELD_TOO_LONG = "stayed parked longer than park_hold"  # the producer's log line (control.py)


@pytest.mark.slow  # two Lightning jobs, one of two DDP ranks: three fresh interpreters
def test_lightning_ddp_beside_a_single_job_alternating_loaders(jobs, name):
    """A strategy="ddp" job of two CPU ranks (gloo) and a single-device job, started
    together, each with a shared train and a shared val loader: every train and val epoch
    of each job holds every sample exactly once, and no consumer of either job is held
    for park_hold (issue 24, item 3: the DDP ranks attach after start_grace, so the jobs
    read the loaders out of phase, and a kept place closed a cycle of waits between them;
    no producer's log may say that a place was kept until park_hold ran out). Each
    training step takes 0.5 s (--step-sleep), so that the single job is still training
    when the DDP ranks attach, seconds later, on a loaded machine too."""
    pytest.importorskip("lightning")
    import torch.distributed

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    n, nv = 128, 48
    common = ["--name", name, "--val-name", f"{name}-val", "--samples", str(n),
              "--val-samples", str(nv), "--step-sleep", "0.5"]
    started = [jobs.python("lightning-ddp", "lightning_fit.py", *common, "--devices", "2"),
               jobs.python("lightning-single", "lightning_fit.py", *common, "--devices", "1")]
    jobs.wait(timeout=240)
    problems = []
    for job in started:
        problems += check_epochs(job, "train", n, 2)
        problems += check_epochs(job, "val", nv, 2, offset=VAL_OFFSET)
    problems += check_one_stream(started, "train") + check_one_stream(started, "val")
    problems += check_loads(jobs, producer_pids(started))
    # Read while the producers still run (they end idle_timeout after the jobs, and a
    # producer that ends cleanly may remove its log): both logs must be there.
    logs = sorted(jobs.runtime.glob("*.producer.log"))
    if len(logs) != 2:
        problems.append(f"want the logs of the 2 producers, found {[p.name for p in logs]}")
    for log in logs:
        held = [line for line in log.read_text(errors="replace").splitlines()
                if HELD_TOO_LONG in line]
        if held:
            problems.append(f"{log.name}: a consumer was held for park_hold: {held}")
    assert_no_problems(problems, jobs)
    jobs.stop_producers()
