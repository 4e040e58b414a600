"""The cluster scripts end to end, on a real Slurm of several nodes on this machine.

Each test brings up `scripts/slurm/lab.py`'s cluster (3 nodes, each its own network, PID, UTS
and mount namespace), submits a shipped sbatch file unchanged (only `--nodes 3
--ntasks-per-node 2` and the output file on sbatch's command line) running the embedded job
in CPU mode - 2 active nodes + 1 spare node, 2 tasks each, TP2 x DP2 - polls squeue, and tears
the whole lab down whatever happens. Results are compared bit for bit with `deadpool train` on
one machine. Skipped, with the reason, without root or network namespaces; the lab installs
Debian's Slurm packages when they are missing, and podman for the container tests (the job's
processes in podman containers: docs/how-to/containers.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from agents_job import remove_node_memory, started_pid
from conftest import MegatronLMReference, TrainRun, run_deadpool
from mlm import logged_iterations, megatron_args, megatron_lm_tree

ROOT = Path(__file__).resolve().parents[2]
ITERS = 30
FAIL_AT = 10  # the iteration after which a node fails
ENDED = {
    *("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"),
    *("PREEMPTED", "BOOT_FAIL", "DEADLINE"),
}
"""The states of a job Slurm ended (`scontrol show job`'s JobState)."""
JOB_TIMEOUT = 300.0  # per Slurm job: start-up of 6 Python processes on 2 shared cores included


def _load_lab() -> Any:
    spec = importlib.util.spec_from_file_location("deadpool_lab", ROOT / "scripts/slurm/lab.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


labmod = _load_lab()


# ---------------------------------------------------------------------- the lab
@pytest.fixture(autouse=True)
def sigterm_tears_labs_down() -> Iterator[None]:
    """SIGTERM to the process running a test (a run stopped from outside) raises an interrupt
    in it, so that the `finally` blocks and fixtures that take its lab down still run: its
    daemons, namespaces and cgroups are not left behind."""

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="module")
def lab_host() -> None:
    """Skip without root or namespaces; install Slurm once when missing."""
    reason = labmod.unavailable()
    if reason:
        pytest.skip(reason)
    labmod.install_packages()


@pytest.fixture
def lab(lab_host: None) -> Iterator[Any]:
    """A fresh 3-node lab per test, in a new private folder; everything it started, and the
    folder, are gone afterwards, whatever happens."""
    lab = labmod.Lab.fresh()
    try:
        lab.up(nodes=3, gpus_per_node=4)
        yield lab
    finally:
        lab.down()


# ---------------------------------------------------------------------- the job
def write_job(folder: Path, **train: Any) -> Path:
    """The embedded job's config: the CPU demo model, ITERS iterations, fast hang detection."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model": {
            "num_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "seq_length": 64,
            "vocab_size": 128,
        },
        "parallel": {"tp": 2, "pp": 1, "dp": 2},
        "train": {"iters": ITERS, **train},
        # Timeouts from the config (and --deadpool-pg-timeout from the workers' flags below):
        # deadpool_launch.sh must pass both to the coordinator.
        "deadpool": {"replicas": 1, "ranks_per_node": 2, "heartbeat_interval": 0.5,
                     "heartbeat_timeout": 3.0},
    }  # fmt: skip
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


EXPECTED_SETTINGS = {"heartbeat_interval": 0.5, "heartbeat_timeout": 3.0, "pg_timeout": 30.0}


@pytest.fixture(scope="module")
def reference(lab_host: None, failure_free: Callable[[int], TrainRun]) -> dict[str, Any]:
    """`deadpool train` on one machine with the same model and layout: its JSON summary
    (conftest: shared with test_failover)."""
    return failure_free(ITERS)[2]


def _torch_noise(line: str) -> bool:
    """torch's C++ warnings and stack frames, which bury a log's own lines."""
    text = line.strip()
    return text.startswith(("frame #", "Exception raised from", "<omitting python frames>")) or (
        text.startswith("[W") and "c10d]" in text
    )


@dataclass
class Job:
    """One submitted sbatch job and its log folder."""

    lab: Any
    id: str
    dir: Path
    submitted: float = field(default_factory=time.time)

    def text(self, name: str) -> str:
        path = self.dir / name
        return path.read_text(errors="replace") if path.exists() else ""

    def task_logs(self) -> dict[int, str]:
        return {
            int(p.stem.split("-")[1]): p.read_text(errors="replace")
            for p in sorted(self.dir.glob("task-*.log"))
        }

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.text("events.jsonl").splitlines() if line]

    def event(self, name: str) -> dict[str, Any] | None:
        found = [e for e in self.events() if e["event"] == name]
        return found[-1] if found else None

    def describe(self) -> str:
        """What a failed test shows: the launcher's and coordinators' logs without torch's C++
        stack frames, the coordinator's events, and each task's DeadPool and Slurm lines and
        the end of its last Python traceback (CI's temporary folders are gone afterwards)."""
        slurm = self.lab.slurm("scontrol", "show", "job", self.id, check=False)
        said = re.findall(r"(?:JobState|Reason|ExitCode)=\S+", slurm)
        parts = [f"job {self.id} in {self.dir} ({' '.join(said) or 'no record from Slurm'})"]
        for name in (
            "batch.out",
            "coordinator.log",
            "standby.log",
            "standby-step.log",
            "inject.log",
        ):
            lines = [x for x in self.text(name).splitlines() if not _torch_noise(x)]
            parts.append(f"--- {name}\n" + "\n".join(lines[-40:]))
        for agent in sorted(self.dir.glob("agent-*.log")):  # with DEADPOOL_RESPAWN_LIMIT
            lines = [x for x in agent.read_text(errors="replace").splitlines() if "[W" not in x]
            parts.append(f"--- {agent.name}\n" + "\n".join(lines[-15:]))
        events = [line[:300] for line in self.text("events.jsonl").splitlines()]
        parts.append("--- events.jsonl\n" + "\n".join(events[-30:]))
        for rank, text in self.task_logs().items():
            lines = text.splitlines()
            ours = [x for x in lines if "[deadpool " in x or "slurmstepd" in x]
            starts = [i for i, x in enumerate(lines) if x.startswith("Traceback (most recent")]
            traceback = lines[starts[-1] :][-12:] if starts else []
            parts.append(f"--- task {rank}\n" + "\n".join(ours[-12:] + traceback))
        return "\n".join(parts)

    def wait_for_iteration(self, iteration: int, timeout: float) -> None:
        """Until some task logged iteration N (the line inject_failure.sh also waits for)."""
        pattern = re.compile(rf"iteration\s+{iteration}/")
        deadline = time.time() + timeout
        while not any(pattern.search(t) for t in self.task_logs().values()):
            assert time.time() < deadline, f"no iteration {iteration} yet\n{self.describe()}"
            assert self.state() is not None, f"the job ended early\n{self.describe()}"
            time.sleep(0.1)

    def state(self) -> str | None:
        """Its squeue state (RUNNING, COMPLETING, ...); None once Slurm no longer lists it."""
        return self.ask("squeue", "-h", "-j", self.id, "-o", "%T").strip() or None

    def ask(self, *cmd: str, patience_s: float = 30.0) -> str:
        """A Slurm command's stdout, asked again while it fails: a squeue that timed out on a
        slurmctld busy on the shared cores prints nothing, as it does for a job that ended
        (CI once took such a failure for the job's end, and read its record while it ran)."""
        deadline = time.time() + patience_s
        while True:
            try:
                return str(self.lab.slurm(*cmd))
            except (labmod.LabError, subprocess.TimeoutExpired):
                if time.time() > deadline:
                    raise
                time.sleep(0.5)

    def wait_end(self, timeout: float = JOB_TIMEOUT) -> dict[str, str]:
        """Slurm's record of the job (JobState, ExitCode, ...) once it says the job ended. A
        job not ended after `timeout` is cancelled and the test fails."""
        deadline = self.submitted + timeout
        while (record := self.record()).get("JobState") not in ENDED:
            if time.time() > deadline:
                held = self.lab.slurm("squeue", "-h", "-j", self.id, "-o", "%T %M %N", check=False)
                self.lab.slurm("scancel", self.id, check=False)
                pytest.fail(
                    f"Slurm still holds the job after {timeout:.0f}s ({held.strip()}): "
                    f"cancelled\n{self.describe()}"
                )
            time.sleep(0.5)
        return record

    def record(self) -> dict[str, str]:
        """Slurm's record of the job (`scontrol show job`): JobState, ExitCode, ..."""
        return dict(re.findall(r"(\w+)=(\S+)", self.ask("scontrol", "show", "job", self.id)))


def submit(
    lab: Any,
    folder: Path,
    site: str,
    config: Path | None,
    nodes: Sequence[str] = (),
    **env: str,
) -> Job:
    """sbatch scripts/slurm/SITE.sbatch from the repository root, as a user does (the embedded
    job with `config`, else as `env` says), on 3 nodes, or on `nodes` (-w)."""
    folder.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    base.update(lab.env())
    base.update(
        GPUS_PER_NODE="2",
        DEADPOOL_MODULES="",  # no environment modules here
        PYTHON=sys.executable,
        DEADPOOL_LOG_DIR=str(folder),
        DEADPOOL_EXTRA_ARGS="--deadpool-pg-timeout 30",
        PYTHONWARNINGS="ignore",
        OMP_NUM_THREADS="1",
        # One srun task per GPU, every failure a spare's, unless a test asks for agents
        # (in-place respawn through them is deadpool_launch.sh's default).
        DEADPOOL_RESPAWN_LIMIT="0",
    )
    if config is not None:
        base["DEADPOOL_CONFIG"] = str(config)
    base.update(env)
    site_args = ["-A", "lab"] if site == "perlmutter" else []  # Perlmutter wants an account
    proc = subprocess.run(
        ["sbatch", "--parsable", *site_args, f"--nodes={len(nodes) or 3}",
         *([f"--nodelist={','.join(nodes)}"] if nodes else []), "--ntasks-per-node=2",
         f"--output={folder}/batch.out", f"scripts/slurm/{site}.sbatch"],
        cwd=ROOT, env=base, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return Job(lab, proc.stdout.strip().split(";")[0], folder)


def assert_trained_like(job: Job, reference: dict[str, Any]) -> None:
    finished = job.event("finished")
    assert finished is not None, job.describe()
    assert finished["rank_digests"] == reference["rank_digests"], job.describe()
    assert finished["final_param_digest"] == reference["final_param_digest"]


# ---------------------------------------------------------------------- the lab itself
@pytest.mark.timeout(120)
def test_lab_nodes_are_separate_machines(lab: Any) -> None:
    names = lab.slurm("srun", "-N3", "--ntasks-per-node=1", "hostname").split()
    assert sorted(names) == ["n1", "n2", "n3"]
    # Each node resolves the others over the lab's bridge; n2's slurmd answers n1.
    probe = "timeout 3 bash -c 'exec 3<>/dev/tcp/n2/6818' && echo open || echo unreachable"
    reach_n2 = ["srun", "-w", "n1", "-N1", "bash", "-c", probe]
    assert lab.slurm(*reach_n2, timeout=30).strip() == "open"
    lab.cut("n2")
    assert lab.slurm(*reach_n2, timeout=30).strip() == "unreachable"
    lab.cut("n2", up=True)
    # freeze/thaw: every process of the node stops, and only those.
    n3 = lab.node_pids("n3")
    assert lab.freeze("n3") == len(n3) >= 2
    assert {labmod._state(p) for p in lab.node_pids("n3")} == {"T"}
    assert "T" not in {labmod._state(p) for p in lab.node_pids("n2")}
    assert lab.thaw("n3") == len(n3)
    assert "T" not in {labmod._state(p) for p in lab.node_pids("n3")}
    # crash: the whole node, and nothing else, is gone.
    lab.crash("n3")
    assert lab.node_pids("n3") == [] and len(lab.node_pids("n2")) >= 2


@pytest.mark.timeout(60)
def test_down_removes_everything_the_lab_recorded(lab: Any) -> None:
    state = dict(lab.state)
    lab.down()
    assert not any(labmod._alive(r) for r in state["procs"].values())
    assert not any(labmod._alive(n["init"]) for n in state["nodes"].values())
    netns = labmod._run(["ip", "netns", "list"]).stdout
    links = labmod._run(["ip", "-o", "link"]).stdout
    assert not any(name in netns for name in state["netns"])
    assert not any(f" {name}:" in links or f" {name}@" in links for name in state["links"])
    assert not os.path.lexists(lab.dir)  # its folder too: nothing of it stays in /tmp


# ---------------------------------------------------------------------- nothing in /tmp trusted
def _planted_lab(folder: Path, state: dict[str, Any]) -> Path:
    """A private-looking lab folder with `state` planted as its state.json."""
    folder.mkdir(mode=0o700)
    (folder / "state.json").write_text(json.dumps(state))
    return folder


def test_a_state_folder_someone_else_could_have_planted_is_refused(tmp_path: Path) -> None:
    """Writable by group or others, another user's, a symbolic link (folder or state.json):
    refused before state.json is read, so nothing in it is ever acted on."""
    folder = _planted_lab(tmp_path / "lab", {"procs": {}, "nodes": {}})
    os.chmod(folder, 0o777)
    with pytest.raises(labmod.LabError, match="writable by group or others .mode 777.: refused"):
        labmod.Lab(folder)
    os.chmod(folder, 0o700)
    (tmp_path / "link").symlink_to(folder)
    with pytest.raises(labmod.LabError, match="is not a folder .a symbolic link..: refused"):
        labmod.Lab(tmp_path / "link")
    (tmp_path / "elsewhere.json").write_text("{}")
    (folder / "state.json").unlink()
    (folder / "state.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(labmod.LabError, match="state file .* is not a regular file"):
        labmod.Lab(folder)
    if os.geteuid() == 0:
        os.chown(folder, 65534, 65534)
        with pytest.raises(labmod.LabError, match="belongs to uid 65534, not to this user"):
            labmod.Lab(folder)


def test_down_never_signals_a_process_the_lab_did_not_start(tmp_path: Path) -> None:
    """A state.json naming a process that is not the lab's (its PID and start time right, as
    one planted to make `down` SIGKILL it would be): `down` leaves it running."""
    victim = subprocess.Popen(["sleep", "60"])
    try:
        rec = labmod._record(victim.pid)
        node = {"init": rec, "launcher": rec, "netns": "dplab-none", "veth": "dpl-none",
                "pid_ns": labmod._pid_ns(victim.pid)}  # fmt: skip
        state = {"tag": "0000", "token": "forged", "procs": {"munged": rec, "slurmctld": rec},
                 "nodes": {"n1": node}, "links": [], "netns": []}  # fmt: skip
        folder = _planted_lab(tmp_path / "lab", state)
        labmod.Lab(folder).down()
        time.sleep(0.2)
        assert victim.poll() is None, "down killed a process the lab did not start"
        assert not folder.exists()
        lab = labmod.Lab(_planted_lab(tmp_path / "lab2", state))
        assert lab.node_pids("n1") == []  # nothing to freeze: not the lab's node
        with pytest.raises(labmod.LabError, match="node n1 is not running"):
            lab.crash("n1")
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_a_fresh_lab_folder_is_private_and_down_removes_it(tmp_path: Path) -> None:
    lab = labmod.Lab.fresh(tmp_path)
    info = os.lstat(lab.dir)
    assert info.st_mode & 0o777 == 0o700 and info.st_uid == os.geteuid()
    assert lab.dir.parent == tmp_path and lab.dir.name.startswith("dplab-")
    lab.down()
    assert not lab.dir.exists()


@pytest.mark.timeout(120)
def test_up_writes_a_fresh_munge_key_over_a_planted_one(lab_host: None, tmp_path: Path) -> None:
    folder = tmp_path / "lab"
    (folder / "munge").mkdir(parents=True, mode=0o700)
    folder.chmod(0o700)
    planted = b"k" * 128
    (folder / "munge" / "munge.key").write_bytes(planted)
    lab = labmod.Lab(folder)
    try:
        lab.up(nodes=1, gpus_per_node=0)
        key = folder / "munge" / "munge.key"
        assert key.read_bytes() != planted and len(key.read_bytes()) == 128
        assert os.lstat(key).st_mode & 0o777 == 0o400
        assert labmod._ours(lab.state["procs"]["munged"], lab.token)
        assert (folder / "node.sh").read_text() == labmod.NODE_SCRIPT
    finally:
        lab.down()
    assert not folder.exists()


@pytest.mark.timeout(60)
def test_lab_refuses_to_run_without_root() -> None:
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or python is None or shutil.which("setpriv") is None:
        pytest.skip("needs root, setpriv and a system python3 to run the lab as another user")
    script = ROOT / "scripts/slurm/lab.py"
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, str(script),
         "--state", f"/tmp/dplab-not-root-{os.getpid()}", "up", "--nodes", "1"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    if "Permission denied" in proc.stderr:
        pytest.skip(f"user nobody cannot read {script}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "lab: error: the lab must run as root (it creates network namespaces and Slurm daemons)"
    ]


# ---------------------------------------------------------------------- inject_failure.sh
def _job_processes(lab: Any, node: str, job_id: str) -> dict[int, str]:
    """PID -> state (R, S, T, ...) of job `job_id`'s task processes on `node`."""
    found = {}
    for pid in lab.node_pids(node):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # it ended meanwhile
            continue
        ours = f"SLURM_JOB_ID={job_id}".encode() in environ and b"SLURM_STEP_ID=0" in environ
        state = labmod._state(pid) if ours else None  # None also once it ended meanwhile
        if state is not None:
            found[pid] = state
    return found


@pytest.mark.timeout(120)
def test_inject_failure_signals_only_its_jobs_processes_at_an_iteration(
    lab: Any, tmp_path: Path
) -> None:
    """Two jobs share n2; the injection stops, then kills, only the target job's tasks there,
    when a task log shows the iteration (the embedded job's and Megatron-LM's line formats)."""
    env = {**os.environ, **lab.env()}

    def sbatch(*args: str) -> str:
        proc = subprocess.run(["sbatch", "--parsable", *args], env=env, capture_output=True,
                              text=True, timeout=30, check=False)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    other = sbatch("-w", "n2", f"--output={tmp_path}/other.out", "--wrap", "srun sleep 300")
    # Task 0 (n1) logs as the embedded job does, task 1 (n2) as Megatron-LM does.
    lines = [
        "12:00:00.000 [deadpool r0 g0] INFO iteration 3/40 | loss 2.1",
        "12:00:00.100 [deadpool r0 g1] INFO restored iteration 4 (from holder)",
        " [2026-11-22 12:00:01] iteration        5/      40 | consumed samples: 40 |",
    ]
    script = tmp_path / "task.sh"
    script.write_text(
        f"#!/bin/bash\nif [ $SLURM_PROCID = 0 ]; then echo '{lines[0]}'; echo '{lines[1]}'; "
        f"else echo '{lines[2]}'; fi\nexec sleep 300\n"
    )
    target = sbatch("-N2", "-w", "n1,n2", f"--output={tmp_path}/target.out", "--wrap",
                    f"srun --no-kill --kill-on-bad-exit=0 --output={tmp_path}/task-%t.log "
                    f"bash {script}")  # fmt: skip
    deadline = time.time() + 30
    while not (
        _job_processes(lab, "n2", other)
        and _job_processes(lab, "n2", target)
        and "iteration        5/" in Job(lab, target, tmp_path).text("task-1.log")
    ):
        assert time.time() < deadline, lab.slurm("squeue")
        time.sleep(0.2)
    inject = [
        "bash", str(ROOT / "scripts/inject_failure.sh"), "--job", target, "--node-index", "1",
        "--log-dir", str(tmp_path),
    ]  # fmt: skip
    # "restored iteration 4" is no iteration line: nothing fires.
    early = subprocess.run(["timeout", "3", *inject, "--at-iteration", "4"], env=env,
                           capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    assert early.returncode == 124, early.stdout + early.stderr
    stop = subprocess.run([*inject, "--signal", "STOP", "--at-iteration", "3"], env=env,
                          capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    assert stop.returncode == 0, stop.stderr
    deadline = time.time() + 5  # a SIGSTOP takes effect once its target next runs
    while set(_job_processes(lab, "n2", target).values()) != {"T"}:
        assert time.time() < deadline, (stop.stdout, _job_processes(lab, "n2", target))
        time.sleep(0.05)
    assert "T" not in _job_processes(lab, "n2", other).values()
    assert "T" not in _job_processes(lab, "n1", target).values()
    kill = subprocess.run([*inject, "--signal", "KILL", "--at-iteration", "5"], env=env,
                          capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    assert kill.returncode == 0, kill.stderr
    assert "at iteration 5" in kill.stdout
    deadline = time.time() + 10
    while _job_processes(lab, "n2", target):
        assert time.time() < deadline, kill.stdout
        time.sleep(0.1)
    assert _job_processes(lab, "n2", other) and _job_processes(lab, "n1", target)


# ---------------------------------------------------------------------- training jobs
@pytest.mark.timeout(2 * JOB_TIMEOUT + 300)
def test_failure_free_job_matches_deadpool_train(
    lab: Any, reference: dict[str, Any], tmp_path: Path
) -> None:
    """perlmutter.sbatch unchanged (account, QoS, GPU constraint, --gpus-per-node=4)."""
    job = submit(lab, tmp_path / "logs", "perlmutter", write_job(tmp_path))
    record = job.wait_end()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", job.describe()
    settings = job.event("settings")
    assert settings is not None and {k: settings[k] for k in EXPECTED_SETTINGS} == EXPECTED_SETTINGS
    assert job.event("plan") is None, job.describe()
    assert_trained_like(job, reference)
    assert "spare s0] INFO released" in job.task_logs()[4]


@pytest.mark.timeout(2 * JOB_TIMEOUT + 300)
def test_training_node_killed_mid_run_the_spare_node_takes_over(
    lab: Any, reference: dict[str, Any], tmp_path: Path
) -> None:
    """vista.sbatch unchanged (partition gh); inject_failure.sh kills node 1's tasks."""
    job = submit(
        lab,
        tmp_path / "logs",
        "vista",
        write_job(tmp_path),
        DEADPOOL_INJECT=f"--node-index 1 --at-iteration {FAIL_AT}",
    )
    record = job.wait_end()
    assert f"SIGKILL to job {job.id}'s processes on n2 at iteration {FAIL_AT}" in job.text(
        "inject.log"
    ), job.describe()
    recovered = job.event("recovered")
    assert recovered is not None, job.describe()
    assert recovered["dead_ranks"] == [2, 3]
    assert sorted(recovered["replaced_by"].values()) == ["s0", "s1"]
    assert recovered["restore_iteration"] >= FAIL_AT
    assert_trained_like(job, reference)
    # srun ends non-zero (two tasks were killed); the job's status is the coordinator's verdict.
    assert "srun exited with status 137" in job.text("batch.out")
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", job.describe()


# ---------------------------------------------------------------------- containers
PODMAN_PYTHON = ROOT / "tests" / "cluster" / "podman_python.sh"
"""The PYTHON wrapper of docs/how-to/containers.md's podman recipe, the host's root as the image."""


@pytest.fixture(scope="module")
def podman_host(lab_host: None) -> None:
    """podman 4.3 (with runc and catatonit), installed as the lab installs Slurm (apt-get);
    skipped, saying so, only on a machine that has neither them nor apt-get."""
    missing = labmod.missing_programs(labmod.CONTAINER_PROGRAMS)
    if missing and shutil.which("apt-get") is None:
        pytest.skip(f"no {', '.join(missing)} and no apt-get to install them")
    labmod.install_packages(labmod.CONTAINER_PACKAGES, labmod.CONTAINER_PROGRAMS)


def container_env(lab: Any, folder: Path, *, coordinators_inside: bool) -> dict[str, str]:
    """What `submit` adds for a job whose processes run in podman containers: PYTHON is the
    wrapper for every process, or (coordinators outside) for the workers and agents only."""
    env = {**lab.podman_env(), "PYTHON": str(PODMAN_PYTHON), "CONTAINER_PYTHON": sys.executable,
           "CONTAINER_MOUNTS": str(folder)}  # fmt: skip
    if not coordinators_inside:
        env["DEADPOOL_COORDINATOR_PYTHON"] = sys.executable
    return env


@dataclass(frozen=True)
class Seen:
    """One Python process of a job, as the host sees it on a lab node."""

    node: str
    role: str  # worker, agent or coordinator (the primary or the standby)
    pid_ns: str
    contained: bool  # its PID namespace is not its node's, its cgroup a podman container's


def job_pythons(lab: Any, job_id: str) -> list[Seen]:
    """Every Python process of job `job_id` on the lab's nodes: those sharing a node's network
    namespace (a container with --net host does), in a container's PID namespace or not."""
    seen = []
    for node in lab.nodes():
        init = lab.state["nodes"][node]["init"]["pid"]
        node_net, node_pid = (os.readlink(f"/proc/{init}/ns/{ns}") for ns in ("net", "pid"))
        for pid in labmod._pids():
            try:
                if os.readlink(f"/proc/{pid}/ns/net") != node_net:
                    continue
                if not Path(f"/proc/{pid}/comm").read_text().startswith("python"):
                    continue
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                pid_ns = os.readlink(f"/proc/{pid}/ns/pid")
                cgroup = Path(f"/proc/{pid}/cgroup").read_text()
            except OSError:  # it ended meanwhile
                continue
            if f"SLURM_JOB_ID={job_id}".encode() not in environ:
                continue
            # (an agent's command line ends with its workers')
            role = next(r for r, mark in (("agent", "\0agent\0"), ("coordinator", "\0coordinator\0"),
                        ("worker", ".worker\0"), ("other", "")) if mark in cmd)  # fmt: skip
            contained = pid_ns != node_pid and "/libpod-" in cgroup
            seen.append(Seen(node, role, pid_ns, contained))
    return sorted(seen, key=lambda p: (p.node, p.role))


def container_leftovers(lab: Any) -> tuple[list[str], list[str]]:
    """podman, conmon and catatonit processes left on the lab's nodes; the containers the lab's
    podman still lists as running."""
    left = []
    for node in lab.nodes():
        for pid in lab.node_pids(node):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if comm in ("podman", "conmon", "catatonit"):
                left.append(f"{node}: {comm} {pid}")
    env = {**os.environ, **lab.podman_env()}
    running = subprocess.run(["podman", "ps", "--no-trunc", "--format", "{{.ID}} {{.Command}}"], env=env,
                             capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    return left, running.stdout.splitlines()


@pytest.mark.timeout(2 * JOB_TIMEOUT + 300)
def test_in_podman_containers_a_training_node_killed_the_spare_node_takes_over(
    lab: Any, podman_host: None, reference: dict[str, Any], tmp_path: Path
) -> None:
    """Every process in a container (PYTHON the podman wrapper: the coordinator on the batch
    host, the standby, the workers): n2 dies whole mid-run, its containers with it; the spare
    node's containers take ranks 2 and 3, and training ends like the failure-free run. No
    container outlives the job on the nodes that survived."""
    env = container_env(lab, tmp_path, coordinators_inside=True)
    job = submit(lab, tmp_path / "logs", "vista", write_job(tmp_path), **env)
    job.wait_for_iteration(FAIL_AT, JOB_TIMEOUT)
    seen = job_pythons(lab, job.id)
    placed = [(p.node, p.role) for p in seen]
    assert placed == [("n1", "coordinator"), ("n1", "worker"), ("n1", "worker"),
                      ("n2", "worker"), ("n2", "worker"),
                      ("n3", "coordinator"), ("n3", "worker"), ("n3", "worker")], seen  # fmt: skip
    assert all(p.contained for p in seen), seen
    assert len({p.pid_ns for p in seen}) == len(seen), seen  # one container each
    lab.crash("n2")
    record = job.wait_end()
    recovered = job.event("recovered")
    assert recovered is not None and recovered["dead_ranks"] == [2, 3], job.describe()
    assert sorted(recovered["replaced_by"].values()) == ["s0", "s1"]
    assert recovered["restore_iteration"] >= FAIL_AT
    assert_trained_like(job, reference)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", job.describe()
    # The coordinators' exit statuses came through podman: the verdict, and the standby's
    # "not the job's coordinator" (5).
    assert "the coordinator exited with status 0" in job.text("batch.out"), job.describe()
    assert job.text("standby.status").strip() == "5", job.describe()
    processes, running = container_leftovers(lab)
    assert processes == [], processes
    # Listed still: n2's two, which died with their node before podman could end them (the
    # lab's storage goes with the lab; a node's runroot is empty after a reboot).
    assert len(running) == 2 and all(".worker" in c for c in running), running


@pytest.mark.timeout(2 * JOB_TIMEOUT + 300)
def test_coordinators_outside_the_container_agents_and_workers_inside(
    lab: Any, podman_host: None, reference: dict[str, Any], tmp_path: Path
) -> None:
    """As pyxis runs a job: the coordinators on the host (DEADPOOL_COORDINATOR_PYTHON, the
    host's Python), each node's agent in a container (PYTHON the wrapper), and the workers an
    agent starts in its container (the wrapper, run inside, runs Python there). Failure-free,
    like the run on one machine."""
    env = container_env(lab, tmp_path, coordinators_inside=False)
    job = submit(lab, tmp_path / "logs", "vista", write_job(tmp_path), DEADPOOL_RESPAWN_LIMIT="1",
                 **env)  # fmt: skip
    job.wait_for_iteration(FAIL_AT, JOB_TIMEOUT)
    seen = job_pythons(lab, job.id)
    placed = [(p.node, p.role, p.contained) for p in seen]
    expected = [("n1", "agent", True), ("n1", "coordinator", False), ("n1", "worker", True),
                ("n1", "worker", True), ("n2", "agent", True), ("n2", "worker", True),
                ("n2", "worker", True), ("n3", "agent", True), ("n3", "coordinator", False),
                ("n3", "worker", True), ("n3", "worker", True)]  # fmt: skip
    assert placed == expected, seen
    for node in ("n1", "n2", "n3"):  # a node's workers run in its agent's container
        assert len({p.pid_ns for p in seen if p.node == node and p.role != "coordinator"}) == 1
    record = job.wait_end()
    assert job.event("recovered") is None, job.describe()
    assert_trained_like(job, reference)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", job.describe()
    assert container_leftovers(lab) == ([], [])


@pytest.fixture
def node_memory(tmp_path: Path) -> Iterator[None]:
    """After a test with node agents: delete the memory folders of the agents its lab nodes'
    crashes killed (the lab's nodes share this machine's /dev/shm)."""
    yield
    remove_node_memory(tmp_path)


def _worker_pid(lab: Any, node: str, agent_log: str, task: int) -> int:
    """The host PID of the process a node's agent started as task `task` (`agent_log`: its log,
    which names the PID in the node's own PID namespace)."""
    pid = started_pid(agent_log, task)
    for host_pid in lab.node_pids(node):
        try:
            status = Path(f"/proc/{host_pid}/status").read_text()
        except OSError:  # it ended meanwhile
            continue
        ns = next(
            (line.split()[-1] for line in status.splitlines() if line.startswith("NSpid:")), ""
        )
        if ns == str(pid):
            return host_pid
    raise AssertionError(f"no process {pid} (task {task}) on {node}")


@pytest.mark.timeout(2 * JOB_TIMEOUT + 300)
def test_node_agents_respawn_a_killed_process_in_place_and_a_lost_node_takes_the_spares(
    lab: Any, reference: dict[str, Any], tmp_path: Path, node_memory: None
) -> None:
    """DEADPOOL_RESPAWN_LIMIT=1: one `deadpool agent` per node starts its processes. Rank 2's
    process on n2 is SIGKILLed, its node fine: n2's agent respawns it there, no spare is spent.
    Later n2 dies whole (its agent with it): the spare node n3 takes ranks 2 and 3."""
    job = submit(lab, tmp_path / "logs", "vista", write_job(tmp_path), DEADPOOL_RESPAWN_LIMIT="1")
    job.wait_for_iteration(FAIL_AT, JOB_TIMEOUT)
    os.kill(_worker_pid(lab, "n2", job.text("agent-1.log"), 2), signal.SIGKILL)
    job.wait_for_iteration(2 * FAIL_AT, JOB_TIMEOUT)
    lab.crash("n2")
    record = job.wait_end()
    recoveries = [e for e in job.events() if e["event"] == "recovered"]
    assert len(recoveries) == 2, job.describe()
    crash, node = recoveries
    assert crash["dead_ranks"] == [2] and crash["respawned"] == {"2": 1}, job.describe()
    assert crash["replaced_by"] == {"2": "s2"}
    assert node["dead_ranks"] == [2, 3] and node["respawned"] == {}, job.describe()
    assert sorted(node["replaced_by"].values()) == ["s0", "s1"]
    assert "s2 takes rank 2 in place of a2" in job.text("agent-1.log")
    # s2 (task 6) restored from its predecessor's snapshot in n2's memory, not from a peer.
    restored = f"restored iteration {crash['restore_iteration']} (from local snapshot)"
    assert restored in job.task_logs()[6], job.describe()
    assert_trained_like(job, reference)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", job.describe()


@pytest.mark.timeout(2 * JOB_TIMEOUT + 300)
def test_frozen_node_is_detected_by_heartbeat_and_replaced(
    lab: Any, reference: dict[str, Any], tmp_path: Path
) -> None:
    """Every process of n2 (slurmd too) is SIGSTOPped: a hung node. The coordinator names its
    ranks hung after the heartbeat timeout, the survivors stop waiting on them, the spare node
    takes over, and the job ends although n2's processes never run again."""
    job = submit(lab, tmp_path / "logs", "vista", write_job(tmp_path))
    job.wait_for_iteration(FAIL_AT, JOB_TIMEOUT)
    lab.freeze("n2")
    record = job.wait_end()
    dead = [e for e in job.events() if e["event"] == "process_dead"]
    assert {e["member"] for e in dead} == {"a2", "a3"}, job.describe()
    # by their silence: the first as hung, its node-mate as hung or as silent on a dead rank's node
    assert all("silent for" in e["why"] for e in dead), dead
    recovered = job.event("recovered")
    assert recovered is not None and recovered["dead_ranks"] == [2, 3], job.describe()
    assert_trained_like(job, reference)
    assert record["JobState"] == "COMPLETED", job.describe()


@pytest.mark.timeout(2 * JOB_TIMEOUT + 300)
def test_batch_host_crash_loses_no_training_state_and_ends_the_job(
    lab: Any, reference: dict[str, Any], tmp_path: Path
) -> None:
    """n1 - the batch host, the primary coordinator's host, ranks 0 and 1 - dies whole. The
    standby coordinator on n3 takes over, the spares there replace ranks 0 and 1, training ends
    like the failure-free run, and Slurm lets go of the job (the batch script died with n1:
    the standby ends the job) instead of holding its nodes."""
    config = write_job(tmp_path)
    job = submit(lab, tmp_path / "logs", "vista", config, DEADPOOL_END_GRACE="5")
    job.wait_for_iteration(FAIL_AT, JOB_TIMEOUT)
    lab.crash("n1")
    crashed = time.time()
    job.wait_end(timeout=crashed - job.submitted + 120)
    took_over = job.event("taking_over")
    assert took_over is not None and took_over["epoch"] == 1, job.describe()
    recovered = job.event("recovered")
    assert recovered is not None and recovered["dead_ranks"] == [0, 1], job.describe()
    assert_trained_like(job, reference)


@pytest.mark.timeout(2 * JOB_TIMEOUT + 300)
def test_a_node_of_another_allocation_joins_as_spares_and_takes_over(
    lab_host: None, reference: dict[str, Any], tmp_path: Path
) -> None:
    """A 4-node lab. The job runs on n1-n3 (n3 its spare node); a second sbatch of
    vista.sbatch, unchanged, on n4 with DEADPOOL_JOIN and the job's token file (the command
    the job prints) adds n4's two tasks to the running job as spares s2 and s3. Then n2
    crashes (the spare node n3 takes its ranks) and n3 crashes (n4's tasks take them): more
    node losses than the job had spare nodes. Training ends like the failure-free run, and
    the joining allocation ends with the job."""
    lab = labmod.Lab.fresh()
    try:
        # n4 joins while the job starts and must be in before its 30 iterations end: its
        # processes get the 2 shared cores first, as a node of its own has its own CPUs.
        lab.up(nodes=4, gpus_per_node=4, favoured=["n4"])
        job = submit(lab, tmp_path / "logs", "vista", write_job(tmp_path), ["n1", "n2", "n3"])
        deadline = time.time() + JOB_TIMEOUT
        while not (join := re.search(JOIN_LINE, job.text("batch.out"))):
            assert time.time() < deadline and job.state() is not None, job.describe()
            time.sleep(0.2)
        joining = submit(
            lab,
            tmp_path / "join-logs",
            "vista",
            write_job(tmp_path / "join"),
            ["n4"],
            DEADPOOL_JOIN=join[1],
            DEADPOOL_JOB_ID=join[2],
            DEADPOOL_JOB_TOKEN_FILE=join[3],
        )
        while len([e for e in job.events() if e["event"] == "spare_joined"]) < 2:
            assert time.time() < deadline, f"{joining.describe()}\n{job.describe()}"
            time.sleep(0.2)
        joined = sorted(e["member"] for e in job.events() if e["event"] == "spare_joined")
        assert joined == ["s2", "s3"], job.describe()  # after the job's own s0 and s1
        job.wait_for_iteration(FAIL_AT, JOB_TIMEOUT)
        lab.crash("n2")
        while job.event("recovered") is None:
            assert time.time() < deadline and job.state() is not None, job.describe()
            time.sleep(0.1)
        assert job.event("finished") is None, "training ended before n3 crashed"
        lab.crash("n3")
        record = job.wait_end()
        recoveries = [e for e in job.events() if e["event"] == "recovered"]
        assert [r["dead_ranks"] for r in recoveries] == [[2, 3], [2, 3]], job.describe()
        assert sorted(recoveries[0]["replaced_by"].values()) == ["s0", "s1"]
        assert sorted(recoveries[1]["replaced_by"].values()) == joined
        assert_trained_like(job, reference)
        assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", job.describe()
        assert joining.wait_end()["JobState"] == "COMPLETED", joining.describe()
    finally:
        lab.down()


REVIVE_ITERS = 400
"""The revive test's run: long enough (about a minute here) for a crashed node to boot again and
join the job (as hotswap/coordinator/test_node_agents.py's join test: one failure-free reference for
both)."""


@pytest.mark.timeout(3 * JOB_TIMEOUT + 600)
def test_node_agents_a_crashed_node_revived_joins_with_its_agent_and_takes_over_again(
    lab: Any, failure_free: Callable[[int], TrainRun], tmp_path: Path, node_memory: None
) -> None:
    """DEADPOOL_RESPAWN_LIMIT=1 (one `deadpool agent` per node). n2 crashes: the spare node n3
    takes ranks 2 and 3. `lab.py revive n2` boots it again, and the command the job printed
    (DEADPOOL_JOIN, its token file, the same sbatch file) submitted on n2 starts n2's agent,
    which joins the running job (node 3) with its two processes as spares. n3 crashes: n2's
    processes take ranks 2 and 3 again. Then the one holding rank 2 is SIGKILLed: n2's agent
    respawns it in place. Training ends like the failure-free run."""
    reference = failure_free(REVIVE_ITERS)[2]
    job = submit(lab, tmp_path / "logs", "vista", write_job(tmp_path, iters=REVIVE_ITERS),
                 DEADPOOL_RESPAWN_LIMIT="1")  # fmt: skip
    deadline = time.time() + 2 * JOB_TIMEOUT

    joining: Any = None

    def until(what: str, condition: Callable[[], object]) -> None:
        while not condition():
            if time.time() > deadline or job.state() is None:
                more = "" if joining is None else f"\n--- the join\n{joining.describe()}"
                raise AssertionError(f"{what}\n{job.describe()}{more}\n{lab.status()}")
            time.sleep(0.2)

    until("the join line", lambda: re.search(JOIN_LINE, job.text("batch.out")))
    join = re.search(JOIN_LINE, job.text("batch.out"))
    assert join is not None
    job.wait_for_iteration(FAIL_AT, JOB_TIMEOUT)
    lab.crash("n2")
    until("the first recovery", lambda: job.event("recovered"))
    # The join below waits in Slurm's queue until n2 is back. n2 boots on the 2 cores the job's
    # four processes (and the suite's other worker) keep busy: its processes get them first, as
    # a node has CPUs of its own, or its fork server's imports can outlast the training (CI).
    lab.revive("n2", favoured=True)
    config = write_job(tmp_path / "join", iters=REVIVE_ITERS)
    joining = submit(lab, tmp_path / "join-logs", "vista", config, ["n2"], DEADPOOL_JOIN=join[1],
                     DEADPOOL_JOB_ID=join[2], DEADPOOL_JOB_TOKEN_FILE=join[3],
                     DEADPOOL_RESPAWN_LIMIT="1")  # fmt: skip

    def joined() -> list[str]:
        return sorted(e["member"] for e in job.events() if e["event"] == "spare_joined")

    until("n2's spares", lambda: len(joined()) == 2)
    assert job.event("finished") is None, "training ended before n2 joined"
    lab.crash("n3")
    until("the second recovery", lambda: len([e for e in job.events()
                                              if e["event"] == "recovered"]) == 2)  # fmt: skip
    holder = next(t for t in (0, 1) if "[deadpool r2 " in joining.text(f"task-{t}.log"))
    os.kill(_worker_pid(lab, "n2", joining.text("agent-0.log"), holder), signal.SIGKILL)
    record = job.wait_end(timeout=deadline - job.submitted)
    recoveries = [e for e in job.events() if e["event"] == "recovered"]
    assert [r["dead_ranks"] for r in recoveries] == [[2, 3], [2, 3], [2]], job.describe()
    assert sorted(recoveries[0]["replaced_by"].values()) == ["s0", "s1"]
    assert sorted(recoveries[1]["replaced_by"].values()) == joined()
    assert recoveries[2]["respawned"] == {"2": 3}, recoveries
    # n2's agent reported the crash, finding the name its process took from the store.
    assert re.search(r"process s[23] exited with code -9", job.text("coordinator.log"))
    assert_trained_like(job, reference)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", job.describe()
    assert joining.wait_end()["JobState"] == "COMPLETED", joining.describe()


JOIN_LINE = r"DEADPOOL_JOIN=(\S+) DEADPOOL_JOB_ID=(\S*) DEADPOOL_JOB_TOKEN_FILE=(\S+)"
"""The job's line that says how to add nodes to it."""


@pytest.mark.timeout(2 * JOB_TIMEOUT + 300)
def test_both_coordinators_nodes_lost_survivors_save_and_the_job_ends(
    lab: Any, reference: dict[str, Any], tmp_path: Path
) -> None:
    """n1 (the batch host: the primary, ranks 0 and 1) and n3 (the standby, the spares) die
    together: nothing can recover. The survivors on n2 find no coordinator within the connect
    timeout, save what they hold (their own snapshots and their replicas of ranks 0 and 1: a
    complete set), and, once Slurm reports n1 and n3 not responding, cancel the job instead of
    leaving it to hold the nodes; `--load` resumes the saved set bit for bit."""
    save = tmp_path / "save"
    config = write_job(tmp_path, save=str(save))
    job = submit(
        lab,
        tmp_path / "logs",
        "vista",
        config,
        DEADPOOL_EXTRA_ARGS="--deadpool-pg-timeout 30 --deadpool-connect-timeout 8",
        DEADPOOL_END_GRACE="5",
    )
    job.wait_for_iteration(FAIL_AT, JOB_TIMEOUT)
    lab.crash("n1")
    lab.crash("n3")
    crashed = time.time()
    # connect timeout 8 s, Slurm's verdict ~15 s (SlurmdTimeout 10 s), grace 5 s, a margin
    record = job.wait_end(timeout=crashed - job.submitted + 120)
    survivors = [job.task_logs()[r] for r in (2, 3)]
    for log in survivors:
        assert "found none of" in log and "saved what this rank held" in log, job.describe()
    assert any(f"cancelled the Slurm job {job.id}" in log for log in survivors), job.describe()
    assert record["JobState"] == "CANCELLED", job.describe()
    from megatron_deadpool.replication import save_dir

    point = save_dir.resume_point(str(save))
    assert point is not None and point[0] == "snapshots" and point[1] >= FAIL_AT - 1, point
    resumed = run_deadpool(
        "train", "--config", str(config), "--load", str(save), "--spares", "0",
        "--json-log", str(tmp_path / "resumed.jsonl"), "--run-dir", str(tmp_path / "resumed"),
        timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    summary = json.loads((tmp_path / "resumed.jsonl").read_text().splitlines()[-1])
    assert summary["final_param_digest"] == reference["final_param_digest"]


# ---------------------------------------------------------------------- Megatron-LM
MLM_ITERS = 16  # as test_megatron_lm_failover: both compare against one failure-free run
MLM_ARGS = " ".join([*megatron_args(MLM_ITERS), "--use-distributed-optimizer"])
MLM_FLAGS = (
    "--deadpool-heartbeat-timeout 3 --deadpool-heartbeat-interval 0.5 --deadpool-pg-timeout 30"
)


@pytest.mark.timeout(3 * JOB_TIMEOUT + 600)
def test_megatron_lm_node_killed_mid_run_the_spare_node_takes_over(
    lab: Any, tmp_path: Path, megatron_lm_failure_free: Callable[[int], MegatronLMReference]
) -> None:
    """DEADPOOL_MODE=megatron-lm through vista.sbatch: pretrain_gpt.py unmodified, node 1's
    tasks killed at an iteration from Megatron's own log line; the final weights and every
    logged iteration are those of `deadpool megatron-lm` on one machine without a failure.
    (Under load the kill can leave the survivors one step apart - the last collective of a step
    completed on some of them only: megatron_lm/survivors.py.)"""
    tree = megatron_lm_tree()  # the oldest supported tag MEGATRON_LM_PATH lists
    expected = megatron_lm_failure_free(MLM_ITERS)  # conftest: the same run on one machine
    job = submit(
        lab,
        tmp_path / "logs",
        "vista",
        None,
        DEADPOOL_MODE="megatron-lm",
        MEGATRON_LM_PATH=str(tree),
        MEGATRON_ARGS=MLM_ARGS,
        DEADPOOL_EXTRA_ARGS=MLM_FLAGS,
        DEADPOOL_INJECT="--node-index 1 --at-iteration 6",
    )
    record = job.wait_end(timeout=2 * JOB_TIMEOUT)
    assert "at iteration 6" in job.text("inject.log"), job.describe()
    recovered = job.event("recovered")
    assert recovered is not None and recovered["dead_ranks"] == [2, 3], job.describe()
    finished = job.event("finished")
    assert finished is not None and finished["rank_digests"] == expected.digests, job.describe()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0"
    logged = logged_iterations("\n".join(job.task_logs().values()))
    assert logged == {it: expected.iterations.get(it) for it in logged}, job.describe()
    # Only the line of the step whose log met the failure may be missing (rank 3 prints it, and
    # died in its barrier): the last step completed, the restore iteration or the one after.
    missing = set(expected.iterations) - set(logged)
    restored = recovered["restore_iteration"]
    assert len(missing) <= 1 and missing <= {restored, restored + 1}, (missing, job.describe())


# ---------------------------------------------------------------------- deadpool selftest
@pytest.mark.timeout(JOB_TIMEOUT + 120)
def test_selftest_runs_across_the_allocation_with_the_site_script(lab: Any, tmp_path: Path) -> None:
    """`DEADPOOL_MODE=selftest` with vista.sbatch unchanged: every check's ranks are srun tasks
    on the three nodes (two active, one spare), a killed and a frozen peer each replaced by a
    spare on the spare node, bitwise equal to the failure-free run; the frozen task, which
    never exits, killed with its job step; exit code 0 for Slurm."""
    job = submit(lab, tmp_path / "logs", "vista", None, DEADPOOL_MODE="selftest")
    record = job.wait_end()
    out = job.text("batch.out")
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", out
    report = json.loads(job.text("selftest.json"))
    rows = report["checks"]
    for check in ("settings", "replication", "peer killed", "peer frozen"):
        assert rows[check]["status"] == "pass", out
    assert report["environment"]["slurm"]["nodes"] == 3
    assert rows["replication"]["data"]["holders"] == {"0": [2], "1": [3], "2": [0], "3": [1]}
    for check in ("peer killed", "peer frozen"):
        run = tmp_path / "logs" / "selftest" / check.replace(" ", "-")
        logs = {int(p.stem.split("-")[1]): p.read_text() for p in run.glob("task-*.log")}
        assert sorted(logs) == list(range(6))  # 2 nodes x 2 actives, 1 node x 2 spares
        assert "[deadpool r1 g1]" in logs[4]  # task 4 = spare s0, on n3, took rank 1
        killed = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
        killed = [e for e in killed if e["event"] == "step_killed"]
        assert len(killed) == (1 if check == "peer frozen" else 0), killed
