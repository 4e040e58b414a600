"""The fork server (`hotswap/launch/forkserver.py`) and the launcher's side of it (`hotswap/launch/warm_start.py`).

A forked child must be what a fresh `python ...` would be: the same exit codes (0, sys.exit(N),
1 for an exception, -N for a signal), argv, sys.path[0], environment, working folder and
output - each compared with a fresh interpreter running the same command -, a session of its
own (killing its group kills its helpers), no descriptor of the server's, default signal
handlers and random state of its own. The server refuses to fork with a second thread, dies
with its launcher, and `close()` leaves no process behind. Most tests use a server that imports
nothing heavy (`json`); one imports torch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from megatron_deadpool.hotswap.coordinator.liveness import kill_groups
from megatron_deadpool.hotswap.launch import forkserver
from megatron_deadpool.hotswap.launch.forkserver import Preload, fork_hazards
from megatron_deadpool.hotswap.launch.warm_start import (
    UNKNOWN_EXIT,
    ForkedProcess,
    ForkRefused,
    ForkServer,
    SharedServers,
    WarmStart,
    command_refusal,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
LIGHT = Preload(("json", "json.tool"))
PY = sys.executable

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("own_servers")]


def _gone(pid: int) -> bool:
    """The process ended (a zombie counts: whoever reaps it, it runs no more)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _run(server: ForkServer, argv: list[str], started: list, **kw: Any) -> tuple[int, str]:
    """Fork `argv`, stdout and stderr into one pipe: (exit code, output)."""
    proc = server.spawn(
        argv,
        env=kw.pop("env", ENV),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )
    started.append(proc)
    out = proc.stdout.read()
    return proc.wait(30), out


def _cold(argv: list[str], **kw: Any) -> tuple[int, str]:
    """The same command in a fresh interpreter."""
    done = subprocess.run(
        argv, env=kw.pop("env", ENV), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=60, check=False, **kw,
    )  # fmt: skip
    return done.returncode, done.stdout


@pytest.mark.parametrize(
    "code",
    [
        "print('hello')",
        "import sys; sys.exit(7)",
        "import sys; sys.exit('a message')",
        "raise ValueError('boom')",
        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
        "raise KeyboardInterrupt",
        "import atexit; atexit.register(print, 'at exit'); print('main')",
        "import threading, time; threading.Thread(target=lambda: (time.sleep(0.3), print('t'))).start()",
    ],
    ids=["ok", "exit7", "exit-message", "exception", "sigkill", "interrupt", "atexit", "thread"],
)
def test_exit_codes_and_output_are_a_fresh_interpreters(server, started, code: str) -> None:
    """0, sys.exit(N), sys.exit(text) -> 1, an exception -> 1 with its traceback (no frame of
    the server), SIGKILL -> -9, KeyboardInterrupt -> -2; atexit handlers run, non-daemon
    threads are joined: as `python -c CODE` does, output included."""
    warm = _run(server, [PY, "-c", code], started)
    assert warm == _cold([PY, "-c", code])
    assert "forkserver" not in warm[1]


def test_argv_path_env_and_cwd_are_a_fresh_interpreters(server, started, tmp_path: Path) -> None:
    """`-m MODULE`, `SCRIPT` and `-c CODE`: sys.argv, sys.path[0], __name__/__file__/__spec__,
    the environment and the working folder, as a fresh interpreter has them."""
    show = textwrap.dedent("""
        import json, os, sys
        spec = globals().get("__spec__")
        print(json.dumps({
            "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
            "file": globals().get("__file__"), "spec": spec and spec.name,
            "env": {k: v for k, v in os.environ.items() if k.startswith("WARM_TEST")},
            "path": sys.path[1:],
        }))
        """)
    (tmp_path / "shown.py").write_text(show)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(ENV, WARM_TEST_A="1", WARM_TEST_B="x y")
    for argv, cwd in (
        ([PY, "-m", "shown", "a", "--b"], tmp_path),
        ([PY, str(tmp_path / "shown.py"), "c"], elsewhere),
        ([PY, "-c", show, "d"], elsewhere),
    ):
        warm = _run(server, argv, started, env=env, cwd=cwd)
        cold = _cold(argv, env=env, cwd=cwd)
        assert warm[0] == cold[0] == 0, warm[1]
        assert json.loads(warm[1]) == json.loads(cold[1])


