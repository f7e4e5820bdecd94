"""When the producer's GPU memory is freed (docs/gpu.md), on the CUDA driver double.

The driver says: "Calling cuMemFree on an exported memory region before calling
cuIpcCloseMemHandle in the importing context will result in undefined behavior"
(cuIpcOpenMemHandle). The double logs such a free ("freed_while_imported importer=<pid>
how=free", or how=exit where the exporting process exits), and an importer's stream work
on memory whose exporter freed it or is gone ("use_after_free"), so that what a real GPU
would do silently shows here.

Each test orders its processes with FIFOs and the processes' own JSON lines: the consumer
takes its first batch (it maps the pool), says so and idles; the producer closes with
release_timeout=0.2 only once told, so the consumer is idle past release_timeout every
time; the test then lets the consumer go on, kills it, or lets the producer exit.
"""

from __future__ import annotations

import os
import signal

import fakecuda
from test_gpu import fake_lib, gpu_env  # noqa: F401  (fixtures)

SLOTS = 4
BATCHES = 3  # with the epoch's end marker, the ring's 4 slots hold them all

# A producer of BATCHES batches on the double's cuda:0 that closes (release_timeout=0.2)
# when the test writes to its FIFO, then says how many rings its keeper holds. "stay":
# it then waits for the keeper to free the pool and says so; "exit": it exits at once.
PRODUCER = """
import os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from roles import CountingLoader
from tensorsocket import TensorProducer
from tensorsocket.producer.gpu_release import POOL_KEEPER as keeper
from tools.harness import emit
name, after, fifo = sys.argv[1:4]
fd = os.open(fifo, os.O_RDWR)

def shm_use():  # this process's fds and mappings of /dev/shm objects
    fds = set()
    for n in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{n}").startswith("/dev/shm/"):
                fds.add(n)
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = {line.split(None, 5)[-1].strip() for line in f if "/dev/shm/" in line}
    return fds, maps

before = shm_use()
p = TensorProducer(CountingLoader(%d, "tuple"), name=name, ring_slots=%d, min_consumers=1,
                   device="cuda:0", device_fallback=False, release_timeout=0.2)
emit({"ready": True, "pid": os.getpid()})
for _ in p:
    pass
os.read(fd, 1)  # the consumer maps the pool and idles
p.close()
emit({"closed": True, "kept": keeper.kept()})
if after == "stay":
    thread = keeper._thread
    if thread is not None:
        thread.join(120)
    fds, maps = shm_use()
    emit({"kept_after": keeper.kept(),
          "keeper_alive": thread is not None and thread.is_alive(),
          "new_fds": sorted(fds - before[0]), "new_maps": sorted(maps - before[1])})
""" % (BATCHES, SLOTS)

# A consumer on the double (tests/roles.py FakeGpu: each batch is read back, and a slow
# checksum "kernel" is queued on it) that takes the first batch, says so, idles until the
# test writes to its FIFO, then reads on to the end and closes.
CONSUMER = """
import os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import tensorsocket.data.delivery
from roles import FakeGpu
from tensorsocket import TensorConsumer
from tools.harness import emit
name, fifo = sys.argv[1:3]
fd = os.open(fifo, os.O_RDWR)
gpu = FakeGpu(100)
tensorsocket.data.delivery._device_tensor = gpu.tensor
tensorsocket.data.delivery._device_tensors = gpu.tensors
c = TensorConsumer(name=name, timeout=60, batch_timeout=60)
it = iter(c)
x, _ = next(it)
values = [int(x[0, 0])]
del x
emit({"took": values[0], "pid": os.getpid()})
os.read(fd, 1)
outcome = "end"
try:
    for x, _ in it:
        values.append(int(x[0, 0]))
except Exception as e:
    outcome = f"{type(e).__name__}: {e}"
c.close()
emit({"values": values, "outcome": outcome, **gpu.check()})
"""


def _fifo(short_tmp, name: str) -> str:
    path = os.path.join(short_tmp, name)
    os.mkfifo(path)
    return path


def _poke(fifo: str) -> None:
    """Wake the process blocked reading fifo (it holds it open read-write)."""
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)


def _start(procs, name, gpu_env, short_tmp, after: str):
    """Producer and consumer, the consumer holding the pool mapped and idle, the producer
    closed past its release_timeout; returns (producer, its pid, consumer, consumer fifo,
    the producer's 'closed' line)."""
    pfifo, cfifo = _fifo(short_tmp, "p"), _fifo(short_tmp, "c")
    # Not forked from the test's fork server: a forked child ends with os._exit, which
    # skips the double's destructor (the exit of a process that frees its memory).
    prod = procs.script(PRODUCER, name, after, pfifo, env=gpu_env, fork=False)
    ppid = procs.wait_ready(prod)["pid"]
    cons = procs.script(CONSUMER, name, cfifo, env=gpu_env)
    assert procs.wait_ready(cons)["took"] == 0
    _poke(pfifo)
    closed = prod.read_json()
    return prod, ppid, cons, cfifo, closed


def _log(gpu_env):
    return fakecuda.parse_log(gpu_env["FAKECUDA_LOG"])


