"""Persistent Megatron checkpoints (`megatron_deadpool.embedded.checkpoint`): a resumed run is
bitwise.

Two 4-process worlds (TP2xDP2, gloo, the embedded GPT job built by `gpt.build`):

1. the *saving* world trains iterations 1-3, saves iteration 3 through megatron-core's
   `dist_checkpointing` (torch_dist), then trains 4-5, recording losses and parameters;
2. a *fresh* world builds the job anew, loads the checkpoint and trains the same 4-5.

The fresh world must end with the same losses and bitwise the same parameters; right after the
load its parameters, optimizer shard (fp32 main params, Adam moments and step counts), LR
schedule and RNG states must be those saved. It then loads the checkpoint a second time over its
trained state (in place, as a rollback would) and must repeat iterations 4-5 exactly again.

Single-process tests cover the marker file (Megatron-LM's `latest_checkpointed_iteration.txt`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from mp import run_world

SAVE_AT = 3
ITERS = 5
WORLD_TIMEOUT = 240.0


# ---------------------------------------------------------------------- child side
def _fingerprint(objs: Any) -> dict[str, Any]:
    """What must come back from a checkpoint: parameters, optimizer shard, schedule, RNG."""
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_deadpool.digest import rank_digest
    from megatron_deadpool.replication.snapshot import inner_optimizers

    def sha(t: torch.Tensor) -> str:
        return hashlib.sha256(
            t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()
        ).hexdigest()

    shard, steps, groups = hashlib.sha256(), set(), []
    for opt in inner_optimizers(objs.optimizer):
        for group in opt.param_groups:
            groups.append(
                {k: v for k, v in group.items() if k != "params" and isinstance(v, (int, float))}
            )
            for param in group["params"]:
                shard.update(sha(param).encode())
                state = opt.state[param]
                for key in sorted(state):
                    value = state[key]
                    if key == "step":
                        steps.add(float(value))
                    shard.update(f"{key}:{sha(value)};".encode())
    tracker = get_cuda_rng_tracker().get_states()
    rng = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    for name in sorted(tracker):
        rng.update(name.encode() + tracker[name].numpy().tobytes())
    return {
        "params": rank_digest(objs.model),
        "optimizer_shard": shard.hexdigest(),
        "adam_steps": sorted(steps),
        "param_groups": groups,
        "scheduler": {k: v for k, v in objs.scheduler.state_dict().items()},
        "rng": rng.hexdigest(),
    }


def _no_helper_process() -> bool:
    """No multiprocessing child of this process running (megatron-core's writer would start a
    manager's server at the first save, which stays until the process exits)."""
    import multiprocessing

    return not [p for p in multiprocessing.active_children() if p.is_alive()]


def _checkpoint_rank(
    *, rank: int, world_size: int, store: Any, root: str, phase: str
) -> dict[str, Any]:
    """One rank of the saving world (`phase="save"`) or of the loading world (`"load"`)."""
    from megatron.core import parallel_state as ps

    from megatron_deadpool.config.job import JobConfig, ParallelConfig, TrainConfig
    from megatron_deadpool.digest import rank_digest
    from megatron_deadpool.embedded import checkpoint, gpt

    job = JobConfig(parallel=ParallelConfig(tp=2, pp=1, dp=2), train=TrainConfig(iters=ITERS))
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    objs = gpt.build(job)
    out: dict[str, Any] = {"rank": rank}

    def train(first: int) -> dict[str, Any]:
        losses = [gpt.train_step(job, objs, it)[0] for it in range(first, ITERS + 1)]
        return {"losses": losses, "params": rank_digest(objs.model)}

    if phase == "save":
        out["before_save"] = [gpt.train_step(job, objs, it)[0] for it in range(1, SAVE_AT + 1)]
        out["at_save"] = _fingerprint(objs)
        path = checkpoint.save(objs, SAVE_AT, root)
        out["path"] = str(path)
        out["latest"] = checkpoint.latest_iteration(root)
        out["unchanged_by_save"] = _fingerprint(objs) == out["at_save"]
        out["after"] = train(SAVE_AT + 1)
        out["no_helper_process"] = _no_helper_process()
    else:
        out["loaded_iteration"] = checkpoint.load(objs, root)
        out["after_load"] = _fingerprint(objs)
        out["after"] = train(out["loaded_iteration"] + 1)
        # Again, over a live, trained state: load restores in place.
        out["reloaded_iteration"] = checkpoint.load(objs, root)
        out["after_reload"] = _fingerprint(objs)
        out["again"] = train(out["reloaded_iteration"] + 1)
    return out


# ---------------------------------------------------------------------- parent side
@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ckpt")
    saved = run_world(
        "test_checkpoint:_checkpoint_rank",
        4,
        kwargs={"root": str(root), "phase": "save"},
        timeout=WORLD_TIMEOUT,
    )
    loaded = run_world(
        "test_checkpoint:_checkpoint_rank",
        4,
        kwargs={"root": str(root), "phase": "load"},
        timeout=WORLD_TIMEOUT,
    )
    return {"root": root, "saved": saved, "loaded": loaded}


@pytest.mark.timeout(2 * WORLD_TIMEOUT + 60)
def test_layout_is_megatron_lms(worlds: dict[str, Any]) -> None:
    root: Path = worlds["root"]
    path = root / f"iter_{SAVE_AT:07d}"
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == str(SAVE_AT)
    assert all(r["path"] == str(path) and r["latest"] == SAVE_AT for r in worlds["saved"])
    meta = json.loads((path / "metadata.json").read_text())
    assert meta["sharded_backend"] == "torch_dist"
    assert (path / "common.pt").is_file() and (path / ".metadata").is_file()
    assert len(list(path.glob("*.distcp"))) >= 4  # every rank wrote its own shard


@pytest.mark.timeout(2 * WORLD_TIMEOUT + 60)
def test_save_changes_nothing_and_leaves_no_process(worlds: dict[str, Any]) -> None:
    assert all(r["unchanged_by_save"] for r in worlds["saved"])
    assert all(r["no_helper_process"] for r in worlds["saved"])


@pytest.mark.timeout(2 * WORLD_TIMEOUT + 60)
def test_load_restores_every_rank_bitwise(worlds: dict[str, Any]) -> None:
    for saved, loaded in zip(worlds["saved"], worlds["loaded"]):
        rank = saved["rank"]
        assert loaded["loaded_iteration"] == SAVE_AT
        for key in ("params", "optimizer_shard", "adam_steps", "param_groups", "scheduler", "rng"):
            assert loaded["after_load"][key] == saved["at_save"][key], f"rank {rank}: {key}"
        assert loaded["after_load"]["adam_steps"] == [float(SAVE_AT)]


@pytest.mark.timeout(2 * WORLD_TIMEOUT + 60)
def test_resumed_training_is_bitwise(worlds: dict[str, Any]) -> None:
    for saved, loaded in zip(worlds["saved"], worlds["loaded"]):
        assert loaded["after"]["losses"] == saved["after"]["losses"]
        assert loaded["after"]["params"] == saved["after"]["params"], f"rank {saved['rank']}"
    losses = worlds["saved"][0]["before_save"] + worlds["saved"][0]["after"]["losses"]
    assert len(set(losses)) == ITERS  # the job really trains


@pytest.mark.timeout(2 * WORLD_TIMEOUT + 60)
def test_load_over_trained_state_rolls_back_in_place(worlds: dict[str, Any]) -> None:
    for saved, loaded in zip(worlds["saved"], worlds["loaded"]):
        assert loaded["reloaded_iteration"] == SAVE_AT
        assert loaded["after_reload"] == saved["at_save"], f"rank {saved['rank']}"
        assert loaded["again"] == saved["after"]


# ---------------------------------------------------------------------- single process
@pytest.mark.timeout(60)
def test_latest_iteration_reads_the_marker(tmp_path: Path) -> None:
    from megatron_deadpool.embedded import checkpoint

    assert checkpoint.latest_iteration(tmp_path) is None
    assert checkpoint.latest_iteration(tmp_path / "missing") is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("12\n")
    assert checkpoint.latest_iteration(tmp_path) == 12
    assert checkpoint.iteration_dir(tmp_path, 12) == tmp_path / "iter_0000012"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(checkpoint.CheckpointError, match="expected an iteration number"):
        checkpoint.latest_iteration(tmp_path)


@pytest.mark.timeout(60)
def test_load_without_checkpoint_says_so(tmp_path: Path) -> None:
    from megatron_deadpool.embedded import checkpoint

    with pytest.raises(checkpoint.CheckpointError, match="nothing was saved there"):
        checkpoint.load(None, tmp_path)  # type: ignore[arg-type]
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    with pytest.raises(checkpoint.CheckpointError, match="not a complete torch_dist checkpoint"):
        checkpoint.load(None, tmp_path)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- bench recovery
FAIL_AT, INTERVAL, T0 = 8, 5, 1000.0


def _fake_launch(digests: dict[str, str], agents: list[tuple[str, bool]] | None = None) -> Any:
    """Stands in for the bench's launches; iteration i of generation 0 ends at T0 + i / 10.
    `agents`: gets (which run, whether node agents launched it) for every launch."""
    from megatron_deadpool.bench.recovery import Launch

    def recs(iterations: range, start: float) -> list[dict[str, Any]]:
        return [
            {"iteration": i, "time": start + 0.1 * (k + 1), "iter_time_s": 0.1, "loss": 3 - i / 10}
            for k, i in enumerate(iterations)
        ]

    hot_swaps = itertools.count()

    def launch(
        job: Any, run_dir: Path, stop_on_failure: bool, timeout_s: float, node_agents: bool = False
    ) -> Launch:
        if agents is not None:
            agents.append((run_dir.name, node_agents))
        iters, failed_at = job.train.iters, T0 + 0.1 * (FAIL_AT - 1) + 0.05
        if job.deadpool.enabled:  # hot swap: 1.05 s of phases, then iteration 8 takes 0.1 s
            # the n-th hot swap reconstructs in 0.3 + n/100 s, agrees in n/100 s less
            n = next(hot_swaps) / 100
            phases = {"detect": 0.1, "agree": 0.5 - n, "reconstruct": 0.3 + n, "restore": 0.05}
            rec = {"phases_s": {**phases, "first_iteration": 0.1}, "restore_iteration": 7}
            rec.update(recomputed_iterations=0, total_s=1.05, newcomers_claimed_s=0.2)
            records = recs(range(1, FAIL_AT), T0) + recs(
                range(FAIL_AT, iters + 1), failed_at + 0.95
            )
            summary = {"recoveries": [rec], "final_param_digest": digests["deadpool"]}
            return Launch(0, records, summary, run_dir, T0 - 5, failed_at=failed_at)
        if job.deadpool.fail:  # restart, failing part: stopped 0.2 s after the failure
            assert stop_on_failure and job.train.save_interval == INTERVAL
            return Launch(
                1,
                recs(range(1, FAIL_AT), T0),
                {},
                run_dir,
                T0 - 5,
                failed_at=failed_at,
                detected_at=failed_at + 0.05,
                stopped_at=failed_at + 0.2,
            )
        if job.train.load:  # relaunch: starts iteration 6 at T0 + 10 after a 0.5 s load
            ckpt = (FAIL_AT - 1) // INTERVAL * INTERVAL
            records = recs(range(ckpt + 1, iters + 1), T0 + 10)
            summary = {"final_param_digest": digests["restart"]}
            return Launch(0, records, summary, run_dir, failed_at + 0.21, load_s=0.5)
        summary = {"final_param_digest": "ref", "median_iter_time_s": 0.1}
        return Launch(0, recs(range(1, iters + 1), T0), summary, run_dir, T0 - 5)

    return launch


def _bench_recovery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str
) -> tuple[int, dict[str, Any] | None]:
    """`deadpool bench recovery` over `_fake_launch` (both recoveries reproduce the reference):
    its exit code and its JSON (None when it failed)."""
    from megatron_deadpool.bench import recovery
    from megatron_deadpool.cli import main as cli

    monkeypatch.setattr(recovery, "launch", _fake_launch({"deadpool": "ref", "restart": "ref"}))
    out = tmp_path / "recovery.json"
    args = ["--fail", f"2@{FAIL_AT}", "--save-interval", str(INTERVAL), "--json", str(out)]
    rc = cli.main(["bench", "recovery", *args, *extra])
    return rc, json.loads(out.read_text()) if rc == 0 else None


