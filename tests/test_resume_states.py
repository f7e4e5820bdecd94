"""Resume states that do not fit (issue 35, item 7): a state saved over another loader,
or with fields changed by hand, is refused by load_state_dict() with a ValueError that
names the field, and the consumer stays as it was; an older state (version 2) still loads,
with a warning saying what could not be checked. Real share() producers and jobs
(tests/resume_job.py): 160 samples in shuffled batches of 8, a job takes 5 of them (40
samples) and saves its state; the resumed epoch owes the other 120.

On 7094346 every one of these states was used: batches_in_epoch + 5 gave 80 of the 120
owed samples, 10^6 none, a complemented taken bitmap gave the 40 taken before again and
none of the 120, a state saved over batches of 8 loaded with batches of 16 gave 80."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tensorsocket.data import resume
from tensorsocket.data.resume import EpochTaken, SavedPlace
from tensorsocket.data.sample_ids import IdMask

from test_resume import assert_once, flat, producers_end, run_job, same_producer  # noqa: F401

SAMPLES, BATCH, TAKE = 160, 8, 5
LOADER = ["--samples", str(SAMPLES), "--batch-size", str(BATCH)]


def complemented(text: str, size: int) -> str:
    mask = IdMask.from_text(text, size)
    mask.bits[:size] = ~mask.bits[:size]
    return mask.to_text(size)


def older(state: dict) -> dict:
    """`state` as tensorsocket wrote it before it stored what it depends on (version 2)."""
    new = ("loader_batch_size", "epoch_batches", "samples_in_epoch", "taken_count")
    return {**{k: v for k, v in state.items() if k not in new}, "tensorsocket_state": 2}


def write(tmp_path, name: str, state: dict) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(state))
    return str(path)


def interrupted(name, tmp_path, *opts: str) -> tuple[dict, dict]:
    """The job that took 5 batches and saved its state: (its output, the state)."""
    first = run_job(name, *LOADER, "--take", str(TAKE), *opts,
                    state_out=tmp_path / "state.json")
    state = first["state"]
    assert state["taken"] is not None and state["batches_in_epoch"] == TAKE
    return first, state


# -- real jobs ---------------------------------------------------------------------------

def test_states_changed_by_hand_are_refused_and_the_consumer_stays_as_it_was(
        name, tmp_path, producers_end):
    """A job loads a good state (its epoch counter set to 1000, which is carried as is),
    then tries states changed by hand: each is refused with a ValueError naming the
    field, and the good state stays loaded: the resumed epoch holds exactly the 120
    samples not taken, then a whole epoch."""
    first, state = interrupted(name, tmp_path)
    taken = state["taken"]
    bad = [  # (the field the refusal names, the state)
        ("batches_in_epoch", {**state, "batches_in_epoch": TAKE + 5}),
        ("batches_in_epoch", {**state, "batches_in_epoch": 10 ** 6}),
        ("taken", {**state, "taken": complemented(taken, SAMPLES)}),
        ("samples_in_epoch", {**state, "taken": complemented(taken, SAMPLES),
                              "taken_count": SAMPLES - TAKE * BATCH}),
        ("epoch", {**state, "epoch": True}),
        ("taken", older({**state, "taken": complemented(taken, SAMPLES)})),
    ]
    good = {**state, "epoch": 1000}
    argv = [arg for i, (_, s) in enumerate(bad)
            for arg in ("--bad-state", write(tmp_path, f"bad{i}", s))]
    second = run_job(name, *LOADER, "--epochs", "2", *argv,
                     state_in=write(tmp_path, "good", good))
    same_producer(first, second)
    assert len(second["bad_states"]) == len(bad)
    wrong = [(field, outcome) for (field, _), outcome in zip(bad, second["bad_states"])
             if not outcome.get("refused", "").startswith("ValueError: the state's " + field)]
    assert not wrong, "not refused naming the field changed:\n" + "\n".join(
        f"{field}: {outcome}" for field, outcome in wrong)
    assert second["state_after_load"] == good  # the refusals changed nothing
    before, rest = flat(first["epochs"][0]), flat(second["epochs"][0])
    assert len(rest) == SAMPLES - TAKE * BATCH
    assert_once(before + rest, SAMPLES, "the interrupted epoch, both runs")
    assert_once(flat(second["epochs"][1]), SAMPLES, "the epoch after")
    assert not second["warnings"], second["warnings"]


def test_a_state_saved_over_another_loader_is_refused(name, tmp_path, producers_end):
    """A state saved over batches of 8 is loaded into a consumer of a loader with batches
    of 16 over the same data: refused, naming loader_batch_size (on 7094346: the resumed
    epoch gave 80 of the 120 samples owed); that consumer's epochs stay whole."""
    _, state = interrupted(name, tmp_path)
    other = run_job(f"{name}-16", "--samples", str(SAMPLES), "--batch-size", "16",
                    "--epochs", "1", "--bad-state", write(tmp_path, "state8", state))
    [outcome] = other["bad_states"]
    assert "refused" in outcome, f"accepted: {outcome}"
    assert outcome["refused"].startswith("ValueError: the state's loader_batch_size is 8, "
                                         "this consumer's is 16"), outcome
    assert other["state_after_load"]["epoch"] == 0
    assert other["state_after_load"]["batches_in_epoch"] == 0
    assert_once(flat(other["epochs"][0]), SAMPLES, "its first epoch")


