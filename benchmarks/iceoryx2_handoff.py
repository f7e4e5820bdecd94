"""The handoff benchmark through iceoryx2 (PyPI ``iceoryx2``): Python publish-subscribe
with a WaitSet, as a peer of handoff.py.

    python benchmarks/iceoryx2_handoff.py [--quick] [--kinds tiny,32MiB] [--consumers 1,2,4]
                                          [--repeats 3] [--json out.json]

The same workloads as handoff.py (handoff_common: the same batches and counter stamps,
batch counts, consumer touch and check, timing from each consumer's first batch to its
last), through one iceoryx2 publish-subscribe service. One producer process and N
consumer processes (children of this script, hidden roles ``_iproducer`` /
``_iconsumer``):

  - The service's payload is a slice of 8-byte words (``iox2.Slice[ctypes.c_uint64]``,
    so the payload is 8-byte aligned for the int64 and float32 leaves) sized to the batch:
    576 bytes tiny, 32 MiB large. The producer loans a slice per batch
    (``loan_slice_uninit``), copies the loader's leaves into it (``np.copyto`` into numpy
    views of the loaned chunk: the one copy, as ours and the floor make), sends it, and
    notifies an event service of the same name (``Notifier.notify()``) so that the
    subscribers wake.
  - Each consumer attaches its event ``Listener`` to a ``WaitSet``, waits on it, drains
    the listener's events (``try_wait``) and then every queued sample
    (``Subscriber.receive``). Per sample it makes the batch's torch tensors over the
    payload without copying (``torch.from_numpy`` of numpy arrays over the chunk, made
    per batch as shm_pipe_handoff.py makes them), touches and checks them exactly as
    handoff.py's consumers do (handoff_common.Tally), drops them and releases the sample
    (``Sample.delete()``).

Lossless, like ours: ``enable_safe_overflow(False)`` on the service and
``BackpressureStrategy.RetryUntilDelivered`` on the publisher make a send to a subscriber
whose queue is full wait (iceoryx2's adaptive wait: sched_yield up to 10000 times, then
sleeps of 100 us, then 10 ms) instead of dropping or overwriting the oldest sample. Each
subscriber's queue holds SUBSCRIBER_BUFFER = handoff_common.PEER_QUEUE (4) samples and it
borrows one at a time, the publisher loans one: its data segment holds 6 samples at one
subscriber, 5N + 1 at N (ours: handoff_common.RING_SLOTS = 6 ring slots at every N); no
history. The producer waits (START_TIMEOUT)
until all N subscribers and their listeners are connected before it sends batch 0, and
after the last batch it notifies END_EVENT; a consumer that sees END_EVENT drains its
queue and stops. The producer then waits (JOIN_TIMEOUT) until every subscriber has left
before it drops the service.

Every run has its own iceoryx2 configuration: file prefix ``tsb-iox2-<pid>-<tag>_`` and
root directory ``<tmp>/tsb-iox2-<pid>-<tag>/`` (instead of the default ``iox2_`` and
``/tmp/iceoryx2/``), so that the orchestrator removes exactly that run's files afterwards
(the root directory, and ``/dev/shm/<prefix>*``: data segment, dynamic configs,
connections, event management) whatever state the children ended in.

Where ``import iceoryx2`` fails, the suite is skipped: a line says so and why, and the
document has ``skipped`` (the reason) and no results; this script then exits 0.
``python benchmarks/handoff.py --with-iceoryx2`` runs this suite interleaved with ours
(per configuration and repeat) and prints one comparison table. The document's schema is
handoff.py's; consumer reports are handoff.py's, the producer report has batches, seconds,
cpu_seconds and drained (every subscriber left within JOIN_TIMEOUT).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (  # noqa: E402
    cpu_seconds, dispatch, harness, machine_info, report, stop_all, tail, unwind_on_sigterm,
    write_json,
)
from handoff_common import (  # noqa: E402
    PEER_QUEUE, SCHEMA, CountingLoader, Tally, add_common_options, batch_bytes,
    check_reports, child_parser, make_batch, parse_common, print_table, run_suite,
)

SUBSCRIBER_BUFFER = PEER_QUEUE  # samples a subscriber's queue holds before the publisher waits
END_EVENT = 1  # event id notified after the last batch (a plain notify(), id 0: one was sent)
WORD = ctypes.c_uint64  # the slice's element: 8 bytes, so the payload is 8-byte aligned

READY_TIMEOUT = 60.0  # producer process up, its service created
START_TIMEOUT = 60.0  # producer waits this long for N subscribers and listeners
BATCH_TIMEOUT = 60.0  # consumer waits this long on its WaitSet for one batch
JOIN_TIMEOUT = 60.0  # producer waits this long for the subscribers to leave
RUN_TIMEOUT = 600.0  # one whole configuration, from the orchestrator
POLL = 0.001  # seconds between looks at the service's subscriber count


def unavailable() -> str | None:
    """Why iceoryx2 cannot be used here (None if `import iceoryx2` works)."""
    try:
        import iceoryx2  # noqa: F401
    except Exception as e:  # ImportError, or a broken wheel
        return f"import iceoryx2 failed: {type(e).__name__}: {e}"
    return None


def version() -> str:
    """The installed iceoryx2's version ("?" if its metadata is missing)."""
    from importlib import metadata

    try:
        return metadata.version("iceoryx2")
    except metadata.PackageNotFoundError:
        return "?"


