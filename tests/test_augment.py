"""A consumer's own per-sample transform over the producer's shared samples (issue 27):
real producer processes, consumers here (with worker processes of their own).

The producer's loader yields (images, ids): image i is a uint8 (3, 12, 12) tensor filled
with i. The transforms here crop and add noise drawn from torch's generator, so what they
return tells the sample (its floor is the id), the crop and the draw (the seed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest
import torch

from conftest import ROOT, alive as _alive, popen
from tensorsocket import ProducerFinished, TensorConsumer, TensorSocketError, \
    TensorSocketWarning, TransformError
from tensorsocket.augment.seeding import _UNKNOWN_ID as UNKNOWN_ID, sample_seed, seed_everything

SAMPLES = 40
BATCH = 8

PRODUCER = textwrap.dedent(r'''
    import faulthandler, signal, sys, torch
    from torch.utils.data import DataLoader, Dataset
    from tensorsocket import TensorProducer

    faulthandler.register(signal.SIGUSR1)  # a test that waits too long asks where it is

    name, epochs, consumers, kind = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

    class Images(Dataset):
        def __len__(self):
            return %d
        def __getitem__(self, i):
            image = torch.full((3, 12, 12), i, dtype=torch.uint8)
            return {"image": image, "id": i} if kind == "dict" else (image, i)

    class Stream(torch.utils.data.IterableDataset):  # no len(): an epoch of unknown length
        def __iter__(self):
            return ((torch.full((3, 12, 12), i, dtype=torch.uint8), i) for i in range(%d))

    loader = (DataLoader(Stream(), batch_size=%d) if kind == "stream" else
              DataLoader(Images(), batch_size=%d, shuffle=True))
    producer = TensorProducer(loader, name=name, min_consumers=consumers, start_grace=0,
                              ring_slots=6)
    for _ in range(epochs):
        for _ in producer:
            pass
    producer.join()
''' % (SAMPLES, SAMPLES, BATCH, BATCH))


def crop_and_noise(size: int):
    """A transform: a random size x size crop of the sample, as float, plus noise in [0, 1)."""
    def transform(x: torch.Tensor) -> torch.Tensor:
        i, j = torch.randint(0, 12 - size + 1, (2,)).tolist()
        return x[:, i:i + size, j:j + size].float() + torch.rand(())
    transform.__qualname__ = f"crop_and_noise({size})"
    return transform


def expected(transform, seed: int, epoch: int, i: int) -> torch.Tensor:
    """What `transform` gives sample i in `epoch` for a job seeded `seed`."""
    seed_everything(sample_seed(seed, epoch, i))
    return transform(torch.full((3, 12, 12), i, dtype=torch.uint8))


@pytest.fixture
def producer(name, tmp_path):
    """Start a producer process: producer(epochs, consumers, kind="tuple")."""
    started = []

    def start(epochs: int = 2, consumers: int = 1, kind: str = "tuple"):
        script = tmp_path / "producer.py"
        script.write_text(PRODUCER)
        p = popen([sys.executable, str(script), name, str(epochs), str(consumers), kind],
                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started.append(p)
        return p
    yield start
    for p in started:  # each ends once its epochs are read and its consumers gone
        try:
            p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGUSR1)
            try:
                out = p.communicate(timeout=5)[0]
            except subprocess.TimeoutExpired:
                p.kill()
                out = p.communicate()[0]
            pytest.fail(f"the producer did not end:\n{out[-3000:]}")


def read_out(consumer, epochs: int, it=None) -> None:
    """Read on (from `it`, an iterator of the consumer's epoch under way, if given) until
    this consumer has taken the producer's last entry (the end marker of its epoch
    `epochs` - 1); a batch whose transform fails counts as read (the loop goes on after a
    TransformError; a new iter() would skip the rest of the epoch instead).

    A producer whose consumers have all left pauses before its next batch until one
    attaches (min_consumers, start_timeout=None: tensorsocket/producer/gate.py), so the
    producer fixture, which waits for it to end, needs its `epochs` read: a test whose
    consumers stop earlier (a consumer resumed from state_dict() reads only what it needs,
    one whose transform fails stops at the error) has its last consumer read out the rest,
    without which the producer ends only if it published its last batch before that
    consumer left (a race it loses when the machine is busy). It stops at the last entry
    rather than iterating on to ProducerFinished: the producer ends then, and an iter() that
    unparks while it closes waits for an answer that never comes."""
    entries = epochs * (SAMPLES // BATCH + 1)  # each epoch's batches and its end marker
    with warnings.catch_warnings():  # (a late joiner's epoch may span two of the producer's)
        warnings.simplefilter("ignore", TensorSocketWarning)
        for _ in range(epochs + 1):
            if consumer.ring.info()["published"] == entries and consumer.stats()["lag"] == 0:
                return
            it = iter(consumer) if it is None else it
            while True:
                try:
                    next(it)
                except TransformError:
                    continue
                except StopIteration:
                    break
                except ProducerFinished:
                    return
            it = None
    pytest.fail(f"the producer's {entries} entries were not read within {epochs + 1} epochs")


def read_epochs(consumer, epochs: int) -> list[dict[int, torch.Tensor]]:
    """{id: output} of each epoch, asserting every id once per epoch."""
    seen = []
    for _ in range(epochs):
        got: dict[int, torch.Tensor] = {}
        for images, ids in consumer:
            for k, i in enumerate(ids.tolist()):
                assert i not in got, f"sample {i} twice in one epoch"
                got[i] = images[k].clone()
        assert sorted(got) == list(range(SAMPLES))
        seen.append(got)
    return seen


@pytest.mark.parametrize("workers", [0, 2])
def test_two_jobs_own_transforms_one_producer(name, producer, workers):
    """Two jobs, each with its own transform and seed, over one producer: every sample
    once per epoch to each, each transformed by its own transform with the randomness of
    (its seed, epoch, sample id), with or without worker processes."""
    p = producer(epochs=2, consumers=2)
    a_t, b_t = crop_and_noise(8), crop_and_noise(5)
    with TensorConsumer(name=name, transform=a_t, seed=11, transform_workers=workers) as a, \
            TensorConsumer(name=name, transform=b_t, seed=12) as b:
        outs = {"a": [], "b": []}
        for epoch in range(2):  # the two jobs read in turn, a batch each
            got_a: dict[int, torch.Tensor] = {}
            got_b: dict[int, torch.Tensor] = {}
            for (xa, ia), (xb, ib) in zip(a, b):
                assert xa.shape[1:] == (3, 8, 8) and xb.shape[1:] == (3, 5, 5)
                got_a.update({i: xa[k].clone() for k, i in enumerate(ia.tolist())})
                got_b.update({i: xb[k].clone() for k, i in enumerate(ib.tolist())})
            assert sorted(got_a) == sorted(got_b) == list(range(SAMPLES))
            outs["a"].append(got_a)
            outs["b"].append(got_b)
        if workers:
            assert len(a.stats()["transform_workers"]) == workers
            assert a.stats()["transform_seconds"] == 0.0  # all of it in the workers
        else:
            assert a.stats()["transform_seconds"] > 0.0
        assert b.stats()["transform_seconds"] > 0.0 and "transform_seconds" in b.stats()
    for epoch in range(2):
        for i in range(SAMPLES):
            assert torch.equal(outs["a"][epoch][i], expected(a_t, 11, epoch, i)), (epoch, i)
            assert torch.equal(outs["b"][epoch][i], expected(b_t, 12, epoch, i)), (epoch, i)
    # Another epoch, another draw (same seed): not the same crops and noise.
    assert any(not torch.equal(outs["a"][0][i], outs["a"][1][i]) for i in range(SAMPLES))
    assert p.wait(60) == 0


def test_workers_and_in_process_agree_and_leave_the_callers_rng(name, producer):
    """The same seed gives the same outputs with workers and without; the transform run
    in this process leaves torch's generator where the caller had it."""
    producer(epochs=1, consumers=2)
    t = crop_and_noise(6)
    torch.manual_seed(3)
    want_rand = torch.rand(4)
    torch.manual_seed(3)
    with TensorConsumer(name=name, transform=t, seed=5, transform_workers=0) as here, \
            TensorConsumer(name=name, transform=t, seed=5, transform_workers=3,
                           transform_prefetch=1) as there:
        first = torch.rand(2)
        got_here: dict[int, torch.Tensor] = {}
        got_there: dict[int, torch.Tensor] = {}
        for (x0, i0), (x1, i1) in zip(here, there):
            got_here.update({i: x0[k] for k, i in enumerate(i0.tolist())})
            got_there.update({i: x1[k] for k, i in enumerate(i1.tolist())})
        rest = torch.rand(2)
    assert torch.equal(torch.cat([first, rest]), want_rand)
    assert sorted(got_here) == list(range(SAMPLES))
    assert all(torch.equal(got_here[i], got_there[i]) for i in range(SAMPLES))


