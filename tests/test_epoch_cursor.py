"""EpochCursor alone: a consumer's epoch state and its decisions on the producer's stream
of ring entries, without a ring or a process. Each test drives the cursor as
TensorConsumer does: place() every entry it takes, taken() after each batch it makes,
end() at StopIteration."""

from __future__ import annotations

from dataclasses import dataclass

from tensorsocket.data.epoch_cursor import Abandon, EpochCursor, Step


@dataclass(frozen=True)
class Entry:
    """A ring entry as the cursor sees it."""

    epoch: int
    index: int
    is_end_of_epoch: bool = False

    @property
    def seq(self) -> int:
        """Its place in the stream (the producer's stream has one entry per position)."""
        return self.epoch * 100000 + self.index * 2 + self.is_end_of_epoch


def stream(epochs: int, length: int, first_epoch: int = 0) -> list[Entry]:
    """The producer's entries: `length` batches then an end marker, per epoch."""
    out = []
    for e in range(first_epoch, first_epoch + epochs):
        out += [Entry(e, i) for i in range(length)] + [Entry(e, length, True)]
    return out


def read_epoch(cursor: EpochCursor, entries: list[Entry]) -> tuple[list[tuple[int, int]],
                                                                   Entry | None]:
    """One epoch as the consumer reads it: the (epoch, index) of the batches delivered, and
    the entry kept for the next epoch (END_BEFORE), if any. Consumes from `entries`."""
    cursor.begin()
    got: list[tuple[int, int]] = []
    kept = None
    while not cursor.source_done:
        entry = entries.pop(0)
        step = cursor.place(entry)
        if step is Step.TAKE:
            got.append((entry.epoch, entry.index))
            cursor.deliver()
            cursor.taken(entry)
        elif step is Step.END_BEFORE:
            kept = entry
            break
        elif step is Step.END:
            break
    cursor.end()
    return got, kept


def test_aligned_epochs_are_the_producers_epochs():
    entries = stream(3, 4)
    cursor = EpochCursor(aligned=True, length=4)
    for e in range(3):
        got, kept = read_epoch(cursor, entries)
        assert got == [(e, i) for i in range(4)] and kept is None
        assert cursor.epoch == e + 1 and not cursor.in_epoch
        # The epoch ended at len(), before the end marker, which is the next entry.
        assert cursor.wants_end_marker()
        assert cursor.ends_finished_epoch(entries.pop(0))


def test_epoch_ends_at_len_before_the_end_marker_which_is_taken_lazily():
    """The last batch ends the epoch (no wait for the producer's marker); if the marker is
    not published yet it is noted unread (stats() leaves it out of the lag), and when it
    comes as the next epoch's first entry it is dropped there."""
    cursor = EpochCursor(aligned=True, length=3)
    entries = stream(2, 3)
    got, _ = read_epoch(cursor, entries[:3])
    assert got == [(0, 0), (0, 1), (0, 2)] and cursor.source_done
    assert cursor.wants_end_marker()
    cursor.marker_unpublished()  # the consumer found nothing published yet
    assert cursor.end_marker_unread
    cursor.begin()
    assert cursor.place(entries[3]) is Step.DROP  # epoch 0's marker, in the next epoch
    assert not cursor.end_marker_unread
    assert cursor.place(entries[4]) is Step.TAKE and cursor.producer_epoch == 1


def test_an_entry_of_the_next_epoch_taken_for_the_marker_is_kept():
    cursor = EpochCursor(aligned=True, length=2)
    read_epoch(cursor, stream(1, 2)[:2])
    assert not cursor.ends_finished_epoch(Entry(1, 0))  # not a marker: kept for epoch 1
    assert not cursor.after_end_marker
    assert cursor.ends_finished_epoch(Entry(0, 2, True))
    assert cursor.after_end_marker and not cursor.wants_end_marker()


def test_a_late_joiner_skips_to_the_next_epoch_start():
    entries = stream(2, 5)[2:]  # attached at batch 2 of epoch 0
    cursor = EpochCursor(aligned=True, length=5)
    cursor.begin()
    steps = [cursor.place(entries.pop(0)) for _ in range(3)]
    assert steps == [Step.SKIP, Step.SKIP, Step.SKIP]  # batches 2..4 of epoch 0
    assert cursor.place(entries.pop(0)) is Step.DROP  # epoch 0's marker
    assert cursor.want_epoch == 1 and cursor.fresh()
    got = []
    while not cursor.source_done:
        entry = entries.pop(0)
        assert cursor.place(entry) is Step.TAKE
        got.append(entry.index)
        cursor.taken(entry)
    assert got == list(range(5)) and cursor.want_epoch == 2


