"""Megatron-LM's `pretrain_gpt.py` with models beyond test_pretrain_gpt.py's dense TP2 x DP2 GPT,
hot-swapped bitwise: an MoE model whose router keeps state outside the optimizer, an
interleaved pipeline, a pipeline in Megatron's tp-pp-dp rank order, FP16 training with
Megatron's loss scalers, and context parallelism.

- MoE (4 experts, top 2, EP 1, DP4 + a spare) with ``--moe-router-enable-expert-bias``:
  the router's ``expert_bias`` is a module buffer Megatron updates every step outside the
  optimizer, and ``local_tokens_per_expert`` a counter the forward pass fills. Rank 2 is killed
  as iteration 4 starts with the replication round in flight dropped: the survivors roll back
  to iteration 2 and the spare takes rank 2's buffers from its holder. Every lm loss and every
  rank's final digest of parameters and buffers must be the failure-free run's.
- MoE with expert parallelism (the same model at EP 2 over DP 4, two ranks per node + a
  spare): experts 0-1 live on ranks 0 and 2, experts 2-3 on ranks 1 and 3 (Megatron's expert
  data-parallel groups [0, 2] and [1, 3], on different nodes); the expert optimizer is a second
  distributed optimizer over those groups. Each rank's replica (dense and expert shard) is held
  by the rank with the same experts on the other node: rank 2's by rank 0. A killed rank 2
  (both tags) and a hung rank 2 (newest tag) are restored from rank 0: every lm loss and every
  rank's final digest equal the failure-free run's, and data-parallel peers of the dense part
  end with different digests (different experts) while ranks holding the same experts agree.
  Expert-tensor parallelism (TP 1, expert TP 2, EP 1: each expert split over ranks [0, 1] and
  [2, 3], expert data-parallel groups [0, 2] and [1, 3]): a killed rank 2, restored from rank 0,
  newest tag only (MoE with TP > 1 needs sequence parallelism, which torch's LayerNorm of the
  CPU mode refuses, so TP 1 with expert TP 2 is the expert-tensor layout that runs here). In
  core_v0.16.1 the local experts are not split over expert TP (all four ranks end with the same
  weights, so the digest pattern asserted here does not hold there); a killed rank there, run
  by hand, was bitwise too.
- Interleaved pipeline: PP2 x VPP2 x DP2 + a spare (4 layers, one per virtual stage), a killed
  rank and a hung rank, against the same failure-free run; newest tag only (`Swap.tags`).
- Rank order tp-pp-dp (``--use-tp-pp-dp-mapping``): TP1 x PP2 x DP2 on nodes of 2 + a spare. A
  node holds one pipeline (ranks 0 and 1 under tp-pp-dp; under the default order it would hold
  a data-parallel group, which DeadPool refuses), so each rank's replica is on its
  data-parallel peer under tp-pp-dp on the other node: rank 2's on rank 0. A killed and a hung
  rank 2 are restored from rank 0. Newest tag only: DeadPool's path is the same on both tags
  (each reads ``args.use_tp_pp_dp_mapping`` and builds its groups in order 'tp-cp-ep-pp-dp';
  0.19's extra ``gtp_remat`` axis has size 1), and the driver checks at start-up that the
  layout names the groups Megatron made.
- FP16 (TP2 x DP2 + a spare) with the dynamic loss scaler from an initial scale of 2^20: the
  first three iterations overflow and are skipped (the scale backs off after two, hysteresis
  2), iterations 4 and 5 step. Rank 2 killed as iteration 4 starts (the round in flight
  dropped: the restore iteration 2 and the recomputed iteration 3 are both skipped ones), and
  rank 2 hung as iteration 5 starts (restored at 3 or 4: Adam's state, which the skipped first
  steps had not created, must be rolled back or handed to the spare). Every logged line (loss
  scale, skipped and nan iteration counts, lr, lm loss, grad norm) and every rank's final
  parameters and buffers must be the failure-free run's. With a constant ``--loss-scale``, a
  killed rank. Newest tag only: the loss scalers (`megatron/core/optimizer/grad_scaler.py`),
  `MixedPrecisionOptimizer.prepare_grads` and `train_step`'s handling of a skipped step are the
  same code in core_v0.16.1 (where the killed-rank case, run by hand, was bitwise too).
- Context parallelism: TP 1 x CP 2 x DP 2 + a spare, every rank its own node, a GPT whose
  layers have no attention (``--spec no_attention_gpt layer``, tests/hooks/no_attention:
  Megatron-Core runs context parallelism only in Transformer Engine's attention; the sequence
  split of every batch, the gradients and the distributed optimizer over the 'dp-cp' group are
  Megatron's own). The replicas are placed over the 'dp-cp' group [0, 1, 2, 3], so rank 2's is
  on rank 3, its context-parallel peer. A killed rank 2 (both tags) and a hung rank 2 (newest
  tag) are restored from rank 3, bitwise. With attention: tests/gpu/test_context_parallel.py.

Each model's failure-free run is made once per module (`baselines`) and shared. Skips unless
MEGATRON_LM_PATH lists a tree of the tag (tests/mlm.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
from mlm import (
    HANG_HEARTBEAT,
    NEWEST,
    RUN_TIMEOUT,
    TAGS,
    Run,
    drop_in_flight_env,
    launch,
    megatron_args,
    megatron_lm_tree,
    no_attention_env,
)

ITERS = 5
SPARE = ["--deadpool", "--deadpool-spares", "1", "--use-distributed-optimizer"]
MODELS: dict[str, list[str]] = {
    "moe": [
        *megatron_args(ITERS), *SPARE, "--deadpool-ranks-per-node", "2",
        "--tensor-model-parallel-size", "1",  # MoE with TP needs sequence parallelism
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-score-function",
        "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2",
        "--disable-bias-linear",  # core_v0.19.0's local experts add their bias in place: error
    ],
    "moe-ep": [
        *megatron_args(ITERS), *SPARE, "--deadpool-ranks-per-node", "2",
        "--tensor-model-parallel-size", "1", "--expert-model-parallel-size", "2",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-score-function",
        "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2",
        "--disable-bias-linear",
    ],
    "moe-etp": [
        *megatron_args(ITERS), *SPARE, "--deadpool-ranks-per-node", "2",
        "--tensor-model-parallel-size", "1", "--expert-tensor-parallel-size", "2",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-score-function",
        "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2",
        "--disable-bias-linear",
    ],
    # TP 2 x DP 2; the first 3 iterations overflow (scale 2^20, 2^20, 2^19), 4 and 5 step.
    "fp16": [
        *megatron_args(ITERS), *SPARE, "--deadpool-ranks-per-node", "2",
        "--fp16", "--initial-loss-scale", "1048576", "--loss-scale-window", "3",
    ],
    "fp16-constant": [
        *megatron_args(ITERS), *SPARE, "--deadpool-ranks-per-node", "2",
        "--fp16", "--loss-scale", "4096",
    ],
    # TP 1, 4 layers: two pipeline stages of two virtual stages of one layer; every rank its
    # own failure domain (a rank's data-parallel peer is the other rank of its stage).
    "vpp": [
        *megatron_args(ITERS), *SPARE, "--deadpool-ranks-per-node", "1",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
    ],
    # TP 1, one layer per stage, Megatron's tp-pp-dp order, two ranks per node: pipelines
    # [0, 1] and [2, 3] (one per node), data-parallel groups [0, 2] and [1, 3] (across nodes).
    "tppdp": [
        *megatron_args(ITERS), *SPARE, "--deadpool-ranks-per-node", "2",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        "--use-tp-pp-dp-mapping",
    ],
    # TP 1 x CP 2 x DP 2, every rank its own node, layers without attention (the only model
    # context parallelism trains without Transformer Engine): context-parallel pairs [0, 1]
    # and [2, 3], data-parallel groups [0, 2] and [1, 3], one 'dp-cp' group of all four.
    "cp": [
        *megatron_args(ITERS), *SPARE, "--deadpool-ranks-per-node", "1",
        "--tensor-model-parallel-size", "1", "--context-parallel-size", "2",
        "--spec", "no_attention_gpt", "layer",
    ],
}  # fmt: skip
"""The `pretrain_gpt.py` arguments of each model (argparse keeps an option's last value)."""
MODEL_ENV: dict[str, dict[str, str]] = {"cp": no_attention_env()}
"""The environment a model's processes need beyond the test's own."""


def _env(model: str, *more: dict[str, str]) -> dict[str, str]:
    """`model`'s environment with `more` (each PYTHONPATH kept: joined)."""
    env: dict[str, str] = {}
    for part in (MODEL_ENV.get(model, {}), *more):
        for key, value in part.items():
            joined = key == "PYTHONPATH" and key in env
            env[key] = os.pathsep.join([env[key], value]) if joined else value
    return env


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Run]:
    """`baselines(tag, model)`: the failure-free run of `model` on `tag`'s tree, made once per
    module."""
    done: dict[tuple[str, str], Run] = {}

    def get(tag: str, model: str) -> Run:
        if (tag, model) not in done:
            tmp = tmp_path_factory.mktemp(f"mlm-{model}-{tag}")
            run = launch(tmp, "baseline", megatron_lm_tree(tag) / "pretrain_gpt.py",
                         MODELS[model], env=_env(model))  # fmt: skip
            assert run.returncode == 0, run.describe()
            seen = logged(run) if model.startswith("fp16") else run.iterations()
            assert sorted(seen) == list(range(1, ITERS + 1)), run.describe()
            done[tag, model] = run
        return done[tag, model]

    return get


