"""Test helpers for the CUDA driver test double (csrc/tests/fake_cuda.c).

* ``build(out_dir)`` compiles ``libfakecuda.so`` (raises ``NoCompiler`` where there is no
  C compiler, so callers can skip, and ``BuildError`` with the compiler output otherwise).
  Point the core at it with ``TENSORSOCKET_LIBCUDA=<path>``.
* ``parse_log(path)`` reads the ``FAKECUDA_LOG`` file: one ``LogLine`` per driver call or
  executed stream operation (``<pid> <op> key=value ...``).
* ``FakeCuda(lib_path)`` wraps the library with ``ctypes`` (raising ``CudaError`` on a
  failed call), including the test-only ``fakecuda_launch_read`` and ``fakecuda_counter``.
* ``Agent(lib_path, env)`` runs a child Python process holding a ``FakeCuda`` as ``fc`` and
  executes snippets sent to it, so a test can drive several processes step by step.
  The child is this file run as a script: ``python tests/fakecuda.py agent LIB``.
"""

from __future__ import annotations

import ast
import ctypes
import json
import os
import re
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "csrc" / "tests" / "fake_cuda.c"
LIB_NAME = "libfakecuda.so"
BASE_FLAGS = [
    "-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-g",
    "-shared", "-fPIC", "-pthread", "-fvisibility=default", "-Icsrc",
    # The double's calls to its own cu* functions stay inside it, even in a process where
    # torch has loaded the real libcuda first (on a GPU machine).
    "-Wl,-Bsymbolic",
]
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
BUILD_TIMEOUT = 300

# ---- driver constants (cuda.h) ---------------------------------------------------------

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_DEINITIALIZED = 4
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_MAP_FAILED = 205
CUDA_ERROR_PEER_ACCESS_UNSUPPORTED = 217
CUDA_ERROR_INVALID_HANDLE = 400
CUDA_ERROR_ILLEGAL_STATE = 401
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_UNKNOWN = 999
CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900
CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901
CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905
CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906
CUDA_ERROR_CAPTURED_EVENT = 907

ERROR_NAMES = {
    value: name for name, value in globals().items()
    if name.startswith("CUDA_") and isinstance(value, int)
}

CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41
CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED = 125
CU_EVENT_BLOCKING_SYNC = 0x1
CU_EVENT_DISABLE_TIMING = 0x2
CU_EVENT_INTERPROCESS = 0x4
CU_STREAM_NON_BLOCKING = 0x1
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CU_MEMHOSTREGISTER_PORTABLE = 0x1
CU_MEMHOSTREGISTER_READ_ONLY = 0x8
CU_STREAM_CAPTURE_MODE_GLOBAL = 0
CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
CU_STREAM_CAPTURE_MODE_RELAXED = 2
CU_STREAM_CAPTURE_STATUS_NONE = 0
CU_STREAM_CAPTURE_STATUS_ACTIVE = 1
CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2
CU_EVENT_WAIT_EXTERNAL = 0x1
STREAM_LEGACY = 0x1
STREAM_PER_THREAD = 0x2
IPC_EVENT_FLAGS = CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING

# The driver functions the core looks up, and the double's test-only exports.
DRIVER_FUNCTIONS = (
    "cuInit", "cuDriverGetVersion", "cuGetErrorName", "cuGetErrorString",
    "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetAttribute", "cuDeviceGetUuid",
    "cuDeviceGetName", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2",
    "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2", "cuCtxSynchronize", "cuMemAlloc_v2",
    "cuMemFree_v2", "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoDAsync_v2", "cuMemHostRegister_v2",
    "cuMemHostUnregister", "cuStreamCreate", "cuStreamDestroy_v2", "cuStreamSynchronize",
    "cuStreamWaitEvent", "cuEventCreate", "cuEventDestroy_v2", "cuEventRecord", "cuEventQuery",
    "cuEventSynchronize", "cuIpcGetMemHandle", "cuIpcOpenMemHandle_v2", "cuIpcCloseMemHandle",
    "cuIpcGetEventHandle", "cuIpcOpenEventHandle", "cuDeviceCanAccessPeer",
    "cuDeviceGetUuid_v2",
    # optional in the core (ts_cuda_api.c): CUDA 12.5 and 10.1
    "cuCtxRecordEvent", "cuThreadExchangeStreamCaptureMode",
    "cuStreamIsCapturing",
)
# Driver functions a driver may lack; OLD_DRIVER_FLAGS builds the double without them (a
# driver older than CUDA 11.4).
OPTIONAL_FUNCTIONS = ("cuDeviceGetUuid_v2",)
OLD_DRIVER_FLAGS = ("-DFAKECUDA_NO_UUID_V2",)
TEST_FUNCTIONS = ("fakecuda_launch_read", "fakecuda_counter", "fakecuda_launch_sleep",
                  "fakecuda_begin_capture", "fakecuda_end_capture", "fakecuda_launch_gate",
                  "fakecuda_teardown")


