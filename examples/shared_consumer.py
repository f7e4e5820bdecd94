"""A training script whose only change is the loader line; run it with shared_producer.py.

    python examples/shared_producer.py & python examples/shared_consumer.py --lr 0.1 &
    python examples/shared_consumer.py --lr 0.01; wait

It waits for the producer named "example" (up to 60 s), then trains on its batches: zero-copy
views of the shared ring (an in-place op on one stays private to this job). It prints its
loss and samples per epoch.
"""

import argparse

import torch
import torch.nn as nn

import tensorsocket


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                          nn.Flatten(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    # loader = DataLoader(NoisyImages(), batch_size=64, shuffle=True, num_workers=2)
    loader = tensorsocket.TensorConsumer(name="example")
    for epoch in range(3):
        total, samples = 0.0, 0
        for images, labels in loader:
            loss = nn.functional.cross_entropy(model(images), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(labels)
            samples += len(labels)
        print(f"lr {args.lr}: epoch {epoch} loss {total / samples:.3f} ({samples} samples)",
              flush=True)
    loader.close()


if __name__ == "__main__":
    main()
