"""The layout against the groups Megatron made (hotswap/worker/layout_check.py): a layout in another
rank order than Megatron's is refused, naming both groups, before any replica is placed.

Megatron's groups of rank 2 of 4 are built in a private (fake) world, in a fresh interpreter
(the private world changes `torch.distributed` for the whole process)."""

from __future__ import annotations

import pytest
from mlm import run_python

CASES = {
    # As --use-tp-pp-dp-mapping: the layout in Megatron's order passes, the default one not.
    "rank order": (
        'initialize_model_parallel(1, 2, order="tp-cp-ep-pp-dp")',
        "Layout(1, 2, 2, 2, RankOrder.TP_PP_DP)",
        "Layout(1, 2, 2, 2)",
        (
            "Megatron's pp group of rank 2 is [2, 3], but tp 1 x pp 2 x dp 2 in rank order "
            "tp-dp-pp, 2 rank(s) per node puts rank 2 in pp group [0, 2]"
        ),
    ),
    # Expert groups (EP 2 over 4 ranks: ep [2, 3], expert dp [0, 2]): another EP size refused.
    "expert groups": (
        "initialize_model_parallel(1, 1, expert_model_parallel_size=2)",
        "Layout(1, 1, 4, 2, ep=2)",
        "Layout(1, 1, 4, 2, ep=4)",
        (
            "Megatron's expert ep group of rank 2 is [2, 3], but tp 1 x pp 1 x dp 4 (experts: "
            "etp 1 x ep 4 x expert dp 1) in rank order tp-dp-pp, 2 rank(s) per node puts rank 2 "
            "in expert ep group [0, 1, 2, 3]"
        ),
    ),
    # Context-parallel and 'dp-cp' groups (TP 1 x CP 2 x DP 2: cp [2, 3], dp-cp [0, 1, 2, 3]):
    # the layout with CP 2 names them, one without context parallelism (DP 4) is refused.
    "context parallel groups": (
        "initialize_model_parallel(1, 1, context_parallel_size=2)",
        "Layout(1, 1, 2, 1, cp=2)",
        "Layout(1, 1, 4, 1)",
        (
            "Megatron's dp group of rank 2 is [0, 2], but tp 1 x pp 1 x dp 4 in rank order "
            "tp-dp-pp, 1 rank(s) per node puts rank 2 in dp group [0, 1, 2, 3]"
        ),
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES)
def test_a_layout_with_other_groups_than_megatrons_is_refused(case: str) -> None:
    megatron_call, matching, other, refusal = CASES[case]
    proc = run_python(f"""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron_deadpool.errors import ConfigError
        from megatron_deadpool.hotswap.worker import private_world
        from megatron_deadpool.hotswap.worker.layout_check import check_megatron_groups
        from megatron_deadpool.replication.placement import Layout, RankOrder

        private_world.enter(2, 4)
        dist.init_process_group()
        ps.{megatron_call}
        check_megatron_groups({matching}, 2)
        try:
            check_megatron_groups({other}, 2)
        except ConfigError as exc:
            print("refused:", exc)
        """)
    assert proc.returncode == 0, proc.stderr
    assert f"refused: {refusal}" in proc.stdout, proc.stdout
