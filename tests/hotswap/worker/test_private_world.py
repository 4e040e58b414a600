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


def test_objects_move_from_a_forgotten_world_onto_the_next_worlds_groups_in_one_walk() -> None:
    """`rebind.forget` + `rebind.swap`: torch forgets the private world while the objects keep
    its groups; the next world's groups of the same names take their places, none is left."""
    proc = run_python("""
        import json
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron_deadpool.hotswap.worker import private_world, rebind

        def world():
            private_world.enter(2, 4)
            dist.init_process_group(backend="gloo")
            ps.initialize_model_parallel(tensor_model_parallel_size=2)

        world()
        class Holder:  # as Megatron's modules hold them: attributes, lists, tuples
            pass
        obj = Holder()
        obj.tp = ps.get_tensor_model_parallel_group()
        obj.pair = (ps.get_data_parallel_group(), [dist.distributed_c10d._get_default_group()])
        old = (obj.tp, obj.pair[0], obj.pair[1][0])
        stranger = dist.new_group([0, 1, 2, 3])  # no parallel_state name
        held = rebind.forget()
        private_world.leave()
        out = {"forgotten": not dist.is_initialized(), "held": len(held)}
        world()
        stale = []
        out["moved"] = rebind.swap([obj], held, stale=stale)
        out["stale"] = stale
        out["new"] = [
            obj.tp is ps.get_tensor_model_parallel_group(),
            obj.pair[0] is ps.get_data_parallel_group(),
            obj.pair[1][0] is dist.distributed_c10d._get_default_group(),
        ]
        out["old_gone"] = all(g is not n for g, n in zip(old, (obj.tp, obj.pair[0], obj.pair[1][0])))
        obj.other = stranger
        try:
            rebind.swap([obj], held)
        except RuntimeError as exc:
            out["unnamed"] = str(exc)
        print(json.dumps(out))
        """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["forgotten"] and out["held"] > 3, out
    assert out["moved"] == 3 and out["stale"] == [] and out["new"] == [True] * 3, out
    assert out["old_gone"], out
    assert "no new group for released handles: ['unknown:" in out["unnamed"], out
