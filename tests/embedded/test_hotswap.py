"""Hot swap end to end: real processes, real signals, real megatron-core on gloo.

Each case runs `deadpool train` with injected failures (SIGKILL then SIGSTOP in one run, a
whole node, a pipeline-parallel rank) and checks that the run ends with exactly the losses and
the parameter digest of the failure-free run, recomputes at most one iteration, and leaves no object
holding a process group of an aborted generation. Failures memory cannot recover end the run
with exit code 3, the reason on the launcher's output and in each survivor's log, and a report
naming the lost ranks and shards. The job's own error (an exception before anything was
replicated, or a spare raising what the rank it replaced raised) is no failure to hot-swap: the
run ends at once with exit code 9 and that error, no spare spent on it.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from conftest import TrainRun, assert_out_of_redundancy, hung_silence_s, run_deadpool, train_case

from megatron_deadpool.devices import reconfigure
from megatron_deadpool.hotswap.worker import group_repair

ITERS = "6"
NO_REPAIR_TO_DIE_IN = pytest.mark.skipif(
    not reconfigure.choose("gloo").repair,
    reason="torch < 2.14 (or DEADPOOL_GROUP_REPAIR=rebuild): no repair in place to die in",
)
"""The cases of a death in a repair of the groups in place: where torch repairs none, skipped."""
CASES: dict[str, list[str]] = {
    # The TP2 x DP2 cases compare against the session's shared failure-free run (`tp_reference`).
    "ref_pp": ["--pp", "2", "--dp", "2"],
    # One run, two failures: a crash, then a hang (SIGSTOP) of another rank.
    "kill_then_hang": [
        "--tp", "2", "--dp", "2", "--spares", "2", "--fail", "2@3", "--fail", "1@5:hang",
    ],
    "pp_kill": ["--pp", "2", "--dp", "2", "--spares", "1", "--fail", "3@4"],
    "node": ["--tp", "2", "--dp", "2", "--spares", "2", "--fail", "node:1@3"],
    # With --save: memory still holds every shard, so survivors save a complete set.
    "no_spare": ["--tp", "2", "--dp", "2", "--spares", "0", "--fail", "2@4", "--save", "{ckpt}"],
    # The same with Megatron checkpoints as well: what --load falls back on.
    "no_spare_interval": [
        "--tp", "2", "--dp", "2", "--spares", "0", "--fail", "2@4", "--save", "{ckpt}",
        "--save-interval", "2",
    ],
    # Rank 2 killed right after training completed (its last step done and replicated).
    "lost_at_end": [
        "--tp", "2", "--dp", "2", "--spares", "1", "--fail", "2@end", "--save", "{ckpt}",
    ],
    # Every rank raises as iteration 1 starts: an error of the job's start-up.
    "start_up_error": [
        "--tp", "2", "--dp", "2", "--spares", "1", "--fail", "node:0@1:raise", "--fail",
        "node:1@1:raise",
    ],
    # Rank 2 raises as iteration 4 starts, in whichever process holds it: the spare that takes
    # its slot raises the same.
    "same_error_again": ["--tp", "2", "--dp", "2", "--spares", "2", "--fail", "2@4:raise"],
    # Rank 1 dies in the repair of generation 1's groups in place (torch >= 2.14), its handles
    # published: its peers wait for it in gloo's reconfigure.
    "death_in_repair": [
        "--tp", "2", "--dp", "2", "--spares", "2", "--fail", "2@3", "--fail", "1@repair",
    ],
    # Rank 0 hangs in generation 1's repair before it published its handles, which the newcomer
    # taking rank 1 reads for the survivors' prefix: a hang, so that the newcomer claimed its
    # slot and waits there before the coordinator sees the loss (a crash can be seen first).
    "hang_before_handles": [
        "--tp", "2", "--dp", "2", "--spares", "2", "--fail", "1@3", "--fail", "0@handles:hang",
    ],
    "owner_and_holder": [
        "--tp", "2", "--dp", "2", "--spares", "2", "--fail", "0@3", "--fail", "2@3", "--save",
        "{ckpt}", "--save-interval", "2",
    ],
}  # fmt: skip


@cache
def run(case: str, root: str) -> tuple[subprocess.CompletedProcess, list[dict[str, Any]], dict]:
    return train_case(Path(root) / case, CASES[case], ITERS)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("hotswap"))


@pytest.fixture(scope="module")
def tp_reference(failure_free: Callable[[int], TrainRun]) -> dict[str, Any]:
    """The summary of the failure-free TP2 x DP2 run of ITERS iterations (conftest: shared with
    test_faults, test_frozen_peer and test_train)."""
    return failure_free(int(ITERS))[2]


def _check_recovered(case: str, reference: dict, root: str, dead: list[list[int]]) -> dict:
    proc, records, summary = run(case, root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["losses"] == reference["losses"]
    assert [r["loss"] for r in records] == summary["losses"]  # the JSON log: one line each
    assert summary["final_param_digest"] == reference["final_param_digest"]
    assert summary["dp_replicas_identical"]
    recoveries = summary["recoveries"]
    assert [r["dead_ranks"] for r in recoveries] == dead
    for rec in recoveries:
        assert rec["recomputed_iterations"] <= 1, rec
        assert rec["stale_group_refs"] == 0, rec
        assert set(rec["phases_s"]) == {
            "detect",
            "agree",
            "reconstruct",
            "restore",
            "first_iteration",
        }
        assert rec["total_s"] > 0
        # The reconstruct's wait for the newcomers' builds: the last claim, before any joined.
        assert 0 <= rec["newcomers_claimed_s"] <= rec["phases_s"]["reconstruct"], rec
    assert "recovered in" in proc.stdout and "agreed: restore iteration" in proc.stdout
    # Reference counting alone freed every released group: a group still referenced (say, from
    # a frame) costs a full garbage collection, ~0.5 s of the recovery, and stays alive anyway.
    logs = [log.read_text() for log in (Path(root) / case / "logs").glob("*.log")]
    for text in logs:
        assert "are still referenced somewhere" not in text, text[-3000:]
    # Survivors and newcomers restore through a snapshotter of the shard's layout, which the
    # next replicator keeps (`snapshot.load_snapshot`): none walks its state again.
    restored = [x for text in logs for x in text.splitlines() if "INFO restored iteration" in x]
    assert len(restored) >= 4 * len(dead), restored
    assert not [x for x in restored if "its snapshotter built anew" in x], restored
    return summary


def _log_text(root: str, case: str) -> str:
    """Every process's log of `case`, joined."""
    return "\n".join(p.read_text() for p in (Path(root) / case / "logs").glob("*.log"))


