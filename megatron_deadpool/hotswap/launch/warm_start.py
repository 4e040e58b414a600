"""Warm start: a launcher's way to start its processes, forked from a pre-imported interpreter.

`WarmStart.start(argv, env, output, preload=...)` returns a running process of `python ...`,
handled like a `subprocess.Popen` (`pid`, `poll()`, `wait()`, `stdout` for a pipe, killed by
its process group as `hotswap.coordinator.liveness` does): forked by a `ForkServer` that imported
`preload`'s modules once (`hotswap.launch.forkserver`; started on first use, one per `Preload`), or
started as a fresh interpreter - when warm start is off (DEADPOOL_WARM_START=0 in the launcher's
environment), not asked for (no `preload`), or not possible, which one line to `log` says,
once per reason: the server could not start or refuses to fork (threads, CUDA: see
`hotswap.launch.forkserver`), the command is not `python -m|-c|SCRIPT` of the server's interpreter,
or it needs another value of a variable read at start-up (`forkserver.STARTUP_ENV`).

The server is the parent of the processes it forks; a reader thread here takes its reports
(spawned, refused, exited with code N). Should the server itself die, a process it forked that
ends afterwards reports `UNKNOWN_EXIT` (its pidfd, passed along, still tells when it ends).
`close()` ends the servers (they never outlive the launcher: end of file on their socket, and
SIGKILL when the launcher's thread that started them ends); the processes are the caller's to
end, as with Popen. With DEADPOOL_WARM_START=shared, `close()` gives the servers back to this
process's `SharedServers` instead, for the next launcher of the same process (a test session, a
notebook's jobs: torch and Megatron imported once per kind of process, not once per job;
`deadpool bench` turns it off).
"""

from __future__ import annotations

import contextlib
import io
import locale
import logging
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from ...devices.threads import start_thread
from .forkserver import Preload, receive, send, startup_env

WARM_START_ENV = "DEADPOOL_WARM_START"
"""0 in the launcher's environment: every process starts as a fresh interpreter; `shared`: fork
servers outlive the launcher that started them and serve every later launcher of this process
(`SharedServers`: a test session, a notebook that runs many jobs)."""
SHARED = "shared"
UNKNOWN_EXIT = 255
"""The exit code of a forked process that ended after its fork server died."""
EXIT_CODE_S = 1.0
"""Longest wait for the exit code of a process whose pidfd says it ended (`exit_fd`: a forked
one's comes from its fork server, which reaps it; the code is then read at a later look)."""
SERVER_MODULE = "megatron_deadpool.hotswap.launch.forkserver"

_log = logging.getLogger(__name__)
Output = IO[Any] | int | None


