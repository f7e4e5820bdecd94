"""The handoff benchmark through the original TensorSocket 0.0.5 (PyPI).

    python benchmarks/original_handoff.py [--kinds tiny,32MiB] [--consumers 1,2,4]
                                          [--repeats 3] [--quick] [--json out.json]

The same workloads as handoff.py (same batches and counter stamps, same batch
counts, same consumer touch and check, timed from first to last batch in each
consumer), run through the original TensorSocket: its producer and every
consumer are separate processes started with the python of a cached venv in
which ``import tensorsocket`` is the original (original_env.ensure_venv(); the
children check the version they imported). This process only orchestrates and
measures the memcpy baseline. ``python benchmarks/handoff.py --with-original``
runs this after handoff.py's own suite and prints one comparison table.

How the original is driven (read from its source):

  - TensorProducer(loader, port, ack_port, heart_ports, rubber_band_pct=0.005,
    consumer_max_buffer_size=10, producer_batch_size=P): four free TCP ports per
    run (it binds tcp://*). The producer collates P loader batches with
    torch.cat and sends one pickled message per P batches, holding for every
    consumer P slices (each slice pickles the whole collated storage, a copy),
    to every subscriber (so each consumer receives and unpickles N*P*P batches'
    bytes per P batches), then waits for every consumer's ack (10 s poll),
    while a consumer missing one 500 ms heartbeat is dropped. P=1 does not
    work in 0.0.5 (the second broadcast collates an empty list: IndexError), and
    a tail of batches % P batches is never sent; P defaults to 8 for tiny (the
    library default; 2 and 16 measured the same) and 2 for 32MiB (the fewest
    bytes per batch; 8 would make a 2 GiB message per consumer per broadcast),
    see --producer-batch-size.
  - It never sends the last group of P batches of an epoch (the group is
    collected, but the end-of-epoch check comes before its broadcast). So, by
    default, its loader yields P padding batches after the N measured ones
    (counters N..N+P-1, never sent); consumers must still receive exactly the
    batches 0..N-1. --no-padding shows the drop itself (an error result).
  - TensorConsumer(port, ack_port, heart_ports, batch_size=rows of one loader
    batch) so that a consumer batch is exactly one loader batch; its iterator
    yields the batch (0.0.5 returns the batch, not (batch_idx, batch); both are
    accepted).
  - The original has no min_consumers: its producer starts as soon as one
    consumer's heartbeat arrives, and a consumer that attaches later than the
    rubber band allows may get nothing that epoch. So the producer process waits
    (with a timeout) until all N consumers are in its heartbeat table
    (producer.hb.consumers) before iterating its one epoch.
  - After the epoch the producer calls join() (with a timeout) and keeps its
    sockets open until the orchestrator has seen every consumer finish (its
    end-of-epoch message must reach them), then exits.

Failures are results: every wait has a timeout (consumer watchdog: no batch for
--batch-timeout s; whole configuration: --config-timeout s; memory: the run is
stopped if MemAvailable falls below a floor), and a configuration that fails,
hangs, drops, duplicates or corrupts batches gets an ``error`` text instead of
a number; the run goes on. All children are killed and reaped in a finally.

JSON: the schema of handoff.py (see its docstring), with ``error`` fields and
``settings.original`` (the producer/consumer parameters used). A consumer
report also has error (null or why it stopped), rc and max_rss_mb; the
producer report has phase, loader_batches, get_sample_calls, seconds,
consumers_at_end, heartbeat_lost and heartbeat_events (consumers leaving or
joining its heartbeat table during the epoch), join, rc, max_rss_mb and, if
it failed, error.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

import handoff_common as H  # noqa: E402  (benchmarks/ is not a package)
from bench_common import (  # noqa: E402
    dispatch, free_ports, harness, json_reports, read_text, stop_all, tail, write_json,
)
from original_env import ORIGINAL_VERSION, OriginalUnavailable, ensure_venv  # noqa: E402

LABEL = f"tensorsocket {ORIGINAL_VERSION} (original, PyPI)"
PRODUCER_BATCH_SIZE = {"tiny": 8, "32MiB": 2}
RUBBER_BAND_PCT = 0.005  # the library's default
CONSUMER_MAX_BUFFER_SIZE = 10  # the library's default
LOADER_ROWS = {"tiny": H.TINY_SHAPES[0][0], "32MiB": H.LARGE_SHAPE[0]}

READY_TIMEOUT = 60.0  # producer process up and its sockets bound
START_TIMEOUT = 60.0  # all N consumers in the producer's heartbeat table
BATCH_TIMEOUT = 60.0  # consumer: no batch (or no handshake) for this long
CONFIG_TIMEOUT = 900.0  # one whole configuration
JOIN_TIMEOUT = 30.0  # the producer's join()
LINGER_TIMEOUT = CONFIG_TIMEOUT  # producer keeps its sockets open at most this long after
KILL_GRACE = 5.0
MEM_FLOOR_FRACTION = 0.15  # stop a run when MemAvailable < this fraction of MemTotal
MEM_GUARD_FRACTION = 0.5  # do not start a run estimated to need more of MemAvailable


# -- children (run by the venv's python) ---------------------------------------------------


class _Emitter:
    """Writes exactly one final JSON report line, from whichever thread gets there first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False

    def line(self, obj: dict) -> None:
        os.write(1, (json.dumps(obj) + "\n").encode())

    def final(self, obj: dict, rc: int) -> None:
        with self.lock:
            if not self.done:
                self.done = True
                obj["max_rss_mb"] = _max_rss_mb()
                self.line(obj)
        os._exit(rc)


