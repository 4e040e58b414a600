"""Model weights and optimizer after a restore (hotswap/worker/weights.py): the optimizer's cached
answers of collectives are dropped on every rank, so survivors and newcomers issue the same
collectives at their next step (megatron-core 0.19's `has_grad_norm_group`: an all-reduce on the
first step, cached; a newcomer has no answer yet). The hot-swap runs on megatron-core 0.19
(tests/megatron_lm on the core_v0.19.0 tree; the embedded job in .ci/lane312) depend on it.
"""

from __future__ import annotations

from types import SimpleNamespace

from megatron_deadpool.hotswap.worker.weights import forget_cached_collectives


def test_cached_collective_answers_are_dropped_on_every_chained_optimizer() -> None:
    inner = [SimpleNamespace(_has_grad_norm_group_cache={"g": True}) for _ in range(2)]
    chained = SimpleNamespace(_has_grad_norm_group_cache={"g": True}, chained_optimizers=inner)
    forget_cached_collectives(chained)
    assert chained._has_grad_norm_group_cache is None
    assert [o._has_grad_norm_group_cache for o in inner] == [None, None]
    plain = SimpleNamespace()  # core_v0.16.1's optimizers cache nothing
    forget_cached_collectives(plain)
    assert not hasattr(plain, "_has_grad_norm_group_cache")
