"""Run one DataLoader and share its batches with every training script on this machine.

    python examples/shared_producer.py &
    python examples/shared_consumer.py --lr 0.1 &
    python examples/shared_consumer.py --lr 0.01
"""

import torch
from torch.utils.data import DataLoader, Dataset

from tensorsocket import TensorProducer


class NoisyImages(Dataset):
    """Synthetic 3x32x32 images with a per-sample CPU transform."""

    def __len__(self) -> int:
        return 2048

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        img = torch.rand(3, 40, 40, generator=g)
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
            print(f"producer: epoch {epoch} published", flush=True)


if __name__ == "__main__":
    main()