def test_a_joiner_at_an_epoch_start_reads_that_epoch():
    cursor = EpochCursor(aligned=True, length=3)
    got, _ = read_epoch(cursor, stream(1, 3, first_epoch=7))
    assert got == [(7, 0), (7, 1), (7, 2)]


def test_an_epoch_the_producer_cut_short_ends_at_its_marker_or_the_next_epoch():
    cursor = EpochCursor(aligned=True, length=5)
    # The producer's epoch 0 was cut short (break) after 2 batches: its marker ends ours.
    got, kept = read_epoch(cursor, [Entry(0, 0), Entry(0, 1), Entry(0, 2, True)])
    assert got == [(0, 0), (0, 1)] and kept is None and cursor.epoch == 1
    # No marker at all: the next epoch's first batch ends ours and is kept for the next.
    got, kept = read_epoch(cursor, [Entry(1, 0), Entry(2, 0)])
    assert got == [(1, 0)] and kept == Entry(2, 0)
    got, _ = read_epoch(cursor, [kept] + [Entry(2, i) for i in range(1, 5)])
    assert got == [(2, i) for i in range(5)]


def test_break_mid_epoch_leaves_it_and_the_next_epoch_is_whole():
    cursor = EpochCursor(aligned=True, length=4)
    entries = stream(2, 4)
    cursor.begin()
    for _ in range(2):
        entry = entries.pop(0)
        assert cursor.place(entry) is Step.TAKE
        cursor.deliver()
        cursor.taken(entry)
    assert cursor.abandon(cursor.epoch, holding=False) is Abandon.LEFT
    assert cursor.epoch == 1 and not cursor.in_epoch and cursor.want_epoch == 1
    assert cursor.abandon(0, holding=False) is Abandon.NOTHING  # an old iterator
    # Reading on from where it left: the rest of epoch 0 is skipped.
    cursor.begin()
    assert [cursor.place(entries.pop(0)) for _ in range(3)] == \
        [Step.SKIP, Step.SKIP, Step.DROP]
    assert cursor.place(entries.pop(0)) is Step.TAKE and cursor.producer_epoch == 1


def test_abandon_without_a_batch_or_after_the_last_one():
    cursor = EpochCursor(aligned=True, length=2)
    cursor.begin()
    assert cursor.abandon(0, holding=False) is Abandon.UNSTARTED
    assert cursor.epoch == 0 and not cursor.in_epoch
    cursor.begin()
    for entry in stream(1, 2)[:2]:
        cursor.place(entry)
        cursor.deliver()
        cursor.taken(entry)
    assert cursor.complete(holding=False) and not cursor.complete(holding=True)
    assert cursor.idle(holding=False) and not cursor.idle(holding=True)
    assert cursor.abandon(0, holding=False) is Abandon.COMPLETE  # a loop that took len()
    assert cursor.epoch == 1


def test_group_ranks_share_an_epoch():
    """Rank r takes batches r, r + W, ... of the first len // W * W; the rest go to no rank."""
    length, world = 7, 3
    for rank in range(world):
        cursor = EpochCursor(aligned=True, length=length, rank=rank, world_size=world)
        entries = stream(2, length)
        for e in range(2):
            got, _ = read_epoch(cursor, entries)
            assert got == [(e, i) for i in range(rank, 6, world)], rank
            assert cursor.group_batches() == 2
            while entries and entries[0].epoch == e:  # what the rank left: the rest
                assert cursor.place(entries[0]) in (Step.DROP, Step.SKIP)
                entries.pop(0)


def test_windowed_epochs_are_len_batches_from_where_the_consumer_started():
    cursor = EpochCursor(aligned=False, length=4)
    entries = stream(3, 4)[2:]  # started at batch 2 of epoch 0
    got, _ = read_epoch(cursor, entries)
    assert got == [(0, 2), (0, 3), (1, 0), (1, 1)]
    got, _ = read_epoch(cursor, entries)
    assert got == [(1, 2), (1, 3), (2, 0), (2, 1)]


def test_windowed_epoch_ends_with_a_producer_epoch_cut_short():
    """A windowed epoch that reaches the end marker of a producer epoch cut short (break
    in the producer's loop) ends there; the next ends at the producer's next marker."""
    cursor = EpochCursor(aligned=False, length=4)
    got, _ = read_epoch(cursor, [Entry(0, 0), Entry(0, 1), Entry(0, 2, True)])
    assert got == [(0, 0), (0, 1)] and cursor.epoch_end == (2, 0)
    got, _ = read_epoch(cursor, stream(1, 4, first_epoch=1))
    assert got == [(1, i) for i in range(4)] and cursor.epoch_end == (3, 0)


