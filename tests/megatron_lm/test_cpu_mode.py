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
