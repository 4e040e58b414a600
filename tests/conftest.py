"""Shared test set-up: the harness on the import path, and a runner for the real `deadpool` CLI.

Multi-process tests use `tests/mp.py` (fresh interpreters joined in a gloo world on a loopback
TCPStore); CLI tests run the installed `deadpool` command as a subprocess, the way a user does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


def deadpool_command() -> list[str]:
    """The installed `deadpool` entry point next to this interpreter, else `-m` on the CLI."""
    script = Path(sys.executable).parent / "deadpool"
    return [str(script)] if script.exists() else [sys.executable, "-m", "megatron_deadpool.cli"]


def run_deadpool(
    *args: str, timeout: float = 120.0, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run `deadpool ARGS...` to completion; stdout and stderr captured as text."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONWARNINGS", None)  # what a user sees, warnings included
    return subprocess.run(
        [*deadpool_command(), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(cwd or REPO_ROOT),
        env=env,
    )


def call_deadpool(*args: str) -> int:
    """`deadpool ARGS...` in this process, through the real entry point (`cli.main.main`): its
    exit code, argparse's own exits included. Output goes to pytest's capture (`capsys`)."""
    from megatron_deadpool.cli import main as cli

    try:
        return cli.main(list(args))
    except SystemExit as exc:  # argparse's own errors and --help exit
        return exc.code if isinstance(exc.code, int) else 1


@pytest.fixture
def deadpool_cli() -> Callable[..., subprocess.CompletedProcess]:
    """`deadpool_cli("train", "--tp", "0")` runs the real CLI and returns the finished process."""
    return run_deadpool


# Fast failure detection for tests: hangs are named after 3 s of silence.
FAST_HEARTBEAT = ["--deadpool-heartbeat-timeout", "3", "--deadpool-heartbeat-interval", "0.5"]


def train_case(
    out: Path, args: list[str], iters: str
) -> tuple[subprocess.CompletedProcess, list[dict], dict]:
    """`deadpool train ARGS` with logs under `out` ("{ckpt}" in ARGS becomes out/ckpt).

    Returns the finished process, the per-iteration records and the summary ({} if none).
    """
    import json

    log = out / "run.jsonl"
    proc = run_deadpool(
        "train",
        *(a.replace("{ckpt}", str(out / "ckpt")) for a in args),
        "--iters",
        iters,
        *FAST_HEARTBEAT,
        "--json-log",
        str(log),
        "--run-dir",
        str(out / "logs"),
        timeout=240,
    )
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    if lines and lines[-1].get("event") == "summary":
        return proc, lines[:-1], lines[-1]
    return proc, lines, {}


def assert_out_of_redundancy(
    proc: subprocess.CompletedProcess, report: dict, out: Path, survivors: list[int]
) -> None:
    """A `deadpool train` run (`train_case` under `out`) that ran out of redundancy: exit code
    3, the reason on the launcher's output, and each survivor's log ending on the message it
    exited with ("out of redundancy: REASON; ..."), as README "When memory cannot recover"
    documents."""
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report, "no out_of_redundancy report in the summary"
    assert f"OUT OF REDUNDANCY: {report['reason']}" in proc.stdout, proc.stdout[-3000:]
    for rank in survivors:
        log = (out / "logs" / f"a{rank}.log").read_text(errors="replace")
        assert f"out of redundancy: {report['reason']}; " in log, (rank, log[-2000:])
