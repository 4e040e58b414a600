"""Group handles a recovery could not rebind (hotswap/worker/rebind.py `unnamed_groups`): a group the
job's objects hold that is none of Megatron's `parallel_state` groups (e.g. one a library made
for itself) is found before any failure, so the job is refused at start-up with one line
(`rebind.check_rebindable`). A world of one process, in a fresh interpreter."""

from __future__ import annotations

import pytest
from mlm import run_python


@pytest.mark.timeout(120)
def test_a_group_outside_parallel_state_is_found_and_megatrons_are_not() -> None:
    proc = run_python("""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron_deadpool.hotswap.worker.rebind import unnamed_groups

        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        ps.initialize_model_parallel(1, 1)

        class Holder:
            def __init__(self, *groups):
                self.groups = {"a": list(groups)}

        ours = Holder(ps.get_data_parallel_group(), ps.get_expert_data_parallel_group())
        print("megatron's:", unnamed_groups([ours, dist.group.WORLD]))
        own = dist.new_group([0])
        print("own:", unnamed_groups([ours, Holder(own), (own,)]))
        print("extra:", unnamed_groups([Holder(own)], {"mine": own}))
        """)
    assert proc.returncode == 0, proc.stderr
    assert "megatron's: []" in proc.stdout, proc.stdout
    assert "own: ['a group of ranks [0]']" in proc.stdout, proc.stdout
    assert "extra: []" in proc.stdout, proc.stdout
