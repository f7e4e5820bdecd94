"""Random breaks, kept batches, lag rejoins and kills, for a while: nothing hangs.

Three consumer processes read a producer's epochs with random behaviour: a loop left with
break at a random step (the loop variable still holding its batch), a batch or two kept
across epochs, pauses long enough to be detached for lagging (max_lag=3, rejoin), and the
test SIGKILLs one of them now and then and starts another. Every job must keep finishing
epochs until the deadline and exit cleanly; every epoch it reads starts at batch 0 with no
gap or repeat. 6 s (at least one kill) in the default run; 60 s under the `slow` marker
(`python -m pytest -m slow`). The seed is in the test id's output.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from tensorsocket import TensorProducer
from conftest import popen

CHURN_JOB = r"""
import json, random, sys, time, warnings
from tensorsocket import TensorConsumer
name, seed, until = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
warnings.simplefilter("ignore")          # lag warnings are expected here
rng = random.Random(seed)
c = TensorConsumer(name=name, timeout=60, batch_timeout=45)
kept, epochs, batches = [], 0, 0
while epochs == 0 or time.time() < until:
    ids = []
    stop = rng.choice([None, None, rng.randrange(20)])
    for step, batch in enumerate(c):
        ids.append(int(batch[0]))
        batches += 1
        if rng.random() < 0.05:
            kept = (kept + [batch])[-2:]    # kept across steps and epochs
        if rng.random() < 0.03:
            time.sleep(rng.uniform(0.05, 0.4))  # long enough to lag behind, sometimes
        if step == stop:
            break                         # `batch` still holds its slot
    if ids != list(range(len(ids))):
        sys.exit(f"epoch {epochs} read {ids}")
    epochs += 1
    if rng.random() < 0.3:
        kept.clear()
print(json.dumps({"epochs": epochs, "batches": batches}), flush=True)
c.close()
"""


def test_random_breaks_kept_batches_lags_and_kills_never_hang(name):
    _churn(name, duration=6.0)


@pytest.mark.slow
def test_random_breaks_kept_batches_lags_and_kills_never_hang_long(name):
    _churn(name, duration=60.0)


def _churn(name: str, duration: float) -> None:
    import torch

    seed = int(os.environ.get("TS_CHURN_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (TS_CHURN_SEED={seed} repeats it)")
    rng = random.Random(seed)
    loader = [torch.full((256,), float(i)) for i in range(20)]
    producer = TensorProducer(loader, name=name, ring_slots=8, max_lag=3, lag_policy="rejoin",
                              min_consumers=1, start_timeout=60)
    stop = threading.Event()

    def produce() -> None:
        try:
            while not stop.is_set():
                for _ in producer:
                    pass
        except Exception:  # closed by the test at the end
            pass

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    until = time.time() + duration
    jobs: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        job = popen([sys.executable, "-c", CHURN_JOB, name, str(rng.randrange(1 << 30)),
                     str(until)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        jobs.append(job)
        return job

    try:
        live = [start() for _ in range(3)]
        kills = 0
        while kills == 0 or time.time() < until - 3:  # one kill at least, however slow
            time.sleep(rng.uniform(1.0, 3.0))
            victim = live.pop(rng.randrange(len(live)))
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            kills += 1
            live.append(start())
        results = []
        for job in live:
            out, err = job.communicate(timeout=duration + 120)
            assert job.returncode == 0, f"seed {seed}: {err[-3000:]}"
            results.append(json.loads(out))
        assert kills >= 1
        assert all(r["epochs"] >= 1 and r["batches"] >= 1 for r in results), results
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.wait()
        stop.set()
        producer.close()
        thread.join(30)
