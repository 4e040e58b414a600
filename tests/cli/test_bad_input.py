"""Every bad input refused before any process starts, across the `deadpool` commands: one line on
stderr naming the flag or key (and the fix), exit code 2, no traceback, no hang, no worker.

One row per bad input (the closing notes of issue 25 list what each did before). Most
rows run the real entry point in this process (`call_deadpool`); two run the installed command
(`run_deadpool`), where the entry point's own handling differs: a config file that is not UTF-8,
and a `--deadpool-*` value Megatron-LM's command line carries to `deadpool megatron-lm`.
"""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REPO_ROOT, call_deadpool, run_deadpool

DEMO = str(REPO_ROOT / "configs" / "cpu-demo.yaml")
COORD = ["coordinator", "--world-size", "2", "--deadpool-coordinator", "127.0.0.1:29499"]
"""`deadpool coordinator`; every row below is refused before it would listen on that port."""
AGENT = ["agent", "--world-size", "2", "--node", "0", "--deadpool-coordinator", "127.0.0.1:29499"]
"""`deadpool agent` with what every row below keeps."""
MLM = ["megatron-lm", "--nproc-per-node", "2", "--timeout", "30"]
CHAOS = ["chaos", "--minutes", "1", "--mtbf-iters", "8", "--episodes", "1"]