def test_an_older_state_still_resumes_exactly_with_a_warning(name, tmp_path, producers_end):
    """A version 2 state (before the fields a state depends on) over the same loader
    resumes exactly, with a TensorSocketWarning that says what could not be checked."""
    first, state = interrupted(name, tmp_path)
    second = run_job(name, *LOADER, "--epochs", "1",
                     state_in=write(tmp_path, "v2", older(state)))
    assert_once(flat(first["epochs"][0]) + flat(second["epochs"][0]), SAMPLES, "epoch 0")
    assert len(second["warnings"]) == 1 and "older tensorsocket (state version 2)" in \
        second["warnings"][0], second["warnings"]


# -- the checks (no processes) ---------------------------------------------------------
# A consumer's EpochShape as a tuple: (batch_size=, world_size, the loader's batch size,
# len(), the dataset's length).

SHAPE = (None, 1, BATCH, SAMPLES // BATCH, SAMPLES)


def decode(state: dict, fit: tuple) -> SavedPlace:
    return resume.decode(state, resume.EpochShape(*fit))


def encode(place: SavedPlace, fit: tuple) -> dict:
    return resume.encode(place, resume.EpochShape(*fit))


def unchecked(place: SavedPlace, fit: tuple) -> str | None:
    return resume.unchecked(place, resume.EpochShape(*fit))


def saved(batches: int, ids, samples=None, fit: tuple = SHAPE, size=SAMPLES) -> dict:
    mask = IdMask(size)
    mask.add(np.asarray(ids, dtype=np.int64))
    held = samples if samples is not None else len(ids)
    return encode(SavedPlace(0, batches, mask, size, held), fit)


def test_decode_refuses_what_does_not_fit_naming_field_value_and_bound():
    state = saved(5, range(40))
    assert decode(state, SHAPE).batches == 5
    cases = [
        ({**state, "batches_in_epoch": 21}, SHAPE,
         "batches_in_epoch is 21: an epoch of this consumer has 20 batches (len()), so it "
         "must be 0 to 20"),
        ({**state, "batches_in_epoch": 10}, SHAPE,
         "batches_in_epoch is 10 and its samples_in_epoch is 40: 10 batches of 8 samples "
         "hold 73 to 80, so batches_in_epoch must be 5"),
        ({**state, "batches_in_epoch": 0}, SHAPE,
         "taken names 40 samples, its batches_in_epoch is 0"),
        ({**state, "taken_count": 39}, SHAPE, "taken names 40 samples, its taken_count is 39"),
        ({**state, "samples_in_epoch": 30}, SHAPE,
         "samples_in_epoch is 30 and its taken names 40 samples"),
        ({**state, "samples_in_epoch": -1}, SHAPE, "samples_in_epoch is -1"),
        ({**state, "epoch": -3}, SHAPE, "epoch is -3: it must be an integer 0 or more"),
        ({**state, "epoch": 2.0}, SHAPE, "epoch is 2.0"),
        (state, (None, 1, 16, 10, SAMPLES), "loader_batch_size is 8, this consumer's is 16"),
        (state, (None, 1, BATCH, 19, SAMPLES), "epoch_batches is 20, this consumer's is 19"),
        (state, (None, 1, BATCH, 20, 170), "dataset_len is 160"),
        ({**state, "tensorsocket_state": True}, SHAPE, "not a tensorsocket consumer state"),
    ]
    for bad, fit, message in cases:
        with pytest.raises(ValueError) as refused:
            decode(bad, fit)
        assert message in str(refused.value), (message, str(refused.value))


def test_decode_accepts_every_state_a_consumer_saves():
    # Its last batch short, or all of the epoch taken.
    decode(saved(20, range(160)), SHAPE)
    decode(saved(3, range(17), fit=(None, 1, 8, 3, 100), size=100), (None, 1, 8, 3, 100))
    # A sampler that draws with replacement: fewer samples named than the batches held.
    decode(saved(5, [1, 2, 3] * 10 + list(range(10, 20)), samples=40), SHAPE)
    # A window over two producer epochs: the loader's short last batch in the middle.
    decode(saved(2, range(12), fit=(None, 1, 8, 13, 100), size=100), (None, 1, 8, 13, 100))
    # A group's state at its ranks' last batch: all of it (the tail no rank takes too).
    group = (None, 2, 32, 4, 280)
    decode(encode(SavedPlace(0, 4, IdMask.whole(280), 280, 280), group), group)
    # Own batch_size: the loader's batch size is not the consumer's and may differ.
    decode(saved(3, range(60), fit=(20, 1, 32, 8, SAMPLES)), (20, 1, 16, 8, SAMPLES))
    # Between epochs, and by count (no sampler).
    decode(encode(SavedPlace(7, 0, None, SAMPLES), SHAPE), SHAPE)
    decode(encode(SavedPlace(0, 3, None, None), (None, 1, 8, 20, None)),
           (None, 1, 8, 20, None))
    # An epoch counter far ahead: the job's count, carried as it is.
    assert decode({**saved(5, range(40)), "epoch": 10 ** 6}, SHAPE).epoch == 10 ** 6


def test_older_states_are_checked_where_they_can_be():
    state = older(saved(5, range(40)))
    place = decode(state, SHAPE)
    assert place.samples is None and "older tensorsocket" in unchecked(place, SHAPE)
    with pytest.raises(ValueError, match="taken names 120 samples, more than its "
                                         "batches_in_epoch=5 batches of 8 samples hold"):
        decode({**state, "taken": complemented(state["taken"], SAMPLES)}, SHAPE)
    with pytest.raises(ValueError, match="batches_in_epoch is 1000000"):
        decode({**state, "batches_in_epoch": 10 ** 6}, SHAPE)
    # Saved over batches of 8, loaded with batches of 16: warned, not provable.
    wider = (None, 1, 16, 10, SAMPLES)
    assert "will be lost or come twice" in unchecked(decode(state, wider), wider)
    # Re-saved before its epoch began, it stays a state whose samples are unknown.
    again = encode(place, SHAPE)
    assert again["samples_in_epoch"] is None and unchecked(decode(again, SHAPE), SHAPE)


def test_a_batch_recorded_again_after_an_interrupt_counts_once():
    taken = EpochTaken(1)
    ids = np.arange(8)
    taken.delivered(ids)
    taken.delivered(ids)  # next() interrupted after it: the batch is delivered again
    taken.delivered(np.array([3, 4, 20, 21, 22, 23, 24, 25]))  # two drawn again
    mask, samples = taken.part(2)
    assert (mask.count(), samples) == (14, 16)
