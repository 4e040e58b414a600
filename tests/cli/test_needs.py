"""Without megatron-core (an extra now), the embedded job's commands stop up front with one line
and exit code 2 naming the install command, instead of starting workers that all fail at import
and ending "out of redundancy" (exit 3). `deadpool megatron-lm` is not checked: it takes
`megatron.core` from the Megatron-LM tree it runs.

megatron-core is installed in the test environment, so its absence is made real for one
process tree: a `megatron` package first on PYTHONPATH that fails to import, as a missing one
does."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import REPO_ROOT, deadpool_command


def run_without_megatron(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`deadpool ARGS` with `import megatron` failing as it does where it is not installed."""
    stand_in = tmp_path / "megatron"
    stand_in.mkdir(exist_ok=True)
    (stand_in / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'megatron'\", name='megatron')\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO_ROOT}", OMP_NUM_THREADS="1")
    return subprocess.run(
        [*deadpool_command(), *args],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "args",
    [
        ("train", "--tp", "1", "--dp", "2", "--iters", "2"),
        ("chaos", "--minutes", "1", "--mtbf-iters", "8"),
        ("selftest", "--nproc", "2"),
    ],
    ids=lambda a: a[0],
)
def test_embedded_job_commands_need_megatron_core_up_front(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    proc = run_without_megatron(tmp_path, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "megatron-core is not installed" in line
    assert "pip install 'megatron-deadpool[megatron-core]'" in line
    assert proc.stdout == ""  # nothing started


@pytest.mark.timeout(150)
def test_megatron_lm_and_help_need_no_installed_megatron_core(tmp_path: Path) -> None:
    assert run_without_megatron(tmp_path, "megatron-lm", "--help").returncode == 0
    assert run_without_megatron(tmp_path, "train", "--help").returncode == 0
    assert run_without_megatron(tmp_path, "--version").returncode == 0