ROWS: dict[str, tuple[list[str], str]] = {
    # row: (arguments after `deadpool`; "{d}" is the row's folder of bad files, text the line
    # must contain: the flag or key it names)
    # -- deadpool train: numbers (the --deadpool-* flags are DeadpoolConfig's, YAML's too)
    "train-heartbeat-timeout-nan": (["train", "--deadpool-heartbeat-timeout", "nan"],
                                    "deadpool-heartbeat-timeout"),
    "train-heartbeat-interval-nan": (["train", "--deadpool-heartbeat-interval", "nan"],
                                     "deadpool-heartbeat-interval"),
    "train-connect-timeout-inf": (["train", "--deadpool-connect-timeout", "inf"],
                                  "deadpool-connect-timeout"),
    "train-pg-timeout-inf": (["train", "--deadpool-pg-timeout", "inf"], "deadpool-pg-timeout"),
    "train-agree-timeout-nan": (["train", "--deadpool-agree-timeout", "nan"],
                                "deadpool-agree-timeout"),
    "train-abort-timeout-nan": (["train", "--deadpool-abort-timeout", "nan"],
                                "deadpool-abort-timeout"),
    "train-yaml-heartbeat-nan": (["train", "--config", "{d}/nan.yaml"],
                                 "deadpool-heartbeat-timeout"),
    "train-lr-inf": (["train", "--lr", "inf"], "train.lr"),
    "train-yaml-cluster-nan": (["train", "--config", "{d}/cluster-nan.yaml"],
                               "cluster.gpu_memory_gib"),
    "train-iters-zero": (["train", "--iters", "0"], "train.iters"),
    "train-timeout-zero": (["train", "--timeout", "0"], "--timeout"),
    "train-timeout-nan": (["train", "--timeout", "nan"], "--timeout"),
    "train-replicas-zero": (["train", "--deadpool-replicas", "0"], "replicas"),
    "train-respawn-limit-negative": (["train", "--deadpool-respawn-limit", "-1"],
                                     "deadpool-respawn-limit"),
    "train-respawn-window-nan": (["train", "--deadpool-respawn-window", "nan"],
                                 "deadpool-respawn-window"),
    "train-node-agents-without-deadpool": (["train", "--no-deadpool", "--node-agents"],
                                           "--node-agents"),
    "train-save-interval-negative": (["train", "--save", "{d}/ck", "--save-interval", "-1"],
                                     "train.save_interval"),
    "train-coordinator-port": (["train", "--deadpool-coordinator", "localhost:70000"],
                               "deadpool-coordinator"),
    # -- deadpool train: files and folders
    "train-config-directory": (["train", "--config", "{d}"], "config"),
    "train-config-bad-yaml": (["train", "--config", "{d}/bad-syntax.yaml"],
                              "bad-syntax.yaml:3:6"),
    "train-log-dir-unwritable": (["train", "--deadpool-log-dir", "{d}/afile/logs"],
                                 "--deadpool-log-dir"),
    "train-run-dir-unwritable": (["train", "--run-dir", "{d}/afile/run"], "--run-dir"),
    "train-json-log-directory": (["train", "--json-log", "{d}"], "--json-log"),
    "train-metrics-file-directory": (["train", "--deadpool-metrics-file", "{d}"],
                                     "--deadpool-metrics-file"),
    "train-metrics-file-unwritable": (["train", "--deadpool-metrics-file", "{d}/afile/m.prom"],
                                      "--deadpool-metrics-file"),
    "train-save-unwritable": (["train", "--save", "{d}/afile/ckpt", "--save-interval", "1"],
                              "--save"),
    "train-load-missing": (["train", "--load", "{d}/nope"], "--load"),
    "train-load-file": (["train", "--load", "{d}/afile"], "--load"),
    "train-load-bad-tracker": (["train", "--load", "{d}/badckpt"], "--load"),
    "train-load-tracker-without-folder": (["train", "--load", "{d}/nofolder"], "--load"),
    "train-load-bad-manifest": (["train", "--load", "{d}/badsnap"], "--load"),
    # -- deadpool agent (refused before it starts a process or connects)
    "agent-no-command": (["agent", "--world-size", "2", "--node", "0"], "command"),
    "agent-node-negative": (["agent", "--world-size", "2", "--node", "-1", "--", "true"], "--node"),
    "agent-no-ranks-per-node": ([*AGENT, "--", "true"], "deadpool-ranks-per-node"),
    "agent-no-secret": ([*AGENT, "--deadpool-ranks-per-node", "2", "--deadpool-log-dir", "{d}",
                         "--", "true"], "DEADPOOL_JOB_TOKEN"),
    # -- deadpool coordinator
    "coordinator-respawn-limit": ([*COORD, "--deadpool-respawn-limit", "1"],
                                  "deadpool-respawn-limit"),
    "coordinator-metrics-file-unwritable": ([*COORD, "--deadpool-metrics-file",
                                             "{d}/afile/m.prom"], "--deadpool-metrics-file"),
    "coordinator-no-secret": (COORD, "DEADPOOL_JOB_TOKEN"),  # a primary's own matches no worker
    "coordinator-max-wait-negative": ([*COORD, "--max-wait", "-1"], "--max-wait"),
    "coordinator-max-wait-nan": ([*COORD, "--max-wait", "nan"], "--max-wait"),
    "coordinator-world-size-zero": ([*COORD[:1], "--world-size", "0"], "--world-size"),
    "coordinator-heartbeat-nan": ([*COORD, "--deadpool-heartbeat-timeout", "nan"],
                                  "deadpool-heartbeat-timeout"),
    "coordinator-config-bad-yaml": ([*COORD, "--config", "{d}/bad-syntax.yaml"],
                                    "bad-syntax.yaml:3:6"),
    "coordinator-log-dir-unwritable": ([*COORD[:-1], "127.0.0.1:29999", "--deadpool-log-dir",
                                        "{d}/afile/logs"], "--deadpool-log-dir"),
    # -- deadpool plan
    "plan-micro-batch-size-zero": (["plan", "--model", DEMO, "--micro-batch-size", "0"],
                                   "--micro-batch-size"),
    "plan-global-batch-size-zero": (["plan", "--model", DEMO, "--global-batch-size", "0"],
                                    "--global-batch-size"),
    "plan-mfu-nan": (["plan", "--model", DEMO, "--mfu", "nan"], "--mfu"),
    "plan-cluster-inf": (["plan", "--model", DEMO, "--cluster", "{d}/cluster-inf.yaml"],
                         "cluster.nic_gb_s"),
    "plan-model-not-utf8": (["plan", "--model", "{d}/bad-utf8.yaml"], "UTF-8"),
    # -- deadpool chaos
    "chaos-minutes-nan": (["chaos", "--minutes", "nan", "--mtbf-iters", "8"], "--minutes"),
    "chaos-mtbf-nan": ([*CHAOS, "--mtbf-iters", "nan"], "--mtbf-iters"),
    "chaos-episodes-zero": ([*CHAOS, "--episodes", "0"], "--episodes"),
    "chaos-minutes-too-short": (["chaos", "--minutes", "0.05", "--mtbf-iters", "8"],
                                "--minutes"),  # it ran, then said "exceeded its -5s limit"
    "chaos-mtbf-below-one": ([*CHAOS, "--mtbf-iters", "0.5"], "--mtbf-iters"),
    "chaos-heartbeat-interval-nan": ([*CHAOS, "--heartbeat-interval", "nan"],
                                     "--heartbeat-interval"),
    "chaos-heartbeat-nan": ([*CHAOS, "--heartbeat-timeout", "nan"], "heartbeat-timeout"),
    "chaos-run-dir-unwritable": ([*CHAOS, "--run-dir", "{d}/afile/run"], "--run-dir"),
    # -- deadpool megatron-lm (the script: an empty file; nothing runs it)
    "megatron-lm-timeout-nan": ([*MLM[:3], "--timeout", "nan", "{d}/pretrain.py"], "--timeout"),
    "megatron-lm-nproc-zero": (["megatron-lm", "--nproc-per-node", "0", "{d}/pretrain.py"],
                               "--nproc-per-node"),
    "megatron-lm-heartbeat-nan": ([*MLM, "{d}/pretrain.py", "--deadpool",
                                   "--deadpool-heartbeat-timeout", "nan"],
                                  "deadpool-heartbeat-timeout"),
    "megatron-lm-nnodes-two": ([*MLM, "--nnodes", "2", "{d}/pretrain.py"], "--nnodes"),
    "megatron-lm-run-dir-unwritable": ([*MLM, "--run-dir", "{d}/afile/run", "{d}/pretrain.py"],
                                       "--run-dir"),
    "megatron-lm-save-unwritable": ([*MLM, "{d}/pretrain.py", "--save", "{d}/afile/ckpt"],
                                    "--save"),
    # -- deadpool selftest and bench
    "selftest-timeout-nan": (["selftest", "--nproc", "2", "--timeout", "nan"], "--timeout"),
    "bench-overhead-timeout-nan": (["bench", "overhead", "--timeout", "nan"], "--timeout"),
    "bench-overhead-repeats-zero": (["bench", "overhead", "--repeats", "0"], "--repeats"),
    "bench-goodput-failures-zero": (["bench", "goodput", "--failures", "0"], "--failures"),
    "bench-control-plane-steady-nan": (["bench", "control-plane", "--steady", "nan"],
                                       "--steady"),
    "bench-recovery-iters-nan": (["bench", "recovery", "--iters", "nan"], "--iters"),
    "bench-store-state-ranks-zero": (["bench", "store-state", "--ranks", "0"], "--ranks"),
    "selftest-spares-negative": (["selftest", "--spares", "-1"], "--spares"),
    "selftest-nproc-zero": (["selftest", "--nproc", "0"], "--nproc"),
}  # fmt: skip