@pytest.mark.timeout(60)
def test_bench_recovery_runs_the_hot_swap_by_node_agents_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """--node-agents: the hot swap is launched by one agent per simulated node (as the Slurm
    scripts run a job), the reference and the restart baseline as without; said in the table
    and the JSON."""
    from megatron_deadpool.bench import recovery
    from megatron_deadpool.cli import main as cli

    for flag, hot in ((), False), (("--node-agents",), True):
        agents: list[tuple[str, bool]] = []
        fake = _fake_launch({"deadpool": "ref", "restart": "ref"}, agents)
        monkeypatch.setattr(recovery, "launch", fake)
        out = tmp_path / "recovery.json"
        argv = ["--fail", f"2@{FAIL_AT}", "--save-interval", str(INTERVAL), "--json", str(out)]
        assert cli.main(["bench", "recovery", *argv, *flag]) == 0
        assert dict(agents) == {
            "reference": False,
            "deadpool": hot,
            "restart_fail": False,
            "restart_resume": False,
        }
        assert json.loads(out.read_text())["node_agents"] is hot
        said = "launched by node agents" in capsys.readouterr().out
        assert said is hot


@pytest.mark.timeout(60)
def test_bench_recovery_phases_add_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    rc, data = _bench_recovery(tmp_path, monkeypatch)
    assert rc == 0, capsys.readouterr().err
    failed_at = T0 + 0.75
    assert data["deadpool_recovery_s"] == pytest.approx(T0 + 0.75 + 1.05 - failed_at)
    assert data["restart_recovery_s"] == pytest.approx(T0 + 10.3 - failed_at)
    assert data["speedup"] == pytest.approx(data["restart_recovery_s"] / 1.05)
    assert (data["deadpool_recomputed"], data["restart_recomputed"]) == (0, 2)
    assert data["restart_checkpoint_iteration"] == 5
    for side in ("deadpool", "restart"):
        assert sum(data[f"{side}_phases_s"].values()) == pytest.approx(data[f"{side}_recovery_s"])
    assert data["restart_phases_s"]["checkpoint_load"] == pytest.approx(0.5)
    assert data["restart_phases_s"]["recompute"] == pytest.approx(0.2)  # iterations 6 and 7
    assert data["deadpool_matches_reference"] and data["restart_matches_reference"]
    assert data["deadpool_newcomers_claimed_s"] == 0.2  # of the reconstruct: the newcomer's build
    out = capsys.readouterr().out
    assert "speedup of the hot swap" in out
    assert "reconstruct, 0.200s until the newcomer claimed its slot" in out


