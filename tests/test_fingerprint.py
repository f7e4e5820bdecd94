"""tensorsocket.loader.fingerprint: describe() and differences() of loaders' pipelines."""

from __future__ import annotations

import json
import random
import sys
import textwrap
import types

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, TensorDataset

from tensorsocket import TensorSocketError
from tensorsocket.control.endpoints import resolve
from tensorsocket.loader.fingerprint import MAX_CHARS, describe, differences, records_first_sample
from tensorsocket.sharing.share import _check_same_data
from conftest import run as run_python

# A pipeline module both this process and a fresh interpreter import by the same name, so
# its classes have the same qualified names on both sides.
PIPELINE = textwrap.dedent('''
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Scale:
        """A transform without a repr of its own (its default repr has an address)."""
        def __init__(self, factor):
            self.factor = factor
        def __call__(self, x):
            return x * self.factor

    class Images(Dataset):
        def __init__(self, transform=None, size=8):
            self.transform, self.size = transform, size
        def __len__(self):
            return 20
        def __getitem__(self, i):
            image = torch.rand(3, self.size, self.size)  # random: values are not described
            return (self.transform(image) if self.transform else image), i

    def mixup_collate(batch):
        images = torch.stack([b[0] for b in batch])
        targets = torch.nn.functional.one_hot(torch.tensor([b[1] for b in batch]), 10)
        return images, targets.float()

    def build(**changes):
        options = dict(batch_size=4, shuffle=True, drop_last=True)
        options.update(changes)
        return DataLoader(Images(Scale(2)), **options)
''')


@pytest.fixture
def pipeline(tmp_path, monkeypatch):
    """The PIPELINE module, importable here and by a subprocess (from tmp_path)."""
    module_name = f"pipeline_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module_name}.py").write_text(PIPELINE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(module_name)
    yield module
    sys.modules.pop(module_name, None)


def test_same_loader_is_described_the_same(pipeline):
    first = describe(pipeline.build(), first_sample=True)
    second = describe(pipeline.build(), first_sample=True)
    assert first == second
    assert differences(first, second) == []
    fields = json.loads(first)
    assert fields["transform"] == f"{pipeline.__name__}.Scale(factor=2)"  # no address
    assert fields["sample"] == "tuple(Tensor[float32,[3, 8, 8]], int)"
    assert fields["collate_fn"] == "default_collate"
    assert fields["sampler"] == "torch.utils.data.sampler.RandomSampler"
    assert (fields["batch_size"], fields["drop_last"], fields["len"]) == (4, True, 20)


def test_same_loader_in_a_fresh_process_is_described_the_same(pipeline, tmp_path):
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import {pipeline.__name__} "
            "as p; from tensorsocket.loader.fingerprint import describe; "
            "print(describe(p.build(), first_sample=True))")
    out = run_python([sys.executable, "-c", code], capture_output=True, text=True,
                     timeout=60, check=True).stdout.strip()
    assert out == describe(pipeline.build(), first_sample=True)


@pytest.mark.parametrize("change, named, ours, theirs", [
    (dict(collate_fn="mixup"), "collate_fn", "mixup_collate", "default_collate"),
    (dict(batch_size=16), "batch_size", "16", "4"),
    (dict(shuffle=False), "sampler", "SequentialSampler", "RandomSampler"),
    (dict(drop_last=False), "drop_last", "false", "true"),
])
def test_each_loader_setting_that_differs_is_named(pipeline, change, named, ours, theirs):
    if change.get("collate_fn") == "mixup":
        change["collate_fn"] = pipeline.mixup_collate
    found = differences(describe(pipeline.build(**change)), describe(pipeline.build()))
    assert len(found) == 1, found
    assert found[0].startswith(f"{named}: this script's ")
    mine, producers = found[0].split(", the producer's ")
    assert ours in mine and theirs in producers


def test_other_transform_is_named(pipeline):
    producer = describe(pipeline.build())
    edited = describe(DataLoader(pipeline.Images(pipeline.Scale(3)), batch_size=4,
                                 shuffle=True, drop_last=True))
    assert differences(edited, producer) == [
        f"transform: this script's {pipeline.__name__}.Scale(factor=3), the producer's "
        f"{pipeline.__name__}.Scale(factor=2)"]
    no_transform = describe(DataLoader(pipeline.Images(), batch_size=4, shuffle=True,
                                       drop_last=True))
    assert differences(no_transform, producer)[0].startswith("transform: this script's none,")


