"""`deadpool train` end to end through the real CLI, and its answers to bad input.

Two full runs (TP2 x DP2, 4 iterations; DeadPool on, then off) must give bit-identical losses
and final parameters; the DeadPool run must show each iteration's replication committed one
iteration behind. Bad input of every kind must end with exit code 2 and one line on stderr
naming the field - never a traceback, and before any worker process starts.
Also `deadpool bench overhead`'s aggregation and JSON, with the training runs stubbed out.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from conftest import run_deadpool

ITERS = 4
RUN_ARGS = ["train", "--tp", "2", "--dp", "2", "--iters", str(ITERS)]


def _read_log(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert lines and lines[-1].get("event") == "summary", "the last JSON line is the summary"
    return lines[:-1], lines[-1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The two full training runs of this file (each ~20 s on 2 cores)."""
    out: dict[str, Any] = {}
    for mode, extra in (("on", []), ("off", ["--no-deadpool"])):
        d = tmp_path_factory.mktemp(f"train-{mode}")
        log = d / "log.jsonl"
        proc = run_deadpool(
            *RUN_ARGS, *extra, "--json-log", str(log), "--run-dir", str(d / "run"), timeout=240
        )
        assert proc.returncode == 0, f"DeadPool {mode}: exit {proc.returncode}\n{proc.stderr}"
        assert "Traceback" not in proc.stderr
        records, summary = _read_log(log)
        out[mode] = {"records": records, "summary": summary, "stdout": proc.stdout}
    return out


@pytest.mark.timeout(420)
def test_deadpool_on_and_off_train_bit_identically(runs: dict[str, Any]) -> None:
    on, off = runs["on"]["summary"], runs["off"]["summary"]
    assert on["returncode"] == off["returncode"] == 0
    assert on["iterations"] == off["iterations"] == ITERS
    assert len(on["losses"]) == ITERS
    assert on["losses"] == off["losses"]  # exact float equality, not approx
    assert on["final_param_digest"] is not None
    assert on["final_param_digest"] == off["final_param_digest"]
    assert on["dp_replicas_identical"] and off["dp_replicas_identical"]
    assert on["deadpool"] is True and off["deadpool"] is False


@pytest.mark.timeout(420)
def test_replication_commits_one_iteration_behind(runs: dict[str, Any]) -> None:
    records = runs["on"]["records"]
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    assert records[0]["committed_iteration"] is None  # round 1 still in flight
    for rec in records[1:]:
        assert rec["committed_iteration"] == rec["iteration"] - 1, rec
        assert rec["replica_bytes_sent"] > 0
    assert runs["on"]["summary"]["committed_iteration"] == ITERS  # the final round, drained
    for rec in runs["off"]["records"]:
        assert rec["committed_iteration"] is None and rec["replica_bytes_sent"] == 0


@pytest.mark.timeout(420)
def test_losses_fall(runs: dict[str, Any]) -> None:
    for mode in ("on", "off"):
        losses = runs[mode]["summary"]["losses"]
        assert losses[-1] < losses[0], (mode, losses)
        assert [r["loss"] for r in runs[mode]["records"]] == losses


# ---------------------------------------------------------------------- bad input
BAD_INPUT: dict[str, tuple[list[str], str]] = {
    # case: (arguments after `deadpool train`, text the one stderr line must contain)
    "replica-device": (["--deadpool-replica-device", "tpu"], "--deadpool-replica-device"),
    "iters-not-int": (["--iters", "many"], "--iters"),
    "tp-zero": (["--tp", "0"], "parallel.tp"),
    "spares-negative": (["--spares", "-1"], "spares"),
    "world-vs-ranks-per-node": (
        ["--tp", "2", "--dp", "3", "--ranks-per-node", "4"],
        "ranks-per-node",
    ),
    "world-vs-ranks-per-node-off": (
        ["--no-deadpool", "--tp", "2", "--dp", "3", "--ranks-per-node", "4"],
        "ranks-per-node",
    ),
    "replicas-cannot-place": (["--deadpool-replicas", "2", "--dp", "2"], "deadpool-replicas"),
    "dp-one": (["--dp", "1"], "dp >= 2"),
    "fail-malformed": (["--fail", "2@x"], "fail"),
    "fail-no-such-rank": (["--fail", "9@2"], "fail: rank 9"),
    "yaml-unknown-key": (["--config", "{dir}/unknown.yaml"], "model.hidden"),
    "yaml-wrong-type": (["--config", "{dir}/wrong_type.yaml"], "model.hidden_size"),
    "config-missing": (["--config", "{dir}/missing.yaml"], "missing.yaml"),
}


SUBPROCESS_CASES = ("replica-device", "tp-zero", "replicas-cannot-place", "yaml-wrong-type")
"""One case per kind of refusal (argparse, schema, placement, YAML) also runs as a real
`deadpool` process; each pays ~5 s of imports, so the rest run `cli.main` in this process."""


