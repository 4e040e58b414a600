"""Reading a Megatron-LM argument line (megatron_deadpool/planner/megatron_line.py): both
spellings, Megatron's defaults, ignored flags, and bad lines refused naming the flag."""

from __future__ import annotations

import pytest

from megatron_deadpool.errors import ConfigError
from megatron_deadpool.planner.megatron_line import parse_megatron_line

SIZES = [
    "--num-layers=4",
    "--hidden-size",
    "256",
    "--num-attention-heads=8",
    "--seq-length",
    "512",
    "--vocab-size=1000",
]


def test_megatron_defaults_for_what_the_line_leaves_out() -> None:
    line = parse_megatron_line(SIZES)
    m = line.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (4, 256, 8, 512)
    assert m.tie_embeddings and m.add_bias_linear and not m.swiglu
    assert m.normalization == "LayerNorm" and m.position_embedding_type == "learned_absolute"
    assert m.ffn_hidden_size is None and m.num_query_groups is None and m.num_experts is None
    assert (line.tp, line.pp, line.ep, line.etp, line.tp_pp_dp) == (1, 1, 1, None, False)
    assert (line.micro_batch_size, line.global_batch_size, line.recompute) == (1, None, "none")
    assert line.train == {}


def test_a_full_line_with_flags_the_planner_ignores() -> None:
    line = parse_megatron_line(
        [
            *SIZES,
            "--data-path",
            "/data/x_text_document",
            "--log-interval=10",
            "--tensor-model-parallel-size=2",
            "--pipeline-model-parallel-size",
            "2",
            "--context-parallel-size=1",
            "--num-experts=8",
            "--moe-router-topk=2",
            "--expert-model-parallel-size=4",
            "--expert-tensor-parallel-size=1",
            "--use-tp-pp-dp-mapping",
            "--swiglu",
            "--disable-bias-linear",
            "--untie-embeddings-and-output-weights",
            "--normalization=RMSNorm",
            "--position-embedding-type=rope",
            "--group-query-attention",
            "--num-query-groups=2",
            "--ffn-hidden-size=1024",
            "--micro-batch-size=2",
            "--global-batch-size=64",
            "--recompute-granularity=full",
            "--recompute-method=uniform",
            "--train-iters=100",
            "--lr=3e-4",
            "--seed=7",
        ]
    )
    m = line.model
    assert m.swiglu and not m.add_bias_linear and not m.tie_embeddings
    assert (m.normalization, m.position_embedding_type) == ("RMSNorm", "rope")
    assert (m.num_query_groups, m.ffn_hidden_size, m.num_experts) == (2, None, 8)  # 4 x hidden
    assert (line.tp, line.pp, line.ep, line.etp, line.tp_pp_dp) == (2, 2, 4, 1, True)
    assert (line.micro_batch_size, line.global_batch_size, line.recompute) == (2, 64, "full")
    assert line.train == {"iters": 100, "lr": 3e-4, "seed": 7}
    assert parse_megatron_line([*SIZES, "--recompute-activations"]).recompute == "selective"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--context-parallel-size=2"], "--context-parallel-size 2"),
        (["--tensor-model-parallel-size=0"], "--tensor-model-parallel-size"),
        (["--hidden-size=abc"], "--hidden-size"),
        (["--num-query-groups=2"], "--group-query-attention"),
        (["--normalization=BatchNorm"], "--normalization"),
        (["--num-attention-heads=7"], "divisible"),
    ],
)
def test_bad_lines_name_the_flag(extra: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_megatron_line([*SIZES, *extra])
    assert message in str(info.value)


def test_missing_sizes_are_named() -> None:
    with pytest.raises(ConfigError) as info:
        parse_megatron_line(["--num-layers=2", "--hidden-size=64"])
    text = str(info.value)
    assert "--num-attention-heads, --seq-length, --vocab-size missing" in text
