"""The demo of the README's Quickstart: one producer feeds several training consumers
from one shared loader, and the summary says how much loader CPU time sharing saved.

    python examples/demo.py                          # 3 consumers, 2 epochs of 1024 images
    python examples/demo.py --consumers 2 --epochs 1 --images 256 --no-live
    python examples/demo.py --help

The parent (this script without --role) starts a producer process and N consumer
processes, all this script again (``--role producer|consumer``) through
tools.harness. The producer runs a DataLoader with a real per-sample CPU transform
over a synthetic in-memory image set (``_demo_model.py``) and publishes every batch to the
shared-memory ring; each consumer trains a tiny CNN on those batches with its own learning
rate. Children report to the parent with one JSON object per stdout line, after ``MARK``;
the parent prints their progress and a summary, with a live panel under it on a terminal
(``_demo_panel.py``: the ring and each consumer's progress as ``tensorsocket status``
reads them). Every wait has a deadline (--timeout): on any failure every child is stopped,
nothing is left in /dev/shm or the runtime directory, and the error is one line (with
--debug: the children's output too).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import queue
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # _demo_model, _demo_panel (python examples/demo.py has it)
sys.path.append(str(HERE.parent))  # tools/: this checkout's, not installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _demo_model import (  # noqa: E402
    BATCH_SIZE, SEED, RandomCropFlipNormalize, SyntheticImages, TimedLoader, TinyCNN,
)
from _demo_panel import LivePanel  # noqa: E402

from tensorsocket.cli.clean import remove_leftovers  # noqa: E402
from tools import harness  # noqa: E402

PROG = "demo.py"
MARK = "@tensorsocket-demo "
CHILD_TIMEOUT = 30.0  # library timeouts inside the children (handshake, batch, publish, join)
KILL_GRACE = 3.0  # seconds between SIGTERM and SIGKILL when stopping children
LEARNING_RATES = (0.02, 0.05, 0.1, 0.01)  # consumer k (from 1) uses LEARNING_RATES[(k - 1) % 4]


class _Terminated(BaseException):
    """Raised in the parent by SIGTERM, so that it stops its children as on Ctrl-C."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated()


class DemoError(Exception):
    """The demo failed; ``hint`` says what to try, ``details`` holds the children's output."""

    def __init__(self, message: str, hint: str = "", details: str = "") -> None:
        super().__init__(message)
        self.hint = hint
        self.details = details


# -- children ----------------------------------------------------------------------------


def _emit(event: str, **fields: Any) -> None:
    """Send one event to the parent: a marked JSON line on stdout."""
    harness.emit({"event": event, **fields}, marker=MARK)


def _run_producer(name: str, consumers: int, epochs: int, images: int) -> None:
    """Producer role: run the loader `epochs` times through a TensorProducer."""
    from tensorsocket import TensorProducer

    torch.manual_seed(SEED)
    dataset = SyntheticImages(images, transform=RandomCropFlipNormalize())
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True,
                                         num_workers=0,
                                         generator=torch.Generator().manual_seed(SEED))
    timed = TimedLoader(loader)
    producer = TensorProducer(timed, name=name, min_consumers=consumers,
                              start_timeout=CHILD_TIMEOUT, publish_timeout=CHILD_TIMEOUT)
    try:
        _emit("listening", batches_per_epoch=len(timed))
        for epoch in range(epochs):
            cpu_before, batches = timed.cpu_seconds, 0
            for _ in producer:
                batches += 1
            _emit("epoch", epoch=epoch + 1, batches=batches,
                  loader_cpu_s=timed.cpu_seconds - cpu_before)
        stats = producer.stats()
        if not producer.join(timeout=CHILD_TIMEOUT):
            raise TimeoutError(f"the consumers did not read every batch within {CHILD_TIMEOUT} s")
    finally:
        producer.close()
    _emit("result", batches=stats["batches"], bytes_copied=stats["bytes_copied"],
          loader_cpu_s=timed.cpu_seconds, wait_s=stats["wait_seconds"])


