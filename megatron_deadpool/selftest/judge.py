"""The verdict of each training-run check, from the run's summary and records (pure).

The runs are `deadpool train` runs (`embedded.launch.LocalLauncher`): the summary is the last
line of their JSON log and the records are rank 0's per-iteration lines. A check passes only
when the run did what DeadPool promises; the detail names what differed otherwise.
"""

from __future__ import annotations

import statistics
from typing import Any

from ..units import human_bytes
from .table import Row

REPLICATION = "replication"
PEER_KILLED = "peer killed"
PEER_FROZEN = "peer frozen"
CROSS_RANK = (REPLICATION, PEER_KILLED, PEER_FROZEN)
"""The checks that need two ranks or more: without any of them the selftest is incomplete."""


def _failed_run(check: str, seconds: float, summary: dict[str, Any], returncode: int) -> Row:
    why = (summary.get("out_of_redundancy") or {}).get("reason")
    reason = "ran past its time limit" if returncode == 124 else f"exited with code {returncode}"
    return Row(check, "fail", seconds, f"the run {reason}" + (f" ({why})" if why else ""))


def replication(
    seconds: float,
    returncode: int,
    summary: dict[str, Any],
    records: list[dict[str, Any]],
    iters: int,
    holders: list[list[int]],
) -> Row:
    """A failure-free run: every iteration's round committed (the globally agreed commit of
    round t arrives with iteration t+1, the last one at the end), the data-parallel replicas
    identical at the end. `holders[r]`: the ranks holding rank r's replica."""
    if returncode != 0:
        return _failed_run(REPLICATION, seconds, summary, returncode)
    problems = []
    if len(records) != iters:
        problems.append(f"{len(records)} of {iters} iterations reported")
    late = [
        r["iteration"]
        for r in records
        if r["iteration"] > 1 and r.get("committed_iteration") != r["iteration"] - 1
    ]
    if late:
        problems.append(f"round not committed by the next iteration at iteration(s) {late}")
    if summary.get("committed_iteration") != iters:
        problems.append(
            f"final committed iteration {summary.get('committed_iteration')}, expected {iters}"
        )
    if not summary.get("dp_replicas_identical"):
        problems.append("data-parallel replicas of the parameters differ at the end")
    per_round = records[-1].get("replica_bytes_sent", 0) if records else 0
    added_s = statistics.median(r["replication_s"] for r in records) if records else None
    parts = sorted({k for r in records for k in r.get("replication_parts_s", {})})
    data = {
        "iterations": len(records),
        "committed_iteration": summary.get("committed_iteration"),
        "bytes_per_round_per_rank": per_round,
        "median_replication_s_per_iter": added_s,
        "median_replication_parts_s": {
            k: statistics.median(
                r["replication_parts_s"][k] for r in records if k in r["replication_parts_s"]
            )
            for k in parts
        },
        "median_iter_time_s": summary.get("median_iter_time_s"),
        "holders": {str(r): hs for r, hs in enumerate(holders)},
        "final_param_digest": summary.get("final_param_digest"),
    }
    if problems:
        return Row(REPLICATION, "fail", seconds, "; ".join(problems), data)
    placed = ", ".join(f"{r}->{'/'.join(map(str, hs))}" for r, hs in enumerate(holders))
    detail = (
        f"{iters}/{iters} rounds committed on {len(holders)} ranks (replica holders {placed}); "
        f"{human_bytes(per_round)} sent per rank per round; replication adds {added_s:.4f} s "
        f"to an iteration of {summary.get('median_iter_time_s') or 0:.3f} s (medians)"
    )
    return Row(REPLICATION, "pass", seconds, detail, data)


def hot_swap(
    check: str,
    seconds: float,
    returncode: int,
    summary: dict[str, Any],
    reference: dict[str, Any] | None,
    rank: int,
    detect_limit_s: float | None = None,
) -> Row:
    """A run in which `rank` failed once: one recovery replaced it with a spare, at most one
    iteration was recomputed, and the losses and final parameters equal the failure-free
    `reference` summary's bitwise. `detect_limit_s`: the longest the failure may take to be
    detected (a frozen peer: the heartbeat timeout and one heartbeat interval)."""
    if returncode != 0:
        return _failed_run(check, seconds, summary, returncode)
    recoveries = summary.get("recoveries") or []
    data: dict[str, Any] = {"recoveries": recoveries}
    problems = []
    if len(recoveries) != 1:
        problems.append(f"{len(recoveries)} recoveries, expected 1")
    rec = recoveries[0] if recoveries else {}
    spare = (rec.get("replaced_by") or {}).get(str(rank), "")
    if recoveries and (rec.get("dead_ranks") != [rank] or not spare.startswith("s")):
        problems.append(
            f"recovery replaced {rec.get('replaced_by')} (dead {rec.get('dead_ranks')}), "
            f"expected rank {rank} by a spare"
        )
    recomputed = rec.get("recomputed_iterations", 0)
    if recomputed > 1:
        problems.append(f"{recomputed} iterations recomputed, at most 1 allowed")
    detect = (rec.get("phases_s") or {}).get("detect")
    if detect_limit_s is not None and detect is not None and detect > detect_limit_s:
        problems.append(f"detected after {detect:.2f} s, limit {detect_limit_s:.2f} s")
    if reference is None or not reference.get("final_param_digest"):
        problems.append("no failure-free digest to compare with (the replication check failed)")
    else:
        digest = summary.get("final_param_digest")
        data["final_param_digest"] = digest
        if digest != reference["final_param_digest"]:
            problems.append(
                f"final parameter digest {str(digest)[:16]} differs from the failure-free "
                f"run's {reference['final_param_digest'][:16]}"
            )
        if summary.get("losses") != reference.get("losses"):
            problems.append("losses differ from the failure-free run's")
    if problems:
        return Row(check, "fail", seconds, "; ".join(problems), data)
    phases = ", ".join(f"{k} {v:.2f}" for k, v in rec["phases_s"].items())
    detail = (
        f"rank {rank} replaced by spare {spare}; recovered in {rec['total_s']:.2f} s "
        f"({phases}); {recomputed} iteration(s) recomputed; losses and final digest "
        f"{summary['final_param_digest'][:16]} equal to the failure-free run's"
    )
    return Row(check, "pass", seconds, detail, data)
