"""Where optimizers keep their step, and everything else a snapshot must carry exactly.

- Transformer Engine's and apex's `FusedAdam` keep ``step`` in ``param_groups[i]["step"]`` (an
  int) and, for fp16 states, TE keeps per-state scales in ``optimizer._scales[p][name]``:
  `GroupStepAdam` (tests/optimizers.py) does the same (with TE's update rule). Snapshot,
  restore into a fresh optimizer with no state, one more step on both: bitwise equal. Without
  the group step the restored optimizer restarts bias correction and the step differs (the
  control).
- torch `Adam` keeps ``state[p]["step"]`` as a 0-dim CPU tensor (on a GPU too): such scalars
  travel in the snapshot's host blob; same round trip, bitwise.
- A survivor rolls its own state back through its snapshotter (`Snapshotter.restore`, the
  layout worked out once): bitwise what `restore_into` gives, and the snapshotter captures on as
  a new one would; a snapshot of another layout is left to `restore_into`.
- Megatron's CUDA-graph-safe RNG tracker holds `torch.Generator` objects: captured through
  `Generator.get_state()` and restored into the same objects.
- The header a GPU capture assembles on the device equals the host encoding.
- `guard_optimizer_step` runs the replicator's wait before the optimizer's step.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from optimizers import Scheduler, Wrapped, make_optimizer, set_grads

from megatron_deadpool.errors import ConfigError
from megatron_deadpool.replication import snapshot
from megatron_deadpool.replication.replicator import guard_optimizer_step
from megatron_deadpool.replication.snapshot import (
    HEADER_BYTES,
    CorruptReplicaError,
    Header,
    RankState,
    Snapshotter,
    _DeviceHeader,
)


def _bits(tensors: list[torch.Tensor]) -> list[bytes]:
    return [
        t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() for t in tensors
    ]


def _round_trip(kind: str, drop_group_step: bool = False) -> tuple[RankState, RankState]:
    """Train 3 steps, snapshot, restore into a fresh optimizer, then one more step on both."""
    params, opt = make_optimizer(kind, seed=1)
    for step in range(3):
        set_grads(params, step)
        opt.step()
    source = RankState(Wrapped(opt), Scheduler())
    snap = Snapshotter(source, owner=0)
    flat = torch.zeros(snap.flat_nbytes(), dtype=torch.uint8)
    snap.capture(3, flat)
    fresh_params, fresh_opt = make_optimizer(kind, seed=2)  # other values, no state at all
    fresh = RankState(Wrapped(fresh_opt), Scheduler())
    Snapshotter.restore_into(fresh, flat, owner=0, iteration=3)
    assert _bits(fresh.state_tensors()) == _bits(source.state_tensors())
    if drop_group_step:
        for group in fresh_opt.param_groups:
            group.pop("step")
    for p, opt_, state in ((params, opt, source), (fresh_params, fresh_opt, fresh)):
        set_grads(p, 3)
        opt_.step()
    return source, fresh


@pytest.mark.parametrize("kind", ["fused", "fused-fp16", "torch-adam"])
def test_restore_into_a_fresh_optimizer_then_the_next_step_is_bitwise(kind: str) -> None:
    source, fresh = _round_trip(kind)
    assert _bits(fresh.state_tensors()) == _bits(source.state_tensors())
    a, b = source.optimizer.optimizer, fresh.optimizer.optimizer
    assert [g.get("step") for g in a.param_groups] == [g.get("step") for g in b.param_groups]


def _stepped(kind: str, steps: int, seed: int = 1) -> tuple[list[torch.Tensor], Any, RankState]:
    params, opt = make_optimizer(kind, seed=seed)
    state = RankState(Wrapped(opt), Scheduler())
    for step in range(steps):
        set_grads(params, step)
        opt.step()
        state.scheduler.num_steps += 1
    return params, opt, state


@pytest.mark.parametrize("kind", ["fused", "fused-fp16", "torch-adam"])
def test_a_snapshotter_rolls_its_own_state_back_as_restore_into_does(kind: str) -> None:
    """A survivor's rollback (`Snapshotter.restore`): the state, scheduler and RNG of the
    snapshot, bitwise as `restore_into` gives them; the next step and the next capture by
    the same snapshotter are those of a state restored anew and a new snapshotter."""
    params, opt, state = _stepped(kind, 3)
    snap = Snapshotter(state, owner=0)
    flat = torch.zeros(snap.flat_nbytes(), dtype=torch.uint8)
    snap.capture(3, flat)
    saved, draw = _bits(state.state_tensors()), torch.rand(3)
    for step in (3, 4):  # the survivor trained on, then failed
        set_grads(params, step)
        opt.step()
    state.scheduler.num_steps = 5
    torch.rand(10)
    assert _bits(state.state_tensors()) != saved

    assert snap.restore(flat, iteration=3)
    assert _bits(state.state_tensors()) == saved
    assert state.scheduler.num_steps == 3 and torch.equal(torch.rand(3), draw)
    control_params, _, control = _stepped(kind, 0, seed=2)
    Snapshotter.restore_into(control, flat, owner=0, iteration=3)
    for p, opt_ in ((params, opt), (control_params, control.optimizer.optimizer)):
        set_grads(p, 3)
        opt_.step()
    assert _bits(state.state_tensors()) == _bits(control.state_tensors())
    again, anew = (torch.zeros(snap.flat_nbytes(), dtype=torch.uint8) for _ in range(2))
    snap.capture(4, again)
    Snapshotter(control, owner=0).capture(4, anew)
    assert torch.equal(again, anew)


def test_a_snapshotter_leaves_a_snapshot_of_another_layout_to_restore_into() -> None:
    """Another manifest (here another optimizer's): nothing loaded, False; a corrupt snapshot
    of its own layout is refused as `restore_into` refuses it."""
    _, _, other = _stepped("fused", 1)
    source = Snapshotter(other, owner=0)
    flat = torch.zeros(source.flat_nbytes(), dtype=torch.uint8)
    source.capture(1, flat)
    _, _, state = _stepped("torch-adam", 2)
    snap, before = Snapshotter(state, owner=0), _bits(state.state_tensors())
    assert not snap.restore(flat, iteration=1)
    assert _bits(state.state_tensors()) == before
    own = torch.zeros(snap.flat_nbytes(), dtype=torch.uint8)
    snap.capture(2, own)
    own[3] ^= 1
    with pytest.raises(CorruptReplicaError):
        snap.restore(own, iteration=2)
    assert _bits(state.state_tensors()) == before


def test_the_group_step_matters_control() -> None:
    """Without `param_groups[i]["step"]` the restored FusedAdam restarts bias correction."""
    source, fresh = _round_trip("fused", drop_group_step=True)
    assert _bits(fresh.state_tensors()) != _bits(source.state_tensors())


def test_fused_adam_group_step_and_te_scales_are_in_the_snapshot() -> None:
    params, opt = make_optimizer("fused-fp16", seed=1)
    set_grads(params, 0)
    opt.step()
    state = RankState(Wrapped(opt), Scheduler())
    keys = {(entry[1], entry[2]) for entry in state.manifest()}
    assert {(0, "_scales/exp_avg"), (1, "_scales/exp_avg"), (0, "exp_avg")} <= keys
    assert state.small_state(1)["group_steps"] == [[0, 0, 1]]


def test_torch_adams_cpu_scalar_steps_travel_in_the_host_blob() -> None:
    params, opt = make_optimizer("torch-adam", seed=1)
    set_grads(params, 0)
    opt.step()
    steps = [opt.state[p]["step"] for p in params]
    assert all(s.dim() == 0 and s.device.type == "cpu" for s in steps)
    snap = Snapshotter(RankState(Wrapped(opt), Scheduler()), owner=0)
    start, stop = snap.blob.scalars
    assert stop - start == sum(s.element_size() for s in steps)
    assert all(t.dim() > 0 for t in snap.plan.tensors[:-1])  # the blob is the last tensor


def test_fp8_optimizer_states_are_refused_with_the_fix() -> None:
    class Float8Like(torch.Tensor):
        pass

    params, opt = make_optimizer("fused", seed=1)
    set_grads(params, 0)
    opt.step()
    opt.state[params[0]]["exp_avg"] = opt.state[params[0]]["exp_avg"].as_subclass(Float8Like)
    with pytest.raises(ConfigError, match="FP8 optimizer states .* use fp32, bf16 or fp16"):
        RankState(Wrapped(opt), Scheduler()).manifest()


def test_graph_safe_rng_tracker_generators_round_trip_in_place() -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    saved = tracker.get_states()
    gen = torch.Generator().manual_seed(1234)
    try:
        tracker.set_states({"model-parallel-rng": gen})
        params, opt = make_optimizer("fused", seed=1)
        set_grads(params, 0)
        opt.step()
        state = RankState(Wrapped(opt), Scheduler())
        snap = Snapshotter(state, owner=0)
        flat = torch.zeros(snap.flat_nbytes(), dtype=torch.uint8)
        snap.capture(1, flat)
        expected = torch.rand(4, generator=gen)  # what the next draw after the capture gives
        torch.rand(100, generator=gen)  # the generator moves on
        Snapshotter.restore_into(state, flat, owner=0, iteration=1)
        assert tracker.get_states()["model-parallel-rng"] is gen  # the same object, reset
        assert torch.equal(torch.rand(4, generator=gen), expected)
    finally:
        tracker.set_states(saved)


@pytest.mark.parametrize(
    "checksum", [0, 1, 0x7FFF_FFFF_FFFF_FFFF, 1 << 63, (1 << 64) - 1, 0xDEAD_BEEF_0123_4567]
)
def test_header_assembled_on_the_device_equals_the_host_encoding(checksum: int) -> None:
    header = Header(owner=5, iteration=123456, nbytes=1 << 34, checksum=0, meta_nbytes=8192)
    expected = Header(**{**header.__dict__, "checksum": checksum}).encode()
    slot = torch.tensor([snapshot._signed(checksum)], dtype=torch.int64)
    out = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    _DeviceHeader(torch.device("cpu")).write(header, slot, out)
    assert out.numpy().tobytes() == expected
    assert snapshot.read_header(torch.cat([torch.zeros(16, dtype=torch.uint8), out])) is not None


def test_the_optimizer_step_waits_for_the_capture_first() -> None:
    calls: list[str] = []

    class Replicator:
        def before_step(self) -> None:
            calls.append("wait for capture")

    params, opt = make_optimizer("fused", seed=1)
    real_step = opt.step

    def step() -> None:
        calls.append("step")
        real_step()

    opt.step = step  # type: ignore[method-assign]
    guard = guard_optimizer_step(opt)
    assert guard_optimizer_step(opt) is guard  # once per optimizer
    set_grads(params, 0)
    opt.step()
    assert calls == ["step"]  # no replicator yet
    guard.replicator = Replicator()  # type: ignore[assignment]
    opt.step()
    assert calls == ["step", "wait for capture", "step"]
    assert not math.isnan(float(params[0].sum()))