@pytest.mark.timeout(600)
def test_killed_then_hung_ranks_are_replaced_bitwise(root: str, tp_reference: dict) -> None:
    summary = _check_recovered("kill_then_hang", tp_reference, root, [[2], [1]])
    assert [r["generation"] for r in summary["recoveries"]] == [1, 2]
    events = (Path(root) / "kill_then_hang" / "logs" / "events.jsonl").read_text()
    dead = [json.loads(x)["why"] for x in events.splitlines() if '"process_dead"' in x]
    # The crash is seen by the launcher as the process exits, not by a heartbeat timeout (how
    # long detection takes: `deadpool bench recovery`, its "detect failure" row).
    assert len(dead) == 2 and dead[0] == "exited with code -9", dead
    # The hang only by the heartbeat timeout (3 s): declared after that long a silence. (The
    # recovery's `detect` phase runs from the fault's stamp, which can come up to a heartbeat
    # interval after the last beat, so it may be shorter than the timeout.)
    silence = hung_silence_s(dead[1])
    assert silence is not None and silence >= 3.0, dead


@pytest.mark.timeout(600)
def test_pipeline_parallel_rank_is_replaced_bitwise(root: str) -> None:
    _check_recovered("pp_kill", run("ref_pp", root)[2], root, [[3]])