def test_other_first_sample_structure_is_named(pipeline):
    producer = describe(pipeline.build(), first_sample=True)
    edited = describe(DataLoader(pipeline.Images(pipeline.Scale(2), size=16), batch_size=4,
                                 shuffle=True, drop_last=True), first_sample=True)
    assert differences(edited, producer) == [
        "first sample (dataset[0] structure): this script's tuple(Tensor[float32,[3, 16, 16]], "
        "int), the producer's tuple(Tensor[float32,[3, 8, 8]], int)"]
    # Without the sample on one side, nothing to compare.
    assert differences(describe(pipeline.build()), edited) == []
    assert not records_first_sample(describe(pipeline.build()))
    assert records_first_sample(producer)


def test_ignored_fields_are_not_reported(pipeline):
    found = differences(describe(pipeline.build(batch_size=8, drop_last=False)),
                        describe(pipeline.build()), ignore=("batch_size", "drop_last"))
    assert found == []


def test_transforms_are_found_through_a_subset(pipeline):
    fields = json.loads(describe(DataLoader(Subset(pipeline.Images(pipeline.Scale(5)), [0, 1]))))
    assert fields["dataset"] == "torch.utils.data.dataset.Subset"
    assert fields["transform"] == f"{pipeline.__name__}.Scale(factor=5)"


def test_wrappers_are_looked_through_one_way(pipeline):
    """dataset_layers: a ConcatDataset's datasets and wrappers' .dataset, nested, each
    once (a dataset in a ConcatDataset twice, a cycle); the
    fingerprint's transform is the first layer's that has one, and dataset_transforms
    (what the decoded cache checks) gives every layer's."""
    from torch.utils.data import ConcatDataset

    from tensorsocket.loader.fingerprint import dataset_layers, dataset_transforms

    class Loop(Dataset):
        def __init__(self, inner):
            self.dataset = inner

        def __len__(self):
            return len(self.dataset)

        def __getitem__(self, i):
            return self.dataset[i]

    inner = pipeline.Images(pipeline.Scale(3))
    subset = Subset(inner, [0, 1])
    concat = ConcatDataset([subset, inner, subset])
    loop = Loop(concat)
    concat.datasets.append(loop)  # a cycle: walked once
    assert dataset_layers(loop) == [loop, concat, subset, inner]
    fields = json.loads(describe(DataLoader(loop)))
    assert fields["transform"] == f"{pipeline.__name__}.Scale(factor=3)"
    outer = pipeline.Images(pipeline.Scale(7))
    outer.dataset = concat  # a dataset with a transform of its own that wraps another
    assert [v.factor for _, v in dataset_transforms(outer)] == [7, 3]
    assert json.loads(describe(DataLoader(outer)))["transform"].endswith("Scale(factor=7)")


class Counted(TensorDataset):
    """Counts its loads."""

    def __init__(self) -> None:
        super().__init__(torch.arange(4))
        self.loads = 0

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        self.loads += 1
        return super().__getitem__(i)


def test_only_first_sample_true_loads_a_sample():
    dataset = Counted()
    loader = DataLoader(dataset, batch_size=2)
    assert "sample" not in json.loads(describe(loader)) and dataset.loads == 0
    assert json.loads(describe(loader, first_sample=True))["sample"] == "tuple(Tensor[int64,[]])"
    assert dataset.loads == 1