# ---- building --------------------------------------------------------------------------


class NoCompiler(RuntimeError):
    """There is no C compiler ($CC, default ``cc``): tests should skip."""


class BuildError(RuntimeError):
    """The compiler rejected fake_cuda.c; the message holds the command and its output."""


def compiler() -> list[str]:
    """The C compiler command ($CC, default ``cc``); NoCompiler if it is not installed."""
    cc = shlex.split(os.environ.get("CC", "cc"))
    if not cc or shutil.which(cc[0]) is None:
        raise NoCompiler(f"no C compiler {cc[0] if cc else '(empty $CC)'!r}")
    return cc


def build(out_dir: Path, extra: Sequence[str] = (), name: str = LIB_NAME,
          sanitize: bool | None = None) -> Path:
    """Compile csrc/tests/fake_cuda.c into ``out_dir/name`` and return its path.

    ``extra`` adds compiler flags. ``sanitize`` adds ASan+UBSan (``SANITIZE_FLAGS``); by
    default it follows TENSORSOCKET_SANITIZE=1, as setup.py does (scripts/test-sanitized.sh
    preloads the runtimes into Python, so an instrumented library loads there)."""
    if sanitize is None:
        sanitize = os.environ.get("TENSORSOCKET_SANITIZE") == "1"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / name
    tmp = out_dir / f".{name}.{os.getpid()}.tmp"
    flags = [*BASE_FLAGS, *(SANITIZE_FLAGS if sanitize else []), *extra]
    cmd = [*compiler(), *flags, str(SOURCE.relative_to(ROOT)), "-o", str(tmp), "-lrt"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"compiling the CUDA test double failed:\n{shlex.join(cmd)}\n"
                         f"{proc.stdout}{proc.stderr}")
    os.replace(tmp, out)
    return out


# ---- the log -----------------------------------------------------------------------------


@dataclass(frozen=True)
class LogLine:
    """One line of FAKECUDA_LOG: ``<pid> <op> key=value ...`` (values are strings)."""

    pid: int
    op: str
    fields: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, key: str) -> str:
        return self.fields[key]

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.fields.get(key, default)

    def num(self, key: str) -> int:
        """A field as an integer (decimal, or hex with 0x)."""
        return int(self.fields[key], 0)


_LINE = re.compile(r"^(\d+) ([a-z][a-z0-9_]*)((?: [A-Za-z_]+=\S*)*)$")


def parse_line(line: str) -> LogLine:
    """Parse one log line; ValueError if it is malformed (e.g. two writes interleaved)."""
    m = _LINE.match(line)
    if m is None:
        raise ValueError(f"malformed fakecuda log line: {line!r}")
    fields = dict(kv.split("=", 1) for kv in m.group(3).split())
    return LogLine(int(m.group(1)), m.group(2), fields)


