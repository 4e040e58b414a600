"""`deadpool bench paper`: settings, figures of a run, tables and plots, on synthetic runs.

No training is launched here: a fake runner returns iteration records whose gaps are known, so
the amortised times, ratios and save counts can be checked exactly, and the report (results.md,
the three PNGs, the JSON) is generated from them. The end-to-end `--quick` run takes about six
minutes on the 2-core CPU machine (six configurations plus the recovery pair, each a real job of
five processes), too long for the suite: it is documented in docs/reproduce.md instead.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_deadpool.bench import interleaved, plots, report
from megatron_deadpool.bench.overhead import base_job
from megatron_deadpool.bench.recovery import PHASE_LABELS, Launch
from megatron_deadpool.bench.reproduce import paper, paper_matrix
from megatron_deadpool.bench.stats import ratio_summary
from megatron_deadpool.errors import ConfigError

STEP, SAVE, FIRST = 0.1, 0.05, 1.0
"""Fake runs: s per iteration, s per save, one-time start-up of the first save."""


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    paper.configure(parser)
    return parser.parse_args(list(argv))


def fake_runner(calls: list[tuple[str, int, str]]):
    """Records whose gaps are STEP, plus SAVE after every saved iteration (FIRST once more)."""

    def run(job, run_dir: Path, stop: bool, worker: str) -> Launch:
        every = job.train.save_interval
        calls.append(("deadpool" if job.deadpool.enabled else "off", every, worker))
        t, records = 100.0, []
        for i in range(1, job.train.iters + 1):
            if every and i > 1 and (i - 1) % every == 0:
                t += SAVE + (FIRST if i - 1 == every else 0.0)
            t += STEP
            records.append({"iteration": i, "time": t, "loss": 3.0 - 0.1 * i, "iter_time_s": STEP})
        summary = {"final_param_digest": "d" * 64, "wall_s": t - 100.0}
        return Launch(0, records, summary, run_dir, spawned_at=0.0)

    return run


def test_settings_quick_defaults_and_validation() -> None:
    s = paper.settings(parse("--quick"))
    assert (s["iters"], s["interval"], s["repeats"], s["warmup"]) == (13, 4, 1, 5)
    assert s["modes"] == list(paper_matrix.MODE_KEYS)
    s = paper.settings(parse("--modes", "ckpt_1,deadpool"))
    assert s["modes"] == ["no_ft", "deadpool", "ckpt_1"]  # the baseline is always there
    assert s["repeats"] == paper.DEFAULT["repeats"]
    with pytest.raises(ConfigError, match="unknown"):
        paper.settings(parse("--modes", "sync"))
    with pytest.raises(ConfigError, match="N >= 2"):
        paper.settings(parse("--interval", "1"))
    with pytest.raises(ConfigError, match="timed window"):
        paper.settings(parse("--iters", "6", "--interval", "4"))


def test_run_figures_count_every_save_in_the_window() -> None:
    calls: list = []
    runner = fake_runner(calls)
    jobs = paper_matrix.matrix_jobs(base_job(None), paper.settings(parse("--quick")))
    every_n = paper_matrix.mode_job(jobs, paper_matrix.MODES[3], 4, Path("/nonexistent"))
    assert every_n.train.save_interval == 4 and not every_n.deadpool.enabled
    fig = interleaved.iteration_times(runner(every_n, Path("."), False, "").records, 5, 4)
    assert len(fig.gaps_s) == 8  # iterations 6..13
    assert fig.saves_in_window == 2  # after iterations 8 and 12
    assert fig.amortised_s == pytest.approx(STEP + 2 * SAVE / 8)
    assert fig.median_s == pytest.approx(STEP)
    assert fig.first_save_s == pytest.approx(SAVE + FIRST)
    hot = paper_matrix.mode_job(jobs, paper_matrix.MODES[1], 4, Path("/nonexistent"))
    assert hot.deadpool.enabled and hot.deadpool.spares >= 1 and not hot.deadpool.fail
    assert not hot.train.save


def test_report_from_fake_runs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    calls: list = []
    out = tmp_path / "out"
    args = parse(
        "--quick", "--no-recovery", "--out", str(out), "--json", str(tmp_path / "r.json"),
        "--nvrx-python", str(tmp_path / "no-such-python"),
    )  # fmt: skip
    assert paper.run(args, runner=fake_runner(calls)) == 0
    assert [c[2] for c in calls] == ["", "", "", "", "async"]  # nvrx: not runnable here
    result = json.loads((tmp_path / "r.json").read_text())
    modes = result["failure_free"]["modes"]
    assert modes["ckpt_1"]["amortised_s"] == pytest.approx(STEP + SAVE)
    assert modes["ckpt_1"]["ratio_vs_no_ft"] == pytest.approx((STEP + SAVE) / STEP)
    assert modes["ckpt_n"]["ratio_vs_no_ft"] == pytest.approx((STEP + SAVE / 4) / STEP)
    assert modes["deadpool"]["ratio_vs_no_ft"] == pytest.approx(1.0)
    assert modes["nvrx_local_1"]["amortised_s"] is None
    assert "no-such-python" in modes["nvrx_local_1"]["reason"]
    text = (out / "results.md").read_text()
    # One repeat: a ratio has no interval, so none is printed as a figure.
    assert (
        "| checkpoint every iteration | 0.150 | 0.150 | not measured: 1 repeat(s) give no " in text
    )
    assert "1.50x" not in text
    assert "| NVRx local ckpt + replication every iteration | not measured:" in text
    assert (out / "iteration_time.png").stat().st_size > 10_000
    assert "![failure-free iteration time](iteration_time.png)" in text
    assert not (out / "recovery_timeline.png").exists()


def test_ratios_are_figures_only_when_their_interval_excludes_one(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    args = parse(
        "--quick", "--repeats", "6", "--no-recovery", "--modes", "deadpool,ckpt_1",
        "--out", str(out),
    )  # fmt: skip
    assert paper.run(args, runner=fake_runner([])) == 0
    text = (out / "results.md").read_text()
    # Every repeat gives the same ratios: 1.5 exactly for a save per iteration, 1.0 for DeadPool.
    assert "| 1.50x (95% CI 1.50-1.50, 6 repeats) |" in text
    assert "| no difference measurable at this noise (95% CI 1.00-1.00, 6 repeats) |" in text


def synthetic_recovery() -> dict:
    return {
        "deadpool_phases_s": {
            "detect": 0.4, "agree": 0.6, "reconstruct": 3.1, "restore": 0.2,
            "recompute": 0.0, "first_iteration": 1.2,
        },
        "restart_phases_s": {
            "detect": 0.1, "teardown": 0.3, "relaunch_init": 21.0, "checkpoint_load": 2.2,
            "recompute": 1.5, "first_iteration": 0.4,
        },
        "deadpool_recovery_s": 5.5, "restart_recovery_s": 25.5, "speedup": 25.5 / 5.5,
        "speedup_ratio": ratio_summary([25.5 / 5.5] * 6),
        "deadpool_recomputed": 1, "restart_recomputed": 3, "deadpool_restore_iteration": 6,
        "restart_checkpoint_iteration": 4, "deadpool_matches_reference": True,
        "restart_matches_reference": True, "repeats": 1,
        "config": {"fail": "2@8", "save_interval": 4},
        "phase_labels": dict(PHASE_LABELS),
    }  # fmt: skip


def test_recovery_table_and_all_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    losses = [3.0 - 0.1 * i for i in range(1, 14)]
    result = {
        "settings": {"iters": 13, "interval": 4, "repeats": 1, "recovery_repeats": 1,
                     "warmup": 5},
        "config": {"tp": 2, "pp": 1, "dp": 2, "world": 4, "ranks_per_node": 2, "replicas": 1,
                   "spares": 1},
        "machine": "test", "command": "deadpool bench paper --quick", "wall_s": 60.0,
        "failure_free": {"modes": {
            "no_ft": {"label": "no fault tolerance", "protects": "-", "amortised_s": 0.2,
                      "median_s": 0.2, "ratio_vs_no_ft": 1.0, "saves_in_window": 0,
                      "first_save_s": None, "losses_match_no_ft": True,
                      "digests_match_no_ft": True, "per_run_amortised_s": [0.2]},
            "async_1": {"label": "async checkpoint every iteration", "protects": "-",
                        "amortised_s": None, "reason": "forked writer hangs in this setup"},
        }},
        "recovery": synthetic_recovery(),
        "loss": {"reference_losses": losses, "deadpool_losses": losses, "fail_iteration": 8,
                 "failure": "rank 2 kill at iteration 8", "restore_iteration": 6,
                 "recomputed_iterations": [7], "bitwise_identical": True},
    }  # fmt: skip
    plots.draw(result, tmp_path)
    assert set(result["figures"]) == {"iteration_time.png", "recovery_timeline.png",
                                      "loss_curve.png"}  # fmt: skip
    for name in result["figures"]:
        assert (tmp_path / name).stat().st_size > 10_000
    text = plots.markdown(result)
    assert "| **total** | **5.50 s** | **25.50 s** |" in text
    assert "| reconstruct process groups | 3.100 | - |" in text
    assert "| relaunch + init (start to load) | - | 21.000 |" in text
    assert "| iterations recomputed | 1 | 3 |" in text
    assert "Restart / hot swap: 4.6x (95% CI 4.6-4.6, 6 repeats)" in text
    assert "not measured: forked writer hangs" in text


def test_report_helpers(tmp_path: Path) -> None:
    assert report.text_row(["a", "1.5s"], ["<3", ">6"]) == "a     1.5s"
    assert report.markdown_table(["x", "y", "z"], [["1", "", "3"]]) == [
        "| x | y | z |",
        "|---|---|---|",
        "| 1 | | 3 |",
    ]
    report.write_json(tmp_path / "r.json", {"a": 1, "p": tmp_path})
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1, "p": str(tmp_path)}


@pytest.mark.timeout(120)
def test_worker_program_is_passed_not_swapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron_deadpool.bench import timed_launch
    from megatron_deadpool.bench.reproduce import paper_workers
    from megatron_deadpool.embedded import launch

    local = launch.LocalLauncher
    passed: list = []

    def timed(job, run_dir: Path, stop: bool, timeout_s: float, **worker) -> Launch:
        assert launch.LocalLauncher is local
        passed.append(worker)
        return Launch(0, [], {}, run_dir, spawned_at=0.0)

    monkeypatch.setattr(timed_launch, "launch", timed)
    job = base_job(None)
    paper_workers.launch(job, tmp_path, False, "", timeout_s=1.0, python="py")
    paper_workers.launch(job, tmp_path, False, "async", timeout_s=1.0, python="py")
    assert passed[0] == {} and set(passed[1]) == {"worker_command", "worker_env"}
    assert "PYTHONPATH" in passed[1]["worker_env"]
    launcher = local(job, run_dir=str(tmp_path), quiet=True, **passed[1])
    commands = [
        launcher._command("a0", "h:1"),
        local(job, run_dir=str(tmp_path))._command("a0", "h:1"),
    ]
    assert commands[0][:4] == [
        "py",
        "-m",
        "megatron_deadpool.bench.reproduce.paper_workers",
        "async",
    ]
    assert commands[1][1:3] == ["-m", "megatron_deadpool.embedded.worker"]


def test_worker_entry_needs_a_kind() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "megatron_deadpool.bench.reproduce.paper_workers"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 1 and "usage" in out.stderr  # sys.exit("usage: ...")
