"""``tensorsocket demo``: one producer feeds several training consumers from one shared loader.

The parent (``run()``) starts a producer process and N consumer processes with
``python -m tensorsocket.demo ROLE ...``. The producer runs a DataLoader with
a real per-sample CPU transform over a synthetic in-memory image set and
publishes every batch to the shared-memory ring; each consumer trains a tiny
CNN on those batches. Children report to the parent with one JSON object per
stdout line, prefixed with ``MARK``; the parent prints progress and a summary,
with the live panel of ``tensorsocket._demo_panel`` under it on a terminal.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

import torch
import torch.nn.functional as F
from torch import nn

from ._demo_panel import LivePanel
from .clean import remove_leftovers

MARK = "@tensorsocket-demo "
BATCH_SIZE = 32
IMAGE_SIZE = 96
CROP_SIZE = 64
NUM_CLASSES = 10
MEAN = (0.5, 0.5, 0.5)
STD = (0.25, 0.25, 0.25)
SEED = 0
CHILD_TIMEOUT = 30.0  # library timeouts inside the children (handshake, batch, publish, join)
KILL_GRACE = 3.0  # seconds between SIGTERM and SIGKILL when stopping children
LEARNING_RATES = (0.02, 0.05, 0.1, 0.01)  # consumer k (from 1) uses LEARNING_RATES[(k - 1) % 4]


class DemoError(Exception):
    """The demo failed; ``hint`` says what to try, ``details`` holds the children's output."""

    def __init__(self, message: str, hint: str = "", details: str = "") -> None:
        super().__init__(message)
        self.hint = hint
        self.details = details


# -- data: a synthetic image set and a CPU transform in plain torch --------------------


class SyntheticImages(torch.utils.data.Dataset):
    """Deterministic in-memory uint8 images (3 x 96 x 96) with a class tint; label = index % 10."""

    def __init__(self, count: int, transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 seed: int = SEED) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.labels = torch.arange(count) % NUM_CLASSES
        palette = torch.randint(0, 256, (NUM_CLASSES, 3, 1, 1), generator=gen, dtype=torch.int16)
        self.images = torch.empty(count, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.uint8)
        for start in range(0, count, 256):  # in chunks: no large temporaries
            stop = min(count, start + 256)
            noise = torch.randint(0, 256, (stop - start, 3, IMAGE_SIZE, IMAGE_SIZE),
                                  generator=gen, dtype=torch.int16)
            tint = palette[self.labels[start:stop]]
            self.images[start:stop] = ((3 * noise + tint) // 4).to(torch.uint8)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])


class RandomCropFlipNormalize:
    """Random resized crop to size x size, random flip, to float, per-channel normalization."""

    def __init__(self, size: int = CROP_SIZE, scale: tuple[float, float] = (0.25, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), mean: tuple[float, ...] = MEAN,
                 std: tuple[float, ...] = STD) -> None:
        self.size = size
        self.scale = scale
        self.log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def crop_box(self, height: int, width: int) -> tuple[int, int, int, int]:
        """A random (top, left, height, width) box, as torchvision's RandomResizedCrop picks it."""
        area = height * width
        for _ in range(10):
            target = area * float(torch.empty(()).uniform_(*self.scale))
            aspect = math.exp(float(torch.empty(()).uniform_(*self.log_ratio)))
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, ()))
                left = int(torch.randint(0, width - w + 1, ()))
                return top, left, h, w
        return 0, 0, height, width

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        """Transform one uint8 C x H x W image into a normalized float C x size x size tensor."""
        top, left, h, w = self.crop_box(image.shape[-2], image.shape[-1])
        x = image[:, top:top + h, left:left + w].float().div_(255.0)
        x = F.interpolate(x.unsqueeze(0), size=(self.size, self.size), mode="bilinear",
                          align_corners=False, antialias=True).squeeze(0)
        if float(torch.rand(())) < 0.5:
            x = x.flip(-1)
        return x.sub_(self.mean).div_(self.std)


class TimedLoader:
    """Wrap a loader and add up the CPU time (time.process_time) spent fetching its batches."""

    def __init__(self, loader: torch.utils.data.DataLoader) -> None:
        self.loader = loader
        self.batch_size = loader.batch_size
        self.cpu_seconds = 0.0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        start = time.process_time()
        it = iter(self.loader)
        self.cpu_seconds += time.process_time() - start
        while True:
            start = time.process_time()
            try:
                batch = next(it)
            except StopIteration:
                return
            finally:
                self.cpu_seconds += time.process_time() - start
            yield batch


