"""Megatron-LM integration: each supported tag's own `pretrain_gpt.py` on CPU with DeadPool.

These tests run Megatron-LM's `pretrain_gpt.py` on CPU, TP2 x DP2 + 1 spare, once per
supported tag (core_v0.16.1, core_v0.19.0; a test id names its tag), and skip unless
MEGATRON_LM_PATH lists a tree of that tag (tests/mlm.py; README, "Use with Megatron-LM" >
"Tested combinations"), e.g. prepared by scripts/prepare_megatron_lm.sh:

    pip install -e '.[megatron-lm]'
    export MEGATRON_LM_PATH=$(scripts/prepare_megatron_lm.sh ../shared/megatron-lm)

They compare every logged iteration (lm loss, grad norm, learning rate) and each rank's final
digest of its parameters and buffers (`digest.rank_digest`) of runs with a killed or hung rank
against a failure-free run. Both tags run the failure-free, killed, hung and
out-of-redundancy runs; each of the others runs on one tag, to keep the suite within its time
budget (README, "Tested combinations").
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from mlm import (
    APPLY,
    HANG_HEARTBEAT,
    NEWEST,
    OLDEST,
    RUN_TIMEOUT,
    TAGS,
    Run,
    drop_in_flight_env,
    launch,
    megatron_args,
    megatron_lm_tree,
    run_python,
)

NEWCOMER_JOINED = re.compile(
    r"\[deadpool r2 g1\] INFO (joined generation 1 as rank 2 of 4|generation 1: rank 2 joined "
    r"its groups in place)"
)
"""The newcomer in rank 2's slot joined generation 1: its groups created (rebuilt, torch < 2.14)
or joined in place (`group_repair`)."""

BOTH = pytest.mark.parametrize("tag", TAGS)

ITERS = 6
MEGATRON_ARGS = megatron_args(ITERS)
DEADPOOL_ARGS = ["--deadpool", "--deadpool-spares", "1", "--deadpool-ranks-per-node", "2"]


def _baseline(tag: str, tmp: Path) -> Run:
    """Failure-free TP2 x DP2 run with DeadPool on, checkpoints at 3 and 6, TensorBoard, a
    metrics file."""
    tree = megatron_lm_tree(tag)
    args = [*MEGATRON_ARGS, "--use-distributed-optimizer", "--save", str(tmp / "ckpt"),
            "--save-interval", "3", "--tensorboard-dir", str(tmp / "tb"), *DEADPOOL_ARGS,
            "--deadpool-metrics-file", str(tmp / "deadpool.prom")]  # fmt: skip
    run = launch(tmp, "baseline", tree / "pretrain_gpt.py", args)
    assert run.returncode == 0, run.describe()
    return run


def _nodistopt(tag: str, tmp: Path) -> Run:
    """Without --use-distributed-optimizer, rank 1 killed as iteration 4 starts; checkpoint
    of iteration 3 (written before the failure) for the resume test."""
    tree = megatron_lm_tree(tag)
    args = [*MEGATRON_ARGS, "--save", str(tmp / "ckpt"), "--save-interval", "3",
            *DEADPOOL_ARGS, "--deadpool-fail", "1@4"]  # fmt: skip
    return launch(tmp, "nodistopt", tree / "pretrain_gpt.py", args)


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Run]:
    """`shared_runs(tag, name)`: the run `name` ("baseline", "nodistopt") of `tag`'s tree,
    launched once per module and shared by the tests comparing against it."""
    makers = {"baseline": _baseline, "nodistopt": _nodistopt}
    done: dict[tuple[str, str], Run] = {}

    def get(tag: str, name: str) -> Run:
        if (tag, name) not in done:
            done[tag, name] = makers[name](tag, tmp_path_factory.mktemp(f"mlm-{name}-{tag}"))
        return done[tag, name]

    return get


def _assert_same_training(run: Run, baseline: Run) -> None:
    assert run.returncode == 0, run.describe()
    assert run.iterations() == baseline.iterations(), run.describe()
    assert sorted(run.iterations()) == list(range(1, ITERS + 1))
    assert run.summary["param_digests"] == baseline.summary["param_digests"]


@pytest.mark.timeout(2 * RUN_TIMEOUT)
@BOTH
def test_failure_free_run_replicates_every_iteration(shared_runs, tag: str) -> None:
    baseline = shared_runs(tag, "baseline")
    assert sorted(baseline.iterations()) == list(range(1, ITERS + 1))
    committed = re.findall(r"deadpool \| iteration +(\d+)/ +\d+ \| committed replica iteration: "
                           r"(\d+|none yet)", baseline.text)  # fmt: skip
    assert committed[0] == ("1", "none yet")
    assert all(int(c) == int(it) - 1 for it, c in committed[1:-1]) and len(committed) == ITERS
    assert committed[-1] == (str(ITERS), str(ITERS))  # the last step commits its own round
    assert baseline.summary["recoveries"] == []
    # The metrics file has rank 0's progress as the embedded job's has its records.
    metrics = (baseline.run_dir.parent / "deadpool.prom").read_text().splitlines()
    for line in (f"deadpool_iteration {ITERS}", f"deadpool_committed_iteration {ITERS}",
                 "deadpool_under_replicated_shards 0", "deadpool_spares_available 1"):  # fmt: skip
        assert line in metrics, metrics
    (nbytes,) = [x.split()[1] for x in metrics if x.startswith("deadpool_replica_bytes_per_")]
    assert int(nbytes) > 0
    digests = baseline.summary["param_digests"]
    assert len(digests) == 4 and digests["0"] == digests["2"] and digests["1"] == digests["3"]
    if importlib.util.find_spec("tensorboard") is not None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        (events,) = (baseline.run_dir.parent / "tb").glob("events.out.tfevents.*")
        acc = EventAccumulator(str(events))
        acc.Reload()
        scalars = acc.Scalars("deadpool/committed-iteration")
        assert [(s.step, s.value) for s in scalars][-1] == (ITERS, ITERS)
        assert "lm loss" in acc.Tags()["scalars"]  # Megatron's own, same writer
        # The coordinator's view (`job/status`): one spare waiting, no respawn, no standby, no
        # shard short of replicas.
        names = ("spares-available", "respawns", "standbys", "under-replicated-shards")
        last = {name: acc.Scalars(f"deadpool/{name}")[-1].value for name in names}
        assert last == {"spares-available": 1.0, "respawns": 0.0, "standbys": 0.0,
                        "under-replicated-shards": 0.0}, last  # fmt: skip


@pytest.mark.timeout(3 * RUN_TIMEOUT)
@BOTH
def test_killed_rank_is_hot_swapped_bitwise(shared_runs, tag: str, tmp_path: Path) -> None:
    """Rank 2 is SIGKILLed as iteration 4 starts; the in-flight round is dropped, so the
    survivors roll back to iteration 2 and recompute iteration 3 with replayed data. DeadPool
    logs at INFO, Megatron's default."""
    tree = megatron_lm_tree(tag)
    baseline = shared_runs(tag, "baseline")
    args = [*MEGATRON_ARGS, "--use-distributed-optimizer", "--save", str(tmp_path / "ckpt"),
            "--save-interval", "3", *DEADPOOL_ARGS, "--deadpool-fail", "2@4",
            "--deadpool-metrics-file", str(tmp_path / "deadpool.prom")]  # fmt: skip
    run = launch(tmp_path, "swap", tree / "pretrain_gpt.py", args, env=drop_in_flight_env())
    _assert_same_training(run, baseline)
    # The spare in rank 2's slot held no copy of the shard rank 2 held one of: short until
    # a round after the restore iteration committed, 0 at the end.
    events = [json.loads(x) for x in (run.run_dir / "events.jsonl").read_text().splitlines()]
    (agreed,) = [e for e in events if e["event"] == "agreed"]
    assert len(agreed["under_replicated"]) == 1, agreed
    metrics = (tmp_path / "deadpool.prom").read_text().splitlines()
    assert "deadpool_under_replicated_shards 0" in metrics, metrics
    assert "deadpool_recoveries_total 1" in metrics and "deadpool_generation 1" in metrics
    (rec,) = run.summary["recoveries"]
    assert rec["dead_ranks"] == [2] and rec["replaced_by"] == {"2": "s0"}
    assert rec["restore_iteration"] == 2 and rec["recomputed_iterations"] == 1
    assert rec["stale_group_refs"] == 0
    assert re.search(r"deadpool \| recovered \| generation: 1 \| dead ranks: \[2\] \| "
                     r"restored iteration: 2 \| recomputed iterations: 1", run.text)  # fmt: skip
    assert NEWCOMER_JOINED.search(run.text), run.text[-3000:]
    # Megatron's own checkpoint after the swap holds the failure-free run's state.
    ours, theirs = _common_state(
        tree, tmp_path / "ckpt", baseline.run_dir.parent / "ckpt", iteration=6
    )
    assert ours == theirs and ours["iteration"] == 6 and ours["consumed_train"] == 6 * 8


