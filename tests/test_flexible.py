"""Flexible consumers in real processes: late joiners, own batch sizes, different
speeds, the laggard policy, leaving and attaching again."""

from __future__ import annotations

import pytest

from roles import SampleDataset  # noqa: F401  (roles must import cleanly)


def _batches(epoch: int, start: int, stop: int) -> list[int]:
    """Values of batches [start, stop) of a producer epoch (CountingLoader: e*1000+b)."""
    return [epoch * 1000 + b for b in range(start, stop)]


def _assert_late_joiner_epoch(got: list[int], epochs: int, batches: int) -> None:
    """got is a late joiner's epoch: `batches` consecutive batches of the producer's
    stream (of `epochs` epochs) from where it joined, or up to the stream's end."""
    stream = [v for k in range(epochs) for v in _batches(k, 0, batches)]
    start = stream.index(got[0])
    assert got == stream[start:start + len(got)], got
    assert len(got) == batches or got[-1] == stream[-1], got


@pytest.mark.parametrize(
    "window, gate, first_epoch",
    [
        # Joins at epoch 1, batch 37 with a window of 10: starts at batch 27; its epoch
        # is the next 100 batches, wrapping into the producer's epoch 2.
        (10, "1:37", _batches(1, 27, 100) + _batches(2, 0, 27)),
        # A window reaching back past the epoch start is cut there: an aligned epoch.
        (50, "1:37", _batches(1, 0, 100)),
        # No window: it starts at the current batch.
        (0, "1:37", _batches(1, 37, 100) + _batches(2, 0, 37)),
        # Between epochs: it starts at the next epoch's first batch.
        (10, "1:0", _batches(1, 0, 100)),
    ],
    ids=["window-mid-epoch", "window-to-epoch-start", "no-window", "between-epochs"],
)
def test_late_joiner_sees_exact_batches(procs, name, window, gate, first_epoch):
    prod = procs.start("producer", "--name", name, "--kind", "tuple", "--epochs", "3",
                       "--batches", "100", "--window", str(window), "--gate", gate)
    procs.wait_ready(prod)
    early = procs.start("consumer", "--name", name, "--kind", "tuple", "--epochs", "3")
    assert procs.wait_ready(prod) == {"gate": True}  # the producer holds before `gate`
    late = procs.start("consumer", "--name", name, "--kind", "tuple", "--epochs", "2",
                       "--no-align")
    e, lt, p = procs.result(early), procs.result(late), procs.result(prod)

    # The consumer that was there from the start got every batch once, in order.
    assert e["epochs"] == [_batches(k, 0, 100) for k in range(3)] and e["errors"] == []
    assert lt["errors"] == [] and lt["len"] == 100
    assert lt["epochs"][0] == first_epoch
    # Its next epoch continues where the first ended. If that runs past the producer's
    # last epoch, it ends early with a warning.
    rest = first_epoch[-1] + 1
    second = [v for v in range(rest, 3000) if v % 1000 < 100][:100]
    if first_epoch[0] % 1000 == 0:
        assert lt["epochs"][1] == second and lt["warnings"] == []
    else:
        assert lt["epochs"][1] == [v for v in second if v < 2100]
        assert any("finished in the middle" in w for w in lt["warnings"]), lt["warnings"]
    assert p["drained"] is True and p["stats"]["window"] == window


@pytest.mark.parametrize("slots, gate, first_epoch", [
    (12, "1:37", _batches(2, 0, 100)),  # mid-epoch: it waits for epoch 2
    (60, "1:37", _batches(1, 0, 100)),  # the epoch start still in the ring: epoch 1
    (12, "1:0", _batches(1, 0, 100)),  # between epochs: the next one
], ids=["mid-epoch", "start-in-ring", "between-epochs"])
def test_aligned_late_joiner_gets_whole_epochs(procs, name, slots, gate, first_epoch):
    """By default a late joiner's epochs are whole producer epochs: it starts at the
    current epoch's first batch while that is still in the ring, else at the next one's."""
    prod = procs.start("producer", "--name", name, "--kind", "tuple", "--epochs", "3",
                       "--batches", "100", "--window", "10", "--gate", gate,
                       "--slots", str(slots))
    procs.wait_ready(prod)
    early = procs.start("consumer", "--name", name, "--kind", "tuple", "--epochs", "3")
    assert procs.wait_ready(prod) == {"gate": True}
    late = procs.start("consumer", "--name", name, "--kind", "tuple", "--epochs", "1")
    e, lt = procs.result(early), procs.result(late)
    procs.result(prod)
    assert e["epochs"] == [_batches(k, 0, 100) for k in range(3)] and e["errors"] == []
    assert lt["errors"] == [] and lt["epochs"] == [first_epoch]


