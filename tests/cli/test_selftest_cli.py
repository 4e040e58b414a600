"""`deadpool selftest`'s answers to bad input (megatron_deadpool/cli/selftest.py): exit code 2
and one line naming the flag, nothing printed on stdout and nothing run. What the selftest
checks is tested in tests/selftest/test_selftest.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import call_deadpool, run_deadpool

BAD_INPUT = [
    (["--nproc", "0"], "--nproc"),
    (["--nproc", "4", "--spares", "0"], "--spares"),
    (["--nproc", "4", "--timeout", "0"], "--timeout"),
    (["--nproc", "four"], "--nproc"),
    ([], "--nproc"),
    (["--nproc", "4", "--spare-nodes", "2"], "--spare-nodes"),
    (["--slurm", "--nproc", "4"], "--nproc"),
    (["--slurm"], "--slurm"),  # outside an allocation
]


def _check_refusal(rc: int, out: str, err: str, flag: str, run_dir: Path) -> None:
    assert rc == 2, out + err
    assert out == ""
    assert len(err.splitlines()) == 1 and flag in err, err
    assert not list(run_dir.iterdir())  # nothing ran


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("args", "flag"), BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path,
    args: list[str],
    flag: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.setenv(name, "")
    rc = call_deadpool("selftest", *args, "--run-dir", str(tmp_path))
    out, err = capsys.readouterr()
    _check_refusal(rc, out, err, flag, tmp_path)


@pytest.mark.timeout(120)
def test_bad_input_through_the_installed_command(tmp_path: Path) -> None:
    """One refusal as a real `deadpool` process (each pays seconds of imports: the other cases
    run `cli.main` in this process)."""
    proc = run_deadpool("selftest", "--nproc", "0", "--run-dir", str(tmp_path), timeout=90)
    _check_refusal(proc.returncode, proc.stdout, proc.stderr, "--nproc", tmp_path)
