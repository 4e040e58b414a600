"""Replication of real Megatron-Core optimizer shards, checked bit for bit on 4 processes.

Each layout (TP2xDP2 with two ranks per node, PP2xDP2 with one rank per node) runs once, in
one spawn of 4 gloo processes that build the embedded GPT job with `gpt.build` and drive a
`Replicator` exactly as the embedded job (`embedded/job.py`) does (step with `settle`, `commit`,
`start_round`). The children record what they observe (sha256 of every flat buffer, commit
results, restore checks) and return it as JSON; the tests below check those records:

- after every round, every holder's replica is bitwise equal to its owner's local snapshot of
  the same iteration, and verified;
- unpacking a rank's snapshot into its optimizer (NaN-filled first) restores every tensor of
  the live shard and the RNG state exactly;
- the committed iteration after step t is t-1; a bit flipped in transit blocks that round's
  commit on every rank, is reported, and the next round commits again;
- a bit flipped at rest makes `snapshot.verify` raise `CorruptReplicaError`.

Single-process tests cover the snapshot header and restore on a plain torch Adam.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any

import pytest
import torch
from mp import WorldError, run_world
from optimizers import Wrapped

from megatron_deadpool.replication import snapshot
from megatron_deadpool.replication.snapshot import (
    HEADER_BYTES,
    CorruptReplicaError,
    RankState,
    Snapshotter,
    read_header,
    verify,
)

ITERS = 7
FLIP_AT = 5  # the holder of rank 0 corrupts round FLIP_AT - 1 as it arrives
LAYOUTS = {
    "tp2xdp2": {"tp": 2, "pp": 1, "dp": 2, "ranks_per_node": 2},
    "pp2xdp2": {"tp": 1, "pp": 2, "dp": 2, "ranks_per_node": 1},
}


def _sha(buf: torch.Tensor) -> str:
    return hashlib.sha256(buf.contiguous().cpu().numpy().tobytes()).hexdigest()


# ---------------------------------------------------------------------- child side
def _replication_rank(
    *,
    rank: int,
    world_size: int,
    store: Any,
    tp: int,
    pp: int,
    dp: int,
    ranks_per_node: int,
    iters: int,
    flip_at: int,
) -> dict[str, Any]:
    """One rank: train `iters` steps with replication, recording what the tests check."""
    import datetime

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_deadpool.config.deadpool import DeadpoolConfig
    from megatron_deadpool.config.job import JobConfig, ParallelConfig, TrainConfig
    from megatron_deadpool.devices.base import Device
    from megatron_deadpool.devices.memory import ReplicaMemory
    from megatron_deadpool.embedded import gpt
    from megatron_deadpool.replication.placement import Layout, place_replicas
    from megatron_deadpool.replication.replicator import Replicator

    job = JobConfig(
        parallel=ParallelConfig(tp=tp, pp=pp, dp=dp),
        train=TrainConfig(iters=iters),
        deadpool=DeadpoolConfig(enabled=True, ranks_per_node=ranks_per_node),
    )
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    layout = Layout(tp=tp, pp=pp, dp=dp, ranks_per_node=ranks_per_node)
    placement = place_replicas(layout, 1)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=120))
    objs = gpt.build(job)
    out: dict[str, Any] = {
        "rank": rank,
        "megatron_dp_group": dist.get_process_group_ranks(ps.get_data_parallel_group()),
        "layout_dp_group": layout.dp_group_of[rank],
        "holders": list(placement.holders[rank]),
        "owners": list(placement.held_by[rank]),
        "committed": {},
        "rounds": {},
        "restore": {},
        "kept": {},
        "losses": [],
    }
    flipper = placement.holders[0][0]
    state = RankState(objs.optimizer, objs.scheduler)
    repl: Replicator | None = None

    def record_round(repl: Replicator, r: int) -> None:
        """Round r is finished and not yet overwritten: hash the buffers that hold it."""

        def entry(buf: torch.Tensor | None) -> dict[str, Any]:
            return {"sha": None if buf is None else _sha(buf), "verified": buf is not None}

        out["rounds"][str(r)] = {
            "local": entry(repl.local.find(r)),
            "held": {str(o): entry(pair.find(r)) for o, pair in repl.held.items()},
        }

    for it in range(1, iters + 1):
        if repl is not None:
            repl.before_step()
            if it == flip_at and rank == flipper:
                repl.flip_bit_on_arrival(0, byte=repl.sizes[0] // 3, bit=5)
        step = gpt.train_step(job, objs, it, settle=repl.settle if repl else None)
        out["losses"].append(step.loss)
        if repl is None:
            memory = ReplicaMemory("cpu", Device(kind="cpu", backend="gloo"))
            repl = Replicator(Snapshotter(state, rank), placement, rank, group, memory)
        committed = repl.commit(step.replicas_ok)
        out["committed"][str(it)] = committed
        if it > 1:
            record_round(repl, it - 1)
        if it == flip_at and rank == flipper:
            latest = repl.held[0].latest()
            out["latest_after_corrupt"] = latest[0] if latest else None
        repl.start_round(it)
        out["kept"][str(it)] = {
            "committed": committed,
            "local": committed is None or repl.local.find(committed) is not None,
            "held": {
                str(o): committed is None or pair.find(committed) is not None
                for o, pair in repl.held.items()
            },
        }
        out["restore"][str(it)] = _restore_check(state, repl, rank, it)
    repl.drain()
    out["final_committed"] = repl.committed
    record_round(repl, iters)
    out["corrupt_seen"] = [[o, i, msg] for o, i, msg in repl.corrupt_seen]
    out["at_rest"] = {}
    for owner in repl.owners:  # flip one bit of each held replica at rest: verify must fail
        repl.flip_bit_at_rest(owner, byte=repl.sizes[owner] // 2, bit=3)
        latest = repl.held[owner].latest()
        try:
            verify(latest[1], owner=owner, iteration=latest[0])
            out["at_rest"][str(owner)] = None
        except CorruptReplicaError as exc:
            out["at_rest"][str(owner)] = str(exc)
    return out


def _restore_check(state: RankState, repl: Any, rank: int, it: int) -> dict[str, Any]:
    """Restore snapshot `it` over a NaN-filled live shard: every tensor must come back."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    live = state.state_tensors()
    saved = [t.detach().clone() for t in live]
    rng_saved = [t.clone() for t in snapshot.rng_tensors()]
    sched_saved = dict(state.scheduler.state_dict())
    for t in live:
        t.fill_(math.nan if t.is_floating_point() else -1)
    torch.rand(7)  # move both RNG streams on
    with get_cuda_rng_tracker().fork():
        torch.rand(7)
    flat = repl.local.find(it)
    assert flat is not None, f"rank {rank} has no verified local snapshot of iteration {it}"
    meta = Snapshotter.restore_into(state, flat, owner=rank, iteration=it)
    after = state.state_tensors()
    result = {
        "n_tensors": len(saved),
        "same_count": len(after) == len(saved),
        "tensors_equal": len(after) == len(saved)
        and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(after, saved)),
        "rng_equal": all(torch.equal(a, b) for a, b in zip(snapshot.rng_tensors(), rng_saved)),
        "meta_iteration": meta["iteration"],
        "manifest_equal": meta["manifest"] == state.manifest(),
        "num_steps_saved": sched_saved["num_steps"],
        "num_steps_restored": state.scheduler.state_dict()["num_steps"],
    }
    return result


