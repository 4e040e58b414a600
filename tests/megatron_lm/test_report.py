"""DeadPool's lines in Megatron's format (report.py)."""

from __future__ import annotations

import re


def test_report_lines_have_megatrons_shape() -> None:
    from megatron_deadpool.megatron_lm.report import megatron_line, replication_fields

    line = megatron_line(*replication_fields(5, 8, 4, 2048, 0.0021))
    assert re.fullmatch(
        r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+\] deadpool \| iteration +5/ +8 \| committed "
        r"replica iteration: 4 \| replica bytes per iteration: 2\.0 KiB \| replication time "
        r"\(ms\): 2\.1 \|",
        line,
    )


def test_a_logged_intervals_sums_are_reset_as_megatron_resets_them() -> None:
    """A `training_log` deferred at a log interval (its barrier failed) leaves the sums that
    the completed call leaves: Megatron's reset (losses to a zero float32 tensor, counts 0)."""
    import torch

    from megatron_deadpool.megatron_lm.report import reset_log_sums

    sums = {"lm loss": torch.tensor([2.5], dtype=torch.float), "advanced iterations": 2,
            "skipped iterations": 1, "nan iterations": 0}  # fmt: skip
    reset_log_sums(sums)
    assert sums["lm loss"].dtype == torch.float and sums["lm loss"].tolist() == [0.0]
    assert [sums[k] for k in ("advanced iterations", "skipped iterations")] == [0, 0]


def test_the_short_shards_scalar_is_zero_once_this_rank_committed_past_the_restore() -> None:
    """`deadpool/under-replicated-shards`: the coordinator's count (job/status) from the
    recovery agreed in generation 1 at restore iteration 4, until this rank - which knows its
    own committed iteration first - committed a round after 4 in that generation."""
    from megatron_deadpool.hotswap.protocol.messages import JobStatus
    from megatron_deadpool.megatron_lm.report import SCALARS, status_scalars

    status = JobStatus(0, 1, 0, 0, 0, under_replicated=2, agreed_generation=1, restore_iteration=4)
    short = "under-replicated-shards"
    assert short in SCALARS and status_scalars(None) == {}
    assert status_scalars(status, generation=1, committed=4)[short] == 2.0  # restored, not yet
    assert status_scalars(status, generation=1, committed=None)[short] == 2.0  # a newcomer
    assert status_scalars(status, generation=0, committed=5)[short] == 2.0  # the old world's
    assert status_scalars(status, generation=1, committed=5)[short] == 0.0
    planned = JobStatus(0, 1, 0, 0, 0, under_replicated=2, agreed_generation=2)  # not agreed
    assert status_scalars(planned, generation=2, committed=9)[short] == 2.0
