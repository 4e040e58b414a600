"""Shared test set-up: the harness on the import path, runners for the real `deadpool` CLI, and
the failure-free reference runs, computed once per session.

Multi-process tests use `tests/mp.py` (fresh interpreters joined in a gloo world on a loopback
TCPStore); CLI tests run the installed `deadpool` command as a subprocess, the way a user does
(`run_deadpool`), or its entry point in this process (`call_deadpool`). Bitwise tests compare
against `failure_free(iters)` (`deadpool train`) and `megatron_lm_failure_free(iters)`. Other
helpers: tests/procs.py (ports, waiting on conditions), tests/stores.py (a recording store),
tests/optimizers.py (optimizer stand-ins), tests/mlm.py (Megatron-LM trees and runs),
tests/standby_job.py (a job with a standby coordinator), tests/coordinated_job.py (a
cluster coordinator and its five workers). Fixtures for launcher tests: `own_servers`, `started`,
`server`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

# The launchers a test runs in this process borrow kept fork servers
# (`hotswap.launch.warm_start.SharedServers`): torch and Megatron are imported once per kind of process
# and pytest worker, not once per job. tests/hotswap/launch/test_forkserver.py and
# tests/embedded/test_warm_start.py test a launcher's own servers, the default.
os.environ.setdefault("DEADPOOL_WARM_START", "shared")


LONGEST_FIRST = (
    "megatron_lm/test_pretrain_gpt_models.py",
    "megatron_lm/test_pretrain_gpt.py",
    "cluster/test_slurm_lab.py",
    "hotswap/coordinator/test_failover.py",
    "bench/test_goodput.py",
    "embedded/test_hotswap.py",
    "hotswap/worker/test_faults.py",
    "megatron_lm/test_megatron_lm_failover.py",
    "embedded/test_respawn.py",
    "selftest/test_selftest.py",
    "embedded/test_full_disk.py",
    "megatron_lm/test_megatron_lm_full_disk.py",
)
"""The modules that take longest (a minute or more each on 2 cores), longest first."""


def pytest_configure(config: pytest.Config) -> None:
    """With pytest-xdist's workers (`-n 2`), each module runs whole on one worker (its module
    fixtures and cached runs made once), in the order collected (`--dist loadfile
    --no-loadscope-reorder`, whatever the command line says). And this is the only conftest.py:
    test modules import its helpers as `conftest`, a name a second one would take over."""
    others = sorted(p for p in TESTS_DIR.rglob("conftest.py") if p != Path(__file__).resolve())
    if others:
        raise pytest.UsageError(
            f"{others[0]}: tests import tests/conftest.py as `conftest`; move its fixtures there"
        )
    if getattr(config.option, "numprocesses", None):
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the longest modules first (`LONGEST_FIRST`), the others as collected: `-n 2` hands out
    whole modules in this order (`pytest_configure`), so no long module is left to run alone at
    the end."""

    def rank(item: pytest.Item) -> int:
        module = item.path.relative_to(TESTS_DIR).as_posix()
        return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)


def deadpool_command() -> list[str]:
    """The installed `deadpool` entry point next to this interpreter, else `-m` on the CLI."""
    script = Path(sys.executable).parent / "deadpool"
    return [str(script)] if script.exists() else [sys.executable, "-m", "megatron_deadpool.cli"]