def test_idle_consumer_keeps_the_pool_past_release_timeout(procs, name, gpu_env, short_tmp):
    """A consumer idle past release_timeout while the producer closes: the pool is kept
    (nothing freed under its mapping), the consumer then reads the batches still published
    and the normal end, and once it closes the keeper frees the pool: every allocation
    freed, after the consumer's last cuIpcCloseMemHandle, nothing left in /dev/shm."""
    prod, ppid, cons, cfifo, closed = _start(procs, name, gpu_env, short_tmp, "stay")
    log = _log(gpu_env)
    assert [str(line) for line in log if line.op == "freed_while_imported"] == []
    assert fakecuda.select(log, "free", pid=ppid) == []  # nothing freed while the consumer maps it
    assert closed["kept"] == 1, closed
    _poke(cfifo)
    c = procs.result(cons)
    assert c["outcome"] == "end" and c["values"] == list(range(BATCHES)), c
    assert c["kernel_mismatches"] == 0, c
    p = procs.result(prod)
    assert p == {"kept_after": 0, "keeper_alive": False, "new_fds": [], "new_maps": []}, p
    log = _log(gpu_env)
    assert [str(line) for line in log
            if line.op in ("freed_while_imported", "use_after_free")] == []
    frees = [i for i, line in enumerate(log) if line.pid == ppid and line.op == "free"]
    allocs = [line for line in log if line.pid == ppid and line.op == "alloc"]
    closes = [i for i, line in enumerate(log)
              if line.pid == c_pid(log, ppid) and line.op == "ipc_close_mem"]
    assert len(frees) == len(allocs) == SLOTS and len(closes) == SLOTS
    assert max(closes) < min(frees)


def c_pid(log, ppid: int) -> int:
    """The consumer's pid: the one process of the log that opened the pool."""
    pids = {line.pid for line in log if line.op == "ipc_open_mem"} - {ppid}
    assert len(pids) == 1, pids
    return pids.pop()


def test_killed_consumer_lets_the_keeper_free_the_pool(procs, name, gpu_env, short_tmp):
    """A consumer SIGKILLed while it maps the pool of a closed producer: the keeper frees
    the pool once its death is noticed, and nothing was freed while it lived."""
    prod, ppid, cons, _, closed = _start(procs, name, gpu_env, short_tmp, "stay")
    log = _log(gpu_env)
    assert [str(line) for line in log if line.op == "freed_while_imported"] == []
    assert fakecuda.select(log, "free", pid=ppid) == []
    assert closed["kept"] == 1, closed
    cons.kill()
    cons.communicate(timeout=30)
    p = procs.result(prod)
    assert p == {"kept_after": 0, "keeper_alive": False, "new_fds": [], "new_maps": []}, p
    log = _log(gpu_env)
    assert [str(line) for line in log if line.op == "freed_while_imported"] == []
    assert len(fakecuda.select(log, "free", pid=ppid)) == SLOTS
    fakecuda.cleanup_shm(cons.pid)  # a killed process cannot free its events


def test_producer_exit_fails_the_consumers_next_batch(procs, name, gpu_env, short_tmp):
    """The producer process exits while a consumer maps its pool, batches still published
    for it: its next next() raises ProducerGone saying the memory went with the producer,
    at once, and it never queues work on the memory of the gone process."""
    prod, ppid, cons, cfifo, closed = _start(procs, name, gpu_env, short_tmp, "exit")
    prod.communicate(timeout=60)  # exited (and reaped): its device memory is gone
    assert prod.returncode == 0
    _poke(cfifo)
    c = procs.result(cons, timeout=60)
    assert c["values"] == [0], c
    # ProducerFailed, a ProducerGone, with the ring's words
    assert c["outcome"].startswith("ProducerFailed: ") and \
        f"(pid {ppid}) exited while this consumer mapped its GPU memory" in c["outcome"], \
        c["outcome"]
    log = _log(gpu_env)
    assert [str(line) for line in log if line.op == "use_after_free"] == []
    # The exit took the memory, not a cuMemFree of the producer's while it was mapped.
    assert [line.get("how") for line in log if line.op == "freed_while_imported"] == \
        ["exit"] * SLOTS
    assert fakecuda.select(log, "free", pid=ppid) == []
    assert closed["kept"] == 1, closed


def test_sigterm_while_kept_fails_the_consumers_next_batch(procs, name, gpu_env, short_tmp):
    """SIGTERM ends the producer (its default action, with the files removed) while the
    keeper holds the pool: the consumer's next batch raises ProducerGone too."""
    prod, ppid, cons, cfifo, closed = _start(procs, name, gpu_env, short_tmp, "stay")
    try:
        os.kill(ppid, signal.SIGTERM)  # it waits for its keeper (if it has one)
    except ProcessLookupError:
        pass
    prod.communicate(timeout=30)
    _poke(cfifo)
    c = procs.result(cons, timeout=60)
    fakecuda.cleanup_shm(ppid)  # a process killed by a signal cannot free its memory
    assert c["values"] == [0] and "exited while this consumer mapped its GPU memory" in \
        c["outcome"], c
    log = _log(gpu_env)
    assert [str(line) for line in log if line.op == "use_after_free"] == []
    assert [str(line) for line in log if line.op == "freed_while_imported"] == []
    assert closed["kept"] == 1, closed
