"""A process's place in the job and what the session refuses to protect (session.py)."""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from megatron_deadpool.config.deadpool import DeadpoolConfig
from megatron_deadpool.errors import ConfigError


def test_task_index_and_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_deadpool.hotswap.protocol.messages import member_of
    from megatron_deadpool.megatron_lm.session import task_from_env

    for name in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert task_from_env() == 0
    monkeypatch.setenv("SLURM_PROCID", "8")
    assert task_from_env() == 8
    monkeypatch.setenv("RANK", "5")
    assert task_from_env() == 5
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ConfigError, match="task index"):
        task_from_env()
    # The coordinator's world size decides: tasks beyond it are spares.
    assert [member_of(t, 4) for t in (0, 3, 4, 5)] == ["a0", "a3", "s0", "s1"]


def test_session_refuses_what_it_cannot_protect() -> None:
    from megatron_deadpool.megatron_lm.session import MegatronSession

    session = MegatronSession(DeadpoolConfig(enabled=True), 0, "token")
    ok = SimpleNamespace(use_distributed_optimizer=True, data_parallel_size=2,
                         distributed_timeout_minutes=10)  # fmt: skip
    session._check_megatron_args(ok)
    # Expert parallelism: replicas placed among ranks holding the same experts (placement.py).
    session._check_megatron_args(SimpleNamespace(**vars(ok), expert_model_parallel_size=2))
    # FP16's loss scaler travels in the snapshot (replication/snapshot.py): not refused.
    session._check_megatron_args(SimpleNamespace(**vars(ok), fp16=True, loss_scale=None))
    # Context parallelism: replicas placed among the 'dp-cp' peers (placement.py); at DP 1
    # without the distributed optimizer the context-parallel peer holds the same state.
    session._check_megatron_args(SimpleNamespace(**vars(ok), context_parallel_size=2))
    no_distributed_optimizer = {"use_distributed_optimizer": False, "data_parallel_size": 1}
    session._check_megatron_args(
        SimpleNamespace(**{**vars(ok), **no_distributed_optimizer, "context_parallel_size": 2})
    )
    bad = [
        ({"use_distributed_optimizer": False, "data_parallel_size": 1}, "data-parallel size is 1"),
        ({"fp8": "hybrid"}, "--fp8-format: Transformer Engine's FP8 scaling state"),
        ({"fp4": "e2m1"}, "--fp4-format: "),
        ({"rampup_batch_size": [4, 4, 100]}, "rampup"),
        ({"distributed_timeout_minutes": 0.1}, "below --distributed-timeout-minutes"),
    ]
    for change, message in bad:
        with pytest.raises(ConfigError, match=re.escape(message)):
            session._check_megatron_args(SimpleNamespace(**{**vars(ok), **change}))


def test_the_tp_pp_dp_mapping_is_taken_from_megatrons_arguments_not_refused() -> None:
    """`--use-tp-pp-dp-mapping` is protected: the session places replicas in Megatron's order
    (`rank_order`; both tags build their groups in order 'tp-cp-ep-pp-dp' with it)."""
    from megatron_deadpool.megatron_lm.session import MegatronSession, rank_order
    from megatron_deadpool.replication.placement import RankOrder

    session = MegatronSession(DeadpoolConfig(enabled=True), 0, "token")
    mapped = SimpleNamespace(use_distributed_optimizer=True, data_parallel_size=2,
                             distributed_timeout_minutes=10, use_tp_pp_dp_mapping=True)  # fmt: skip
    session._check_megatron_args(mapped)
    assert rank_order(mapped) is RankOrder.TP_PP_DP
    assert rank_order(SimpleNamespace(use_tp_pp_dp_mapping=False)) is RankOrder.TP_DP_PP
    assert rank_order(SimpleNamespace()) is RankOrder.TP_DP_PP


@pytest.mark.parametrize(
    "change,flag,fix",
    [
        ({"tp_comm_overlap": True}, "--tp-comm-overlap: ", "drop --tp-comm-overlap"),
        ({"cuda_graph_impl": "local"}, "--cuda-graph-impl=local: ", "--cuda-graph-impl none"),
        (
            {"cuda_graph_impl": "transformer_engine"},
            "--cuda-graph-impl=transformer_engine: ",
            "--cuda-graph-impl none",
        ),
        ({"enable_cuda_graph": True}, "--cuda-graph-impl=local: ", "--cuda-graph-impl none"),
        ({"nccl_ub": True}, "--use-nccl-ub: ", "drop --use-nccl-ub"),
    ],
)
def test_options_bound_to_the_start_up_communicators_are_refused_in_one_line(
    change: dict, flag: str, fix: str
) -> None:
    from megatron_deadpool.megatron_lm.session import MegatronSession

    session = MegatronSession(DeadpoolConfig(enabled=True), 0, "token")
    ok = SimpleNamespace(use_distributed_optimizer=True, data_parallel_size=2,
                         distributed_timeout_minutes=10, tp_comm_overlap=False,
                         cuda_graph_impl="none", nccl_ub=False)  # fmt: skip
    session._check_megatron_args(ok)
    with pytest.raises(ConfigError) as info:
        session._check_megatron_args(SimpleNamespace(**{**vars(ok), **change}))
    message = str(info.value)
    assert "\n" not in message and message.count(flag) == 1 and fix in message


