"""The `deadpool` command itself (megatron_deadpool/cli/main.py): the installed entry point lists
every subcommand the README documents, and a missing or unknown one is refused."""

from __future__ import annotations

import pytest
from conftest import call_deadpool, run_deadpool

# The subcommands the README documents, in the order `deadpool --help` lists them.
DOCUMENTED = (
    "train", "bench", "plan", "chaos", "megatron-lm", "selftest", "coordinator", "agent",
    "slurm-script", "files", "report",
)  # fmt: skip


@pytest.mark.timeout(60)
def test_installed_command_lists_every_documented_subcommand() -> None:
    proc = run_deadpool("--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    listed = [
        line.split()[0]
        for line in proc.stdout.split("positional arguments:")[1].split("options:")[0].splitlines()
        if line.startswith("    ") and not line.startswith("     ")
    ]
    assert tuple(listed) == DOCUMENTED, proc.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", DOCUMENTED)
def test_every_subcommand_is_registered_with_its_module(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`deadpool NAME --help` loads NAME's module through main.py's registry and shows its
    own flags (a subcommand registered without a module, or the wrong one, fails here)."""
    assert call_deadpool(name, "--help") == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: deadpool {name} "), out
    assert "options:" in out and len(out.splitlines()) > 3, out


@pytest.mark.timeout(60)
def test_no_subcommand_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert call_deadpool() == 2
    assert "COMMAND" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_unknown_subcommand_is_one_line_and_exit_2() -> None:
    proc = run_deadpool("nope", timeout=60)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("deadpool: error:") and "'nope'" in line, proc.stderr
    assert "Traceback" not in proc.stderr
