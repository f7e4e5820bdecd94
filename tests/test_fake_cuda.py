"""Tests of the CUDA driver test double itself (csrc/tests/fake_cuda.c).

Every scenario runs in real child processes (tests/fakecuda.py ``Agent``s) that load
libfakecuda.so with ctypes, so cross-process IPC, per-thread contexts and stream ordering
are exercised as the core will exercise them. Checks read the results of the calls and
the shared FAKECUDA_LOG file (one line per call, single write() per line).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

import fakecuda
from fakecuda import (
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
    CUDA_ERROR_ILLEGAL_STATE,
    CUDA_ERROR_INVALID_CONTEXT,
    CUDA_ERROR_INVALID_DEVICE,
    CUDA_ERROR_INVALID_HANDLE,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_MAP_FAILED,
    CUDA_ERROR_NO_DEVICE,
    CUDA_ERROR_NOT_INITIALIZED,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
    CudaError,
    fnv1a,
    parse_log,
    select,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> Path:
    try:
        return fakecuda.build(tmp_path_factory.mktemp("fakecuda"))
    except fakecuda.NoCompiler as e:
        pytest.skip(str(e))


@pytest.fixture
def log(tmp_path) -> Path:
    return tmp_path / "fakecuda.log"


@pytest.fixture
def agent(lib, log):
    """start(setup=True, **env): a child process with the double loaded as ``fc`` (and,
    with setup, cuInit + device 0's primary context pushed). At teardown every child exits
    and must leave no shm object behind."""
    started: list[fakecuda.Agent] = []

    def start(setup: bool = True, device: int = 0, **env: str) -> fakecuda.Agent:
        a = fakecuda.Agent(lib, env={"FAKECUDA_LOG": str(log), **env})
        started.append(a)
        if setup:
            a(f"ctx = fc.setup({device})")
        return a

    yield start
    for a in started:
        a.close()
    leaked = [name for a in started for name in fakecuda.cleanup_shm(a.pid)]
    assert leaked == [], f"shm objects left behind: {leaked}"


def shm_exists(name: str) -> bool:
    return os.path.exists("/dev/shm" + name)


# ---- library -----------------------------------------------------------------------------


def test_exports_exactly_the_driver_functions(lib, agent):
    a = agent(setup=False)
    names = list(fakecuda.DRIVER_FUNCTIONS + fakecuda.TEST_FUNCTIONS)
    assert a(f"[n for n in {names!r} if not hasattr(fc.lib, n)]") == []
    if shutil.which("nm") is None:
        return
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True,
                         text=True, check=True).stdout
    functions = {m.group(1) for m in re.finditer(r" T (\w+)$", out, re.MULTILINE)}
    assert functions == set(names)


def test_error_names_and_strings(agent):
    a = agent(setup=False)
    for rc, name in fakecuda.ERROR_NAMES.items():
        assert a(f"fc.error_name({rc})") == name
        assert a(f"fc.error_string({rc})")
    assert a("fc.error_string(201)") == "invalid device context"
    # Unknown code: CUDA_ERROR_INVALID_VALUE and the output set to NULL.
    a("s = ctypes.c_char_p(b'x')")
    assert a("fc.call('cuGetErrorName', 12345, ctypes.byref(s)), s.value") == \
        [CUDA_ERROR_INVALID_VALUE, None]
    a("s = ctypes.c_char_p(b'x')")
    assert a("fc.call('cuGetErrorString', 12345, ctypes.byref(s)), s.value") == \
        [CUDA_ERROR_INVALID_VALUE, None]


# ---- init and devices ----------------------------------------------------------------------


def test_calls_before_cuinit_fail_and_fail_init(agent):
    a = agent(setup=False)
    assert a("fc.driver_version()") == 12080  # allowed before cuInit, as in the driver
    assert a.rc("fc.device_count()") == CUDA_ERROR_NOT_INITIALIZED
    assert a.rc("fc.mem_alloc(16)") == CUDA_ERROR_NOT_INITIALIZED
    b = agent(setup=False, FAKECUDA_FAIL_INIT="1")
    assert b.rc("fc.init()") == CUDA_ERROR_NO_DEVICE
    assert b.rc("fc.device_count()") == CUDA_ERROR_NOT_INITIALIZED
    c = agent(setup=False, FAKECUDA_VISIBLE="")
    assert c.rc("fc.init()") == CUDA_ERROR_NO_DEVICE


def test_devices_visibility_uuids_and_attributes(agent):
    a = agent(setup=False, FAKECUDA_DEVICES="3", FAKECUDA_VISIBLE="2,0")
    b = agent(setup=False, FAKECUDA_DEVICES="3")
    a("fc.init()")
    b("fc.init()")
    assert a("fc.device_count()") == 2
    assert b("fc.device_count()") == 3
    assert a("fc.device_uuid(0)") == b"fakecuda-phys-02" == b("fc.device_uuid(2)")
    assert a("fc.device_uuid(1)") == b("fc.device_uuid(0)")
    assert a("fc.device_name(0)") == "Fake CUDA Device 2"
    assert a("fc.device_get(1)") == 1
    assert a.rc("fc.device_get(2)") == CUDA_ERROR_INVALID_DEVICE
    assert a.rc("fc.device_uuid(-1)") == CUDA_ERROR_INVALID_DEVICE
    assert a.rc("fc.device_attribute(41, 5)") == CUDA_ERROR_INVALID_DEVICE
    assert a("[fc.device_attribute(x, 1) for x in (41, 125, 7)]") == [1, 1, 0]
    c = agent(FAKECUDA_NO_IPC_EVENTS="1")
    assert c("fc.device_attribute(125, 0)") == 0


# ---- contexts ------------------------------------------------------------------------------


def test_every_thread_needs_a_current_context(agent, log):
    a = agent(setup=False)
    a("fc.init()")
    assert a.rc("fc.mem_alloc(16)") == CUDA_ERROR_INVALID_CONTEXT
    a("ctx = fc.primary_ctx_retain(0); fc.ctx_push(ctx); p = fc.mem_alloc(64)")
    # A new thread has an empty context stack, whatever the main thread pushed ...
    assert a("fakecuda.in_thread(lambda: fc.mem_free(p))") == CUDA_ERROR_INVALID_CONTEXT
    assert a("fakecuda.in_thread(lambda: fc.stream_synchronize(0))") == \
        CUDA_ERROR_INVALID_CONTEXT
    assert a("fakecuda.in_thread(lambda: fc.event_create())") == CUDA_ERROR_INVALID_CONTEXT
    # ... and works once it pushes the primary context.
    assert a("fakecuda.in_thread(lambda: (fc.ctx_push(ctx), fc.mem_free(p), fc.ctx_pop())[2])") \
        == a("ctx")
    assert a("fc.ctx_pop() == ctx") is True
    assert a.rc("fc.ctx_pop()") == CUDA_ERROR_INVALID_CONTEXT
    assert a.rc("fc.ctx_push(12345)") == CUDA_ERROR_INVALID_CONTEXT
    # Reference counted: usable while retained, not after the last release.
    a("fc.primary_ctx_retain(0); fc.primary_ctx_release(0); fc.ctx_push(ctx)")
    assert a.rc("fc.mem_free(fc.mem_alloc(8))") == 0
    a("fc.primary_ctx_release(0)")
    assert a.rc("fc.mem_alloc(8)") == CUDA_ERROR_INVALID_CONTEXT
    assert a.rc("fc.primary_ctx_release(0)") == CUDA_ERROR_INVALID_CONTEXT
    lines = parse_log(log)
    assert [ln["refs"] for ln in select(lines, "ctx_retain")] == ["1", "2"]
    assert select(lines, "fail", why="current_context_released")


# ---- device memory -------------------------------------------------------------------------


def test_alloc_is_a_shm_object_freed_by_cumemfree(agent, log):
    a = agent(FAKECUDA_MEM_LIMIT="12288")
    p = a("p = fc.mem_alloc(4096); p")
    (line,) = select(parse_log(log), "alloc")
    name = line["name"]
    assert line.num("ptr") == p and line["bytes"] == "4096" and line["dev"] == "0"
    assert re.fullmatch(rf"/fakecuda-{a.pid}-\d+", name)
    st = os.stat("/dev/shm" + name)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 4096
    assert a.rc("fc.mem_free(p + 8)") == CUDA_ERROR_INVALID_VALUE
    assert a.rc("fc.mem_alloc(0)") == CUDA_ERROR_INVALID_VALUE
    # FAKECUDA_MEM_LIMIT is the process total.
    assert a.rc("fc.mem_alloc(8193)") == CUDA_ERROR_OUT_OF_MEMORY
    a("q = fc.mem_alloc(8192)")
    assert a.rc("fc.mem_alloc(1)") == CUDA_ERROR_OUT_OF_MEMORY
    a("fc.mem_free(p)")
    assert not shm_exists(name)
    assert a.rc("fc.mem_free(p)") == CUDA_ERROR_INVALID_VALUE
    a("fc.mem_free(fc.mem_alloc(4096)); fc.mem_free(q)")
    assert fakecuda.shm_objects(a.pid) == []
    assert a("fc.counter('alloc'), fc.counter('free'), fc.counter('nonsense')") == [3, 3, -1]


# ---- IPC memory ----------------------------------------------------------------------------


def test_ipc_mem_handle_opens_only_in_another_process(agent, log):
    exp, imp = agent(), agent()
    data = bytes(range(256)) * 16
    h = exp(f"p = fc.mem_alloc(4096); fc.write(p, {data!r}); fc.ipc_get_mem_handle(p)")
    assert len(h) == 64
    assert exp("fc.ipc_get_mem_handle(p)") == h  # deterministic, like the driver's
    assert exp.rc("fc.ipc_open_mem_handle(fc.ipc_get_mem_handle(p))") == \
        CUDA_ERROR_INVALID_CONTEXT
    q = imp(f"q = fc.ipc_open_mem_handle({h!r}); q")
    assert imp("fc.read(q, 4096)") == data
    assert imp(f"fc.ipc_open_mem_handle({h!r})") == q  # same pointer, one more open
    # The mapping is shared both ways, and a stream of the importer reads it.
    imp("fc.write(q, b'importer'); s = fc.stream_create(); r = fc.launch_read(s, q, 4096)")
    assert exp("fc.read(p, 8)") == b"importer"
    imp("fc.stream_synchronize(s)")
    assert imp("r.value") == fnv1a(b"importer" + data[8:])
    imp("fc.ipc_close_mem_handle(q); fc.ipc_close_mem_handle(q)")
    assert imp.rc("fc.ipc_close_mem_handle(q)") == CUDA_ERROR_INVALID_VALUE
    lines = parse_log(log)
    (alloc,) = select(lines, "alloc", exp.pid)
    opens = select(lines, "ipc_open_mem", imp.pid)
    assert [ln["cached"] for ln in opens] == ["0", "1"]
    assert {ln["name"] for ln in opens} == {alloc["name"]}
    (read,) = select(lines, "exec_read", imp.pid)
    assert read["name"] == alloc["name"] and int(read["sum"], 16) == fnv1a(
        b"importer" + data[8:])
    assert [ln["opens"] for ln in select(lines, "ipc_close_mem")] == ["1", "0"]


def test_ipc_mem_handle_rules(agent, log):
    exp = agent(FAKECUDA_DEVICES="2", device=1)
    h = exp("p = fc.mem_alloc(8192); fc.ipc_get_mem_handle(p)")
    assert exp.rc("fc.ipc_get_mem_handle(p + 4096)") == CUDA_ERROR_INVALID_VALUE
    imp = agent(FAKECUDA_DEVICES="2")  # device 0: another physical device
    assert imp.rc("fc.ipc_open_mem_handle(b'garbage' * 9)") == CUDA_ERROR_INVALID_VALUE
    # Flags 0 is refused, as a real driver does (H100, driver 580), on any device.
    assert imp.rc(f"fc.ipc_open_mem_handle({h!r}, 0)") == CUDA_ERROR_INVALID_VALUE
    imp(f"q = fc.ipc_open_mem_handle({h!r}, fakecuda.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)")
    # Visible ordinal 0 is physical device 1 here: the same device, not a peer.
    remapped = agent(FAKECUDA_DEVICES="2", FAKECUDA_VISIBLE="1,0")
    assert remapped.rc(f"fc.ipc_open_mem_handle({h!r}, 0)") == CUDA_ERROR_INVALID_VALUE
    remapped(f"fc.ipc_open_mem_handle({h!r})")
    opens = select(parse_log(log), "ipc_open_mem")
    assert [(ln.pid, ln["peer"]) for ln in opens] == [(imp.pid, "1"), (remapped.pid, "0")]
    # Freed by the exporter: the name is gone, new opens fail; the open mapping stays valid.
    exp("fc.mem_free(p)")
    assert remapped.rc(f"fc.ipc_open_mem_handle({h!r}, 1)") == 0  # cached in this process
    third = agent(FAKECUDA_DEVICES="2", device=1)
    assert third.rc(f"fc.ipc_open_mem_handle({h!r})") == CUDA_ERROR_MAP_FAILED
    assert imp("fc.read(q, 4)") == b"\0\0\0\0"
    mig = agent(FAKECUDA_MIG="1")
    assert mig.rc("fc.ipc_get_mem_handle(fc.mem_alloc(16))") == CUDA_ERROR_NOT_SUPPORTED


def test_exporter_exit_and_kill(agent):
    imp = agent()
    clean = agent()
    h = clean("fc.ipc_get_mem_handle(fc.mem_alloc(64))")
    clean.close()  # a clean exit unlinks what the process still owned, as a GPU frees it
    assert imp.rc(f"fc.ipc_open_mem_handle({h!r})") == CUDA_ERROR_MAP_FAILED
    killed = agent()
    h = killed("p = fc.mem_alloc(64); fc.write(p, b'alive'); fc.ipc_get_mem_handle(p)")
    killed.kill()
    assert imp(f"fc.read(fc.ipc_open_mem_handle({h!r}), 5)") == b"alive"  # left in /dev/shm
    assert fakecuda.cleanup_shm(killed.pid) != []
    imp2 = agent()
    assert imp2.rc(f"fc.ipc_open_mem_handle({h!r})") == CUDA_ERROR_MAP_FAILED


# ---- host registration and copies ----------------------------------------------------------


def test_pageable_copy_is_staged_registered_copy_reads_at_execution(agent, log):
    a = agent(FAKECUDA_OP_DELAY_US="100000")
    a("n = 8192; dev = fc.mem_alloc(n); s = fc.stream_create(); host = fakecuda.host_mmap(n, 1)")
    # Pageable: the bytes are taken when the call returns; later stores do not matter.
    assert a("fc.memcpy_htod_async(dev, host, n, s); ctypes.memset(host, 2, n);"
             "fc.read(dev, 4)") == b"\0\0\0\0"  # not executed yet
    a("fc.stream_synchronize(s)")
    assert a("fc.read(dev, n)") == b"\1" * 8192
    # Registered: read when the stream gets there, so the later store is what arrives.
    a("fc.mem_host_register(host, n, 0); ctypes.memset(host, 3, n)")
    a("fc.memcpy_htod_async(dev, host + 4096, 4096, s); ctypes.memset(host, 4, n)")
    a("fc.stream_synchronize(s)")
    assert a("fc.read(dev, n)") == b"\4" * 4096 + b"\1" * 4096
    htods = select(parse_log(log), "htod")
    assert [ln["pinned"] for ln in htods] == ["0", "1"]
    assert a.rc("fc.memcpy_htod_async(host, host, 16, s)") == CUDA_ERROR_INVALID_VALUE
    assert a.rc("fc.memcpy_htod_async(dev + 1, host, n, s)") == CUDA_ERROR_INVALID_VALUE
    assert a.rc("fc.memcpy_htod_async(dev, host, 16, 0xdead)") == CUDA_ERROR_INVALID_HANDLE
    # Device to device: both ends must be device memory; copied when executed.
    assert a("d2 = fc.mem_alloc(n); fc.memcpy_dtod_async(d2, dev, n, s); fc.read(d2, 4)") == \
        b"\0\0\0\0"
    a("fc.stream_synchronize(s)")
    assert a("fc.read(d2, n) == fc.read(dev, n)") is True
    assert a.rc("fc.memcpy_dtod_async(d2, host, 16, s)") == CUDA_ERROR_INVALID_VALUE
    a("fc.mem_host_unregister(host); fc.stream_destroy(s); fc.mem_free(dev); fc.mem_free(d2)")


def test_host_register_rules(agent):
    a = agent()
    a("n = 16384; rw = fakecuda.host_mmap(n); ro = fakecuda.host_mmap(n)")
    a("fakecuda.host_protect(ro, n, False)")
    assert a.rc("fc.mem_host_register(ro, n, 0)") == CUDA_ERROR_INVALID_VALUE
    # Read-only pages need CU_MEMHOSTREGISTER_READ_ONLY, even when only one page is.
    a("fakecuda.host_protect(rw + 8192, 4096, False)")
    assert a.rc("fc.mem_host_register(rw, n, 0)") == CUDA_ERROR_INVALID_VALUE
    a("fc.mem_host_register(rw, n, fakecuda.CU_MEMHOSTREGISTER_READ_ONLY)")
    a("fc.mem_host_unregister(rw); fakecuda.host_protect(rw, n, True)")
    a("fc.mem_host_register(ro, n, fakecuda.CU_MEMHOSTREGISTER_READ_ONLY)")
    a("fc.mem_host_register(rw, 4096, 0)")
    assert a.rc("fc.mem_host_register(rw + 100, 10, 0)") == \
        CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
    a("fc.mem_host_register(rw + 4096, 4096, 0)")  # adjacent is fine
    assert a.rc("fc.mem_host_unregister(rw + 1)") == CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
    a("fc.mem_host_unregister(rw); fc.mem_host_unregister(rw + 4096); fc.mem_host_unregister(ro)")
    assert a.rc("fc.mem_host_unregister(rw)") == CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
    a("fakecuda.host_munmap(ro, n)")
    assert a.rc("fc.mem_host_register(ro, n, 0)") == CUDA_ERROR_INVALID_VALUE  # unmapped


# ---- streams and events --------------------------------------------------------------------


def test_streams_run_in_order_and_synchronize(agent, log):
    a = agent(FAKECUDA_OP_DELAY_US="30000")
    a("dev = fc.mem_alloc(64); s = fc.stream_create(); ev = fc.event_create()")
    a("for i in range(5): fc.memcpy_htod_async(dev, bytes([i + 1]) * 64, 64, s)")
    assert a("fc.event_record(ev, s); fc.event_query(ev), fc.read(dev, 1)") == [False, b"\0"]
    a("fc.ctx_synchronize()")
    assert a("fc.event_query(ev)") is True
    assert a("fc.read(dev, 64)") == b"\5" * 64
    # The legacy, per-thread and NULL handles are one default stream.
    a("fc.memcpy_htod_async(dev, b'\\7' * 64, 64, 1); fc.event_record(ev, 2)")
    a("fc.stream_synchronize(0)")
    assert a("fc.read(dev, 1), fc.event_query(ev)") == [b"\7", True]
    # Destroy runs what is queued, then the handle is gone.
    a("fc.memcpy_htod_async(dev, b'\\x09' * 64, 64, s); fc.stream_destroy(s)")
    assert a("fc.read(dev, 1)") == b"\x09"
    assert a.rc("fc.stream_synchronize(s)") == CUDA_ERROR_INVALID_HANDLE
    assert a.rc("fc.stream_destroy(s)") == CUDA_ERROR_INVALID_HANDLE
    assert a.rc("fc.stream_destroy(0)") == CUDA_ERROR_INVALID_HANDLE
    a("fc.event_destroy(ev); fc.mem_free(dev)")
    lines = parse_log(log)
    assert [ln["name"] for ln in select(lines, "exec_htod")] == \
        [select(lines, "alloc")[0]["name"]] * 7
    assert {ln["stream"] for ln in select(lines, "htod")} == {f"{a.pid}-1", "default"}
    records = select(lines, "event_record")
    assert [(ln["stream"], ln["gen"]) for ln in records] == [(f"{a.pid}-1", "1"),
                                                             ("default", "2")]


def test_event_rules(agent):
    a = agent()
    assert a.rc("fc.event_create(fakecuda.CU_EVENT_INTERPROCESS)") == CUDA_ERROR_INVALID_VALUE
    assert a.rc("fc.event_create(0x10)") == CUDA_ERROR_INVALID_VALUE
    a("ev = fc.event_create(); s = fc.stream_create()")
    assert a("fc.event_query(ev)") is True  # never recorded: complete, as in the driver
    a("fc.event_synchronize(ev)")
    assert a.rc("fc.stream_wait_event(s, ev)") == CUDA_ERROR_ILLEGAL_STATE
    a("fc.event_record(ev, s)")
    assert a.rc("fc.stream_wait_event(s, ev, 1)") == CUDA_ERROR_INVALID_VALUE
    a("fc.stream_wait_event(s, ev); fc.stream_wait_event(0, ev)")
    assert a.rc("fc.ipc_get_event_handle(ev)") == CUDA_ERROR_INVALID_VALUE
    assert a.rc("fc.event_record(0xdead, s)") == CUDA_ERROR_INVALID_HANDLE
    assert a.rc("fc.event_query(0xdead)") == CUDA_ERROR_INVALID_HANDLE
    a("iev = fc.event_create(fakecuda.IPC_EVENT_FLAGS); eh = fc.ipc_get_event_handle(iev)")
    assert a.rc("fc.ipc_open_event_handle(eh)") == CUDA_ERROR_INVALID_CONTEXT
    assert a.rc("fc.ipc_open_event_handle(b'x' * 64)") == CUDA_ERROR_INVALID_VALUE
    name = a("[n for n in fakecuda.shm_objects(pid) if '-ev-' in n][0]")
    a("fc.event_destroy(iev)")
    assert not shm_exists("/" + name)  # the owner's destroy unlinks the shared state
    a("fc.stream_synchronize(s); fc.stream_destroy(s); fc.event_destroy(ev)")
    assert a.rc("fc.event_destroy(ev)") == CUDA_ERROR_INVALID_HANDLE
    # An event recorded on a stream of another device: CUDA_ERROR_INVALID_HANDLE.
    b = agent(FAKECUDA_DEVICES="2")
    b("ev = fc.event_create(); fc.ctx_push(fc.primary_ctx_retain(1)); s1 = fc.stream_create()")
    assert b.rc("fc.event_record(ev, s1)") == CUDA_ERROR_INVALID_HANDLE


def test_stream_waits_for_work_recorded_by_another_process(agent, log):
    """Producer: slow copy into exported memory, then record an interprocess event.
    Consumer: its stream waits on the event, then reads: it sees the producer's bytes."""
    prod = agent(FAKECUDA_OP_DELAY_US="300000")
    cons = agent()
    data = b"batch-0 " * 512
    h, eh = prod("p = fc.mem_alloc(4096); ev = fc.event_create(fakecuda.IPC_EVENT_FLAGS);"
                 "s = fc.stream_create(); fc.ipc_get_mem_handle(p), fc.ipc_get_event_handle(ev)")
    cons(f"q = fc.ipc_open_mem_handle({h!r}); e = fc.ipc_open_event_handle({eh!r});"
         "s = fc.stream_create()")
    assert cons.rc("fc.stream_wait_event(s, e)") == CUDA_ERROR_ILLEGAL_STATE  # not recorded
    prod(f"fc.memcpy_htod_async(p, {data!r}, 4096, s); fc.event_record(ev, s)")
    # Without waiting, the consumer's kernel runs now and sees no data yet.
    assert cons("r0 = fc.launch_read(s, q, 4096); fc.stream_synchronize(s);"
                "r0.value, fc.event_query(e)") == [fnv1a(bytes(4096)), False]
    # With the wait, the stream is held until the producer's record executed.
    cons("fc.stream_wait_event(s, e); r1 = fc.launch_read(s, q, 4096)")
    cons("fc.stream_synchronize(s)")
    assert cons("r1.value, fc.event_query(e)") == [fnv1a(data), True]
    # The other way round: the consumer records (its reads are done), the producer waits.
    cons("fc.event_record(e, s)")
    prod("fc.event_synchronize(ev)")
    assert prod("fc.event_query(ev)") is True
    cons("fc.event_destroy(e); fc.ipc_close_mem_handle(q)")
    prod("fc.stream_destroy(s); fc.event_destroy(ev); fc.mem_free(p)")

    lines = parse_log(log)
    order = [(ln.pid, ln.op) for ln in lines if ln.op in ("exec_htod", "exec_record",
                                                          "exec_wait", "exec_read")]
    assert order == [
        (cons.pid, "exec_read"),    # r0: ran before the producer's copy
        (prod.pid, "exec_htod"),
        (prod.pid, "exec_record"),
        (cons.pid, "exec_wait"),
        (cons.pid, "exec_read"),    # r1
        (cons.pid, "exec_record"),
    ]
    ev_ids = {ln["ev"] for ln in lines if ln.op in ("event_record", "exec_wait", "ipc_open_event")}
    assert len(ev_ids) == 1 and ev_ids.pop().startswith(f"/fakecuda-ev-{prod.pid}-")
    assert [ln["gen"] for ln in select(lines, "event_record")] == ["1", "2"]
    (wait,) = select(lines, "stream_wait_event")
    assert wait["gen"] == "1"


# ---- what the real driver refuses (issue 34; docs/gpu.md, "The driver double") ----------


def test_ipc_handle_opens_in_one_context_per_device_per_process(agent, log):
    """cuIpcOpenMemHandle: handles "may only be opened by one CUcontext per CUdevice per
    other process"; the same context again gets the same pointer (reference counted)."""
    prod = agent(FAKECUDA_DEVICES="2")
    cons = agent(FAKECUDA_DEVICES="2")
    h = prod("p = fc.mem_alloc(4096); fc.ipc_get_mem_handle(p)")
    q = cons(f"q = fc.ipc_open_mem_handle({h!r}); q")
    assert cons(f"fc.ipc_open_mem_handle({h!r})") == q
    cons("ctx1 = fc.primary_ctx_retain(1); fc.ctx_push(ctx1)")
    assert cons.rc(f"fc.ipc_open_mem_handle({h!r})") == CUDA_ERROR_INVALID_CONTEXT
    cons("fc.ctx_pop(); fc.ipc_close_mem_handle(q); fc.ipc_close_mem_handle(q)")
    prod("fc.mem_free(p)")
    assert select(parse_log(log), "fail", why="already_open_in_another_context_of_this_process")


def test_context_wide_calls_cover_their_context_only(agent):
    """cuCtxSynchronize waits for the current context, cuCtxRecordEvent for the given one:
    work held on another device's stream does not hold them."""
    a = agent(FAKECUDA_DEVICES="2")
    a("ctx1 = fc.primary_ctx_retain(1); fc.ctx_push(ctx1); s1 = fc.stream_create();"
      "gate = fc.launch_gate(s1); fc.ctx_pop()")
    a("s0 = fc.stream_create(); fc.launch_sleep(s0, 1000)")
    a("fc.ctx_synchronize()")  # returns: device 1's gate is not this context's work
    a("ev = fc.event_create(); fc.ctx_record_event(ctx, ev); fc.event_synchronize(ev)")
    a("fc.ctx_push(ctx1); ev1 = fc.event_create(); fc.ctx_record_event(ctx1, ev1)")
    assert a("fc.event_query(ev1)") is False  # device 1's context: held by the gate
    a("gate.value = 1; fc.event_synchronize(ev1); fc.ctx_pop()")


def test_an_event_of_another_context_is_an_invalid_handle(agent):
    """cuEventRecord: "hEvent and hStream must be from the same context otherwise
    CUDA_ERROR_INVALID_HANDLE is returned"; cuCtxRecordEvent: "hEvent and hCtx must be from
    the same CUDA context"."""
    a = agent(FAKECUDA_DEVICES="2")
    a("ev0 = fc.event_create(); ctx1 = fc.primary_ctx_retain(1); fc.ctx_push(ctx1)")
    assert a.rc("fc.ctx_record_event(ctx1, ev0)") == CUDA_ERROR_INVALID_HANDLE
    assert a.rc("fc.event_record(ev0, 0)") == CUDA_ERROR_INVALID_HANDLE  # device 1's legacy
    a("ev1 = fc.event_create(); fc.event_record(ev1, 0); fc.ctx_record_event(ctx1, ev1)")
    a("s1 = fc.stream_create(); fc.ctx_pop()")
    assert a.rc("fc.ctx_record_event(ctx, ev1)") == CUDA_ERROR_INVALID_HANDLE
    a("fc.stream_wait_event(0, ev1)")  # a wait may use an event of another context


def test_context_wide_calls_during_a_capture_on_any_thread_invalidate_it(agent, log):
    """cuCtxRecordEvent "will return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED if the specified
    context hCtx has a stream in the capture mode. In such a case, the call will invalidate
    all the conflicting captures"; so does cuCtxSynchronize, whatever thread calls it and
    whatever the capture's mode; another device's context is no concern."""
    for mode in (fakecuda.CU_STREAM_CAPTURE_MODE_GLOBAL,
                 fakecuda.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                 fakecuda.CU_STREAM_CAPTURE_MODE_RELAXED):
        a = agent(FAKECUDA_DEVICES="2")
        a(f"s = fc.stream_create(1); ev = fc.event_create(); fc.begin_capture(s, {mode})")
        other = "fakecuda.in_thread(lambda: (fc.ctx_push(ctx), {}, fc.ctx_pop()))"
        assert a(other.format("fc.ctx_record_event(ctx, ev)")) == \
            fakecuda.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        assert a("fc.end_capture(s)") is False
        a(f"fc.begin_capture(s, {mode})")
        assert a(other.format("fc.ctx_synchronize()")) == \
            fakecuda.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        assert a("fc.end_capture(s)") is False
        a(f"fc.begin_capture(s, {mode})")
        a("ctx1 = fc.primary_ctx_retain(1); fc.ctx_push(ctx1); ev1 = fc.event_create();"
          "fc.ctx_record_event(ctx1, ev1); fc.ctx_synchronize(); fc.ctx_pop()")
        assert a("fc.end_capture(s)") is True
    assert len(select(parse_log(log), "capture_invalidated")) == 6


def test_a_capturing_stream_waits_on_outside_events_only_as_external(agent):
    """A capturing stream may not wait on an event recorded outside the capture without
    CU_EVENT_WAIT_EXTERNAL (isolation error, capture invalidated); with it, the wait is
    taken; outside a capture the flag is invalid."""
    a = agent()
    a("s = fc.stream_create(1); t = fc.stream_create(1); ev = fc.event_create();"
      "fc.event_record(ev, t)")
    assert a.rc("fc.stream_wait_event(s, ev, fakecuda.CU_EVENT_WAIT_EXTERNAL)") == \
        CUDA_ERROR_INVALID_VALUE
    a("fc.begin_capture(s)")
    assert a.rc("fc.stream_wait_event(s, ev)") == fakecuda.CUDA_ERROR_STREAM_CAPTURE_ISOLATION
    assert a("fc.end_capture(s)") is False
    a("fc.begin_capture(s); fc.stream_wait_event(s, ev, fakecuda.CU_EVENT_WAIT_EXTERNAL)")
    a("inner = fc.event_create(); fc.event_record(inner, s); fc.stream_wait_event(s, inner)")
    a("fc.stream_wait_event(t, ev)")  # a stream not capturing waits as before
    assert a("fc.end_capture(s)") is True


def test_the_legacy_stream_during_a_blocking_capture(agent):
    """While a blocking stream captures, the legacy stream is unusable (IMPLICIT, capture
    invalidated) and cuStreamIsCapturing of it says so without invalidating; a non-blocking
    capture leaves it alone. Capture statuses: NONE, ACTIVE, INVALIDATED."""
    a = agent()
    a("b = fc.stream_create(0); nb = fc.stream_create(fakecuda.CU_STREAM_NON_BLOCKING);"
      "ev = fc.event_create()")
    assert a("fc.stream_is_capturing(b), fc.stream_is_capturing(0)") == [0, 0]
    a("fc.begin_capture(b)")
    assert a("fc.stream_is_capturing(b), fc.stream_is_capturing(nb)") == [1, 0]
    assert a.rc("fc.stream_is_capturing(1)") == fakecuda.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
    assert a("fc.stream_is_capturing(b)") == 1  # the query invalidated nothing
    assert a.rc("fc.event_record(ev, 1)") == fakecuda.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
    assert a("fc.stream_is_capturing(b)") == 2
    assert a("fc.end_capture(b)") is False
    a("fc.begin_capture(nb); fc.event_record(ev, 0); fc.event_synchronize(ev)")
    assert a("fc.stream_is_capturing(0)") == 0
    assert a("fc.end_capture(nb)") is True
    assert a.rc("fc.begin_capture(0)") == fakecuda.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED


def test_an_event_recorded_in_a_capture_cannot_be_waited_for_on_the_host(agent):
    a = agent()
    a("s = fc.stream_create(1); ev = fc.event_create(); fc.begin_capture(s);"
      "fc.event_record(ev, s)")
    assert a.rc("fc.event_synchronize(ev)") == fakecuda.CUDA_ERROR_CAPTURED_EVENT
    assert a("fc.end_capture(s)") is False


def test_rejected_attributes_and_reported_version(agent):
    """An 11.x driver refuses CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED (125, new in 12.0)
    with CUDA_ERROR_INVALID_VALUE; cuDriverGetVersion reports FAKECUDA_DRIVER_VERSION."""
    a = agent(FAKECUDA_REJECT_ATTRIBUTES="125", FAKECUDA_DRIVER_VERSION="11080")
    assert a.rc("fc.device_attribute(125)") == CUDA_ERROR_INVALID_VALUE
    assert a("fc.device_attribute(41), fc.driver_version()") == [1, 11080]


def test_the_driver_tears_down_at_exit(agent, log):
    """exit() runs the driver's teardown (registered by cuInit, logged "teardown"); from
    then on calls return CUDA_ERROR_DEINITIALIZED ("the CUDA driver is in the process of
    shutting down") and are logged as after_teardown, and a wait in progress returns it.
    fakecuda_teardown() does now what exit() does, so that the test sees the calls after."""
    a = agent()
    a("s = fc.stream_create(1); gate = fc.launch_gate(s); ev = fc.event_create();"
      "fc.event_record(ev, s); rcs = []; started = threading.Event()")
    a("def wait():\n"
      "    fc.ctx_push(ctx); started.set(); rcs.append(fc.call('cuEventSynchronize', ev))\n"
      "t = threading.Thread(target=wait); t.start(); started.wait()")
    a("fc.lib.fakecuda_teardown(); t.join(30)")
    assert a("t.is_alive(), rcs") == [False, [fakecuda.CUDA_ERROR_DEINITIALIZED]]
    assert a.rc("fc.device_count()") == fakecuda.CUDA_ERROR_DEINITIALIZED
    assert a.rc("fc.init()") == fakecuda.CUDA_ERROR_DEINITIALIZED
    a("gate.value = 1")
    b = agent()
    b("fc.mem_alloc(4096)")
    b.close()  # a normal exit: exit() tears the driver down, its memory goes
    lines = parse_log(log)
    assert {ln["op"] for ln in select(lines, "after_teardown", pid=a.pid)} >= \
        {"event_sync", "device_count", "init"}
    assert select(lines, "teardown", pid=b.pid) and not select(lines, "after_teardown", pid=b.pid)
    assert fakecuda.shm_objects(b.pid) == []


UNLOAD_SCRIPT = r"""
import _ctypes, ctypes, sys
lib = ctypes.CDLL({lib!r})
if {init}:
    assert lib.cuInit(0) == 0
_ctypes.dlclose(lib._handle)
print("unloaded", flush=True)
"""


@pytest.mark.parametrize("init", [False, True])
def test_dlclose_really_unloads_the_driver(lib, log, tmp_path, init):
    """Nothing pins the library: a dlclose unloads it. After cuInit that is fatal (the real
    driver's exit handlers and threads would run unmapped code): the double aborts at once,
    naming it; before cuInit it is harmless."""
    script = tmp_path / "unload.py"
    script.write_text(UNLOAD_SCRIPT.format(lib=str(lib), init=init))
    proc = subprocess.run([os.sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "FAKECUDA_LOG": str(log)})
    if init:
        assert proc.returncode == -6 and "unloaded (dlclose) after cuInit" in proc.stderr
        assert select(parse_log(log), "unloaded_after_init")
    else:
        assert proc.returncode == 0 and "unloaded" in proc.stdout, proc.stderr


# ---- the log -------------------------------------------------------------------------------


def test_log_lines_never_interleave_and_counters_match(agent, log):
    code = (
        "def work():\n"
        "    fc.ctx_push(ctx)\n"
        "    s = fc.stream_create()\n"
        "    for _ in range(150):\n"
        "        p = fc.mem_alloc(4096)\n"
        "        fc.memcpy_htod_async(p, b'x' * 4096, 4096, s)\n"
        "        fc.stream_synchronize(s)\n"
        "        fc.mem_free(p)\n"
        "    fc.stream_destroy(s)\n"
        "ts = [threading.Thread(target=work) for _ in range(4)]\n"
        "for t in ts: t.start()\n"
        "for t in ts: t.join()\n"
    )
    procs = [agent(), agent()]
    for a in procs:
        a.send(code)
    for a in procs:
        a.recv(timeout=60)
    lines = parse_log(log)  # raises on any malformed (interleaved) line
    for a in procs:
        mine = [ln for ln in lines if ln.pid == a.pid]
        for op in ("alloc", "htod", "exec_htod", "free", "stream_create", "ctx_push"):
            assert a(f"fc.counter({op!r})") == len([ln for ln in mine if ln.op == op])
        assert a("fc.counter('alloc')") == 600
        assert a("fc.counter('fail')") == 0
    assert fakecuda.parse_line(f"{procs[0].pid} fail op=alloc rc=2").fields == {
        "op": "alloc", "rc": "2"}
    with pytest.raises(ValueError):
        fakecuda.parse_line("123 alloc ptr=0x1 456 free")


def test_failed_calls_are_logged(agent, log):
    a = agent()
    assert a.rc("fc.mem_free(1)") == CUDA_ERROR_INVALID_VALUE
    (fail,) = select(parse_log(log), "fail", a.pid)
    assert fail["op"] == "free" and fail.num("rc") == CUDA_ERROR_INVALID_VALUE
    assert fail["err"] == "CUDA_ERROR_INVALID_VALUE"
    assert a("fc.counter('fail')") == 1


def test_cudaerror_carries_the_code():
    e = CudaError(201, "cuMemAlloc_v2")
    assert e.rc == 201 and "CUDA_ERROR_INVALID_CONTEXT" in str(e)


# ---- two GPUs and MIG ------------------------------------------------------------------------


def test_peer_access_and_no_peer(agent, log):
    """cuDeviceCanAccessPeer: every pair of whole GPUs by default; FAKECUDA_NO_PEER takes
    pairs of physical devices (both ways) or "all"; a bad value fails cuInit naming it."""
    a = agent(FAKECUDA_DEVICES="3", FAKECUDA_NO_PEER="0-2")
    assert a("[fc.can_access_peer(d, p) for d, p in ((0, 1), (1, 0), (0, 2), (2, 0), (1, 2))]") \
        == [1, 1, 0, 0, 1]
    assert a.rc("fc.can_access_peer(1, 1)") == CUDA_ERROR_INVALID_DEVICE
    assert a.rc("fc.can_access_peer(0, 3)") == CUDA_ERROR_INVALID_DEVICE
    # Physical ids, whatever the visible order.
    b = agent(FAKECUDA_DEVICES="3", FAKECUDA_NO_PEER="0-2", FAKECUDA_VISIBLE="2,1,0")
    assert b("[fc.can_access_peer(0, 2), fc.can_access_peer(0, 1)]") == [0, 1]
    c = agent(FAKECUDA_DEVICES="3", FAKECUDA_NO_PEER="all")
    assert c("[fc.can_access_peer(0, 1), fc.can_access_peer(2, 1)]") == [0, 0]
    (line, *_) = select(parse_log(log), "can_access_peer", c.pid)
    assert line["phys"] == "0" and line["peer_phys"] == "1" and line["value"] == "0"
    for bad in ("0", "0-", "x", "0-1;2-3", "0-99"):
        d = agent(setup=False, FAKECUDA_DEVICES="2", FAKECUDA_NO_PEER=bad)
        assert d.rc("fc.init()") == CUDA_ERROR_INVALID_VALUE, bad
        (fail,) = select(parse_log(log), "fail", d.pid)
        assert "FAKECUDA_NO_PEER" in fail["why"]


def test_ipc_open_refuses_a_peer_without_access(agent, log):
    """cuIpcOpenMemHandle on a device with no peer access to the exporter's fails with
    CUDA_ERROR_PEER_ACCESS_UNSUPPORTED; the exporter's own device still opens it."""
    exp = agent(FAKECUDA_DEVICES="2", FAKECUDA_NO_PEER="0-1")
    h = exp("p = fc.mem_alloc(4096); fc.ipc_get_mem_handle(p)")
    other = agent(FAKECUDA_DEVICES="2", FAKECUDA_NO_PEER="0-1", device=1)
    assert other.rc(f"fc.ipc_open_mem_handle({h!r})") == CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
    same = agent(FAKECUDA_DEVICES="2", FAKECUDA_NO_PEER="0-1")
    same(f"q = fc.ipc_open_mem_handle({h!r}); fc.ipc_close_mem_handle(q)")
    (fail,) = select(parse_log(log), "fail", other.pid)
    assert fail["op"] == "ipc_open_mem" and fail["why"] == "no_peer_access"
    assert other("fc.error_name(217)") == "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"


def test_mig_instances_have_their_own_v2_uuid(agent, log):
    """FAKECUDA_MIG_GPUS: instances of one GPU share its v1 UUID, each has its own v2 UUID,
    and no instance has peer access to another device; whole GPUs keep one UUID."""
    a = agent(FAKECUDA_DEVICES="3", FAKECUDA_MIG_GPUS="0,0,-")
    assert a("[fc.device_uuid(d) for d in range(3)]") == \
        [b"fakecuda-gpu-00\0", b"fakecuda-gpu-00\0", b"fakecuda-phys-02"]
    assert a("[fc.device_uuid_v2(d) for d in range(3)]") == \
        [b"fakecuda-mig-00\0", b"fakecuda-mig-01\0", b"fakecuda-phys-02"]
    assert a("[fc.can_access_peer(0, 1), fc.can_access_peer(1, 2), fc.can_access_peer(2, 0)]") \
        == [0, 0, 0]
    h = a("p = fc.mem_alloc(4096); fc.ipc_get_mem_handle(p)")
    inst_b = agent(FAKECUDA_DEVICES="3", FAKECUDA_MIG_GPUS="0,0,-", device=1)
    assert inst_b.rc(f"fc.ipc_open_mem_handle({h!r})") == CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
    inst_a = agent(FAKECUDA_DEVICES="3", FAKECUDA_MIG_GPUS="0,0,-")
    inst_a(f"q = fc.ipc_open_mem_handle({h!r}); fc.ipc_close_mem_handle(q)")
    lines = select(parse_log(log), "device_uuid_v2", a.pid)
    assert [ln["mig"] for ln in lines] == ["1", "1", "0"]
    for bad in ("x", "0,,1", "0;0"):
        d = agent(setup=False, FAKECUDA_MIG_GPUS=bad)
        assert d.rc("fc.init()") == CUDA_ERROR_INVALID_VALUE, bad
        (fail,) = select(parse_log(log), "fail", d.pid)
        assert "FAKECUDA_MIG_GPUS" in fail["why"]
    plain = agent(FAKECUDA_DEVICES="2")
    assert plain("fc.device_uuid_v2(1) == fc.device_uuid(1) == b'fakecuda-phys-01'") is True


def test_old_driver_build_lacks_uuid_v2(tmp_path, log):
    """Built with OLD_DRIVER_FLAGS the double lacks cuDeviceGetUuid_v2 (a driver older than
    CUDA 11.4), and exports every other function."""
    try:
        old = fakecuda.build(tmp_path, extra=fakecuda.OLD_DRIVER_FLAGS, name="libold.so")
    except fakecuda.NoCompiler as e:
        pytest.skip(str(e))
    a = fakecuda.Agent(old, env={"FAKECUDA_LOG": str(log)})
    try:
        assert a("hasattr(fc.lib, 'cuDeviceGetUuid_v2')") is False
        assert a("fc.init(); fc.device_uuid(0)") == b"fakecuda-phys-00"
    finally:
        a.close()
    if shutil.which("nm") is not None:
        out = subprocess.run(["nm", "-D", "--defined-only", str(old)], capture_output=True,
                             text=True, check=True).stdout
        functions = {m.group(1) for m in re.finditer(r" T (\w+)$", out, re.MULTILINE)}
        assert functions == set(fakecuda.DRIVER_FUNCTIONS + fakecuda.TEST_FUNCTIONS) - \
            set(fakecuda.OPTIONAL_FUNCTIONS)


# ---- sanitizers ----------------------------------------------------------------------------

# A C program that drives every entry point through a full life cycle, with a child process
# (itself, re-executed) on the IPC side and helper threads with their own contexts. Built
# with the library under ASan+UBSan (LeakSanitizer checks that destroy frees everything) and
# under TSan.
DRIVER_C = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "device/ts_cuda_api.h"

CUresult cuInit(unsigned int);
CUresult cuGetErrorName(CUresult, const char **);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuCtxPushCurrent_v2(CUcontext);
CUresult cuCtxPopCurrent_v2(CUcontext *);
CUresult cuCtxSynchronize(void);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void *, size_t, CUstream);
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr, CUdeviceptr, size_t, CUstream);
CUresult cuMemHostRegister_v2(void *, size_t, unsigned int);
CUresult cuMemHostUnregister(void *);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuStreamDestroy_v2(CUstream);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamWaitEvent(CUstream, CUevent, unsigned int);
CUresult cuEventCreate(CUevent *, unsigned int);
CUresult cuEventDestroy_v2(CUevent);
CUresult cuEventRecord(CUevent, CUstream);
CUresult cuEventQuery(CUevent);
CUresult cuEventSynchronize(CUevent);
CUresult cuIpcGetMemHandle(CUipcMemHandle *, CUdeviceptr);
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *, CUipcMemHandle, unsigned int);
CUresult cuIpcCloseMemHandle(CUdeviceptr);
CUresult cuIpcGetEventHandle(CUipcEventHandle *, CUevent);
CUresult cuIpcOpenEventHandle(CUevent *, CUipcEventHandle);
CUresult fakecuda_launch_read(CUstream, CUdeviceptr, size_t, unsigned long long *, unsigned);