def test_seed_none_follows_torch_manual_seed(name, producer):
    """seed=None draws the job seed from torch's generator, as a DataLoader its base seed."""
    producer(epochs=1, consumers=2)
    torch.manual_seed(7)
    a = TensorConsumer(name=name, transform=crop_and_noise(4))
    torch.manual_seed(7)
    b = TensorConsumer(name=name, transform=crop_and_noise(4))
    try:
        assert a.stats()["transform_seed"] == b.stats()["transform_seed"]
        assert isinstance(a.stats()["transform_seed"], int)
        for (xa, ia), (xb, ib) in zip(a, b):
            assert torch.equal(ia, ib) and torch.equal(xa, xb)
    finally:
        a.close()
        b.close()


def test_dict_batches_and_pil_samples(name, producer):
    """A dict batch: the transform runs on batch["image"] (the other keys untouched); with
    transform_input="pil" it gets PIL images."""
    producer(epochs=1, kind="dict")

    def flip_pil(img):
        assert img.mode == "RGB" and img.size == (12, 12)
        return torch.from_numpy(np.array(img)).permute(2, 0, 1).flip(-1).float()

    with TensorConsumer(name=name, transform=flip_pil, transform_input="pil",
                        transform_workers=1) as c:
        seen = []
        for batch in c:
            assert set(batch) == {"image", "id"}
            assert batch["image"].dtype == torch.float32
            assert torch.equal(batch["image"][:, 0, 0, 0], batch["id"].float())
            seen += batch["id"].tolist()
    assert sorted(seen) == list(range(SAMPLES))


