"""A hyper-parameter sweep over one shared loader: trials with their own batch sizes, joining late.

    python examples/sweep.py            # 4 trials, started 1 s apart (~15 s on 2 CPU cores)
    python examples/sweep.py --quick    # 3 trials of 2-3 epochs, 0.5 s apart (~10 s)

This file is both roles. The driver (no --trial) runs ONE DataLoader (JPEG decoding and
augmentation, as in train_alone.py) through an explicit TensorProducer, and starts the
trials as separate processes at different times: ``python sweep.py --trial --lr ...
--batch-size ...``. Each trial is an ordinary training loop over
``TensorConsumer(name=..., batch_size=B)``: the consumer cuts the loader's batches of 64
into batches of B (zero-copy slices where B divides 64; 48 does not, so some of its batches
are concatenated across two loader batches).

What to look at:
- Each trial (a ResNet-18, as in train_alone.py, on 32 px crops) prints its loss per epoch;
  every epoch has all 320 samples (10 x --images), whatever the batch size and whenever the
  trial started. A trial that starts while the producer is mid-epoch
  is a late joiner: its epochs start at the oldest batch the producer still keeps
  (docs/usage.md, "What a consumer gets"), so they straddle the producer's epochs.
- The driver prints a table of the trials (lr, batch size, epochs, final loss, samples
  seen, when it started) and the loader CPU time: measured once for everybody in this
  process, against what separate DataLoaders would have spent for the samples the trials
  used. The loader runs with num_workers=0 here, so all of its CPU time is this process's
  and is measured (time.process_time); the trials' own CPU is not counted on either side.
The producer stops once every trial has finished (it runs as many epochs as they need).
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.nn.functional as F

from tensorsocket import TensorConsumer, TensorProducer

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tools/: this checkout's, not installed
from tools import harness  # noqa: E402

RESULT = "RESULT "  # a trial's last stdout line: RESULT {json}
LOADER_BATCH = 64

# (learning rate, batch size, epochs, start delay in seconds)
TRIALS = [(0.1, 32, 4, 0.0), (0.03, 64, 4, 1.0), (0.3, 16, 3, 2.0), (0.01, 48, 3, 3.0)]
QUICK_TRIALS = [(0.1, 32, 3, 0.0), (0.03, 64, 2, 0.5), (0.01, 48, 2, 1.0)]
CROP = 32


# -- a trial: an ordinary training loop over a TensorConsumer ---------------------------


def trial(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    me = f"[trial {args.trial} lr {args.lr} batch {args.batch_size}]"
    models = import_vision()[1]
    model = models.resnet18(num_classes=10)  # the model of train_alone.py, on smaller crops
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = TensorConsumer(name=args.name, batch_size=args.batch_size, timeout=60)
    print(f"{me} attached: {len(loader)} batches per epoch", flush=True)
    samples_seen, loss = 0, float("nan")
    for epoch in range(1, args.epochs + 1):
        total, samples = 0.0, 0
        for x, y in loader:
            out = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            out.backward()
            optimizer.step()
            total += out.item() * len(y)
            samples += len(y)
        loss = total / samples
        samples_seen += samples
        print(f"{me} epoch {epoch}/{args.epochs}: loss {loss:.3f} ({samples} samples)",
              flush=True)
    loader.close()
    harness.emit({"trial": args.trial, "lr": args.lr, "batch_size": args.batch_size,
                  "epochs": args.epochs, "final_loss": loss, "samples": samples_seen},
                 marker=RESULT)


# -- the driver: one producer, trials started at different times -----------------------


class Trial:
    """A trial process (started through tools.harness); a thread echoes its output
    and keeps its result."""

    def __init__(self, number: int, lr: float, batch_size: int, epochs: int, name: str) -> None:
        self.number, self.lr, self.batch_size, self.epochs = number, lr, batch_size, epochs
        self.started = time.perf_counter()
        self.proc = harness.spawn(
            harness.python_argv(os.path.abspath(__file__), "--trial", str(number), "--name",
                                name, "--lr", str(lr), "--batch-size", str(batch_size),
                                "--epochs", str(epochs)),
            env=harness.child_env(), stderr=None, label=f"trial {number}")
        self.events: queue.Queue = queue.Queue()
        self.proc.follow(self.events, marker=RESULT, echo=lambda line: print(line, flush=True))
        self._result: dict | None = None

    @property
    def result(self) -> dict | None:
        """Its RESULT line, once it printed it."""
        while self._result is None and not self.events.empty():
            _, event = self.events.get()
            if event.get("event") != "eof":
                self._result = event
        return self._result

    def done(self) -> bool:
        return self.proc.poll() is not None


class TimedLoader:
    """The DataLoader, adding up the samples it loads and the CPU time that takes.

    With num_workers=0 the loader runs in this thread, so time.thread_time() around each
    next() is exactly its CPU cost: reading, decoding, augmenting and collating a batch.
    """

    def __init__(self, loader) -> None:
        self.loader = loader
        self.samples = 0
        self.cpu = 0.0

    def __getattr__(self, name):  # batch_size, sampler, drop_last...: the producer reads them
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        it = iter(self.loader)
        while True:
            start = time.thread_time()
            try:
                batch = next(it)
            except StopIteration:
                return
            finally:
                self.cpu += time.thread_time() - start
            self.samples += len(batch[1])
            yield batch


def import_vision():
    """(datasets, models, transforms, what): torchvision where it imports, else _vision.py."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import torchvision
        from torchvision import datasets, models, transforms

        return datasets, models, transforms, f"torchvision {torchvision.__version__}"
    except Exception as e:  # not installed, or a build for another torch
        from _vision import datasets, models, transforms

        return datasets, models, transforms, \
            f"examples/_vision.py, as torchvision does not import here ({e!r:.100})"