def _common_state(tree: Path, *ckpts: Path, iteration: int) -> list[dict]:
    """Megatron's common checkpoint state of `iteration` in each `ckpt` folder, read in a
    process that imports the tree's Megatron (its pickled args name its classes): common.pt
    (core_v0.16.1) or the 'common_state' object inside the torch_dist files (core_v0.19.0)."""
    proc = run_python(f"""
        import io, json, sys
        sys.argv = sys.argv[:1]
        sys.path.insert(0, {str(tree)!r})
        from megatron_deadpool.megatron_lm import prepare
        prepare()
        import torch
        import torch.distributed.checkpoint as dcp

        def load(where):
            if (where / "common.pt").exists():
                return torch.load(where / "common.pt", weights_only=False)
            key = "common_state/shard_0_1"
            state = {{key: io.BytesIO()}}
            dcp.load(state, storage_reader=dcp.FileSystemReader(where), no_dist=True)
            blob = state[key]  # the object itself, or its bytes
            if isinstance(blob, io.BytesIO):
                blob.seek(0)
                blob = torch.load(blob, weights_only=False)
            return blob[0]

        from pathlib import Path
        out = []
        for ckpt in {[str(c) for c in ckpts]!r}:
            c = load(Path(ckpt) / "iter_{iteration:07d}")
            out.append({{"iteration": c["iteration"], "scheduler": c["opt_param_scheduler"],
                        "flops": c["num_floating_point_operations_so_far"],
                        "consumed_train": c["args"].consumed_train_samples}})
        print(json.dumps(out))
        """, timeout=RUN_TIMEOUT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _patched_view(tree: Path, where: Path) -> Path:
    """A view of `tree` whose pretrain_gpt.py is a patched copy (scripts/apply_patches.sh);
    everything else links to the tree."""
    where.mkdir()
    for entry in tree.iterdir():
        if entry.name != "pretrain_gpt.py":
            (where / entry.name).symlink_to(entry)
    (where / "pretrain_gpt.py").write_bytes((tree / "pretrain_gpt.py").read_bytes())
    applied = subprocess.run(
        ["bash", str(APPLY), str(where)], capture_output=True, text=True, check=False
    )
    assert applied.returncode == 0, applied.stderr
    return where / "pretrain_gpt.py"


@pytest.mark.timeout(3 * RUN_TIMEOUT)
@BOTH
def test_hung_rank_is_hot_swapped_bitwise(shared_runs, tag: str, tmp_path: Path) -> None:
    """Rank 2 is stopped (SIGSTOP) as iteration 4 starts: its sockets stay open, so only its
    silence names it; the coordinator kills it and the spare takes its place. The newest tag
    runs its patched script here (the runner is tested above), and Megatron's
    MEGATRON_LOGGING_LEVEL=30 (WARNING) holds for DeadPool's log lines too."""
    tree = megatron_lm_tree(tag)
    baseline = shared_runs(tag, "baseline")
    script = tree / "pretrain_gpt.py"
    if tag == NEWEST:
        script = _patched_view(tree, tmp_path / "mlm")
    args = [*MEGATRON_ARGS, "--use-distributed-optimizer", *DEADPOOL_ARGS, *HANG_HEARTBEAT,
            "--deadpool-fail", "2@4:hang"]  # fmt: skip
    run = launch(tmp_path, "hang", script, args, patched=tag == NEWEST,
                  env={"MEGATRON_LOGGING_LEVEL": "30"})  # fmt: skip
    _assert_same_training(run, baseline)
    (rec,) = run.summary["recoveries"]
    assert rec["dead_ranks"] == [2] and rec["replaced_by"] == {"2": "s0"}
    assert rec["restore_iteration"] in (2, 3) and rec["recomputed_iterations"] <= 1
    assert re.search(r"process a2 silent for [\d.]+s \(hung\); killed", run.text), run.describe()
    assert "[deadpool r2 g0] WARNING fault injection: hang at iteration 4" in run.text
    assert not re.search(r"\[deadpool (r\d+ g\d+|spare s\d+)\] INFO ", run.text), run.describe()


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_a_killed_rank_is_respawned_on_its_node_and_spends_no_spare(
    shared_runs, tmp_path: Path
) -> None:
    """With --deadpool-respawn-limit, rank 2 SIGKILLed is replaced by a new process on its own
    node (the launcher is the nodes' agent), which restores from its predecessor's snapshot in
    the node's segment files, and spare s0 stays in the pool; the training is the failure-free
    run's. The newest tag only: the respawn is DeadPool's launcher and
    coordinator, the same code for both tags (the newcomer joins as a spare does, which the
    killed-rank test runs on both)."""
    tree = megatron_lm_tree(NEWEST)
    baseline = shared_runs(NEWEST, "baseline")
    args = [*MEGATRON_ARGS, "--use-distributed-optimizer", *DEADPOOL_ARGS,
            "--deadpool-respawn-limit", "1", "--deadpool-fail", "2@4"]  # fmt: skip
    run = launch(tmp_path, "respawn", tree / "pretrain_gpt.py", args)
    _assert_same_training(run, baseline)
    (rec,) = run.summary["recoveries"]
    assert rec["dead_ranks"] == [2] and rec["respawned"] == {"2": 1}
    assert rec["replaced_by"] == {"2": "s1"} and run.summary["spares_left"] == ["s0"]
    assert "rank 2 <- s1 (respawned on node 1)" in run.text
    assert NEWCOMER_JOINED.search(run.text), run.text[-3000:]
    # Its predecessor's snapshot, in the node's segment files, restored it: no transfer.
    assert re.search(r"\[deadpool r2 g1\] INFO restored iteration \d+ \(from local", run.text)


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_a_rank_and_its_holder_killed_together_are_respawned_from_their_nodes_memory(
    shared_runs, tmp_path: Path
) -> None:
    """Ranks 1 and 3 (on two nodes, each holding the other's replica) SIGKILLed at the same
    iteration: without memory that outlives a process this is out of redundancy. Each is
    respawned on its node, restores from its predecessor's segment files, no spare is spent,
    and the training is the failure-free run's."""
    tree = megatron_lm_tree(NEWEST)
    baseline = shared_runs(NEWEST, "baseline")
    args = [*MEGATRON_ARGS, "--use-distributed-optimizer", *DEADPOOL_ARGS,
            "--deadpool-respawn-limit", "1", "--deadpool-fail", "1@4",
            "--deadpool-fail", "3@4"]  # fmt: skip
    run = launch(tmp_path, "together", tree / "pretrain_gpt.py", args)
    _assert_same_training(run, baseline)
    respawned = {r for rec in run.summary["recoveries"] for r in rec["respawned"]}
    assert respawned == {"1", "3"} and run.summary["spares_left"] == ["s0"], run.summary
    for rank in (1, 3):
        assert re.search(
            rf"\[deadpool r{rank} g\d\] INFO restored iteration \d+ \(from local", run.text
        )


@pytest.mark.timeout(3 * RUN_TIMEOUT)
@BOTH
def test_out_of_redundancy_saves_every_shard_and_load_resumes_bitwise(
    shared_runs, tag: str, tmp_path: Path
) -> None:
    """No spare: rank 2 is SIGKILLed as iteration 4 starts. Its shard survives on its holder,
    so the survivors save a complete snapshot set of the last common iteration and exit 3; the
    same command with --load resumes from it (writing it as a Megatron checkpoint through
    Megatron's save_checkpoint) and logs the failure-free run's iterations from there on.
    The newest tag adds Megatron's --verify-integrity: that checkpoint gets its manifest."""
    from megatron_deadpool.replication import snapshot_set as salvage

    tree = megatron_lm_tree(tag)
    baseline = shared_runs(tag, "baseline")
    ckpt = tmp_path / "ckpt"
    base = [*MEGATRON_ARGS, "--use-distributed-optimizer", "--save", str(ckpt),
            "--save-interval", "100", "--deadpool", "--deadpool-ranks-per-node", "2"]  # fmt: skip
    if tag == NEWEST:
        base.append("--verify-integrity")
    run = launch(tmp_path, "oor", tree / "pretrain_gpt.py", [*base, "--deadpool-fail", "2@4"])
    assert run.returncode == 3, run.describe()
    oor = run.summary["out_of_redundancy"]
    assert oor["dead_ranks"] == [2] and "no spare left" in oor["reason"]
    t = oor["save"]["iteration"]
    assert oor["save"]["complete"] and t in (2, 3), oor
    assert {c for p, c in run.summary["exit_codes"].items() if p != "a2"} == {3}
    assert re.search(rf"saved every rank's state of iteration {t} to \S+: run the same "
                     "command with --load", run.text), run.describe()  # fmt: skip
    manifest = salvage.read_manifest(ckpt, t)
    assert manifest["complete"] and manifest["ranks_present"] == [0, 1, 2, 3]
    assert manifest["megatron"]["consumed_train"] == 8 * t  # global batch 8
    assert not (ckpt / "latest_checkpointed_iteration.txt").exists()  # none before the failure

    resumed = launch(tmp_path, "resumed", tree / "pretrain_gpt.py", [*base, "--load", str(ckpt)])
    assert resumed.returncode == 0, resumed.describe()
    assert re.search(rf"resumed from DeadPool's snapshot set of iteration {t}", resumed.text)
    assert (ckpt / f"iter_{t:07d}" / "metadata.json").is_file()  # Megatron's format now
    if tag == NEWEST:
        assert (ckpt / f"iter_{t:07d}" / "integrity.json").is_file()
    ours, theirs = resumed.iterations(), baseline.iterations()
    assert sorted(ours) == list(range(t + 1, ITERS + 1)), resumed.describe()
    assert resumed.summary["param_digests"] == baseline.summary["param_digests"]
    # Megatron does not reset its running loss sums after a process's first logged iteration
    # (`should_reset = not is_first_iteration`), so in any resumed run the line of T+2
    # averages T+1 and T+2; every other value is the failure-free run's, bit for bit.
    for it in ours:
        lr, loss, grad_norm = ours[it]
        assert (lr, grad_norm) == (theirs[it][0], theirs[it][2]), (it, ours[it], theirs[it])
        if it == t + 2:
            mean = (float(theirs[t + 1][1]) + float(theirs[t + 2][1])) / 2
            assert float(loss) == pytest.approx(mean, rel=1e-6), (it, loss, theirs)
        else:
            assert loss == theirs[it][1], (it, ours[it], theirs[it])
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)