def test_producer_finishing_mid_window_ends_the_epoch_with_what_came():
    cursor = EpochCursor(aligned=False, length=4)
    cursor.begin()
    for entry in (Entry(0, 2), Entry(0, 3), Entry(0, 4, True)):
        if cursor.place(entry) is Step.TAKE:
            cursor.taken(entry)
    assert cursor.finished_between_windows() and cursor.source_done
    fresh = EpochCursor(aligned=False, length=4)
    fresh.begin()
    assert not fresh.finished_between_windows() and not fresh.in_epoch


def test_resume_skips_the_batches_taken_before():
    cursor = EpochCursor(aligned=True, length=4)
    cursor.resume(3, 2, exact=False)
    assert cursor.epoch == 3 and not cursor.in_epoch  # nothing of epoch 3 delivered yet
    cursor.begin()
    assert cursor.skip == 2  # the consumer drops that many batches, counted as delivered
    cursor.skip, cursor.delivered = 0, 2
    assert cursor.deliver() == 2 and (cursor.epoch, cursor.delivered) == (3, 3)


def test_resumed_epoch_reads_every_batch_to_the_end_of_the_next_producer_epoch():
    """An exact resume (the consumer keeps the samples not taken yet): alone, it takes
    every batch from where it is to the end of the producer epoch after this one (the
    samples it needs that came before it are somewhere in that one), counting from the
    batches delivered before; the epoch after it is a whole one."""
    cursor = EpochCursor(aligned=True, length=4)
    cursor.resume(0, 3, exact=True)
    got, _ = read_epoch(cursor, stream(3, 4)[2:])
    assert got == [(0, 2), (0, 3)] + [(1, i) for i in range(4)]
    assert cursor.delivered == 3 + 6 and cursor.epoch == 1
    assert not cursor.resuming and cursor.want_epoch == 2 and cursor.producer_epoch is None
    got, _ = read_epoch(cursor, stream(1, 4, first_epoch=2))
    assert got == [(2, i) for i in range(4)]


def test_resumed_group_epoch_reads_all_batches_of_one_producer_epoch():
    """In a group, a resumed epoch waits for a producer epoch start and takes every batch
    of it (the consumer deals the samples kept among the ranks), not every
    world_size-th."""
    cursor = EpochCursor(aligned=True, length=4, rank=1, world_size=2)
    cursor.resume(0, 1, exact=True)
    got, _ = read_epoch(cursor, stream(2, 4)[2:])
    assert got == [(1, i) for i in range(4)]


def test_attaching_again_after_an_epoch_cut_short_starts_a_whole_one():
    cursor = EpochCursor(aligned=True, length=4)
    cursor.begin()
    cursor.place(Entry(5, 0))
    cursor.taken(Entry(5, 0))
    assert cursor.rejoined() and cursor.source_done  # it had batches: it ends here
    cursor.attached_again()
    assert cursor.producer_epoch is None and cursor.want_epoch == 6


def test_an_entry_placed_or_taken_again_changes_nothing():
    """A KeyboardInterrupt after place() or taken() and before the consumer did what they
    said: the consumer does the entry's steps again, and the cursor answers as before
    without counting it twice (the last batch of the epoch too)."""
    entries = stream(2, 3)
    cursor = EpochCursor(aligned=True, length=3)
    cursor.begin()
    for entry in entries[:3]:
        assert cursor.place(entry) is Step.TAKE
        before = dict(vars(cursor))
        assert cursor.place(entry) is Step.TAKE and vars(cursor) == before
        cursor.taken(entry)
        after = dict(vars(cursor))
        cursor.taken(entry)
        assert cursor.place(entry) is Step.TAKE and vars(cursor) == after
    assert cursor.pulled == 3 and cursor.source_done
    # Once the epoch had its last batch, any other entry belongs to the next one.
    assert cursor.place(entries[4]) is Step.END_BEFORE and cursor.pulled == 3
    cursor.end()
    cursor.begin()
    assert cursor.place(entries[3]) is Step.DROP  # epoch 0's marker
    assert cursor.place(entries[4]) is Step.TAKE and cursor.producer_epoch == 1


def test_an_iterator_replaced_before_its_first_batch_keeps_the_entries_taken():
    """The first next() of an epoch took a batch and was interrupted before returning it;
    the loop makes a new iterator: the epoch goes on with that batch (it is not left, as
    one that delivered batches is, which would skip the rest of the producer's epoch)."""
    entries = stream(2, 3)
    cursor = EpochCursor(aligned=True, length=3)
    cursor.begin()
    assert cursor.place(entries[0]) is Step.TAKE
    assert cursor.abandon(0, holding=False) is Abandon.KEPT
    assert cursor.in_epoch and cursor.producer_epoch == 0 and cursor.pulled == 1
    assert cursor.place(entries[0]) is Step.TAKE  # the same entry, made again
    cursor.deliver()
    assert cursor.abandon(0, holding=False) is Abandon.LEFT  # it delivered one: left
