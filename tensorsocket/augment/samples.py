"""Which leaf of a batch holds the samples a transform runs on, running it on each sample,
and putting the outputs back into the batch.

The leaf is the batch's inputs, as a dataset's ``transform`` sees them: element 0 of a
tuple or list batch (``(images, labels)``), ``batch[transform_key]`` of a dict batch
(default: ``"image"`` if there is one, else the first key), or the batch itself if it is a
tensor. A sample is one row of it (dim 0): a ``uint8`` CHW image for the usual shared
decode. The transform's outputs are stacked in the leaf's place, as a DataLoader's
default collate stacks them; the batch's other leaves are copied out of the ring (they are
small: labels, ids), so a transformed batch holds no ring slot.
"""

from __future__ import annotations

import collections.abc
from typing import Any, Callable, Sequence

import torch

from ..errors import TransformError
from .seeding import seed_everything

Rebuild = Callable[[torch.Tensor], Any]  # the batch with its inputs replaced


def describe(transform: Any) -> str:
    """A short name of a transform for messages: a pipeline (an object with a
    ``transforms`` list, as torchvision's and timm's Compose) by its steps' class names,
    anything else by its repr's first line; at most 160 characters."""
    steps = getattr(transform, "transforms", None)
    if isinstance(steps, (list, tuple)):
        text = f"{type(transform).__name__}({', '.join(type(t).__name__ for t in steps)})"
    else:
        lines = repr(transform).splitlines()
        text = lines[0] if lines else type(transform).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def split_inputs(batch: Any, key: Any) -> tuple[torch.Tensor, Rebuild]:
    """(the inputs leaf of `batch`, a function making the batch with another tensor in its
    place); TransformError when the batch has no such tensor leaf."""
    if isinstance(batch, torch.Tensor):
        return _checked(batch, "the batch"), lambda out: out
    if isinstance(batch, collections.abc.Mapping):
        if not batch:
            raise TransformError("transform=: the batch is an empty dict: no inputs to transform")
        if key is None:
            key = "image" if "image" in batch else next(iter(batch))
        if key not in batch:
            raise TransformError(f"transform_key={key!r} is not a key of the batch (its keys: "
                                 f"{list(batch)})")
        rest = {k: _private(v) for k, v in batch.items() if k != key}
        kind, order = type(batch), list(batch)

        def rebuild_mapping(out: torch.Tensor) -> Any:
            made = {k: (out if k == key else rest[k]) for k in order}
            return made if kind is dict else kind(made)  # type: ignore[call-arg]
        return _checked(batch[key], f"batch[{key!r}]"), rebuild_mapping
    if isinstance(batch, (tuple, list)) and batch:
        rest_items = [_private(v) for v in batch[1:]]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
            kind_nt = type(batch)  # (not the batch: its views would hold its ring slot)
            return _checked(batch[0], "batch[0]"), lambda out: kind_nt(out, *rest_items)
        kind_seq = type(batch)
        return _checked(batch[0], "batch[0]"), \
            lambda out: kind_seq([out, *rest_items])  # type: ignore[call-arg]
    raise TransformError(
        f"transform=: a batch of type {type(batch).__name__} has no inputs to transform: "
        "the transform runs on a tensor batch, element 0 of a tuple or list batch, or "
        "batch[transform_key] of a dict batch")


def _checked(leaf: Any, where: str) -> torch.Tensor:
    """`leaf` if it is a tensor of samples (at least one dimension); else TransformError."""
    if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
        raise TransformError(
            f"transform=: {where} is {type(leaf).__name__}"
            f"{' of 0 dimensions' if isinstance(leaf, torch.Tensor) else ''}, not a tensor "
            "of samples (dim 0: one row per sample); the producer's loader must yield the "
            "shared samples as a tensor there (set transform_key= for a dict batch)")
    return leaf