def _max_rss_mb() -> float | None:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except (ImportError, OSError):
        return None


def _import_original():
    import tensorsocket

    version = getattr(tensorsocket, "__version__", None)
    if version != ORIGINAL_VERSION or "site-packages" not in tensorsocket.__file__:
        raise RuntimeError(f"imported tensorsocket {version} from {tensorsocket.__file__}, "
                           f"not the original {ORIGINAL_VERSION}")
    return tensorsocket


def run_oproducer(args: argparse.Namespace) -> int:
    emit = _Emitter()
    state: dict = {"role": "producer", "phase": "starting"}
    loader = None

    def partial(error: str) -> dict:
        out = dict(state, error=error)
        if loader is not None:
            out["loader_batches"] = loader.yielded
        return out

    signal.signal(signal.SIGTERM, lambda *_: emit.final(
        partial(f"terminated by the orchestrator (phase {state['phase']})"), 128 + 15))
    try:
        ts = _import_original()
        port, ack_port, hb_pub, hb_sub = args.ports
        pbs = args.producer_batch_size
        copies = int(RUBBER_BAND_PCT * args.batches) + pbs + 3  # > what the rubber band holds
        loader = H.CountingLoader(args.kind, args.batches, copies=copies)
        producer = ts.TensorProducer(
            loader, port=port, ack_port=ack_port, heart_ports=(hb_pub, hb_sub),
            rubber_band_pct=RUBBER_BAND_PCT, consumer_max_buffer_size=CONSUMER_MAX_BUFFER_SIZE,
            producer_batch_size=pbs,
        )
        emit.line({"role": "producer", "ready": True})
        state["phase"] = "waiting for consumers"
        t_end = time.monotonic() + START_TIMEOUT
        while len(producer.hb.consumers) < args.consumers:
            if time.monotonic() > t_end:
                emit.final(partial(f"only {len(producer.hb.consumers)} of {args.consumers} "
                                   f"consumers in the heartbeat table after "
                                   f"{START_TIMEOUT:.0f} s"), 3)
            time.sleep(0.02)
        state["phase"] = "epoch"
        t0 = time.perf_counter()
        _watch_heartbeats(producer, state, t0)
        calls = 0
        for _ in producer:
            calls += 1
        state.update(seconds=time.perf_counter() - t0, get_sample_calls=calls,
                     loader_batches=loader.yielded,
                     consumers_at_end=len(producer.hb.consumers), phase="join")
        joiner = threading.Thread(target=producer.join, daemon=True)
        joiner.start()
        joiner.join(JOIN_TIMEOUT)
        state["join"] = "ok" if not joiner.is_alive() else f"hung > {JOIN_TIMEOUT:.0f} s"
        state["phase"] = "done"
        with emit.lock:
            emit.done = True
            emit.line(dict(state, max_rss_mb=_max_rss_mb()))
        # Keep the sockets open (the end-of-epoch message must reach the consumers)
        # until the orchestrator closes our stdin, at most LINGER_TIMEOUT.
        select.select([sys.stdin], [], [], args.linger)
        os._exit(0)
    except BaseException as e:  # noqa: B036 - reported as this run's result
        emit.final(partial(f"{type(e).__name__}: {e} [{_where(e)}]"), 1)
    return 1