def test_a_transform_that_cannot_run_names_both_sides(name, producer):
    """A transform written for float input fails at the first batch with a TransformError
    that names the transform and what the shared samples are."""
    producer(epochs=1)

    def needs_float(x):
        return torch.nn.functional.normalize(x, dim=0)  # no uint8 kernel

    with TensorConsumer(name=name, transform=needs_float, transform_workers=2) as c:
        it = iter(c)
        with pytest.raises(TransformError) as e:
            next(it)
        read_out(c, 1, it)
    text = str(e.value)
    assert "needs_float" in text and "torch.uint8" in text and "(3, 12, 12)" in text
    assert "transform_input='pil'" in text and isinstance(e.value, ValueError)


def test_a_worker_error_carries_its_traceback(name, producer):
    """A transform that fails on one sample in a worker: the consumer raises a
    TransformError with the worker's traceback, at that batch."""
    producer(epochs=1)

    parent = os.getpid()  # (the first sample's check runs here, in the parent)

    def fails_on_13(x):
        if int(x[0, 0, 0]) == 13 and os.getpid() != parent:
            raise KeyError("sample 13 is cursed")
        return x.float()

    with TensorConsumer(name=name, transform=fails_on_13, transform_workers=2) as c:
        with pytest.raises(TransformError, match="sample 13 is cursed") as e:
            for _ in c:
                pass
    assert "fails_on_13" in str(e.value) and "Traceback" in str(e.value)


def test_a_killed_worker_is_an_error_not_a_hang(name, producer):
    """A transform worker killed (the OOM killer, say) makes next() raise, naming it."""
    producer(epochs=1)
    gate = os.pipe()

    def slow(x):
        os.read(gate[0], 1)  # waits until the test writes: the batch stays in flight
        return x.float()

    with TensorConsumer(name=name, transform=slow, transform_workers=1,
                        transform_prefetch=1) as c:
        it = iter(c)
        os.write(gate[1], b"x" * BATCH)  # the first batch's samples (in the check: 1)
        os.write(gate[1], b"x")
        next(it)
        pid = c.stats()["transform_workers"][0]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(TensorSocketError, match=f"transform worker \\(pid {pid}\\) "
                                                    "exited unexpectedly"):
            next(it)
        # the workers are stopped, the batches in flight give their slots back and stay
        # undelivered; this iterator keeps saying so
        with pytest.raises(TensorSocketError, match="a new iter\\(\\) starts new"):
            next(it)
        assert c.stats()["transform_workers"] == []
        c._place.flush_releases()
        assert c.ring.held_slots() == 0
        os.write(gate[1], b"x" * SAMPLES * 2)  # (the new workers' transforms pass the gate)
        read_out(c, 1)


