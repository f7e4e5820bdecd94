"""Loader fingerprint: what a loader's batches are made of, as a compact JSON text.

share() attaches a caller to a producer of the same name that may have been
started by an earlier run of an edited script. Comparing the dataset's type and
length is not enough: the same dataset with other transforms, another
collate_fn or another sampler makes other batches. describe() writes down what
identifies a loader's pipeline without running it:

- the loader's type, its dataset's type and length;
- the dataset's ``transform``, ``target_transform`` and ``transforms`` (looked
  for through wrappers such as ``Subset`` and ``ConcatDataset``, as
  ``dataset_layers`` looks through them: the first dataset of the chain that has
  any): a function by its qualified name, an
  object by its class and repr (with memory addresses removed, so that the same
  code describes the same in two processes; an object without a repr of its own
  by its plain attributes);
- a DataLoader's ``collate_fn`` (torch's own default_collate and
  default_convert by their bare names), ``batch_size``, ``drop_last`` and the
  types of its sampler and batch sampler;
- with ``first_sample=True``, for a map-style torch Dataset, the structure of
  ``dataset[0]``: the type tree with tensors' and arrays' dtypes and shapes,
  never values. It is loaded with the random generators (torch CPU,
  ``random``, numpy's global one) seeded to 0 and restored after, so random
  transforms give the same structure in both processes and the caller's
  random streams are untouched; a sample that fails to load is left out. It
  is off by default: it runs the dataset's code outside its loader (a load
  that a dataset counting or logging its loads sees, and that may open files
  before a DataLoader forks its workers), and the generators' states are
  process-wide, so it must not be asked for from a thread other than the one
  that loads (a producer's control thread, say).

A loader that is not a DataLoader (a list, an iterator, a Hugging Face
iterable) is described by what is known without iterating it: its type, its
length, its ``dataset`` and ``batch_size`` if it has them. A callable loader (a
factory of loaders) is described as a factory, which matches anything: there is
nothing to compare before it runs.

differences() compares two descriptions leniently: a field known on one side
only, an unknown length, or a description that is missing or unreadable is no
difference.
"""
from __future__ import annotations

import collections.abc
import contextlib
import functools
import hashlib
import json
import os
import random
import re
import sys
import types
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ..data.sample_ids import recorded_sampler

__all__ = ["dataset_layers", "dataset_transforms", "describe", "differences",
           "records_first_sample"]

FORMAT = 1  # version of the description's fields
MAX_CHARS = 3000  # a description is shorter than this
_TEXT_CHARS = 400  # a transform's, a collate_fn's or a sample's text, at most
_NAME_CHARS = 160  # a qualified type name, at most
_SHOWN_CHARS = 120  # each side of a difference in differences()'s messages
_ITEMS = 8  # elements of a sequence written in a sample's structure
_KEYS = 32  # keys of a mapping written in a sample's structure
_DEPTH = 6  # nesting of a sample's structure written out
_ATTRIBUTES = 20  # plain attributes that describe an object without a repr of its own
_TRANSFORM_ATTRIBUTES = ("transform", "target_transform", "transforms")
_LAYERS = 16  # datasets looked at in a wrapper's chain (dataset_layers)
_TORCH_COLLATES = frozenset({"default_collate", "default_convert"})
_ADDRESS = re.compile(r"\s+at\s+0x[0-9a-fA-F]+|0x[0-9a-fA-F]{8,}")
_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_MISSING = object()

# Fields in the order differences() reports them, with the words it names them by.
_LABELS = {
    "type": "loader type",
    "wrapper": "loader wrapper",
    "dataset": "dataset type",
    "len": "length",
    "transform": "transform",
    "target_transform": "target_transform",
    "transforms": "transforms",
    "collate_fn": "collate_fn",
    "batch_size": "batch_size",
    "drop_last": "drop_last",
    "sampler": "sampler",
    "batch_sampler": "batch_sampler",
    "sample": "first sample (dataset[0] structure)",
}
# Attributes that say where a dataset's data is (dataset_identity).
_IDENTITY_ATTRIBUTES = ("root", "split", "train", "path", "data_dir", "data_path", "name",
                        "version", "mode", "download")
_NOT_COMPARED = frozenset({"format", "kind"})


def describe(loader: Any, *, first_sample: bool = False) -> str:
    """A compact JSON description of loader's pipeline (module docstring), under MAX_CHARS."""
    try:
        fields = _loader_fields(loader, first_sample)
    except Exception:  # an attribute that raises: what is safe to say
        fields = {"kind": "unknown", "type": _type_name(loader)}
    return _encode({"format": FORMAT, **fields})


