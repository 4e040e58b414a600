"""What FP16 training changes that a snapshot must carry: Megatron's loss scaler, and the
optimizer state of a run whose first steps were skipped for overflow.

- Megatron's `DynamicGradScaler` (its own class, built on the CPU) changes ``_scale``,
  ``_growth_tracker`` and ``_hysteresis_tracker`` after every step: captured with the snapshot,
  a rollback (the same scaler, moved on) and a newcomer (a fresh scaler) get them back exactly,
  one scaler per inner optimizer of a chained optimizer, and the next updates agree.
- A skipped first step leaves torch Adam without state when the snapshot layout is fixed: the
  layout must hold the state the first real step creates (created up front, as that step would),
  and creating it up front must not change that step by a bit.
- An optimizer whose lazily created state DeadPool cannot create up front (torch SGD with
  momentum) is refused at the capture that would miss it, not silently rolled back wrong.
"""

from __future__ import annotations

import pytest
import torch
from optimizers import Chained, Scheduler, Wrapped, dynamic_grad_scaler, make_params, set_grads

from megatron_deadpool.errors import ConfigError
from megatron_deadpool.replication.snapshot import (
    CorruptReplicaError,
    RankState,
    Snapshotter,
)


def _scaler_state(scaler) -> tuple[bytes, int, int]:
    return (scaler._scale.numpy().tobytes(), scaler._growth_tracker, scaler._hysteresis_tracker)


def _capture(state: RankState, iteration: int) -> torch.Tensor:
    snap = Snapshotter(state, owner=0)
    flat = torch.zeros(snap.flat_nbytes(), dtype=torch.uint8)
    snap.capture(iteration, flat)
    return flat


def _adam(seed: int) -> torch.optim.Adam:
    return torch.optim.Adam(make_params(seed), lr=1e-2)


def test_the_loss_scalers_are_restored_on_rollback_and_on_a_newcomer() -> None:
    """Two inner optimizers, each with its own scaler in another state (backing off after two
    overflows; growing after a clean window), captured, moved on, restored: exactly as captured;
    then both follow the same updates."""
    scalers = [dynamic_grad_scaler(), dynamic_grad_scaler(2.0**16)]
    for found_inf in (True, True, True):  # hysteresis 2: the 2nd and 3rd overflow back off
        scalers[0].update(found_inf)
    for found_inf in (False, False, False):  # window 2: grows once, one clean step counted
        scalers[1].update(found_inf)
    opts = Chained(*(Wrapped(_adam(i), scaler) for i, scaler in enumerate(scalers)))
    captured = [_scaler_state(s) for s in scalers]
    assert captured[0][0] == torch.tensor([2.0**18]).numpy().tobytes() and captured[0][2] == -1
    assert captured[1][0] == torch.tensor([2.0**17]).numpy().tobytes() and captured[1][1] == 1
    flat = _capture(RankState(opts, Scheduler()), iteration=3)

    for scaler in scalers:  # a survivor's scalers move on past the snapshot
        for found_inf in (False, True, False, False, False):
            scaler.update(found_inf)
    assert [_scaler_state(s) for s in scalers] != captured
    Snapshotter.restore_into(RankState(opts, Scheduler()), flat, owner=0, iteration=3)
    assert [_scaler_state(s) for s in scalers] == captured

    fresh = [dynamic_grad_scaler(), dynamic_grad_scaler()]  # a newcomer's, at their start
    newcomer = Chained(*(Wrapped(_adam(i + 5), scaler) for i, scaler in enumerate(fresh)))
    Snapshotter.restore_into(RankState(newcomer, Scheduler()), flat, owner=0, iteration=3)
    assert [_scaler_state(s) for s in fresh] == captured
    for found_inf in (False, False, True, True, False):
        for scaler in (*scalers, *fresh):
            scaler.update(found_inf)
    assert [_scaler_state(s) for s in fresh] == [_scaler_state(s) for s in scalers]


def test_a_scaler_the_rank_does_not_have_is_refused() -> None:
    flat = _capture(RankState(Wrapped(_adam(1), dynamic_grad_scaler()), Scheduler()), 1)
    with pytest.raises(CorruptReplicaError, match="loss scaler for optimizer 0"):
        Snapshotter.restore_into(RankState(Wrapped(_adam(2)), Scheduler()), flat, owner=0,
                                 iteration=1)  # fmt: skip


def test_adam_state_of_skipped_first_steps_is_in_the_layout_and_changes_no_bit() -> None:
    """The snapshot is taken after step 1, which overflowed (no inner step): the state Adam's
    first real step creates is in the layout already; that step, from state created up front,
    equals the step of an Adam that created its own; a rollback after it is exact."""
    params = make_params(1)
    opt = torch.optim.Adam(params, lr=1e-2)
    state = RankState(Wrapped(opt), Scheduler())
    snap = Snapshotter(state, owner=0)  # after the skipped step 1: no state yet
    keys = {(entry[1], entry[2]) for entry in snap.manifest}
    assert {(0, "exp_avg"), (0, "exp_avg_sq"), (0, "step"), (1, "exp_avg")} <= keys

    reference = make_params(1)
    ref_opt = torch.optim.Adam(reference, lr=1e-2)
    for step in (1, 2):
        set_grads(params, step)
        set_grads(reference, step)
        opt.step()
        ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, reference))
    for p, q in zip(params, reference):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], ref_opt.state[q][key])

    flat = torch.zeros(snap.flat_nbytes(), dtype=torch.uint8)
    snap.capture(3, flat)  # the layout fixed at step 1 holds the state of step 3
    saved = [t.clone() for t in state.state_tensors()]
    set_grads(params, 3)
    opt.step()
    Snapshotter.restore_into(state, flat, owner=0, iteration=3)
    assert all(torch.equal(a, b) for a, b in zip(state.state_tensors(), saved))


def test_state_that_appears_after_the_layout_is_refused_at_capture() -> None:
    """torch SGD creates its momentum buffer from the first gradient (not as zeros): DeadPool
    does not create it up front, and refuses the capture that would miss it."""
    params = make_params(1)
    opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    snap = Snapshotter(RankState(Wrapped(opt), Scheduler()), owner=0)
    flat = torch.zeros(snap.flat_nbytes(), dtype=torch.uint8)
    snap.capture(1, flat)  # still no state: fine
    set_grads(params, 1)
    opt.step()
    with pytest.raises(ConfigError, match="SGD created optimizer state after DeadPool fixed"):
        snap.capture(2, flat)