def _assert_same_training(run: Run, baseline: Run) -> None:
    """Every logged iteration (lr, lm loss, grad norm) and every rank's digest of its final
    parameters and buffers equal the failure-free run's."""
    assert run.returncode == 0, run.describe()
    assert run.iterations() == baseline.iterations(), run.describe()
    assert sorted(run.iterations()) == list(range(1, ITERS + 1))
    assert run.summary["param_digests"] == baseline.summary["param_digests"]


_LOG_LINE = re.compile(r"\] iteration\s+(\d+)/\s*\d+ \|(.*loss scale: .*)$", re.MULTILINE)


def logged(run: Run) -> dict[int, list[str]]:
    """iteration -> the fields of Megatron's log line but its timing (skipped iterations log no
    lm loss or grad norm: `Run.iterations` does not see them), each logged exactly once."""
    found: dict[int, list[str]] = {}
    for m in _LOG_LINE.finditer(run.text):
        it = int(m.group(1))
        assert it not in found, f"iteration {it} logged twice"
        fields = [f.strip() for f in m.group(2).split("|")]
        found[it] = [f for f in fields if f and not f.startswith("elapsed time")]
    return found


def _assert_same_fp16_training(run: Run, baseline: Run) -> None:
    """Every field of every logged line and every rank's final parameters and buffers equal
    the failure-free run's."""
    assert run.returncode == 0, run.describe()
    assert logged(run) == logged(baseline), run.describe()
    assert sorted(logged(run)) == list(range(1, ITERS + 1))
    assert run.summary["param_digests"] == baseline.summary["param_digests"]