def parse_log(path: Path | str) -> list[LogLine]:
    """Every line of a FAKECUDA_LOG file, in file order ([] if the file does not exist)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [parse_line(line) for line in text.splitlines() if line]


def select(lines: Iterable[LogLine], kind: str | None = None, /, pid: int | None = None,
           **fields: str) -> list[LogLine]:
    """The lines of op `kind` (positional) and process pid whose fields have these values,
    e.g. ``select(lines, "fail", op="ipc_open_mem", rc="201")``."""
    return [
        ln for ln in lines
        if (kind is None or ln.op == kind) and (pid is None or ln.pid == pid)
        and all(ln.fields.get(k) == v for k, v in fields.items())
    ]


# ---- shm objects -------------------------------------------------------------------------


def shm_objects(pid: int | None = None) -> list[str]:
    """The double's shm objects in /dev/shm (of process pid if given), as names without '/'."""
    pat = re.compile(r"^fakecuda-(?:ev-|imp-)?(\d+)-\d+$")
    found = []
    for entry in os.listdir("/dev/shm"):
        m = pat.match(entry)
        if m is not None and (pid is None or int(m.group(1)) == pid):
            found.append(entry)
    return sorted(found)


class DeviceTensor:
    """Stands in for a torch CUDA tensor of a consumer on the double (CPU torch has none):
    holds its DLPack capsule, so the slot, as long as it lives, and says where the leaf is."""

    def __init__(self, capsule: Any, view: Any) -> None:
        self.cap, self.ptr, self.nbytes = capsule, view.data_ptr, view.nbytes
        self.shape = tuple(view.shape)
        self.ndim = len(self.shape)


def deliver_device_tensors(delivery: Any, stream: Any) -> None:
    """Make tensorsocket.data.delivery (the module) export each batch's device leaves as
    DeviceTensors on stream, and report stream as this thread's current one (what torch's
    current stream is to a consumer on a GPU)."""
    def device_tensors(slot: Any, device: Any) -> list:
        caps = slot.capsules(versioned=True, device=True, stream=stream)
        return [DeviceTensor(c, v) for c, v in zip(caps, slot.views(device=True))]

    delivery._device_tensors = device_tensors
    delivery.current_stream = lambda device: stream


@contextlib.contextmanager
def checked_env(lib: Path, log: Path, **extra: str) -> Iterator[dict]:
    """The environment of processes on the double `lib`, logging to `log` (plus extra
    variables); afterwards, the shm objects of the processes in the log that are left
    behind are removed and reported (AssertionError). Objects of other processes (a
    suite running beside this one) are not touched."""
    before = set(shm_objects())
    yield {"TENSORSOCKET_LIBCUDA": str(lib), "FAKECUDA_LOG": str(log), **extra}
    pids = {int(line.split(" ", 1)[0]) for line in log.read_text().splitlines()
            if line[:1].isdigit()} if log.exists() else set()
    left = sorted(o for o in set(shm_objects()) - before if int(o.rsplit("-", 2)[1]) in pids)
    for obj in left:
        os.unlink(f"/dev/shm/{obj}")
    assert left == [], f"device memory or events left behind: {left}"


def cleanup_shm(pid: int) -> list[str]:
    """Remove what a killed process left in /dev/shm (a clean exit removes it itself)."""
    removed = shm_objects(pid)
    for entry in removed:
        try:
            os.unlink(f"/dev/shm/{entry}")
        except FileNotFoundError:
            pass
    return removed


# ---- ctypes wrapper ----------------------------------------------------------------------


class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


class CUipcEventHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


class CudaError(RuntimeError):
    """A driver call returned rc != CUDA_SUCCESS."""

    def __init__(self, rc: int, func: str = "?") -> None:
        self.rc = rc
        self.func = func
        self.name = ERROR_NAMES.get(rc, f"error {rc}")
        super().__init__(f"{func}: {self.name} ({rc})")