def differences(mine: str | None, theirs: str | None, *,
                ignore: Collection[str] = ()) -> list[str]:
    """What differs between this script's description and the producer's, in words."""
    a, b = _parse(mine), _parse(theirs)
    if a is None or b is None or a.get("format") != b.get("format"):
        return []
    if "factory" in (a.get("kind"), b.get("kind")):
        return []
    keys = [k for k in _LABELS if k in a and k in b]
    keys += sorted(k for k in a.keys() & b.keys() if k not in _LABELS)
    found = []
    for key in keys:
        if key in ignore or key in _NOT_COMPARED or a[key] == b[key]:
            continue
        if key == "len" and (a[key] is None or b[key] is None):
            continue  # a length unknown on one side
        ours, producers = _contrast(_shown(a[key]), _shown(b[key]))
        found.append(f"{_LABELS.get(key, key)}: this script's {ours}, the producer's "
                     f"{producers}")
    return found


def dataset_identity(dataset: Any, transforms: dict[str, Any]) -> str:
    """What names one dataset and what is made of its samples, as JSON: its type, length,
    the attributes that say where its data is (_IDENTITY_ATTRIBUTES: a folder dataset's
    root, a split's name; not every attribute: a counter a dataset keeps would tell two
    jobs of one dataset apart), and `transforms`
    (attribute -> transform, those applied to its samples) in words. The decoded-sample
    store's key: two jobs whose datasets read the same files through the same shared
    transforms get one store. (Data that changes on disk under one root is the content
    check's to find, not this.)"""
    fields: dict[str, Any] = {"dataset": _type_name(dataset), "len": _length(dataset)}
    for name in _IDENTITY_ATTRIBUTES:
        value = _attribute(dataset, name)
        if value is not _MISSING and (_is_plain(value) or isinstance(value, os.PathLike)):
            fields[name] = str(value) if isinstance(value, os.PathLike) else value
    fields.update({attr: _callable_text(value) for attr, value in sorted(transforms.items())})
    return json.dumps(fields, separators=(",", ":"), sort_keys=True)


def records_first_sample(description: str | None) -> bool:
    """Whether a description holds its dataset's first-sample structure."""
    fields = _parse(description)
    return fields is not None and "sample" in fields


# -- describing -------------------------------------------------------------------------


def _loader_fields(loader: Any, first_sample: bool) -> dict:
    """The fields of a loader's description."""
    iterable = hasattr(type(loader), "__iter__") or hasattr(type(loader), "__getitem__")
    if callable(loader) and not iterable:
        return {"kind": "factory", "type": _type_name(loader)}
    fields: dict[str, Any] = {}
    inner = loader
    if not isinstance(loader, DataLoader):
        wrapped = _attribute(loader, "loader")
        if isinstance(wrapped, DataLoader):  # a prefetching wrapper, say
            fields["wrapper"] = _type_name(loader)
            inner = wrapped
    if isinstance(inner, DataLoader):
        fields.update(kind="dataloader", type=_type_name(inner))
        fields.update(_dataset_fields(inner.dataset, first_sample))
        fields["collate_fn"] = _callable_text(inner.collate_fn)
        fields["batch_size"] = inner.batch_size
        fields["drop_last"] = bool(inner.drop_last)
        # (A producer's loader has its sampler wrapped while an epoch runs: see through.)
        fields["sampler"] = _type_name(recorded_sampler(inner.sampler))
        batch_sampler = recorded_sampler(inner.batch_sampler)
        fields["batch_sampler"] = None if batch_sampler is None else _type_name(batch_sampler)
        return fields
    fields.update(kind="iterable", type=_type_name(loader))
    dataset = _attribute(loader, "dataset")
    if dataset is not _MISSING and dataset is not None:
        fields.update(_dataset_fields(dataset, first_sample))
    else:
        fields["len"] = _length(loader)
    batch_size = _attribute(loader, "batch_size")
    if isinstance(batch_size, int) and not isinstance(batch_size, bool):
        fields["batch_size"] = batch_size
    drop_last = _attribute(loader, "drop_last")
    if isinstance(drop_last, bool):
        fields["drop_last"] = drop_last
    return fields


def _dataset_fields(dataset: Any, first_sample: bool) -> dict:
    """Type, length, transforms and first-sample structure of a dataset."""
    size = _length(dataset)
    fields: dict[str, Any] = {"dataset": _type_name(dataset), "len": size}
    holder = _transform_holder(dataset)
    for attr in _TRANSFORM_ATTRIBUTES:
        value = _attribute(holder, attr)
        if value is _MISSING:
            continue
        if attr == "transforms" and type(value).__name__ == "StandardTransform":
            continue  # torchvision's pair of transform and target_transform, written above
        fields[attr] = _callable_text(value)
    map_style = isinstance(dataset, Dataset) and not isinstance(dataset, IterableDataset)
    if first_sample and map_style and size:
        structure = _first_sample_structure(dataset)
        if structure is not None:
            fields["sample"] = structure
    return fields