@pytest.mark.timeout(3 * RUN_TIMEOUT)
@pytest.mark.parametrize("tag", [NEWEST])
def test_rank_lost_after_training_completed_costs_nothing(
    shared_runs, tag: str, tmp_path: Path
) -> None:
    """Rank 2 is SIGKILLed right after the last step completed and was replicated, before
    pretrain()'s final save: no recovery, the run succeeds with the failure-free iterations,
    and the survivors save the final state - rank 2's from its holder - as a complete snapshot
    set, which the same command with --load turns into Megatron's checkpoint of that step."""
    from megatron_deadpool.replication import snapshot_set as salvage

    tree = megatron_lm_tree(tag)
    baseline = shared_runs(tag, "baseline")
    ckpt = tmp_path / "ckpt"
    base = [*MEGATRON_ARGS, "--use-distributed-optimizer", "--save", str(ckpt),
            "--save-interval", "4", *DEADPOOL_ARGS]  # fmt: skip
    run = launch(tmp_path, "end", tree / "pretrain_gpt.py", [*base, "--deadpool-fail", "2@end"])
    assert run.returncode == 0, run.describe()
    assert run.iterations() == baseline.iterations(), run.describe()
    assert run.summary["recoveries"] == []
    lost = run.summary["lost_after_training"]
    assert lost["dead_ranks"] == [2] and lost["completed_iteration"] == ITERS
    assert lost["save"]["complete"] and lost["save"]["sources"] == {"2": 0}
    actives = {p: c for p, c in run.summary["exit_codes"].items() if p.startswith("a")}
    assert actives == {"a0": 0, "a1": 0, "a2": -9, "a3": 0}
    expected = {r: d for r, d in baseline.summary["param_digests"].items() if r != "2"}
    assert run.summary["param_digests"] == expected
    assert re.search(
        rf"training completed at iteration {ITERS}; rank\(s\) \[2\] lost "
        r"afterwards, in Megatron's final work after training: saved every rank's state",
        run.text,
    )
    manifest = salvage.read_manifest(ckpt, ITERS)
    assert manifest["complete"] and manifest["ranks_present"] == [0, 1, 2, 3]
    assert manifest["megatron"]["consumed_train"] == 8 * ITERS  # global batch 8
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"

    converted = launch(tmp_path, "converted", tree / "pretrain_gpt.py", [*base, "--load",
                        str(ckpt)])  # fmt: skip
    assert converted.returncode == 0, converted.describe()
    assert re.search(rf"resumed from DeadPool's snapshot set of iteration {ITERS}", converted.text)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    ours, theirs = _common_state(tree, ckpt, baseline.run_dir.parent / "ckpt", iteration=ITERS)
    assert ours == theirs


