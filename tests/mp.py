"""A small multi-process harness: run one function in N processes joined in a gloo world.

    results = run_world("test_replication:_replication_rank", 4, kwargs={"tp": 2}, timeout=150)

The test process hosts a loopback `TCPStore(port=0)`; each child (`sys.executable -c ...`, its
own session so its whole process group can be killed) is forked from the test session's fork
server, which imported torch, megatron-core and DeadPool's modules once (`WARM`,
`hotswap.launch.warm_start`; DEADPOOL_WARM_START=0: fresh interpreters). It connects to the store,
selects the CPU development mode (`select_device("cpu")`), sets one torch thread, joins a
gloo default group of `world_size` ranks and calls `target(rank=..., world_size=..., store=...,
**kwargs)`. The target returns JSON-serialisable data; it travels back through the store as
JSON (nothing is ever unpickled). A child that raises reports its traceback the same way.

`run_world` returns the per-rank results in rank order, or raises `WorldError` (an
`AssertionError`) with every failing rank's traceback and log tail when a rank fails, exits
without a result, or the hard timeout passes. In every case all children's process groups are
SIGKILLed in a `finally` before it returns; should the test process itself be killed, a
watchdog thread in every child ends it within a second (the fork server dies with the test
process; its children see their parent change).

One fork server serves the whole test session (started by the first `run_world`, ended at
exit), not one per `run_world` call, which would pay the server's imports (torch,
megatron-core: several CPU-seconds) once per call; tests/replication/test_replication.py took
74 s warm against 159 s with fresh interpreters (2 cores, shared with other jobs). With fresh
interpreters on a loaded machine a child may still be importing when a short run limit passes
(test_harness_reports_failures_and_kills_every_child[hang], 25 s).
"""

from __future__ import annotations

import atexit
import datetime
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from megatron_deadpool.hotswap.launch.forkserver import Preload
from megatron_deadpool.hotswap.launch.warm_start import WarmStart

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
_RESULT = "mp/result/{rank}"
_BOOT = "import sys; sys.path.insert(0, {tests!r}); import mp; mp._child_main()"
PRELOAD = Preload(
    (
        "pytest",
        "torch.distributed",
        "megatron_deadpool.embedded.job",
        "megatron_deadpool.embedded.checkpoint",
        "megatron_deadpool.devices.abort",
        "megatron_deadpool.devices.memory",
        "megatron_deadpool.devices.p2p",
        "megatron_deadpool.replication.replicator",
        "megatron_deadpool.replication.shard_exchange",
    )
)
"""What the children's targets import (the test modules under tests/ that use `run_world`)."""
WARM = WarmStart(log=lambda line: print(f"tests/mp.py: {line}", file=sys.stderr, flush=True))
"""The children's starter: one fork server for the test session (ended at exit)."""
atexit.register(WARM.close)


class WorldError(AssertionError):
    """A multi-process run failed: a rank raised, died, or the run timed out. `pids`: the
    ranks' processes (all killed by the time it is raised)."""

    pids: tuple[int, ...] = ()


def run_world(
    target: str,
    world_size: int,
    *,
    kwargs: dict[str, Any] | None = None,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    keep_logs_on_failure: bool = True,
    optional: tuple[int, ...] = (),
) -> list[Any]:
    """Run `target` ("module:function", a test module anywhere under tests/) on `world_size`
    ranks.

    The children's logs are removed after a success, and kept (their path is in the error)
    after a failure unless `keep_logs_on_failure` is False (tests of failures themselves).
    Ranks in `optional` (e.g. one that stops itself with SIGSTOP) are not waited for: their
    result is None, and they are killed with the others at the end.
    """
    import torch.distributed as dist

    from megatron_deadpool.hotswap.coordinator.liveness import kill_groups

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    log_dir = Path(tempfile.mkdtemp(prefix="deadpool-mp-"))
    child_env = dict(os.environ)
    child_env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONWARNINGS="ignore",
        MP_PORT=str(store.port),
        MP_WORLD=str(world_size),
        MP_TARGET=target,
        MP_PATH=str(_module_dir(target.partition(":")[0])),
        MP_KWARGS=json.dumps(kwargs or {}),
        MP_TIMEOUT=str(timeout),
        MP_PARENT=str(os.getpid()),
        **(env or {}),
    )
    server_env = {k: v for k, v in child_env.items() if not k.startswith("MP_")}
    procs: list[Any] = []  # subprocess.Popen, or its kind for a forked child
    failed = False
    try:
        for rank in range(world_size):
            with open(log_dir / f"rank{rank}.log", "w") as log:
                procs.append(
                    WARM.start(
                        [sys.executable, "-c", _BOOT.format(tests=str(TESTS_DIR))],
                        {**child_env, "MP_RANK": str(rank)},
                        log,
                        preload=PRELOAD,
                        cwd=str(REPO_ROOT),
                        server_env=server_env,
                    )
                )
        results = _collect(store, procs, timeout, log_dir, set(optional))
    except BaseException as exc:
        failed = True
        if isinstance(exc, WorldError):
            exc.pids = tuple(proc.pid for proc in procs)
        raise
    finally:
        kill_groups(procs)  # whole groups: helpers (checkpoint writers) linger
        if not failed or not keep_logs_on_failure:
            shutil.rmtree(log_dir, ignore_errors=True)
    return results


