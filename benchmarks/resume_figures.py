"""What an interrupted and resumed job reads of the interrupted epoch, per case: the
samples seen before the interruption and after it, their overlap and their union (every
sample once: before + after = union = the epoch).

    python benchmarks/resume_figures.py

Real processes: tests/resume_job.py over a share()d DataLoader of 256 samples, batches
of 32; the job takes 3 batches (2 per rank in the DDP case), saves state_dict() after
the break and exits; a new job loads it and reads the epoch's rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "resume_job.py"
ENV = {**os.environ, "TENSORSOCKET_START_GRACE": "0", "TENSORSOCKET_IDLE_TIMEOUT": "2"}


def start(name: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(JOB), name, *args], env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=300)
    if p.returncode:
        raise SystemExit(f"job failed: {err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def ids(job: dict) -> list[int]:
    return [i for batch in job["epochs"][0] for i in batch]


def case(label: str, world: int, *opts: str) -> None:
    name = f"fig-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state.json"
        group = [["--rank", str(r), "--world-size", str(world)] for r in range(world)] \
            if world > 1 else [[]]
        take = "2" if world > 1 else "3"
        firsts = [start(name, "--take", take, "--state-out", f"{state}{i}", *g, *opts)
                  for i, g in enumerate(group)]
        before = [i for p in firsts for i in ids(result(p))]
        seconds = [start(name, "--epochs", "1", "--state-in", f"{state}0", *g, *opts)
                   for g in group]
        after = [i for p in seconds for i in ids(result(p))]
    union = set(before) | set(after)
    overlap = len(before) + len(after) - len(union)
    print(f"{label:<38} {len(before):>7} {len(after):>6} {overlap:>8} {len(union):>6} "
          f"{'yes' if overlap == 0 and len(union) == 256 else 'NO':>10}")


def main() -> None:
    print(f"{'case (256 samples, batch 32)':<38} {'before':>7} {'after':>6} {'overlap':>8} "
          f"{'union':>6} {'exactly once':>10}")
    case("shuffle", 1)
    case("no shuffle", 1, "--no-shuffle")
    case("shuffle, own batch_size=20", 1, "--own-batch-size", "20")
    case("shuffle, DDP 2 ranks (rank 0's state)", 2)
    case("shuffle, DDP 2 ranks, batch_size=20", 2, "--own-batch-size", "20")


if __name__ == "__main__":
    main()