@pytest.mark.timeout(60)
def test_bench_recovery_fails_when_a_recovered_run_differs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from megatron_deadpool.bench import recovery
    from megatron_deadpool.cli import main as cli

    monkeypatch.setattr(recovery, "launch", _fake_launch({"deadpool": "ref", "restart": "x"}))
    assert cli.main(["bench", "recovery", "--fail", f"2@{FAIL_AT}"]) == 1
    assert "differs from the failure-free run" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_bench_recovery_repeats_report_medians_and_the_speedups_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    rc, data = _bench_recovery(tmp_path, monkeypatch, "--repeats", "6")
    assert rc == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    speedup = (T0 + 10.3 - (T0 + 0.75)) / 1.05
    assert data["repeats"] == 6 and data["speedup_runs"] == pytest.approx([speedup] * 6)
    assert data["speedup_ratio"]["ci"] == pytest.approx([speedup, speedup])
    assert data["deadpool_recomputed_runs"] == [0] * 6
    assert f"median: {speedup:.1f}x (95% CI" in printed and "0/0/0/0/0/0" in printed
    # every repeat's phases beside the medians (the fake launches all take the same)
    reconstruct = [0.3 + n / 100 for n in range(6)]
    assert data["deadpool_phases_runs_s"]["reconstruct"] == pytest.approx(reconstruct)
    assert data["deadpool_phases_s"]["reconstruct"] == pytest.approx(0.325)  # their median
    spread = printed.split("hot swap per repeat (s): ")[1]
    assert spread.startswith("total " + "/".join(["1.050"] * 6))
    runs = "/".join(f"{x:.3f}" for x in reconstruct)
    assert f"reconstruct process groups          {runs}" in spread
