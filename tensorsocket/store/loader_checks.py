"""What share(loader, store=True) takes as a job's own DataLoader, and what of it a
StoreLoader made again from its arguments carries over (store.loader).

The store makes the job's DataLoader again, over the store's dataset, from the loader's
arguments. That is the user's loader exactly when the loader is a torch DataLoader, or a
subclass that only sets arguments in its ``__init__``. Otherwise what the subclass adds
would be lost without a word, so it is refused, naming it:

- members that override DataLoader's (``__iter__``, ``__len__``, ``_get_iterator`` ...) or
  change attribute access (``__getattr__`` ...);
- public methods and properties, of the subclass or of a mixin, wherever it sits in the
  class's MRO (the training calls ``loader.log_batches()``).

Private helpers (``_build_sampler``, used by ``__init__``), class markers (``__slots__``,
abc's) and plain data are no behaviour; the public data of the subclass and of the
instance (``self.vocab`` set in ``__init__``, a class constant) is carried over to the
StoreLoader (public_data). A loader that only passes for a DataLoader (accelerate's
prepared loaders: ``isinstance`` through a ``__class__`` property) and a loader over the
store's own dataset (one share() returned) are refused too.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, IterableDataset, Subset

from .dataset import StoreDataset

# What a class body holds that is no behaviour of its instances (Lightning's __old*
# patches, made while it records the arguments of the loaders a train_dataloader() makes,
# are passed by their prefix).
_CLASS_BOOKKEEPING = frozenset({
    "__init__", "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__",
    "__annotations__", "__firstlineno__", "__static_attributes__", "__orig_bases__",
    "__parameters__", "__slots__", "__abstractmethods__", "_abc_impl", "__init_subclass__",
    "__class_getitem__", "__type_params__"})

# Dunders that change what an instance does though DataLoader does not define them.
_BEHAVIOUR_DUNDERS = frozenset({"__getattr__", "__getattribute__", "__next__", "__call__",
                                "__getitem__", "__reduce__", "__reduce_ex__", "__getstate__",
                                "__setstate__", "__copy__", "__deepcopy__"})

# DataLoader's own members (and its bases', but object's).
_DATALOADER_MEMBERS = frozenset(name for cls in DataLoader.__mro__ if cls is not object
                                for name in vars(cls))


def check_loader(loader: Any) -> None:
    """TypeError / ValueError naming the knob for a loader that store=True cannot make
    again as the user's own (module docstring)."""
    if not isinstance(loader, DataLoader):
        raise TypeError(f"store=True takes a torch DataLoader, got {type(loader).__name__}: "
                        "other loaders share through the producer's ring (leave store= off)")
    if not issubclass(type(loader), DataLoader):
        raise TypeError(
            f"store=True takes the DataLoader itself; a {type(loader).__qualname__} wraps "
            "one (accelerate's prepare() makes such loaders): call share() on the "
            "DataLoader, then wrap the loader it returns")
    if isinstance(_innermost(loader.dataset), StoreDataset):
        raise TypeError("the loader's dataset is a store's already (the dataset of a loader "
                        "share(..., store=True) returned): iterate that loader as it is, or "
                        "make one over your own dataset")
    added = subclass_behaviour(type(loader))
    if added:
        raise TypeError(
            f"store=True makes the job's DataLoader again over the store; a "
            f"{type(loader).__qualname__} is a DataLoader subclass whose own "
            f"{', '.join(added)} would be lost: pass a torch DataLoader (and apply what the "
            "subclass adds to the loader share() returns), or leave store= off (the "
            "producer's ring runs any loader as it is)")
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError("store=True needs a map-style dataset (indexed samples); an "
                         "IterableDataset's stream shares through the producer's ring "
                         "(leave store= off)")


def subclass_behaviour(cls: type) -> list[str]:
    """The members of DataLoader subclass `cls` and its mixins that a loader made again
    from its arguments would not have (module docstring); [] for DataLoader."""
    added: set[str] = set()
    for klass in cls.__mro__:
        if klass in DataLoader.__mro__:
            continue
        for name, value in vars(klass).items():
            if name in _CLASS_BOOKKEEPING or name.startswith("__old"):
                continue
            if name in _DATALOADER_MEMBERS or name in _BEHAVIOUR_DUNDERS or (
                    not name.startswith("_") and _is_behaviour(value)):
                added.add(name)
    return sorted(added)


def public_data(loader: DataLoader, made: DataLoader) -> dict[str, Any]:
    """The public data of `loader` that `made` (a loader made again from its arguments)
    lacks: its subclass's and mixins' class constants and what its __init__ set."""
    data: dict[str, Any] = {}
    for klass in reversed(type(loader).__mro__):
        if klass in DataLoader.__mro__:
            continue
        data.update((name, value) for name, value in vars(klass).items()
                    if not name.startswith("_") and not _is_behaviour(value))
    data.update((name, value) for name, value in vars(loader).items()
                if not name.startswith("_"))
    return {name: value for name, value in data.items() if not hasattr(made, name)}


def _is_behaviour(value: Any) -> bool:
    """Whether a class member is behaviour: a method, property or other descriptor (a
    class kept as a constant is data)."""
    return not isinstance(value, type) and hasattr(type(value), "__get__")


def _innermost(dataset: Any) -> Any:
    """The dataset under any Subset chain."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return dataset