def test_break_drops_the_batches_in_flight(name, producer):
    """A loop that breaks with batches in flight: the next epoch is whole, every sample
    once, and the worker results of the dropped batches are not delivered."""
    producer(epochs=2)
    t = crop_and_noise(8)
    with TensorConsumer(name=name, transform=t, seed=1, transform_workers=2) as c:
        for k, _ in enumerate(c):
            if k == 1:
                break
        got = read_epochs(c, 1)[0]
    assert all(torch.equal(got[i], expected(t, 1, 1, i)) for i in range(SAMPLES))


def test_state_dict_counts_only_delivered_batches(name, producer, tmp_path):
    """state_dict() mid-epoch with batches in flight names only the samples delivered: a
    consumer resumed from it gets exactly the others (the first consumer takes all of the
    producer's first epoch into flight: the producer runs 3 for the second to find)."""
    producer(epochs=3)
    with TensorConsumer(name=name, transform=crop_and_noise(8), transform_workers=2) as c:
        it = iter(c)
        first = [next(it)[1].tolist() for _ in range(2)]
        state = c.state_dict()
    taken = sorted(sum(first, []))
    with TensorConsumer(name=name, transform=crop_and_noise(8), transform_workers=1) as c:
        c.load_state_dict(state)
        rest = sorted(i for _, ids in c for i in ids.tolist())
        read_out(c, 3)
    assert sorted(taken + rest) == list(range(SAMPLES))


def test_bad_transform_options_name_the_knob():
    """Options are checked before anything attaches."""
    with pytest.raises(TypeError, match="seed, transform_workers given without transform="):
        TensorConsumer(name="unused", seed=3, transform_workers=2)
    with pytest.raises(TypeError, match="transform must be callable"):
        TensorConsumer(name="unused", transform="flip")
    with pytest.raises(ValueError, match="transform_workers must be an int >= 0"):
        TensorConsumer(name="unused", transform=abs, transform_workers=-1)
    with pytest.raises(ValueError, match="transform_input must be one of"):
        TensorConsumer(name="unused", transform=abs, transform_input="jpeg")


class Compose:
    """A stand-in for torchvision's Compose (split_transform reads .transforms)."""

    def __init__(self, transforms):
        self.transforms = transforms


def _step(name):
    return type(name, (), {})()


def test_split_transform_cuts_before_the_first_random_or_float_step():
    """The shared part is the leading uint8-preserving deterministic transforms; the job
    keeps the rest, in a pipeline of the same kind; nothing to share or nothing left is
    an error naming why."""
    import tensorsocket

    steps = [_step(n) for n in ("Resize", "PILToTensor", "RandomResizedCrop",
                                "RandomHorizontalFlip", "ToDtype", "Normalize")]
    shared, job = tensorsocket.split_transform(Compose(steps))
    assert isinstance(shared, Compose) and isinstance(job, Compose)
    assert shared.transforms == steps[:2] and job.transforms == steps[2:]
    with pytest.raises(ValueError, match="first transform, RandomResizedCropAndInterpolation"):
        tensorsocket.split_transform(Compose([_step("RandomResizedCropAndInterpolation")]))
    with pytest.raises(ValueError, match="nothing is left for the job"):
        tensorsocket.split_transform(Compose([_step("Resize"), _step("PILToTensor")]))
    with pytest.raises(TypeError, match="takes a Compose"):
        tensorsocket.split_transform([_step("Resize")])


def test_a_stale_iterator_ends_and_leaves_the_new_ones_batches(name, producer):
    """An iterator made before the current one ends at once; the current one's batches in
    flight are not touched by it."""
    producer(epochs=1)
    with TensorConsumer(name=name, transform=crop_and_noise(8), seed=2,
                        transform_workers=2) as c:
        old = iter(c)
        new = iter(c)
        ids = next(new)[1].tolist()
        with pytest.raises(StopIteration):
            next(old)
        for _, more in new:
            ids += more.tolist()
    assert sorted(ids) == list(range(SAMPLES))


CONSUMER = textwrap.dedent(r'''
    import json, sys, torch
    from tensorsocket import TensorConsumer

    def crop(x):
        i, j = torch.randint(0, 5, (2,)).tolist()
        return x[:, i:i + 8, j:j + 8].float()

    c = TensorConsumer(name=sys.argv[1], transform=crop, transform_workers=2)
    it = iter(c)
    next(it)
    print(json.dumps(c.stats()["transform_workers"]), flush=True)
    sys.stdin.read()  # until the test kills this process
''')