@pytest.mark.timeout(600)
def test_whole_node_is_replaced_by_two_spares(root: str, tp_reference: dict) -> None:
    _check_recovered("node", tp_reference, root, [[2, 3]])


def _resume(
    case: str, root: str, reference: dict[str, Any], says: tuple[str, ...] = ()
) -> dict[str, Any]:
    """`--load` the directory the failed run saved into; the run must end as if unbroken (and
    its output contain each of `says`)."""
    out = Path(root) / case
    proc = run_deadpool(
        "train",
        "--tp",
        "2",
        "--dp",
        "2",
        "--iters",
        ITERS,
        "--load",
        str(out / "ckpt"),
        "--json-log",
        str(out / "resume.jsonl"),
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(part in proc.stdout for part in says), proc.stdout[-3000:]
    summary = json.loads((out / "resume.jsonl").read_text().splitlines()[-1])
    assert summary["losses"] == reference["losses"][-len(summary["losses"]) :]
    assert summary["final_param_digest"] == reference["final_param_digest"]
    return summary


@pytest.mark.timeout(600)
def test_no_spare_left_saves_every_shard_and_resumes_exactly(root: str, tp_reference: dict) -> None:
    proc, _, summary = run("no_spare", root)
    report = summary["out_of_redundancy"]
    assert_out_of_redundancy(proc, report, Path(root) / "no_spare", survivors=[0, 1, 3])
    assert report["dead_ranks"] == [2] and report["lost_ranks"] == []  # nothing lost
    assert "no spare left" in report["reason"]
    assert report["save"]["complete"] and report["save"]["sources"] == {"2": 0}
    assert summary["final_param_digest"] is None
    manifest = json.loads(
        next(
            (Path(root) / "no_spare" / "ckpt" / "deadpool").glob("iter_*/manifest.json")
        ).read_text()
    )
    assert manifest["complete"] and manifest["ranks_present"] == [0, 1, 2, 3]
    resumed = _resume("no_spare", root, tp_reference)
    assert len(resumed["losses"]) == int(ITERS) - manifest["iteration"]


@pytest.mark.timeout(600)
def test_load_passes_over_a_damaged_snapshot_set_and_resumes_exactly(
    root: str, tp_reference: dict
) -> None:
    """The newest complete set has one flipped bit in rank 1's file (a write that did not reach
    the disk whole, or damage since): `--load` checks every file before any rank resumes,
    passes the set over in one line, and every rank resumes from the Megatron checkpoint
    instead - bitwise the failure-free run from there."""
    from megatron_deadpool.replication import save_dir, snapshot_set

    proc, _, _ = run("no_spare_interval", root)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    ckpt = Path(root) / "no_spare_interval" / "ckpt"
    t = snapshot_set.latest_complete(ckpt)
    megatron = save_dir.latest_iteration(ckpt)
    assert t is not None and megatron is not None and t >= megatron, (t, megatron)
    damaged = snapshot_set.rank_file(ckpt, t, 1)
    data = bytearray(damaged.read_bytes())
    data[100] ^= 1 << 5
    damaged.write_bytes(bytes(data))
    where = snapshot_set.set_dir(ckpt, t)
    says = (
        f"--load {ckpt}: passed over the damaged snapshot set {where} (rank_00001.snap: checksum",
        f"); resuming from the Megatron checkpoint of iteration {megatron}\n",
    )
    resumed = _resume("no_spare_interval", root, tp_reference, says)
    assert len(resumed["losses"]) == int(ITERS) - megatron


@pytest.mark.timeout(600)
def test_a_full_disk_during_the_out_of_redundancy_save_ends_with_code_3_and_no_temporary_file(
    root: str, tmp_path: Path
) -> None:
    """--save on a 64 KiB filesystem (tmpfs in a private mount namespace): the survivors' save
    fails for want of space; the run still ends with exit code 3, each survivor's line says
    what was and was not saved, no traceback, and no temporary file is left there."""
    import os
    import shutil

    from conftest import FAST_HEARTBEAT, SPARE_PATH, deadpool_command

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a small filesystem privately")
    save, listing, out = tmp_path / "save", tmp_path / "listing.txt", tmp_path / "run"
    save.mkdir()
    script = (
        'save=$1 listing=$2; shift 2; mount -t tmpfs -o size=64k tmpfs "$save" || exit 90; '
        '"$@"; rc=$?; find "$save" > "$listing"; exit $rc'
    )
    cmd = [*deadpool_command(), "train", "--tp", "2", "--dp", "2", "--spares", "0", "--fail",
           "2@4", *SPARE_PATH, "--save", str(save), "--iters", ITERS, *FAST_HEARTBEAT,
           "--json-log", str(out / "run.jsonl"), "--run-dir", str(out / "logs")]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", str(save),
         str(listing), *cmd],
        capture_output=True, text=True, timeout=300, check=False, env=env,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    files = listing.read_text().split()
    assert files and not [f for f in files if f.endswith(".tmp")], files
    assert not list(save.iterdir())  # it all went to the private mount, gone with it
    for rank in (0, 1, 3):
        log = (out / "logs" / f"a{rank}.log").read_text(errors="replace")
        assert "Traceback" not in log, log[-3000:]
        line = next(x for x in log.splitlines() if "out of redundancy: " in x)
        assert "could not save to " in line and "No space left on device" in line, line
        assert "saved nothing, not ranks [" in line and "the set is incomplete" in line, line