def test_a_preloaded_module_runs_afresh_under_minus_m(server, started, tmp_path: Path) -> None:
    """`-m json.tool` while the server imported json.tool: it runs as __main__, without
    runpy's warning about a module found in sys.modules."""
    (tmp_path / "in.json").write_text('{"b": 1, "a": [2]}')
    argv = [PY, "-W", "default", "-m", "json.tool", "--sort-keys", str(tmp_path / "in.json")]
    with pytest.raises(ForkRefused):  # interpreter options: only a fresh interpreter has them
        server.spawn(argv, env=ENV)
    assert server.refusal(argv, ENV) is not None
    argv = [PY, "-m", "json.tool", "--sort-keys", str(tmp_path / "in.json")]
    env = dict(ENV, PYTHONWARNINGS="default")  # read at start-up: a server of its own
    assert server.refusal(argv, env) is not None
    loud = ForkServer(LIGHT, env)
    try:
        warm = _run(loud, argv, started, env=env)
    finally:
        loud.close()
    assert warm == _cold(argv, env=env) and '"a": [' in warm[1]


def test_output_to_a_file_and_to_a_text_pipe(server, started, tmp_path: Path) -> None:
    code = "import sys; print('out'); print('err', file=sys.stderr); print('é')"
    with open(tmp_path / "log", "w") as log:
        proc = server.spawn([PY, "-c", code], env=ENV, stdout=log, stderr=subprocess.STDOUT)
    started.append(proc)
    assert proc.wait(30) == 0 and proc.stdout is None
    assert sorted((tmp_path / "log").read_text().splitlines()) == ["err", "out", "é"]
    proc = server.spawn([PY, "-c", code], env=ENV, stdout=subprocess.PIPE, text=True)
    started.append(proc)
    assert list(proc.stdout) == ["out\n", "é\n"] and proc.wait(30) == 0


def test_killing_the_group_kills_the_childs_helpers(server, started) -> None:
    """The child leads a session of its own: `kill_groups` (os.killpg) reaches its helpers."""
    code = "import subprocess, time; print(subprocess.Popen(['sleep', '300']).pid, flush=True); time.sleep(300)"
    proc = server.spawn([PY, "-c", code], env=ENV, stdout=subprocess.PIPE, text=True)
    started.append(proc)
    helper = int(proc.stdout.readline())
    assert os.getsid(proc.pid) == proc.pid and os.getpgid(helper) == proc.pid
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    kill_groups([proc])
    assert proc.returncode == -signal.SIGKILL and _wait_gone(helper)


def test_a_child_holds_no_descriptor_and_no_handler_of_the_server(server, started) -> None:
    code = textwrap.dedent("""
        import os, signal
        fds = []
        for name in os.listdir("/proc/self/fd"):
            try:
                os.fstat(int(name))
            except OSError:
                continue
            fds.append(int(name))
        print(sorted(fds))
        print(signal.getsignal(signal.SIGINT) is signal.default_int_handler,
              signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
              signal.getsignal(signal.SIGPIPE) is signal.SIG_IGN,
              sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))
        """)
    warm = _run(server, [PY, "-c", code], started)
    # What a fresh interpreter started from here has: SIGINT raises KeyboardInterrupt, unless
    # this process ignores it (as a shell's background job does), which a child inherits.
    fresh = subprocess.run(
        [PY, "-c", code], capture_output=True, text=True, env=ENV, timeout=60, check=False
    )
    sigint = "True" if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN else "False"
    assert (fresh.returncode, fresh.stdout) == (0, f"[0, 1, 2]\n{sigint} True True []\n")
    assert warm == (0, fresh.stdout)


