"""`snapshot.load_snapshot`: which snapshotter loads a recovery's restore.

A survivor rolling back to its own snapshot loads it through its replicator's snapshotter
(`Snapshotter.restore`), which the next replicator then keeps instead of walking the state again;
so does a newcomer through the snapshotter it built before the agreement, whose layout its
optimizer's lazily created state predicts. Another rank's snapshot, another state, or a layout
the prediction missed goes through `restore_into`. Real optimizers (tests/optimizers.py), no
process group.
"""

from __future__ import annotations

import pytest
import torch
from optimizers import Scheduler, Wrapped, make_optimizer, set_grads

from megatron_deadpool.replication import snapshot
from megatron_deadpool.replication.snapshot import RankState, Snapshotter, load_snapshot


def _state(seed: int, steps: int) -> RankState:
    params, opt = make_optimizer("torch-adam", seed=seed)
    for step in range(steps):
        set_grads(params, step)
        opt.step()
    return RankState(Wrapped(opt), Scheduler())


def _captured(snap: Snapshotter, iteration: int) -> torch.Tensor:
    flat = torch.zeros(snap.flat_nbytes(), dtype=torch.uint8)
    snap.capture(iteration, flat)
    return flat


def _bits(state: RankState) -> list[bytes]:
    return [t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in state.state_tensors()]


def test_the_replicators_snapshotter_loads_its_own_rank_and_state_and_is_kept() -> None:
    state = _state(seed=1, steps=2)
    snap = Snapshotter(state, owner=1)
    flat = _captured(snap, 2)
    view = RankState(state.optimizer, state.scheduler)  # `job.rank_state()`: a new view
    assert load_snapshot(snap, view, flat, owner=1, iteration=2) is snap
    assert load_snapshot(None, view, flat, owner=1, iteration=2) is None


def test_another_rank_or_state_goes_through_restore_into() -> None:
    state = _state(seed=1, steps=2)
    snap = Snapshotter(state, owner=1)
    flat = _captured(snap, 2)
    fresh = _state(seed=3, steps=0)  # a newcomer's optimizer: no state yet
    assert load_snapshot(snap, fresh, flat, owner=1, iteration=2) is None
    assert _bits(fresh) == _bits(state)
    other = _captured(Snapshotter(state, owner=0), 2)
    assert load_snapshot(snap, state, other, owner=0, iteration=2) is None


def test_a_newcomers_snapshotter_built_before_its_restore_loads_the_holders_copy() -> None:
    """A newcomer's optimizer has no state: its snapshotter creates what the first step would
    (`lazy_state`), which is the layout of the dead rank's snapshot - loaded through it,
    bitwise; a state the prediction misses (here: another optimizer) is left to
    `restore_into`."""
    state = _state(seed=1, steps=2)
    flat = _captured(Snapshotter(state, owner=1), 2)
    newcomer = _state(seed=3, steps=0)
    ahead = Snapshotter(newcomer, owner=1)
    assert load_snapshot(ahead, newcomer, flat, owner=1, iteration=2) is ahead
    assert _bits(newcomer) == _bits(state)
    _, opt = make_optimizer("fused", seed=3)
    other = RankState(Wrapped(opt), Scheduler())
    assert load_snapshot(Snapshotter(other, owner=1), other, flat, owner=1, iteration=2) is None


def test_a_snapshot_the_snapshotter_declines_is_verified_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checksum of a whole shard (GBs on a GPU) is taken once per restore, also when the
    kept snapshotter declines the layout and the state is walked instead."""
    state = _state(seed=1, steps=2)
    flat = _captured(Snapshotter(state, owner=1), 2)
    _, opt = make_optimizer("fused", seed=3)
    other = RankState(Wrapped(opt), Scheduler())
    declined = Snapshotter(other, owner=1)
    calls = []
    real = snapshot.verify
    monkeypatch.setattr(snapshot, "verify", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert load_snapshot(declined, other, flat, owner=1, iteration=2) is None
    assert load_snapshot(Snapshotter(state, owner=1), state, flat, owner=1, iteration=2)
    assert len(calls) == 2