def _hung(tag: str, model: str, tmp: Path, at: int = 4) -> Run:
    """Rank 2 stopped (SIGSTOP) as iteration `at` starts: only its silence names it, the spare
    takes its slot, and the survivors restore iteration `at` - 2 or `at` - 1 (whether that
    round was committed), recomputing at most one."""
    args = [*MODELS[model], *HANG_HEARTBEAT, "--deadpool-fail", f"2@{at}:hang"]
    run = launch(tmp, "hang", megatron_lm_tree(tag) / "pretrain_gpt.py", args, env=_env(model))
    assert run.returncode == 0, run.describe()
    (rec,) = run.summary["recoveries"]
    assert rec["dead_ranks"] == [2] and rec["replaced_by"] == {"2": "s0"}
    assert rec["restore_iteration"] in (at - 2, at - 1) and rec["recomputed_iterations"] <= 1
    return run


def _killed(tag: str, model: str, tmp: Path, extra: tuple[str, ...] = ()) -> Run:
    """Rank 2 SIGKILLed as iteration 4 starts, the round in flight dropped: the survivors roll
    back to iteration 2 and recompute iteration 3, the spare restores from rank 2's holder.
    `extra`: more arguments (argparse keeps an option's last value)."""
    args = [*MODELS[model], *extra, "--deadpool-fail", "2@4"]
    run = launch(tmp, "swap", megatron_lm_tree(tag) / "pretrain_gpt.py", args,
                 env=_env(model, drop_in_flight_env()))  # fmt: skip
    (rec,) = run.summary["recoveries"] or [None]
    assert rec is not None, run.describe()
    assert rec["dead_ranks"] == [2] and rec["replaced_by"] == {"2": "s0"}
    assert rec["restore_iteration"] == 2 and rec["recomputed_iterations"] == 1
    return run


