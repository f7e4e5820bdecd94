"""What the client scripts of tests/test_frameworks.py share.

Each client is a training script as a user would write it, with the one-line swap
``loader = tensorsocket.share(DataLoader(...), name=...)``; ``--no-share`` runs the
same script on its own DataLoader (the baseline the shared run must match).

- ``IdDataset``: sample i is ``(x=[float(i)], y=i)``, so every batch says which samples
  it holds; every load is appended to ``$TS_TEST_LOADS`` as ``<pid> <i>``, so the test
  can tell which process ran the loader.
- ``trace()``: records which attributes of the loader object code outside tensorsocket
  reads, sets or deletes (the frameworks, the script), and len() / iter() on it, with the
  file and line that did and whether the attribute was there; written to the script's
  JSON as ``touched`` (``TS_TEST_TRACE=0`` turns it off).
- ``dump()``: writes this process's record to ``<out>.rank<r>.json`` atomically (the
  test merges the ranks of a job); scripts call it after every epoch too, so a job that
  hangs or dies still leaves what it had received.
- SIGUSR1 dumps every thread's stack to stderr (faulthandler): the test does that to a
  job that hangs, before killing it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

T0 = time.time()
# TS_TEST_STORE=1: the swap is share(loader, name=..., store=True), the store of decoded
# samples (tests/test_store_frameworks.py), each job its own DataLoader.
STORE = os.environ.get("TS_TEST_STORE") == "1"
# The test sends SIGUSR1 to a job that hangs before it kills it: every thread's stack goes
# to stderr, which the test shows.
faulthandler.register(signal.SIGUSR1, all_threads=True)


class IdDataset(TensorDataset):
    """n samples; sample i is (tensor([float(i)]), tensor(i)). Loads are logged."""

    def __init__(self, n: int, offset: int = 0) -> None:
        ids = torch.arange(offset, offset + n)
        super().__init__(ids.float().unsqueeze(1), ids)
        self.loads = os.environ.get("TS_TEST_LOADS")

    def __getitem__(self, i: int) -> Any:
        sample = super().__getitem__(i)
        if self.loads:
            fd = os.open(self.loads, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, b"%d %d\n" % (os.getpid(), int(sample[1])))
            finally:
                os.close(fd)
        return sample


def make_loader(loader: DataLoader, name: str, no_share: bool) -> tuple[Any, dict]:
    """The one-line swap: tensorsocket.share(loader, name=name), unless no_share; also
    what the test wants to know about the result."""
    started = time.time()
    if no_share:
        shared = loader
    else:
        import tensorsocket

        shared = tensorsocket.share(loader, name=name, store=STORE)
    meta = {
        "pid": os.getpid(),
        "name": name,
        "t_share_call": started - T0,
        "t_share_return": time.time() - T0,
        "wall_start": started,
        "type": f"{type(shared).__module__}.{type(shared).__qualname__}",
        "is_dataloader": isinstance(shared, DataLoader),
        "started_producer": getattr(shared, "started_producer", None),
        "producer_pid": getattr(shared, "producer_pid", None),
        "producer_log": str(getattr(shared, "producer_log", None)),
    }
    try:
        meta["len"] = len(shared)
    except TypeError as e:
        meta["len"] = f"TypeError: {e}"
    meta["own_len"] = len(loader)
    if not no_share and os.environ.get("TS_TEST_TRACE", "1") == "1":
        meta["touched"] = trace(shared)
    return shared, meta


def trace(obj: Any) -> dict:
    """Record the attribute reads on obj from outside the tensorsocket package:
    {name: {"file:line": found}}. Swaps obj's class for a subclass (isinstance still
    holds); returns the dict it fills (empty if the class cannot be swapped)."""
    touched: dict[str, dict[str, bool]] = {}
    import tensorsocket

    package = os.path.dirname(os.path.abspath(tensorsocket.__file__))

    def note(name: str, found: bool) -> None:
        frame = sys._getframe(2)
        # isinstance() against an ABC or a runtime-checkable Protocol reads __class__ and
        # the protocol's attributes from abc / typing: name the code that asked.
        while frame.f_back is not None and (frame.f_code.co_filename.startswith("<frozen")
                                            or frame.f_code.co_filename.endswith(
                                                ("/typing.py", "/abc.py"))):
            frame = frame.f_back
        path = frame.f_code.co_filename
        if path.startswith(package) or path == __file__:
            return
        short = path
        for marker in ("site-packages/", "tests/clients/"):
            if marker in path:
                short = path.split(marker, 1)[1]
        touched.setdefault(name, {}).setdefault(f"{short}:{frame.f_lineno}", found)

    cls = type(obj)

    def __getattribute__(self: Any, name: str) -> Any:
        try:
            value = cls.__getattribute__(self, name)
        except AttributeError:
            fallback = getattr(cls, "__getattr__", None)
            if fallback is not None:
                try:
                    value = fallback(self, name)
                except AttributeError:
                    pass
                else:
                    note(name, True)
                    return value
            note(name, False)
            raise
        note(name, True)
        return value

    def __setattr__(self: Any, name: str, value: Any) -> None:
        note(f"{name} (set)", True)
        cls.__setattr__(self, name, value)

    def __delattr__(self: Any, name: str) -> None:
        note(f"{name} (deleted)", True)
        cls.__delattr__(self, name)

    namespace: dict[str, Any] = {"__getattribute__": __getattribute__,
                                 "__setattr__": __setattr__, "__delattr__": __delattr__,
                                 "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    if hasattr(cls, "__len__"):
        def __len__(self: Any) -> int:
            note("len()", True)
            return cls.__len__(self)
        namespace["__len__"] = __len__
    if hasattr(cls, "__iter__"):
        def __iter__(self: Any) -> Any:
            note("iter()", True)
            return cls.__iter__(self)
        namespace["__iter__"] = __iter__
    try:
        traced = type(cls.__name__, (cls,), namespace)
        obj.__class__ = traced
    except TypeError:
        return touched
    return touched


def dump(out: str, rank: int, record: dict) -> None:
    """Write record to <out>.rank<rank>.json (atomically: a reader never sees half)."""
    path = f"{out}.rank{rank}.json"
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def ids_of(y: Any) -> list[int]:
    """The sample ids of a batch's id tensor."""
    return [int(i) for i in y.reshape(-1).tolist()]


def own_loads() -> int:
    """Samples this process loaded itself (lines of $TS_TEST_LOADS with its pid)."""
    path = os.environ.get("TS_TEST_LOADS")
    if not path or not os.path.exists(path):
        return 0
    me = str(os.getpid())
    with open(path) as f:
        return sum(1 for line in f if line.split(" ", 1)[0] == me)
