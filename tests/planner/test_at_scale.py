"""Recovery at 512, 1,024 and 16,384 GPUs (megatron_deadpool/planner/at_scale.py,
recovery_terms.py): every term carries a kind and a source, the cited figures are the published
ones, the measured one is `bench control-plane`'s, the verdict names the term that misses the
10 s target, and the plan's own recovery line is the table's column at its size."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_deadpool.config.cluster import load_cluster
from megatron_deadpool.config.deadpool import DeadpoolConfig
from megatron_deadpool.config.job import load_job
from megatron_deadpool.planner import measured
from megatron_deadpool.planner.at_scale import COMPARISONS, SIZES, recovery_at_scale
from megatron_deadpool.planner.capacity import PlanReport, Workload, plan
from megatron_deadpool.planner.recovery_terms import (
    BUILD_S_PER_B_PARAMS,
    KINDS,
    shrink_s,
    survivors_stop_s,
)
from megatron_deadpool.replication.placement import Layout

ROOT = Path(__file__).resolve().parents[2]
PERLMUTTER = load_cluster(ROOT / "configs" / "clusters" / "perlmutter.yaml")
NAMES = [
    "detect",
    "survivors stop",
    "agree",
    "newcomer builds",
    "repair communicators",
    "newcomer joins",
    "transfer shard",
    "failed iteration",
]


def report_65b(
    gbs: int = 1024, name: str = "gpt-65b", deadpool: DeadpoolConfig | None = None, **cluster: float
) -> PlanReport:
    model = load_job(ROOT / "configs" / "models" / f"{name}.yaml").model
    layout = Layout(tp=4, pp=8, dp=16, ranks_per_node=4)
    return plan(
        model,
        layout,
        replicas=1,
        spares=4,
        cluster=dataclasses.replace(PERLMUTTER, **cluster),
        workload=Workload(global_batch_size=gbs),
        deadpool=deadpool,
    )


def test_every_term_at_every_size_has_a_kind_and_a_source() -> None:
    scaled, skipped = recovery_at_scale(report_65b())
    assert [s.gpus for s in scaled] == list(SIZES) and not skipped
    for s in scaled:
        assert [t.name for t in s.terms] == NAMES
        for t in (*s.terms, s.rebuild):
            assert t.kind in KINDS and t.source and t.seconds >= 0
        assert s.term("agree").kind == "measured here"
        assert s.term("agree").seconds == measured.agree_s(s.gpus + 4)  # and the 4 spares
        assert measured.COMMAND in s.term("agree").source
        assert s.term("newcomer joins").kind == "assumed"  # no published ncclCommGrow figure
        assert s.total_s == pytest.approx(sum(t.seconds for t in s.terms))
        assert s.downtime_s == pytest.approx(s.total_s - s.term("failed iteration").seconds)
    by_size = {s.gpus: s for s in scaled}
    assert by_size[1024].term("repair communicators").kind == "cited"
    assert by_size[1024].term("repair communicators").seconds == 2.03  # NeMo-RL #3186
    assert by_size[16384].term("repair communicators").kind == "assumed"  # extrapolated
    assert by_size[16384].term("agree").seconds == pytest.approx(1.300 * 16388 / 16384)
    assert "#3186" in by_size[512].term("repair communicators").source
    assert "nccl#1646" in by_size[512].rebuild.source and by_size[512].rebuild.seconds == 55


def test_the_plans_recovery_line_is_the_tables_column_at_its_size() -> None:
    """`deadpool plan`'s crash and hang lines and the table are one model: at the plan's own
    size (512 GPUs here) every phase is the sum of the table's terms, and the DeadPool settings
    planned with (the heartbeat) reach every column."""
    beat = DeadpoolConfig(enabled=True, heartbeat_interval=2.0, heartbeat_timeout=20.0)
    report = report_65b(deadpool=beat)
    scaled, _ = recovery_at_scale(report)
    own = scaled[0]
    assert own.gpus == report.layout.world_size == 512 and own == report.failure
    crash, hang = report.recovery, report.recovery_hang
    assert crash.total_s == pytest.approx(own.total_s)
    assert crash.stop_s == own.term("survivors stop").seconds
    assert crash.resume_s == pytest.approx(own.downtime_s)
    assert crash.reconstruct_s == pytest.approx(
        sum(
            own.term(t).seconds
            for t in ("newcomer builds", "repair communicators", "newcomer joins")
        )
    )
    assert crash.restore_s == own.term("transfer shard").seconds
    assert crash.first_iteration_s == own.term("failed iteration").seconds
    detect = measured.AGENT_DETECT_S  # a crash: its node agent reports the exit at once
    assert crash.detect_s == detect and hang.detect_s == 20.0 and own.detect_node_s == 20.0
    wake = measured.plan_wake_s(512 + 4)  # with the spares
    assert crash.stop_s == pytest.approx(wake)  # 12.9 s iterations: the plan waiter stops them
    assert hang.stop_s == own.stop_node_s == wake  # blocked survivors: the plan waiter too
    assert hang.total_s - crash.total_s == pytest.approx(own.node_delay_s)
    assert own.node_delay_s == pytest.approx(20.0 + wake - detect - crash.stop_s)
    assert {s.term("detect").seconds for s in scaled} == {detect}
    assert [s.term("survivors stop").seconds for s in scaled] == [
        pytest.approx(measured.plan_wake_s(s.gpus + 4)) for s in scaled
    ]
    assert own.rebuild_total_s == pytest.approx(
        own.total_s - own.reconstruct_s + own.term("newcomer builds").seconds + 55.0
    )


def test_survivors_stop_at_their_iterations_end_or_when_their_plan_waiter_wakes() -> None:
    """After a crash's detection, a survivor that meets no collective with the dead rank
    computes on to its iteration's end, unless its plan waiter stops it first: it wakes as the
    plan (published at the detection) reaches it (`plan_waiter.py`, `bench plan-wake`)."""
    assert survivors_stop_s(0.5, 1.0, 0.01) == 0.0  # its iteration ended before the detection
    assert survivors_stop_s(1.6, 1.0, 1.0) == pytest.approx(0.6)  # to its iteration's end
    assert survivors_stop_s(1.6, 0.04, 2.0) == pytest.approx(1.56)
    assert survivors_stop_s(12.9, 0.04, 0.05) == pytest.approx(0.05)  # the waiter woke
    long = report_65b()  # 12.9 s iterations at 512 GPUs: the plan waiter stops the survivors
    stop = long.failure.term("survivors stop")
    assert long.per_iteration.compute_s > 3 and stop.kind == "measured here"
    assert stop.seconds == pytest.approx(measured.plan_wake_s(516))
    assert measured.PLAN_WAKE_COMMAND in stop.source
    detect = long.failure.term("detect")
    assert detect.kind == "measured here" and detect.seconds == measured.AGENT_DETECT_S
    assert measured.AGENT_DETECT_COMMAND in detect.source


def test_snapshots_in_host_memory_make_the_restore_their_copy_back() -> None:
    """A job whose snapshots do not fit the GPU keeps them in host memory: a survivor's copy
    back to the GPU is the restore when it is slower than the newcomer's transfer."""
    on_gpu = report_65b()
    on_host = report_65b(gpu_memory_gib=20.0, host_device_gb_s=0.5)
    assert on_gpu.per_gpu.fits_gpu and not on_host.per_gpu.fits_gpu
    copy = on_host.per_iteration.snapshot_copy_s
    transfer = on_host.failure.term("transfer shard")
    assert copy > on_gpu.failure.term("transfer shard").seconds
    assert transfer.seconds == copy == on_host.recovery.restore_s
    assert "copy back at 0.5 GB/s" in transfer.source
    assert "copy back" not in on_gpu.failure.term("transfer shard").source


