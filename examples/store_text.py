"""Fine-tuning jobs on three data selections of one tokenized text dataset, sharing the
tokenization through the store of decoded samples (``share(..., store=True)``).

    pip install tokenizers
    python examples/store_text.py [--lines 4000] [--epochs 2] [--workers 1] [--json PATH]

A data-selection sweep: three jobs fine-tune a small classifier on selections of one
corpus: all of it, a random 50 % and a fixed 25 % (every fourth line), each shuffled with
its own seed, each at its own speed (1, 2 and 4 training steps per batch), started one
after the other. The expensive per-sample work is the tokenization (a byte-level BPE
tokenizer of HF ``tokenizers``, trained here on the corpus, as a fine-tuning run would
load a pretrained one), done in the dataset's ``__getitem__``: deterministic, so the jobs
share it. Each job's own part is its random masking of tokens (``transform=``, seeded per
job, epoch and sample). Each job prints a line and the run a summary: the tokenizations
done by all the jobs' processes (every ``__getitem__`` counted) against what three jobs
on their own DataLoaders would do, and each job's batches checked index for index against
its own DataLoader's (run first, in the job, for the check).

The script runs itself with the hidden role ``_job`` for each job.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the model reads data and learns a task from many small examples while the loss "
         "falls slowly over each epoch of training on text that was cleaned tokenized and "
         "split into selections chosen by score by random draw or by a fixed rule").split()
SELECTIONS = ("all", "random-half", "fixed-quarter")
STEPS = (1, 2, 4)
SEQ_LEN = 64
VOCAB = 2000


def write_corpus(path: Path, lines: int) -> None:
    """`lines` lines of made-up sentences (a fixed seed: the same corpus every run)."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(lines):
            n = rng.randint(8, 60)
            f.write(" ".join(rng.choice(WORDS) for _ in range(n)) + ".\n")


def train_tokenizer(corpus: Path, out: Path) -> None:
    """A byte-level BPE tokenizer trained on the corpus, saved as tokenizer.json."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train([str(corpus)], vocab_size=VOCAB, min_frequency=2, special_tokens=["<pad>", "<mask>"])
    tok.save(str(out))


class TokenizedLines:
    """Line i of the corpus tokenized: (input ids padded to SEQ_LEN, attention mask, a
    label, i). Every tokenization appends a byte to `count_path` (all processes)."""

    def __init__(self, corpus: Path, tokenizer: Path, count_path: str) -> None:
        self.lines = corpus.read_text().splitlines()
        self.tokenizer_path = str(tokenizer)
        self.count_path = count_path
        self._tok = None

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i: int):
        import torch
        from tokenizers import Tokenizer

        if self._tok is None:  # (per process: a DataLoader worker loads its own)
            self._tok = Tokenizer.from_file(self.tokenizer_path)
        fd = os.open(self.count_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, b".")
        finally:
            os.close(fd)
        ids = self._tok.encode(self.lines[i]).ids[:SEQ_LEN]
        x = torch.zeros(SEQ_LEN, dtype=torch.int64)
        x[:len(ids)] = torch.tensor(ids, dtype=torch.int64)
        mask = torch.zeros(SEQ_LEN, dtype=torch.bool)
        mask[:len(ids)] = True
        return x, mask, len(ids) % 2, i

    def __getstate__(self):
        return {**self.__dict__, "_tok": None}


class MaskTokens:
    """A job's own part: each token replaced by <mask> (id 1) with probability p."""

    def __init__(self, p: float) -> None:
        self.p = p

    def __call__(self, ids):
        import torch

        keep = torch.rand(ids.shape) >= self.p
        return torch.where(keep, ids, torch.ones_like(ids))


