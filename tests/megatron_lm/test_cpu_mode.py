"""The Megatron flags the CPU development mode adds (cpu.py)."""

from __future__ import annotations

from megatron_deadpool.megatron_lm.cpu import CPU_FLAGS, with_cpu_flags


def test_cpu_flags_fill_in_only_what_the_user_left_out() -> None:
    added = with_cpu_flags([])
    for flag, value in CPU_FLAGS:
        assert flag in added
        if value is not None:
            assert added[added.index(flag) + 1] == value
    user = ["--transformer-impl", "transformer_engine", "--distributed-backend=nccl"]
    out = with_cpu_flags(user + ["--no-rope-fusion"])
    assert out.count("--transformer-impl") == 1 and "local" not in out
    assert "gloo" not in out and out.count("--no-rope-fusion") == 1


def test_moe_is_mended_for_host_tensors() -> None:
    """core_v0.16.1's router gating names `te_general_gemm` without Transformer Engine, and the
    all-to-all dispatcher's split sizes stay tensors in host memory: the CPU mode mends both."""
    from mlm import OLDEST, megatron_lm_tree, run_python

    tree = megatron_lm_tree(OLDEST)
    proc = run_python(f"""
        import sys
        sys.path.insert(0, {str(tree)!r})
        from megatron_deadpool.megatron_lm import prepare
        prepare()
        import numpy, torch
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
        assert moe_utils.te_general_gemm is None
        splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
        assert isinstance(splits, numpy.ndarray) and splits.tolist() == [3, 1], splits
        kept = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([3, 1]))
        assert torch.is_tensor(kept)
        w, x = torch.randn(4, 8), torch.randn(5, 8)
        out = moe_utils.router_gating_linear(x, w, None, torch.float32)
        assert torch.equal(out, x @ w.t())
        print("mended")
        """)  # fmt: skip
    assert proc.returncode == 0 and "mended" in proc.stdout, proc.stderr[-3000:]