# ---------------------------------------------------------------------- parent side
@pytest.fixture(scope="module", params=list(LAYOUTS))
def world(request: pytest.FixtureRequest) -> dict[str, Any]:
    """One 4-process run per layout, shared by the tests of that layout."""
    layout = LAYOUTS[request.param]
    results = run_world(
        "test_replication:_replication_rank",
        4,
        kwargs={**layout, "iters": ITERS, "flip_at": FLIP_AT},
        timeout=200,
    )
    return {"layout": layout, "ranks": results}


@pytest.mark.timeout(260)
def test_holders_are_megatron_dp_peers_on_other_nodes(world: dict[str, Any]) -> None:
    rpn = world["layout"]["ranks_per_node"]
    for res in world["ranks"]:
        r = res["rank"]
        assert sorted(res["layout_dp_group"]) == sorted(res["megatron_dp_group"])
        assert len(res["holders"]) == 1 and len(res["owners"]) == 1
        for h in res["holders"]:
            assert h in res["megatron_dp_group"] and h != r
            assert h // rpn != r // rpn, f"rank {r}'s replica is on its own node"


@pytest.mark.timeout(260)
def test_every_replica_is_bitwise_its_owners_snapshot(world: dict[str, Any]) -> None:
    ranks = world["ranks"]
    flipper = ranks[0]["holders"][0]
    for r in range(1, ITERS + 1):
        for owner in ranks:
            mine = owner["rounds"][str(r)]["local"]
            assert mine["verified"], f"rank {owner['rank']} lost its snapshot {r}"
            for h in owner["holders"]:
                held = ranks[h]["rounds"][str(r)]["held"][str(owner["rank"])]
                if owner["rank"] == 0 and h == flipper and r == FLIP_AT - 1:
                    assert not held["verified"], "a replica corrupted in transit was verified"
                    continue
                assert held["verified"], f"iteration {r}: replica at {h} not verified"
                assert (
                    held["sha"] == mine["sha"]
                ), f"iteration {r}: holder {h}'s replica of rank {owner['rank']} differs"
    # Different iterations really are different snapshots.
    assert ranks[0]["rounds"]["1"]["local"]["sha"] != ranks[0]["rounds"]["2"]["local"]["sha"]