def warm_start_enabled(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(WARM_START_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def warm_start_shared(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(WARM_START_ENV, "").strip().lower() == SHARED


class ForkServerError(RuntimeError):
    """The fork server cannot be started or used any more."""


class ForkRefused(ForkServerError):
    """The fork server refused a request; `lasting`: it will refuse every later one too."""

    def __init__(self, why: str, *, lasting: bool) -> None:
        super().__init__(why)
        self.lasting = lasting


class ForkedProcess:
    """A process forked by a `ForkServer`, handled like the `subprocess.Popen` of a fresh one."""

    def __init__(
        self, server: ForkServer, rid: int, pid: int, args: Sequence[str], stdout: IO[Any] | None
    ) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = stdout
        self._server = server
        self._id = rid

    # Safe from two threads (a launcher's loop polls while its `ExitWatch` waits): the server
    # keeps each exit code, and a None never overwrites a code another thread read.
    def poll(self) -> int | None:
        self._read_code(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read_code(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def _read_code(self, timeout: float | None) -> None:
        if self.returncode is None:
            code = self._server.exit_code(self._id, timeout=timeout)
            if code is not None:
                self.returncode = code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self._server.signal(self._id, sig)

    def exit_fd(self) -> int | None:
        """A pidfd of the process (a copy the caller closes), readable once it ended; None once
        its exit was read (`poll`)."""
        return self._server.exit_fd(self._id)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"<ForkedProcess: returncode: {self.returncode} args: {self.args!r}>"


class ForkServer:
    """The launcher's side of one fork server: starts it (`python -m ...forkserver`), waits
    until it imported `preload`, then forks processes on request (`spawn`)."""

    def __init__(
        self,
        preload: Preload,
        env: Mapping[str, str],
        *,
        python: str = sys.executable,
        log_path: Path | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        """Start the server with environment `env` and wait (at most `timeout_s`) until it is
        ready; `ForkServerError` if it fails. Its own output goes to `log_path` (appended), else
        to this process's stderr."""
        self.preload = preload
        self.python = python
        self.startup = startup_env(env)
        self._lock = threading.Lock()  # one request at a time
        self._cond = threading.Condition()
        self._replies: queue.Queue[tuple[dict[str, Any] | None, list[int]]] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._pidfds: dict[int, int] = {}
        self._next_id = 0
        self._alive = True
        self._reader: threading.Thread | None = None
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [python, "-m", SERVER_MODULE, "--fd", str(theirs.fileno())]
        argv += ["--parent", str(os.getpid())]
        if threading.current_thread() is threading.main_thread():
            argv.append("--die-with-parent")  # PR_SET_PDEATHSIG follows the starting thread
        try:
            with open(log_path, "ab") if log_path else contextlib.nullcontext() as out:
                self.proc = subprocess.Popen(
                    argv,
                    env=dict(env),
                    stdin=subprocess.DEVNULL,
                    stdout=out or subprocess.DEVNULL,
                    stderr=out,
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True,  # a Ctrl-C meant for the launcher is the launcher's
                )
        except OSError:
            self.sock.close()
            raise
        finally:
            theirs.close()
        self._ready(timeout_s, log_path)

    def _ready(self, timeout_s: float, log_path: Path | None) -> None:
        where = f"; its output: {log_path}" if log_path else ""
        try:
            send(self.sock, {"op": "preload", **_as_message(self.preload)})
            self.sock.settimeout(timeout_s)
            message, _ = receive(self.sock, max_fds=0)
            self.sock.settimeout(None)
        except OSError as exc:
            self.close()
            raise ForkServerError(f"fork server did not start: {exc}{where}") from None
        if message is None or message.get("op") != "ready":
            self.close()
            why = (message or {}).get("error") or f"exited with code {self.proc.poll()}"
            raise ForkServerError(f"fork server failed to import: {why}{where}")
        self.pid: int = message["pid"]
        self.hazards: list[str] = message["hazards"]
        self.import_s: float = message["seconds"]
        self._reader = start_thread(self._read, name="forkserver-reader")

    @property
    def alive(self) -> bool:
        """The server still runs and answers (as far as its reader knows)."""
        with self._cond:
            return self._alive and self.proc.poll() is None

    # ------------------------------------------------------------------ requests
    def refusal(self, argv: Sequence[str], env: Mapping[str, str]) -> str | None:
        """Why `argv` with `env` cannot be forked from this server (None: it can)."""
        why = command_refusal(argv, self.python)
        if why is not None:
            return why
        wanted = startup_env(env)
        if wanted != self.startup:
            differ = wanted.keys() | self.startup.keys()
            keys = sorted(k for k in differ if wanted.get(k) != self.startup.get(k))
            return f"start-up variables differ from the fork server's: {', '.join(keys)}"
        return None

    def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        stdout: Output = None,
        stderr: Output = None,
        cwd: str | os.PathLike[str] | None = None,
        text: bool = False,
    ) -> ForkedProcess:
        """Fork `argv` (see `refusal`) with `env`, in `cwd` (default: ours), stdin ours, and
        stdout/stderr as for Popen: a file, a descriptor, None (ours), `subprocess.DEVNULL`,
        `subprocess.PIPE` (stdout only: read `.stdout`, text lines with `text`) or
        `subprocess.STDOUT` (stderr only). `ForkRefused` if the server will not fork it."""
        why = self.refusal(argv, env)
        if why is not None:
            raise ForkRefused(why, lasting=False)
        with contextlib.ExitStack() as temporary:
            out, reader = _descriptor(stdout, 1, temporary, text)
            err = out if stderr == subprocess.STDOUT else _descriptor(stderr, 2, temporary)[0]
            stdin = 0 if _is_open(0) else _descriptor(subprocess.DEVNULL, 0, temporary)[0]
            request = {
                "op": "spawn",
                "argv": list(argv),
                "env": dict(env),
                "cwd": os.fspath(cwd if cwd is not None else os.getcwd()),
            }
            try:
                message, fds = self._request(request, [stdin, out, err])
            except BaseException:
                if reader is not None:
                    reader.close()
                raise
        if message["op"] != "spawned":
            if reader is not None:
                reader.close()
            raise ForkRefused(message.get("error", "?"), lasting=message.get("lasting", True))
        rid = message["id"]
        with self._cond:
            self._pidfds[rid] = fds[0]
        return ForkedProcess(self, rid, message["pid"], argv, reader)

    def _request(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        with self._lock:
            if not self._alive:
                raise ForkRefused("the fork server is gone", lasting=True)
            self._next_id += 1
            request["id"] = self._next_id
            try:
                send(self.sock, request, fds)
            except ValueError as exc:  # too large a message: this request only
                raise ForkRefused(str(exc), lasting=False) from None
            except OSError as exc:
                raise ForkRefused(f"the fork server is gone ({exc})", lasting=True) from None
            try:
                message, got = self._replies.get(timeout=60.0)
            except queue.Empty:
                raise ForkRefused("the fork server did not answer in 60 s", lasting=True) from None
        if message is None:
            raise ForkRefused(f"the fork server exited ({self.proc.poll()})", lasting=True)
        return message, got

    def _read(self) -> None:
        """The reader thread: replies to the waiting `spawn`, exit codes to `exit_code`."""
        try:
            while True:
                message, fds = receive(self.sock, max_fds=1)
                if message is None:
                    break
                if message.get("op") == "exited":
                    with self._cond:
                        self._exits[message["id"]] = message["code"]
                        self._cond.notify_all()
                else:
                    self._replies.put((message, fds))
        except OSError:
            pass
        finally:
            with self._cond:
                self._alive = False
                self._cond.notify_all()
            self._replies.put((None, []))

    # ------------------------------------------------------------------ the processes
    def exit_code(self, rid: int, timeout: float | None) -> int | None:
        """Process `rid`'s exit code once it ended (waiting up to `timeout`, None: forever)."""
        with self._cond:
            self._cond.wait_for(lambda: rid in self._exits or not self._alive, timeout)
            if rid in self._exits:  # kept: another thread may ask again (`ExitWatch`)
                self._forget(rid)
                return self._exits[rid]
            if self._alive:
                return None  # not yet ended, or ended and not yet reported
            pidfd = self._pidfds.get(rid)
        if pidfd is None:
            return UNKNOWN_EXIT
        # The server is gone: the pidfd still tells whether the process ended, not how. (poll,
        # not select: a launcher of a large job has descriptors beyond select's 1,024.)
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        if poller.poll(None if timeout is None else timeout * 1e3):
            with self._cond:
                self._forget(rid)
            return UNKNOWN_EXIT
        return None

    def exit_fd(self, rid: int) -> int | None:
        """A copy of process `rid`'s pidfd (the caller closes it); None once its exit was read."""
        with self._cond:
            pidfd = self._pidfds.get(rid)
            return None if pidfd is None else os.dup(pidfd)

    def signal(self, rid: int, sig: int) -> None:
        with self._cond:
            pidfd = self._pidfds.get(rid)
        if pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, sig)

    def _forget(self, rid: int) -> None:
        pidfd = self._pidfds.pop(rid, None)
        if pidfd is not None:
            os.close(pidfd)

    def close(self, timeout_s: float = 10.0) -> None:
        """End the server (its processes are left alone) and reap it."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # end of file for both the server and the reader
        if self._reader is not None:
            self._reader.join(timeout_s)
        self.sock.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with self._cond:
            for rid in list(self._pidfds):
                self._forget(rid)


def command_refusal(argv: Sequence[str], python: str) -> str | None:
    """Why `argv` is not a command a fork server running `python` can fork (None: it is):
    `python -m MODULE ...`, `python -c CODE ...` or `python SCRIPT ...`, no interpreter option."""
    if not argv or not same_interpreter(argv[0], python):
        return f"{argv[0] if argv else 'an empty command'} is not {python}"
    if len(argv) < 2 or (argv[1].startswith("-") and argv[1] not in ("-m", "-c")):
        return "only `python -m MODULE`, `python -c CODE` and `python SCRIPT` are forked"
    if argv[1] in ("-m", "-c") and len(argv) < 3:
        return f"{argv[1]} without its argument"
    return None


def same_interpreter(command: str, python: str) -> bool:
    """Whether `command` (a path, or a name looked up on PATH as a shell would: `python` in a
    Slurm script) runs the interpreter `python` is: the same file, or another name for it in
    the same folder (a virtual environment's `python` and `python3`)."""
    found = shutil.which(command) if os.sep not in command else command
    if found is None:
        return False
    a, b = os.path.abspath(found), os.path.abspath(python)
    return a == b or (
        os.path.dirname(a) == os.path.dirname(b) and os.path.realpath(a) == os.path.realpath(b)
    )


def exit_fd(proc: ForkedProcess | subprocess.Popen) -> int | None:
    """A descriptor that becomes readable when `proc` (started by `WarmStart.start`) ends - a
    pidfd, the caller's to close - so that a launcher can wait for any of its processes to end
    (`select.poll`) instead of polling them; None where there is none (the process is gone)."""
    if isinstance(proc, ForkedProcess):
        return proc.exit_fd()
    if proc.returncode is not None:
        return None
    try:  # our child, not reaped yet (returncode unset): its pid is still its own
        return os.pidfd_open(proc.pid)
    except OSError:  # gone, or a kernel before 5.3 (no pidfds): its exit is found by polling
        return None


def _cold(
    argv: Sequence[str], env: Mapping[str, str], output: Output, cwd: str | os.PathLike[str] | None
) -> subprocess.Popen:
    """A fresh interpreter, as the launchers started every process before warm start."""
    text = output == subprocess.PIPE  # lines as they come, as the launchers read them
    return subprocess.Popen(
        list(argv),
        stdout=output,
        stderr=subprocess.STDOUT,
        env=dict(env),
        cwd=cwd,
        start_new_session=True,
        text=text,
        bufsize=1 if text else -1,
    )


def _as_message(preload: Preload) -> dict[str, Any]:
    return {
        "modules": list(preload.modules),
        "path": list(preload.path),
        "scripts": list(preload.scripts),
    }


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _descriptor(
    spec: Output, default: int, temporary: contextlib.ExitStack, text: bool = False
) -> tuple[int, IO[Any] | None]:
    """The descriptor to hand over for a Popen-style stream argument (closed by `temporary`
    where this function opened it), and for `subprocess.PIPE` the launcher's reading end."""
    if spec is None:
        return default, None
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        temporary.callback(os.close, fd)
        return fd, None
    if spec == subprocess.PIPE:
        read, write = os.pipe()
        temporary.callback(os.close, write)
        raw = open(read, "rb")  # noqa: SIM115 - the caller's, as Popen.stdout
        if not text:
            return write, raw
        encoding = locale.getpreferredencoding(False)
        return write, io.TextIOWrapper(raw, encoding=encoding, line_buffering=True)
    if isinstance(spec, int):
        if spec < 0:
            raise ValueError(f"unsupported stream argument {spec}")
        return spec, None
    return spec.fileno(), None


class SharedServers:
    """Fork servers kept for the life of this process and lent to every `WarmStart` that asks for
    the same `Preload` with the same start-up variables (DEADPOOL_WARM_START=shared): a process
    that runs many jobs one after another (a test session, a notebook) imports torch and Megatron
    once per kind of process instead of once per job.

    Only a server started from the main thread is kept: a server dies with the thread that
    started it (`--die-with-parent`), and the main thread lives as long as this process. A server
    found dead is replaced. At most `limit` servers are kept, each holding its imports' memory:
    past that, the one lent longest ago that no launcher holds is ended."""

    def __init__(self, limit: int = 4) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._servers: dict[tuple[Preload, tuple[tuple[str, str], ...]], ForkServer] = {}
        self._users: dict[ForkServer, int] = {}

    def acquire(
        self, preload: Preload, env: Mapping[str, str], make: Callable[[], ForkServer]
    ) -> ForkServer:
        """The kept server for `preload` and `env`'s start-up variables, or a new one from
        `make()` (whose errors pass through); the caller holds it until `release`."""
        key = (preload, tuple(sorted(startup_env(env).items())))
        with self._lock:
            server = self._servers.pop(key, None)
            if server is not None and not server.alive:
                self._users.pop(server, None)
                server.close()
                server = None
            if server is None:
                server = make()
            self._servers[key] = server  # the most recently lent last
            self._users[server] = self._users.get(server, 0) + 1
            idle = [k for k, s in self._servers.items() if not self._users.get(s)]
            for old in idle[: max(0, len(self._servers) - self.limit)]:
                ended = self._servers.pop(old)
                self._users.pop(ended, None)
                ended.close()
            return server

    def holds(self, server: ForkServer) -> bool:
        with self._lock:
            return server in self._users

    def release(self, server: ForkServer) -> None:
        """One holder of `server` is done with it (it stays, for the next)."""
        with self._lock:
            if self._users.get(server):
                self._users[server] -= 1

    def close(self) -> None:
        """End every kept server (at this process's end they end by themselves)."""
        with self._lock:
            servers, self._servers, self._users = list(self._servers.values()), {}, {}
        for server in servers:
            server.close()

    def discard(self, server: ForkServer) -> None:
        """End `server` and forget it (it refuses to fork)."""
        with self._lock:
            self._users.pop(server, None)
            for key in [k for k, s in self._servers.items() if s is server]:
                del self._servers[key]
        server.close()


SHARED_SERVERS = SharedServers()
"""This process's kept fork servers (DEADPOOL_WARM_START=shared)."""


class WarmStart:
    """Starts a launcher's processes: forked from a fork server for their `Preload` when it can,
    as fresh interpreters otherwise (see the module docstring)."""

    def __init__(
        self,
        *,
        log: Callable[[str], None] | None = None,
        log_dir: Path | None = None,
        enabled: bool | None = None,
        shared: SharedServers | None = None,
    ) -> None:
        """`log`: where the one line per reason for a fresh start goes (default: this module's
        logger); `log_dir`: where the servers write their own output (forkserver*.log; a kept
        server's goes where the launcher that started it said); `enabled` None: unless
        DEADPOOL_WARM_START=0; `shared`: where to borrow servers from (default:
        `SHARED_SERVERS` with DEADPOOL_WARM_START=shared, else none: servers of its own)."""
        self.enabled = warm_start_enabled() if enabled is None else enabled
        self.shared = shared or (SHARED_SERVERS if warm_start_shared() else None)
        self.log = log or _log.warning
        self.log_dir = log_dir
        self.servers: dict[Preload, ForkServer | None] = {}
        self._said: set[str] = set()

    def start(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        output: Output,
        *,
        preload: Preload | None = None,
        cwd: str | os.PathLike[str] | None = None,
        server_env: Mapping[str, str] | None = None,
    ) -> ForkedProcess | subprocess.Popen:
        """Start `argv` with `env` in a session of its own, stdout and stderr to `output` (a
        file, or `subprocess.PIPE`: text lines on `.stdout`). With `preload`, fork it from that
        preload's server, which starts (with `server_env`, default `env`) on first use."""
        if preload is None or not self.enabled:
            return _cold(argv, env, output, cwd)
        why = command_refusal(argv, sys.executable)
        server = self._server(preload, server_env or env) if why is None else None
        if server is not None:
            why = server.refusal(argv, env)
            if why is None:
                try:
                    return server.spawn(
                        argv,
                        env=env,
                        stdout=output,
                        stderr=subprocess.STDOUT,
                        cwd=cwd,
                        text=output == subprocess.PIPE,
                    )
                except ForkRefused as exc:
                    why = None if exc.lasting else f"the fork server refused: {exc}"
                    if exc.lasting:
                        self._retire(preload, f"the fork server refused to fork: {exc}")
        if why is not None:
            self._say(f"warm start: {why}; starting a fresh interpreter")
        return _cold(argv, env, output, cwd)

    def _server(self, preload: Preload, env: Mapping[str, str]) -> ForkServer | None:
        if preload not in self.servers:
            log_path = None
            if self.log_dir is not None:
                suffix = f"-{len(self.servers)}" if self.servers else ""
                log_path = self.log_dir / f"forkserver{suffix}.log"
            try:
                self.servers[preload] = self._new_server(preload, env, log_path)
            except (ForkServerError, OSError) as exc:
                self.servers[preload] = None
                self._say(f"warm start off: {exc}; processes start as fresh interpreters")
        return self.servers[preload]

    def _new_server(
        self, preload: Preload, env: Mapping[str, str], log_path: Path | None
    ) -> ForkServer:
        def make() -> ForkServer:
            return ForkServer(preload, env, log_path=log_path)

        if self.shared is None or threading.current_thread() is not threading.main_thread():
            return make()
        return self.shared.acquire(preload, env, make)

    def _end(self, server: ForkServer) -> None:
        if self.shared is not None and self.shared.holds(server):
            self.shared.discard(server)
        else:
            server.close()

    def _retire(self, preload: Preload, why: str) -> None:
        server = self.servers.get(preload)
        if server is not None:
            self.servers[preload] = None
            self._end(server)
            self._say(f"warm start off: {why}; processes start as fresh interpreters")

    def _say(self, line: str) -> None:
        if line not in self._said:
            self._said.add(line)
            self.log(line)

    def close(self) -> None:
        """End every fork server (not the processes they forked); a kept one is given back."""
        for preload, server in list(self.servers.items()):
            if server is not None and self.shared is not None and self.shared.holds(server):
                self.shared.release(server)
            elif server is not None:
                server.close()
            self.servers[preload] = None
