"""The floor for handoff.py: the same workload through plain ``multiprocessing.shared_memory``
and pipes, as one would write it by hand with no safety at all.

    python benchmarks/shm_pipe_handoff.py [--quick] [--kinds tiny] [--consumers 1,4]

One producer process and N consumer processes. The producer owns a shared-memory block of
RING_SLOTS slots (handoff_common.RING_SLOTS, as ours). Per batch it copies the loader's
tensors into slot ``seq % RING_SLOTS`` (np.copyto) and writes ``seq`` (8 bytes) into each
consumer's pipe; before it reuses a slot it reads the consumers' acknowledgements from
their return pipes until every one of them is done with the batch the slot held. A
consumer reads sequence numbers from its pipe (many per read() when they queue up), makes
the batch's torch tensors over the slot (torch.from_numpy of an ndarray on the block, made
per batch as a zero-copy loader must), touches and checks it exactly as handoff.py's
consumers do (handoff_common.Tally), drops it and acknowledges with 8 bytes.

What it leaves out, which tensorsocket does: no batch structure (the tuple is hard-coded),
no lifetime tracking (a consumer that keeps a tensor past its acknowledgement reads a later
batch), no crash handling, no late joiners, no control plane. So it is a floor for the
per-batch cost of a handoff between processes, not a competitor.

handoff.py runs it in the same run as its own suite (``run_floor()``) and reports
ours / floor per configuration; the schema of the document is handoff.py's.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (  # noqa: E402
    cpu_seconds, dispatch, harness, report, stop_all, tail, unwind_on_sigterm, write_json,
)
from handoff_common import (  # noqa: E402
    RING_SLOTS, CountingLoader, Tally, add_common_options, check_reports, child_parser,
    make_batch, parse_common, print_table, run_suite,
)

LABEL = "shared_memory + pipes (floor)"
RUN_TIMEOUT = 600.0  # seconds for one configuration
READY_TIMEOUT = 60.0
SEQ = 8  # bytes of a sequence number or acknowledgement on a pipe


def _layout(kind: str) -> tuple[list[tuple[tuple[int, ...], str, int]], int]:
    """[(shape, numpy dtype, offset)] of the batch's leaves in a slot, and the slot size."""
    leaves, off = [], 0
    for t in make_batch(kind):
        a = t.numpy()
        leaves.append((tuple(a.shape), a.dtype.str, off))
        off += (a.nbytes + 63) // 64 * 64
    return leaves, max(off, 1)  # SharedMemory refuses size 0


# -- children ----------------------------------------------------------------------------


def run_producer(args: argparse.Namespace) -> int:
    """Copy each batch into the next slot and send its number down every consumer's pipe."""
    import numpy as np
    from multiprocessing import resource_tracker, shared_memory

    leaves, slot_bytes = _layout(args.kind)
    shm = shared_memory.SharedMemory(name=args.name, create=True,
                                     size=slot_bytes * RING_SLOTS)
    views: list = []  # per slot, numpy views of its leaves on the block
    try:
        # This process unlinks the block itself; the tracker would warn about it.
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        views[:] = [[np.ndarray(shape, dtype, buffer=shm.buf, offset=k * slot_bytes + off)
                  for shape, dtype, off in leaves] for k in range(RING_SLOTS)]
        outs = [int(fd) for fd in args.out_fds.split(",")]
        acks = [int(fd) for fd in args.ack_fds.split(",")]
        acked = [0] * len(acks)  # batches each consumer is done with
        loader = CountingLoader(args.kind, args.batches)
        report({"role": "producer", "ready": True})
        t0 = cpu0 = None
        for seq, batch in enumerate(loader):
            if t0 is None:
                t0, cpu0 = time.perf_counter(), cpu_seconds()
            while min(acked) + RING_SLOTS <= seq:  # slot seq % RING_SLOTS is still read
                ready, _, _ = select.select(acks, [], [], RUN_TIMEOUT)
                if not ready:
                    raise TimeoutError("no consumer acknowledged a batch in time")
                for fd in ready:
                    got = len(os.read(fd, 4096))
                    if got == 0:
                        raise RuntimeError("a consumer closed its pipe")
                    acked[acks.index(fd)] += got // SEQ
            for dst, src in zip(views[seq % RING_SLOTS], batch, strict=True):
                np.copyto(dst, src.numpy())
            word = seq.to_bytes(SEQ, "little")
            for fd in outs:
                os.write(fd, word)
        t1, cpu1 = time.perf_counter(), cpu_seconds()
        for fd in outs:
            os.close(fd)  # end of stream
        for fd in acks:  # wait until every consumer let go of the block
            while os.read(fd, 4096):
                pass
    finally:
        views.clear()  # no export of the block may outlive close()
        shm.close()
        shm.unlink()
    report({"role": "producer", "batches": args.batches,
            "seconds": t1 - (t0 or t1), "cpu_seconds": cpu1 - (cpu0 or cpu1)})
    return 0


