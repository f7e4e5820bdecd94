"""The producer's DataLoader workers get steady malloc heaps (worker_heap_pad=).

End to end: a producer process runs a real DataLoader with two workers; each worker
reports whether its first 20 MiB block came from the brk heap (glibc mmaps a block that
size by default) and whether the loader's own worker_init_fn ran; a consumer in this
process receives what they reported.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from roles import HeapProbeDataset, mark_worker_init
from tensorsocket import TensorConsumer, TensorProducer, config
from tensorsocket.loader.worker_heap import PaddedWorkerInit, glibc_mallopt, padded_workers

pytestmark = pytest.mark.skipif(glibc_mallopt() is None, reason="glibc only")
# Under ASan (scripts/test-sanitized.sh) malloc is ASan's allocator: glibc's mallopt does not
# govern it, so where a block comes from says nothing about the padding.
glibc_malloc = pytest.mark.skipif(os.environ.get("TENSORSOCKET_SANITIZE") == "1",
                                  reason="ASan replaces glibc's malloc")

SAMPLES = 16


def _received(procs, name: str, pad: int | None) -> tuple[torch.Tensor, dict]:
    """Rows (sample, first block from the heap, own init ran) of one epoch, and the
    producer's report."""
    args = ["--name", name, "--kind", "heap-probe", "--samples", str(SAMPLES),
            "--loader-bs", "4"]
    if pad is not None:
        args += ["--worker-heap-pad", str(pad)]
    producer = procs.start("producer", *args)
    procs.wait_ready(producer)
    with TensorConsumer(name=name, timeout=30) as consumer:
        rows = torch.cat([batch.clone() for batch in consumer])
    return rows, procs.result(producer)


@glibc_malloc
def test_workers_pad_their_heaps_by_default(procs, name):
    rows, report = _received(procs, name, None)
    assert rows[:, 0].tolist() == list(range(SAMPLES))
    assert rows[:, 1].tolist() == [1] * SAMPLES, "a worker's first 20 MiB block was mmapped"
    assert rows[:, 2].tolist() == [1] * SAMPLES, "the loader's own worker_init_fn did not run"
    assert report["loader_worker_init_fn"] == "mark_worker_init"  # put back after iter()


@glibc_malloc
def test_worker_heap_pad_zero_leaves_glibc_defaults(procs, name):
    rows, report = _received(procs, name, 0)
    assert rows[:, 0].tolist() == list(range(SAMPLES))
    # glibc's default: a worker's first block above its inherited mmap threshold is mapped.
    assert rows[:, 1].tolist() == [0] * SAMPLES
    assert rows[:, 2].tolist() == [1] * SAMPLES
    assert report["loader_worker_init_fn"] == "mark_worker_init"


def test_padded_workers_wraps_only_while_iter_starts_workers():
    loader = torch.utils.data.DataLoader(HeapProbeDataset(4), batch_size=2, num_workers=1,
                                         worker_init_fn=mark_worker_init)
    with padded_workers(loader, 1 << 20) as padded:
        assert padded
        wrapper = loader.worker_init_fn
        assert isinstance(wrapper, PaddedWorkerInit)
        assert (wrapper.top_pad, wrapper.inner) == (1 << 20, mark_worker_init)
        with padded_workers(loader, 1 << 20) as again:  # no second layer
            assert again and loader.worker_init_fn is wrapper
        assert loader.worker_init_fn is wrapper
    assert loader.worker_init_fn is mark_worker_init
    # spawn and forkserver workers receive it pickled
    clone = pickle.loads(pickle.dumps(wrapper))
    assert (clone.top_pad, clone.inner) == (1 << 20, mark_worker_init)


@pytest.mark.parametrize("loader, pad", [
    (torch.utils.data.DataLoader(HeapProbeDataset(4), num_workers=0), 1 << 20),  # no workers
    ([torch.zeros(2)], 1 << 20),  # not a DataLoader
    (torch.utils.data.DataLoader(HeapProbeDataset(4), num_workers=1), 0),  # turned off
])
def test_padded_workers_leaves_other_loaders_alone(loader, pad):
    before = getattr(loader, "worker_init_fn", None)
    with padded_workers(loader, pad) as padded:
        assert not padded
        assert getattr(loader, "worker_init_fn", None) is before


def test_worker_heap_pad_setting(monkeypatch, name):
    assert config.get("worker_heap_pad", environ={}) == 16 << 20
    for text, value in (("off", 0), ("0", 0), ("4M", 4 << 20), ("65536", 65536)):
        assert config.get("worker_heap_pad", environ={"TENSORSOCKET_WORKER_HEAP_PAD": text}) \
            == value
    with pytest.raises(ValueError, match="TENSORSOCKET_WORKER_HEAP_PAD='-1'.*bytes >= 0"):
        config.get("worker_heap_pad", environ={"TENSORSOCKET_WORKER_HEAP_PAD": "-1"})
    for bad in (-1, 1.5, "16M", True):
        with pytest.raises(ValueError, match="worker_heap_pad=.* takes a number of bytes"):
            TensorProducer([torch.zeros(1)], name=name, worker_heap_pad=bad)
    monkeypatch.setenv("TENSORSOCKET_WORKER_HEAP_PAD", "2M")
    with TensorProducer([torch.zeros(1)], name=name, min_consumers=0) as producer:
        assert producer.worker_heap_pad == 2 << 20