def _watch_heartbeats(producer, state: dict, t0: float) -> None:
    """Record, every 50 ms, consumers leaving / joining the original producer's heartbeat
    table during the epoch (a consumer that misses one 500 ms beat is dropped)."""
    events = state.setdefault("heartbeat_events", [])
    state["heartbeat_lost"] = 0

    def members() -> set:
        for _ in range(10):
            try:
                return set(producer.hb.hearts)
            except RuntimeError:  # changed size during iteration (its IOLoop thread)
                time.sleep(0.001)
        return set()

    def run() -> None:
        prev = members()
        while state.get("phase") == "epoch":
            time.sleep(0.05)
            now = members()
            lost, new = prev - now, now - prev
            if lost or new:
                state["heartbeat_lost"] += len(lost)
                if len(events) < 20:
                    events.append({"t": round(time.perf_counter() - t0, 3), "lost": len(lost),
                                   "joined": len(new), "members": len(now)})
            prev = now

    threading.Thread(target=run, daemon=True).start()


def _where(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    return " <- ".join(f"{f.name} {Path(f.filename).name}:{f.lineno}" for f in reversed(tb[-3:]))


def _unwrap(item):
    """0.0.5 yields the batch; its docstring says (batch_idx, batch): accept both."""
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int):
        return item[1]
    return item


def run_oconsumer(args: argparse.Namespace) -> int:
    emit = _Emitter()
    tally = H.Tally(args.kind)
    phase = {"name": "attaching", "since": time.perf_counter()}

    def stop(error: str, rc: int) -> None:
        emit.final(tally.report(error=error), rc)

    def watchdog() -> None:
        while True:
            time.sleep(0.1)
            now = time.perf_counter()
            if phase["name"] == "attaching":
                if now - phase["since"] > args.batch_timeout:
                    stop(f"not attached (no data_loader_len message) within "
                         f"{args.batch_timeout:g} s", 3)
            elif phase["name"] == "running":
                last = max(phase["since"], tally.t_last)
                if now - last > args.batch_timeout:
                    stop(f"no batch for {args.batch_timeout:g} s after {tally.n} batches", 3)

    signal.signal(signal.SIGTERM, lambda *_: stop(
        f"terminated by the orchestrator ({phase['name']}) after {tally.n} batches", 128 + 15))
    threading.Thread(target=watchdog, daemon=True).start()
    try:
        ts = _import_original()
        port, ack_port, hb_pub, hb_sub = args.ports
        consumer = ts.TensorConsumer(port=port, ack_port=ack_port,
                                     heart_ports=(hb_pub, hb_sub),
                                     batch_size=LOADER_ROWS[args.kind])
        phase.update(name="running", since=time.perf_counter())
        tally.consume(consumer, unwrap=_unwrap)
        phase["name"] = "done"
        emit.final(tally.report(), 0)
    except BaseException as e:  # noqa: B036 - reported as this run's result
        stop(f"{type(e).__name__}: {e} [{_where(e)}]", 1)
    return 1


# -- orchestrator (this interpreter) --------------------------------------------------------


def estimate_peak_bytes(kind: str, consumers: int, pbs: int) -> int:
    """Rough peak memory of one run of the original: the pickled broadcast (for every
    consumer pbs slices, each pickling the whole pbs-batch storage) in the producer and,
    received and unpickled, in every consumer, plus the consumers' 10-message queues."""
    b = H.batch_bytes(kind)
    message = consumers * pbs * pbs * b
    return message * (1 + 2 * consumers) + consumers * CONSUMER_MAX_BUFFER_SIZE * pbs * b


def _child_env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the venv's site-packages decide what tensorsocket is
    env.pop("PYTHONHOME", None)
    return env


