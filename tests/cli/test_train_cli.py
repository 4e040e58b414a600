"""`deadpool train`'s answers to bad input (megatron_deadpool/cli/train.py and the job schema):
exit code 2 and one line on stderr naming the field - never a traceback, and before any worker
process starts. Training itself is tested in tests/embedded/test_train.py."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from conftest import call_deadpool, run_deadpool

BAD_INPUT: dict[str, tuple[list[str], str]] = {
    # case: (arguments after `deadpool train`, text the one stderr line must contain)
    "replica-device": (["--deadpool-replica-device", "tpu"], "--deadpool-replica-device"),
    "iters-not-int": (["--iters", "many"], "--iters"),
    "tp-zero": (["--tp", "0"], "parallel.tp"),
    "spares-negative": (["--spares", "-1"], "spare-ranks"),
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
    rc = call_deadpool(*_argv(case, bad_dir))
    out, err = capsys.readouterr()
    _check_refusal(case, rc, out, err, bad_dir / f"run-{case}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_bad_input_through_the_installed_command(
    case: str, bad_dir: Path, bad_subprocesses: dict[str, subprocess.CompletedProcess]
) -> None:
    proc = bad_subprocesses[case]
    _check_refusal(case, proc.returncode, proc.stdout, proc.stderr, bad_dir / f"run-{case}")