_c = ctypes
_P = ctypes.POINTER
_VP = ctypes.c_void_p
_U64 = ctypes.c_ulonglong
_SIGNATURES: dict[str, list[Any]] = {
    "cuInit": [_c.c_uint],
    "cuDriverGetVersion": [_P(_c.c_int)],
    "cuGetErrorName": [_c.c_int, _P(_c.c_char_p)],
    "cuGetErrorString": [_c.c_int, _P(_c.c_char_p)],
    "cuDeviceGetCount": [_P(_c.c_int)],
    "cuDeviceGet": [_P(_c.c_int), _c.c_int],
    "cuDeviceGetAttribute": [_P(_c.c_int), _c.c_int, _c.c_int],
    "cuDeviceGetUuid": [_P(CUuuid), _c.c_int],
    "cuDeviceGetName": [_c.c_char_p, _c.c_int, _c.c_int],
    "cuDevicePrimaryCtxRetain": [_P(_VP), _c.c_int],
    "cuDevicePrimaryCtxRelease_v2": [_c.c_int],
    "cuCtxPushCurrent_v2": [_VP],
    "cuCtxPopCurrent_v2": [_P(_VP)],
    "cuCtxSynchronize": [],
    "cuMemAlloc_v2": [_P(_U64), _c.c_size_t],
    "cuMemFree_v2": [_U64],
    "cuMemcpyHtoDAsync_v2": [_U64, _VP, _c.c_size_t, _VP],
    "cuMemcpyDtoDAsync_v2": [_U64, _U64, _c.c_size_t, _VP],
    "cuMemHostRegister_v2": [_VP, _c.c_size_t, _c.c_uint],
    "cuMemHostUnregister": [_VP],
    "cuStreamCreate": [_P(_VP), _c.c_uint],
    "cuStreamDestroy_v2": [_VP],
    "cuStreamSynchronize": [_VP],
    "cuStreamWaitEvent": [_VP, _VP, _c.c_uint],
    "cuEventCreate": [_P(_VP), _c.c_uint],
    "cuEventDestroy_v2": [_VP],
    "cuEventRecord": [_VP, _VP],
    "cuEventQuery": [_VP],
    "cuEventSynchronize": [_VP],
    "cuIpcGetMemHandle": [_P(CUipcMemHandle), _U64],
    "cuIpcOpenMemHandle_v2": [_P(_U64), CUipcMemHandle, _c.c_uint],
    "cuIpcCloseMemHandle": [_U64],
    "cuIpcGetEventHandle": [_P(CUipcEventHandle), _VP],
    "cuIpcOpenEventHandle": [_P(_VP), CUipcEventHandle],
    "fakecuda_launch_read": [_VP, _U64, _c.c_size_t, _P(_U64), _c.c_uint],
    "fakecuda_counter": [_c.c_char_p],
    "cuDeviceCanAccessPeer": [_P(_c.c_int), _c.c_int, _c.c_int],
    "cuDeviceGetUuid_v2": [_P(CUuuid), _c.c_int],
    "cuCtxRecordEvent": [_VP, _VP],
    "cuThreadExchangeStreamCaptureMode": [_P(_c.c_int)],
    "fakecuda_launch_sleep": [_VP, _c.c_uint],
    "fakecuda_begin_capture": [_VP, _c.c_int],
    "fakecuda_end_capture": [_VP],
    "fakecuda_launch_gate": [_VP, _P(_c.c_int)],
    "cuStreamIsCapturing": [_VP, _P(_c.c_int)],
    "fakecuda_teardown": [],
}

HostSrc = int | bytes | bytearray | memoryview