def run_deadpool(
    *args: str, timeout: float = 120.0, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run `deadpool ARGS...` to completion; stdout and stderr captured as text. When it runs
    past `timeout`, it is killed with every process it started (a launcher's fork server and
    workers sit in sessions of their own, and a rank stopped by a hang fault would wait
    forever) - SIGTERM first, so that launchers and node agents delete their shared memory -
    then `TimedOut` is raised (a `subprocess.TimeoutExpired` that shows its output)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONWARNINGS", None)  # what a user sees, warnings included
    cmd = [*deadpool_command(), *args]
    with subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(cwd or REPO_ROOT),
        env=env,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            from megatron_deadpool.hotswap.coordinator.liveness import kill_tree

            kill_tree(proc.pid, grace_s=TERM_GRACE_S)
            out, err = proc.communicate()
            raise TimedOut(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


TERM_GRACE_S = 5.0
"""How long a timed-out command's processes get after SIGTERM before SIGKILL (`kill_tree`: a
launcher and a node agent delete their shared memory, ``/dev/shm/deadpool-*``, on SIGTERM)."""


class TimedOut(subprocess.TimeoutExpired):
    """`subprocess.TimeoutExpired` whose message ends with what the command printed last (the
    test's report then says where the job stood, e.g. a coordinator waiting for a rank)."""

    def __str__(self) -> str:
        printed = {"stdout": self.stdout, "stderr": self.stderr}
        tails = [f"its {name} ended:\n{text[-4000:]}" for name, text in printed.items() if text]
        return "\n".join([super().__str__(), *tails])


def run_logs(run_dir: Path, lines: int = 8) -> str:
    """What a failed run left in `run_dir` and its folders, to read in CI's output (its
    temporary folders are gone by then): the coordinator's events after the last recovery, and
    the last `lines` lines of every process's log."""
    out = []
    for path in sorted(run_dir.rglob("events.jsonl")):
        events = path.read_text(errors="replace").splitlines()
        last = max([i for i, e in enumerate(events) if '"recovered"' in e], default=0)
        out += [f"== {path.relative_to(run_dir)} (from line {last + 1})", *events[last:][-40:]]
    for path in sorted(run_dir.rglob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        out += [f"== {path.relative_to(run_dir)}", *(line[:300] for line in tail)]
    return "\n".join(out)


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


SPARE_PATH = ["--deadpool-respawn-limit", "0"]
"""In-place respawn off (it is on by default): every failure takes a spare, as the tests of
the spare path and of the end out of redundancy need. Given before a test's own flags, which
win (argparse keeps the last)."""

# Fast failure detection for tests: hangs are named after 3 s of silence.
FAST_HEARTBEAT = ["--deadpool-heartbeat-timeout", "3", "--deadpool-heartbeat-interval", "0.5"]


TrainRun = tuple[subprocess.CompletedProcess, list[dict], dict]


@dataclass(frozen=True)
class MegatronLMReference:
    """A failure-free Megatron-LM run (`megatron_lm_failure_free`)."""

    digests: dict[str, str]
    """rank -> the digest of its final parameters."""
    iterations: dict[int, tuple[str, str, str]]
    """iteration -> (learning rate, lm loss, grad norm) as Megatron logged them."""


"""A finished `deadpool train`: the process, the per-iteration records, the summary."""


@pytest.fixture
def own_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every `WarmStart` has servers of its own, as a launcher process has by default (the test
    session lends kept ones: `DEADPOOL_WARM_START` above); the kept ones are tested with a pool of
    their own."""
    monkeypatch.setenv("DEADPOOL_WARM_START", "1")


@pytest.fixture
def started() -> Iterator[list[Any]]:
    """Processes a test starts; their groups are killed whatever happens."""
    from megatron_deadpool.hotswap.coordinator.liveness import kill_groups

    procs: list[Any] = []
    try:
        yield procs
    finally:
        kill_groups(procs)


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fork server (`hotswap.launch.warm_start.ForkServer`) importing the test module's `LIGHT`,
    in its `ENV`; ended and reaped after the module's tests."""
    from megatron_deadpool.hotswap.launch.warm_start import ForkServer

    srv = ForkServer(request.module.LIGHT, request.module.ENV)
    try:
        yield srv
    finally:
        srv.close()
        assert srv.proc.returncode is not None


def train_case(
    out: Path, args: list[str], iters: str, timeout: float = 240, *, spare_path: bool = True
) -> TrainRun:
    """`deadpool train ARGS` with logs under `out` ("{ckpt}" in ARGS becomes out/ckpt).

    In-place respawn off (`SPARE_PATH`) unless ARGS set --deadpool-respawn-limit or
    `spare_path` is False (the defaults): these runs test a spare's takeover and the end out of
    redundancy. Returns the finished process, the
    per-iteration records and the summary ({} if none).
    """
    log = out / "run.jsonl"
    proc = run_deadpool(
        "train",
        *(SPARE_PATH if spare_path else []),
        *(a.replace("{ckpt}", str(out / "ckpt")) for a in args),
        "--iters",
        iters,
        *FAST_HEARTBEAT,
        "--json-log",
        str(log),
        "--run-dir",
        str(out / "logs"),
        timeout=timeout,
    )
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    if lines and lines[-1].get("event") == "summary":
        return proc, lines[:-1], lines[-1]
    return proc, lines, {}


# The failure-free runs that bitwise tests compare against: one per session and length.
FAILURE_FREE_ARGS = ["--tp", "2", "--dp", "2", "--spares", "0"]
"""The CPU demo's model and layout (configs/cpu-demo.yaml: TP 2 x DP 2, two ranks per node),
DeadPool on, no spare: what every embedded job of the tests trains, whatever its spares,
failure domains or coordinators."""


def once_per_run(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Any]) -> Any:
    """`make(folder)`'s JSON-able result, computed once per test run: with pytest-xdist's
    workers (`-n 2`), the first to ask runs it in a folder of the run's shared temporary root,
    under a file lock, and the others wait and read its result. A `make` that fails leaves no
    result: the next to ask runs it again (and fails the same way)."""
    from filelock import FileLock

    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the workers of this run
    folder, result = root / name, root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not result.exists():
            folder.mkdir(exist_ok=True)
            result.write_text(json.dumps(make(folder)))
        return json.loads(result.read_text())


@pytest.fixture(scope="session")
def failure_free(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], TrainRun]:
    """`failure_free(iters)`: the failure-free `deadpool train` of the CPU demo for `iters`
    iterations (`FAILURE_FREE_ARGS`), run the first time a test asks for that length in this
    test run (`once_per_run`) and shared by every test comparing against it (losses and
    parameter digests, exactly): test_hotswap, test_faults, test_frozen_peer and test_train (its
    DeadPool-on run) at 6 iterations, test_faults' preemption at 8, test_failover and the Slurm
    lab at 30."""

    def make(iters: int, out: Path) -> dict[str, Any]:
        proc, records, summary = train_case(out, FAILURE_FREE_ARGS, str(iters), timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert len(records) == iters and summary.get("final_param_digest"), summary
        return {"proc": [proc.args, proc.returncode, proc.stdout, proc.stderr],
                "records": records, "summary": summary}  # fmt: skip

    def get(iters: int) -> TrainRun:
        run = once_per_run(tmp_path_factory, f"failure-free-{iters}", partial(make, iters))
        return subprocess.CompletedProcess(*run["proc"]), run["records"], run["summary"]

    return get


@pytest.fixture(scope="session")
def megatron_lm_failure_free(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[int], MegatronLMReference]:
    """`megatron_lm_failure_free(iters)`: a failure-free `deadpool megatron-lm` run of the
    oldest supported Megatron-LM tag MEGATRON_LM_PATH lists (`mlm.megatron_args(iters)`, TP 2 x
    DP 2, distributed optimizer, DeadPool on, no spare): each rank's final parameter digest and
    every logged iteration (learning rate, lm loss, grad norm), run once per session and
    length: test_megatron_lm_failover and the Slurm lab's Megatron-LM job (16 iterations)
    compare against it. Skips without a tree."""
    from mlm import launch, megatron_args, megatron_lm_tree

    def make(iters: int, tree: Path, tmp: Path) -> dict[str, Any]:
        args = [*megatron_args(iters), "--use-distributed-optimizer", "--deadpool",
                "--deadpool-spares", "0", "--deadpool-ranks-per-node", "2"]  # fmt: skip
        run = launch(tmp, "reference", tree / "pretrain_gpt.py", args)
        assert run.returncode == 0, run.describe()
        iterations = run.iterations()
        assert sorted(iterations) == list(range(1, iters + 1)), run.describe()
        return {"digests": run.summary["param_digests"],
                "iterations": {str(k): list(v) for k, v in iterations.items()}}  # fmt: skip

    def get(iters: int) -> MegatronLMReference:
        tree = megatron_lm_tree()  # skips without one
        run = once_per_run(
            tmp_path_factory, f"mlm-failure-free-{iters}", partial(make, iters, tree)
        )
        iterations = {int(k): (v[0], v[1], v[2]) for k, v in run["iterations"].items()}
        return MegatronLMReference(run["digests"], iterations)

    return get


def hung_silence_s(why: str) -> float | None:
    """The silence a process was killed after as hung, from its `process_dead` event's `why`
    ("silent for 3.2s (hung); killed"); None for any other death."""
    found = re.fullmatch(r"silent for (\d+\.\d)s \(hung\); killed", why)
    return float(found[1]) if found else None


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