def test_late_joiner_realigns_after_a_short_producer_epoch(procs, name):
    """Joined at epoch 0, batch 37 (no window); the producer cuts epoch 1 at 20 batches:
    the joiner's first epoch ends with the producer's, and the next is epoch 2, whole."""
    prod = procs.start("producer", "--name", name, "--kind", "tuple", "--epochs", "3",
                       "--batches", "100", "--window", "0", "--gate", "0:37", "--cut", "1:20")
    procs.wait_ready(prod)
    early = procs.start("consumer", "--name", name, "--kind", "tuple", "--epochs", "3")
    assert procs.wait_ready(prod) == {"gate": True}
    late = procs.start("consumer", "--name", name, "--kind", "tuple", "--epochs", "2",
                       "--no-align")
    e, lt = procs.result(early), procs.result(late)
    procs.result(prod)
    assert e["epochs"] == [_batches(0, 0, 100), _batches(1, 0, 20), _batches(2, 0, 100)]
    assert lt["errors"] == [] and lt["warnings"] == []
    assert lt["epochs"] == [_batches(0, 37, 100) + _batches(1, 0, 20), _batches(2, 0, 100)]


def _sample_ids(epoch: int, stop: int) -> list[int]:
    return [epoch * 100000 + i for i in range(stop)]


def test_own_batch_sizes_deliver_every_sample_once_in_order(procs, name):
    """Loader batch size P = 8 over 100 samples (last loader batch: 4 samples);
    consumers with B = P/4, 2P, 3 and 3 with drop_last, all from one producer."""
    prod = procs.start("producer", "--name", name, "--kind", "samples", "--samples", "100",
                       "--loader-bs", "8", "--epochs", "2", "--min-consumers", "4")
    procs.wait_ready(prod)
    args = {"2": [], "16": [], "3": [], "3-drop": ["--drop-last"]}
    cons = {k: procs.start("consumer", "--name", name, "--kind", "samples", "--epochs", "2",
                           "--batch-size", k.split("-")[0], *extra)
            for k, extra in args.items()}
    res = {k: procs.result(c) for k, c in cons.items()}
    procs.result(prod)
    for k, r in res.items():
        assert r["errors"] == [], (k, r["errors"])
        b = int(k.split("-")[0])
        keep = 99 if k == "3-drop" else 100
        assert r["epochs"] == [_sample_ids(0, keep), _sample_ids(1, keep)], k
        full, tail = divmod(keep, b)
        want = [b] * full + ([tail] if tail else [])
        assert r["sizes"] == [want, want], k
        assert r["len"] == len(want), k
    # B divides P: every batch is a zero-copy slice of a ring slot.
    assert res["2"]["zero_copy"] is True
    # B = 2P: batches are concatenated in the consumer (one copy).
    assert res["16"]["zero_copy"] is False
    assert res["3-drop"]["stats"]["dropped_samples"] == 2  # one per epoch


def test_own_batch_size_over_detection_style_tuples(procs, name):
    """collate_fn=lambda b: tuple(zip(*b)) (images of varying size, target dicts):
    batch_size cuts per sample, not along the images' channels."""
    prod = procs.start("producer", "--name", name, "--kind", "detection", "--samples", "10",
                       "--loader-bs", "4")
    procs.wait_ready(prod)
    c = procs.start("consumer", "--name", name, "--kind", "detection", "--batch-size", "3")
    r = procs.result(c)
    procs.result(prod)
    assert r["errors"] == [] and r["epochs"] == [_sample_ids(0, 10)]
    assert r["sizes"] == [[3, 3, 3, 1]] and r["len"] == 4