def _run_consumer(name: str, rank: int, epochs: int) -> None:
    """Consumer role: train a TinyCNN with SGD on the producer's batches for `epochs` epochs."""
    from tensorsocket import TensorConsumer

    torch.manual_seed(SEED + rank)
    model = TinyCNN()
    lr = LEARNING_RATES[(rank - 1) % len(LEARNING_RATES)]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    consumer = TensorConsumer(name=name, timeout=CHILD_TIMEOUT, batch_timeout=CHILD_TIMEOUT)
    try:
        _emit("attached", batches_per_epoch=len(consumer), lr=lr)
        batches = samples = 0
        first: float | None = None
        epoch_loss = float("nan")
        for epoch in range(epochs):
            total, count = 0.0, 0
            for images, labels in consumer:
                if first is None:
                    first = time.perf_counter()
                loss = F.cross_entropy(model(images), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += loss.item() * len(labels)
                count += len(labels)
                batches += 1
            samples += count
            epoch_loss = total / count if count else float("nan")
            _emit("epoch", epoch=epoch + 1, mean_loss=epoch_loss)
        seconds = time.perf_counter() - first if first is not None else 0.0
    finally:
        consumer.close()
    _emit("result", batches=batches, samples=samples, seconds=seconds, lr=lr,
          samples_per_s=samples / seconds if seconds > 0 else 0.0, final_loss=epoch_loss)


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux for SIGTERM when the parent dies; exit now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        raise SystemExit(143)


def _on_sigterm(signum: int, frame: Any) -> None:
    """The first SIGTERM unwinds the child so that producers and consumers tear down cleanly."""
    # Later ones are ignored so they cannot cut that teardown short: PR_SET_PDEATHSIG fires
    # once per exiting thread of a dying parent. The parent escalates to SIGKILL if needed.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def child_main(args: argparse.Namespace) -> int:
    """A child: ``demo.py --role producer|consumer ...`` (started by the parent)."""
    # The parent handles Ctrl-C and stops us with SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if args.parent_pid is not None:
        _die_with_parent(args.parent_pid)
    torch.set_num_threads(1)
    try:
        if args.role == "producer":
            _run_producer(args.name, args.consumers, args.epochs, args.images)
        else:
            _run_consumer(args.name, args.rank, args.epochs)
    except Exception as e:
        traceback.print_exc()
        _emit("error", message=f"{type(e).__name__}: {e}")
        return 1
    return 0


# -- parent ------------------------------------------------------------------------------


@dataclass
class _Child:
    """One child process as the parent tracks it."""

    label: str
    proc: harness.ChildProcess
    rank: int = 0  # 0 for the producer
    result: dict | None = None
    closed: bool = False  # its stdout reached EOF
    exited: bool = False


def _spawn(label: str, rank: int, args: list[str], env: dict[str, str],
           events: "queue.Queue[tuple[_Child, dict]]") -> _Child:
    """Start one child; its events go to `events`."""
    proc = harness.spawn(harness.python_argv(__file__, *args), env=env, label=label,
                         text=True, bufsize=1)
    child = _Child(label, proc, rank)
    proc.follow(events, marker=MARK, tag=child)
    return child


def _stop_children(children: list[_Child]) -> None:
    """SIGTERM every running child (and what it started), SIGKILL what is still alive after
    KILL_GRACE, reap all."""
    group = harness.Children()
    group.procs = [c.proc for c in children]
    group.stop_all(KILL_GRACE)


def _child_output(children: list[_Child]) -> str:
    """The last lines each child wrote, for --debug."""
    parts = []
    for child in children:
        tail = getattr(child.proc, "tail", ())
        if tail:
            body = "\n".join("    " + line for line in tail)
            parts.append(f"--- output of {child.label} (pid {child.proc.pid}) ---\n{body}")
    return "\n".join(parts)


class _Demo:
    """The parent's side of one demo run: the children, their events, the results."""

    def __init__(self, consumers: int, epochs: int, images: int, timeout: float,
                 out: TextIO, live: bool | None = None) -> None:
        self.consumers = consumers
        self.epochs = epochs
        self.images = images
        self.timeout = timeout
        self.out = out
        self.name = f"demo-{os.getpid()}"
        self.started = time.monotonic()
        self.events: "queue.Queue[tuple[_Child, dict]]" = queue.Queue()
        self.children: list[_Child] = []
        self.producer_result: dict | None = None
        self.consumer_results: dict[int, dict] = {}
        if live is None:
            live = out.isatty() and os.environ.get("TERM", "dumb") != "dumb"
        self.panel = LivePanel(self.name, math.ceil(images / BATCH_SIZE), epochs, out) \
            if live else None

    def say(self, label: str, text: str) -> None:
        """Print one progress line (above the live panel)."""
        if self.panel is not None:
            self.panel.clear()
        print(f"[{time.monotonic() - self.started:5.1f}s] {label:<11} {text}", file=self.out,
              flush=True)
        if self.panel is not None:
            self.panel.draw()

    def run(self) -> dict:
        """Start the children, follow them to the end, print the summary."""
        batches = math.ceil(self.images / BATCH_SIZE)
        print(f"tensorsocket demo: 1 producer + {self.consumers} consumer(s), {self.images} "
              f"images ({batches} batches of {BATCH_SIZE}), {self.epochs} epoch(s), "
              f"producer name {self.name!r}", file=self.out, flush=True)
        try:
            self.start()
            self.follow()
        except DemoError as e:
            _stop_children(self.children)  # first, so that the readers have every line
            e.details = _child_output(self.children)
            raise
        finally:
            if self.panel is not None:
                self.panel.clear()
            _stop_children(self.children)
            remove_leftovers(self.name)
        return self.summary()

    def start(self) -> None:
        """Start the producer and the consumers."""
        env = harness.child_env(threads=1)  # this tree's tensorsocket; one thread each
        common = ["--name", self.name, "--epochs", str(self.epochs),
                  "--parent-pid", str(os.getpid())]
        try:
            self.children.append(_spawn("producer", 0, [
                "--role", "producer", *common, "--consumers", str(self.consumers),
                "--images", str(self.images)], env, self.events))
            for rank in range(1, self.consumers + 1):
                self.children.append(_spawn(f"consumer {rank}", rank, [
                    "--role", "consumer", *common, "--rank", str(rank)], env, self.events))
        except OSError as e:
            raise DemoError(f"cannot start a child process: {e}",
                            f"check that {sys.executable} can run") from e
        for child in self.children:
            self.say(child.label, f"started (pid {child.proc.pid})")

    def follow(self) -> None:
        """Report the children's events until all have exited; DemoError on any failure."""
        deadline = self.started + self.timeout
        while not all(child.exited for child in self.children):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                running = ", ".join(c.label for c in self.children if not c.exited)
                raise DemoError(
                    f"the demo did not finish within {self.timeout:g} s "
                    f"(still running: {running})",
                    "the machine may be busy: try fewer --images or --epochs, or a larger "
                    "--timeout")
            closing = [c for c in self.children if c.closed and not c.exited]
            try:
                child, event = self.events.get(timeout=min(remaining, 0.05 if closing else 0.5))
            except queue.Empty:
                pass
            else:
                self.report(child, event)
            for child in closing:
                self.check_exit(child)
            if self.panel is not None:
                self.panel.refresh(self._labels())

    def _labels(self) -> dict[int, str]:
        """Each child's label by pid (for the live panel)."""
        return {c.proc.pid: c.label for c in self.children}

    def report(self, child: _Child, event: dict) -> None:
        """Print one child's event; DemoError if it reports a failure."""
        kind = event.get("event")
        if kind == "listening":
            self.say(child.label, f"ready, {event['batches_per_epoch']} batches per epoch; "
                                  f"waiting for {self.consumers} consumer(s)")
        elif kind == "attached":
            self.say(child.label, f"attached, training with lr {event['lr']:g}")
        elif kind == "epoch" and child.rank == 0:
            self.say(child.label, f"epoch {event['epoch']}/{self.epochs} published: "
                                  f"{event['batches']} batches, "
                                  f"loader CPU {event['loader_cpu_s']:.2f} s")
        elif kind == "epoch":
            self.say(child.label, f"epoch {event['epoch']}/{self.epochs} done, "
                                  f"mean loss {event['mean_loss']:.4f}")
        elif kind == "result":
            child.result = event
            if child.rank == 0:
                self.producer_result = event
                self.say(child.label, f"finished: {event['batches']} batches published")
            else:
                self.consumer_results[child.rank] = event
                if self.panel is not None:
                    self.panel.finished(child.proc.pid, event["batches"], self._labels())
                self.say(child.label, f"finished: {event['batches']} batches, "
                                      f"{event['samples_per_s']:.0f} samples/s, "
                                      f"final loss {event['final_loss']:.4f}")
        elif kind == "error":
            raise DemoError(f"{child.label} failed: {event.get('message', '?')}")
        elif kind == "eof":
            child.closed = True

    def check_exit(self, child: _Child) -> None:
        """Note a child that has exited; DemoError if it failed or reported no result."""
        code = child.proc.poll()
        if code is None:
            return
        child.exited = True
        if code != 0 or child.result is None:
            why = f"exit code {code}" if code >= 0 else f"signal {-code}"
            raise DemoError(f"{child.label} (pid {child.proc.pid}) ended with {why} "
                            "without reporting a result")

    def summary(self) -> dict:
        """Print the summary and return it."""
        producer = self.producer_result
        assert producer is not None
        wall = time.monotonic() - self.started
        loader_cpu = producer["loader_cpu_s"]
        saved = (self.consumers - 1) * loader_cpu
        out = self.out
        print("\nSummary", file=out)
        for rank, result in sorted(self.consumer_results.items()):
            label = f"consumer {rank}"
            print(f"  {label:<11} lr {result['lr']:<5g} {result['samples']:6d} samples  "
                  f"{result['samples_per_s']:7.0f} samples/s  "
                  f"final loss {result['final_loss']:.4f}", file=out)
        print(f"  producer    {producer['batches']} batches published once "
              f"({producer['bytes_copied'] / 2**20:.0f} MiB into shared memory), "
              f"read by {self.consumers} consumer(s)", file=out)
        print(f"  loader CPU time for {self.epochs} epoch(s): {loader_cpu:.2f} s "
              f"({loader_cpu / self.epochs:.2f} s per epoch)", file=out)
        print(f"  CPU time saved by sharing: ({self.consumers} - 1) x {loader_cpu:.2f} s = "
              f"{saved:.2f} s (what {self.consumers} separate DataLoaders would have cost "
              "extra)", file=out)
        print(f"  wall time {wall:.1f} s", file=out, flush=True)
        return {"name": self.name, "consumers": self.consumer_results, "producer": producer,
                "loader_cpu_s": loader_cpu, "cpu_saved_s": saved, "wall_s": wall}


def run(consumers: int = 3, epochs: int = 2, images: int = 1024, timeout: float = 120.0,
        out: TextIO | None = None, live: bool | None = None) -> dict:
    """Run the demo, printing progress and a summary to `out`; DemoError on any failure.

    live: redraw a status panel (ring, consumer progress) under the log; default: when
    `out` is a terminal."""
    return _Demo(consumers, epochs, images, timeout, out or sys.stdout, live).run()


def _positive(kind: type):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def _check_environment() -> None:
    """DemoError for what would make every child fail: a TENSORSOCKET_* value that does
    not parse, a runtime directory that cannot be used (said once, here)."""
    from tensorsocket import config
    from tensorsocket.control.endpoints import runtime_dir

    for setting in config.SETTINGS.values():
        try:
            setting.from_env()
        except ValueError as e:
            raise DemoError(str(e)) from None
    try:
        runtime_dir()
    except (OSError, ValueError) as e:
        var = config.SETTINGS["runtime_dir"].env
        if var in str(e):  # the message names the variable and what to do
            raise DemoError(str(e)) from None
        raise DemoError(f"cannot use the runtime directory for sockets and locks: {e}",
                        f"set {var} to a directory of your own") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=PROG, description="Start one producer process that runs a DataLoader with a CPU "
        "transform over synthetic images, and N consumer processes that each train a tiny CNN "
        "on the shared batches; print their throughput and the CPU time that sharing the "
        "loader saved.")
    ap.add_argument("--consumers", type=_positive(int), default=3, metavar="N",
                    help="consumer processes (default: 3)")
    ap.add_argument("--epochs", type=_positive(int), default=2, metavar="N",
                    help="epochs to run (default: 2)")
    ap.add_argument("--images", type=_positive(int), default=1024, metavar="N",
                    help="synthetic images in the dataset (default: 1024)")
    ap.add_argument("--timeout", type=_positive(float), default=120.0, metavar="SECONDS",
                    help="stop every process and fail after this long (default: 120)")
    ap.add_argument("--no-live", action="store_true",
                    help="no live status panel under the log (default: shown on a terminal)")
    ap.add_argument("--debug", action="store_true",
                    help="show tracebacks and the output of the child processes on errors")
    # The children: this script again, started by the parent.
    ap.add_argument("--role", choices=["producer", "consumer"], help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from tensorsocket import _core

    if args.role is None and args.consumers > _core.MAX_CONSUMERS:
        ap.error(f"--consumers {args.consumers} is more than a ring supports "
                 f"(at most {_core.MAX_CONSUMERS})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role is not None:
        return child_main(args)
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        _check_environment()
        run(consumers=args.consumers, epochs=args.epochs, images=args.images,
            timeout=args.timeout, live=False if args.no_live else None)
        return 0
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print(f"{PROG}: terminated", file=sys.stderr)
        return 143
    except DemoError as e:
        if args.debug:
            traceback.print_exc()
            if e.details:
                print(e.details, file=sys.stderr)
        print(f"{PROG}: error: {e}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        if not args.debug and e.details:
            print("hint: run again with --debug to see the output of the child processes",
                  file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