SUBPROCESS_ROWS: dict[str, tuple[list[str], str]] = {
    "train-config-not-utf8": (["train", "--config", "{d}/bad-utf8.yaml"], "UTF-8"),
    "megatron-lm-replica-device": ([*MLM, "{d}/pretrain.py", "--deadpool",
                                    "--deadpool-replica-device", "tpu"],
                                   "--deadpool-replica-device"),
}  # fmt: skip
"""Rows through the installed command (each pays the interpreter's start)."""


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of bad inputs: files that are not what a flag wants."""
    d = tmp_path_factory.mktemp("bad-input")
    files = {
        "nan.yaml": "deadpool:\n  heartbeat_timeout: .nan\n",
        "cluster-nan.yaml": "cluster:\n  gpu_memory_gib: .nan\n",
        "cluster-inf.yaml": "cluster:\n  nic_gb_s: .inf\n",
        "bad-syntax.yaml": "model:\n  hidden_size: [64\ntrain:\n  iters: 2\n",
        "afile": "not a directory\n",
        "pretrain.py": "",
        "badckpt/latest_checkpointed_iteration.txt": "release\n",
        "nofolder/latest_checkpointed_iteration.txt": "5\n",
        "badsnap/deadpool/iter_0000003/manifest.json": '{"complete": true, "iteration": "x"}',
    }
    for name, text in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    (d / "bad-utf8.yaml").write_bytes(b"model:\n  hidden_size: \xff\xfe64\n")
    return d


def _argv(args: list[str], d: Path, row: str) -> list[str]:
    argv = [a.format(d=d) for a in args]
    if argv[0] == "train" and "--run-dir" not in argv:
        argv += ["--run-dir", str(d / f"run-{row}")]  # where a started worker would log
    return argv


def _check(row: str, rc: int, err: str, expected: str, d: Path) -> None:
    assert "Traceback" not in err, err
    assert rc == 2, f"{row}: exit {rc}\n{err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"{row}: expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("deadpool") and expected in lines[0], lines[0]
    assert not (d / f"run-{row}").exists(), f"{row}: a worker was started"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("row", list(ROWS))
def test_bad_input_is_refused_in_one_line(
    row: str, bad: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args, expected = ROWS[row]
    t0 = time.monotonic()
    rc = call_deadpool(*_argv(args, bad, row))
    seconds = time.monotonic() - t0
    _check(row, rc, capsys.readouterr().err, expected, bad)
    assert seconds < 20, f"{row}: refused only after {seconds:.0f} s"  # no run, no wait


@pytest.fixture(scope="module")
def subprocesses(bad: Path) -> dict[str, subprocess.CompletedProcess]:
    """The subprocess rows, both at once (a row that started a job would pass the timeout)."""

    def run(row: str) -> subprocess.CompletedProcess:
        return run_deadpool(*_argv(SUBPROCESS_ROWS[row][0], bad, row), timeout=60)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(SUBPROCESS_ROWS, pool.map(run, SUBPROCESS_ROWS)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("row", list(SUBPROCESS_ROWS))
def test_bad_input_through_the_installed_command(
    row: str, bad: Path, subprocesses: dict[str, subprocess.CompletedProcess]
) -> None:
    proc = subprocesses[row]
    _check(row, proc.returncode, proc.stderr, SUBPROCESS_ROWS[row][1], bad)


@pytest.mark.parametrize("command", ["train", "megatron-lm"])
def test_a_start_under_torchrun_is_refused_in_one_line(
    command: str, bad: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun restarts every worker when one fails: a launcher started by it says so and what
    to run instead, before it starts anything (torchrun sets TORCHELASTIC_RUN_ID and the like
    in its workers' environment)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    argv = ["train"] if command == "train" else [*MLM, str(bad / "pretrain.py")]
    t0 = time.monotonic()
    rc = call_deadpool(*argv)
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "torchrun" in err and "TORCHELASTIC_RUN_ID" in err and f"deadpool {command}" in err
    assert time.monotonic() - t0 < 20


@pytest.mark.parametrize("command", ["train", "megatron-lm"])
def test_torchs_detail_debug_level_is_refused_before_any_process_starts(
    command: str, bad: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL every spare fails as it builds (each worker would
    refuse it): the launcher refuses it once, in one line, with the fix."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    argv = ["train"] if command == "train" else [*MLM, str(bad / "pretrain.py")]
    rc = call_deadpool(*argv)
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL: " in err and "=INFO or unset it" in err