class TinyCNN(nn.Module):
    """Two strided conv layers, global average pooling and a linear classifier."""

    def __init__(self, classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.fc = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of images."""
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return self.fc(x.mean(dim=(2, 3)))


# -- children ----------------------------------------------------------------------------


def _emit(event: str, **fields: Any) -> None:
    """Send one event to the parent: a marked JSON line on stdout."""
    sys.stdout.write(MARK + json.dumps({"event": event, **fields}, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _run_producer(name: str, consumers: int, epochs: int, images: int) -> None:
    """Producer role: run the loader `epochs` times through a TensorProducer."""
    from .producer import TensorProducer

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
    from .consumer import TensorConsumer

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


def child_main(argv: list[str] | None = None) -> int:
    """Entry point of a child process: ``python -m tensorsocket.demo ROLE ...``."""
    parser = argparse.ArgumentParser(prog="python -m tensorsocket.demo",
                                     description="a child of `tensorsocket demo` (internal)")
    parser.add_argument("role", choices=["producer", "consumer"])
    parser.add_argument("--name", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--consumers", type=int, default=1)
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
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
    proc: subprocess.Popen
    rank: int = 0  # 0 for the producer
    stderr_tail: deque = field(default_factory=lambda: deque(maxlen=40))
    result: dict | None = None
    closed: bool = False  # its stdout reached EOF
    exited: bool = False
    readers: list = field(default_factory=list)


def _read_stdout(child: _Child, events: "queue.Queue[tuple[_Child, dict]]") -> None:
    """Thread: forward the child's marked JSON lines to the queue, keep the other lines."""
    assert child.proc.stdout is not None
    for line in child.proc.stdout:
        if line.startswith(MARK):
            try:
                event = json.loads(line[len(MARK):])
            except ValueError:
                child.stderr_tail.append(line.rstrip("\n"))
                continue
            events.put((child, event))
        else:
            child.stderr_tail.append(line.rstrip("\n"))
    events.put((child, {"event": "eof"}))


def _read_stderr(child: _Child) -> None:
    """Thread: keep the last lines the child wrote to stderr."""
    assert child.proc.stderr is not None
    for line in child.proc.stderr:
        child.stderr_tail.append(line.rstrip("\n"))


def _child_env() -> dict[str, str]:
    """Environment for the children: this package importable, one thread each."""
    env = dict(os.environ)
    package_parent = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    return env


def _spawn(label: str, rank: int, args: list[str], env: dict[str, str],
           events: "queue.Queue[tuple[_Child, dict]]") -> _Child:
    """Start one child and its reader threads."""
    proc = subprocess.Popen([sys.executable, "-m", "tensorsocket.demo", *args], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, bufsize=1)
    child = _Child(label, proc, rank)
    child.readers = [threading.Thread(target=_read_stdout, args=(child, events), daemon=True),
                     threading.Thread(target=_read_stderr, args=(child,), daemon=True)]
    for reader in child.readers:
        reader.start()
    return child


def _stop_children(children: list[_Child]) -> None:
    """SIGTERM every running child, SIGKILL those still alive after KILL_GRACE, reap all."""
    for child in children:
        if child.proc.poll() is None:
            try:
                child.proc.terminate()
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + KILL_GRACE
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
    for child in children:
        for reader in child.readers:
            reader.join(timeout=1.0)


def _child_output(children: list[_Child]) -> str:
    """The last lines each child wrote, for --debug."""
    parts = []
    for child in children:
        if child.stderr_tail:
            body = "\n".join("    " + line for line in child.stderr_tail)
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
        env = _child_env()
        common = ["--name", self.name, "--epochs", str(self.epochs),
                  "--parent-pid", str(os.getpid())]
        try:
            self.children.append(_spawn("producer", 0, [
                "producer", *common, "--consumers", str(self.consumers),
                "--images", str(self.images)], env, self.events))
            for rank in range(1, self.consumers + 1):
                self.children.append(_spawn(f"consumer {rank}", rank, [
                    "consumer", *common, "--rank", str(rank)], env, self.events))
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


if __name__ == "__main__":
    sys.exit(child_main())