def label() -> str:
    """The implementation's name in the document: iceoryx2 <major.minor> (...)."""
    return f"iceoryx2 {'.'.join(version().split('.')[:2])} (Python publish-subscribe, WaitSet)"


# -- what producer and consumers share ------------------------------------------------------


def run_root(name: str) -> str:
    """The root directory of the iceoryx2 files of the run `name` (its own, not /tmp/iceoryx2)."""
    return os.path.join(tempfile.gettempdir(), name)


def open_node(name: str):
    """An iceoryx2 node whose files carry the prefix `name`_ under run_root(name)."""
    import iceoryx2 as iox2

    iox2.set_log_level_from_env_or(iox2.LogLevel.Warn)
    config = iox2.config.default()
    config.global_cfg.prefix = iox2.FileName.new(f"{name}_")
    config.global_cfg.root_path = iox2.Path.new(run_root(name) + "/")
    return iox2.NodeBuilder.new().config(config).create(iox2.ServiceType.Ipc)


def pubsub_builder(node, name: str, consumers: int):
    """The publish-subscribe service's builder: lossless, one publisher, `consumers`
    subscribers with a queue of SUBSCRIBER_BUFFER samples, one borrowed at a time."""
    import iceoryx2 as iox2

    return (node.service_builder(iox2.ServiceName.new(name))
            .publish_subscribe(iox2.Slice[WORD])
            .enable_safe_overflow(False)
            .history_size(0)
            .subscriber_max_buffer_size(SUBSCRIBER_BUFFER)
            .subscriber_max_borrowed_samples(1)
            .max_publishers(1)
            .max_subscribers(consumers))


def event_builder(node, name: str, consumers: int):
    """The event service of the same name: one notifier, `consumers` listeners."""
    import iceoryx2 as iox2

    return (node.service_builder(iox2.ServiceName.new(name)).event()
            .max_notifiers(1).max_listeners(consumers))


def words(kind: str) -> int:
    """The slice length (8-byte words) of a batch of `kind`."""
    return (batch_bytes(kind) + ctypes.sizeof(WORD) - 1) // ctypes.sizeof(WORD)


def leaf_layout(kind: str) -> list[tuple[tuple[int, ...], str, int]]:
    """[(shape, numpy dtype, byte offset)] of the batch's leaves, packed in order (tiny:
    float32 (8, 16) at 0, int64 (8,) at 512; 32MiB: uint8 (32, 1024, 1024) at 0)."""
    out, off = [], 0
    for t in make_batch(kind):
        a = t.numpy()
        out.append((tuple(a.shape), a.dtype.str, off))
        off += a.nbytes
    return out


def leaf_maker(kind: str):
    """A function: payload address -> numpy arrays of the batch's leaves over it (no copy;
    the ctypes array type and the dtypes are made once, here)."""
    import numpy as np

    chunk = ctypes.c_uint8 * batch_bytes(kind)
    leaves = [(shape, np.dtype(dtype), off) for shape, dtype, off in leaf_layout(kind)]

    def arrays(ptr: int) -> list:
        buf = chunk.from_address(ptr)
        return [np.ndarray(shape, dtype, buf, off) for shape, dtype, off in leaves]
    return arrays


# -- child: producer ------------------------------------------------------------------------