def _transform_holder(dataset: Any) -> Any:
    """The first of the dataset and those it wraps (dataset_layers) that holds a
    transform attribute; the dataset itself if none does."""
    for layer in dataset_layers(dataset):
        if any(_attribute(layer, a) is not _MISSING for a in _TRANSFORM_ATTRIBUTES):
            return layer
    return dataset


def dataset_layers(dataset: Any) -> list[Any]:
    """The dataset and the datasets it wraps, outermost first, breadth first: the
    ``dataset`` a wrapper holds (torch's Subset, torchvision's and most libraries'
    wrappers) and the ``datasets`` list of a ConcatDataset or ChainDataset; each once,
    _LAYERS at most. The one way wrappers are looked through: the fingerprint's
    transforms and the decoded-sample cache's check of them (dataset_transforms)."""
    layers: list[Any] = []
    seen: set[int] = set()
    todo = [dataset]
    while todo and len(layers) < _LAYERS:
        layer = todo.pop(0)
        if layer is None or layer is _MISSING or id(layer) in seen:
            continue
        seen.add(id(layer))
        layers.append(layer)
        todo.append(_attribute(layer, "dataset"))
        inner = _attribute(layer, "datasets")
        if isinstance(inner, (list, tuple)):
            todo.extend(inner[:_LAYERS])
    return layers


def dataset_transforms(dataset: Any) -> list[tuple[str, Any]]:
    """(attribute, value) of each ``transform``, ``target_transform`` and ``transforms``
    (not None) of the dataset and of every dataset it wraps (dataset_layers)."""
    found = []
    for layer in dataset_layers(dataset):
        for attr in _TRANSFORM_ATTRIBUTES:
            value = _attribute(layer, attr)
            if value is not _MISSING and value is not None:
                found.append((attr, value))
    return found


def _first_sample_structure(dataset: Any) -> str | None:
    """The structure of dataset[0], loaded with seeded random generators; None if it fails."""
    try:
        with _seeded_random():
            sample = dataset[0]
        return _clip(_structure(sample, 0), _TEXT_CHARS)
    except Exception:
        return None


@contextlib.contextmanager
def _seeded_random() -> Iterator[None]:
    """Seed torch's CPU generator, random's and numpy's global one to 0; restore them after."""
    numpy = sys.modules.get("numpy")
    torch_state = torch.get_rng_state()
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        torch.default_generator.manual_seed(0)  # CPU only: nothing queued for CUDA
        random.seed(0)
        if numpy is not None:
            numpy.random.seed(0)
        yield
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


def _structure(obj: Any, depth: int) -> str:
    """Type tree of obj with dtypes and shapes, no values."""
    if depth > _DEPTH:
        return "..."
    if isinstance(obj, torch.Tensor):
        return f"Tensor[{str(obj.dtype).removeprefix('torch.')},{list(obj.shape)}]"
    kind = type(obj)
    if kind.__module__ == "numpy" and hasattr(obj, "dtype") and hasattr(obj, "shape"):
        return f"{kind.__name__}[{obj.dtype},{list(obj.shape)}]"
    if kind.__module__.startswith("PIL."):
        return f"{kind.__name__}[{getattr(obj, 'mode', '?')},{getattr(obj, 'size', '?')}]"
    if isinstance(obj, collections.abc.Mapping):
        keys = sorted(obj, key=repr)
        items = [f"{k!r}: {_structure(obj[k], depth + 1)}" for k in keys[:_KEYS]]
        if len(keys) > _KEYS:
            items.append(f"... {len(keys) - _KEYS} more")
        name = "" if kind is dict else _type_name(obj)
        return name + "{" + ", ".join(items) + "}"
    if isinstance(obj, (tuple, list)):
        items = [_structure(item, depth + 1) for item in obj[:_ITEMS]]
        if len(obj) > _ITEMS:
            items.append(f"... {len(obj) - _ITEMS} more")
        name = kind.__name__ if kind in (tuple, list) else _type_name(obj)
        return f"{name}({', '.join(items)})"
    if isinstance(obj, _PLAIN):
        return kind.__name__
    return _type_name(obj)