class Unreadable(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        raise OSError(f"sample {i} is on a disk that is gone")


def test_failing_getitem_does_not_break_describe():
    text = describe(DataLoader(Unreadable(), batch_size=2), first_sample=True)
    fields = json.loads(text)
    assert "sample" not in fields and fields["len"] == 4
    assert differences(text, describe(DataLoader(TensorDataset(torch.arange(4)), batch_size=2)))


def test_describing_leaves_the_random_streams_alone(pipeline):
    torch.manual_seed(7)
    random.seed(7)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(7)
    random.seed(7)
    describe(pipeline.build(), first_sample=True)  # dataset[0] draws from torch's generator
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_list_iterator_and_iterable_dataset_are_not_iterated():
    batches = [torch.zeros(2), torch.ones(2), torch.ones(2)]
    fields = json.loads(describe(batches))
    assert fields == {"format": 1, "kind": "iterable", "type": "builtins.list", "len": 3}
    assert differences(describe(batches), describe(batches[:2])) == [
        "length: this script's 3, the producer's 2"]
    stream = (torch.tensor(i) for i in range(3))
    assert json.loads(describe(stream))["len"] is None
    assert next(stream).item() == 0  # describe() did not take from it

    class Endless(IterableDataset):
        def __iter__(self):
            raise AssertionError("describe() must not iterate")

    fields = json.loads(describe(DataLoader(Endless(), batch_size=2)))
    assert fields["len"] is None and "sample" not in fields


def test_a_factory_matches_anything(pipeline):
    def epochs_of_batches():
        yield from ([torch.zeros(2)] * 3)

    factory = describe(epochs_of_batches)
    assert json.loads(factory)["kind"] == "factory"
    loader = describe(pipeline.build())
    assert differences(factory, loader) == [] and differences(loader, factory) == []
    assert differences(describe(lambda: pipeline.build()), describe([1, 2])) == []


def test_missing_or_unreadable_descriptions_are_no_difference(pipeline):
    loader = describe(pipeline.build())
    for other in (None, "", "not json", "[1, 2]", json.dumps({"format": 99, "len": 3})):
        assert differences(loader, other) == [] and differences(other, loader) == []
    # A field only one side has is no difference; an unknown length neither.
    assert differences(json.dumps({"format": 1, "len": None, "collate_fn": "x"}),
                       json.dumps({"format": 1, "len": 5})) == []


def test_long_reprs_are_cut_but_still_told_apart():
    class Verbose:
        def __init__(self, tail: str) -> None:
            self.tail = tail

        def __repr__(self) -> str:
            return "Verbose(" + "step(), " * 2000 + self.tail + ")"

    class Held(TensorDataset):
        def __init__(self, transform: Verbose) -> None:
            super().__init__(torch.arange(4))
            self.transform = self.target_transform = self.transforms = transform

    a = describe(DataLoader(Held(Verbose("a")), collate_fn=Verbose("a")))
    b = describe(DataLoader(Held(Verbose("b")), collate_fn=Verbose("b")))
    assert len(a) < MAX_CHARS and len(b) < MAX_CHARS
    found = differences(a, b)
    assert [f.split(":")[0] for f in found] == [
        "transform", "target_transform", "transforms", "collate_fn"]
    assert all(len(f) < 400 for f in found)


def test_share_check_names_the_pipeline_difference_and_the_way_out(pipeline):
    """share()'s check of a running producer, given the producer's handshake fields."""
    producer = types.SimpleNamespace(
        producer_dataset=f"{pipeline.__name__}.Images", producer_dataset_len=20,
        producer_pid=4242, producer_fingerprint=describe(pipeline.build()))
    endpoint = resolve("fingerprint-check")
    _check_same_data(producer, pipeline.build(batch_size=7, drop_last=False), endpoint, 60)
    with pytest.raises(TensorSocketError, match=r"pid 4242\) serves other data.*collate_fn: "
                       r"this script's .*mixup_collate, the producer's default_collate.*"
                       r"another name=.*kill 4242.*idle_timeout=60"):
        _check_same_data(producer, pipeline.build(collate_fn=pipeline.mixup_collate),
                         endpoint, 60)
    # A producer that recorded its first sample: the caller's is loaded and compared.
    producer.producer_fingerprint = describe(pipeline.build(), first_sample=True)
    _check_same_data(producer, pipeline.build(), endpoint, 60)
    with pytest.raises(TensorSocketError, match=r"first sample \(dataset\[0\] structure\): "
                       r"this script's tuple\(Tensor\[float32,\[3, 16, 16\]\], int\)"):
        _check_same_data(producer, DataLoader(pipeline.Images(pipeline.Scale(2), size=16),
                                              batch_size=4), endpoint, None)
    producer.producer_fingerprint = None  # a producer that does not say: no check
    _check_same_data(producer, pipeline.build(collate_fn=pipeline.mixup_collate), endpoint, 60)