@pytest.mark.timeout(260)
def test_snapshot_restores_live_optimizer_state_exactly(world: dict[str, Any]) -> None:
    for res in world["ranks"]:
        for it in range(1, ITERS + 1):
            check = res["restore"][str(it)]
            where = f"rank {res['rank']} iteration {it}"
            assert check["n_tensors"] >= 3, where  # main-param shard + exp_avg + exp_avg_sq
            assert check["same_count"] and check["tensors_equal"], where
            assert check["rng_equal"], where
            assert check["meta_iteration"] == it and check["manifest_equal"], where
            assert check["num_steps_restored"] == check["num_steps_saved"] == it, where


@pytest.mark.timeout(260)
def test_commit_advances_and_a_corrupt_round_is_not_committed(world: dict[str, Any]) -> None:
    ranks = world["ranks"]
    flipper = ranks[0]["holders"][0]
    expected = {1: None}
    expected.update({it: it - 1 for it in range(2, ITERS + 1)})
    expected[FLIP_AT] = FLIP_AT - 2  # round FLIP_AT-1 arrived corrupt at one holder
    for res in ranks:
        got = {int(k): v for k, v in res["committed"].items()}
        assert got == expected, f"rank {res['rank']}"
        assert res["final_committed"] == ITERS
        if res["rank"] == flipper:
            assert len(res["corrupt_seen"]) == 1
            owner, iteration, message = res["corrupt_seen"][0]
            assert (owner, iteration) == (0, FLIP_AT - 1)
            assert "checksum mismatch" in message and "rank 0" in message
            # Double buffer: the previous verified replica is still there.
            assert res["latest_after_corrupt"] == FLIP_AT - 2
        else:
            assert res["corrupt_seen"] == []
    # Losses are one all-reduced value: identical on every rank, and they fall.
    losses = ranks[0]["losses"]
    assert all(res["losses"] == losses for res in ranks)
    assert losses[-1] < losses[0]


@pytest.mark.timeout(260)
def test_committed_copies_exist_while_next_round_is_in_flight(world: dict[str, Any]) -> None:
    """While round t is in flight, owner and holders still hold the committed iteration."""
    for res in world["ranks"]:
        for it in range(1, FLIP_AT):
            kept = res["kept"][str(it)]
            assert kept["local"] and all(kept["held"].values()), f"rank {res['rank']} it {it}"


@pytest.mark.timeout(260)
def test_committed_copies_survive_a_corrupt_round(world: dict[str, Any]) -> None:
    for res in world["ranks"]:
        for it in range(1, ITERS + 1):
            kept = res["kept"][str(it)]
            where = f"rank {res['rank']} iteration {it} (committed {kept['committed']})"
            assert kept["local"], f"{where}: local snapshot of the committed iteration gone"
            assert all(kept["held"].values()), f"{where}: committed replica gone"


