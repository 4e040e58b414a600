"""`deadpool --version`, `deadpool slurm-script` and `deadpool files`: what a user installed from
a wheel, without a clone, gets (issue 39): the versions, and the Slurm scripts, job configs and
Megatron-LM patches the package carries - a printed sbatch script submitted from an empty folder
runs the package's own launcher."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from conftest import REPO_ROOT, call_deadpool, deadpool_command, run_deadpool

import megatron_deadpool
from megatron_deadpool.cli import files

RESOURCES = REPO_ROOT / "megatron_deadpool" / "resources"


@pytest.mark.timeout(60)
def test_version_names_deadpool_torch_and_megatron_core() -> None:
    proc = run_deadpool("--version", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        f"deadpool {megatron_deadpool.__version__} (torch {metadata.version('torch')}, "
        f"megatron-core {metadata.version('megatron-core')})\n"
    )
    assert metadata.version("megatron-deadpool") == megatron_deadpool.__version__


@pytest.mark.timeout(60)
def test_version_imports_no_torch() -> None:
    code = (
        "import sys\nfrom megatron_deadpool.cli.main import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "assert 'torch' not in sys.modules and 'megatron' not in sys.modules, 'imported'\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("deadpool ")


@pytest.mark.timeout(60)
def test_slurm_script_lists_the_sites(capsys: pytest.CaptureFixture[str]) -> None:
    assert call_deadpool("slurm-script") == 0
    sites = sorted(p.stem for p in (REPO_ROOT / "scripts" / "slurm").glob("*.sbatch"))
    assert capsys.readouterr().out.split() == sites == ["perlmutter", "vista"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("site", ["perlmutter", "vista"])
def test_slurm_script_prints_the_packaged_script_unchanged(
    site: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert call_deadpool("slurm-script", site) == 0
    out = capsys.readouterr().out
    assert out == (RESOURCES / "scripts" / "slurm" / f"{site}.sbatch").read_text()
    assert out == (REPO_ROOT / "scripts" / "slurm" / f"{site}.sbatch").read_text()


@pytest.mark.timeout(60)
def test_slurm_script_unknown_site_is_one_line_with_the_list_and_exit_2() -> None:
    proc = run_deadpool("slurm-script", "nersc", timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert "'nersc'" in line and "perlmutter, vista" in line, line


@pytest.mark.timeout(60)
def test_files_lists_prints_and_locates(capsys: pytest.CaptureFixture[str]) -> None:
    assert call_deadpool("files") == 0
    listed = capsys.readouterr().out.split()
    for name in (
        "scripts/slurm/deadpool_launch.sh",
        "scripts/slurm/deadpool_coordinator.sh",
        "scripts/inject_failure.sh",
        "scripts/apply_patches.sh",
        "configs/cpu-demo.yaml",
        "configs/models/gpt-7b.yaml",
        "configs/clusters/vista.yaml",
        "patches/megatron-lm/core_v0.19.0/0001-pretrain_gpt-deadpool-hooks.patch",
    ):
        assert name in listed, name
    assert "scripts/slurm/lab.py" not in listed and "scripts/checks.sh" not in listed
    assert call_deadpool("files", "configs/models/gpt-7b.yaml") == 0
    assert capsys.readouterr().out == (REPO_ROOT / "configs/models/gpt-7b.yaml").read_text()
    assert call_deadpool("files", "--path", "configs/cpu-demo.yaml") == 0
    assert Path(capsys.readouterr().out.strip()) == RESOURCES / "configs" / "cpu-demo.yaml"
    assert call_deadpool("files", "configs/nope.yaml") == 2
    assert "deadpool files" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_files_copy_lays_them_out_as_in_the_repository(tmp_path: Path) -> None:
    kept = tmp_path / "configs" / "cpu-demo.yaml"
    kept.parent.mkdir()
    kept.write_text("mine\n")
    assert call_deadpool("files", "--copy", str(tmp_path)) == 0
    for name in files.packaged():
        if name != "configs/cpu-demo.yaml":
            assert (tmp_path / name).read_bytes() == (REPO_ROOT / name).read_bytes(), name
    assert kept.read_text() == "mine\n"  # an existing file is the user's: kept
    assert os.access(tmp_path / "scripts/slurm/perlmutter.sbatch", os.X_OK)
    assert call_deadpool("files", "--copy", str(tmp_path), "configs/cpu-demo.yaml") == 2


@pytest.mark.timeout(60)
def test_printed_sbatch_submitted_without_a_clone_runs_the_packaged_launcher(
    tmp_path: Path,
) -> None:
    """`deadpool slurm-script vista > job.sbatch` in an empty folder, run dry as Slurm would
    (submit directory = that folder): the package's launcher, coordinator wrapper and default
    config are used, and the logs go to the submit directory."""
    job = tmp_path / "job.sbatch"
    job.write_text(run_deadpool("slurm-script", "vista", timeout=60).stdout)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nodes = "nid001000 nid001001 nid001002"
    scontrol = f'[ "$1 $2" = "show hostnames" ] && printf "%s\\n" {nodes} && exit 0; exit 1'
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\n{scontrol}\n")
    (bin_dir / "scontrol").chmod(0o755)
    deadpool = shlex.join(deadpool_command())
    (bin_dir / "deadpool").write_text(f'#!/bin/sh\nexec {deadpool} "$@"\n')
    (bin_dir / "deadpool").chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "PYTHONPATH": str(REPO_ROOT),
        "HOME": os.environ.get("HOME", "/tmp"),
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "deadpool",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "SLURM_JOB_NODELIST": "nid[001000-001002]",
        "DEADPOOL_DRY_RUN": "1",
    }
    done = subprocess.run(
        ["bash", str(job)],
        env=env,
        cwd=tmp_path,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    commands = {
        what: shlex.split(rest)
        for line in done.stdout.splitlines()
        if line.startswith("DRY-RUN ") and not line.startswith("DRY-RUN env: ")
        for what, _, rest in [line.removeprefix("DRY-RUN ").partition(": ")]
    }
    coordinator = commands["coordinator"]
    assert coordinator[:2] == ["bash", str(RESOURCES / "scripts/slurm/deadpool_coordinator.sh")]
    config = coordinator[coordinator.index("--config") + 1]
    assert Path(config).resolve() == (REPO_ROOT / "configs" / "cpu-demo.yaml").resolve()
    agent = " ".join(commands["agent 0"])  # one agent per node: respawn is on by default
    assert f"--output={tmp_path}/logs/deadpool-4242/agent-0.log" in agent, agent