def test_the_plan_at_each_size_keeps_tp_pp_and_the_batch_per_replica() -> None:
    scaled, _ = recovery_at_scale(report_65b())
    assert [s.layout for s in scaled] == [
        "tp 4 x pp 8 x dp 16",
        "tp 4 x pp 8 x dp 32",
        "tp 4 x pp 8 x dp 512",
    ]
    # the same work per GPU: the failed iteration costs the same at every size
    its = {round(s.term("failed iteration").seconds, 6) for s in scaled}
    assert len(its) == 1
    # a larger dp shards the optimizer finer: a newcomer receives less
    assert scaled[0].restore_bytes > scaled[1].restore_bytes > scaled[2].restore_bytes


def test_verdict_names_the_term_that_misses_the_target() -> None:
    big = {s.gpus: s for s in recovery_at_scale(report_65b(1024))[0]}[1024]
    assert big.total_s > 10 and "failed iteration" in big.verdict()
    assert big.verdict().startswith("misses the 10 s target at 1,024 GPUs")
    # 65B at 2 B parameters per GPU: its newcomer's start-up alone takes ~10 s
    at_128 = {s.gpus: s for s in recovery_at_scale(report_65b(128))[0]}[1024]
    assert "newcomer builds" in at_128.verdict()
    small = {s.gpus: s for s in recovery_at_scale(report_65b(128, "gpt-13b"))[0]}[1024]
    assert small.total_s <= 10 and small.verdict().startswith("meets")


def test_the_newcomers_build_grows_with_the_parameters_on_its_gpu() -> None:
    big, small = (
        {s.gpus: s for s in recovery_at_scale(report_65b(name=m))[0]}[1024]
        for m in ("gpt-65b", "gpt-13b")
    )
    for s, report in ((big, report_65b()), (small, report_65b(name="gpt-13b"))):
        build = s.term("newcomer builds")
        assert build.kind == "assumed" and "#6750" in build.source and "nccl#743" in build.source
        assert build.seconds == pytest.approx(report.per_gpu.params / 1e9 * BUILD_S_PER_B_PARAMS)
    assert big.term("newcomer builds").seconds > 4 * small.term("newcomer builds").seconds


def test_sizes_tp_x_pp_does_not_divide_are_skipped_with_the_reason() -> None:
    scaled, skipped = recovery_at_scale(report_65b(), (512, 1000))
    assert [s.gpus for s in scaled] == [512]
    assert skipped == ["1,000 GPUs: not a multiple of tp x pp = 32"]


def test_shrink_interpolates_the_published_figures() -> None:
    assert shrink_s(32) == (1.38, False)
    assert shrink_s(1024) == (2.03, False)
    assert shrink_s(16) == (1.38, True)
    value, outside = shrink_s(16384)
    assert outside and value == pytest.approx(2.03 + 4 * (2.03 - 1.38) / 5)


def test_comparisons_are_the_published_figures() -> None:
    figures = {c.name.split(" (")[0]: (c.gpus, c.seconds) for c in COMPARISONS}
    assert figures == {
        "TrainMover": (1024, 20.0),
        "DeadPool paper": (512, 40.0),
        "whole-job restart": (None, 600.0),
    }
