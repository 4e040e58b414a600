"""Context parallelism with Transformer Engine's attention, hot-swapped (``pytest -m gpu``).

On CPU (tests/megatron_lm/test_pretrain_gpt_models.py) context parallelism runs with layers
without attention: Megatron-Core runs it only in Transformer Engine's attention, which needs a
GPU. This test is the same life cycle with that attention: `pretrain_gpt.py` at TP 1 x CP 2 x
DP 1 (Transformer Engine's layers, its ring attention exchanging key/value blocks between the
two context-parallel ranks) + 1 spare, every rank its own failure domain. The distributed
optimizer is sharded over the 'dp-cp' group [0, 1], so each rank's replica is on its
context-parallel peer. Rank 1 is killed as iteration 4 starts: the spare restores from rank 0
and every `lm loss`, grad norm and learning rate and both ranks' final parameters and buffers
equal the failure-free run's, bit for bit (Megatron's `--deterministic-mode`).

Needs three CUDA devices (two NCCL ranks and the spare each take one; one GPU cannot host two
NCCL ranks), Transformer Engine, and a Megatron-LM tree in MEGATRON_LM_PATH; skipped
otherwise, saying which is missing. Not run yet: no machine with three GPUs has been lent.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from mlm import NEWEST, launch, megatron_args, megatron_lm_tree

pytestmark = [pytest.mark.gpu]

GPUS = 3
ITERS = 5
ARGS = [
    *megatron_args(ITERS),
    "--tensor-model-parallel-size", "1", "--context-parallel-size", "2",
    "--transformer-impl", "transformer_engine",
    "--deterministic-mode", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--bf16", "--use-distributed-optimizer",
    "--deadpool", "--deadpool-spares", "1", "--deadpool-ranks-per-node", "1",
]  # fmt: skip
"""Megatron's arguments: the tests' tiny GPT (seq 64: 4 chunks of 16 for CP 2's load
balancing) with TE's layers, deterministic kernels (no dropout: TE's dropout in attention is
not deterministic under replay)."""


def _needs() -> Path:
    if torch.cuda.device_count() < GPUS:
        pytest.skip(
            f"needs {GPUS} CUDA devices (2 context-parallel NCCL ranks + a spare), "
            f"found {torch.cuda.device_count()}"
        )
    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("needs Transformer Engine (Megatron-Core's context parallelism runs in it)")
    return megatron_lm_tree(NEWEST)


@pytest.mark.timeout(900)
def test_context_parallel_with_te_attention_killed_rank_is_hot_swapped_bitwise(
    tmp_path: Path,
) -> None:
    script = _needs() / "pretrain_gpt.py"
    env = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "DEADPOOL_DEVICE": "cuda"}
    baseline = launch(tmp_path, "baseline", script, ARGS, env=env, nproc=2)
    assert baseline.returncode == 0, baseline.describe()
    assert sorted(baseline.iterations()) == list(range(1, ITERS + 1)), baseline.describe()
    run = launch(tmp_path, "swap", script, [*ARGS, "--deadpool-fail", "1@4"], env=env, nproc=2)
    assert run.returncode == 0, run.describe()
    (rec,) = run.summary["recoveries"]
    assert rec["dead_ranks"] == [1] and rec["replaced_by"] == {"1": "s0"}, rec
    assert "shards from rank 0 -> rank 1" in run.text, run.describe()
    assert run.iterations() == baseline.iterations(), run.describe()
    assert run.summary["param_digests"] == baseline.summary["param_digests"]