def run_producer(args: argparse.Namespace) -> int:
    """Publish `batches` batches to `consumers` subscribers once they are all connected."""
    import iceoryx2 as iox2
    import numpy as np

    node = open_node(args.name)
    service = pubsub_builder(node, args.name, args.consumers).create()
    events = event_builder(node, args.name, args.consumers).create()
    publisher = (service.publisher_builder()
                 .initial_max_slice_len(words(args.kind))
                 .allocation_strategy(iox2.AllocationStrategy.Static)
                 .backpressure_strategy(iox2.BackpressureStrategy.RetryUntilDelivered)
                 .max_loaned_samples(1)
                 .create())
    notifier = events.notifier_builder().create()
    loader = CountingLoader(args.kind, args.batches)
    arrays, n = leaf_maker(args.kind), words(args.kind)
    views: dict[int, list] = {}  # per chunk address, the leaves' arrays over it
    report({"role": "producer", "ready": True})
    await_subscribers(service, events, args.consumers)
    publisher.update_connections()
    t0 = cpu0 = None
    sent = 0
    for batch in loader:
        if t0 is None:
            t0, cpu0 = time.perf_counter(), cpu_seconds()
        sample = publisher.loan_slice_uninit(n)
        ptr = sample.payload_ptr
        if ptr not in views:  # the service's few chunks come round again
            views[ptr] = arrays(ptr)
        for dst, src in zip(views[ptr], batch, strict=True):
            np.copyto(dst, src.numpy())
        sample.assume_init().send()
        notifier.notify()
        sent += 1
    t1, cpu1 = time.perf_counter(), cpu_seconds()
    notifier.notify_with_custom_event_id(iox2.EventId.new(END_EVENT))
    views.clear()
    drained = await_departure(service)
    report({"role": "producer", "batches": sent, "seconds": t1 - (t0 or t1),
            "cpu_seconds": cpu1 - (cpu0 or cpu1), "drained": drained})
    return 0


def await_subscribers(service, events, consumers: int) -> None:
    """Wait until `consumers` subscribers and listeners are connected (START_TIMEOUT)."""
    deadline = time.monotonic() + START_TIMEOUT
    while (service.dynamic_config.number_of_subscribers < consumers
           or events.dynamic_config.number_of_listeners < consumers):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{service.dynamic_config.number_of_subscribers} subscribers and "
                f"{events.dynamic_config.number_of_listeners} listeners of {consumers} "
                f"connected after {START_TIMEOUT:g} s")
        time.sleep(POLL)


def await_departure(service) -> bool:
    """Wait until every subscriber has left (JOIN_TIMEOUT); whether they all did."""
    deadline = time.monotonic() + JOIN_TIMEOUT
    while service.dynamic_config.number_of_subscribers > 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL)
    return True


# -- child: consumer ------------------------------------------------------------------------


def run_consumer(args: argparse.Namespace) -> int:
    """Receive every batch through a WaitSet, touch and check it, release it; report."""
    import iceoryx2 as iox2

    node = open_node(args.name)
    events = event_builder(node, args.name, args.consumers).open()
    listener = events.listener_builder().create()  # before the subscriber: no wake-up lost
    waitset = iox2.WaitSetBuilder.new().create(iox2.ServiceType.Ipc)
    guard = waitset.attach_notification(listener)
    service = pubsub_builder(node, args.name, args.consumers).open()
    subscriber = service.subscriber_builder().buffer_size(SUBSCRIBER_BUFFER).create()
    tally = Tally(args.kind)
    try:
        tally.consume(batches(subscriber, listener, waitset, tally, args.kind))
    finally:
        subscriber.delete()  # the producer waits for every subscriber to leave
        del guard
    report(tally.report())
    return 0


def batches(subscriber, listener, waitset, tally: Tally, kind: str):
    """The batches as tuples of torch tensors over the received samples, until END_EVENT;
    each sample is released when the caller asks for the next batch."""
    import iceoryx2 as iox2
    import torch

    arrays = leaf_maker(kind)
    timeout = iox2.Duration.from_secs_f64(BATCH_TIMEOUT)
    stop = (iox2.WaitSetRunResult.TerminationRequest, iox2.WaitSetRunResult.Interrupt,
            iox2.WaitSetRunResult.StopRequest)
    while True:
        ready, result = waitset.wait_and_process_with_timeout(timeout)
        if result in stop:
            raise RuntimeError(f"WaitSet stopped ({result}) after {tally.n} batches")
        ended = any(e.id.as_value == END_EVENT for e in listener.try_wait())
        got = 0
        while (sample := subscriber.receive()) is not None:
            got += 1
            batch = tuple([torch.from_numpy(a) for a in arrays(sample.payload_ptr)])
            yield batch
            del batch
            sample.delete()
        if ended:
            return
        if not ready and not got:
            raise TimeoutError(f"no batch for {BATCH_TIMEOUT:g} s after {tally.n} batches")


# -- orchestrator ---------------------------------------------------------------------------


def remove_run_files(name: str) -> list[str]:
    """Remove the iceoryx2 files of the run `name` (its root directory, /dev/shm/<name>_*);
    the paths removed."""
    gone = []
    for path in glob.glob(f"/dev/shm/{glob.escape(name)}_*"):
        try:
            os.unlink(path)
            gone.append(path)
        except FileNotFoundError:
            pass
    root = run_root(name)
    if os.path.isdir(root):
        shutil.rmtree(root, ignore_errors=True)
        gone.append(root)
    return gone


