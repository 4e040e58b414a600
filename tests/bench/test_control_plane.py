"""`deadpool bench control-plane`: its simulated ranks do to the store what real ranks do, and
the bench runs end to end (at a small size) against the real coordinator."""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import pytest
from procs import wait_until
from stores import SEAL, Recording

from megatron_deadpool.bench.scale import control_plane
from megatron_deadpool.bench.scale.sim_ranks import FOREVER_S, survivor_report
from megatron_deadpool.hotswap.protocol.membership import Membership, host_store
from megatron_deadpool.hotswap.protocol.messages import Decision, Plan, Roster


def _survivor_ops(survive) -> list[tuple[str, Any]]:
    """The store operations of rank 1's survivor side while the coordinator plans generation 1
    (rank 2 died) and decides it."""
    store = host_store("127.0.0.1", 0)
    coordinator = Membership(store, "coordinator", SEAL)
    recording = Recording(store.clone())
    survivor = threading.Thread(target=survive, args=(Membership(recording, "a1", SEAL),))
    survivor.start()

    # The survivor reports, then blocks on the decision, before the plan exists.
    def waiting() -> bool:
        return any(op == "wait" for op, _ in recording.ops)

    wait_until(lambda: waiting() or not survivor.is_alive(), 60, "the survivor's wait")
    assert waiting(), recording.ops
    plan = Plan(generation=1, base=0, world_size=3, dead=(2,), needy=(2,), replaced={2: "s0"})
    coordinator.publish_plan(plan)
    wait_until(lambda: coordinator.holdings_count(1) >= 1, 60, "the survivor's report")
    coordinator.decide(1, Decision.roster(6))
    coordinator.claim_slot(1, 2)  # as the newcomer of rank 2 does before it joins
    survivor.join(30)
    assert not survivor.is_alive()
    return recording.ops


@pytest.mark.timeout(240)  # importing recovery imports megatron-core: slow on a busy machine
def test_simulated_survivor_makes_the_store_calls_of_agree() -> None:
    from megatron_deadpool.hotswap.worker import recovery

    holds = {"local": [5, 6], "0": [5, 6]}

    def real(members: Membership) -> None:
        class Holder:
            def holdings(self) -> dict[str, list[int]]:
                return holds

        recovery.Recovery(
            members,
            "a1",
            1,
            Roster(0, 3, {0: "a0", 1: "a1", 2: "a2"}),
            Holder(),  # type: ignore[arg-type]
        ).agree(
            {},
            last_completed=6,
            deadline=time.time() + 30,
            cause=RuntimeError("peer died"),
            salvage_target=lambda iteration: (None, None),
        )

    def simulated(members: Membership) -> None:
        survivor_report(members, 1, 1, holds, 6)
        members.wait_decision(1, FOREVER_S)
        plan = members.plan(1)
        assert plan is not None
        members.wait_newcomers(1, plan.needy, FOREVER_S)

    ops = _survivor_ops(real)
    assert [op for op, _ in ops] == [
        "set",  # the report, before the plan: nothing to wait for first
        "add",
        "wait",  # the decision
        "compare_set",  # read without a second wait (`Membership._peek`)
        "compare_set",  # the plan
        "wait",  # the newcomer's claim
        "compare_set",
    ]
    assert _survivor_ops(simulated) == ops


@pytest.mark.timeout(600)
def test_bench_measures_recoveries_and_sweeps_at_a_small_size() -> None:
    args = argparse.Namespace(
        ranks=[64],
        procs=2,
        steady=1.5,
        failures=2,
        heartbeat_interval=0.5,
        heartbeat_timeout=10.0,
        hb_group=16,
        sim_nice=10,
        sim_ranks=None,
        timeout=300.0,
    )
    result = control_plane.measure(64, args, progress=lambda line: None)
    assert [f["phases_s"].keys() for f in result["failures"]] == [
        {"detect", "agree", "reconstruct", "restore", "first_iteration"}
    ] * 2
    for f in result["failures"]:
        assert 0 <= f["failure_to_plan_s"] <= f["failure_to_roster_s"]
        assert f["failure_to_roster_s"] <= f["failure_to_all_joined_s"]
    steady = result["steady"]
    assert steady["keys_per_sweep"] == 64 + control_plane.SPARES  # actives and spares
    assert steady["requests_per_sweep"] == 1 and steady["sweeps"] >= 1
    assert 0 < steady["sweep_cpu_ms"] < 1000
    alone = control_plane.coordinator_alone(64, args)
    assert alone["keys_per_sweep"] == 64 + control_plane.SPARES
    assert 0 < alone["notice_to_plan_s"] and 0 < alone["reports_to_roster_s"] < 60
    lines = control_plane.table([alone], [result])
    assert lines[0].split() == ["ranks", "64"]
    assert not any("not measured" in line for line in lines)