EP_PLACEMENT = (
    "tp 1 x pp 1 x dp 4 (experts: etp 1 x ep 2 x expert dp 2) in rank order tp-dp-pp, 2 rank(s) "
    "per node; owner->holders (data-parallel peers of dense and expert layers under tp-dp-pp on "
    "other nodes): 0->[2], 1->[3], 2->[0], 3->[1]"
)
"""Rank 0's log line of the placement with EP 2: each rank's replica on the rank holding the
same experts on the other node."""
ETP_PLACEMENT = (
    "tp 1 x pp 1 x dp 4 (experts: etp 2 x ep 1 x expert dp 2) in rank order tp-dp-pp, 2 rank(s) "
    "per node; owner->holders (data-parallel peers of dense and expert layers under tp-dp-pp on "
    "other nodes): 0->[2], 1->[3], 2->[0], 3->[1]"
)
TP_PP_DP_PLACEMENT = (
    "tp 1 x pp 2 x dp 2 in rank order tp-pp-dp, 2 rank(s) per node; owner->holders "
    "(data-parallel peers under tp-pp-dp on other nodes): 0->[2], 1->[3], 2->[0], 3->[1]"
)
"""Rank 0's log line of the placement: each rank's replica on its data-parallel peer under
tp-pp-dp, on the other node (under the default order ranks 0 and 1 would be peers)."""
CP_PLACEMENT = (
    "tp 1 x cp 2 x pp 1 x dp 2 in rank order tp-dp-pp, 1 rank(s) per node; owner->holders "
    "(data- and context-parallel peers under tp-dp-pp on other nodes): 0->[1], 1->[2], 2->[3], "
    "3->[0]"
)
"""Rank 0's log line of the placement with CP 2: the distributed optimizer is sharded over the
'dp-cp' group [0, 1, 2, 3], and rank 2's replica is on rank 3, its context-parallel peer (its
data-parallel peer is rank 0)."""


def _from_the_rank_with_the_same_experts(run: Run, placement: str = EP_PLACEMENT) -> None:
    """Replicas placed among ranks holding the same experts, rank 2's shards came from rank 0;
    ranks 0 and 2 (experts 0-1, or the first halves of every expert) end equal, as do 1 and 3,
    and the two differ."""
    assert placement in run.text, run.describe()
    digests = run.summary["param_digests"]
    assert digests["0"] == digests["2"] != digests["1"] == digests["3"]
    assert "shards from rank 0 -> rank 2" in run.text, run.describe()
    (rec,) = run.summary["recoveries"]
    assert rec["stale_group_refs"] == 0, rec


def _from_data_parallel_peer(run: Run) -> None:
    """The replicas were placed under tp-pp-dp and rank 2's shard came from rank 0; Megatron's
    stages are those of tp-pp-dp too: ranks 0 and 2 (stage 0) end with the same parameters,
    as do 1 and 3 (stage 1)."""
    assert TP_PP_DP_PLACEMENT in run.text, run.describe()
    digests = run.summary["param_digests"]
    assert digests["0"] == digests["2"] != digests["1"] == digests["3"]
    assert "agreed: restore iteration" in run.text and "shards from rank 0 -> rank 2" in run.text


def _from_the_context_parallel_peer(run: Run) -> None:
    """Replicas placed over the 'dp-cp' group, rank 2's shard restored from rank 3 (its
    context-parallel peer); all four ranks hold the same weights and end equal."""
    assert CP_PLACEMENT in run.text, run.describe()
    assert "shards from rank 3 -> rank 2" in run.text, run.describe()
    assert len(set(run.summary["param_digests"].values())) == 1
    (rec,) = run.summary["recoveries"]
    assert rec["stale_group_refs"] == 0, rec


def _placed(placement: str) -> Callable[[Run], None]:
    """A check that a run's log shows `placement` (rank 0's line)."""

    def check(run: Run) -> None:
        assert placement in run.text, run.describe()

    return check


def _silence_named(run: Run) -> None:
    """The launcher named the hung process by its silence and killed it."""
    assert re.search(r"process a2 silent for [\d.]+s \(hung\); killed", run.text), run.describe()


def _skipped(line: list[str]) -> int:
    (field,) = [f for f in line if f.startswith("number of skipped iterations:")]
    return int(field.split(":")[1])


def _three_skipped_then_two_steps(baseline: Run) -> None:
    """The FP16 run: iterations 1-3 overflow and are skipped (no lm loss logged), the scale
    backs off from 2^20 to 2^18, iterations 4 and 5 step."""
    lines = logged(baseline)
    assert [_skipped(lines[it]) > 0 for it in range(1, ITERS + 1)] == [True] * 3 + [False] * 2
    assert all(not any(f.startswith("lm loss") for f in lines[it]) for it in (1, 2, 3))
    scales = [f for it in sorted(lines) for f in lines[it] if f.startswith("loss scale")]
    assert (
        scales == ["loss scale: 1048576.0", "loss scale: 524288.0"] + ["loss scale: 262144.0"] * 3
    )


def _none_skipped(baseline: Run) -> None:
    """A constant loss scale: no iteration skipped."""
    assert all(_skipped(line) == 0 for line in logged(baseline).values())


