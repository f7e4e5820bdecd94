"""Two GPUs and MIG, end to end, on the CUDA driver test double (no GPU needed).

Real producer and consumer processes load csrc/tests/fake_cuda.c instead of libcuda. The
double's FAKECUDA_NO_PEER makes pairs of GPUs without peer access (cuDeviceCanAccessPeer
gives 0, and cuIpcOpenMemHandle refuses their memory as a real driver would), its
FAKECUDA_MIG_GPUS makes MIG instances (their own cuDeviceGetUuid_v2 UUID, their parent
GPU's cuDeviceGetUuid one, no peer access), FAKECUDA_VISIBLE reorders the devices a process
sees (CUDA_VISIBLE_DEVICES), and a build without cuDeviceGetUuid_v2 stands for a driver
older than CUDA 11.4. A consumer must import the pool only where its GPU can map it, tell
MIG instances apart, and otherwise fall back to host delivery with a GPUFallbackWarning
naming both GPUs; every batch stays correct.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import fakecuda

BATCHES, EPOCHS, SLOTS = 12, 2, 4
TESTS = Path(__file__).resolve().parent

# A consumer (tests/roles.py) whose copies of host batches to a GPU are left out: this
# machine may have no GPU for torch. The host tensors stay as they were in the ring, so the
# batches are still checked; the delivery's device says where they would have been copied.
HOST_COPY_CONSUMER = r"""
import sys
sys.path.insert(0, sys.argv[1])
import roles
from tensorsocket.data import delivery

def _to_device(self, leaves, kinds):
    return leaves