def test_a_server_with_a_second_thread_refuses_to_fork(started) -> None:
    """A preloaded module started a thread: the server says so when ready, refuses every fork
    (lasting), and `WarmStart` then starts the process fresh, saying why in one line."""
    threaded = Preload(("forkserver_threads",), path=(str(HERE),))
    srv = ForkServer(threaded, ENV)
    try:
        assert any("2 threads" in hazard for hazard in srv.hazards), srv.hazards
        with pytest.raises(ForkRefused, match="2 threads") as refused:
            srv.spawn([PY, "-c", "pass"], env=ENV)
        assert refused.value.lasting
    finally:
        srv.close()
    lines: list[str] = []
    starter = WarmStart(log=lines.append)
    try:
        for _ in range(2):
            proc = starter.start([PY, "-c", "print('ran')"], ENV, subprocess.PIPE, preload=threaded)
            started.append(proc)
            assert isinstance(proc, subprocess.Popen) and proc.stdout.read() == "ran\n"
            assert proc.wait(30) == 0
        assert len(lines) == 1 and "2 threads" in lines[0] and "fresh" in lines[0], lines
        assert starter.servers[threaded] is None  # retired: closed and reaped
    finally:
        starter.close()


def test_fork_hazards_name_threads_and_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked in this (test) process: a second thread, and torch's CUDA state as initialised."""
    import torch.cuda

    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    try:
        assert any("threads" in h for h in fork_hazards())
    finally:
        stop.set()
        thread.join()
    monkeypatch.setattr(torch.cuda, "_initialized", True)
    assert any("CUDA" in h for h in fork_hazards())


def test_a_request_the_server_cannot_serve_starts_fresh(started) -> None:
    """Another value of a start-up variable (OMP_NUM_THREADS: OpenMP reads it when it loads,
    in the server), another interpreter: a fresh process, one line per reason. Warm start
    off (DEADPOOL_WARM_START=0) or no preload: fresh, silently, and no server at all."""
    lines: list[str] = []
    starter = WarmStart(log=lines.append)
    try:
        for _ in range(2):
            proc = starter.start(
                [PY, "-c", "pass"], dict(ENV, OMP_NUM_THREADS="2"), None, preload=LIGHT,
                server_env=ENV,
            )  # fmt: skip
            started.append(proc)
            assert isinstance(proc, subprocess.Popen) and proc.wait(30) == 0
        assert len(lines) == 1 and "OMP_NUM_THREADS" in lines[0], lines
        proc = starter.start(["/bin/true"], ENV, None, preload=LIGHT)
        started.append(proc)
        assert isinstance(proc, subprocess.Popen) and proc.wait(30) == 0 and len(lines) == 2
        proc = starter.start([PY, "-c", "pass"], ENV, None, preload=LIGHT)
        started.append(proc)
        assert isinstance(proc, ForkedProcess) and proc.wait(30) == 0 and len(lines) == 2
    finally:
        starter.close()
    for off in (WarmStart(enabled=False, log=lines.append), WarmStart(log=lines.append)):
        preload = LIGHT if not off.enabled else None
        proc = off.start([PY, "-c", "pass"], ENV, None, preload=preload)
        started.append(proc)
        assert isinstance(proc, subprocess.Popen) and proc.wait(30) == 0
        assert not off.servers and len(lines) == 2


def test_warm_start_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, enabled, shared in (("0", False, False), ("off", False, False),
                                   ("1", True, False), ("", True, False), ("shared", True, True)):  # fmt: skip
        monkeypatch.setenv("DEADPOOL_WARM_START", value)
        assert WarmStart().enabled is enabled
        assert (WarmStart().shared is not None) is shared
    monkeypatch.delenv("DEADPOOL_WARM_START")
    assert WarmStart().enabled and WarmStart().shared is None