def test_a_killed_job_takes_its_workers_with_it(name, producer, tmp_path):
    """A job SIGKILLed with its transform workers running: the workers end by themselves
    (they watch their parent), and another job goes on reading every sample."""
    import json

    producer(epochs=2, consumers=2)
    script = tmp_path / "consumer.py"
    script.write_text(CONSUMER)
    job = popen([sys.executable, str(script), name], cwd=ROOT, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with TensorConsumer(name=name, transform=crop_and_noise(8), seed=4) as c:
            it = iter(c)
            ids = next(it)[1].tolist()
            workers = json.loads(job.stdout.readline())
            assert len(workers) == 2
            job.kill()
            job.wait(30)
            ids += [i for _, more in it for i in more.tolist()]
            assert sorted(ids) == list(range(SAMPLES))
            assert sorted(read_epochs(c, 1)[0]) == list(range(SAMPLES))
        deadline = time.monotonic() + 30
        while any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in workers):
            assert time.monotonic() < deadline, f"workers {workers} outlived their job"
            time.sleep(0.1)
    finally:
        if job.poll() is None:
            job.kill()
        job.communicate()


def test_a_pipeline_is_named_by_its_steps():
    """Errors name a Compose by its steps (its repr's first line says only "Compose(")."""
    from tensorsocket.augment.samples import describe

    assert describe(Compose([_step("RandomResizedCrop"), _step("Normalize")])) == \
        "Compose(RandomResizedCrop, Normalize)"
    assert describe(crop_and_noise(4)).startswith("<function crop_and_noise(4)")


@pytest.mark.parametrize("workers", [0, 2])
def test_without_sample_ids_a_samples_position_seeds_it(name, producer, workers):
    """A loader that does not tell its samples' dataset indices (an IterableDataset): each
    sample's position in the epoch, counted across its batches from 0 at every epoch, seeds
    it in the indices' stead (kept apart from any index)."""
    producer(epochs=2, kind="stream")
    t = crop_and_noise(6)
    with TensorConsumer(name=name, transform=t, seed=5, transform_workers=workers) as c:
        for epoch in range(2):
            position = 0
            for images, labels in c:
                for image, i in zip(images, labels.tolist()):
                    seed_everything(sample_seed(5, epoch, UNKNOWN_ID + position))
                    want = t(torch.full((3, 12, 12), i, dtype=torch.uint8))
                    assert torch.equal(image, want), (epoch, position)
                    position += 1
            assert position == SAMPLES


def test_ctrl_c_in_a_transform_loses_no_sample(name, producer):
    """A KeyboardInterrupt while the transform runs at next() (Ctrl-C, caught by a loop
    that goes on): the batch is transformed again at the next next(), every sample comes
    once, each as an uninterrupted run gives it (the positions that seed samples without
    ids included)."""
    producer(epochs=1, kind="stream")
    t = crop_and_noise(6)
    armed = [True]

    def interrupted_once(x):
        if int(x[0, 0, 0]) == 13 and armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        return t(x)

    got: dict[int, torch.Tensor] = {}
    interrupts = 0
    with TensorConsumer(name=name, transform=interrupted_once, seed=5) as c:
        it = iter(c)
        while True:
            try:
                images, labels = next(it)
            except KeyboardInterrupt:
                interrupts += 1
                continue
            except StopIteration:
                break
            for image, i in zip(images, labels.tolist()):
                assert i not in got, f"sample {i} twice"
                got[i] = image.clone()
    assert interrupts == 1 and sorted(got) == list(range(SAMPLES))
    for i, image in got.items():  # (the stream's position of sample i is i)
        seed_everything(sample_seed(5, 0, UNKNOWN_ID + i))
        assert torch.equal(image, t(torch.full((3, 12, 12), i, dtype=torch.uint8))), i