delivery.Delivery._to_device = _to_device
sys.argv = ["roles.py", "consumer", *sys.argv[2:]]
roles.main()
"""


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, Path]:
    """The double, and its build without cuDeviceGetUuid_v2 (an old driver)."""
    out = tmp_path_factory.mktemp("fakecuda-peer")
    try:
        return {"new": fakecuda.build(out),
                "old": fakecuda.build(out, extra=fakecuda.OLD_DRIVER_FLAGS,
                                      name="libfakecuda-old.so")}
    except fakecuda.NoCompiler as e:
        pytest.skip(f"no C compiler for the CUDA test double: {e}")


@pytest.fixture(params=["new"])
def gpu_env(request, libs, tmp_path):
    """Environment of processes on the double, with a call log; checks no leftovers."""
    with fakecuda.checked_env(libs[request.param], tmp_path / "cuda.log",
                              FAKECUDA_OP_DELAY_US="200") as env:
        yield env


def _run(procs, name, env, *, producer_env=None, consumer_env=None, device=None,
         gpu_double=False):
    """A producer on its cuda:0 and one consumer; return (producer, consumer) results."""
    p = procs.start("producer", "--name", name, "--epochs", str(EPOCHS), "--batches",
                    str(BATCHES), "--slots", str(SLOTS), "--min-consumers", "1",
                    "--device", "cuda:0", env={**env, **(producer_env or {})})
    procs.wait_ready(p)
    args = ["--name", name, "--epochs", str(EPOCHS)]
    args += ["--device", device] if device else []
    args += ["--gpu-double"] if gpu_double else []
    cenv = {**env, **(consumer_env or {})}
    if gpu_double:
        c = procs.start("consumer", *args, env=cenv)
    else:
        c = procs.script(HOST_COPY_CONSUMER, str(TESTS), *args, env=cenv)
    return procs.result(p), procs.result(c), c.pid


def _expected():
    return [[e * 1000 + b for b in range(BATCHES)] for e in range(EPOCHS)]


def _uuid_hex(text: bytes) -> str:
    return text.hex()


def _consumer_ops(env, pid, op):
    return fakecuda.select(fakecuda.parse_log(env["FAKECUDA_LOG"]), op, pid=pid)


def _assert_fell_back(c, device, *words):
    """Correct batches through host memory, one GPUFallbackWarning with these words."""
    assert c["errors"] == [] and c["epochs"] == _expected()
    assert c["stats"]["device"] == device and c["stats"]["zero_copy_gpu"] is False
    reason = c["stats"]["device_fallback_reason"]
    for w in words:
        assert w in reason, reason
    warned = [w for w in c["warnings"] if w.startswith("GPUFallbackWarning")]
    assert len(warned) == 1 and reason in warned[0], c["warnings"]


@pytest.mark.parametrize("no_peer", ["0-1", "all"])
def test_consumer_without_peer_access_falls_back(procs, name, gpu_env, no_peer):
    """device='cuda:1' where GPU 1 cannot access GPU 0's memory: the consumer asks
    cuDeviceCanAccessPeer before opening anything, never maps the pool, and reads the host
    copy (to be copied into cuda:1) with a warning naming both GPUs."""
    env = {**gpu_env, "FAKECUDA_DEVICES": "2", "FAKECUDA_NO_PEER": no_peer}
    prod, c, cpid = _run(procs, name, env, device="cuda:1")
    assert prod["stats"]["device"] == "cuda:0"
    _assert_fell_back(c, "cuda:1", "GPU 1 (Fake CUDA Device 1) cannot read the memory of "
                      "GPU 0 (Fake CUDA Device 0)", "cuDeviceCanAccessPeer")
    (asked,) = _consumer_ops(env, cpid, "can_access_peer")
    assert (asked["dev"], asked["peer"], asked["value"]) == ("1", "0", "0")
    assert _consumer_ops(env, cpid, "ipc_open_mem") == []
    assert _consumer_ops(env, cpid, "ipc_open_event") == []


def test_consumer_with_peer_access_imports(procs, name, gpu_env):
    """device='cuda:1' where GPU 1 can access GPU 0: checked, then imported in place."""
    env = {**gpu_env, "FAKECUDA_DEVICES": "2"}
    prod, c, cpid = _run(procs, name, env, device="cuda:1", gpu_double=True)
    assert c["errors"] == [] and c["epochs"] == _expected() and c["warnings"] == []
    assert c["stats"]["device"] == "cuda:1" and c["stats"]["zero_copy_gpu"] is True
    log = fakecuda.parse_log(env["FAKECUDA_LOG"])
    mine = [line for line in log if line.pid == cpid]
    asked = [i for i, line in enumerate(mine) if line.op == "can_access_peer"]
    opens = [i for i, line in enumerate(mine) if line.op == "ipc_open_mem"]
    assert len(asked) == 1 and mine[asked[0]]["value"] == "1"
    assert len(opens) == SLOTS and asked[0] < min(opens)
    assert all(mine[i]["peer"] == "1" for i in opens)


def test_no_peer_access_found_by_uuid_in_reordered_visibility(procs, name, gpu_env):
    """Producer and consumers number the GPUs differently (CUDA_VISIBLE_DEVICES): the pool's
    GPU is found by UUID in the consumer's own numbering, and peer access is asked about
    that one. Physical GPU 2 holds the pool; 0 has no peer access to it, 1 has."""
    env = {**gpu_env, "FAKECUDA_DEVICES": "3", "FAKECUDA_NO_PEER": "0-2"}
    prod, c, cpid = _run(procs, name, env, producer_env={"FAKECUDA_VISIBLE": "2,0,1"},
                         consumer_env={"FAKECUDA_VISIBLE": "1,0,2"}, device="cuda:1")
    # The consumer's cuda:1 is physical GPU 0, its cuda:2 the pool's physical GPU 2.
    _assert_fell_back(c, "cuda:1", "GPU 1 (Fake CUDA Device 0) cannot read the memory of "
                      "GPU 2 (Fake CUDA Device 2)")
    (asked,) = _consumer_ops(env, cpid, "can_access_peer")
    assert (asked["phys"], asked["peer_phys"], asked["value"]) == ("0", "2", "0")
    assert _consumer_ops(env, cpid, "ipc_open_mem") == []

    name2 = name + "-b"
    prod, c, cpid = _run(procs, name2, env, producer_env={"FAKECUDA_VISIBLE": "2,0,1"},
                         consumer_env={"FAKECUDA_VISIBLE": "1,0,2"}, device="cuda:0",
                         gpu_double=True)
    assert c["errors"] == [] and c["epochs"] == _expected()
    assert c["stats"]["device"] == "cuda:0" and c["stats"]["zero_copy_gpu"] is True
    (asked,) = _consumer_ops(env, cpid, "can_access_peer")
    assert (asked["phys"], asked["peer_phys"], asked["value"]) == ("1", "2", "1")


MIG = {"FAKECUDA_DEVICES": "2", "FAKECUDA_MIG_GPUS": "0,0"}  # two instances of GPU 0


def test_mig_instance_does_not_import_another_instances_pool(procs, name, gpu_env):
    """The pool is on MIG instance A. A consumer that sees only instance B (as with
    CUDA_VISIBLE_DEVICES=MIG-<uuid>) must not take B for the pool's GPU (they share the
    v1 UUID): the segment names A by its v2 UUID, which this consumer cannot see, so it
    reads the host copy and never tries to map A's memory."""
    env = {**gpu_env, **MIG}
    prod, c, cpid = _run(procs, name, env, consumer_env={"FAKECUDA_VISIBLE": "1"})
    assert c["ring_info"]["device_uuid"] == _uuid_hex(b"fakecuda-mig-00\0")
    _assert_fell_back(c, "cpu", "not visible to this process")
    assert _consumer_ops(env, cpid, "ipc_open_mem") == []