def _argv(case: str, d: Path) -> list[str]:
    args = [a.format(dir=d) for a in BAD_INPUT[case][0]]
    extra = ["--iters", "2", "--timeout", "30"] if case != "iters-not-int" else []
    return ["train", *args, *extra, "--run-dir", str(d / f"run-{case}")]


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bad-input")
    (d / "unknown.yaml").write_text(yaml.safe_dump({"model": {"hidden": 64}}))
    (d / "wrong_type.yaml").write_text(yaml.safe_dump({"model": {"hidden_size": "big"}}))
    return d


@pytest.fixture(scope="module")
def bad_subprocesses(bad_dir: Path) -> dict[str, subprocess.CompletedProcess]:
    """The subprocess cases, two at a time."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = pool.map(lambda c: run_deadpool(*_argv(c, bad_dir), timeout=120), SUBPROCESS_CASES)
        return dict(zip(SUBPROCESS_CASES, procs))


def _check_refusal(case: str, rc: int, stdout: str, stderr: str, run_dir: Path) -> None:
    expected = BAD_INPUT[case][1]
    assert "Traceback" not in stderr, stderr
    assert rc == 2, f"exit {rc}\n{stdout}\n{stderr}"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    assert expected in lines[0], lines[0]
    assert lines[0].startswith("deadpool"), lines[0]
    # Refused before any worker process started.
    assert not list(run_dir.glob("*.log")), f"workers were started: {sorted(run_dir.iterdir())}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_exits_2_with_one_line(
    case: str, bad_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    from megatron_deadpool.cli import main as cli

    try:
        rc = cli.main(_argv(case, bad_dir))
    except SystemExit as exc:  # argparse's own errors exit
        rc = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    _check_refusal(case, rc, out, err, bad_dir / f"run-{case}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_bad_input_through_the_installed_command(
    case: str, bad_dir: Path, bad_subprocesses: dict[str, subprocess.CompletedProcess]
) -> None:
    proc = bad_subprocesses[case]
    _check_refusal(case, proc.returncode, proc.stdout, proc.stderr, bad_dir / f"run-{case}")


# ---------------------------------------------------------------------- bench overhead
def _fake_runner(calls: list[str]) -> Callable[..., SimpleNamespace]:
    """Stands in for LocalLauncher runs: 'on' iterations take 10% longer."""

    def runner(job: Any, run_dir: Path, *_: Any) -> SimpleNamespace:
        mode = "on" if job.deadpool.enabled else "off"
        calls.append(mode)
        base = 0.1 if mode == "off" else 0.11
        iters = job.train.iters
        records, end = [], 1000.0
        for i in range(1, iters + 1):
            step = 5.0 if i <= 2 else base + 0.001 * (i % 3)
            end += step  # iterations follow each other: the gap to the previous end is the step
            records.append(
                {
                    "iteration": i,
                    "time": end,
                    "loss": 3.0 - 0.1 * i,
                    "iter_time_s": step,
                    "replication_s": 0.0 if mode == "off" else 0.01,
                    "replica_bytes_sent": 0 if mode == "off" else 1000,
                    "committed_iteration": None,
                }
            )
        summary = {"final_param_digest": "abc", "wall_s": 1.0}
        return SimpleNamespace(returncode=0, records=records, summary=summary)

    return runner


@pytest.mark.timeout(60)
def test_bench_overhead_interleaves_and_writes_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from megatron_deadpool.bench import overhead
    from megatron_deadpool.cli import main as cli

    calls: list[str] = []
    monkeypatch.setattr(overhead, "_launch", _fake_runner(calls))
    out = tmp_path / "overhead.json"
    rc = cli.main(["bench", "overhead", "--repeats", "2", "--iters", "6", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert calls == ["off", "on", "off", "on"]
    data = json.loads(out.read_text())
    assert {"off_iter_s", "on_iter_s", "ratio_median", "runs"} <= set(data)
    assert len(data["runs"]) == 4
    assert all(len(r["gaps_s"]) == 4 for r in data["runs"])  # 2 warm-up left out
    assert [(r["config"], r["repeat"]) for r in data["runs"]] == [
        ("off", 1), ("on", 1), ("off", 2), ("on", 2)
    ]  # fmt: skip
    # Timed iterations 3..6 take base + 0, 1, 2, 0 ms: amortised (their mean) base + 0.75 ms,
    # typical (their median) base + 0.5 ms.
    assert all(r["median_s"] == pytest.approx(r["amortised_s"] - 0.00025) for r in data["runs"])
    assert data["off_iter_s"] == pytest.approx(0.10075)
    assert data["on_iter_s"] == pytest.approx(0.11075)
    assert data["ratio_median"] == pytest.approx(0.11075 / 0.10075)
    assert data["losses_identical"] and data["digests_identical"]
    assert data["ratio_ci95"] is None  # two pairs are too few for a 95% interval
    out = capsys.readouterr().out
    assert "2 repeat(s) give no 95% interval (6 needed)" in out
    assert "1.1" not in out.splitlines()[-2]  # no ratio printed as a figure


@pytest.mark.timeout(60)
def test_bench_overhead_refuses_nothing_to_measure(capsys: pytest.CaptureFixture) -> None:
    from megatron_deadpool.cli import main as cli

    assert cli.main(["bench", "overhead", "--iters", "2", "--warmup", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "iters (2) must exceed warmup (2)" in err[0]