def make_loader(k: int, dataset, workers: int, seed: int):
    """Job k's DataLoader over its selection."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, Subset, SubsetRandomSampler

    g = torch.Generator()
    g.manual_seed(seed)
    n = len(dataset)
    common = dict(batch_size=32, num_workers=workers, generator=g)
    if k == 0:
        return DataLoader(dataset, shuffle=True, **common)
    if k == 1:
        half = np.sort(np.random.default_rng(1).permutation(n)[: n // 2]).tolist()
        return DataLoader(Subset(dataset, half), shuffle=True, **common)
    return DataLoader(dataset, sampler=SubsetRandomSampler(range(0, n, 4), generator=g), **common)


def job(argv: list[str]) -> int:
    """One fine-tuning job: its own DataLoader's ids first (the check), then the shared
    run, training its model."""
    p = argparse.ArgumentParser()
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--name", required=True)
    a = p.parse_args(argv[1:])
    import torch
    import torch.nn as nn

    import tensorsocket as ts

    torch.set_num_threads(1)
    d = Path(a.dir)
    seed = 1000 + a.index
    check = TokenizedLines(d / "corpus.txt", d / "tokenizer.json", str(d / "check-count"))
    own = make_loader(a.index, check, a.workers, seed)
    want = [[b[3].tolist() for b in own] for _ in range(a.epochs)]

    data = TokenizedLines(d / "corpus.txt", d / "tokenizer.json", str(d / "count"))
    loader = ts.share(make_loader(a.index, data, a.workers, seed), name=a.name, store=True,
                      transform=MaskTokens(0.15), seed=seed)
    model = nn.Sequential(nn.EmbeddingBag(VOCAB, 64), nn.Linear(64, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got, t0 = [], time.monotonic()
    for _ in range(a.epochs):
        epoch = []
        for x, mask, y, ids in loader:
            epoch.append(ids.tolist())
            for _ in range(STEPS[a.index]):
                opt.zero_grad()
                logits = model(x * mask)  # (pad positions read as <pad>, id 0)
                loss = nn.functional.cross_entropy(logits, torch.as_tensor(y))
                loss.backward()
                opt.step()
        got.append(epoch)
    info = loader.store_info()
    loader.close()
    print(json.dumps({"job": a.index, "selection": SELECTIONS[a.index],
                      "samples": sum(len(b) for e in got for b in e),
                      "seconds": round(time.monotonic() - t0, 2), "ids_equal": got == want,
                      "loss": round(loss.item(), 4), "store_hits": info.get("hits"),
                      "store_commits": info.get("commits")}), flush=True)
    return 0 if got == want else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=4000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--stagger", type=float, default=1.0, help="seconds between job starts")
    p.add_argument("--json", default=None, help="write the summary here too")
    args = p.parse_args()
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        print("this example needs HF tokenizers: pip install tokenizers", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="store-text-") as tmp:
        d = Path(tmp)
        write_corpus(d / "corpus.txt", args.lines)
        train_tokenizer(d / "corpus.txt", d / "tokenizer.json")
        name = f"store-text-{os.getpid()}"
        procs = []
        for k in range(3):
            if k:
                time.sleep(args.stagger)
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "_job", "--index", str(k), "--dir", tmp,
                 "--epochs", str(args.epochs), "--workers", str(args.workers), "--name", name],
                stdout=subprocess.PIPE, text=True))
        records = []
        for proc in procs:
            out, _ = proc.communicate(timeout=900)
            if proc.returncode != 0:
                print(f"a job failed (exit {proc.returncode}): {out}", file=sys.stderr)
                return 1
            records.append(json.loads(out.strip().splitlines()[-1]))
        shared = (d / "count").stat().st_size
        alone = (d / "check-count").stat().st_size
    for r in records:
        print(f"job {r['job']} ({r['selection']}): {r['samples']} samples in {r['seconds']} s, "
              f"batches as its own DataLoader's: {r['ids_equal']}, last loss {r['loss']}")
    summary = {"jobs": records, "tokenizations_shared": shared, "tokenizations_own": alone,
               "lines": args.lines, "epochs": args.epochs}
    print(f"tokenizations: {shared} shared, against {alone} for the three jobs each with its "
          f"own DataLoader ({alone / max(shared, 1):.1f}x fewer; {args.lines} lines)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if all(r["ids_equal"] for r in records) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_job":
        sys.exit(job(sys.argv[1:]))
    sys.exit(main())
