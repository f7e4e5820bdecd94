"""tensorsocket.share(): one producer elected among real training processes.

The trainer processes run TRAINER (below) with sys.executable; each test gets a
runtime directory of its own (XDG_RUNTIME_DIR), and every process that still
runs with it at teardown (trainers, the forked producer, its loader workers)
is killed.
"""

from __future__ import annotations

import json
import os
import shutil
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import tensorsocket
from conftest import shm_segments, popen
from tensorsocket import ProducerFinished, ProducerNotFound, TensorConsumer, TensorSocketError
from tensorsocket import _core
from tensorsocket.control.endpoints import runtime_dir

IDLE = 1.5  # idle_timeout of the producers the tests start
SAMPLES = 40

TRAINER = r'''
import faulthandler, json, os, signal, sys, time
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info
import tensorsocket

cfg = json.loads(sys.argv[1])
faulthandler.register(signal.SIGUSR1)  # a test that waits too long asks where we are

class Ids(Dataset):
    """Sample i is the tensor i; every load is logged with the pid of the loader's
    process (the producer, also for the loads of its worker processes)."""
    def __len__(self):
        return cfg["samples"]
    def __getitem__(self, i):
        if cfg.get("fail"):
            raise ValueError("boom: this dataset cannot load sample %d" % i)
        root = os.getppid() if get_worker_info() is not None else os.getpid()
        fd = os.open(cfg["loads"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(fd, b"%d %d\n" % (root, i))
        os.close(fd)
        return torch.tensor(i)

def say(**msg):
    print(json.dumps(msg), flush=True)

say(ready=os.getpid())
while not os.path.exists(cfg["go"]):
    time.sleep(0.005)
loader = DataLoader(Ids(), batch_size=cfg["loader_batch_size"],
                    num_workers=cfg.get("workers", 0))
c = tensorsocket.share(loader, name=cfg["name"], idle_timeout=cfg["idle"], timeout=30,
                       **cfg.get("options", {}))
say(attached=os.getpid(), started=c.started_producer, producer=c.producer_pid, len=len(c),
    log=str(c.producer_log), dataset=len(c.dataset))
epochs, sizes, read = [], [], 0
for e in range(cfg["epochs"]):
    ids = []
    for batch in c:
        ids += batch.tolist()
        sizes.append(len(batch))
        read += 1
        if read == cfg.get("stop_after"):
            say(read=read)
            time.sleep(60)  # until the test kills us
    epochs.append(ids)
c.close()
say(pid=os.getpid(), epochs=epochs, sizes=sizes)
'''


# -- fixtures and helpers ---------------------------------------------------------------


def _ours(p: psutil.Process, base: str) -> bool:
    """Whether p runs with XDG_RUNTIME_DIR=base, or writes its output into base (a producer
    that share() forked writes to its log in the runtime directory). /proc/PID/environ
    shows the environment a process was exec'd with: a child forked by the tests' fork
    server (tools.harness) and the producers it forks show the server's."""
    if p.environ().get("XDG_RUNTIME_DIR") == base:
        return True
    for fd in (1, 2):
        try:
            if os.readlink(f"/proc/{p.pid}/fd/{fd}").startswith(base + os.sep):
                return True
        except OSError:
            pass
    return False


def _killall(base: str) -> None:
    """Kill every process of ours that runs with XDG_RUNTIME_DIR=base (see _ours)."""
    for p in psutil.process_iter(["uids"]):
        if p.pid == os.getpid() or p.info["uids"] is None or p.info["uids"].real != os.getuid():
            continue
        try:
            if _ours(p, base):
                p.kill()
        except (psutil.Error, OSError):
            pass