def _last_report(text: str, role: str) -> dict | None:
    lines = json_reports(text, role)
    return lines[-1] if lines else None


def _wait_ready(proc: subprocess.Popen, out: Path, err: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if '"ready": true' in read_text(out):
            return
        if proc.poll() is not None:
            rep = _last_report(read_text(out), "producer")
            why = rep["error"] if rep and rep.get("error") else tail(read_text(err))
            raise RuntimeError(f"producer exited before it was ready (rc={proc.returncode}): "
                               f"{why}")
        time.sleep(0.05)
    raise TimeoutError(f"producer not ready within {timeout:.0f} s")


class _Children:
    """The processes of one configuration of the original: started with the venv's python,
    on four fresh ports, their stdout and stderr in files of a temporary directory."""

    def __init__(self, python: Path | None, kind: str) -> None:
        self.python = python
        self.kind = kind
        self.ports = [str(p) for p in free_ports(4)]
        self.tmp = Path(tempfile.mkdtemp(prefix="ts-original-handoff-"))
        self.procs: list = []
        self.files: list[tuple[Path, Path]] = []
        self.opened: list = []
        self.env = _child_env()

    def spawn(self, role: str, i: int, *extra: str, stdin=None) -> subprocess.Popen:
        out, err = self.tmp / f"{role}{i}.out", self.tmp / f"{role}{i}.err"
        fo, fe = open(out, "w"), open(err, "w")
        self.opened.extend([fo, fe])
        p = harness().spawn([str(self.python), os.path.abspath(__file__), role, "--kind",
                             self.kind, "--ports", *self.ports, *extra], label=f"{role} {i}",
                            stdin=stdin, stdout=fo, stderr=fe, cwd=self.tmp, env=self.env)
        self.procs.append(p)
        self.files.append((out, err))
        return p

    def close_files(self) -> None:
        for f in self.opened:
            f.close()


class Runner:
    """Runs configurations of the original with the venv's python."""

    def __init__(self, python: Path | None, unavailable: str | None, pbs: dict,
                 batch_timeout: float, config_timeout: float, padding: bool = True) -> None:
        self.python = python
        self.padding = padding
        self.unavailable = unavailable
        self.pbs = pbs
        self.batch_timeout = batch_timeout
        self.config_timeout = config_timeout

    def __call__(self, kind: str, consumers: int, batches: int, tag: str) -> dict:
        if self.unavailable:
            return {"consumers": [], "producer": None,
                    "error": f"original unavailable: {self.unavailable}"}
        pbs = self.pbs[kind]
        need = estimate_peak_bytes(kind, consumers, pbs)
        avail = (harness().meminfo_gb("MemAvailable") or 0) * 1e9
        if avail and need > MEM_GUARD_FRACTION * avail:
            return {"consumers": [], "producer": None,
                    "error": f"not run: estimated peak memory {need / 1e9:.1f} GB (producer_"
                             f"batch_size={pbs}) > {MEM_GUARD_FRACTION:g} x MemAvailable "
                             f"{avail / 1e9:.1f} GB"}
        res = None
        for _attempt in range(2):  # a port taken between free_ports() and bind(): once more
            res = self._run(kind, consumers, batches, pbs)
            if not (res["error"] and "Address already in use" in res["error"]):
                break
        notes = []
        if not self.padding:
            notes.append(f"no padding: the original never sends the last group of "
                         f"producer_batch_size={pbs} batches of an epoch")
        elif batches % pbs:
            notes.append(f"batches={batches} is not a multiple of producer_batch_size={pbs}: "
                         f"the original never sends the last {batches % pbs}")
        if res["error"] and notes:
            res["error"] += " [" + "; ".join(notes) + "]"
        return res

    def _run(self, kind: str, consumers: int, batches: int, pbs: int) -> dict:
        kids = _Children(self.python, kind)
        problems: list[str] = []
        try:
            self._drive(kids, consumers, batches, pbs, problems)
        except Exception as e:  # recorded as this configuration's result
            problems.append(f"{type(e).__name__}: {e}")
        finally:
            stop_all(kids.procs)
            kids.close_files()
            reports, preport = self._collect(kids.procs, kids.files, problems)
            shutil.rmtree(kids.tmp, ignore_errors=True)
        if preport and preport.get("error"):
            problems.append(f"producer: {preport['error']}")
        if reports:
            check = H.check_reports(reports, kind, batches, consumers)
            if check:
                problems.append(check)
        if problems and preport and preport.get("heartbeat_lost"):
            problems.append(f"the producer's heartbeat table lost a consumer "
                            f"{preport['heartbeat_lost']} time(s) during the epoch")
        notes = []
        if preport and preport.get("join") not in (None, "ok"):
            notes.append(f"producer: join() {preport['join']}")
        return {"consumers": reports, "producer": preport,
                "error": "; ".join(problems) or None, "notes": notes}

    def _drive(self, kids: "_Children", consumers: int, batches: int, pbs: int,
               problems: list[str]) -> None:
        """The producer, then the consumers until they finish (or the configuration's
        timeout or the memory floor stops them), then let the producer go."""
        pad = pbs if self.padding else 0
        producer = kids.spawn("_oproducer", 0, "--batches", str(batches + pad),
                              "--consumers", str(consumers),
                              "--producer-batch-size", str(pbs),
                              "--linger", str(LINGER_TIMEOUT), stdin=subprocess.PIPE)
        _wait_ready(producer, *kids.files[0], READY_TIMEOUT)
        cons = [kids.spawn("_oconsumer", i + 1, "--batch-timeout", str(self.batch_timeout))
                for i in range(consumers)]
        self._watch(cons, problems)
        # Consumers still running get SIGTERM: they report how far they got.
        for c in cons:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        for c in cons:
            try:
                c.wait(timeout=KILL_GRACE)
            except subprocess.TimeoutExpired:
                pass
        producer.stdin.close()  # consumers are done: the producer may exit
        failed = bool(problems)
        try:  # its join() may take up to JOIN_TIMEOUT; no waiting after a failure
            producer.wait(timeout=KILL_GRACE + (0 if failed else JOIN_TIMEOUT))
        except subprocess.TimeoutExpired:
            if not failed:
                problems.append(f"producer still running {KILL_GRACE + JOIN_TIMEOUT:.0f} s "
                                "after the consumers finished")

    def _watch(self, cons: list, problems: list[str]) -> None:
        """Until every consumer exited, the configuration's time is up, or MemAvailable
        fell below the floor (the last two: a problem)."""
        mem_total = (harness().meminfo_gb("MemTotal") or 0) * 1e9
        deadline = time.monotonic() + self.config_timeout
        while any(c.poll() is None for c in cons):
            if time.monotonic() > deadline:
                problems.append(f"configuration not finished within "
                                f"{self.config_timeout:.0f} s")
                return
            avail = (harness().meminfo_gb("MemAvailable") or 0) * 1e9
            if mem_total and avail and avail < MEM_FLOOR_FRACTION * mem_total:
                problems.append(f"stopped by the benchmark: MemAvailable fell to "
                                f"{avail / 1e9:.1f} GB of {mem_total / 1e9:.1f} GB")
                return
            time.sleep(0.1)

    def _collect(self, procs, files, problems) -> tuple[list[dict], dict | None]:
        preport = None
        reports = []
        for i, (p, (out, err)) in enumerate(zip(procs, files, strict=True)):
            role = "producer" if i == 0 else "consumer"
            rep = _last_report(read_text(out), role)
            if rep is None:
                who = "producer" if i == 0 else f"consumer {i}"
                problems.append(f"{who} exited rc={p.returncode} without a report: "
                                f"{tail(read_text(err), 4)}")
                if i:
                    reports.append({"role": "consumer", "batches": 0, "error": "no report"})
                continue
            rep["rc"] = p.returncode
            if i == 0:
                preport = rep
            else:
                reports.append(rep)
        return reports, preport


def run_original(*, kinds: list[str], counts: list[int], repeats: int, nbatches: dict,
                 quick: bool, producer_batch_size: dict | None = None,
                 batch_timeout: float = BATCH_TIMEOUT,
                 config_timeout: float = CONFIG_TIMEOUT, padding: bool = True) -> dict:
    """The suite through the original; the JSON document of handoff.py's schema."""
    pbs = dict(PRODUCER_BATCH_SIZE, **(producer_batch_size or {}))
    python, unavailable = None, None
    try:
        python = ensure_venv(lambda msg: print(msg, flush=True))
    except (OriginalUnavailable, OSError, subprocess.SubprocessError) as e:
        unavailable = f"{type(e).__name__}: {e}"
        print(f"[{LABEL}] unavailable: {unavailable}")
    runner = Runner(python, unavailable, pbs, batch_timeout, config_timeout, padding)
    settings = {
        "original": {
            "version": ORIGINAL_VERSION,
            "python": str(python) if python else None,
            "producer_batch_size": {k: pbs[k] for k in kinds},
            "consumer_batch_size": {k: LOADER_ROWS[k] for k in kinds},
            "padding_batches": {k: pbs[k] if padding else 0 for k in kinds},
            "rubber_band_pct": RUBBER_BAND_PCT,
            "consumer_max_buffer_size": CONSUMER_MAX_BUFFER_SIZE,
            "transport": "tcp://localhost (pickled payloads over ZeroMQ PUB/SUB)",
        },
        "timeouts": {"ready": READY_TIMEOUT, "start": START_TIMEOUT, "batch": batch_timeout,
                     "config": config_timeout, "join": JOIN_TIMEOUT},
    }
    return H.run_suite(runner, label=LABEL, kinds=kinds, counts=counts, repeats=repeats,
                       nbatches=nbatches, quick=quick, settings=settings)


def _parse_pbs(text: str | None) -> dict:
    """'tiny=8,32MiB=2' or '4' (all kinds) -> {kind: n}."""
    if not text:
        return {}
    if "=" not in text:
        return {k: int(text) for k in H.KINDS}
    out = {}
    for part in text.split(","):
        k, v = part.split("=", 1)
        if k not in H.KINDS:
            raise ValueError(f"unknown kind {k!r}")
        out[k] = int(v)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    H.add_common_options(parser)
    parser.add_argument("--producer-batch-size", metavar="N|KIND=N,...",
                        help="the original's producer_batch_size (default tiny=8,32MiB=2; "
                             "1 crashes in 0.0.5)")
    parser.add_argument("--batch-timeout", type=float, default=BATCH_TIMEOUT,
                        help=f"consumer: give up after this long without a batch "
                             f"(default {BATCH_TIMEOUT:g} s)")
    parser.add_argument("--config-timeout", type=float, default=CONFIG_TIMEOUT,
                        help=f"one configuration at most this long (default {CONFIG_TIMEOUT:g} s)")
    parser.add_argument("--no-padding", action="store_true",
                        help="let the loader yield exactly the batches the consumers must get "
                             "(the original then drops the last producer_batch_size of them)")
    args, kinds, counts, repeats, nbatches = H.parse_common(parser, argv)
    try:
        pbs = _parse_pbs(args.producer_batch_size)
    except ValueError as e:
        parser.error(f"--producer-batch-size: {e}")
    doc = run_original(kinds=kinds, counts=counts, repeats=repeats, nbatches=nbatches,
                       quick=args.quick, producer_batch_size=pbs,
                       batch_timeout=args.batch_timeout, config_timeout=args.config_timeout,
                       padding=not args.no_padding)
    H.print_table(doc)
    if args.json:
        write_json(args.json, doc)
    return 0


def _child_main(argv: list[str]) -> int:
    role = argv[0]
    parser = argparse.ArgumentParser(prog=f"original_handoff.py {role}")
    parser.add_argument("--kind", required=True, choices=H.KINDS)
    parser.add_argument("--ports", type=int, nargs=4, required=True)
    parser.add_argument("--batches", type=int, default=0)
    parser.add_argument("--consumers", type=int, default=1)
    parser.add_argument("--producer-batch-size", type=int, default=8)
    parser.add_argument("--linger", type=float, default=LINGER_TIMEOUT)
    parser.add_argument("--batch-timeout", type=float, default=BATCH_TIMEOUT)
    args = parser.parse_args(argv[1:])
    if role == "_oproducer":
        return run_oproducer(args)
    return run_oconsumer(args)


if __name__ == "__main__":
    dispatch({"_oproducer": _child_main, "_oconsumer": _child_main}, main)