@pytest.mark.timeout(3 * RUN_TIMEOUT)
@pytest.mark.parametrize("tag", [NEWEST])
def test_out_of_redundancy_with_shards_lost_saves_what_survives(tag: str, tmp_path: Path) -> None:
    """Ranks 0 and 2, each other's replica holder, are SIGKILLed as iteration 5 starts: their
    shards are gone. The survivors save their own snapshots (an incomplete set), name the lost
    ranks and exit 3; --load then resumes from Megatron's checkpoint of iteration 3."""
    from megatron_deadpool.replication import snapshot_set as salvage

    tree = megatron_lm_tree(tag)
    ckpt = tmp_path / "ckpt"
    base = [*MEGATRON_ARGS, "--use-distributed-optimizer", "--save", str(ckpt),
            "--save-interval", "3", "--deadpool", "--deadpool-ranks-per-node", "2"]  # fmt: skip
    fail = ["--deadpool-fail", "0@5", "--deadpool-fail", "2@5"]
    run = launch(tmp_path, "lost", tree / "pretrain_gpt.py", [*base, *fail])
    assert run.returncode == 3, run.describe()
    oor = run.summary["out_of_redundancy"]
    assert oor["lost_ranks"] == [0, 2] and oor["lost_shards_holders"] == {"0": [2], "2": [0]}
    assert not oor["save"]["complete"] and oor["save"]["missing"] == [0, 2]
    t = oor["save"]["iteration"]
    assert re.search(rf"shards lost: ranks \[0, 2\]; saved the surviving snapshots of "
                     rf"iteration {t} to \S+; the shards of ranks \[0, 2\] are lost",
                     run.text), run.describe()  # fmt: skip
    manifest = salvage.read_manifest(ckpt, t)
    assert manifest["ranks_present"] == [1, 3] and manifest["ranks_missing"] == [0, 2]
    assert salvage.latest_complete(ckpt) is None

    resumed = launch(tmp_path, "resumed", tree / "pretrain_gpt.py", [*base, "--load", str(ckpt)])
    assert resumed.returncode == 0, resumed.describe()
    assert "resumed from DeadPool's snapshot set" not in resumed.text
    assert sorted(resumed.iterations()) == [4, 5, 6], resumed.describe()