def test_an_epoch_of_unknown_length_ends_after_its_batches_in_flight(name, producer):
    """A loader without len(): the batches in flight when its end is read are still the
    epoch's. A state_dict() then names them as not delivered (a consumer resumed from it
    is owed them), and the epoch ends after them."""
    producer(epochs=1, kind="stream")
    with TensorConsumer(name=name, transform=crop_and_noise(8), transform_workers=2,
                        transform_prefetch=2) as c:
        it = iter(c)
        # 4 batches in flight (2 workers x 2): the third next() reads the epoch's end,
        # with its last 2 batches (of 5) still in flight
        first = [i for _ in range(3) for i in next(it)[1].tolist()]
        state = c.state_dict()
        assert c.epoch == 0
        more = [i for _, ids in it for i in ids.tolist()]
        assert c.epoch == 1  # ended once its last batch was delivered
    assert first == list(range(3 * BATCH)) and more == list(range(3 * BATCH, SAMPLES))
    assert (state["epoch"], state["batches_in_epoch"]) == (0, 3)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_whose_transform_raised_is_passed(name, producer, workers):
    """A transform that raises on one batch: next() raises, the loop can go on (as a
    DataLoader's after its dataset raised), and the lost batch counts as passed in
    state_dict(), its place and its samples alike: a consumer resumed from it gets exactly
    the samples neither delivered nor lost."""
    producer(epochs=3)
    parent = os.getpid()

    def fails_on_13(x):
        if int(x[0, 0, 0]) == 13 and (workers == 0 or os.getpid() != parent):
            raise KeyError("sample 13 is cursed")
        return x.float()

    def as_float(x):
        return x.float()

    delivered: list[int] = []
    with TensorConsumer(name=name, transform=fails_on_13, transform_workers=workers) as c:
        it = iter(c)
        # (in the process: the transform's own error, as a DataLoader's dataset's; or a
        # TransformError if 13 was the first sample, whose check runs before the rest)
        with pytest.raises((TransformError, KeyError) if workers == 0 else TransformError,
                           match="sample 13"):
            while True:
                delivered += next(it)[1].tolist()
        if len(delivered) < SAMPLES - BATCH:  # the loop goes on after the error
            delivered += next(it)[1].tolist()
        state = c.state_dict()
    with TensorConsumer(name=name, transform=as_float, transform_workers=workers) as c:
        c.load_state_dict(state)
        rest = [i for _, ids in c for i in ids.tolist()]
        read_out(c, 3)
    assert 13 not in delivered + rest
    assert len(set(delivered + rest)) == len(delivered + rest) == SAMPLES - BATCH


def test_a_failed_batch_holds_no_ring_slot(name, producer):
    """The error of a transform that fails (here, at the first sample's check) does not
    keep the batch's views alive: its ring slot goes back while the exception is kept."""
    producer(epochs=1)

    def needs_float(x):
        return torch.nn.functional.normalize(x, dim=0)

    with TensorConsumer(name=name, transform=needs_float) as c:
        it = iter(c)
        with pytest.raises(TransformError) as e:
            next(it)
        assert e.value.__traceback__ is not None
        c._place.flush_releases()
        assert c.ring.held_slots() == 0
        read_out(c, 1, it)


def test_a_transform_that_writes_into_its_input_sees_fresh_samples(name, producer):
    """A transform that writes into its input (in place, as RandomErasing(inplace=True)
    does) in a worker changes only that worker's copy: every later batch in the same
    ring slot is still the producer's."""
    producer(epochs=3)

    def scribble(x):
        x[0, 0, 0] = 255  # a write into the ring's sample, in the worker
        return x[1:].float()

    with TensorConsumer(name=name, transform=scribble, transform_workers=1) as c:
        for _ in range(3):
            for x, ids in c:
                assert torch.equal(x[:, 0, 0, 0], ids.float()), "a stale sample"


def test_workers_stop_when_the_consumer_is_dropped(name, producer):
    """A consumer dropped without close() stops its transform workers (as a DataLoader
    iterator's workers stop when it is collected)."""
    import gc

    producer(epochs=1)
    c = TensorConsumer(name=name, transform=crop_and_noise(8), transform_workers=2)
    assert sorted(read_epochs(c, 1)[0]) == list(range(SAMPLES))
    workers = c.stats()["transform_workers"]
    del c
    gc.collect()
    for pid in workers:
        assert not _alive(pid), f"worker {pid} outlived its consumer"


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spawned_workers_stay_while_the_job_pauses(name, producer, context):
    """Workers started by spawn or forkserver (their parent is not the job's process)
    stay through a pause longer than their parent check, and end with the consumer."""
    producer(epochs=1)
    with TensorConsumer(name=name, transform=_spawnable, transform_workers=1,
                        transform_context=context) as c:
        it = iter(c)
        ids = next(it)[1].tolist()
        time.sleep(2.5)  # longer than a worker's parent check (1 s): it must stay
        ids += [i for _, more in it for i in more.tolist()]
    assert sorted(ids) == list(range(SAMPLES))


def _spawnable(x):
    """A transform a spawned worker can unpickle (a module-level function)."""
    return x.float()
