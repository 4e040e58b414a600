"""The step Megatron-LM's survivors go on at, and whose running sums a rank takes
(megatron_lm/survivors.py)."""

from __future__ import annotations

import pytest

from megatron_deadpool.errors import DeadpoolRuntimeError
from megatron_deadpool.megatron_lm.survivors import SurvivorReport, peer_ahead, resume_step


def _report(target: int | None, sums: float = 0.0) -> SurvivorReport:
    return SurvivorReport(
        target=target,
        counters={"9": {"consumed_train": 72.0}},
        flags=(True, False, False),
        log_state={"lm loss": sums},
    )


def test_survivors_one_step_apart_go_on_at_the_later_step() -> None:
    """The split a partly completed last collective leaves (the Slurm lab's
    test_megatron_lm_node_killed_mid_run_the_spare_node_takes_over met it: {10, 11})."""
    assert resume_step({0: _report(11), 1: _report(10)}) == 11
    assert resume_step({0: _report(10), 1: _report(10)}) == 10


def test_survivors_further_apart_or_without_a_step_are_an_error() -> None:
    with pytest.raises(DeadpoolRuntimeError, match="too far apart"):
        resume_step({0: _report(12), 1: _report(10)})
    with pytest.raises(DeadpoolRuntimeError, match="no step"):
        resume_step({0: _report(None), 1: _report(10)})
    with pytest.raises(DeadpoolRuntimeError, match="no step"):
        resume_step({})


def test_the_sums_come_from_a_preferred_peer_at_the_step_else_the_lowest_rank_there() -> None:
    reports = {0: _report(11, 1.0), 1: _report(10, 2.0), 2: _report(11, 3.0), 3: _report(11, 4.0)}
    assert peer_ahead(reports, 11, (1, 3)).log_state == {"lm loss": 4.0}  # 1 is behind
    assert peer_ahead(reports, 11).log_state == {"lm loss": 1.0}
    with pytest.raises(DeadpoolRuntimeError, match="no survivor reports step 12"):
        peer_ahead(reports, 12)


def test_a_report_round_trips_and_a_foreign_one_is_refused() -> None:
    report = _report(11, 2.5)
    assert SurvivorReport.from_dict(report.to_dict()) == report
    with pytest.raises(DeadpoolRuntimeError, match="not Megatron-LM's"):
        SurvivorReport.from_dict({"target": 3})