def _module_dir(module: str) -> Path:
    """The folder under tests/ that holds `module`.py (test files have unique names)."""
    found = sorted(TESTS_DIR.rglob(f"{module}.py"))
    if len(found) != 1:
        raise WorldError(f"{module}.py: expected one such file under {TESTS_DIR}, found {found}")
    return found[0].parent


def _collect(
    store: Any, procs: list[subprocess.Popen], timeout: float, log_dir: Path, optional: set[int]
) -> list:
    world_size = len(procs)
    required = set(range(world_size)) - optional
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    while not required <= set(results):
        if _problems(store, procs, results, optional):
            # One rank's failure makes its peers' collectives fail too: give them a moment to
            # report, then show every rank's story (the root cause is usually the first one).
            time.sleep(1.0)
            raise WorldError(_describe(_problems(store, procs, results, optional), log_dir))
        if time.monotonic() > deadline:
            missing = sorted(required - set(results))
            what = f"timed out after {timeout:.0f}s; no result from ranks {missing}"
            raise WorldError(_describe([what], log_dir))
        time.sleep(0.05)
    # Every rank reported; give them a moment to leave their final barrier, then kill.
    end = time.monotonic() + 10
    while time.monotonic() < end and any(procs[r].poll() is None for r in required):
        time.sleep(0.05)
    return [results.get(r) for r in range(world_size)]


def _problems(
    store: Any, procs: list[subprocess.Popen], results: dict[int, Any], optional: set[int]
) -> list[str]:
    """Collect new results into `results`; describe ranks that failed (tracebacks first)."""
    raised, died = [], []
    for rank, proc in enumerate(procs):
        if rank in results or rank in optional:
            continue
        key = _RESULT.format(rank=rank)
        exited = proc.poll() is not None
        if store.check([key]):
            report = json.loads(store.get(key))
            if report["ok"]:
                results[rank] = report["value"]
            else:
                raised.append(f"rank {rank} raised:\n{report['error'].rstrip()}")
        elif exited:
            died.append(f"rank {rank} exited with code {proc.returncode} without a result")
    return raised + died


def _describe(problems: list[str], log_dir: Path, lines: int = 25) -> str:
    parts = list(problems)
    for log in sorted(log_dir.glob("rank*.log")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log.name} (last {lines} lines; logs kept in {log_dir})")
        parts.extend(text)
    return "\n".join(parts)


# ---------------------------------------------------------------------- child side
def _child_main() -> None:
    """Entry point of one child process (see module docstring)."""
    rank = int(os.environ["MP_RANK"])
    world_size = int(os.environ["MP_WORLD"])
    timeout = float(os.environ["MP_TIMEOUT"])
    sys.path[:0] = [os.environ["MP_PATH"], str(TESTS_DIR)]
    _start_watchdog(int(os.environ["MP_PARENT"]), limit_s=timeout + 30.0)
    import torch
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1",
        int(os.environ["MP_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    key = _RESULT.format(rank=rank)
    try:
        torch.set_num_threads(1)
        from megatron_deadpool.devices import select_device

        select_device("cpu")
        dist.init_process_group(
            backend="gloo",
            store=dist.PrefixStore("mp/world", store),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        module_name, _, func_name = os.environ["MP_TARGET"].partition(":")
        func = getattr(importlib.import_module(module_name), func_name)
        value = func(
            rank=rank,
            world_size=world_size,
            store=dist.PrefixStore("mp/user", store),
            **json.loads(os.environ["MP_KWARGS"]),
        )
        store.set(key, json.dumps({"ok": True, "value": value}))
        if dist.is_initialized():  # a target that aborted its groups has none left
            dist.barrier()  # nobody leaves while a peer may still read from it
    except BaseException:  # noqa: BLE001 - report everything, the parent decides
        store.set(key, json.dumps({"ok": False, "error": traceback.format_exc()}))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (gloo threads, atexit hooks)


def _start_watchdog(test_process: int, limit_s: float) -> None:
    """Exit when the test process is gone (even SIGKILLed) or the run is far past its limit.

    The parent is the test process, or the fork server, which dies with the test process:
    either way the parent changes (or the test process was gone before we looked)."""
    import threading

    deadline = time.monotonic() + limit_s
    parent = os.getppid()

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    def watch() -> None:
        while True:
            if os.getppid() != parent or gone(test_process) or time.monotonic() > deadline:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, name="mp-watchdog", daemon=True).start()