@pytest.mark.timeout(260)
def test_bit_flip_at_rest_is_detected(world: dict[str, Any]) -> None:
    for res in world["ranks"]:
        for owner, message in res["at_rest"].items():
            assert message is not None, f"flip in rank {owner}'s replica at {res['rank']} missed"
            assert "checksum mismatch" in message and f"rank {owner}" in message


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_harness_reports_failures_and_kills_every_child(mode: str) -> None:
    # The hang's limit also covers start-up (importing torch, joining the group): on a loaded
    # machine a child may still be starting when it passes, and must be killed all the same.
    expected = "boom from rank 1" if mode == "raise" else "timed out after 25s"
    with pytest.raises(WorldError, match=expected) as failed:
        run_world(
            "test_replication:_misbehave",
            2,
            kwargs={"mode": mode},
            timeout=60 if mode == "raise" else 25,
            keep_logs_on_failure=False,
        )
    pids = failed.value.pids
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _misbehave(*, rank: int, world_size: int, store: Any, mode: str) -> dict:
    import time

    import torch.distributed as dist

    assert dist.get_world_size() == world_size == 2
    dist.barrier()  # both ranks started
    if rank == 1:
        if mode == "raise":
            raise ValueError("boom from rank 1")
        time.sleep(3600)
    dist.barrier()  # rank 0 blocks on its peer
    return {"rank": rank}


# ---------------------------------------------------------------------- single process
class _Router(torch.nn.Module):
    """A model chunk with the MoE router's buffers: one a step changes, one a counter."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.register_buffer("expert_bias", torch.zeros(4, dtype=dtype))
        self.register_buffer("tokens", torch.zeros(4, dtype=dtype), persistent=False)
        self.register_buffer("ga_steps", torch.tensor(0.0), persistent=False)  # a host scalar


def _toy_state(seed: int = 0, steps: int = 2, model: tuple = ()) -> RankState:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gen = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(5, 3, generator=gen)),
        torch.nn.Parameter(torch.randn(7, generator=gen)),
    ]
    adam = torch.optim.Adam(params, lr=1e-2)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        adam.step()
    opt = Wrapped(adam)
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1e-2,
        min_lr=1e-3,
        lr_warmup_steps=2,
        lr_decay_steps=10,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=10,
        wd_incr_style="constant",
    )
    sched.step(increment=steps)
    return RankState(opt, sched, model)


def _captured(state: RankState, owner: int = 3, iteration: int = 7) -> torch.Tensor:
    snap = Snapshotter(state, owner)
    flat = torch.zeros(snap.flat_nbytes(), dtype=torch.uint8)
    snap.capture(iteration, flat)
    return flat


@pytest.mark.timeout(60)
def test_snapshot_header_round_trip_and_verify() -> None:
    state = _toy_state()
    flat = _captured(state, owner=3, iteration=7)
    header = read_header(flat)
    assert header is not None
    assert (header.owner, header.iteration) == (3, 7)
    assert header.nbytes + HEADER_BYTES == flat.numel()
    assert 0 < header.meta_nbytes <= header.nbytes
    assert verify(flat, owner=3, iteration=7) == header
    assert read_header(torch.zeros_like(flat)) is None
    with pytest.raises(CorruptReplicaError, match="expected 2"):
        verify(flat, owner=2)
    with pytest.raises(CorruptReplicaError, match="expected 8"):
        verify(flat, iteration=8)
    with pytest.raises(CorruptReplicaError, match="bad magic"):
        verify(torch.zeros_like(flat))
    # Any single bit of the packed region (tensors, RNG, metadata) is covered by the checksum.
    for byte in (0, 1, header.nbytes // 2, header.nbytes - header.meta_nbytes, header.nbytes - 1):
        for bit in (0, 7):
            bad = flat.clone()
            bad[byte] ^= 1 << bit
            with pytest.raises(CorruptReplicaError, match="checksum mismatch"):
                verify(bad, owner=3, iteration=7)


@pytest.mark.timeout(60)
def test_verify_detects_bit_flips_in_header_fields_restore_reads() -> None:
    flat = _captured(_toy_state())
    start = flat.numel() - HEADER_BYTES
    missed = []
    names = ["magic", "owner", "iteration", "nbytes", "checksum", "meta", "check word"]
    for word, name in enumerate(names):
        for bit in (0, 4, 8, 13, 31, 62, 63):
            bad = flat.clone()
            bad[start + 8 * word + bit // 8] ^= 1 << (bit % 8)
            try:
                verify(bad, owner=3, iteration=7)
                missed.append(f"{name} bit {bit}: passed")
            except CorruptReplicaError:
                pass
            except Exception as exc:  # noqa: BLE001 - anything else is a miss too
                missed.append(f"{name} bit {bit}: {type(exc).__name__}")
    assert not missed, missed


@pytest.mark.timeout(60)
def test_restore_into_a_fresh_optimizer_reproduces_the_shard() -> None:
    """A newcomer's optimizer has no state yet: the manifest creates it, then bytes fill it."""
    source = _toy_state(seed=1, steps=3)
    flat = _captured(source, owner=0, iteration=3)
    rng_before = [t.clone() for t in snapshot.rng_tensors()]
    fresh = _toy_state(seed=2, steps=0)  # other values, no Adam state, a fresh scheduler
    torch.rand(3)
    meta = Snapshotter.restore_into(fresh, flat, owner=0, iteration=3)
    assert meta["iteration"] == 3
    a, b = source.state_tensors(), fresh.state_tensors()
    assert len(a) == len(b) == 2 * 4  # per param: the param + exp_avg, exp_avg_sq, step
    assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))
    assert fresh.scheduler.state_dict() == source.scheduler.state_dict()
    assert fresh.optimizer.param_groups[0]["lr"] == source.optimizer.param_groups[0]["lr"]
    assert all(torch.equal(x, y) for x, y in zip(snapshot.rng_tensors(), rng_before))