class FakeCuda:
    """The double loaded with ctypes. Methods raise CudaError on failure; handles
    (contexts, streams, events) and device pointers are ints, IPC handles 64 bytes."""

    def __init__(self, lib_path: Path | str) -> None:
        self.path = str(lib_path)
        self.lib = ctypes.CDLL(self.path)
        for name, argtypes in _SIGNATURES.items():
            if name in OPTIONAL_FUNCTIONS and not hasattr(self.lib, name):
                continue  # an old driver's build (OLD_DRIVER_FLAGS)
            fn = getattr(self.lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        self._keep: list[Any] = []  # results of pending launch_read calls, and staging

    # -- plumbing

    def call(self, name: str, *args: Any) -> int:
        """Call a function by name; return its CUresult unchecked."""
        return getattr(self.lib, name)(*args)

    def _ok(self, name: str, *args: Any) -> None:
        rc = self.call(name, *args)
        if rc != CUDA_SUCCESS:
            raise CudaError(rc, name)

    # -- init and devices

    def init(self, flags: int = 0) -> None:
        self._ok("cuInit", flags)

    def driver_version(self) -> int:
        v = ctypes.c_int()
        self._ok("cuDriverGetVersion", ctypes.byref(v))
        return v.value

    def error_name(self, rc: int) -> str | None:
        """The driver's name of rc (None if it does not know it)."""
        s = ctypes.c_char_p()
        self.call("cuGetErrorName", rc, ctypes.byref(s))
        return s.value.decode() if s.value is not None else None

    def error_string(self, rc: int) -> str | None:
        s = ctypes.c_char_p()
        self.call("cuGetErrorString", rc, ctypes.byref(s))
        return s.value.decode() if s.value is not None else None

    def device_count(self) -> int:
        n = ctypes.c_int()
        self._ok("cuDeviceGetCount", ctypes.byref(n))
        return n.value

    def device_get(self, ordinal: int) -> int:
        d = ctypes.c_int()
        self._ok("cuDeviceGet", ctypes.byref(d), ordinal)
        return d.value

    def device_attribute(self, attribute: int, device: int = 0) -> int:
        v = ctypes.c_int()
        self._ok("cuDeviceGetAttribute", ctypes.byref(v), attribute, device)
        return v.value

    def device_uuid(self, device: int = 0) -> bytes:
        u = CUuuid()
        self._ok("cuDeviceGetUuid", ctypes.byref(u), device)
        return bytes(u.bytes)

    def device_uuid_v2(self, device: int = 0) -> bytes:
        u = CUuuid()
        self._ok("cuDeviceGetUuid_v2", ctypes.byref(u), device)
        return bytes(u.bytes)

    def can_access_peer(self, device: int, peer: int) -> int:
        v = ctypes.c_int()
        self._ok("cuDeviceCanAccessPeer", ctypes.byref(v), device, peer)
        return v.value

    def device_name(self, device: int = 0) -> str:
        buf = ctypes.create_string_buffer(256)
        self._ok("cuDeviceGetName", buf, len(buf), device)
        return buf.value.decode()

    # -- contexts

    def primary_ctx_retain(self, device: int = 0) -> int:
        c = ctypes.c_void_p()
        self._ok("cuDevicePrimaryCtxRetain", ctypes.byref(c), device)
        return c.value or 0

    def primary_ctx_release(self, device: int = 0) -> None:
        self._ok("cuDevicePrimaryCtxRelease_v2", device)

    def ctx_push(self, ctx: int) -> None:
        self._ok("cuCtxPushCurrent_v2", ctx)

    def ctx_pop(self) -> int:
        c = ctypes.c_void_p()
        self._ok("cuCtxPopCurrent_v2", ctypes.byref(c))
        return c.value or 0

    def ctx_synchronize(self) -> None:
        self._ok("cuCtxSynchronize")

    def setup(self, device: int = 0) -> int:
        """cuInit, retain device's primary context and push it on this thread."""
        self.init()
        ctx = self.primary_ctx_retain(device)
        self.ctx_push(ctx)
        return ctx

    # -- memory

    def mem_alloc(self, nbytes: int) -> int:
        p = ctypes.c_ulonglong()
        self._ok("cuMemAlloc_v2", ctypes.byref(p), nbytes)
        return p.value

    def mem_free(self, dptr: int) -> None:
        self._ok("cuMemFree_v2", dptr)

    def _host_ptr(self, src: HostSrc) -> int | ctypes.c_char_p:
        if isinstance(src, int):
            return src
        if isinstance(src, bytes):
            return ctypes.c_char_p(src)
        buf = (ctypes.c_char * len(src)).from_buffer(src)
        return ctypes.addressof(buf)

    def memcpy_htod_async(self, dst: int, src: HostSrc, nbytes: int | None = None,
                          stream: int = 0) -> None:
        """Queue a copy of host src (an address, or a buffer) to device dst."""
        if nbytes is None:
            nbytes = len(src)  # type: ignore[arg-type]
        self._ok("cuMemcpyHtoDAsync_v2", dst, self._host_ptr(src), nbytes, stream)

    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream: int = 0) -> None:
        self._ok("cuMemcpyDtoDAsync_v2", dst, src, nbytes, stream)

    def mem_host_register(self, ptr: int, nbytes: int, flags: int = 0) -> None:
        self._ok("cuMemHostRegister_v2", ptr, nbytes, flags)

    def mem_host_unregister(self, ptr: int) -> None:
        self._ok("cuMemHostUnregister", ptr)

    def read(self, dptr: int, nbytes: int) -> bytes:
        """The bytes at a device pointer (the double's device memory is mapped here)."""
        return ctypes.string_at(dptr, nbytes)

    def write(self, dptr: int, data: bytes) -> None:
        """Store bytes at a device pointer directly (not through a stream)."""
        ctypes.memmove(dptr, data, len(data))

    # -- streams and events

    def stream_create(self, flags: int = 0) -> int:
        s = ctypes.c_void_p()
        self._ok("cuStreamCreate", ctypes.byref(s), flags)
        return s.value or 0

    def stream_destroy(self, stream: int) -> None:
        self._ok("cuStreamDestroy_v2", stream)

    def stream_synchronize(self, stream: int = 0) -> None:
        self._ok("cuStreamSynchronize", stream)

    def stream_wait_event(self, stream: int, event: int, flags: int = 0) -> None:
        self._ok("cuStreamWaitEvent", stream, event, flags)

    def event_create(self, flags: int = CU_EVENT_DISABLE_TIMING) -> int:
        e = ctypes.c_void_p()
        self._ok("cuEventCreate", ctypes.byref(e), flags)
        return e.value or 0

    def event_destroy(self, event: int) -> None:
        self._ok("cuEventDestroy_v2", event)

    def event_record(self, event: int, stream: int = 0) -> None:
        self._ok("cuEventRecord", event, stream)

    def event_query(self, event: int) -> bool:
        """True if complete, False on CUDA_ERROR_NOT_READY."""
        rc = self.call("cuEventQuery", event)
        if rc == CUDA_ERROR_NOT_READY:
            return False
        if rc != CUDA_SUCCESS:
            raise CudaError(rc, "cuEventQuery")
        return True

    def event_synchronize(self, event: int) -> None:
        self._ok("cuEventSynchronize", event)

    # -- IPC

    def ipc_get_mem_handle(self, dptr: int) -> bytes:
        h = CUipcMemHandle()
        self._ok("cuIpcGetMemHandle", ctypes.byref(h), dptr)
        return bytes(h.reserved)

    def ipc_open_mem_handle(self, handle: bytes,
                            flags: int = CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) -> int:
        h = CUipcMemHandle()
        ctypes.memmove(h.reserved, bytes(handle)[:64], min(64, len(handle)))
        p = ctypes.c_ulonglong()
        self._ok("cuIpcOpenMemHandle_v2", ctypes.byref(p), h, flags)
        return p.value

    def ipc_close_mem_handle(self, dptr: int) -> None:
        self._ok("cuIpcCloseMemHandle", dptr)

    def ipc_get_event_handle(self, event: int) -> bytes:
        h = CUipcEventHandle()
        self._ok("cuIpcGetEventHandle", ctypes.byref(h), event)
        return bytes(h.reserved)

    def ipc_open_event_handle(self, handle: bytes) -> int:
        h = CUipcEventHandle()
        ctypes.memmove(h.reserved, bytes(handle)[:64], min(64, len(handle)))
        e = ctypes.c_void_p()
        self._ok("cuIpcOpenEventHandle", ctypes.byref(e), h)
        return e.value or 0

    # -- test-only exports

    def launch_read(self, stream: int, dptr: int, nbytes: int,
                    delay_us: int = 0) -> ctypes.c_ulonglong:
        """Queue the fake checksum kernel; read ``.value`` of the result after a sync."""
        out = ctypes.c_ulonglong(0)
        self._keep.append(out)
        self._ok("fakecuda_launch_read", stream, dptr, nbytes, ctypes.byref(out), delay_us)
        return out

    def counter(self, op: str) -> int:
        """How often this process performed op (-1 for a name the double does not know)."""
        return self.lib.fakecuda_counter(op.encode())

    def launch_sleep(self, stream: int, delay_us: int) -> None:
        """Queue a slow kernel touching nothing: later work on the stream waits for it."""
        self._ok("fakecuda_launch_sleep", stream, delay_us)

    def launch_gate(self, stream: int) -> ctypes.c_int:
        """Queue a kernel that runs until the returned cell's ``.value`` is set to 1:
        later work on the stream waits for the host to open the gate."""
        gate = ctypes.c_int(0)
        self._keep.append(gate)
        self._ok("fakecuda_launch_gate", stream, ctypes.byref(gate))
        return gate

    def begin_capture(self, stream: int, mode: int = CU_STREAM_CAPTURE_MODE_GLOBAL) -> None:
        """Mark the stream as capturing (simulated: its work still runs)."""
        self._ok("fakecuda_begin_capture", stream, mode)

    def end_capture(self, stream: int) -> bool:
        """End the capture; True if it was still valid (nothing invalidated it)."""
        rc = self.call("fakecuda_end_capture", stream)
        if rc not in (CUDA_SUCCESS, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED):
            raise CudaError(rc, "fakecuda_end_capture")
        return rc == CUDA_SUCCESS

    def stream_is_capturing(self, stream: int) -> int:
        """The stream's CUstreamCaptureStatus (CudaError with
        CUDA_ERROR_STREAM_CAPTURE_IMPLICIT for the legacy stream during a blocking capture)."""
        v = ctypes.c_int(-1)
        self._ok("cuStreamIsCapturing", stream, ctypes.byref(v))
        return v.value

    def ctx_record_event(self, ctx: int, event: int) -> None:
        self._ok("cuCtxRecordEvent", ctx, event)

    def exchange_capture_mode(self, mode: int) -> int:
        """Set this thread's capture mode; return the previous one."""
        m = ctypes.c_int(mode)
        self._ok("cuThreadExchangeStreamCaptureMode", ctypes.byref(m))
        return m.value