def test_every_start_up_bound_option_is_named_when_several_are_given() -> None:
    from megatron_deadpool.megatron_lm.refused import refused_problems

    args = SimpleNamespace(tp_comm_overlap=True, cuda_graph_impl="local", nccl_ub=True)
    problems = refused_problems(args)
    assert [p.split(":")[0] for p in problems] == [
        "--tp-comm-overlap", "--cuda-graph-impl=local", "--use-nccl-ub"
    ]  # fmt: skip
    assert refused_problems(SimpleNamespace()) == []  # a release without these options
    assert refused_problems(SimpleNamespace(cuda_graph_impl=None)) == []


def _driver(rank: int, membership: object) -> Any:
    """A driver holding `rank`, its store access `membership` (a stand-in for the calls used)."""
    from stores import TEST_SECRET

    from megatron_deadpool.devices.base import Device
    from megatron_deadpool.hotswap.worker.driver import Driver

    cfg = DeadpoolConfig(enabled=True)
    driver = Driver(cfg, Device("cpu", "gloo"), coordinator="-", token=TEST_SECRET, task=rank)
    driver.rank, driver._membership = rank, membership  # type: ignore[assignment]
    return driver


def test_a_checkpoint_not_saved_says_what_happens_next() -> None:
    """Megatron's save that failed (save.py): rank 0 hands the line to the launcher, ending
    with what follows - training goes on, it is complete, or Megatron's exit check stops it
    (the line waits for that check's decision)."""
    from megatron_deadpool.megatron_lm.session import MegatronSession

    published: dict[int, str] = {}
    driver = _driver(0, SimpleNamespace(publish_checkpoint_failure=published.__setitem__))
    session = MegatronSession(DeadpoolConfig(enabled=True), 0, "")
    session._active = driver
    session.checkpoint_not_saved(2, "L2")
    with session.exit_check() as decided:
        session.checkpoint_not_saved(3, "L3")
        assert 3 not in published
        decided(True)
    with session.exit_check() as decided:
        session.checkpoint_not_saved(4, "L4")
        decided(False)
    driver.completed = 5
    session.checkpoint_not_saved(5, "L5")
    goes_on = "; training goes on (its state is protected in memory)"
    assert published == {
        2: "L2" + goes_on,
        3: "L3; Megatron stops after this iteration",
        4: "L4" + goes_on,
        5: "L5; training is complete: its final state (iteration 5) is not saved",
    }


def test_survivors_one_step_apart_are_brought_to_the_later_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the survivors of the Slurm lab's Megatron-LM job reported under load: ranks 0 and 2
    completed step 10 and deferred its logging's failure (target 11), rank 1 failed inside step
    10 (target 10); rank 3 is the newcomer. Rank 1 runs step 10 and skips its between-step work
    with a peer's running sums; the newcomer starts at step 11 with a rank-at-11's counters."""
    from megatron_deadpool.hotswap.protocol.messages import Roster
    from megatron_deadpool.megatron_lm.session import MegatronSession
    from megatron_deadpool.megatron_lm.survivors import SurvivorReport

    def report(target: int, sums: float) -> SurvivorReport:
        counters = {str(s): {"consumed_train": 8.0 * s} for s in range(8, target)}
        return SurvivorReport(target, counters, (True, False, False), {"lm loss": sums})

    reports = {0: report(11, 0.0), 1: report(10, 5.0), 2: report(11, 0.0)}
    membership = SimpleNamespace(
        plan=lambda g: SimpleNamespace(needy=[3]),
        holdings=lambda g, r: SimpleNamespace(job=reports[r].to_dict()) if r in reports else None,
        sources=lambda g: SimpleNamespace(holders={3: 1}),  # rank 1, behind, holds 3's shard
    )
    roster = Roster(1, 4, {0: "a0", 1: "a1", 2: "a2", 3: "s0"}, restore_iteration=9)

    def session(rank: int, target: int | None) -> MegatronSession:
        s = MegatronSession(DeadpoolConfig(enabled=True), rank, "token")
        placement = SimpleNamespace(holders=((2,), (3,), (0,), (1,)))
        s._active = _driver(rank, membership)
        s._active.placement = placement
        s.target = target
        return s

    behind = session(1, 10)
    behind.after_rejoin(roster)
    assert behind.skips_between_steps(10) and not behind.skips_between_steps(11)
    assert behind._log_state_to_load == {"lm loss": 0.0}  # a rank at step 11's, not its own
    ahead = session(0, 11)
    ahead.after_rejoin(roster)
    assert not ahead.skips_between_steps(10) and ahead._log_state_to_load is None
    newcomer = session(3, None)
    newcomer.driver.member = "s0"  # as `connect` names it
    monkeypatch.setenv("RANK", "3")  # exported by the driver before `slot_taken`
    newcomer.slot_taken(roster)
    plan = newcomer.newcomer_plan()  # the roster is agreed: at once
    assert plan.target == 11 and "10" in plan.counters  # from rank 0
    # Step 10's evaluation is skipped with its log (Megatron's loop reads args.do_valid after
    # `training_log`), and the flag is back for step 11.
    args = SimpleNamespace(do_valid=True)
    monkeypatch.setitem(sys.modules, "megatron.training", SimpleNamespace(get_args=lambda: args))
    behind.skip_evaluation()
    behind.skip_evaluation()  # a second call keeps the first's saved value
    assert args.do_valid is False
    behind._evaluation_back()
    assert args.do_valid is True