@pytest.mark.timeout(60)
def test_restore_into_live_scheduler_keeps_num_steps() -> None:
    """A survivor rolling back restores into its own, already stepped, scheduler."""
    state = _toy_state(steps=3)
    flat = _captured(state, owner=0, iteration=3)
    expected = dict(state.scheduler.state_dict())
    lr = state.optimizer.param_groups[0]["lr"]
    state.scheduler.step(increment=1)  # the survivor went one step past the snapshot
    Snapshotter.restore_into(state, flat, owner=0, iteration=3)
    assert state.scheduler.state_dict() == expected
    assert state.optimizer.param_groups[0]["lr"] == lr


@pytest.mark.timeout(60)
def test_model_buffers_travel_with_the_shard_and_into_the_digest() -> None:
    """Buffers a step changes outside the optimizer (the MoE router's expert bias, its token
    counter) are captured and restored - a survivor's in place, a newcomer's (whose bias
    Megatron has not turned to float32 yet under --bf16) in the replica's dtype - and are part
    of the final digest."""
    from megatron_deadpool.digest import rank_digest

    router = _Router()
    router.expert_bias.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
    router.ga_steps.fill_(3.0)
    state = _toy_state(seed=1, steps=3, model=(router,))
    assert [e[:3] for e in state.manifest() if e[0] == snapshot.BUFFER] == [
        ["buffer", 0, "expert_bias"], ["buffer", 0, "tokens"], ["buffer", 0, "ga_steps"]
    ]  # fmt: skip
    flat = _captured(state, owner=0, iteration=3)
    digest = rank_digest([router])
    expected = {n: b.clone() for n, b in router.named_buffers()}

    router.expert_bias.add_(1.0)  # the survivor went on: a step past the snapshot
    router.tokens.add_(5.0)  # and a forward pass of a step cut short
    router.ga_steps.add_(1.0)
    assert rank_digest([router]) != digest
    Snapshotter.restore_into(state, flat, owner=0, iteration=3)
    assert all(torch.equal(b, expected[n]) for n, b in router.named_buffers())
    assert rank_digest([router]) == digest

    newcomer = _Router(torch.bfloat16)
    Snapshotter.restore_into(_toy_state(seed=2, steps=0, model=(newcomer,)), flat, owner=0,
                             iteration=3)  # fmt: skip
    assert newcomer.expert_bias.dtype == torch.float32
    assert all(torch.equal(b, expected[n]) for n, b in newcomer.named_buffers())
    assert rank_digest([newcomer]) == digest

    other = torch.nn.Module()
    other.register_buffer("expert_bias", torch.zeros(5))
    with pytest.raises(CorruptReplicaError, match="the models differ"):
        Snapshotter.restore_into(_toy_state(model=(other,)), flat, owner=0, iteration=3)