def test_kept_servers_serve_one_launcher_after_another(started) -> None:
    """DEADPOOL_WARM_START=shared: a launcher's server, given back at its `close()`, forks the
    next launcher's processes (no second import); other start-up variables get a server of
    their own; a server found dead is replaced; past the limit the idle one lent longest ago
    ends; a launcher in another thread than the main one has servers of its own."""
    pool = SharedServers(limit=2)
    other_env = dict(ENV, OMP_NUM_THREADS="2")

    def launch(env: dict[str, str] = ENV) -> ForkServer:
        starter = WarmStart(shared=pool)
        proc = starter.start([PY, "-c", "pass"], env, None, preload=LIGHT, server_env=env)
        started.append(proc)
        assert isinstance(proc, ForkedProcess) and proc.wait(30) == 0
        server = starter.servers[LIGHT]
        assert server is not None
        starter.close()
        return server

    try:
        first = launch()
        assert first.alive and pool.holds(first)
        assert launch() is first
        other = launch(other_env)
        assert other is not first and launch() is first
        first.proc.kill()
        first.proc.wait(10)
        replaced = launch()
        assert replaced is not first and replaced.alive
        newest = launch(dict(ENV, OMP_NUM_THREADS="3"))  # a third kind: `other` (idle) ends
        assert not other.alive and replaced.alive and newest.alive
        assert not pool.holds(other)

        in_thread: list[ForkServer] = []
        thread = threading.Thread(target=lambda: in_thread.append(launch()))
        thread.start()
        thread.join(60)
        assert in_thread and in_thread[0] is not replaced and not pool.holds(in_thread[0])
        assert not in_thread[0].alive  # closed with its launcher
    finally:
        pool.close()


def test_children_of_a_dead_server_report_an_unknown_exit(started) -> None:
    """The server is killed while its child runs: the child goes on (as a fresh process whose
    launcher died would), its end is still seen (pidfd) with `UNKNOWN_EXIT`, and the server
    refuses further forks for good."""
    srv = ForkServer(LIGHT, ENV)
    try:
        proc = srv.spawn([PY, "-c", "import time; time.sleep(300)"], env=ENV)
        started.append(proc)
        srv.proc.kill()
        srv.proc.wait(10)
        time.sleep(0.2)
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == UNKNOWN_EXIT
        with pytest.raises(ForkRefused) as refused:
            srv.spawn([PY, "-c", "pass"], env=ENV)
        assert refused.value.lasting
    finally:
        srv.close()