def test_slow_and_fast_consumers_are_both_lossless(procs, name):
    prod = procs.start("producer", "--name", name, "--kind", "tuple", "--epochs", "2",
                       "--batches", "30", "--min-consumers", "2")
    procs.wait_ready(prod)
    slow = procs.start("consumer", "--name", name, "--kind", "tuple", "--epochs", "2",
                       "--delay", "0.03")
    fast = procs.start("consumer", "--name", name, "--kind", "tuple", "--epochs", "2")
    s, f, p = procs.result(slow), procs.result(fast), procs.result(prod)
    for r in (s, f):
        assert r["errors"] == [] and r["epochs"] == [_batches(0, 0, 30), _batches(1, 0, 30)]
    # The fast one spent its spare time waiting for batches; the producer for slots.
    assert f["stats"]["wait_seconds"] > s["stats"]["wait_seconds"]
    assert p["stats"]["wait_seconds"] > 0
    assert p["stats"]["lag_detached"] == 0


def test_laggard_is_detached_with_a_clear_error(procs, name):
    prod = procs.start("producer", "--name", name, "--kind", "tuple", "--epochs", "1",
                       "--batches", "60", "--min-consumers", "2", "--max-lag", "3",
                       "--window", "0")
    procs.wait_ready(prod)
    # It holds each batch while it "trains" on it, as a training loop does.
    slow = procs.start("consumer", "--name", name, "--kind", "tuple", "--delay", "0.5",
                       "--hold")
    fast = procs.start("consumer", "--name", name, "--kind", "tuple")
    f, s, p = procs.result(fast), procs.result(slow), procs.result(prod)
    assert f["errors"] == [] and f["epochs"] == [_batches(0, 0, 60)]
    assert s["outcome"].startswith("ConsumerDetached"), s["outcome"]
    assert "max_lag=3" in s["outcome"]
    # What it did get, it got once and in order, before it was detached.
    got = [v for ep in s["epochs"] for v in ep]
    assert got == sorted(set(got))
    assert p["stats"]["lag_detached"] == 1 and p["stats"]["max_lag"] == 3


def test_laggard_rejoins_as_a_late_joiner_with_a_warning(procs, name):
    # The loader takes 10 ms per batch, and sets the pace of both consumers: scheduling
    # jitter cannot put either of them 8 batches (80 ms) behind the other.
    prod = procs.start("producer", "--name", name, "--kind", "tuple", "--epochs", "3",
                       "--batches", "40", "--min-consumers", "2", "--max-lag", "8",
                       "--window", "2", "--lag-policy", "rejoin", "--delay", "0.01")
    procs.wait_ready(prod)
    # Slow on its first batch only: it lags once, rejoins, then keeps up. It asks
    # for more epochs than its shortened ones add up to, and ends at ProducerFinished.
    slow = procs.start("consumer", "--name", name, "--kind", "tuple", "--epochs", "10",
                       "--delay", "0.4", "--delay-first", "1")
    fast = procs.start("consumer", "--name", name, "--kind", "tuple", "--epochs", "3")
    f, s, p = procs.result(fast), procs.result(slow), procs.result(prod)
    assert f["errors"] == [] and f["epochs"] == [_batches(k, 0, 40) for k in range(3)]
    assert s["errors"] == [] and s["outcome"].startswith("ProducerFinished"), s["outcome"]
    assert any(w.startswith("LagWarning") and "max_lag=8" in w for w in s["warnings"])
    # Once, as a rule; a loaded machine can stall it past max_lag again later.
    assert s["stats"]["rejoins"] >= 1 and s["stats"]["skipped_entries"] > 0
    assert p["stats"]["lag_detached"] == s["stats"]["rejoins"]
    # Nothing twice, nothing out of order, across all its epochs.
    got = [v for ep in s["epochs"] for v in ep]
    assert got == sorted(set(got)), got
    # The epoch it was detached in ended early. The next starts where it rejoined (the
    # oldest batch of the window) and is 40 consecutive batches, wrapping into the
    # producer's next epoch (unless it was detached again in it).
    assert 0 < len(s["epochs"][0]) < 40
    stream = [v for k in range(3) for v in _batches(k, 0, 40)]
    for ep in s["epochs"][1:]:
        start = stream.index(ep[0])
        assert ep == stream[start:start + len(ep)], ep
    if s["stats"]["rejoins"] == 1:
        _assert_late_joiner_epoch(s["epochs"][1], 3, 40)


