"""The demo of the README's Quickstart: the same training jobs run twice, first each
with its own DataLoader (what they do today), then through one shared loader
(tensorsocket), and the two runs compared, measured side by side.

    python examples/demo.py                     # 3 jobs, 3 epochs of 512 JPEGs: ~1 minute on 2 cores
    python examples/demo.py --jobs 4 --epochs 3 --images 1024 --plot demo.png
    python examples/demo.py --help

The workload is the collocated benchmark's (benchmarks/workload.py): JPEGs (generated
once into benchmarks/.cache/, no download) decoded and augmented per sample on the CPU,
a small ResNet trained with SGD, one thread per process; each job has its own learning
rate, as in a sweep. Before the runs the loader's and a training step's CPU cost per batch
are measured (one thread each), from which a model predicts the speedup on this machine
(``_demo_report.model_speedup``: a prediction, not a bound).

- **baseline**: N job processes, each with its own ``DataLoader(num_workers=--workers)``.
- **shared**: one producer process runs that DataLoader once
  (``TensorProducer(loader, min_consumers=N)``, with the N jobs' workers together, at most
  the machine's cores), and N job processes iterate ``TensorConsumer(name=...)``.

The CPU that other processes used during each run is measured too (the machine's busy time
less the runs'): where it exceeds a tenth of a run's own, the comparison says it is skewed.
Both loaders' workers keep a padded heap (the producer's ``worker_heap_pad`` default, and
the same pad for the baseline's), so what differs is sharing alone. Each job checks by id
that it trained on every sample exactly once per epoch. The children are this script
again (``--role``, ``_demo_roles.py``), started through tools.harness; they report with
one JSON object per stdout line after ``MARK``. On a terminal a live panel shows the
shared ring (``_demo_panel.py``). Every wait has a deadline (--timeout): on any failure
every child is stopped, nothing is left in /dev/shm or the runtime directory, and the
error is one line (with --debug: the children's output too).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import math
import os
import queue
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

HERE = Path(__file__).resolve().parent
try:  # before the workload's import needs it
    importlib.import_module("PIL.Image")
except ImportError:
    sys.exit("demo.py: error: the demo decodes JPEGs with Pillow, which is not installed\n"
             "hint: pip install -e '.[demo]' (or pip install pillow)")
sys.path.insert(0, str(HERE))  # _demo_roles, _demo_report, _demo_panel
sys.path.append(str(HERE.parent))  # tools/: this checkout's, not installed

import _demo_report as report  # noqa: E402
import _demo_roles as roles  # noqa: E402
import torch  # noqa: E402
import workload  # noqa: E402  (benchmarks/, put on sys.path by _demo_roles)
from _demo_panel import LivePanel  # noqa: E402

from tensorsocket.cli.clean import remove_leftovers  # noqa: E402
from tools import harness  # noqa: E402

PROG = "demo.py"
MARK = roles.MARK
CHILD_TIMEOUT = 60.0  # library timeouts inside the children (handshake, batch, publish, join)
KILL_GRACE = 3.0  # seconds between SIGTERM and SIGKILL when stopping children
BATCH_SIZE = 32


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
    """A child: ``demo.py --role job|producer|consumer ...`` (started by the parent)."""
    # The parent handles Ctrl-C and stops us with SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if args.parent_pid is not None:
        _die_with_parent(args.parent_pid)
    torch.set_num_threads(1)
    try:
        roles.ROLES[args.role](args)
    except Exception as e:
        traceback.print_exc()
        roles.emit("error", message=f"{type(e).__name__}: {e}")
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
    ready: bool = False
    closed: bool = False  # its stdout reached EOF
    exited: bool = False


def _spawn(label: str, rank: int, args: list[str], env: dict[str, str],
           events: "queue.Queue[tuple[_Child, dict]]") -> _Child:
    """Start one child; its events go to `events`; its stdin is a pipe (the start signal)."""
    proc = harness.spawn(harness.python_argv(__file__, *args), env=env, label=label,
                         text=True, bufsize=1, stdin=subprocess.PIPE)
    child = _Child(label, proc, rank)
    proc.follow(events, marker=MARK, tag=child)
    return child


def _stop_children(children: list[_Child]) -> None:
    """SIGTERM every running child (and what it started), SIGKILL what is still alive after
    KILL_GRACE, reap all."""
    group = harness.Children()
    group.procs = [c.proc for c in children]
    group.stop_all(KILL_GRACE)
    for c in children:
        if c.proc.stdin is not None:
            try:
                c.proc.stdin.close()
            except OSError:  # a child that died with unread input: nothing to flush
                pass


def _child_output(children: list[_Child]) -> str:
    """The last lines each child wrote, for --debug."""
    parts = []
    for child in children:
        tail = getattr(child.proc, "tail", ())
        if tail:
            body = "\n".join("    " + line for line in tail)
            parts.append(f"--- output of {child.label} (pid {child.proc.pid}) ---\n{body}")
    return "\n".join(parts)


@dataclass
class Settings:
    """What the user asked for."""

    jobs: int = 3
    epochs: int = 3
    images: int = 512
    workers: int = 1  # DataLoader workers per baseline job
    timeout: float = 300.0

    @property
    def producer_workers(self) -> int:
        """The shared loader's workers: the jobs' together, at most the usable cores."""
        return max(1, min(self.jobs * self.workers, len(os.sched_getaffinity(0))))


class _Run:
    """One run of the jobs, "baseline" (a DataLoader each) or "shared": its children,
    their events, their results."""

    def __init__(self, demo: "_Demo", mode: str) -> None:
        self.demo = demo
        self.mode = mode
        self.events: "queue.Queue[tuple[_Child, dict]]" = queue.Queue()
        self.children: list[_Child] = []
        self.jobs: dict[int, dict] = {}
        self.producer: dict | None = None
        self.panel: LivePanel | None = None

    def execute(self) -> dict:
        """Run the children to the end; the run's figures (report.measure_run)."""
        cpu0, t0 = roles.children_cpu_seconds(), time.monotonic()
        busy0, own0 = harness.machine_busy_seconds(), time.process_time()
        try:
            self.start()
            self.follow()
        except DemoError as e:
            _stop_children(self.children)  # first, so that the readers have every line
            e.details = _child_output(self.children)
            raise
        finally:
            # Ctrl-C or SIGTERM again must not cut the teardown short (the children ignore
            # a second SIGTERM): held until every child is stopped and the files are gone.
            held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            try:
                if self.panel is not None:
                    self.panel.clear()
                _stop_children(self.children)
                if self.mode == "shared":
                    remove_leftovers(self.demo.name)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
        figures = report.measure_run([self.jobs[k] for k in sorted(self.jobs)], self.producer,
                                     time.monotonic() - t0, roles.children_cpu_seconds() - cpu0)
        busy1 = harness.machine_busy_seconds()
        # What the rest of the machine did meanwhile: all CPUs' busy time less this run's
        # processes and this parent (a busy machine skews the comparison).
        figures["other_cpu_s"] = None if busy0 is None or busy1 is None else max(
            0.0, busy1 - busy0 - figures["cpu_s"] - (time.process_time() - own0))
        if not figures["every_sample_once"]:
            found = [(rank, e + 1, c["missing"], c["repeated"])
                     for rank, j in sorted(self.jobs.items()) for e, c in enumerate(j["epochs"])
                     if c["missing"] or c["repeated"]]
            raise DemoError(f"{self.mode} run: not every sample exactly once per epoch "
                            "(job, epoch, missing, repeated): " + str(found))
        figures["jobs"] = [self.jobs[k] for k in sorted(self.jobs)]
        if self.producer is not None:
            figures["producer"] = self.producer
        self.demo.say(self.mode, f"done: {figures['samples']} samples in "
                                 f"{figures['train_s']:.1f} s ({figures['samples_per_s']:.0f} "
                                 f"samples/s), {figures['train_cpu_s']:.1f} CPU seconds")
        return figures

    def start(self) -> None:
        """Start the producer (shared run) and the jobs."""
        cfg, demo = self.demo.settings, self.demo
        env = harness.child_env(threads=1)  # this tree's tensorsocket; one thread each
        common = ["--epochs", str(cfg.epochs), "--images-dir", demo.images_dir,
                  "--images", str(cfg.images), "--batch", str(BATCH_SIZE),
                  "--parent-pid", str(os.getpid()), "--child-timeout", str(CHILD_TIMEOUT)]
        try:
            if self.mode == "shared":
                self.children.append(_spawn("producer", 0, [
                    "--role", "producer", *common, "--name", demo.name, "--jobs",
                    str(cfg.jobs), "--workers", str(cfg.producer_workers)], env, self.events))
            role = ["--role", "job", "--workers", str(cfg.workers)] if self.mode == "baseline" \
                else ["--role", "consumer", "--name", demo.name]
            for rank in range(1, cfg.jobs + 1):
                self.children.append(_spawn(f"job {rank}", rank, [
                    *role, *common, "--rank", str(rank)], env, self.events))
        except OSError as e:
            raise DemoError(f"cannot start a child process: {e}",
                            f"check that {sys.executable} can run") from e
        if self.mode == "shared" and demo.live:
            self.panel = LivePanel(demo.name, math.ceil(cfg.images / BATCH_SIZE), cfg.epochs,
                                   demo.out)
            demo.panel = self.panel

    def follow(self) -> None:
        """Report the children's events until all have exited; DemoError on any failure."""
        demo = self.demo
        while not all(child.exited for child in self.children):
            remaining = demo.deadline - time.monotonic()
            if remaining <= 0:
                running = ", ".join(c.label for c in self.children if not c.exited)
                raise DemoError(
                    f"the demo did not finish within {demo.settings.timeout:g} s "
                    f"(--timeout; still running in the {self.mode} run: {running})",
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

    def _start_jobs(self) -> None:
        """Every child of the run is ready: let them all start at once."""
        for c in self.children:
            try:
                c.proc.stdin.write("go\n")
                c.proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass  # it died meanwhile: check_exit says so

    def report(self, child: _Child, event: dict) -> None:
        """Print one child's event; DemoError if it reports a failure."""
        kind, say = event.get("event"), self.demo.say
        if kind == "ready":
            child.ready = True
            if child.rank == 0:
                say(child.label, f"ready, {event['batches_per_epoch']} batches per epoch, "
                                 f"{self.demo.settings.producer_workers} loader worker(s); "
                                 f"waiting for {self.demo.settings.jobs} jobs")
            else:
                how = "its own DataLoader" if self.mode == "baseline" else "the shared loader"
                say(child.label, f"ready: {how}, lr {event['lr']:g}")
            if all(c.ready for c in self.children):
                self._start_jobs()
        elif kind == "epoch" and child.rank == 0:
            say(child.label, f"epoch {event['epoch']}/{self.demo.settings.epochs} published: "
                             f"{event['batches']} batches")
        elif kind == "epoch":
            ok = "every sample once" if not event["missing"] and not event["repeated"] else \
                f"{event['missing']} samples missing, {event['repeated']} repeated"
            say(child.label, f"epoch {event['epoch']}/{self.demo.settings.epochs} done, "
                             f"mean loss {event['mean_loss']:.4f}, {ok}")
        elif kind == "result":
            self._result(child, event)
        elif kind == "error":
            raise DemoError(f"{child.label} of the {self.mode} run failed: "
                            f"{event.get('message', '?')}")
        elif kind == "eof":
            child.closed = True

    def _result(self, child: _Child, event: dict) -> None:
        """Keep a child's final report."""
        child.result = event
        if child.rank == 0:
            self.producer = event
            self.demo.say(child.label, f"finished: {event['batches']} batches published once")
            return
        self.jobs[child.rank] = event
        if self.panel is not None:
            batches = math.ceil(event["samples"] / BATCH_SIZE)
            self.panel.finished(child.proc.pid, batches, self._labels())
        self.demo.say(child.label, f"finished: {event['samples']} samples, final loss "
                                   f"{event['final_loss']:.4f}")

    def check_exit(self, child: _Child) -> None:
        """Note a child that has exited; DemoError if it failed or reported no result."""
        code = child.proc.poll()
        if code is None:
            return
        child.exited = True
        if code != 0 or child.result is None:
            why = f"exit code {code}" if code >= 0 else f"signal {-code}"
            raise DemoError(f"{child.label} of the {self.mode} run (pid {child.proc.pid}) "
                            f"ended with {why} without reporting a result")


class _Demo:
    """The parent: the images, the costs per batch, the two runs, the comparison."""

    def __init__(self, settings: Settings, out: TextIO, live: bool | None = None) -> None:
        self.settings = settings
        self.out = out
        self.name = f"demo-{os.getpid()}"
        self.started = time.monotonic()
        self.deadline = math.inf  # set when the runs start (--timeout is for them)
        self.images_dir = ""
        if live is None:
            live = out.isatty() and os.environ.get("TERM", "dumb") != "dumb"
        self.live = live
        self.panel: LivePanel | None = None  # the shared run's, while it runs

    def say(self, label: str, text: str) -> None:
        """Print one progress line (above the live panel)."""
        if self.panel is not None:
            self.panel.clear()
        print(f"[{time.monotonic() - self.started:5.1f}s] {label:<9} {text}", file=self.out,
              flush=True)
        if self.panel is not None:
            self.panel.draw()

    def run(self) -> dict:
        """Both runs and the comparison; the whole result (also what --json writes)."""
        cfg, cores = self.settings, len(os.sched_getaffinity(0))
        print(f"tensorsocket demo: {cfg.jobs} training jobs, {cfg.epochs} epoch(s) of "
              f"{cfg.images} JPEGs ({workload.IMAGE_SIZE} px, decoded and augmented on the "
              f"CPU), batches of {BATCH_SIZE}; producer name {self.name!r}", file=self.out,
              flush=True)
        self.images_dir = str(workload.ensure_images(
            cfg.images, workload.IMAGE_SIZE, progress=lambda text: self.say("images", text),
            processes=cores))
        _read_all(self.images_dir)  # both runs find the files in the page cache
        costs = self.calibrate()
        self.deadline = time.monotonic() + cfg.timeout
        runs = {}
        for mode in report.MODES:
            self.say(mode, f"starting: {cfg.jobs} jobs, "
                     + (f"each with its own DataLoader ({cfg.workers} worker(s))"
                        if mode == "baseline" else
                        f"one shared loader ({cfg.producer_workers} worker(s))"))
            runs[mode] = _Run(self, mode).execute()
            self.panel = None
        model = report.model_speedup(costs["loader_s"], costs["train_s"], cfg.jobs, cores,
                                     cfg.workers, cfg.producer_workers)
        report.table(runs, model, costs, cfg.jobs, cfg.epochs, cores, self.out)
        machine, commit = harness.machine_info(), _commit()
        print(f"  ({_machine_line(machine, commit)}; total "
              f"{time.monotonic() - self.started:.0f} s)", file=self.out, flush=True)
        return {"settings": vars(cfg) | {"producer_workers": cfg.producer_workers,
                                         "batch_size": BATCH_SIZE,
                                         "image_size": workload.IMAGE_SIZE},
                "name": self.name, "costs": costs, "model_speedup": model[0], "runs": runs,
                "machine": machine, "commit": commit,
                "total_s": time.monotonic() - self.started}

    def calibrate(self) -> dict:
        """The loader's and a training step's CPU seconds per batch, one thread each."""
        c = workload.calibrate(self.images_dir, BATCH_SIZE, batches=6, strict_pad=False)
        costs = {"loader_s": c["loader_ms_per_batch"] / 1e3,
                 "train_s": c["train_ms_per_batch"] / 1e3}
        self.say("costs", f"per batch of {BATCH_SIZE}, one thread: loading "
                          f"{c['loader_ms_per_batch']:.0f} ms, a training step "
                          f"{c['train_ms_per_batch']:.0f} ms")
        return costs


def _read_all(directory: str) -> None:
    """Read every file of `directory` once."""
    for path in sorted(Path(directory).iterdir()):
        path.read_bytes()


def _commit() -> str | None:
    """This checkout's commit, if it is a git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _machine_line(m: dict, commit: str | None) -> str:
    """Where this ran (harness.machine_info(), the commit), in one line."""
    return (f"{m['cpus_usable']} cores ({m['cpu_model']}), torch {m['torch']}"
            + (f", commit {commit}" if commit else ""))


def run(settings: Settings | None = None, out: TextIO | None = None,
        live: bool | None = None) -> dict:
    """Run the demo, printing progress and the comparison to `out`; DemoError on any
    failure. live: redraw a status panel under the log during the shared run; default:
    when `out` is a terminal."""
    return _Demo(settings or Settings(), out or sys.stdout, live).run()


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
        prog=PROG, description="Run N training jobs twice, first each with its own "
        "DataLoader, then through one loader shared with tensorsocket, over a loader-bound "
        "workload (JPEG decoding and augmentation), and compare the two runs: wall time, "
        "samples/s, CPU seconds, and the speedup a model of the measured costs predicts.")
    ap.add_argument("--jobs", "--consumers", dest="jobs", type=_positive(int), default=3,
                    metavar="N", help="training jobs in each run (default: 3)")
    ap.add_argument("--epochs", type=_positive(int), default=3, metavar="N",
                    help="epochs each job trains (default: 3)")
    ap.add_argument("--images", type=_positive(int), default=512, metavar="N",
                    help="JPEGs in the dataset, generated once (default: 512)")
    ap.add_argument("--workers", type=_positive(int), default=1, metavar="N",
                    help="DataLoader workers of each baseline job; the shared loader gets "
                    "the jobs' together, at most the cores (default: 1)")
    ap.add_argument("--plot", metavar="PNG", help="also draw the comparison into this file "
                    "(needs matplotlib)")
    ap.add_argument("--json", metavar="PATH", help="also write every figure to this file")
    ap.add_argument("--timeout", type=_positive(float), default=300.0, metavar="SECONDS",
                    help="stop every process and fail when the two runs take longer "
                    "than this (default: 300)")
    ap.add_argument("--no-live", action="store_true",
                    help="no live status panel under the log (default: shown on a terminal)")
    ap.add_argument("--debug", action="store_true",
                    help="show tracebacks and the output of the child processes on errors")
    # The children: this script again, started by the parent.
    ap.add_argument("--role", choices=sorted(roles.ROLES), help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--images-dir", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=BATCH_SIZE, help=argparse.SUPPRESS)
    ap.add_argument("--child-timeout", type=float, default=CHILD_TIMEOUT,
                    help=argparse.SUPPRESS)
    ap.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role is not None:
        return args
    from tensorsocket import _core

    if args.jobs > _core.MAX_CONSUMERS:
        ap.error(f"--jobs {args.jobs} is more than a ring supports "
                 f"(at most {_core.MAX_CONSUMERS})")
    if args.plot is not None and not _have_matplotlib():
        ap.error(f"--plot {args.plot} needs matplotlib, which is not installed here: "
                 "`pip install matplotlib`, or leave --plot out (the table says the same)")
    return args


def _have_matplotlib() -> bool:
    """matplotlib imports."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return False
    return True


def _write_outputs(args: argparse.Namespace, result: dict) -> None:
    """--json and --plot."""
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"  figures written to {args.json}")
    if args.plot:
        report.plot(result["runs"], result["model_speedup"], args.plot)
        print(f"  comparison drawn into {args.plot}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role is not None:
        return child_main(args)
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        _check_environment()
        settings = Settings(jobs=args.jobs, epochs=args.epochs, images=args.images,
                            workers=args.workers, timeout=args.timeout)
        result = run(settings, live=False if args.no_live else None)
        _write_outputs(args, result)
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