def test_mig_instance_asked_for_by_ordinal_falls_back(procs, name, gpu_env):
    """A consumer that sees both instances and asks for device='cuda:1' (instance B) is on
    another device than the pool's (A), with no peer access between MIG instances: it
    falls back naming both, where the v1 UUID would have called them the same GPU."""
    env = {**gpu_env, **MIG}
    prod, c, cpid = _run(procs, name, env, device="cuda:1")
    _assert_fell_back(c, "cuda:1", "GPU 1 (Fake CUDA Device 1) cannot read the memory of "
                      "GPU 0 (Fake CUDA Device 0)")
    assert _consumer_ops(env, cpid, "ipc_open_mem") == []


def test_mig_pool_found_by_v2_uuid_in_reordered_visibility(procs, name, gpu_env):
    """The producer sees instance B as its cuda:0, the consumer sees it as cuda:1 (after A):
    the consumer finds B by its v2 UUID and imports the pool in place (by the shared v1
    UUID it would take A, the first match, and fail to map)."""
    env = {**gpu_env, **MIG}
    prod, c, cpid = _run(procs, name, env, producer_env={"FAKECUDA_VISIBLE": "1,0"},
                         gpu_double=True)
    assert c["errors"] == [] and c["epochs"] == _expected() and c["warnings"] == []
    assert c["stats"]["device"] == "cuda:1" and c["stats"]["zero_copy_gpu"] is True
    opens = _consumer_ops(env, cpid, "ipc_open_mem")
    assert len(opens) == SLOTS and all(line["peer"] == "0" for line in opens)


@pytest.mark.parametrize("gpu_env", ["old"], indirect=True)
def test_old_driver_without_uuid_v2(procs, name, gpu_env):
    """A driver without cuDeviceGetUuid_v2 (before CUDA 11.4): devices are identified by
    cuDeviceGetUuid; a consumer on the pool's GPU imports it, and one on a GPU without
    peer access still falls back."""
    env = {**gpu_env, "FAKECUDA_DEVICES": "2", "FAKECUDA_NO_PEER": "0-1"}
    prod, c, cpid = _run(procs, name, env, gpu_double=True)
    assert c["errors"] == [] and c["epochs"] == _expected() and c["warnings"] == []
    assert c["stats"]["zero_copy_gpu"] is True
    assert c["ring_info"]["device_uuid"] == _uuid_hex(b"fakecuda-phys-00")
    prod, c, cpid = _run(procs, name + "-b", env, device="cuda:1")
    _assert_fell_back(c, "cuda:1", "cannot read the memory of GPU 0", "cuDeviceCanAccessPeer")
    log = fakecuda.parse_log(env["FAKECUDA_LOG"])
    assert [line for line in log if line.op == "device_uuid_v2"] == []
    assert [line for line in log if line.op == "device_uuid"]


def test_devices_are_described_by_v2_uuid(gpu_env):
    """gpu_status() (and the consumer's own same-GPU test for peer_access=False) names each
    MIG instance by its own UUID, not the parent GPU's that both share."""
    import json
    import subprocess
    import sys

    code = ("import json; from tensorsocket import _core; "
            "print(json.dumps([d['uuid'] for d in _core.cuda_status()['devices']]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **gpu_env, **MIG, "FAKECUDA_LOG": ""},
                         timeout=60, check=True)
    assert json.loads(out.stdout) == [_uuid_hex(b"fakecuda-mig-00\0"),
                                      _uuid_hex(b"fakecuda-mig-01\0")]