def run_consumer(args: argparse.Namespace) -> int:
    """Read batch numbers, make the batch's tensors over its slot, check it, acknowledge."""
    import numpy as np
    import torch
    from multiprocessing import resource_tracker, shared_memory

    leaves, slot_bytes = _layout(args.kind)
    shm = shared_memory.SharedMemory(name=args.name)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    inp, ack = int(args.in_fd), int(args.ack_fd)

    def batches():
        pending = b""
        while True:
            data = os.read(inp, 4096)
            if not data:
                return
            pending += data
            n = len(pending) // SEQ
            for i in range(n):
                base = int.from_bytes(pending[i * SEQ:(i + 1) * SEQ], "little") \
                    % RING_SLOTS * slot_bytes
                yield tuple(torch.from_numpy(np.ndarray(shape, dtype, buffer=shm.buf,
                                                        offset=base + off))
                            for shape, dtype, off in leaves)
                os.write(ack, b"\0" * SEQ)  # the caller dropped the batch (Tally does)
            pending = pending[n * SEQ:]

    tally = Tally(args.kind)
    try:
        tally.consume(batches())
    finally:
        shm.close()
        os.close(ack)
    report(tally.report())
    return 0


# -- orchestrator ------------------------------------------------------------------------


def run_config(kind: str, consumers: int, batches: int, tag: str) -> dict:
    """One producer and `consumers` consumers for `batches` batches."""
    h = harness()
    name = f"bench-floor-{os.getpid()}-{tag}"
    procs: list = []
    reports: list[dict] = []
    preport, error = None, None
    pipes = [(os.pipe(), os.pipe()) for _ in range(consumers)]  # (to consumer, acks back)
    script = os.path.abspath(__file__)
    try:
        producer = h.spawn(h.python_argv(
            script, "_producer", "--name", name, "--kind", kind, "--batches", str(batches),
            "--out-fds", ",".join(str(out[1]) for out, _ in pipes),
            "--ack-fds", ",".join(str(back[0]) for _, back in pipes)),
            pass_fds=[fd for out, back in pipes for fd in (out[1], back[0])],
            label="floor producer")
        procs.append(producer)
        producer.wait_ready(READY_TIMEOUT)
        cons = []
        for i, (out, back) in enumerate(pipes):
            c = h.spawn(h.python_argv(script, "_consumer", "--name", name, "--kind", kind,
                                      "--in-fd", str(out[0]), "--ack-fd", str(back[1])),
                        pass_fds=[out[0], back[1]], label=f"floor consumer {i + 1}")
            procs.append(c)
            cons.append(c)
        for out, back in pipes:  # the children hold them now
            for fd in (*out, *back):
                os.close(fd)
        pipes = []
        deadline = time.monotonic() + RUN_TIMEOUT
        for c in cons:
            reports.append(c.result(max(1.0, deadline - time.monotonic())))
        preport = producer.result(max(1.0, deadline - time.monotonic()))
    except Exception as e:  # recorded as this configuration's result
        error = tail(f"{type(e).__name__}: {e}", lines=12, chars=3000)
    finally:
        for out, back in pipes:
            for fd in (*out, *back):
                os.close(fd)
        stop_all(procs)
        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:
            pass
    if error is None:
        error = check_reports(reports, kind, batches, consumers)
    return {"consumers": reports, "producer": preport, "error": error}


def run_floor(*, kinds: list[str], counts: list[int], repeats: int, nbatches: dict,
              quick: bool) -> dict:
    """The floor's suite: handoff.py's document schema."""
    return run_suite(run_config, label=LABEL, kinds=kinds, counts=counts, repeats=repeats,
                     nbatches=nbatches, quick=quick, settings={"ring_slots": RING_SLOTS})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_options(parser)
    args, kinds, counts, repeats, nbatches = parse_common(parser, argv)
    doc = run_floor(kinds=kinds, counts=counts, repeats=repeats, nbatches=nbatches,
                    quick=args.quick)
    print_table(doc)
    if args.json:
        write_json(args.json, doc, say=False)
    return 1 if any(r["error"] for r in doc["results"]) else 0


def _child_main(argv: list[str]) -> int:
    role = argv[0]
    unwind_on_sigterm()
    parser = child_parser("shm_pipe_handoff.py", role)
    parser.add_argument("--out-fds", default="")
    parser.add_argument("--ack-fds", default="")
    parser.add_argument("--in-fd", default="")
    parser.add_argument("--ack-fd", default="")
    args = parser.parse_args(argv[1:])
    return run_producer(args) if role == "_producer" else run_consumer(args)


if __name__ == "__main__":
    dispatch({"_producer": _child_main, "_consumer": _child_main}, main)
