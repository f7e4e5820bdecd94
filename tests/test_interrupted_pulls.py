"""A consumer that cuts its own batches (batch_size=) loses no sample when a pull is
interrupted (batch_timeout's TimeoutError, a KeyboardInterrupt during the wait) and its
loop catches the exception and goes on: the samples it had already taken come first in
its next batch. Real producer and consumer processes."""

from __future__ import annotations

import json
import signal
import subprocess
import time


LOADER_BATCHES = 40
LOADER_BS = 16
SAMPLES = LOADER_BATCHES * LOADER_BS

# Loader batch b holds sample ids 16 b .. 16 b + 15. Every third batch comes `pause`
# seconds late; with a gate file, batch 1 waits until the file exists.
PRODUCER = r"""
import os, sys, time, torch
from tensorsocket import TensorProducer

name, pause, gate = sys.argv[1], float(sys.argv[2]), sys.argv[3]

class Loader:
    def __len__(self):
        return 40

    def __iter__(self):
        for b in range(40):
            if b == 1 and gate != "-":
                deadline = time.monotonic() + 60
                while not os.path.exists(gate):
                    if time.monotonic() > deadline:
                        raise TimeoutError("the test never opened the gate")
                    time.sleep(0.01)
            if b % 3 == 1:
                time.sleep(pause)
            yield {"id": torch.arange(16 * b, 16 * b + 16)}

p = TensorProducer(Loader(), name=name, min_consumers=1, start_timeout=60)
print("ready", flush=True)
for _ in p:
    pass
p.join(timeout=60)
"""

# Takes batches of 12 and goes on after TimeoutError and KeyboardInterrupt (SIGINT).
CONSUMER = r"""
import faulthandler, json, signal, sys
from tensorsocket import TensorConsumer

faulthandler.register(signal.SIGUSR1)  # a test that waits too long asks where we are

name, batch_timeout = sys.argv[1], float(sys.argv[2])
ids, sizes, timeouts, interrupts = [], [], 0, 0
with TensorConsumer(name=name, timeout=60, batch_size=12, batch_timeout=batch_timeout) as c:
    it = iter(c)
    while True:
        try:
            batch = next(it)
            ids.extend(batch["id"].tolist())
            sizes.append(len(batch["id"]))
            del batch
            print(json.dumps({"got": len(sizes)}), flush=True)
        except StopIteration:
            break
        except TimeoutError:
            timeouts += 1
        except KeyboardInterrupt:
            interrupts += 1
            print(json.dumps({"interrupted": interrupts}), flush=True)
print(json.dumps({"ids": ids, "sizes": sizes, "timeouts": timeouts,
                  "interrupts": interrupts}), flush=True)
"""


def _line(p: subprocess.Popen, timeout: float = 60) -> str:
    """The process's next stdout line (fails if it ends or says nothing in time)."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            p.send_signal(signal.SIGUSR1)  # the consumer's stacks (faulthandler), then end it
            time.sleep(1)
            p.kill()
            p.wait(10)
            raise AssertionError(f"no output in {timeout} s; stderr:\n{p.stderr.read()}")
    line = p.stdout.readline()
    if not line:
        p.wait(10)
        raise AssertionError(f"exit {p.returncode}: {p.stderr.read()}")
    return line


def _finish(p: subprocess.Popen) -> str:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:{out}\nstderr:{err}"
    return out


def _check_every_sample_once(result: dict) -> None:
    assert sorted(result["ids"]) == list(range(SAMPLES)), \
        f"missing {sorted(set(range(SAMPLES)) - set(result['ids']))[:20]}"
    assert result["ids"] == list(range(SAMPLES))  # in order, too
    assert result["sizes"] == [12] * (SAMPLES // 12) + [SAMPLES % 12]


def test_batch_timeout_caught_in_the_loop_loses_no_sample(procs, name):
    """Every third loader batch comes 0.3 s late and batch_timeout is 0.05 s: the loop
    sees TimeoutErrors, mostly while half of its next batch is already taken."""
    prod = procs.script(PRODUCER, name, "0.3", "-")
    assert _line(prod) == "ready\n"
    cons = procs.script(CONSUMER, name, "0.05")
    result = json.loads(_finish(cons).splitlines()[-1])
    _finish(prod)
    assert result["timeouts"] > 0  # (each late batch is 0.3 s late: a wait of 0.05 s ends)
    _check_every_sample_once(result)


def test_keyboard_interrupt_during_the_wait_loses_no_sample(procs, name, tmp_path):
    """The consumer has its first batch of 12 (4 samples of loader batch 0 are left) and
    waits for loader batch 1, which the producer holds back; a SIGINT there raises
    KeyboardInterrupt in the consumer, whose loop goes on. Whenever the signal lands, no
    entry can be taken meanwhile, so nothing is in flight outside the consumer's state."""
    gate = tmp_path / "gate"
    prod = procs.script(PRODUCER, name, "0", str(gate))
    assert _line(prod) == "ready\n"
    cons = procs.script(CONSUMER, name, "1000")
    assert json.loads(_line(cons)) == {"got": 1}
    time.sleep(0.2)  # not needed for correctness: it only makes the wait the likely spot
    cons.send_signal(signal.SIGINT)
    assert json.loads(_line(cons)) == {"interrupted": 1}
    gate.touch()
    result = json.loads(_finish(cons).splitlines()[-1])
    _finish(prod)
    assert result["interrupts"] == 1
    _check_every_sample_once(result)