@pytest.mark.timeout(3 * RUN_TIMEOUT)
@pytest.mark.parametrize("tag", [OLDEST])
def test_without_distributed_optimizer_the_newcomer_copies_a_dp_peer(shared_runs, tag: str) -> None:
    run, baseline = shared_runs(tag, "nodistopt"), shared_runs(tag, "baseline")
    assert run.returncode == 0, run.describe()
    (rec,) = run.summary["recoveries"]
    assert rec["dead_ranks"] == [1] and rec["restore_iteration"] == 3
    # Same data and Adam as the baseline; only the gradient-norm reduction differs from the
    # distributed optimizer's, in the last bits.
    ours, theirs = run.iterations(), baseline.iterations()
    assert sorted(ours) == sorted(theirs)
    for it in ours:
        for a, b in zip(ours[it], theirs[it]):
            assert float(a) == pytest.approx(float(b), rel=1e-5), (it, ours[it], theirs[it])
    digests = run.summary["param_digests"]
    assert digests["0"] == digests["2"] and digests["1"] == digests["3"]


@pytest.mark.timeout(4 * RUN_TIMEOUT)
@pytest.mark.parametrize("tag", [OLDEST])
def test_patched_script_resumes_from_megatrons_checkpoint_and_hot_swaps(
    shared_runs, tag: str, tmp_path: Path
) -> None:
    """Both resume with --load from the checkpoint of iteration 3: the runner on the
    unmodified script without a failure, the patched script with the last rank (the one that
    prints Megatron's iteration lines) killed as iteration 5 starts. They must agree bit for
    bit (a resumed run is compared with a resumed run: Megatron's own resume is not bitwise
    equal to an uninterrupted run)."""
    tree = megatron_lm_tree(tag)
    nodistopt = shared_runs(tag, "nodistopt")
    assert nodistopt.returncode == 0, nodistopt.describe()
    load = ["--load", str(nodistopt.run_dir.parent / "ckpt"), "--ckpt-step", "3"]
    reference = launch(tmp_path, "resumed", tree / "pretrain_gpt.py",
                        [*MEGATRON_ARGS, *load, *DEADPOOL_ARGS])  # fmt: skip
    assert reference.returncode == 0, reference.describe()
    script = _patched_view(tree, tmp_path / "mlm")
    args = [*MEGATRON_ARGS, *load, *DEADPOOL_ARGS, "--deadpool-fail", "3@5"]
    run = launch(tmp_path, "patched", script, args, patched=True)
    assert run.returncode == 0, run.describe()
    (rec,) = run.summary["recoveries"]
    assert rec["dead_ranks"] == [3] and rec["restore_iteration"] == 4
    assert sorted(run.iterations()) == [4, 5, 6]
    # Megatron logs a resumed run's first iteration without resetting its running sums, so
    # the line of iteration 5 averages 4 and 5: the newcomer printing it took the sums over.
    assert run.iterations() == reference.iterations(), run.describe()
    assert run.summary["param_digests"] == reference.summary["param_digests"]


