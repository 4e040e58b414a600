"""`deadpool megatron-lm`: the local launcher and its CLI (launch.py, cli/megatron_lm.py)."""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import pytest


def test_launcher_gives_each_rank_torchruns_environment(tmp_path: Path) -> None:
    from megatron_deadpool.megatron_lm.launch import MegatronLauncher

    script = tmp_path / "show_env.py"
    script.write_text(
        "import os, sys\n"
        "print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'],"
        " os.environ['LOCAL_RANK'], os.environ['MASTER_PORT'], sys.argv[1:], flush=True)\n"
    )
    out = tmp_path / "out.txt"
    with open(out, "w") as stream:
        rc = MegatronLauncher(str(script), ["--x", "1"], 3, patched=True, timeout_s=60,
                              run_dir=str(tmp_path / "run"), stream=stream).run()  # fmt: skip
    text = out.read_text()
    assert rc == 0, text
    for r in range(3):
        assert re.search(rf"rank {r} of 3 {r} \d+ \['--x', '1'\]", text), text
        assert (tmp_path / "run" / f"a{r}.log").exists()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["returncode"] == 0 and summary["exit_codes"] == {"a0": 0, "a1": 0, "a2": 0}


def test_launcher_stops_the_job_when_a_rank_fails_without_deadpool(tmp_path: Path) -> None:
    from megatron_deadpool.megatron_lm.launch import MegatronLauncher

    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n    sys.exit(7)\n"
        "time.sleep(120)\n"
    )
    t0 = time.monotonic()
    with open(tmp_path / "out.txt", "w") as stream:
        rc = MegatronLauncher(str(script), [], 2, patched=True, timeout_s=60,
                              run_dir=str(tmp_path / "run"), stream=stream).run()  # fmt: skip
    assert rc == 7 and time.monotonic() - t0 < 40
    assert "a1 exited with code 7" in (tmp_path / "out.txt").read_text()


def test_deadpool_megatron_lm_subcommand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`deadpool megatron-lm ...` through the real CLI entry (registered here in case cli.py
    does not list it yet)."""
    from megatron_deadpool.cli import main as cli

    monkeypatch.setitem(
        cli.COMMANDS, "megatron-lm", ("megatron_deadpool.cli.megatron_lm", "Megatron-LM runner")
    )
    script = tmp_path / "echo.py"
    script.write_text("import os, sys\nprint('task', os.environ['RANK'], sys.argv[1:])\n")
    rc = cli.main(["megatron-lm", "--nproc-per-node", "2", "--patched", "--run-dir",
                   str(tmp_path / "run"), str(script), "--timeout", "5"])  # fmt: skip
    assert rc == 0
    log = (tmp_path / "run" / "a1.log").read_text()
    assert "task 1 ['--timeout', '5']" in log
    assert cli.main(["megatron-lm", "--nproc-per-node", "0", str(script)]) == 2


def test_cli_passes_everything_after_the_script_through() -> None:
    from megatron_deadpool.cli.megatron_lm import configure

    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(
        ["--nproc-per-node", "4", "pretrain_gpt.py", "--timeout", "9", "--deadpool"]
    )
    assert args.nproc_per_node == 4 and args.script == "pretrain_gpt.py"
    assert args.script_args == ["--timeout", "9", "--deadpool"] and args.timeout == 3600.0