def make_loader(args: argparse.Namespace) -> torch.utils.data.DataLoader:
    """The JPEG pipeline of train_alone.py, with smaller crops."""
    from _data import image_folder

    datasets, _, transforms, vision = import_vision()
    print(f"[driver] vision: {vision}", flush=True)
    augment = transforms.Compose([
        transforms.RandomResizedCrop(CROP, scale=(0.25, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ])
    images = datasets.ImageFolder(image_folder(args.images, 256, args.data), transform=augment)
    # num_workers=0: the loading happens in this process, so its CPU time is measured below.
    return torch.utils.data.DataLoader(images, batch_size=LOADER_BATCH, shuffle=True,
                                       num_workers=0)


def driver(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    name = f"sweep-{uuid.uuid4().hex[:8]}"
    schedule = QUICK_TRIALS if args.quick else TRIALS
    loader = TimedLoader(make_loader(args))
    trials: list[Trial] = []

    def launch_due() -> None:
        """Start the trials whose time has come; stop if one failed."""
        while len(trials) < len(schedule) and \
                time.perf_counter() - t0 >= schedule[len(trials)][3]:
            lr, bs, epochs, _ = schedule[len(trials)]
            print(f"[driver] t={time.perf_counter() - t0:.1f} s: starting trial "
                  f"{len(trials) + 1} (lr {lr}, batch size {bs}, epochs: {epochs})", flush=True)
            trials.append(Trial(len(trials) + 1, lr, bs, epochs, name))
        for t in trials:
            if t.done() and t.proc.returncode != 0:
                raise SystemExit(f"trial {t.number} failed (exit {t.proc.returncode})")

    def finished() -> bool:
        return len(trials) == len(schedule) and all(t.done() for t in trials)

    def wait_for_a_trial() -> None:
        # min_consumers=0 lets this driver decide when the producer stops (a producer with
        # min_consumers=1 would wait for a consumer after the last trial left). Meanwhile it
        # does what min_consumers=1 does: the loader does not run while no trial is attached.
        # (The very first batch is published before trial 1 can attach, as the ring is made
        # from it; trial 1 still gets it: it stays readable in the late-joiner window.)
        while producer.stats()["consumers"] == 0 and not finished():
            launch_due()
            time.sleep(0.05)

    cpu0, t0 = time.process_time(), time.perf_counter()
    with TensorProducer(loader, name=name, min_consumers=0) as producer:
        print(f"[driver] producer {name!r}: {len(loader)} batches of {LOADER_BATCH} per epoch; "
              f"{len(schedule)} trials, started {schedule[1][3]:g} s apart", flush=True)
        try:
            launch_due()
            epoch = 0
            while not finished():
                epoch += 1
                batches = 0
                for _ in producer:  # one epoch of the loader, published to the ring
                    batches += 1
                    launch_due()
                    if finished():
                        break  # every trial is done: no need to finish the epoch
                    wait_for_a_trial()
                print(f"[driver] producer epoch {epoch}: {batches} batches published, "
                      f"{producer.stats()['consumers']} trial(s) attached", flush=True)
            stats = producer.stats()
        finally:
            for t in trials:
                if not t.done():
                    t.proc.kill_tree()
                t.proc.stop(grace=5.0)  # reaped, its output read to the end
    cpu = time.process_time() - cpu0
    failed = [t.number for t in trials if t.proc.returncode != 0 or t.result is None]
    if failed:
        raise SystemExit(f"trial(s) {failed} failed")
    summary(trials, loader, cpu, stats, time.perf_counter() - t0)


def summary(trials: list[Trial], loader: TimedLoader, cpu: float, stats: dict,
            wall: float) -> None:
    print(f"\n{'trial':>5} {'lr':>6} {'batch':>5} {'epochs':>6} {'final loss':>10} "
          f"{'samples':>7} {'started':>8}")
    for t in trials:
        r = t.result
        print(f"{t.number:>5} {r['lr']:>6g} {r['batch_size']:>5} {r['epochs']:>6} "
              f"{r['final_loss']:>10.3f} {r['samples']:>7} {t.started - trials[0].started:>+7.1f}s")
    used = sum(t.result["samples"] for t in trials)
    per_sample = loader.cpu / loader.samples  # measured: the loader's CPU cost of one sample
    alone = per_sample * used
    print(f"\nshared loader: {loader.samples} samples loaded once, {loader.cpu:.1f} s of loader "
          f"CPU ({1e3 * per_sample:.2f} ms/sample); this process in all (loader, publishing "
          f"{stats['batches']} batches = {stats['bytes_copied'] / 1e6:.0f} MB into the ring, "
          f"control): {cpu:.1f} s of CPU")
    print(f"the trials used {used} samples; a DataLoader per trial would have loaded each of "
          f"them: ~{alone:.1f} s of CPU at {1e3 * per_sample:.2f} ms/sample")
    if alone > cpu:
        print(f"saved: ~{alone - cpu:.1f} s of CPU ({1 - cpu / alone:.0%} of the loading); "
              f"wall time {wall:.1f} s")
    else:
        print(f"saved nothing this time (the trials hardly overlapped); wall time {wall:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter trials")
    ap.add_argument("--images", type=int, default=32, help="JPEGs per class (10 classes)")
    ap.add_argument("--data", help="directory for the JPEGs (default: a reused temp dir)")
    ap.add_argument("--trial", type=int, help=argparse.SUPPRESS)  # the roles the driver starts
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--lr", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--epochs", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trial:
        trial(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