def _private(value: Any) -> Any:
    """`value` out of the ring: tensors copied (labels and the like are small), containers
    rebuilt, anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, collections.abc.Mapping):
        return type(value)({k: _private(v) for k, v in value.items()})  # type: ignore[call-arg]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_private(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_private(v) for v in value)
    return value


def to_pil(sample: torch.Tensor) -> Any:
    """A uint8 CHW sample (1 or 3 channels) as a PIL image, for transforms written for PIL
    (transform_input="pil")."""
    from PIL import Image

    if sample.dtype != torch.uint8 or sample.dim() != 3 or sample.shape[0] not in (1, 3):
        raise TransformError(
            f"transform_input='pil' needs uint8 samples of shape (1 or 3, H, W); the shared "
            f"samples are {sample.dtype} of shape {tuple(sample.shape)}")
    if sample.shape[0] == 1:
        return Image.fromarray(sample[0].contiguous().numpy(), mode="L")
    return Image.fromarray(sample.permute(1, 2, 0).contiguous().numpy(), mode="RGB")


def transform_samples(transform: Callable[[Any], Any], inputs: torch.Tensor,
                      seeds: Sequence[int], pil: bool, outputs: list | None = None,
                      fresh: bool = False) -> torch.Tensor:
    """The transform of each row of `inputs`, row k seeded with seeds[k], stacked.

    outputs: the outputs of the first rows, made by a run that was cut short (a
    KeyboardInterrupt): the run goes on from the next row, appending to it (each output is
    appended in the step that ends the row's call). fresh: each row is handed over as a
    copy, so that a transform that writes into its input (in place) leaves `inputs` as
    they were: a row run again after an interrupt starts from the same sample. (Rows made
    into PIL images are copies already.)"""
    outputs = [] if outputs is None else outputs
    cuda_device = inputs.device.index or 0 if inputs.device.type == "cuda" else None
    while len(outputs) < len(seeds):
        k = len(outputs)
        sample = inputs[k]
        seed_everything(seeds[k], cuda_device)
        if pil:
            outputs.append(transform(to_pil(sample)))
        else:
            outputs.append(transform(sample.clone() if fresh else sample))
    return stack(outputs, transform)


def stack(outputs: list, transform: Any) -> torch.Tensor:
    """The outputs of one batch stacked into one tensor; TransformError naming the
    transform if they are not tensors of one shape."""
    for out in outputs:
        if not isinstance(out, torch.Tensor):
            raise TransformError(
                f"transform={describe(transform)} returned a {type(out).__name__}, not a "
                "tensor: a batch is made of tensors (end a PIL pipeline with ToTensor() or "
                "PILToTensor())")
    shapes = {tuple(o.shape) for o in outputs}
    if len(shapes) > 1:
        raise TransformError(
            f"transform={describe(transform)} returned samples of different shapes "
            f"{sorted(shapes)[:4]} in one batch: they cannot be stacked (crop or resize to "
            "one size)")
    return torch.stack(outputs)


def first_sample_check(transform: Callable[[Any], Any], inputs: torch.Tensor, seed: int,
                       pil: bool) -> None:
    """Run the transform on a copy of the batch's first sample, here, before anything
    else (a transform that writes into its input changes the copy): a transform that
    cannot run on the shared samples raises TransformError naming the transform and what
    the samples are (a transform_error(): also of the class of what the transform raised,
    which is its __cause__)."""
    try:
        transform_samples(transform, inputs[:1], [seed], pil, fresh=True)
    except TransformError:
        raise
    except Exception as e:
        given = "PIL images made of them" if pil else "tensors"
        hint = ("" if pil else "; a transform written for PIL images (timm's "
                "create_transform, torchvision.transforms.ToTensor) takes "
                "transform_input='pil'")
        raise transform_error(
            type(e),
            f"transform={describe(transform)} cannot run on the shared samples: the "
            f"producer's loader makes them {inputs.dtype} of shape {tuple(inputs.shape[1:])} "
            f"per sample (given to the transform as {given}), and the transform raised "
            f"{type(e).__name__}: {e}. Make the two sides agree: the shared part (the "
            f"producer's dataset) decides dtype and size, the transform must accept them"
            f"{hint}") from e


def raised_here(transform: Any, error: Exception) -> TransformError:
    """The TransformError of `error`, raised by `transform` run here, at next() (no
    workers): a transform_error() of the same message as a worker's, less the worker;
    raised `from error`, whose traceback is the transform's."""
    return transform_error(type(error), f"transform={describe(transform)} raised "
                           f"{type(error).__name__} at next(): {error}")


def transform_error(raised: type | None, message: str) -> TransformError:
    """The TransformError of a transform that raised an exception of class `raised` (None:
    not the transform's own error): also an instance of `raised` where a class can derive
    from both, as a DataLoader re-raises its worker's exception type. So ``except
    TransformError`` and ``except KeyError`` alike catch a transform's KeyError, whatever
    transform_workers is, at the first sample's check or at any later batch."""
    kind = _error_class(raised)
    try:
        return kind(message)
    except Exception:  # (a class whose __new__ wants other arguments)
        return TransformError(message)


# TransformError subclasses made so far, by the exception class they also derive from.
_ERROR_CLASSES: dict[type, type] = {}


def _error_class(raised: type | None) -> type:
    """TransformError, or a subclass of it and of `raised` (made once per class). Never a
    StopIteration (next() raising one would end the caller's loop silently), nor a class
    Python cannot derive from both (TransformError then)."""
    if not isinstance(raised, type) or not issubclass(raised, Exception) or \
            issubclass(raised, (TransformError, StopIteration, StopAsyncIteration)):
        return TransformError
    made = _ERROR_CLASSES.get(raised)
    if made is None:
        name = f"TransformError({raised.__name__})"
        try:
            made = type(name, (TransformError, raised), {
                "__init__": _message_only, "__str__": BaseException.__str__,
                "__reduce__": _reduced, "__module__": "tensorsocket", "__qualname__": name,
                "__doc__": f"A TransformError that is also a {raised.__qualname__}: what the "
                           "transform raised."})
        except Exception:  # (layouts or metaclasses that do not mix)
            made = TransformError
        _ERROR_CLASSES[raised] = made
    return made


def _message_only(self: BaseException, message: str) -> None:
    """__init__ of a transform_error() class: the message only (the transform's class's
    own __init__ may want other arguments)."""
    BaseException.__init__(self, message)


def _reduced(self: BaseException) -> tuple:
    """__reduce__ of a transform_error() class (made at run time: pickled as how to make
    it again, from the transform's class and the message)."""
    raised = next(c for c in type(self).__bases__ if c is not TransformError)
    return transform_error, (raised, str(self))