def fnv1a(data: bytes) -> int:
    """FNV-1a 64, as fakecuda_launch_read computes it."""
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def tuple_leaf_sum(v: int) -> int:
    """FNV-1a of leaf 0 of the "tuple" batch that encodes v (tests/roles.py make_batch): a
    float32 (4, 8) tensor filled with v, as fakecuda_launch_read sums it."""
    import numpy as np

    return fnv1a(np.full((4, 8), v, np.float32).tobytes())


def open_gate_when_published(ring: Any, gate: Any, seq: int, timeout: float) -> None:
    """Open gate (launch_gate's cell) once the producer of ring published entry seq, which
    reuses the slot of an entry that many slots earlier (the bug a test looks for: that
    slot was handed back under the gated work), or after timeout seconds if it cannot
    (the fix: the slot stayed held)."""
    deadline = time.monotonic() + timeout
    while ring.info()["published"] <= seq and time.monotonic() < deadline:
        time.sleep(0.005)
    gate.value = 1


def take_a_round(it: Iterator, ring: Any, gate: Any, slots: int, timeout: float) -> list:
    """Take `slots` more batches of the consumer iterator it, the last of them in the slot
    of the one taken before them, while a thread opens gate once the producer published
    that entry (open_gate_when_published); the batches taken."""
    opener = threading.Thread(target=open_gate_when_published,
                              args=(ring, gate, slots, timeout))
    opener.start()
    try:
        return [next(it) for _ in range(slots)]
    finally:
        opener.join()


