"""A newcomer's private fake world (private_world.py)."""

from __future__ import annotations

import json

from mlm import run_python


def test_newcomer_builds_in_a_private_world() -> None:
    proc = run_python("""
        import datetime, json
        import torch, torch.distributed as dist
        from megatron_deadpool.hotswap.worker import private_world as newcomer
        asked = []
        real_new_group = dist.new_group
        newcomer.enter(2, 4, asked.append)
        dist.init_process_group(backend="gloo", timeout=datetime.timedelta(minutes=3))
        g = dist.new_group([0, 1, 2, 3], backend="gloo")
        keys = [None] * 4
        dist.all_gather_object(keys, ["a", "b"])
        out = dict(rank=dist.get_rank(), world=dist.get_world_size(),
                   backend=dist.get_backend(), group_rank=dist.get_rank(g), keys=keys,
                   asked=asked[0]["backend"], active=newcomer.active())
        newcomer.leave()
        out["restored"] = dist.new_group is real_new_group and not newcomer.active()
        print(json.dumps(out))
        """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {
        "rank": 2, "world": 4, "backend": "fake", "group_rank": 2, "keys": [["a", "b"]] * 4,
        "asked": "gloo", "active": True, "restored": True,
    }  # fmt: skip