def test_leave_and_attach_again_without_disturbing_others(procs, name):
    prod = procs.start("producer", "--name", name, "--kind", "tuple", "--epochs", "3",
                       "--batches", "30", "--min-consumers", "2", "--window", "0")
    procs.wait_ready(prod)
    stay = procs.start("consumer", "--name", name, "--kind", "tuple", "--epochs", "3",
                       "--delay", "0.005")
    # Leaves mid-epoch (close()), then the same process attaches again for one epoch.
    leave = procs.start("consumer", "--name", name, "--kind", "tuple", "--epochs", "3",
                        "--leave-after", "5", "--rejoin-epochs", "1")
    s, lv, p = procs.result(stay), procs.result(leave), procs.result(prod)
    assert s["errors"] == [] and s["epochs"] == [_batches(k, 0, 30) for k in range(3)]
    assert lv["outcome"] == "left" and lv["epochs"] == [_batches(0, 0, 5)]
    again = lv["rejoined"][0]
    # The second attachment is a late joiner: 30 consecutive batches from where it joined.
    _assert_late_joiner_epoch(again, 3, 30)
    assert p["drained"] is True


def test_breaking_out_of_the_loop_leaves_at_once(procs, name):
    """A consumer that breaks out of its loop and pauses (say, to evaluate) does not hold
    the others up; its next iteration attaches it again as a late joiner."""
    prod = procs.start("producer", "--name", name, "--kind", "tuple", "--epochs", "3",
                       "--batches", "40", "--min-consumers", "2", "--window", "4")
    procs.wait_ready(prod)
    stay = procs.start("consumer", "--name", name, "--kind", "tuple", "--epochs", "3",
                       "--delay", "0.02")
    pauser = procs.start("consumer", "--name", name, "--kind", "tuple", "--epochs", "2",
                         "--break-after", "3", "--pause", "1.0")
    s, b, p = procs.result(stay), procs.result(pauser), procs.result(prod)
    assert s["errors"] == [] and s["epochs"] == [_batches(k, 0, 40) for k in range(3)]
    assert b["errors"] == [] and b["epochs"][0] == _batches(0, 0, 3)
    # While it paused, the producer went on far past what the ring could hold for it.
    pause = b["pause"]
    assert pause["published_after"] - pause["left_at"] > pause["slots"], pause
    # Then it came back as a late joiner: 40 consecutive batches from where it joined.
    assert b["outcome"] == "done", b["outcome"]
    _assert_late_joiner_epoch(b["epochs"][1], 3, 40)
    assert p["drained"] is True


def test_consumer_wanting_more_epochs_than_the_producer_runs_gets_an_error(procs, name):
    prod = procs.start("producer", "--name", name, "--kind", "tuple", "--epochs", "2",
                       "--batches", "5")
    procs.wait_ready(prod)
    c = procs.start("consumer", "--name", name, "--kind", "tuple", "--epochs", "4")
    r = procs.result(c)
    procs.result(prod)
    assert r["epochs"] == [_batches(0, 0, 5), _batches(1, 0, 5)]
    assert r["outcome"].startswith("ProducerFinished: the producer finished after 2 epoch")


def test_peek_then_iterate_gets_a_whole_epoch(name):
    """`next(iter(consumer))` (a common peek at one batch) leaves the ring; the loop that
    follows attaches again and, with a window covering the epoch, gets a whole epoch."""
    import threading

    import torch

    from tensorsocket import TensorConsumer, TensorProducer, TensorSocketError

    loader = [torch.full((2,), float(i)) for i in range(12)]
    producer = TensorProducer(loader, name=name, rubber_band=12, start_timeout=30)
    def produce():
        try:
            for _ in range(4):
                for _ in producer:
                    pass
            producer.join(timeout=10)
        except TensorSocketError:  # closed below while it waits for the consumer
            pass

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        with TensorConsumer(name=name, timeout=10) as c:
            assert int(next(iter(c))[0]) == 0
            assert [int(b[0]) for b in c] == list(range(12))
            # An explicitly closed iterator leaves too, and the next one comes back.
            it = iter(c)
            next(it)
            it.close()
            assert next(it, None) is None
            assert len([b for b in c]) == 12
    finally:
        producer.close()
        thread.join(10)