_LAUNCHER = """
import os, sys, threading, time
sys.path.insert(0, {repo!r})
from megatron_deadpool.hotswap.launch.forkserver import Preload
from megatron_deadpool.hotswap.launch.warm_start import ForkServer
kept = []
def start():
    kept.append(ForkServer(Preload(("json",)), dict(os.environ)))
if sys.argv[1] == "thread":  # the starting thread ends: only end of file can stop the server
    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
else:
    start()
print(kept[0].pid, flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("how", ["main", "thread"])
def test_the_server_dies_with_its_launcher(how: str, started: list) -> None:
    """SIGKILL the launcher: its fork server ends too (PR_SET_PDEATHSIG when the main thread
    started it; end of file on its socket in every case), also when the thread that started
    it ended long before."""
    launcher = subprocess.Popen(
        [PY, "-c", _LAUNCHER.format(repo=str(REPO)), how],
        env=ENV, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    started.append(launcher)
    pid = int(launcher.stdout.readline())
    time.sleep(0.5)
    assert not _gone(pid)  # the starting thread's end did not kill it
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(10)
    assert _wait_gone(pid), f"fork server {pid} outlived its launcher"


def test_random_state_descriptors_and_threads_with_torch(started) -> None:
    """With torch imported: one thread in the server (OMP_NUM_THREADS=1 keeps OpenBLAS's pool
    from starting), no CUDA; each child has its own torch, numpy and Python random state (a
    fresh interpreter of torch 2.13 seeds torch from the OS too) and only 0, 1 and 2 open."""
    srv = ForkServer(Preload(("torch", "numpy")), ENV)
    try:
        assert srv.hazards == []
        code = textwrap.dedent("""
            import os, random, numpy, torch
            print(torch.initial_seed(), random.random(), numpy.random.random(),
                  torch.cuda.is_initialized(), torch.get_num_threads(),
                  len(os.listdir("/proc/self/task")))
            """)
        seen = [_run(srv, [PY, "-c", code], started) for _ in range(3)]
        cold = _cold([PY, "-c", code])
        rows = [out.split() for code, out in [*seen, cold] if code == 0]
        assert len(rows) == 4, seen
        for column in range(3):
            assert len({row[column] for row in rows}) == 4, rows  # all different
        assert {tuple(row[3:]) for row in rows} == {("False", "1", "1")}
    finally:
        srv.close()


def test_script_imports_are_the_top_level_ones(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent("""
            import os, json.decoder
            from collections import abc, OrderedDict
            from . import nothing
            try:
                import csv
            except ImportError:
                pass
            def f():
                import sqlite3
            if __name__ == "__main__":
                import zipfile
            """))
    assert forkserver.script_imports(str(script)) == [
        "os", "json.decoder", "collections", "collections.abc", "collections.OrderedDict", "csv",
    ]  # fmt: skip


def test_local_job_forks_and_close_leaves_nothing(tmp_path: Path, started: list) -> None:
    """`LocalJob.spawn` with a preload forks from the job's server (its output in the run
    folder); `close` kills the processes' groups, then ends and reaps the server."""
    from megatron_deadpool.config.deadpool import DeadpoolConfig
    from megatron_deadpool.hotswap.launch.local_job import LocalJob

    job = LocalJob(DeadpoolConfig(enabled=False), world_size=2, token="t", run_dir=tmp_path)
    try:
        for member in job.members:
            with open(tmp_path / f"{member}.log", "w") as log:
                code = (
                    "import os, time; print(os.environ['LOCAL_RANK'], flush=True); time.sleep(300)"
                )
                job.spawn(member, [PY, "-c", code], dict(ENV, RANK="9"), log, preload=LIGHT)
        procs = list(job.procs.values())
        started.extend(procs)
        assert all(isinstance(p, ForkedProcess) for p in procs)
        server = job.starter.servers[LIGHT]
        assert server is not None
        with open(f"/proc/{server.pid}/environ", "rb") as environ:
            names = {item.split(b"=", 1)[0] for item in environ.read().split(b"\0")}
        assert b"RANK" not in names and b"LOCAL_RANK" not in names  # per process, not per job
    finally:
        job.close(grace_s=0)
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2
    assert server.proc.returncode is not None and all(_gone(p.pid) for p in procs)
    assert [(tmp_path / f"{m}.log").read_text() for m in job.members] == ["0\n", "1\n"]
    assert (tmp_path / "forkserver.log").exists()


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_on_a_gpu_the_server_stays_clear_of_cuda_and_children_use_it(started) -> None:
    """With CUDA present: importing torch and megatron-core in the server initialises no CUDA
    (no hazard: forks are allowed), and a forked child initialises CUDA and computes on it."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    srv = ForkServer(Preload(("megatron_deadpool.embedded.job",)), ENV)
    try:
        assert srv.hazards == []
        code = "import torch; print((torch.ones(4, device='cuda') * 2).sum().item())"
        assert _run(srv, [PY, "-c", code], started) == (0, "8.0\n")
    finally:
        srv.close()


def test_another_name_of_the_interpreter_is_the_same_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A virtual environment's `python` and `python3` (one links to the other), or the bare
    name a Slurm script runs (`python`, found on PATH), fork from a server running either; an
    interpreter elsewhere does not."""
    venv, other = tmp_path / "venv" / "bin", tmp_path / "other"
    venv.mkdir(parents=True)
    other.mkdir()
    (venv / "python3").symlink_to(sys.executable)
    (venv / "python").symlink_to("python3")
    (other / "python").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", str(venv))
    python3 = str(venv / "python3")
    for command in (str(venv / "python"), python3, "python"):
        assert command_refusal([command, "-m", "x"], python3) is None, command
    assert command_refusal([str(other / "python"), "-m", "x"], python3) is not None
    assert command_refusal(["no-such-python", "-m", "x"], python3) is not None
