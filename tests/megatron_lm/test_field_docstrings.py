"""Megatron-LM's argument parser built again without reading the dataclasses' source again
(field_docstrings.py)."""

from __future__ import annotations

import json

import pytest
from mlm import megatron_lm_tree, run_python

from megatron_deadpool.megatron_lm.field_docstrings import once_per_class


def test_each_class_is_read_once_and_every_caller_gets_a_copy_of_its_own() -> None:
    reads: list[type] = []

    def real(self: object, cls: type) -> dict[str, str]:
        reads.append(cls)
        return {"field": cls.__name__}

    class A: ...

    class B: ...

    cached = once_per_class(real)
    first = cached(None, A)
    first["field"] = "changed by a caller"
    assert cached(None, A) == {"field": "A"}
    assert cached(None, B) == {"field": "B"}
    assert cached(None, A) is not cached(None, A)
    assert reads == [A, B]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tag", ["core_v0.16.1", "core_v0.19.0"])
def test_the_parser_built_again_is_the_same(tag: str) -> None:
    """With the tree's own `ArgumentGroupFactory`: every dataclass it turns into arguments
    gives the same field docstrings once installed, a copy each time, and Megatron's
    `parse_args` the same arguments as before; installing twice changes nothing."""
    tree = megatron_lm_tree(tag)
    proc = run_python(
        f"""
        import json, sys
        sys.path.insert(0, {str(tree)!r})
        sys.argv = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64",
                    "--num-attention-heads", "4", "--seq-length", "64",
                    "--max-position-embeddings", "64", "--micro-batch-size", "2"]
        from megatron_deadpool.megatron_lm import field_docstrings, runner
        runner.prepare()
        import dataclasses
        from megatron.training import argument_utils, arguments
        from megatron.core.transformer import TransformerConfig

        factory = argument_utils.ArgumentGroupFactory
        before = factory(TransformerConfig).field_docstrings
        parsed = vars(arguments.parse_args(ignore_unknown_args=True))
        installed = field_docstrings.install(), field_docstrings.install()
        again = [factory(TransformerConfig).field_docstrings for _ in range(2)]
        reparsed = vars(arguments.parse_args(ignore_unknown_args=True))
        print(json.dumps({{
            "installed": installed,
            "wrapped_once": not getattr(factory._get_field_docstrings.__wrapped__, "_deadpool",
                                        False),
            "fields": len(before),
            "same": again[0] == before and again[1] == before,
            "copies": again[0] is not again[1],
            "same_args": repr(sorted(parsed.items())) == repr(sorted(reparsed.items())),
        }}))
        """,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["installed"] == [True, True] and out["wrapped_once"], out
    assert out["fields"] > 50, out  # TransformerConfig's documented fields, its bases' included
    assert out["same"] and out["copies"] and out["same_args"], out
