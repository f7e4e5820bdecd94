"""The store of decoded samples: jobs with their own sampler, subset and speed share the
decode of one dataset (docs/decoded-store.md). ``share(loader, name, store=True)``
returns ``store_loader(...)``: the job's own DataLoader over it."""

from .loader import StoreLoader, store_loader

__all__ = ["StoreLoader", "store_loader"]