@pytest.mark.timeout(2 * RUN_TIMEOUT)
@pytest.mark.parametrize("tag", [NEWEST])
def test_megatrons_own_exit_ends_the_job_and_is_no_failure(tag: str, tmp_path: Path) -> None:
    """Megatron's rerun state machine (--rerun-mode validate_results, its default) with its own
    error injector reporting a persistent error: every rank saves a checkpoint and exits with
    code 16 together. DeadPool takes that as the end of the job (exit code 16 passed on, no
    recovery), not as four failed ranks."""
    tree = megatron_lm_tree(tag)
    ckpt = tmp_path / "ckpt"
    args = [*MEGATRON_ARGS, "--use-distributed-optimizer", "--save", str(ckpt),
            "--save-interval", "100", "--rerun-mode", "validate_results", "--error-injection-rate", "1",
            "--error-injection-type", "persistent_error", *DEADPOOL_ARGS]  # fmt: skip
    run = launch(tmp_path, "rerun", tree / "pretrain_gpt.py", args)
    assert run.returncode == 16, run.describe()
    assert "Saving a checkpoint and exiting now" in run.text, run.describe()
    assert run.summary["recoveries"] == [] and run.summary["out_of_redundancy"] is None
    codes = run.summary["exit_codes"]
    assert {codes[f"a{r}"] for r in range(4)} == {16}, codes
    assert "[deadpool] recovery:" not in run.text  # no rank was taken for dead
    assert (
        len(re.findall(r"process a\d exited with code 16 after finishing its work", run.text)) == 4
    )
    assert (ckpt / "latest_checkpointed_iteration.txt").is_file()


