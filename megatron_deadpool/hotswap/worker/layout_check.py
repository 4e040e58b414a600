"""The layout DeadPool computed against the groups Megatron made.

Placement, the coordinator, a standby's rebuild and the planner never import Megatron: they
compute every rank's tensor-, context-, pipeline- and data-parallel peers from the layout
(`placement.Layout`: tp x cp x pp x dp, ranks per node, Megatron's rank order). A layout whose
order is not the one Megatron built its groups in (`initialize_model_parallel(order=...)`) would
put replicas on ranks that are not data-parallel peers; `check_megatron_groups` compares, once per
process after Megatron's groups exist, this rank's groups in both views - with expert
parallelism also its expert-model-, expert-tensor- and expert-data-parallel groups (Megatron's
second, expert `RankGenerator`), among which the replicas of the expert optimizer's shard are
placed; with context parallelism its context-parallel and 'dp-cp' groups (among which the
distributed optimizer is sharded and the replicas are placed). No communication.
`megatron_layout` reads the layout of the groups Megatron made.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from ...errors import ConfigError
from ...replication.placement import Layout, RankOrder


def megatron_layout(ranks_per_node: int | None, order: RankOrder) -> Layout:
    """The layout of the groups Megatron made (`parallel_state`), in Megatron's rank `order`;
    `ranks_per_node` unless None: the launcher's (LOCAL_WORLD_SIZE, SLURM_NTASKS_PER_NODE),
    else tp."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_world_size()
    if ranks_per_node is None:
        text = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE")
        ranks_per_node = int(text) if text else tp
    return Layout(
        tp=tp,
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        ranks_per_node=ranks_per_node,
        order=order,
        ep=ps.get_expert_model_parallel_world_size(),
        etp=None if etp == tp else etp,  # None: Megatron's default, tp
        cp=ps.get_context_parallel_world_size(),
    )


def check_megatron_groups(layout: Layout, rank: int) -> None:
    """Raise `ConfigError` unless `layout` puts `rank` in the tensor-, pipeline- and
    data-parallel groups Megatron gave it (`parallel_state`, ranks in Megatron's order)."""
    from megatron.core import parallel_state as ps

    made = [
        ("tp", ps.get_tensor_model_parallel_group(), layout.groups("tp")),
        ("pp", ps.get_pipeline_model_parallel_group(), layout.groups("pp")),
        ("dp", ps.get_data_parallel_group(), layout.groups("dp")),
    ]
    if layout.cp > 1:
        made += [
            ("cp", ps.get_context_parallel_group(), layout.groups("cp")),
            ("dp-cp", ps.get_data_parallel_group(with_context_parallel=True), layout.dp_cp_groups),
        ]
    if layout.has_experts:
        made += [
            ("expert ep", ps.get_expert_model_parallel_group(), layout.expert_groups("ep")),
            ("expert tp", ps.get_expert_tensor_parallel_group(), layout.expert_groups("tp")),
            ("expert dp", ps.get_expert_data_parallel_group(), layout.expert_groups("dp")),
        ]
    for token, group, groups in made:
        megatron = dist.get_process_group_ranks(group)
        ours = next(g for g in groups if rank in g)
        if megatron != ours:
            raise ConfigError(
                f"Megatron's {token} group of rank {rank} is {megatron}, but {layout.describe()} "
                f"puts rank {rank} in {token} group {ours}: DeadPool would place replicas among "
                "the wrong peers. Megatron was set up in a rank order DeadPool was not told "
                "(Megatron-LM: --use-tp-pp-dp-mapping is read from Megatron's arguments; "
                "`initialize_model_parallel(order=...)` called otherwise is not supported)"
            )
