"""`deadpool megatron-lm`'s command line (megatron_deadpool/cli/megatron_lm.py), through the real
`deadpool` command: everything after the script goes to it, bad input exits 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import call_deadpool


@pytest.mark.timeout(120)
def test_deadpool_megatron_lm_runs_the_script_on_every_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`deadpool megatron-lm ...` through the real `deadpool` command's registry."""
    script = tmp_path / "echo.py"
    script.write_text("import os, sys\nprint('task', os.environ['RANK'], sys.argv[1:])\n")
    rc = call_deadpool("megatron-lm", "--nproc-per-node", "2", "--patched", "--run-dir",
                       str(tmp_path / "run"), str(script), "--timeout", "5")  # fmt: skip
    assert rc == 0, capsys.readouterr()
    log = (tmp_path / "run" / "a1.log").read_text()
    assert "task 1 ['--timeout', '5']" in log
    assert call_deadpool("megatron-lm", "--nproc-per-node", "0", str(script)) == 2


@pytest.mark.timeout(60)
def test_cli_passes_everything_after_the_script_through() -> None:
    from megatron_deadpool.cli.main import build_parser

    argv = ["megatron-lm", "--nproc-per-node", "4", "pretrain_gpt.py", "--timeout", "9",
            "--deadpool"]  # fmt: skip
    parser, _ = build_parser(argv)
    args = parser.parse_args(argv)
    assert args.nproc_per_node == 4 and args.script == "pretrain_gpt.py"
    assert args.script_args == ["--timeout", "9", "--deadpool"] and args.timeout == 3600.0


@pytest.mark.timeout(120)
def test_torchruns_spellings_mean_the_same(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--nproc_per_node` (torchrun's, Megatron-LM's examples') starts the same ranks as
    `--nproc-per-node`; `--nnodes 1` is this machine; `deadpool train` takes it for its
    ranks per node."""
    from megatron_deadpool.cli.main import build_parser
    from megatron_deadpool.config.job_args import job_from_args

    script = tmp_path / "echo.py"
    script.write_text("import os\nprint('task', os.environ['RANK'])\n")
    rc = call_deadpool("megatron-lm", "--nproc_per_node", "2", "--nnodes", "1", "--patched",
                       "--run-dir", str(tmp_path / "run"), str(script))  # fmt: skip
    assert rc == 0, capsys.readouterr()
    assert "task 1" in (tmp_path / "run" / "a1.log").read_text()
    argv = ["train", "--tp", "2", "--dp", "2", "--nproc_per_node", "4"]
    parser, _ = build_parser(argv)
    assert job_from_args(parser.parse_args(argv)).ranks_per_node == 4