def _assert_job_error(run: Run, error: str) -> str:
    """`run` ended with the job's own error: exit code 9, `[deadpool] JOB ERROR: rank R
    start-up: ERROR` (a regular expression) and the end of that rank's log, no spare given a
    slot, decided as the rank died; its member."""
    assert run.returncode == 9, run.describe()
    cause = re.search(rf"\[deadpool\] JOB ERROR: rank (\d) start-up: {error}\n", run.text)
    assert cause is not None, run.describe()
    member = f"a{cause[1]}"
    assert f"[deadpool] {member}'s log ({run.run_dir / member}.log) ends:" in run.text
    assert re.search(rf"    {member}\| .*{error}", run.text), run.describe()
    verdict = run.summary["job_error"]
    assert verdict["report"]["member"] == member and verdict["report"]["phase"] == "start-up"
    assert run.summary["recoveries"] == [] and run.summary["out_of_redundancy"] is None
    events = [json.loads(x) for x in (run.run_dir / "events.jsonl").read_text().splitlines()]
    assert [e for e in events if e["event"] == "plan"] == []  # the spare was never given a slot
    (decided,) = [e for e in events if e["event"] == "job_error"]
    first_death = min(e["t"] for e in events if e["event"] == "process_dead")
    assert decided["t"] - first_death < 1.0  # decided as it died: no timeout waited for
    assert "[deadpool] recovery:" not in run.text and "taking rank" not in run.text
    return member