@pytest.mark.timeout(600)
def test_owner_and_its_holder_lost_together_is_reported_and_resumable(
    root: str, tp_reference: dict
) -> None:
    proc, _, summary = run("owner_and_holder", root)
    report = summary["out_of_redundancy"]
    assert_out_of_redundancy(proc, report, Path(root) / "owner_and_holder", survivors=[1, 3])
    assert report["lost_ranks"] == [0, 2]
    assert report["lost_shards_holders"] == {"0": [2], "2": [0]}
    assert "no surviving copy" in report["reason"]
    assert report["save"] and not report["save"]["complete"]
    manifest = json.loads(
        next(
            (Path(root) / "owner_and_holder" / "ckpt" / "deadpool").glob("iter_*/manifest.json")
        ).read_text()
    )
    assert manifest["ranks_missing"] == [0, 2] and not manifest["complete"]
    resumed = _resume(
        "owner_and_holder", root, tp_reference
    )  # from the Megatron checkpoint of iteration 2
    assert len(resumed["losses"]) == int(ITERS) - 2


@pytest.mark.timeout(600)
def test_a_rank_lost_after_training_completed_costs_nothing(root: str, tp_reference: dict) -> None:
    """No recovery (nothing to recompute), no live rank reported dead, the run succeeds with
    the failure-free losses and weights, and the survivors save the final state - the dead
    rank's from its holder's memory - as a complete snapshot set that `--load` resumes from."""
    proc, records, summary = run("lost_at_end", root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reference = tp_reference
    assert [r["loss"] for r in records] == summary["losses"] == reference["losses"]
    assert summary["final_param_digest"] == reference["final_param_digest"]
    assert summary["recoveries"] == []
    lost = summary["lost_after_training"]
    assert lost["dead_ranks"] == [2] and lost["completed_iteration"] == int(ITERS)
    assert lost["save"] == {
        "iteration": int(ITERS),
        "sources": {"2": 0},
        "complete": True,
        "missing": [],
    }
    assert "lost after training completed" in proc.stdout
    events = [
        json.loads(line)
        for line in (Path(root) / "lost_at_end" / "logs" / "events.jsonl").read_text().splitlines()
    ]
    assert [e["member"] for e in events if e["event"] == "process_dead"] == ["a2"]
    manifest = json.loads(
        (
            Path(root) / "lost_at_end" / "ckpt" / "deadpool" / "iter_0000006" / "manifest.json"
        ).read_text()
    )
    assert manifest["complete"] and manifest["ranks_present"] == [0, 1, 2, 3]
    out = Path(root) / "lost_at_end"
    resumed = run_deadpool(
        "train", "--tp", "2", "--dp", "2", "--iters", ITERS, "--load", str(out / "ckpt"),
        "--json-log", str(out / "resume.jsonl"), timeout=240,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    after = json.loads((out / "resume.jsonl").read_text().splitlines()[-1])
    assert after["losses"] == [] and after["final_param_digest"] == reference["final_param_digest"]


def _events(case: str, root: str) -> list[dict[str, Any]]:
    path = Path(root) / case / "logs" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(300)
def test_an_error_of_every_rank_before_replication_ends_the_job_at_once(root: str) -> None:
    """The exception ends the job with exit code 9, the first failing rank's error as its
    cause and the end of that rank's log; the spare is never given a slot."""
    proc, records, summary = run("start_up_error", root)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 9, out[-3000:]
    cause = re.search(
        r"JOB ERROR: rank (\d) start-up: InjectedError: fault injection: rank (\d) raises at "
        r"iteration 1\n",
        proc.stdout,
    )
    assert cause is not None and cause[1] == cause[2], out[-3000:]
    member = f"a{cause[1]}"
    assert f"{member}'s log (" in proc.stdout and "ends:" in proc.stdout
    assert re.search(rf"{member}\| .*InjectedError: fault injection", proc.stdout), proc.stdout
    assert records == [] and summary["recoveries"] == []
    assert summary["out_of_redundancy"] is None
    verdict = summary["job_error"]
    assert verdict["report"]["member"] == member and verdict["report"]["phase"] == "start-up"
    events = _events("start_up_error", root)
    assert [e for e in events if e["event"] == "plan"] == []  # no spare given a slot
    (decided,) = [e for e in events if e["event"] == "job_error"]
    first_death = min(e["t"] for e in events if e["event"] == "process_dead")
    assert decided["t"] - first_death < 1.0  # decided as it died: no timeout waited for
    assert "recovery:" not in proc.stdout


@pytest.mark.timeout(300)
def test_a_spare_raising_what_the_rank_it_replaced_raised_ends_the_job(root: str) -> None:
    """Rank 2 raises in training: a spare takes its slot (a first error may be its node's). The
    spare raises the same error in the same phase: the job ends, the second spare unused."""
    proc, _, summary = run("same_error_again", root)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 9, out[-3000:]
    message = "fault injection: rank 2 raises at iteration 4"
    assert f"JOB ERROR: rank 2 training: InjectedError: {message}\n" in proc.stdout, out[-3000:]
    events = _events("same_error_again", root)
    said = [e for e in events if e["event"] in ("error_reported", "process_dead", "plan")]
    assert "rank 2's spare s0 failed as a2 did before it" in proc.stdout, (said, out[-3000:])
    assert re.search(rf"s0\| .*InjectedError: {message}", proc.stdout), proc.stdout
    plans = [e for e in events if e["event"] == "plan"]
    assert [p["slots"]["2"] for p in plans] == ["s0"]  # s1 never got a slot
    assert summary["job_error"]["report"]["member"] == "s0"
    assert summary["out_of_redundancy"] is None


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not reconfigure.choose("gloo").repair,
    reason="torch < 2.14 (or DEADPOOL_GROUP_REPAIR=rebuild): groups are rebuilt, as the other "
    "cases test",
)
def test_survivors_repair_their_groups_in_place_and_stay_bitwise(
    root: str, tp_reference: dict
) -> None:
    """torch >= 2.14 (the lane-312 venv): both recoveries of `kill_then_hang` repair the groups
    in place - every survivor keeps its default group object (the same identity before and
    after each recovery), releases and rebinds nothing - and the newcomers join the repaired
    groups; the run stays bitwise identical to the failure-free one."""
    _check_recovered("kill_then_hang", tp_reference, root, [[2], [1]])
    logs = {p.name: p.read_text() for p in (Path(root) / "kill_then_hang" / "logs").glob("*.log")}
    text = "\n".join(logs.values())
    assert "process groups on a recovery: repair" in text
    assert "re-attached the new generation's" not in text  # no survivor rebuilt
    world = re.compile(r"world group (0x\w+)")
    repaired = re.compile(r"rank \d repaired its groups in place \(world group (0x\w+)\)")
    repairs = 0
    for name, log in logs.items():
        first = world.search(log)  # as it created its groups (a newcomer: joined them)
        for m in repaired.finditer(log):
            assert first is not None and m.group(1) == first.group(1), (name, m.group(0))
            repairs += 1
    assert repairs == 3 + 3  # three survivors in each of the two recoveries
    # Each of them first repaired, with the other survivors, the groups no newcomer is in.
    assert text.count("before the newcomers joined") == 3 + 3, text[-3000:]
    newcomers = re.findall(r"generation (\d): rank (\d) joined its groups in place", text)
    assert sorted(newcomers) == [("1", "2"), ("2", "1")]


@pytest.mark.timeout(600)
@NO_REPAIR_TO_DIE_IN
def test_a_rank_lost_in_the_repair_is_replaced_and_the_run_stays_bitwise(
    root: str, tp_reference: dict
) -> None:
    """torch >= 2.14: rank 1 dies in generation 1's repair, once it published its handles. Its
    peers wait for it in gloo's reconfigure until the coordinator's next plan abandons that
    repair (`RepairStore`, from each process's plan waiter as the plan appears, else its
    heartbeat) - not for the repair's 60 s timeout - then start over in a later generation that
    replaces ranks 1 and 2; the run ends bitwise identical to the failure-free one."""
    summary = _check_recovered("death_in_repair", tp_reference, root, [[1, 2]])
    text = _log_text(root, "death_in_repair")
    assert "fault injection: kill in a repair of its groups" in text, text[-3000:]
    assert "repairing the process groups of generation 1 in place failed" in text, text[-3000:]
    assert "the repair was abandoned for a later plan" in text, text[-3000:]
    abandoned = re.findall(
        r"during this process's repair of its groups for generation 1: repair abandoned by the "
        r"(plan waiter|heartbeat)",
        text,
    )
    # The plan waiter's wake-up comes within a store round trip of the plan; each heartbeat only
    # after its next beat: all three survivors' beats falling within that moment does not happen.
    assert "plan waiter" in abandoned, abandoned
    recovery = summary["recoveries"][0]
    assert recovery["generation"] >= 2
    assert recovery["total_s"] < group_repair.REPAIR_TIMEOUT_S / 2, recovery


@pytest.mark.timeout(600)
@NO_REPAIR_TO_DIE_IN
def test_a_newcomer_whose_join_loses_a_survivor_repairs_with_the_survivors_bitwise(
    root: str, tp_reference: dict
) -> None:
    """torch >= 2.14: rank 0 hangs in generation 1's repair before it published its handles,
    while generation 1's newcomer (s0, rank 1) waits for them to learn the survivors' prefix.
    The coordinator's next plan marks them lost: the newcomer's join fails with a peer failure,
    and it recovers with the survivors - its groups, created before it joined, repaired with
    theirs in generation 2 (not created again for a world nobody joins: the default group
    twice, a spare lost), restored from a holder as the newcomer it still is - bitwise."""
    summary = _check_recovered("hang_before_handles", tp_reference, root, [[0, 1]])
    logs = Path(root) / "hang_before_handles" / "logs"
    text = _log_text(root, "hang_before_handles")
    assert "fault injection: hang in a repair of its groups, before its handles" in text
    assert "default process group twice" not in text, text[-3000:]
    s0 = (logs / "s0.log").read_text()
    assert "rank(s) [0] lost before publishing their reconfigure handles" in s0, s0[-3000:]
    assert re.search(r"generation [2-9]: rank 1 repaired its groups in place", s0), s0[-3000:]
    assert "restored iteration" in s0 and "(from holder)" in s0, s0[-3000:]
    assert summary["recoveries"][0]["generation"] >= 2