def _callable_text(obj: Any) -> str | None:
    """A transform or collate_fn in words: a function's qualified name, else class and repr."""
    if obj is None:
        return None
    if isinstance(obj, functools.partial):
        args = [_value_text(a) for a in obj.args]
        args += [f"{k}={_value_text(v)}" for k, v in sorted(obj.keywords.items())]
        return _clip(f"partial({', '.join([_callable_text(obj.func) or 'None', *args])})",
                     _TEXT_CHARS)
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                        types.BuiltinMethodType)):
        return _function_name(obj)
    name = _type_name(obj)
    if type(obj).__repr__ is object.__repr__:
        attributes = _plain_attributes(obj)
        return _clip(f"{name}({attributes})" if attributes else name, _TEXT_CHARS)
    try:
        text = repr(obj)
    except Exception:
        return name
    return _clip(f"{name}: {text}", _TEXT_CHARS)


def _function_name(fn: Any) -> str:
    """module.qualname of a function; torch's default collate functions by bare name."""
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__name__", "")
    if module.startswith("torch.utils.data") and name in _TORCH_COLLATES:
        return name  # the same function whichever torch module path it is reached by
    qualname = getattr(fn, "__qualname__", None) or name or _type_name(fn)
    return _clip(f"{module}.{qualname}" if module else qualname, _NAME_CHARS)


def _plain_attributes(obj: Any) -> str:
    """``name=value`` of an object's attributes that are plain values (sorted, at most 20)."""
    try:
        attributes = vars(obj)
    except TypeError:
        return ""
    shown = []
    for key in sorted(attributes):
        value = attributes[key]
        if key.startswith("__") or not _is_plain(value):
            continue
        shown.append(f"{key}={value!r}")
        if len(shown) == _ATTRIBUTES:
            break
    return ", ".join(shown)


def _is_plain(value: Any) -> bool:
    """A plain value, or a short tuple or list of them."""
    if isinstance(value, (tuple, list)):
        return len(value) <= _ITEMS and all(isinstance(v, _PLAIN) for v in value)
    return isinstance(value, _PLAIN)


def _value_text(value: Any) -> str:
    """An argument of a functools.partial in words."""
    if _is_plain(value):
        return repr(value)
    if callable(value):
        return _callable_text(value) or "None"
    return _type_name(value)


def _type_name(obj: Any) -> str:
    """module.qualname of obj's type."""
    kind = type(obj)
    return _clip(f"{kind.__module__}.{kind.__qualname__}", _NAME_CHARS)


def _length(obj: Any) -> int | None:
    """len(obj), None if it has none."""
    try:
        return len(obj)
    except Exception:  # no len(), or an IterableDataset's TypeError
        return None


def _attribute(obj: Any, name: str) -> Any:
    """getattr(obj, name), _MISSING if absent or if reading it raises."""
    try:
        return getattr(obj, name, _MISSING)
    except Exception:
        return _MISSING


def _clip(text: str, limit: int) -> str:
    """text on one line without memory addresses, cut to limit with a hash of the whole."""
    text = " ".join(_ADDRESS.sub("", text).split())
    if len(text) <= limit:
        return text
    digest = hashlib.sha1(text.encode("utf-8", "replace")).hexdigest()[:12]
    return f"{text[:limit - 16]}...#{digest}"


def _encode(fields: dict) -> str:
    """fields as compact JSON shorter than MAX_CHARS (its longest texts clipped further)."""
    text = json.dumps(fields, separators=(",", ":"))
    while len(text) >= MAX_CHARS:
        strings = [k for k, v in fields.items() if isinstance(v, str)]
        longest = max(strings, key=lambda k: len(fields[k]), default=None)
        if longest is None or len(fields[longest]) <= 40:
            return json.dumps({"format": FORMAT, "kind": fields.get("kind")})
        fields[longest] = _clip(fields[longest], len(fields[longest]) // 2)
        text = json.dumps(fields, separators=(",", ":"))
    return text


# -- comparing --------------------------------------------------------------------------


def _parse(description: str | None) -> dict | None:
    """A description's fields; None if it is missing or unreadable."""
    if not isinstance(description, str):
        return None
    try:
        fields = json.loads(description)
    except ValueError:
        return None
    return fields if isinstance(fields, dict) else None


def _shown(value: Any) -> str:
    """A field's value in a message."""
    if value is None:
        return "none"
    return value if isinstance(value, str) else json.dumps(value)


def _contrast(ours: str, theirs: str) -> tuple[str, str]:
    """Both texts cut to the neighbourhood of their first difference."""
    if len(ours) <= _SHOWN_CHARS and len(theirs) <= _SHOWN_CHARS:
        return ours, theirs
    common = 0
    for x, y in zip(ours, theirs):
        if x != y:
            break
        common += 1
    start = max(0, common - 40)
    return _window(ours, start), _window(theirs, start)


def _window(text: str, start: int) -> str:
    """_SHOWN_CHARS of text from start, with ... where it was cut."""
    part = text[start:start + _SHOWN_CHARS]
    return ("..." if start else "") + part + ("..." if start + _SHOWN_CHARS < len(text) else "")
