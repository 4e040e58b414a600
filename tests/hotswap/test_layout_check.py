"""The layout against the groups Megatron made (hotswap/layout_check.py): a layout in another
rank order than Megatron's is refused, naming both groups, before any replica is placed.

Megatron's groups of rank 2 of 4 are built in a private (fake) world, in a fresh interpreter
(the private world changes `torch.distributed` for the whole process)."""

from __future__ import annotations

import pytest
from mlm import run_python


@pytest.mark.timeout(120)
def test_a_layout_in_another_rank_order_than_megatrons_is_refused() -> None:
    proc = run_python("""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron_deadpool.errors import ConfigError
        from megatron_deadpool.hotswap import private_world
        from megatron_deadpool.hotswap.layout_check import check_megatron_groups
        from megatron_deadpool.replication.placement import Layout, RankOrder

        private_world.enter(2, 4)
        dist.init_process_group()
        ps.initialize_model_parallel(1, 2, order="tp-cp-ep-pp-dp")  # as --use-tp-pp-dp-mapping
        check_megatron_groups(Layout(1, 2, 2, 2, RankOrder.TP_PP_DP), 2)
        try:
            check_megatron_groups(Layout(1, 2, 2, 2), 2)
        except ConfigError as exc:
            print("refused:", exc)
        """)
    assert proc.returncode == 0, proc.stderr
    assert (
        "refused: Megatron's pp group of rank 2 is [2, 3], but tp 1 x pp 2 x dp 2 in rank order "
        "tp-dp-pp, 2 rank(s) per node puts rank 2 in pp group [0, 2]" in proc.stdout
    ), proc.stdout