# ---- host memory with chosen protection (via libc) -----------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_PROT_READ, _PROT_WRITE = 1, 2
_MAP_PRIVATE, _MAP_ANONYMOUS = 0x02, 0x20


def host_mmap(nbytes: int, fill: int = 0) -> int:
    """A fresh page-aligned, writable anonymous host mapping (filled with a byte value)."""
    p = _libc.mmap(None, nbytes, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
    if p is None or p == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), "mmap failed")
    if fill:
        ctypes.memset(p, fill, nbytes)
    return p


def host_protect(ptr: int, nbytes: int, writable: bool) -> None:
    """mprotect a host mapping read-only or read-write."""
    prot = _PROT_READ | (_PROT_WRITE if writable else 0)
    if _libc.mprotect(ptr, nbytes, prot) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed")


def host_munmap(ptr: int, nbytes: int) -> None:
    if _libc.munmap(ptr, nbytes) != 0:
        raise OSError(ctypes.get_errno(), "munmap failed")


def in_thread(fn: Callable[[], Any]) -> Any:
    """Run fn in a new thread (no context pushed there); its result, or the CUresult of
    the CudaError it raised."""
    box: list[Any] = []

    def body() -> None:
        try:
            box.append(fn())
        except CudaError as e:
            box.append(e.rc)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return box[0]


