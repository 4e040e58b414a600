"""Replaying the batches of recomputed steps under Megatron's data iterator (replay.py)."""

from __future__ import annotations

import pytest

from megatron_deadpool.megatron_lm.replay import BatchRecorder, ReplayError


def test_batch_recorder_replays_the_steps_after_the_restore_iteration() -> None:
    rec = BatchRecorder(iter(range(100)))
    got = []
    for step, take in ((1, 2), (2, 2), (3, 2), (4, 1)):  # step 4 fails after one batch
        rec.begin_step(step)
        got += [next(rec) for _ in range(take)]
    assert got == [0, 1, 2, 3, 4, 5, 6]
    assert rec.rewind_to(2) == 3  # step 3's two batches and step 4's one
    rec.begin_step(3)
    assert [next(rec), next(rec)] == [4, 5]
    rec.begin_step(4)
    assert [next(rec), next(rec)] == [6, 7]  # replayed, then read on
    with pytest.raises(ReplayError, match="not kept"):
        rec.rewind_to(0)  # step 1's batches are no longer kept


def test_a_batch_the_consumer_edits_is_replayed_as_it_was_read() -> None:
    """core_v0.19.0's `get_batch` replaces the entries of the dict it is given (moved to the
    device, cut to this rank's share of the sequence with context parallelism): a replayed
    batch is the one the source gave, however often it was replayed and edited."""
    source = iter([{"tokens": [0, 1, 2, 3]}, {"tokens": [4, 5, 6, 7]}])
    rec = BatchRecorder(source)

    def consume() -> list[int]:
        batch = next(rec)
        batch["tokens"] = batch["tokens"][:2]  # as get_batch_on_this_cp_rank does
        return batch["tokens"]

    rec.begin_step(1)
    assert consume() == [0, 1]
    for _ in range(2):  # rolled back twice to iteration 0: the same batch each time
        assert rec.rewind_to(0) == 1
        rec.begin_step(1)
        batch = next(rec)
        assert batch == {"tokens": [0, 1, 2, 3]}
        batch["tokens"] = batch["tokens"][:2]


def test_recorder_goes_under_megatrons_rerun_iterator() -> None:
    from megatron.core.rerun_state_machine import RerunDataIterator

    from megatron_deadpool.megatron_lm.replay import install_recorder

    it = RerunDataIterator(iter(range(5)))
    (rec,) = install_recorder(it)
    assert it.iterable is rec and install_recorder(it) == [rec]
    assert install_recorder(None) == []
    with pytest.raises(ReplayError, match="RerunDataIterator"):
        install_recorder(iter(range(3)))
