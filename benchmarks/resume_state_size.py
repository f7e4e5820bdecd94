"""Size of a consumer's state_dict() at ImageNet scale (1,281,167 samples), as JSON.

    python benchmarks/resume_state_size.py [--samples N]

The state holds the samples of the interrupted epoch taken (tensorsocket.data.resume): a bitmap,
zlib, base64. Printed per fraction of the epoch taken, for a shuffling loader (samples
taken at random) and an unshuffled one (a run of ids), with the time to encode and decode.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from tensorsocket.data.resume import EpochShape, SavedPlace, decode, encode
from tensorsocket.data.sample_ids import IdMask


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1_281_167)
    n = ap.parse_args().samples
    rng = np.random.default_rng(0)
    order = rng.permutation(n)
    shape = EpochShape(dataset_len=n)  # (no batch size: the counts are not checked)
    print(f"state_dict() size for {n} samples (bitmap bound: {(n + 7) // 8} bytes raw, "
          f"{(n + 7) // 8 * 4 // 3} base64)")
    print(f"{'taken':>6} {'shuffled bytes':>15} {'in order bytes':>15} {'encode ms':>10} "
          f"{'decode ms':>10}")
    for fraction in (0.01, 0.125, 0.375, 0.5, 0.875, 0.99):
        k = int(n * fraction)
        shuffled, ordered = IdMask(n), IdMask(n)
        shuffled.add(order[:k])
        ordered.add(np.arange(k))
        t0 = time.perf_counter()
        text = json.dumps(encode(SavedPlace(3, k // 256, shuffled, n), shape))
        t1 = time.perf_counter()
        decode(json.loads(text), shape)
        t2 = time.perf_counter()
        in_order = json.dumps(encode(SavedPlace(3, k // 256, ordered, n), shape))
        print(f"{fraction:>6.1%} {len(text):>15,} {len(in_order):>15,} "
              f"{(t1 - t0) * 1e3:>10.1f} {(t2 - t1) * 1e3:>10.1f}")


if __name__ == "__main__":
    main()