# ---- agents: child processes driven by a test ------------------------------------------------


class AgentError(RuntimeError):
    """A snippet raised something other than CudaError in the agent (message: its traceback)."""


def _encode(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": bytes(value).hex()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return bytes.fromhex(value["__bytes__"])
        return {k: _decode(v) for k, v in value.items()}
    return value


class Agent:
    """A child process that loads the double as ``fc`` (a FakeCuda) and runs the Python
    snippets a test sends it, one at a time, in one namespace. A snippet whose last
    statement is an expression returns its value (bytes, ints, strings, lists...); a
    CudaError raised in the child is raised again here with its rc. The namespace also
    holds ``fakecuda`` (this module), ``ctypes``, ``os``, ``threading``, ``time`` and
    ``pid``."""

    def __init__(self, lib_path: Path | str, env: dict[str, str] | None = None,
                 timeout: float = 20.0) -> None:
        self.timeout = timeout
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "agent", str(lib_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})},
            cwd=ROOT,
        )
        self._buf = b""
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, code: str) -> None:
        """Start running a snippet without waiting for its result (see recv)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(code).encode() + b"\n")
        self.proc.stdin.flush()

    def _readline(self, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sel.select(left):
                raise TimeoutError(f"agent {self.pid}: no reply in {timeout} s")
            chunk = os.read(self.proc.stdout.fileno(), 65536)  # type: ignore[union-attr]
            if not chunk:
                err = self.proc.stderr.read().decode(errors="replace")  # type: ignore[union-attr]
                raise AgentError(f"agent {self.pid} exited ({self.proc.wait()}):\n{err}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def recv(self, timeout: float | None = None) -> Any:
        """The result of the oldest snippet sent and not yet received."""
        reply = json.loads(self._readline(self.timeout if timeout is None else timeout))
        if "cuda" in reply:
            raise CudaError(reply["cuda"], reply["func"])
        if "error" in reply:
            raise AgentError(f"in agent {self.pid}:\n{reply['error']}")
        return _decode(reply["ok"])

    def ready(self, timeout: float = 0.0) -> bool:
        """Whether a reply is waiting (without consuming it)."""
        return b"\n" in self._buf or bool(self._sel.select(timeout))

    def __call__(self, code: str, timeout: float | None = None) -> Any:
        self.send(code)
        return self.recv(timeout)

    def rc(self, code: str) -> int:
        """Run a snippet; the CUresult of the CudaError it raised, or 0."""
        try:
            self(code)
        except CudaError as e:
            return e.rc
        return CUDA_SUCCESS

    def close(self, timeout: float = 10.0) -> int:
        """Let the child exit normally (its library destructor runs); kill it if it hangs."""
        if self.proc.poll() is None:
            try:
                self.send("__exit__")
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._sel.close()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the child (no destructor: its shm objects stay in /dev/shm)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def _run_snippet(code: str, ns: dict[str, Any]) -> Any:
    """Execute code in ns; the value of its last statement if that is an expression."""
    tree = ast.parse(code, "<snippet>")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<snippet>", "exec"), ns)
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), "<snippet>", "eval"), ns)


def _agent_main(lib_path: str) -> int:
    """The child side of Agent: read JSON snippets from stdin, reply on the original stdout."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # prints of snippets go to stderr
    sys.stdout = sys.stderr
    ns: dict[str, Any] = {
        "fc": FakeCuda(lib_path), "fakecuda": sys.modules[__name__], "ctypes": ctypes,
        "os": os, "threading": threading, "time": time, "pid": os.getpid(),
    }
    for line in sys.stdin:
        code = json.loads(line)
        if code == "__exit__":
            break
        try:
            reply: dict[str, Any] = {"ok": _encode(_run_snippet(code, ns))}
        except CudaError as e:
            reply = {"cuda": e.rc, "func": e.func}
        except Exception:
            reply = {"error": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "agent":
        sys.exit(_agent_main(sys.argv[2]))
    sys.exit(f"usage: {sys.argv[0]} agent LIBFAKECUDA")