@pytest.fixture
def rt(name, monkeypatch, procs):
    """A runtime directory of this test's own; leftover processes are killed after."""
    base = tempfile.mkdtemp(prefix="ts-share-")
    monkeypatch.setenv("XDG_RUNTIME_DIR", base)
    for var in ("TENSORSOCKET_RUNTIME_DIR", "TENSORSOCKET_ADDRESS", "TENSORSOCKET_NAME",
                "TENSORSOCKET_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    rdir = runtime_dir()
    assert rdir == Path(base) / "tensorsocket"
    yield rdir
    procs.kill_all()
    _killall(base)
    lock = rdir / f"{name}.lock"
    if lock.exists():  # a producer forked by this very process (an in-process test)
        try:
            os.kill(int(lock.read_text().strip() or 0), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass
    shutil.rmtree(base, ignore_errors=True)


class Trainers:
    """TRAINER processes of one test."""

    def __init__(self, procs, rdir: Path, name: str, tmp: Path) -> None:
        self.procs, self.rdir, self.name, self.tmp = procs, rdir, name, tmp
        self.script = tmp / "trainer.py"
        self.script.write_text(TRAINER)
        self.go = tmp / "go"
        self.loads = tmp / "loads.txt"
        self._buffers: dict[int, bytes] = {}

    def start(self, *, loader_batch_size: int = 8, epochs: int = 2, new_session: bool = False,
              **cfg) -> subprocess.Popen:

        cfg = {"name": self.name, "samples": SAMPLES, "loader_batch_size": loader_batch_size,
               "epochs": epochs, "idle": IDLE, "go": str(self.go), "loads": str(self.loads),
               **cfg}
        p = popen([sys.executable, str(self.script), json.dumps(cfg)],
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                  start_new_session=new_session)
        self.procs.procs.append(p)
        return p

    def line(self, p: subprocess.Popen, timeout: float = 30) -> dict:
        """The next JSON line of p's stdout (read unbuffered: lines that came together
        stay in our buffer, not in a file object's that select() cannot see)."""
        buf = self._buffers.setdefault(p.pid, b"")
        deadline = time.monotonic() + timeout
        fd = p.stdout.fileno()
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            assert left > 0, f"no line from pid {p.pid} within {timeout} s"
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                assert chunk, f"pid {p.pid} exited: {p.stderr.read()}"
                buf += chunk
        line, buf = buf.split(b"\n", 1)
        self._buffers[p.pid] = buf
        return json.loads(line)

    def result(self, p: subprocess.Popen, timeout: float = 60) -> dict:
        """Wait for p to exit 0; its last JSON line."""
        out, err = p.communicate(timeout=timeout)
        out = self._buffers.pop(p.pid, b"").decode() + out
        assert p.returncode == 0, f"exit {p.returncode}\nstdout:{out}\nstderr:{err}"
        return json.loads(out.strip().splitlines()[-1])

    def loads_by_epoch(self) -> tuple[set[int], list[list[int]]]:
        """(pids that loaded samples, the loads cut into epochs of SAMPLES)."""
        rows = [line.split() for line in self.loads.read_text().splitlines()]
        pids = {int(pid) for pid, _ in rows}
        ids = [int(i) for _, i in rows]
        return pids, [ids[k:k + SAMPLES] for k in range(0, len(ids), SAMPLES)]


@pytest.fixture
def trainers(procs, rt, name, tmp_path):
    return Trainers(procs, rt, name, tmp_path)


def wait_gone(pid: int, timeout: float) -> float:
    """Seconds until process pid is gone; fails after timeout."""
    start = time.monotonic()
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() - start < timeout, f"process {pid} still runs"
        time.sleep(0.05)
    return time.monotonic() - start


def assert_nothing_left(rdir: Path, name: str) -> None:
    assert shm_segments(name) == []
    left = sorted(p.name for p in rdir.iterdir())
    # The log of a failed producer stays (the next producer of the name moves it to
    # <name>.producer.log.failed-<time>).
    assert left == [] or len(left) == 1 and (
        left[0] == f"{name}.producer.log"
        or left[0].startswith(f"{name}.producer.log.failed-")), left


def producer_alive(rdir: Path, name: str) -> bool:
    from tensorsocket.sharing.election import producer_live
    from tensorsocket.control.endpoints import resolve

    return producer_live(resolve(name))


# -- real processes -----------------------------------------------------------------------


def test_three_simultaneous_callers_one_producer(trainers, rt, name):
    """Three processes call share() at the same moment, each with its own batch size:
    exactly one producer runs the loader (each sample loaded once per epoch, all by
    it), every process gets every sample exactly once per epoch, len() is what its
    own DataLoader would give, and the producer ends idle_timeout after the last one
    left, leaving nothing behind."""
    # Loader batch sizes 8, 8, 16; the second asks for 5: whoever starts the producer,
    # everyone gets the batches its own DataLoader (or batch_size=) makes.
    ps = [trainers.start(workers=2),
          trainers.start(options={"batch_size": 5}),
          trainers.start(loader_batch_size=16)]
    for p in ps:
        trainers.line(p)
    trainers.go.touch()  # all three call share() now
    attached = [trainers.line(p) for p in ps]
    results = [trainers.result(p) for p in ps]
    ended = time.monotonic()

    assert sum(a["started"] for a in attached) == 1, attached
    producer = attached[0]["producer"]
    assert all(a["producer"] == producer for a in attached)
    assert producer not in {a["attached"] for a in attached}
    assert [a["len"] for a in attached] == [5, 8, 3]
    assert all(a["dataset"] == SAMPLES for a in attached)
    for r, sizes in zip(results, ([8] * 5, [5] * 8, [16, 16, 8]), strict=True):
        assert len(r["epochs"]) == 2
        for ids in r["epochs"]:
            assert sorted(ids) == list(range(SAMPLES)), ids
        assert r["sizes"] == sizes * 2

    pids, epochs = trainers.loads_by_epoch()
    assert pids == {producer}, "the loader must run in the producer only"
    # Each sample is loaded once per epoch; the producer may have run ahead into a
    # further epoch (the ring and the workers' prefetch), never repeating a sample in one.
    assert len(epochs) >= 2 and len(epochs[1]) == SAMPLES
    for ids in epochs:
        assert len(set(ids)) == len(ids)
        if len(ids) == SAMPLES:
            assert sorted(ids) == list(range(SAMPLES))

    log = Path(attached[0]["log"]).read_text()
    assert log.count("listening on") == 1
    gone = wait_gone(producer, IDLE + 10)
    assert time.monotonic() - ended < IDLE + 10, gone
    assert not Path(attached[0]["log"]).exists()  # a clean end (idle_timeout) removes it
    assert_nothing_left(rt, name)


def test_first_caller_interrupted_others_finish(trainers, rt, name):
    """The caller that started the producer gets Ctrl-C (SIGINT to its process group)
    mid-epoch; the producer is not in that group and keeps serving the others, which
    receive every sample once per epoch."""
    first = trainers.start(new_session=True, stop_after=2)
    trainers.line(first)
    trainers.go.touch()
    a = trainers.line(first)
    assert a["started"] is True
    others = [trainers.start(), trainers.start(options={"batch_size": 3})]
    for p in others:
        trainers.line(p)  # ready
        trainers.line(p)  # attached
    assert trainers.line(first) == {"read": 2}
    os.killpg(first.pid, signal.SIGINT)
    try:
        first.wait(timeout=60)  # about 1 s here; a loaded machine is slower
    except subprocess.TimeoutExpired:
        first.send_signal(signal.SIGUSR1)  # its threads' tracebacks into the message
        time.sleep(1)
        first.kill()
        first.wait(timeout=30)
        raise AssertionError(f"the interrupted caller did not exit: {first.stderr.read()}")
    assert first.returncode != 0
    assert psutil.pid_exists(a["producer"]), "Ctrl-C to the first caller killed the producer"
    for p in others:
        r = trainers.result(p)
        for ids in r["epochs"]:
            assert sorted(ids) == list(range(SAMPLES))
    wait_gone(a["producer"], IDLE + 10)
    assert_nothing_left(rt, name)


# -- in this process ----------------------------------------------------------------------


class Failing(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        raise ValueError(f"boom: sample {i} is unreadable")


class Slow(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        time.sleep(30)
        return torch.tensor(i)


def test_loader_failing_on_first_batch_is_a_clear_error(rt, name):
    """The first caller gets the loader's error and the log's path, quickly; nothing runs
    or stays behind."""
    start = time.monotonic()
    with pytest.raises(TensorSocketError) as info:
        tensorsocket.share(DataLoader(Failing(), batch_size=4), name=name, timeout=30)
    assert time.monotonic() - start < 10
    msg = str(info.value)
    log = rt / f"{name}.producer.log"
    assert "ValueError: boom: sample 0 is unreadable" in msg and str(log) in msg, msg
    assert "Traceback" in log.read_text() and "boom" in log.read_text()
    assert not producer_alive(rt, name)
    assert_nothing_left(rt, name)
    # The name is free again: the next caller starts a producer of its own.
    c = tensorsocket.share(DataLoader(TensorDataset(torch.arange(4)), batch_size=2), name=name,
                           idle_timeout=IDLE)
    assert c.started_producer
    assert [b.tolist() for (b,) in c] == [[0, 1], [2, 3]]
    pid = c.producer_pid
    c.close()
    wait_gone(pid, IDLE + 10)
    assert_nothing_left(rt, name)


def test_slow_first_batch_times_out_and_stops_the_producer(rt, name):
    start = time.monotonic()
    with pytest.raises(ProducerNotFound, match=r"timeout=1(\.0)? s.*share\(\.\.\., timeout=\)"):
        tensorsocket.share(DataLoader(Slow(), batch_size=4), name=name, timeout=1)
    assert time.monotonic() - start < 10
    assert not producer_alive(rt, name)
    assert_nothing_left(rt, name)


def test_len_and_epochs_in_process(rt, name):
    """len() equals len(DataLoader); epochs=1 ends the producer once read (without
    waiting for idle_timeout), and asking for more names the knob and the log."""
    ds = TensorDataset(torch.arange(10))
    loader = DataLoader(ds, batch_size=4)
    c = tensorsocket.share(loader, name=name, epochs=1, idle_timeout=30)
    assert isinstance(c, TensorConsumer) and c.started_producer
    assert psutil.Process(c.producer_pid).name() == f"ts:{name}"[:15]  # as ps and top show it
    assert c.dataset is ds
    assert len(c) == len(loader) == 3
    assert [b.tolist() for (b,) in c] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with pytest.raises(ProducerFinished, match="epochs=.*producer.log"):
        next(iter(c))
    wait_gone(c.producer_pid, 10)
    c.close()
    assert_nothing_left(rt, name)


def test_second_caller_own_batch_size_in_process(rt, name):
    """A later caller attaches to the running producer; its batch size and drop_last
    come from its own DataLoader, and so does len()."""
    ds = TensorDataset(torch.arange(10))
    c = tensorsocket.share(DataLoader(ds, batch_size=4), name=name, idle_timeout=IDLE)
    own = DataLoader(ds, batch_size=3, drop_last=True)
    c2 = tensorsocket.share(own, name=name)
    assert not c2.started_producer and c2.producer_pid == c.producer_pid
    assert len(c2) == len(own) == 3
    c.close()  # c2 alone now (a late joiner: its epoch starts where it attached)
    for _ in range(2):
        batches = [b.tolist() for (b,) in c2]
        assert [len(b) for b in batches] == [3, 3, 3]
        ids = sum(batches, [])
        assert len(set(ids)) == 9
    c2.close()
    wait_gone(c.producer_pid, IDLE + 10)
    assert_nothing_left(rt, name)


def test_bad_arguments_name_the_knob(rt, name, monkeypatch):
    loader = DataLoader(TensorDataset(torch.arange(4)), batch_size=2)
    with pytest.raises(TypeError, match=r"producer_options=\{'max_lag'"):
        tensorsocket.share(loader, name=name, max_lag=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'batchsize'"):
        tensorsocket.share(loader, name=name, batchsize=4)
    with pytest.raises(TypeError, match="sets start_timeout= itself.*idle_timeout="):
        tensorsocket.share(loader, name=name, producer_options={"start_timeout": 3})
    with pytest.raises(TypeError, match="unknown TensorProducer option 'ringslots'"):
        tensorsocket.share(loader, name=name, producer_options={"ringslots": 3})
    with pytest.raises(TypeError, match="rendezvous is by name"):
        tensorsocket.share(loader, name=name, port=5555)
    with pytest.raises(TypeError, match="iterator.*epochs=1"):
        tensorsocket.share(iter([1, 2]), name=name)
    with pytest.raises(ValueError, match="idle_timeout"):
        tensorsocket.share(loader, name=name, idle_timeout=0)
    with pytest.raises(ValueError, match="epochs"):
        tensorsocket.share(loader, name=name, epochs=0)
    with pytest.raises(ValueError, match="cache_bytes"):
        tensorsocket.share(loader, name=name, cache_bytes=-1)
    with pytest.raises(ValueError, match=r"^min_consumers must be an int in 1\.\.64"):
        tensorsocket.share(loader, name=name, min_consumers=0)
    with monkeypatch.context() as m:
        m.setenv("TENSORSOCKET_MIN_CONSUMERS", "0")  # the producer's 0 means none for share()
        with pytest.raises(ValueError, match=r"^\$TENSORSOCKET_MIN_CONSUMERS must be an int"):
            tensorsocket.share(loader, name=name)
        m.setenv("TENSORSOCKET_MIN_CONSUMERS", "three")
        with pytest.raises(ValueError, match="TENSORSOCKET_MIN_CONSUMERS"):
            tensorsocket.share(loader, name=name)
    assert not producer_alive(rt, name)
    assert list(rt.iterdir()) == []


def test_cuda_initialised_is_refused(rt, name, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="call share\\(\\) before anything touches the GPU"):
        tensorsocket.share(DataLoader(TensorDataset(torch.arange(4))), name=name)
    assert list(rt.iterdir()) == []


def test_attaches_to_a_running_producer_without_starting_one(rt, name):
    """A live producer of the name (here a plain TensorProducer) is used as it is."""
    assert _core  # the C core is loaded
    import threading

    producer = tensorsocket.TensorProducer(
        DataLoader(TensorDataset(torch.arange(6)), batch_size=2), name=name)
    t = threading.Thread(target=lambda: [None for _ in producer], daemon=True)
    t.start()
    c = tensorsocket.share(DataLoader(TensorDataset(torch.arange(6)), batch_size=2), name=name)
    assert not c.started_producer and c.producer_pid == os.getpid()
    assert [b.tolist() for (b,) in c] == [[0, 1], [2, 3], [4, 5]]
    t.join(10)
    c.close()
    producer.join()
    assert_nothing_left(rt, name)


def test_a_producer_named_x_share_and_share_of_x_run_at_once(rt, name):
    """share(name=x)'s election lock is no producer's name lock: a producer named
    "x.share" held x.share.lock for its whole life, and share(name=x) waited for that lock
    until its timeout. Both run now, each with its own files."""
    import threading

    other = tensorsocket.TensorProducer([torch.full((2,), float(i)) for i in range(3)],
                                        name=f"{name}.share", start_timeout=30)
    t = threading.Thread(target=lambda: [None for _ in other], daemon=True)
    t.start()
    try:
        c = tensorsocket.share(DataLoader(TensorDataset(torch.arange(6)), batch_size=2),
                               name=name, epochs=1, timeout=10)
        assert c.started_producer and c.producer_pid != os.getpid()
        with TensorConsumer(name=f"{name}.share", timeout=10) as reader:
            assert [int(b[0]) for b in reader] == [0, 1, 2]
        assert [b.tolist() for (b,) in c] == [[0, 1], [2, 3], [4, 5]]
        c.close()
    finally:
        t.join(10)
        other.close()
    wait_gone(c.producer_pid, 10)
    assert_nothing_left(rt, name)


def test_stale_producer_serving_other_data_is_refused(rt, name):
    """A producer left idling by an earlier run (another dataset length or type) is not
    silently used: share() names what differs, the pid and the way out."""
    first = tensorsocket.share(DataLoader(TensorDataset(torch.arange(12)), batch_size=4),
                               name=name, idle_timeout=30)
    pid = first.producer_pid
    first.close()  # the run ended; its producer idles
    other_len = DataLoader(TensorDataset(torch.arange(20)), batch_size=4)
    with pytest.raises(TensorSocketError, match=rf"pid {pid}\) serves other data.*has 12 "
                                                rf"samples, this script's 20.*kill {pid}"):
        tensorsocket.share(other_len, name=name)

    class Other(Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return torch.tensor(i)

    with pytest.raises(TensorSocketError, match="reads a torch.utils.data.dataset.TensorDataset"
                                                ", this script's loader a .*Other"):
        tensorsocket.share(DataLoader(Other(), batch_size=4), name=name)
    # The same data with another batch size is fine: the consumer re-batches.
    again = tensorsocket.share(DataLoader(TensorDataset(torch.arange(12)), batch_size=6),
                               name=name)
    assert not again.started_producer and again.producer_pid == pid
    assert [len(b) for (b,) in again] == [6, 6]
    again.close()
    os.kill(pid, signal.SIGTERM)
    wait_gone(pid, 10)


@pytest.mark.parametrize("rank_of_a_group", [True, False])
def test_a_rank_maps_its_delivery_before_it_says_ready(procs, name, monkeypatch,
                                                       rank_of_a_group):
    """A consumer that share() makes for a rank of a group (SharedLoader.before_ready)
    decides where tensors are delivered before it lets go of the election lock and says
    ready: its group starts at one entry once every rank is ready, so the rank must not
    create a CUDA context or page-lock the ring while it already counts as reading (and
    sends no heartbeats yet). A lone consumer says ready first, as always."""
    from tensorsocket.consumer.options import SharedLoader
    from tensorsocket.control.client import ControlClient
    from tensorsocket.data.delivery import Delivery

    calls: list[str] = []
    attach, ready = Delivery.attach, ControlClient.ready

    def recording_attach(self, *args, **kwargs):
        calls.append("attach")
        return attach(self, *args, **kwargs)

    def recording_ready(self, *args, **kwargs):
        calls.append("ready")
        return ready(self, *args, **kwargs)

    monkeypatch.setattr(Delivery, "attach", recording_attach)
    monkeypatch.setattr(ControlClient, "ready", recording_ready)
    prod = procs.start("producer", "--name", name, "--batches", "3")
    procs.wait_ready(prod)
    before = (lambda: calls.append("before")) if rank_of_a_group else None
    with TensorConsumer(name=name, timeout=30, shared=SharedLoader(
            None, False, False, None, before_ready=before)) as c:
        assert calls == (["attach", "before", "ready"] if rank_of_a_group
                         else ["ready", "attach"])
        assert sum(1 for _ in c) == 3
    procs.result(prod)