def _nothing(run: Run) -> None:
    """No check beyond bitwise-equal training."""


@dataclass(frozen=True)
class Swap:
    """Rank 2 of `model` lost and hot-swapped; training must end bitwise equal to the
    failure-free run's (`_assert_same_training`, every logged field with FP16), and the
    failure-free run and the swapped run must each pass their own check."""

    name: str
    model: str
    hang_at: int | None = None
    """None: killed as iteration 4 starts (`_killed`); else stopped as that iteration starts
    (`_hung`)."""
    extra: tuple[str, ...] = ()
    """More arguments of the swapped run (`_killed`'s)."""
    tags: tuple[str, ...] = (NEWEST,)
    """The tags it runs on: by default the newest only (the interleaved pipeline's runs take
    about 50 s each on 2 cores, over the suite's 45 s bound for running a case on both tags)."""
    baseline_check: Callable[[Run], None] = _nothing
    """What the failure-free run must show, checked before the swapped run."""
    run_check: Callable[[Run], None] = _nothing
    """What the swapped run must show."""


SWAPS = (
    Swap("moe-killed", "moe", tags=TAGS),
    Swap("moe-ep-killed", "moe-ep", tags=TAGS, baseline_check=_placed(EP_PLACEMENT),
         run_check=_from_the_rank_with_the_same_experts),
    # Every rank its own node: the nearest data-parallel peer of rank 2 is rank 3, which holds
    # the other experts (a dense placement's ring would put rank 2's replica there); it goes to
    # rank 0, the rank with the same experts, and the coordinator, which learns the expert
    # layout from rank 0, names rank 0 as the newcomer's source.
    Swap("moe-ep-one-rank-per-node-killed", "moe-ep", extra=("--deadpool-ranks-per-node", "1"),
         run_check=partial(_from_the_rank_with_the_same_experts,
                           placement=EP_PLACEMENT.replace("2 rank(s)", "1 rank(s)"))),
    Swap("moe-ep-hung", "moe-ep", hang_at=4, run_check=_from_the_rank_with_the_same_experts),
    Swap("moe-etp-killed", "moe-etp",
         run_check=partial(_from_the_rank_with_the_same_experts, placement=ETP_PLACEMENT)),
    Swap("vpp-killed", "vpp"),
    Swap("vpp-hung", "vpp", hang_at=4, run_check=_silence_named),
    Swap("tppdp-killed", "tppdp", baseline_check=_placed(TP_PP_DP_PLACEMENT),
         run_check=_from_data_parallel_peer),
    Swap("tppdp-hung", "tppdp", hang_at=4, run_check=_from_data_parallel_peer),
    # Killed as iteration 4 starts: the restore iteration (2) and the recomputed one (3) are
    # skipped for overflow; the scaler's backed-off scale and hysteresis come from the snapshot
    # (the spare's own scaler is at its initial state).
    Swap("fp16-killed", "fp16", baseline_check=_three_skipped_then_two_steps),
    # Stopped as iteration 5 starts, after the first step that updated (4): Adam's state,
    # created up front when the snapshot layout was fixed at the skipped iteration 1, is rolled
    # back or handed to the spare with the scaler's growth tracker.
    Swap("fp16-hung", "fp16", hang_at=5),
    Swap("fp16-constant-killed", "fp16-constant", baseline_check=_none_skipped),
    Swap("cp-killed", "cp", tags=TAGS, baseline_check=_placed(CP_PLACEMENT),
         run_check=_from_the_context_parallel_peer),
    Swap("cp-hung", "cp", hang_at=4, run_check=_from_the_context_parallel_peer),
)  # fmt: skip
"""Every hot swap of this module, named as in its test ids (`{name}-{tag}`)."""


@pytest.mark.timeout(3 * RUN_TIMEOUT)
@pytest.mark.parametrize(
    "swap,tag", [pytest.param(s, t, id=f"{s.name}-{t}") for s in SWAPS for t in s.tags]
)
def test_a_lost_rank_is_hot_swapped_bitwise(
    baselines, swap: Swap, tag: str, tmp_path: Path
) -> None:
    baseline = baselines(tag, swap.model)
    swap.baseline_check(baseline)
    if swap.hang_at is None:
        run = _killed(tag, swap.model, tmp_path, swap.extra)
    else:
        run = _hung(tag, swap.model, tmp_path, at=swap.hang_at)
    if swap.model.startswith("fp16"):
        _assert_same_fp16_training(run, baseline)
    else:
        _assert_same_training(run, baseline)
    swap.run_check(run)
