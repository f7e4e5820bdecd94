"""Run one DataLoader and share its batches with the training scripts on this machine.

The explicit two-script form (train_shared.py does the same with tensorsocket.share() and
no producer script): this script runs the loader through a TensorProducer; each
shared_consumer.py trains on its batches.

    python examples/shared_producer.py & python examples/shared_consumer.py --lr 0.1 &
    python examples/shared_consumer.py --lr 0.01; wait        # ~8 s on 2 CPU cores

What to look at: the producer waits for both consumers (min_consumers=2), then publishes 3
epochs of 32 batches; each consumer prints its loss per epoch (it goes down at its own
rate) and the samples it got (all 2048, every epoch). Leaving the ``with`` block waits
until both have read everything, then removes the shared memory.
"""

import torch
from torch.utils.data import DataLoader, Dataset

from tensorsocket import TensorProducer


class NoisyImages(Dataset):
    """Synthetic 3x32x32 images of 10 classes (a colour tint each), randomly cropped and
    flipped: a per-sample CPU transform."""

    TINTS = torch.rand(10, 3, 1, 1, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return 2048

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        img = 0.5 * torch.rand(3, 40, 40, generator=g) + 0.5 * self.TINTS[i % 10]
        y0, x0 = torch.randint(0, 9, (2,), generator=g).tolist()
        img = img[:, y0 : y0 + 32, x0 : x0 + 32]
        if torch.rand(1, generator=g).item() < 0.5:
            img = img.flip(-1)
        return (img - 0.5) / 0.25, i % 10


def main() -> None:
    loader = DataLoader(NoisyImages(), batch_size=64, shuffle=True, num_workers=2)
    with TensorProducer(loader, name="example", min_consumers=2) as producer:
        for epoch in range(3):
            for _ in producer:
                pass
            print(f"producer: epoch {epoch} published ({len(loader)} batches)", flush=True)


if __name__ == "__main__":
    main()
