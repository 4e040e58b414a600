"""`deadpool bench`'s command line (megatron_deadpool/cli/bench.py) through the real `deadpool`
command: every benchmark the docs list (docs/explanation/benchmarks.md) is registered, and bad arguments are refused with
exit code 2 and one line, before anything runs. What the benchmarks measure is tested in
tests/bench/ (and `bench recovery` in tests/embedded/test_checkpoint.py)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import call_deadpool

REPO = Path(__file__).resolve().parents[2]
# The benchmarks the docs list in their "Benchmarks" block (`deadpool bench NAME ...`).
BENCHMARKS_PAGE = (REPO / "docs" / "explanation" / "benchmarks.md").read_text()
DOCUMENTED = set(re.findall(r"^deadpool bench ([a-z-]+)", BENCHMARKS_PAGE, re.MULTILINE))


def test_every_documented_benchmark_is_listed_with_its_module() -> None:
    from megatron_deadpool.cli.bench import BENCHES

    assert {"overhead", "recovery", "paper"} <= DOCUMENTED  # the docs' block was found
    assert set(BENCHES) == DOCUMENTED
    for name, (module, _) in BENCHES.items():
        assert module.startswith("megatron_deadpool.bench."), name
        assert importlib.util.find_spec(module) is not None, module


@pytest.mark.timeout(60)
def test_bench_without_a_name_says_which_exist(capsys: pytest.CaptureFixture[str]) -> None:
    assert call_deadpool("bench") == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert all(name in line for name in DOCUMENTED), line


@pytest.mark.timeout(60)
def test_a_bench_starts_its_jobs_with_fork_servers_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DEADPOOL_WARM_START=shared (as this test session sets it) would let every job of a bench
    after the first skip its imports: `deadpool bench` turns it back to each job's own."""
    monkeypatch.setenv("DEADPOOL_WARM_START", "shared")
    assert call_deadpool("bench") == 2
    assert os.environ["DEADPOOL_WARM_START"] == "1"


@pytest.mark.timeout(60)
def test_bench_overhead_refuses_nothing_to_measure(capsys: pytest.CaptureFixture) -> None:
    assert call_deadpool("bench", "overhead", "--iters", "2", "--warmup", "2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "iters (2) must exceed warmup (2)" in err[0]


@pytest.mark.timeout(60)
def test_bench_recovery_refuses_bad_arguments_before_any_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from megatron_deadpool.bench import recovery

    def no_run(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a run was started")

    monkeypatch.setattr(recovery, "launch", no_run)
    assert call_deadpool("bench", "recovery", "--fail", "2@8:hang") == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert call_deadpool("bench", "recovery", "--repeats", "0") == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--repeats" in line