def run_config(kind: str, consumers: int, batches: int, tag: str) -> dict:
    """One producer and `consumers` consumers for `batches` batches."""
    h = harness()
    name = f"tsb-iox2-{os.getpid()}-{tag}"
    script = os.path.abspath(__file__)
    common = ["--name", name, "--kind", kind, "--consumers", str(consumers)]
    procs: list = []
    reports: list[dict] = []
    preport, error = None, None
    try:
        producer = h.spawn(h.python_argv(script, "_iproducer", *common,
                                         "--batches", str(batches)),
                           label="iceoryx2 producer")
        procs.append(producer)
        producer.wait_ready(READY_TIMEOUT)
        cons = [h.spawn(h.python_argv(script, "_iconsumer", *common),
                        label=f"iceoryx2 consumer {i + 1}") for i in range(consumers)]
        procs += cons
        deadline = time.monotonic() + RUN_TIMEOUT
        for c in cons:
            reports.append(c.result(max(1.0, deadline - time.monotonic())))
        preport = producer.result(max(1.0, deadline - time.monotonic()))
    except Exception as e:  # recorded as this configuration's result
        error = tail(f"{type(e).__name__}: {e}", lines=12, chars=3000)
    finally:
        stop_all(procs)
        remove_run_files(name)
    if error is None:
        error = check_reports(reports, kind, batches, consumers)
    notes = [] if preport is None or preport.get("drained", True) else \
        [f"producer: not every subscriber left within {JOIN_TIMEOUT:g} s"]
    return {"consumers": reports, "producer": preport, "error": error, "notes": notes}


def settings() -> dict:
    """This suite's implementation-specific settings, for the document."""
    return {"iceoryx2": {
        "version": version(),
        "payload": "iox2.Slice[ctypes.c_uint64] sized to the batch, loan_slice_uninit",
        "enable_safe_overflow": False,
        "backpressure_strategy": "RetryUntilDelivered",
        "subscriber_max_buffer_size": SUBSCRIBER_BUFFER,
        "subscriber_max_borrowed_samples": 1,
        "publisher_max_loaned_samples": 1,
        "history_size": 0,
        "allocation_strategy": "Static",
        "wake_up": "event service: Notifier.notify() per batch, Listener in a WaitSet",
        "files": "per run: prefix tsb-iox2-<pid>-<tag>_, root <tmp>/tsb-iox2-<pid>-<tag>/",
    }, "timeouts": {"ready": READY_TIMEOUT, "start": START_TIMEOUT, "batch": BATCH_TIMEOUT,
                    "join": JOIN_TIMEOUT, "run": RUN_TIMEOUT}}


def skipped(reason: str, *, kinds: list[str], counts: list[int], repeats: int,
            nbatches: dict, quick: bool) -> dict:
    """The document of a suite that could not run: `skipped` says why; no results."""
    return {
        "schema": SCHEMA,
        "implementation": "iceoryx2 (Python publish-subscribe, WaitSet)",
        "skipped": reason,
        "machine": machine_info(),
        "settings": {"quick": quick, "repeats": repeats, "kinds": kinds,
                     "consumer_counts": counts, "batches": {k: nbatches[k] for k in kinds},
                     "batch_bytes": {k: batch_bytes(k) for k in kinds}},
        "baselines": {},
        "results": [],
    }


def skip_line(reason: str) -> str:
    """The line that says the peer is skipped, and why."""
    return f"[iceoryx2] SKIPPED: {reason} (pip install iceoryx2 to include it)"


def run_iceoryx2(*, kinds: list[str], counts: list[int], repeats: int, nbatches: dict,
                 quick: bool) -> dict:
    """The suite through iceoryx2 (handoff.py's document schema), or a skipped document."""
    reason = unavailable()
    if reason:
        print(skip_line(reason), flush=True)
        return skipped(reason, kinds=kinds, counts=counts, repeats=repeats, nbatches=nbatches,
                       quick=quick)
    return run_suite(run_config, label=label(), kinds=kinds, counts=counts, repeats=repeats,
                     nbatches=nbatches, quick=quick, settings=settings())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_options(parser)
    args, kinds, counts, repeats, nbatches = parse_common(parser, argv)
    doc = run_iceoryx2(kinds=kinds, counts=counts, repeats=repeats, nbatches=nbatches,
                       quick=args.quick)
    if not doc.get("skipped"):
        print_table(doc)
    if args.json:
        write_json(args.json, doc)
    return 1 if any(r["error"] for r in doc["results"]) else 0


def _child_main(argv: list[str]) -> int:
    role = argv[0]
    unwind_on_sigterm()
    parser = child_parser("iceoryx2_handoff.py", role)
    parser.add_argument("--consumers", type=int, default=1)
    args = parser.parse_args(argv[1:])
    return run_producer(args) if role == "_iproducer" else run_consumer(args)


if __name__ == "__main__":
    dispatch({"_iproducer": _child_main, "_iconsumer": _child_main}, main)
