"""The Slurm scripts: syntax, documented #SBATCH lines, and the command lines they generate.

Each sbatch script is rendered in dry-run mode (DEADPOOL_DRY_RUN=1) for a faked allocation
of 2 active + 1 spare node; nothing is started.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from megatron_deadpool.config.cluster import load_cluster

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("scripts/**/*.sh"), *ROOT.glob("scripts/**/*.sbatch")])
SITES = ["perlmutter", "vista"]
BASH = shutil.which("bash") or "/bin/bash"


NODES = ["nid001000", "nid001001", "nid001002"]  # SLURM_JOB_NODELIST of the faked allocation


def fake_slurm(folder: Path, **programs: str) -> str:
    """A PATH with `scontrol` (that expands the faked allocation's node list) and the given
    programs (name -> shell script body) ahead of the real one."""
    programs.setdefault(
        "scontrol",
        f'[ "$1 $2" = "show hostnames" ] && printf "%s\\n" {" ".join(NODES)} && exit 0; exit 1',
    )
    for name, body in programs.items():
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    return f"{folder}:{os.environ.get('PATH', '/usr/bin:/bin')}"


def render(
    script: str, *script_args: str, **env: str
) -> tuple[int, dict[str, list[str]], dict[str, str], str]:
    """Run `script` dry; return (status, {what: argv}, {env name: value}, stderr). One srun
    task per GPU (DEADPOOL_RESPAWN_LIMIT=0) unless `env` says otherwise: in-place respawn
    through one agent per node is the default of the embedded and megatron-lm modes."""
    bin_dir = Path(tempfile.mkdtemp(prefix="deadpool-fake-slurm-"))
    base = {
        "PATH": fake_slurm(bin_dir),
        "HOME": os.environ.get("HOME", "/tmp"),
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "deadpool",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_JOB_NODELIST": "nid[001000-001002]",
        "DEADPOOL_DRY_RUN": "1",
        "DEADPOOL_RESPAWN_LIMIT": "0",
    }
    done = subprocess.run(
        [BASH, str(ROOT / script), *script_args],
        check=False,
        env={**base, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    shutil.rmtree(bin_dir)
    commands: dict[str, list[str]] = {}
    variables: dict[str, str] = {}
    for line in done.stdout.splitlines():
        if line.startswith("DRY-RUN env: "):
            name, _, value = line.removeprefix("DRY-RUN env: ").partition("=")
            variables[name] = value
        elif line.startswith("DRY-RUN "):
            what, _, rest = line.removeprefix("DRY-RUN ").partition(": ")
            commands[what] = shlex.split(rest)
    return done.returncode, commands, variables, done.stderr


def flag(argv: list[str], name: str) -> str:
    """The value of `--name VALUE` or `--name=VALUE` in argv."""
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(path: Path) -> None:
    done = subprocess.run(
        [BASH, "-n", str(path)], check=False, capture_output=True, text=True, timeout=10
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.timeout(10)
@pytest.mark.parametrize("site", SITES)
def test_every_sbatch_line_is_documented_and_matches_the_cluster(site: str) -> None:
    lines = (ROOT / "scripts" / "slurm" / f"{site}.sbatch").read_text().splitlines()
    directives = {}
    for i, line in enumerate(lines):
        if line.startswith("#SBATCH"):
            before = lines[i - 1]
            assert before.startswith("# ") and not before.startswith("#SBATCH"), line
            key, _, value = line.split()[1].partition("=")
            directives[key] = value
    assert "--no-kill" in directives
    cluster = load_cluster(ROOT / "configs" / "clusters" / f"{site}.yaml")
    for key, value in (
        ("--partition", cluster.slurm_partition),
        ("--constraint", cluster.slurm_constraint),
        ("--qos", cluster.slurm_qos),
    ):
        assert directives.get(key, "") == value, key
    assert directives["--ntasks-per-node"] == str(cluster.gpus_per_node)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("site", SITES)
def test_sbatch_renders_two_active_nodes_and_one_spare(site: str) -> None:
    status, cmds, env, err = render(f"scripts/slurm/{site}.sbatch")
    assert status == 0, err
    gpus = load_cluster(ROOT / "configs" / "clusters" / f"{site}.yaml").gpus_per_node
    srun = cmds["workers"]
    assert srun[0] == "srun"
    for keep_survivors in ("--kill-on-bad-exit=0", "--no-kill", "--wait=0"):
        assert keep_survivors in srun
    assert flag(srun, "--nodes") == "3"
    assert flag(srun, "--ntasks") == str(3 * gpus)
    assert flag(srun, "--ntasks-per-node") == str(gpus)
    assert flag(srun, "--distribution") == "block"  # node i holds ranks i*G .. i*G+G-1
    assert flag(srun, "--output").endswith("logs/deadpool-4242/task-%t.log")
    worker = srun[srun.index("-m") - 1 :]
    assert worker[:4] == ["python", "-m", "megatron_deadpool.embedded.worker", "--config"]
    assert flag(worker, "--config") == "configs/cpu-demo.yaml"
    assert flag(worker, "--deadpool-spare-ranks") == str(gpus)
    assert flag(worker, "--deadpool-ranks-per-node") == str(gpus)
    # The task wrapper takes the rank from Slurm.
    assert "RANK=$SLURM_PROCID" in srun[srun.index("-c") + 1]

    # The primary coordinator on the batch host, the standby on the last node (a spare node);
    # both run through the wrapper that ends the Slurm job with the job.
    wrapper = ["bash", str(ROOT / "scripts/slurm/deadpool_coordinator.sh")]
    coord = cmds["coordinator"]
    assert coord[:3] == [*wrapper, "coordinator"]
    program = coord[3:]
    assert program[:4] == ["python", "-m", "megatron_deadpool.cli", "coordinator"]
    assert flag(program, "--world-size") == str(2 * gpus)
    assert flag(program, "--deadpool-spare-ranks") == str(gpus)
    assert flag(program, "--config") == "configs/cpu-demo.yaml"
    assert flag(program, "--deadpool-coordinator") == flag(worker, "--deadpool-coordinator")
    primary, standby_address = flag(worker, "--deadpool-coordinator").split(",")
    assert standby_address == f"{NODES[-1]}:29400"
    assert flag(program, "--deadpool-log-dir") == flag(worker, "--deadpool-log-dir")
    assert env["MASTER_ADDR"] == primary.rpartition(":")[0]
    standby = cmds["standby"]
    assert standby[:2] == ["srun", "--overlap"] and flag(standby, "--nodelist") == NODES[-1]
    assert flag(standby, "--nodes") == "1" and flag(standby, "--ntasks") == "1"
    at = standby.index(wrapper[1])
    assert standby[at + 1] == "standby" and standby[at + 2 :] == [*program, "--standby"]
    assert flag(standby, "--export").startswith("ALL,DEADPOOL_JOB_LOG=")  # its end lines
    assert env["WORLD_SIZE"] == str(2 * gpus)
    assert env["LOCAL_WORLD_SIZE"] == str(gpus)
    assert env["OMP_NUM_THREADS"] == "1"  # as torchrun sets it (not set by the test's caller)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("site", SITES)
def test_site_environment_matches_the_cluster_file(site: str) -> None:
    cluster = load_cluster(ROOT / "configs" / "clusters" / f"{site}.yaml")
    status, cmds, env, err = render(f"scripts/slurm/{site}.sbatch")
    assert status == 0, err
    for name, value in cluster.env_mapping.items():
        assert env.get(name) == value, name
    assert [c[-1] for w, c in cmds.items() if w == "module"] == cluster.modules[-1:]
    # Every site value is a default the submitting shell can override.
    name = next(iter(cluster.env_mapping))
    status, _, env, err = render(f"scripts/slurm/{site}.sbatch", **{name: "override"})
    assert status == 0 and env[name] == "override", err


@pytest.mark.timeout(30)
def test_megatron_lm_mode_and_external_coordinator() -> None:
    status, cmds, _, err = render(
        "scripts/slurm/perlmutter.sbatch",
        DEADPOOL_MODE="megatron-lm",
        MEGATRON_LM_PATH="/opt/Megatron-LM",
        MEGATRON_ARGS="--num-layers 80 --bf16 --use-distributed-optimizer",
        DEADPOOL_COORDINATOR="login01:31000",
        DEADPOOL_REPLICAS="2",
    )
    assert status == 0, err
    assert "coordinator" not in cmds  # one is running elsewhere
    srun = cmds["workers"]
    worker = srun[srun.index("-m") - 1 :]
    assert worker[:4] == [
        "python",
        "-m",
        "megatron_deadpool.megatron_lm",
        "/opt/Megatron-LM/pretrain_gpt.py",
    ]
    assert worker[4:8] == ["--num-layers", "80", "--bf16", "--use-distributed-optimizer"]
    assert "--deadpool" in worker
    assert flag(worker, "--deadpool-coordinator") == "login01:31000"
    assert flag(worker, "--deadpool-spare-ranks") == "4"
    assert flag(worker, "--deadpool-replicas") == "2"


QUOTED = ["--data-path", "/scratch/my corpus/text_document", "--wandb-exp-name", "run 'a'"]
"""Megatron-LM arguments a whitespace split of MEGATRON_ARGS breaks: spaces, quotes."""


@pytest.mark.timeout(30)
@pytest.mark.parametrize("way", ["script arguments", "file"])
def test_megatron_arguments_with_spaces_and_quotes_reach_the_workers_whole(
    way: str, tmp_path: Path
) -> None:
    """Megatron-LM's arguments as the sbatch script's own (a bash array, quoting kept) or as
    MEGATRON_ARGS_FILE (one per line): each reaches the worker as one argument."""
    env = {"DEADPOOL_MODE": "megatron-lm", "MEGATRON_LM_PATH": "/opt/Megatron-LM"}
    args: list[str] = ["--bf16", *QUOTED]
    if way == "file":
        path = tmp_path / "args.txt"
        path.write_text("# Megatron-LM's arguments\n" + "\n".join(args) + "\n\n")
        env["MEGATRON_ARGS_FILE"] = str(path)
        args = []
    status, cmds, _, err = render("scripts/slurm/perlmutter.sbatch", *args, **env)
    assert status == 0, err
    worker = cmds["workers"][cmds["workers"].index("-m") - 1 :]
    assert worker[4:9] == ["--bf16", *QUOTED], worker


@pytest.mark.timeout(30)
def test_a_quote_in_megatron_args_is_refused_and_two_ways_too() -> None:
    env = {"DEADPOOL_MODE": "megatron-lm", "MEGATRON_LM_PATH": "/m"}
    status, _, _, err = render("scripts/slurm/perlmutter.sbatch",
                               MEGATRON_ARGS="--wandb-exp-name 'run a'", **env)  # fmt: skip
    assert status == 2 and "MEGATRON_ARGS_FILE" in err, err
    status, _, _, err = render("scripts/slurm/perlmutter.sbatch", "--bf16",
                               MEGATRON_ARGS="--bf16", **env)  # fmt: skip
    assert status == 2 and "give one" in err, err


@pytest.mark.timeout(30)
def test_a_joining_allocation_starts_only_spares_that_join_the_running_job() -> None:
    """DEADPOOL_JOIN: no coordinator, no standby; every task of the allocation (3 nodes x 4
    GPUs here, none of them kept as spare nodes) runs with --deadpool-join."""
    status, cmds, env, err = render(
        "scripts/slurm/perlmutter.sbatch",
        DEADPOOL_JOIN="nid000100:29400,nid000199:29400",
        DEADPOOL_JOB_TOKEN_FILE="/home/u/logs/deadpool-17/job.token",
        DEADPOOL_JOB_ID="slurm-17.0",
    )
    assert status == 0, err
    assert "coordinator" not in cmds and "standby" not in cmds
    srun = cmds["workers"]
    assert flag(srun, "--ntasks") == "12"
    worker = srun[srun.index("-m") - 1 :]
    assert "--deadpool-join" in worker
    assert flag(worker, "--deadpool-coordinator") == "nid000100:29400,nid000199:29400"
    assert env["DEADPOOL_JOB_ID"] == "slurm-17.0"  # the running job's run, not this allocation's


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "needs the running job's secret"),
        ({"DEADPOOL_JOB_TOKEN_FILE": "t"}, "needs the running job's run id: DEADPOOL_JOB_ID"),
        ({"DEADPOOL_JOB_TOKEN_FILE": "t", "DEADPOOL_COORDINATOR": "h:1"}, "give one"),
        (
            {"DEADPOOL_JOB_TOKEN_FILE": "t", "DEADPOOL_JOB_ID": "", "DEADPOOL_MODE": "selftest"},
            "DEADPOOL_MODE",
        ),
    ],
)
def test_a_joining_allocation_refuses_what_cannot_join(env: dict[str, str], message: str) -> None:
    status, _, _, err = render("scripts/slurm/perlmutter.sbatch", DEADPOOL_JOIN="h:1", **env)
    assert status == 2 and message in err, err


@pytest.mark.timeout(30)
def test_each_run_of_a_job_gets_its_own_run_id() -> None:
    """The run id every value of the job's stores is sealed for (`seal.py`): the Slurm job's
    id and restart count when this script starts the coordinator - a requeued job's values do
    not open in the next run even with the same secret -; a coordinator started elsewhere: the
    one given, none if none is."""
    _, _, env, err = render("scripts/slurm/perlmutter.sbatch")
    assert env["DEADPOOL_JOB_ID"] == "slurm-4242.0", err
    _, _, env, err = render("scripts/slurm/perlmutter.sbatch", SLURM_RESTART_COUNT="2")
    assert env["DEADPOOL_JOB_ID"] == "slurm-4242.2", err
    _, _, env, err = render("scripts/slurm/perlmutter.sbatch", DEADPOOL_JOB_ID="mine")
    assert env["DEADPOOL_JOB_ID"] == "mine", err
    status, _, env, err = render("scripts/slurm/perlmutter.sbatch", DEADPOOL_COORDINATOR="h:1")
    assert status == 0 and "DEADPOOL_JOB_ID" not in env, err


@pytest.mark.timeout(30)
def test_baseline_mode_runs_plain_megatron_lm_on_the_active_nodes() -> None:
    status, cmds, env, err = render(
        "scripts/slurm/perlmutter.sbatch",
        DEADPOOL_MODE="baseline",
        MEGATRON_LM_PATH="/opt/Megatron-LM",
        MEGATRON_ARGS="--bf16",
    )
    assert status == 0, err
    assert "coordinator" not in cmds
    srun = cmds["workers"]
    assert flag(srun, "--nodes") == "2" and flag(srun, "--ntasks") == "8"
    assert srun[-3:] == ["python", "/opt/Megatron-LM/pretrain_gpt.py", "--bf16"]
    assert env["WORLD_SIZE"] == "8"


@pytest.mark.timeout(30)
def test_coordinator_gets_the_jobs_own_timeouts() -> None:
    flags = "--deadpool-heartbeat-timeout 4 --deadpool-pg-timeout=50 --deadpool-fail 1@3"
    status, cmds, _, err = render("scripts/slurm/vista.sbatch", DEADPOOL_EXTRA_ARGS=flags)
    assert status == 0, err
    coord = cmds["coordinator"]
    assert flag(coord, "--config") == "configs/cpu-demo.yaml"  # its deadpool: section
    assert flag(coord, "--deadpool-heartbeat-timeout") == "4"
    assert flag(coord, "--deadpool-pg-timeout") == "50"
    assert flag(coord, "--deadpool-fail") == "1@3"  # all the workers' flags: it takes its own
    status, cmds, _, err = render(
        "scripts/slurm/perlmutter.sbatch",
        DEADPOOL_MODE="megatron-lm",
        MEGATRON_LM_PATH="/opt/Megatron-LM",
        MEGATRON_ARGS="--bf16 --deadpool-heartbeat-interval 2",
    )
    assert status == 0, err
    coord = cmds["coordinator"]
    assert "--config" not in coord and flag(coord, "--deadpool-heartbeat-interval") == "2"


@pytest.mark.timeout(30)
def test_injection_is_started_with_the_job() -> None:
    status, cmds, _, err = render(
        "scripts/slurm/vista.sbatch", DEADPOOL_INJECT="--node-index 1 --at-iteration 20"
    )
    assert status == 0, err
    inject = cmds["inject"]
    assert inject[1].endswith("scripts/inject_failure.sh")
    assert flag(inject, "--job") == "4242"
    assert flag(inject, "--node-index") == "1"
    assert flag(inject, "--at-iteration") == "20"


@pytest.mark.timeout(30)
def test_selftest_mode_runs_the_selftest_over_the_allocation() -> None:
    status, cmds, _, err = render("scripts/slurm/perlmutter.sbatch", DEADPOOL_MODE="selftest")
    assert status == 0, err
    assert "workers" not in cmds and "coordinator" not in cmds  # it starts its own steps
    argv = cmds["selftest"]
    assert argv[1:5] == ["-m", "megatron_deadpool.cli", "selftest", "--slurm"]
    assert flag(argv, "--nproc-per-node") == "4" and flag(argv, "--spare-nodes") == "1"
    assert flag(argv, "--json").endswith("deadpool-4242/selftest.json")
    status, _, _, err = render(
        "scripts/slurm/perlmutter.sbatch", DEADPOOL_MODE="selftest", DEADPOOL_INJECT="--node 1"
    )
    assert status == 2 and "DEADPOOL_INJECT" in err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SPARE_NODES": "3"}, "no active node"),
        ({"SLURM_JOB_NUM_NODES": ""}, "not inside a Slurm allocation"),
        ({"DEADPOOL_MODE": "torchrun"}, "DEADPOOL_MODE"),
        ({"DEADPOOL_MODE": "megatron-lm"}, "MEGATRON_LM_PATH"),
        ({"DEADPOOL_CONFIG": "nope.yaml"}, "no such file"),
    ],
)
def test_launcher_refuses_bad_settings(env: dict[str, str], message: str) -> None:
    status, _, _, err = render("scripts/slurm/perlmutter.sbatch", **env)
    assert status == 2 and message in err


@pytest.mark.timeout(30)
def test_inject_failure_targets_one_node_without_ssh(tmp_path: Path) -> None:
    # Only sed on PATH: no scontrol, so the script expands the node list itself.
    (tmp_path / "sed").symlink_to(shutil.which("sed") or "/bin/sed")
    done = subprocess.run(
        [
            BASH,
            str(ROOT / "scripts/inject_failure.sh"),
            "--job",
            "4242",
            "--node-index",
            "3",
            "--at-iteration",
            "20",
            "--log-dir",
            "/tmp/none",
            "--signal",
            "STOP",
        ],
        check=False,
        env={
            "PATH": str(tmp_path),
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": "nid[001000-001002,001007]",
            "DEADPOOL_DRY_RUN": "1",
        },
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert done.returncode == 0, done.stderr
    kill = shlex.split(done.stdout.removeprefix("DRY-RUN kill: "))
    assert kill[:3] == ["srun", "--jobid=4242", "--overlap"]
    assert "--nodelist=nid001007" in kill
    # On the node: this job's processes as Slurm lists them, signalled by PID, no pattern.
    assert kill[-4:-2] == ["bash", "-c"] and kill[-1] == "STOP"
    assert "scontrol listpids" in kill[-2] and "pkill" not in kill[-2]


@pytest.mark.timeout(30)
def test_inject_failure_rejects_bad_arguments() -> None:
    for argv in (["--job", "1"], ["--job", "1", "--node", "a", "--at-iteration", "3"]):
        done = subprocess.run(
            [BASH, str(ROOT / "scripts/inject_failure.sh"), *argv],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        )
        assert done.returncode == 2 and "inject_failure: error" in done.stderr


@pytest.mark.timeout(30)
def test_coordinators_get_the_jobs_own_deadpool_settings() -> None:
    status, cmds, _, err = render(
        "scripts/slurm/perlmutter.sbatch",
        DEADPOOL_MODE="megatron-lm",
        MEGATRON_LM_PATH="/opt/Megatron-LM",
        MEGATRON_ARGS="--bf16 --deadpool-pg-timeout=300 --deadpool-agree-timeout 100",
        DEADPOOL_EXTRA_ARGS="--deadpool-heartbeat-timeout 20 --deadpool-heartbeat-interval 2",
    )
    assert status == 0, err
    for what in ("coordinator", "standby"):
        argv = cmds[what]
        assert "--bf16" not in argv and "--config" not in argv  # only the DeadPool settings
        assert "--deadpool-pg-timeout=300" in argv
        assert flag(argv, "--deadpool-agree-timeout") == "100"
        assert flag(argv, "--deadpool-heartbeat-timeout") == "20"
        assert flag(argv, "--deadpool-heartbeat-interval") == "2"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "env", [{"DEADPOOL_STANDBY": "none"}, {"SLURM_JOB_NUM_NODES": "1", "SPARE_NODES": "0"}]
)
def test_no_standby_when_disabled_or_on_one_node(env: dict[str, str]) -> None:
    status, cmds, _, err = render("scripts/slurm/vista.sbatch", **env)
    assert status == 0, err
    assert "standby" not in cmds
    srun = cmds["workers"]
    assert "," not in flag(srun[srun.index("-m") - 1 :], "--deadpool-coordinator")


@pytest.mark.timeout(30)
def test_standby_address_can_be_given() -> None:
    status, cmds, _, err = render("scripts/slurm/vista.sbatch", DEADPOOL_STANDBY="login2:31000")
    assert status == 0, err
    assert flag(cmds["standby"], "--nodelist") == "login2"
    assert flag(cmds["coordinator"], "--deadpool-coordinator").endswith(",login2:31000")


def _wrapper(
    tmp_path: Path, status: int, *, running: bool = True, squeue_fails: bool = False, **env: str
) -> tuple[str, str, Path]:
    """Run deadpool_coordinator.sh around a coordinator that exits with `status`, with a
    Slurm whose job keeps running (or has ended; or whose squeue fails, printing nothing);
    (its output, what the Slurm clients were asked, the log folder)."""
    logs, calls = tmp_path / "logs", tmp_path / "calls"
    logs.mkdir()
    answer = "; exit 1" if squeue_fails else "; echo RUNNING" if running else ""
    path = fake_slurm(
        tmp_path,
        squeue=f'echo "squeue $*" >>{calls}' + answer,
        scancel=f'echo "scancel $*" >>{calls}',
    )
    done = subprocess.run(
        [BASH, str(ROOT / "scripts/slurm/deadpool_coordinator.sh"), "standby", "sh", "-c",
         f"echo coordinator says hello; exit {status}"],
        check=False,
        env={"PATH": path, "DEADPOOL_LOG_DIR": str(logs), "DEADPOOL_END_GRACE": "2",
             "SLURM_JOB_ID": "4242", **env},
        capture_output=True,
        text=True,
        timeout=20,
    )  # fmt: skip
    assert done.returncode == (0 if status == 5 else status), done.stderr
    assert (logs / "standby.status").read_text().strip() == str(status)
    assert "coordinator says hello" in (logs / "standby.log").read_text()
    return done.stdout, calls.read_text() if calls.exists() else "", logs


@pytest.mark.timeout(30)
@pytest.mark.parametrize("status", [0, 3, 6, 9])
def test_coordinator_that_ended_the_job_ends_the_slurm_job(tmp_path: Path, status: int) -> None:
    out, calls, _ = _wrapper(tmp_path, status)
    assert f"standby on {socket.gethostname()} exited with status {status}" in out
    assert "ends within 2s" in out and "cancelling job 4242" in out
    assert calls.splitlines()[-1] == "scancel 4242"
    assert calls.count("squeue") == 2  # polled once a second for the grace period


@pytest.mark.timeout(30)
def test_a_job_that_ends_on_its_own_is_not_cancelled(tmp_path: Path) -> None:
    out, calls, _ = _wrapper(tmp_path, 0, running=False)
    assert "exited with status 0" in out and "cancelling" not in out
    assert calls.splitlines() == ["squeue -h -j 4242 -o %T"]


@pytest.mark.timeout(30)
def test_a_squeue_that_fails_is_not_taken_for_the_jobs_end(tmp_path: Path) -> None:
    """It prints nothing, as for a job that ended: the job is still cancelled after the grace
    period (a stuck task would otherwise hold the nodes until the time limit)."""
    out, calls, _ = _wrapper(tmp_path, 0, squeue_fails=True)
    assert "cancelling job 4242" in out and calls.splitlines()[-1] == "scancel 4242"


@pytest.mark.timeout(30)
def test_the_standby_writes_the_jobs_end_into_the_jobs_log(tmp_path: Path) -> None:
    job_log = tmp_path / "batch.out"
    job_log.write_text("the batch script's lines\n")
    out, _, _ = _wrapper(tmp_path, 3, DEADPOOL_JOB_LOG=str(job_log))
    assert out == ""
    lines = job_log.read_text().splitlines()
    assert lines[0] == "the batch script's lines"
    assert "exited with status 3 (out of redundancy" in lines[1]
    assert "cancelling job 4242" in lines[2]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("status", [4, 5, 1])
def test_coordinator_that_did_not_end_the_job_leaves_it_alone(tmp_path: Path, status: int) -> None:
    out, calls, _ = _wrapper(tmp_path, status)
    assert out == "" and calls == ""


@pytest.mark.timeout(30)
def test_with_a_respawn_limit_one_agent_per_node_starts_the_nodes_processes() -> None:
    status, cmds, _, err = render(
        "scripts/slurm/perlmutter.sbatch", DEADPOOL_RESPAWN_LIMIT="2", SLURM_CPUS_PER_TASK="8"
    )
    assert status == 0, err
    assert "workers" not in cmds  # no srun of one task per GPU
    log_dir = flag(cmds["coordinator"], "--deadpool-log-dir")
    for i, host in enumerate(["nid001000", "nid001001", "nid001002"]):
        argv = cmds[f"agent {i}"]  # a job step of its own on each node
        assert flag(argv, "--nodes") == "1" and flag(argv, "--ntasks") == "1"
        assert flag(argv, "--nodelist") == host and "--input=none" in argv
        assert flag(argv, "--output") == f"{log_dir}/agent-{i}.log"
        assert "--cpus-per-task=32" in argv  # the node's 4 tasks' CPUs
        agent = argv[argv.index("agent") - 3 :]  # python -m megatron_deadpool.cli agent ...
        assert agent[1:4] == ["-m", "megatron_deadpool.cli", "agent"], argv
        assert flag(agent, "--node") == str(i) and flag(agent, "--deadpool-respawn-limit") == "2"
        worker = agent[agent.index("--") + 1 :]
        assert worker[1:3] == ["-m", "megatron_deadpool.embedded.worker"], worker
    assert flag(cmds["coordinator"], "--deadpool-respawn-limit") == "2"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("mode", "limit"), [("embedded", "2"), ("megatron-lm", "2"),
                                             ("baseline", None), ("selftest", None)])  # fmt: skip
def test_in_place_respawn_is_the_default_where_agents_can_run_the_job(
    mode: str, limit: str | None
) -> None:
    """DEADPOOL_RESPAWN_LIMIT unset: agents that respawn twice per node (per the 600 s window)
    in the embedded and megatron-lm modes, told to the coordinator too (which respawns only
    when told); the baseline and the selftest start no agent."""
    env = {"DEADPOOL_MODE": mode, "MEGATRON_LM_PATH": "/m", "MEGATRON_ARGS": "--x 1"}
    # Empty is unset to the script (`:=`): its own default.
    status, cmds, _, err = render(
        "scripts/slurm/perlmutter.sbatch", DEADPOOL_RESPAWN_LIMIT="", **env
    )
    if limit is None:
        assert status == 0 and not any(what.startswith("agent") for what in cmds), (err, cmds)
        return
    assert status == 0, err
    assert "workers" not in cmds and "agent 0" in cmds, cmds
    assert flag(cmds["coordinator"], "--deadpool-respawn-limit") == limit


@pytest.mark.timeout(30)
def test_a_joining_allocations_agents_join_the_job() -> None:
    status, cmds, _, err = render(
        "scripts/slurm/vista.sbatch",
        DEADPOOL_RESPAWN_LIMIT="1",
        DEADPOOL_JOIN="n1:29400",
        DEADPOOL_JOB_TOKEN_FILE="/tmp/x",
        DEADPOOL_JOB_ID="slurm-1.0",
    )
    assert status == 0, err
    argv = cmds["agent 0"]
    agent = argv[argv.index("agent") :]
    assert "--deadpool-join" in agent[: agent.index("--")]  # the agent joins ...
    assert "--deadpool-join" in agent[agent.index("--") :]  # ... and so do its processes
    assert "coordinator" not in cmds