@pytest.mark.timeout(2 * RUN_TIMEOUT)
@pytest.mark.parametrize("tag", [NEWEST])
def test_an_error_in_megatrons_start_up_is_the_jobs_error_no_spare_spent(
    tag: str, tmp_path: Path
) -> None:
    """A --data-path that does not exist: Megatron's dataset builder raises on the ranks that
    build it, before the first step (the others wait for them, then lose them). No node failed:
    the job ends at once with exit code 9 (not 3, which asks for a resume that would fail
    again), the rank's error as the one-line cause and the end of its log; the spare is never
    given a slot."""
    tree = megatron_lm_tree(tag)
    missing = tmp_path / "nonexistent"
    args = [*(a for a in MEGATRON_ARGS if a != "--mock-data"), "--data-path", str(missing),
            *DEADPOOL_ARGS]  # fmt: skip
    run = launch(tmp_path, "bad_data", tree / "pretrain_gpt.py", args)
    _assert_job_error(run, "AssertionError: One or both of the \\.idx and \\.bin files cannot be "
                      f"found at the path prefix {re.escape(str(missing))}")  # fmt: skip


@pytest.mark.timeout(2 * RUN_TIMEOUT)
@pytest.mark.parametrize("tag", [NEWEST])
def test_an_argument_megatron_refuses_before_pretrain_is_the_jobs_error(
    tag: str, tmp_path: Path
) -> None:
    """core_v0.19.0's pretrain_gpt.py validates its arguments before it calls pretrain(), so
    before DeadPool's session exists: the runner reports the error all the same (--tp-comm-overlap
    without --sequence-parallel, which Megatron asserts on every rank)."""
    tree = megatron_lm_tree(tag)
    args = [*MEGATRON_ARGS, "--tp-comm-overlap", *DEADPOOL_ARGS]
    run = launch(tmp_path, "bad_args", tree / "pretrain_gpt.py", args)
    _assert_job_error(run, "AssertionError: Tensor parallel communication/GEMM overlap can happen "
                      "only when sequence parallelism is enabled")  # fmt: skip
