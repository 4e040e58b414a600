"""The embedded job with experts (`deadpool train --num-experts 4 --ep 2`), hot-swapped bitwise.

An MoE GPT (Megatron-Core's local MoE layers, 4 experts, top 2, tokens dispatched all-to-all)
at TP 1 x DP 4 with expert parallelism 2, two ranks per node and a spare: experts 0-1 live on
ranks 0 and 2, experts 2-3 on ranks 1 and 3 (Megatron's expert data-parallel groups [0, 2] and
[1, 3], on different nodes), and the expert optimizer is a second distributed optimizer over
those groups (chained). Each rank's replica - dense and expert shard - is on the rank holding
the same experts on the other node. Rank 2 killed as iteration 4 starts: the spare restores
from rank 0, and every loss and every rank's final digest equal the failure-free run's;
ranks holding the same experts end equal, data-parallel peers with other experts do not.
With no spare the same failure ends the run: the survivors save every shard (both optimizers'),
a Megatron checkpoint was saved at iteration 2 with the expert layers' sharded state, and
`--load` resumes bitwise.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from conftest import TrainRun, assert_out_of_redundancy, run_deadpool, train_case

ITERS = "6"
MOE = ["--tp", "1", "--dp", "4", "--num-experts", "4", "--ep", "2", "--ranks-per-node", "2"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("moe"))


@cache
def _run(case: str, root: str, *args: str) -> TrainRun:
    return train_case(Path(root) / case, [*MOE, *args], ITERS)


def _reference(root: str) -> dict[str, Any]:
    return _ok(_run("reference", root, "--spares", "0"))


def _ok(run: TrainRun) -> dict[str, Any]:
    proc, records, summary = run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["loss"] for r in records] == summary["losses"]
    assert len(summary["losses"]) == int(ITERS)
    return summary


@pytest.mark.timeout(600)
def test_moe_with_expert_parallelism_killed_rank_is_restored_from_the_rank_with_its_experts(
    root: str,
) -> None:
    reference = _reference(root)
    digests = reference["rank_digests"]
    assert digests["0"] == digests["2"] != digests["1"] == digests["3"]
    assert reference["dp_replicas_identical"]

    proc, _, summary = _run("kill", root, "--spares", "1", "--fail", "2@4")
    _ok((proc, _, summary))
    assert summary["losses"] == reference["losses"]
    assert summary["rank_digests"] == digests
    assert summary["final_param_digest"] == reference["final_param_digest"]
    (rec,) = summary["recoveries"]
    assert rec["dead_ranks"] == [2] and rec["stale_group_refs"] == 0, rec
    assert "shards from rank 0 -> rank 2" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.timeout(600)
def test_moe_out_of_redundancy_saves_every_shard_and_load_resumes_bitwise(root: str) -> None:
    reference = _reference(root)
    out = Path(root) / "no_spare"
    proc, _, summary = _run(
        "no_spare", root, "--spares", "0", "--fail", "2@4",
        "--save", str(out / "ckpt"), "--save-interval", "2",
    )  # fmt: skip
    report = summary["out_of_redundancy"]
    assert_out_of_redundancy(proc, report, out, survivors=[0, 1, 3])
    assert report["save"]["complete"] and report["save"]["sources"] == {"2": 0}
    assert (out / "ckpt" / "iter_0000002").is_dir()  # Megatron's own checkpoint, experts in
    resumed = run_deadpool(
        "train", *MOE, "--iters", ITERS, "--load", str(out / "ckpt"),
        "--json-log", str(out / "resume.jsonl"), timeout=240,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    last = json.loads((out / "resume.jsonl").read_text().splitlines()[-1])
    assert last["losses"] == reference["losses"][-len(last["losses"]) :]
    assert last["rank_digests"] == reference["rank_digests"]


@pytest.mark.timeout(120)
def test_moe_flags_are_checked_up_front(deadpool_cli: Any) -> None:
    """Tensor parallelism with experts needs sequence parallelism (refused, naming the way
    out); an expert size without experts is refused; ep must divide the experts."""
    for args, message in (
        (["--tp", "2", "--num-experts", "4"], "train the MoE model at tp 1"),
        (["--tp", "1", "--dp", "4", "--ep", "2"], "apply to MoE models only"),
        (["--tp", "1", "--dp", "4", "--num-experts", "3", "--ep", "2"], "must divide"),
    ):
        proc = deadpool_cli("train", *args, "--iters", "1")
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