extern char **environ;

#define EXPECT(call, want)                                                                  \
    do {                                                                                    \
        CUresult rc_ = (call);                                                              \
        if (rc_ != (want)) {                                                                \
            fprintf(stderr, "%d: %s = %d, want %d\n", __LINE__, #call, rc_, (int)(want));   \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)
#define CK(call) EXPECT(call, CUDA_SUCCESS)
#define N 4096

static CUcontext ctx;

static unsigned long long fnv(const unsigned char *p, size_t n)
{
    unsigned long long h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ULL;
    return h;
}

static void *worker(void *arg)
{
    unsigned char *buf = malloc(N);
    memset(buf, (int)(size_t)arg, N);
    CK(cuCtxPushCurrent_v2(ctx));
    CUstream s;
    CK(cuStreamCreate(&s, 0));
    for (int i = 0; i < 40; i++) {
        CUdeviceptr p;
        unsigned long long sum = 0;
        CK(cuMemAlloc_v2(&p, N));
        CK(cuMemcpyHtoDAsync_v2(p, buf, N, s));
        CK(fakecuda_launch_read(s, p, N, &sum, 0));
        CK(cuMemFree_v2(p)); /* queued work still holds the mapping */
        CK(cuStreamSynchronize(s));
        if (sum != fnv(buf, N)) exit(2);
    }
    CK(cuStreamDestroy_v2(s));
    CK(cuCtxPopCurrent_v2(NULL));
    free(buf);
    return NULL;
}

static int child(char **argv)
{
    CUipcMemHandle mh;
    CUipcEventHandle eh;
    for (int i = 0; i < 64; i++) {
        sscanf(argv[2] + 2 * i, "%2hhx", (unsigned char *)&mh.reserved[i]);
        sscanf(argv[3] + 2 * i, "%2hhx", (unsigned char *)&eh.reserved[i]);
    }
    CUcontext c;
    CUdeviceptr p, p2;
    CUevent e;
    CUstream s;
    unsigned long long sum = 0;
    unsigned char want[N];
    memset(want, 0xa5, N);
    CK(cuInit(0));
    CK(cuDevicePrimaryCtxRetain(&c, 0));
    CK(cuCtxPushCurrent_v2(c));
    CK(cuIpcOpenMemHandle_v2(&p, mh, 1));
    CK(cuIpcOpenMemHandle_v2(&p2, mh, 1));
    if (p != p2) return 3;
    CK(cuIpcOpenEventHandle(&e, eh));
    CK(cuStreamCreate(&s, 0));
    CK(cuStreamWaitEvent(s, e, 0));
    CK(fakecuda_launch_read(s, p, N, &sum, 0));
    CK(cuEventRecord(e, s));
    CK(cuIpcCloseMemHandle(p));
    CK(cuIpcCloseMemHandle(p2)); /* the queued read still holds the mapping */
    CK(cuStreamSynchronize(s));
    if (sum != fnv(want, N)) return 4;
    CK(cuEventDestroy_v2(e));
    CK(cuStreamDestroy_v2(s));
    CK(cuCtxPopCurrent_v2(NULL));
    CK(cuDevicePrimaryCtxRelease_v2(0));
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "child") == 0) return child(argv);
    const char *name;
    CUdeviceptr d, d2, bad;
    CUstream s;
    CUevent ev, lev;
    CUipcMemHandle mh;
    CUipcEventHandle eh;
    unsigned char *host = aligned_alloc(4096, N);
    memset(host, 0xa5, N);
    EXPECT(cuMemAlloc_v2(&bad, 16), CUDA_ERROR_NOT_INITIALIZED);
    CK(cuInit(0));
    EXPECT(cuMemAlloc_v2(&bad, 16), CUDA_ERROR_INVALID_CONTEXT);
    EXPECT(cuGetErrorName(12345, &name), CUDA_ERROR_INVALID_VALUE);
    CK(cuDevicePrimaryCtxRetain(&ctx, 0));
    CK(cuCtxPushCurrent_v2(ctx));
    EXPECT(cuMemFree_v2(1), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuEventCreate(&ev, CU_EVENT_INTERPROCESS), CUDA_ERROR_INVALID_VALUE);
    CK(cuMemAlloc_v2(&d, N));
    CK(cuMemAlloc_v2(&d2, N));
    CK(cuMemHostRegister_v2(host, N, 0));
    EXPECT(cuMemHostRegister_v2(host, N, 0), CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    CK(cuStreamCreate(&s, 0));
    CK(cuEventCreate(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
    CK(cuEventCreate(&lev, CU_EVENT_DISABLE_TIMING));
    EXPECT(cuStreamWaitEvent(s, lev, 0), 401);
    CK(cuMemcpyHtoDAsync_v2(d, host, N, s));
    CK(cuMemcpyDtoDAsync_v2(d2, d, N, s));
    CK(cuEventRecord(lev, s));
    CK(cuStreamWaitEvent(NULL, lev, 0));
    CK(cuMemcpyHtoDAsync_v2(d, host, 16, TS_CU_STREAM_LEGACY));
    CK(cuEventRecord(ev, TS_CU_STREAM_PER_THREAD));
    CK(cuCtxSynchronize());
    CK(cuEventQuery(ev));
    CK(cuIpcGetMemHandle(&mh, d2));
    CK(cuIpcGetEventHandle(&eh, ev));
    EXPECT(cuIpcOpenMemHandle_v2(&bad, mh, 1), CUDA_ERROR_INVALID_CONTEXT);

    char mhex[129], ehex[129], self[] = "child";
    for (int i = 0; i < 64; i++) {
        sprintf(mhex + 2 * i, "%02x", (unsigned char)mh.reserved[i]);
        sprintf(ehex + 2 * i, "%02x", (unsigned char)eh.reserved[i]);
    }
    char *args[] = {argv[0], self, mhex, ehex, NULL};
    pid_t pid;
    int status;
    if (posix_spawn(&pid, "/proc/self/exe", NULL, NULL, args, environ) != 0) return 5;
    pthread_t t[4];
    for (size_t i = 0; i < 4; i++) pthread_create(&t[i], NULL, worker, (void *)(i + 1));
    for (size_t i = 0; i < 4; i++) pthread_join(t[i], NULL);
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "child failed: status %d\n", status);
        return 6;
    }
    CK(cuEventSynchronize(ev)); /* the child's record */

    CK(cuEventDestroy_v2(ev));
    CK(cuEventDestroy_v2(lev));
    CK(cuStreamDestroy_v2(s));
    CK(cuMemHostUnregister(host));
    CK(cuMemFree_v2(d));
    CK(cuMemFree_v2(d2));
    CK(cuCtxPopCurrent_v2(NULL));
    CK(cuDevicePrimaryCtxRelease_v2(0));
    free(host);
    puts("driver ok");
    return 0;
}
"""


def _build_driver(work: Path, flags: list[str]) -> Path:
    """libfakecuda.so and the driver, both built with flags; skips if the toolchain can't."""
    try:
        fakecuda.build(work, extra=flags, sanitize=False)
    except fakecuda.NoCompiler as e:
        pytest.skip(str(e))
    except fakecuda.BuildError as e:
        if "-fsanitize" in " ".join(flags) and "cannot find" in str(e):
            pytest.skip(f"no sanitizer runtime: {e}")
        raise
    src = work / "driver.c"
    src.write_text(DRIVER_C)
    exe = work / "driver"
    cmd = [*fakecuda.compiler(), "-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-g",
           "-pthread", *flags, f"-I{ROOT / 'csrc'}", str(src), "-o", str(exe), f"-L{work}",
           "-lfakecuda", f"-Wl,-rpath,{work}", "-lrt"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
    return exe


@pytest.mark.slow  # sanitizer builds of the C core (scripts/test-sanitized.sh runs ASan too)
@pytest.mark.parametrize("sanitizer", ["address,undefined", "thread"])
def test_life_cycle_is_sanitizer_clean(tmp_path, sanitizer):
    flags = [f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer"]
    exe = _build_driver(tmp_path, flags)
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS")},
        "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=1",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
        "TSAN_OPTIONS": "halt_on_error=1:second_deadlock_stack=1",
        "FAKECUDA_LOG": str(tmp_path / "log"),
    }
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env)
    out = proc.stdout + proc.stderr
    if sanitizer == "thread" and proc.returncode != 0 and "FATAL: ThreadSanitizer" in out:
        pytest.skip(f"TSan binaries do not run here:\n{out}")
    if sanitizer != "thread" and "LeakSanitizer has encountered a fatal error" in out:
        pytest.skip(f"LeakSanitizer does not run here:\n{out}")
    assert proc.returncode == 0 and "driver ok" in out, out
    assert "Sanitizer" not in out and "runtime error" not in out, out
    lines = parse_log(tmp_path / "log")
    parent = lines[0].pid
    pids = {ln.pid for ln in lines}
    assert len(pids) == 2, pids  # the driver and its child both ran
    assert {ln.pid for ln in select(lines, "exec_read")} == pids
    assert select(lines, "fail", pid=parent, op="ipc_open_mem")  # its own handle: 201
    assert [n for pid in pids for n in fakecuda.cleanup_shm(pid)] == []
