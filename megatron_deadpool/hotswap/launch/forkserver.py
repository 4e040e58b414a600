"""The fork server: one interpreter imports the heavy modules once and forks workers from there.

A fresh worker process spends seconds of CPU importing torch and Megatron before it runs a line
of its own; forked from an interpreter that already imported them, it starts in milliseconds.
`python -m megatron_deadpool.hotswap.launch.forkserver --fd N` is started by a launcher
(`hotswap.launch.warm_start`, which also holds the launcher's side of the protocol), imports what the
launcher's first message names (`Preload`), answers "ready", then serves fork requests on its
control socket until the socket closes (end of file: the launcher closed it or died) - or, when
the launcher asked for it, dies with the launcher's thread that started it (`PR_SET_PDEATHSIG`).

Protocol (a `SOCK_SEQPACKET` socket pair, one JSON object per message, descriptors alongside):
launcher -> server `{"op": "preload", "modules", "path", "scripts"}`, then any number of
`{"op": "spawn", "id": N, "argv": [...], "env": {...}, "cwd": DIR}` with the child's stdin,
stdout and stderr; server -> launcher `{"op": "ready", "pid", "threads", "hazards", "seconds"}`
(or `{"op": "error"}` when an import failed), `{"op": "spawned", "id", "pid"}` with a pidfd of
the child (the launcher can tell it ended even if the server is gone) or `{"op": "refused",
"id", "error", "lasting"}`, and `{"op": "exited", "id", "code"}` once it reaped a child (the
code as `Popen.returncode` has it: -N for a signal). The server is the children's parent, not
the launcher: it reaps them in its loop (a `poll` over the control socket and one pidfd per
child) and reports their exit codes.

Each child (`_Child`) is what a fresh `python ARGV` with the requested environment, working
folder and output would be: a session of its own (`setsid`, so `os.killpg(pid, ...)` reaches
it and its helpers), its descriptors on 0/1/2 and no other of the server's, the environment
replaced, `sys.argv`, `sys.path[0]` and a new `__main__` module as the interpreter sets them
for `-m MODULE`, `-c CODE` or `SCRIPT`, and the exit a fresh interpreter makes: non-daemon
threads joined, atexit handlers run, streams flushed, the code of `sys.exit`, 1 for an
uncaught exception, death by SIGINT for an uncaught `KeyboardInterrupt`.

What makes the fork safe (checked before every fork, `fork_hazards`; a request is refused
rather than forked unsafely, and the launcher then starts the process cold):
- One thread. `fork()` copies only the calling thread; a lock another thread held stays locked
  forever in the child. The server starts no thread itself and checks `/proc/self/task` before
  each fork. The second thread that `import torch` leaves (shared/DESIGN.md) is OpenBLAS's
  worker pool, started when numpy loads its bundled OpenBLAS; with OMP_NUM_THREADS=1 (or
  OPENBLAS_NUM_THREADS=1), which every DeadPool launcher sets, it starts none, and the server
  is single-threaded. Torch's own intra-op pool starts only with a first parallel operation,
  which the server never runs.
- No CUDA. A forked child cannot use a CUDA context its parent created, and the driver once
  initialised (`cuInit`, which even `torch.cuda.is_available()` calls) poisons every later
  fork. The server calls nothing that touches CUDA, imports with
  PYTORCH_NVML_BASED_CUDA_CHECK=1 (availability checks during the imports ask NVML instead of
  the driver), and before each fork requires torch's CUDA state uninitialised
  (`torch.cuda._initialized`, the real flag: the CPU mode answers `is_initialized()` with True)
  and the CUDA driver library not loaded (`/proc/self/maps`). The child may use CUDA freely.
- Thread pools: the OpenMP/MKL/OpenBLAS settings are read when their libraries load, in the
  server; so the variables read at interpreter or library start (`STARTUP_ENV`) of a request
  must equal the server's, or the launcher starts the process cold. Workers set their torch
  thread count themselves as before.
- Random state: Python's `random` is reseeded in every child by its own at-fork hook; numpy's
  global generator is reseeded from the OS, and torch's default CPU generator gets what a fresh
  interpreter of this torch has (torch 2.13 seeds it from the OS; older releases used a fixed
  seed, which is then restored), so children do not share the server's state. What stays shared
  is the string hash seed (PYTHONHASHSEED unset: each cold process has its own): nothing may
  depend on it, as nothing may depend on a fresh process's random state.
- Descriptors: the child closes the control socket, the pidfds and every descriptor the server
  holds beyond the ones the preloaded modules opened (none with torch and Megatron), after
  putting its own on 0, 1 and 2.
- Signals: handlers and the blocked set are reset to the state the server had after its imports
  (that of a fresh interpreter: SIGINT raises KeyboardInterrupt, SIGPIPE and SIGXFSZ ignored).
- Logging handlers and atexit handlers: the server installs none; what the preloaded modules
  installed on import, a cold process that imports them has too.
- Memory: after its imports the server freezes its objects out of the garbage collector
  (`gc.freeze`), so a child's collections do not touch, and copy, the pages they live on.

What differs from a cold start, knowingly: the preloaded modules are imported in every child
(a cold process imports what it uses, when it uses it), warnings printed while importing
appear once in the server's output instead of in each process's, and the string hash seed is
shared (see above).
"""

from __future__ import annotations

import argparse
import ast
import atexit
import builtins
import ctypes
import functools
import gc
import importlib
import importlib.machinery
import importlib.util
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

MAX_MESSAGE = 1 << 20
"""Largest control message (an environment of a few KiB is typical)."""
STARTUP_ENV = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "LD_", "MALLOC_", "TORCH")
"""Prefixes of the variables read once when the interpreter or a library starts, which a forked
child cannot change: a request's must equal the server's (`startup_env`)."""
STARTUP_ENV_NAMES = ("DEADPOOL_DEVICE", "PYTORCH_NVML_BASED_CUDA_CHECK")
"""Single variables of that kind (the CPU mode of a preloaded Megatron-LM is decided with them)."""
_LEGACY_TORCH_SEED = 67280421310721  # torch < 2.13 seeded its default generator with this
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Preload:
    """What the server imports before it forks anything."""

    modules: tuple[str, ...]
    """Modules to import in this order; "module:function" also calls `function()` afterwards."""
    path: tuple[str, ...] = ()
    """Folders put first on the import path for the imports (e.g. a Megatron-LM tree). A child's
    `sys.path` is its own program's again; modules imported from here stay imported."""
    scripts: tuple[str, ...] = ()
    """Scripts whose top-level imports (`script_imports`) are imported after `modules`."""


def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of `env` that take effect when a process starts (`STARTUP_ENV`)."""
    return {k: v for k, v in env.items() if k.startswith(STARTUP_ENV) or k in STARTUP_ENV_NAMES}


def thread_names() -> list[str]:
    """This process's threads, by their kernel names (`/proc/self/task/*/comm`)."""
    names = []
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                names.append(f"{tid}:{comm.read().strip()}")
        except OSError:  # ended meanwhile
            pass
    return names


def fork_hazards() -> list[str]:
    """Why forking this process now would be unsafe (empty: safe): more than one thread, or CUDA
    initialised by torch or the CUDA driver loaded."""
    hazards = []
    threads = thread_names()
    if len(threads) != 1:
        hazards.append(f"{len(threads)} threads ({', '.join(threads)}): fork copies one")
    cuda = sys.modules.get("torch.cuda")
    if cuda is not None and getattr(cuda, "_initialized", False):
        hazards.append("torch initialised CUDA in the fork server")
    with open("/proc/self/maps") as maps:
        if "libcuda.so" in maps.read():
            hazards.append("the CUDA driver is loaded in the fork server")
    return hazards


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """One message (and descriptors) on a SOCK_SEQPACKET socket."""
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"fork server message of {len(data)} bytes over {MAX_MESSAGE}")
    socket.send_fds(sock, [data], list(fds))


def receive(sock: socket.socket, max_fds: int = 3) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and its descriptors; (None, []) at end of file."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, max_fds)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), fds


# ---------------------------------------------------------------------- the server
@dataclass
class _Image:
    """What every child starts from: the server's state right after its imports."""

    base_path: list[str]
    """`sys.path` without the server's own first entry and the preload folders."""
    module_fds: set[int]
    """Descriptors the preloaded modules opened (kept in children, as a cold import has them)."""
    signals: dict[int, Any]
    """Each signal's handler after the imports (a fresh interpreter's)."""
    torch_seed: int | None
    """The fixed seed of torch's default generator in a fresh process; None: seeded from the OS."""


@dataclass
class Server:
    """The loop: serve fork requests, reap children, report their exit codes."""

    sock: socket.socket
    image: _Image
    children: dict[int, tuple[int, int]] = field(default_factory=dict)
    """pidfd -> (request id, pid)."""

    def serve(self) -> int:
        poller = select.poll()  # holds no descriptor of its own: nothing for children to close
        poller.register(self.sock.fileno(), select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                if fd == self.sock.fileno():
                    message, fds = receive(self.sock)
                    if message is None:
                        return 0  # the launcher closed the socket or died
                    if message.get("op") == "spawn":
                        pidfd = self._spawn(message, fds)
                        if pidfd is not None:
                            poller.register(pidfd, select.POLLIN)
                    else:
                        for extra in fds:
                            os.close(extra)
                else:
                    poller.unregister(fd)
                    self._reap(fd)

    def _spawn(self, request: dict[str, Any], fds: list[int]) -> int | None:
        hazards = fork_hazards()
        if hazards or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            why = "; ".join(hazards) or f"expected 3 descriptors, got {len(fds)}"
            send(self.sock, {"op": "refused", "id": request["id"], "error": why, "lasting": True})
            return None
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # or the child would write the server's pending output again
        pid = os.fork()
        if pid == 0:
            _Child(self, request, fds).run()
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (request["id"], pid)
        send(self.sock, {"op": "spawned", "id": request["id"], "pid": pid}, [pidfd])
        return pidfd

    def _reap(self, pidfd: int) -> None:
        rid, pid = self.children.pop(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        send(self.sock, {"op": "exited", "id": rid, "code": os.waitstatus_to_exitcode(status)})


# ---------------------------------------------------------------------- a child
class _Child:
    """A forked child becoming `python ARGV` (see the module docstring); never returns."""

    def __init__(self, server: Server, request: dict[str, Any], fds: list[int]) -> None:
        self.server = server
        self.request = request
        self.fds = fds

    def run(self) -> NoReturn:
        code = 1
        try:
            os.setsid()
            self._descriptors()
            self._signals()
            os.chdir(self.request["cwd"])
            os.environ.clear()
            os.environ.update(self.request["env"])
            self._reseed()
            code = run_program(self.request["argv"][1:], self.server.image.base_path)
        except BaseException:  # noqa: BLE001 - a child never returns into the server's loop
            try:
                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(1)
        os._exit(code)

    def _descriptors(self) -> None:
        for target, fd in enumerate(self.fds):
            os.dup2(fd, target)
        self.server.sock.close()
        for fd in open_fds() - {0, 1, 2} - self.server.image.module_fds:
            os.close(fd)  # the received copies, the pidfds, anything else of the server's
        out = sys.stdout
        if os.isatty(1) and isinstance(out, io.TextIOWrapper) and not out.write_through:
            out.reconfigure(line_buffering=True)  # as for a fresh process on a terminal

    def _signals(self) -> None:
        signal.set_wakeup_fd(-1)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        for signum, handler in self.server.image.signals.items():
            if signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)

    def _reseed(self) -> None:
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed()  # a fresh process seeds it from the OS
        torch = sys.modules.get("torch")
        if torch is not None:
            seed = self.server.image.torch_seed
            if seed is None:
                torch.default_generator.seed()
            else:
                torch.default_generator.manual_seed(seed)


def run_program(args: Sequence[str], base_path: Sequence[str]) -> int:
    """Run `python ARGS` (`-m MODULE ...`, `-c CODE ...` or `SCRIPT ...`) in this process as a
    fresh interpreter would, its finalisation included; returns the exit code (an uncaught
    KeyboardInterrupt kills the process with SIGINT, as Python does)."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    sys.orig_argv = [sys.executable, *args]
    run: Callable[[], Any]
    if args[0] == "-m":
        sys.modules.pop(_main_module(args[1]), None)  # preloaded: the program runs it afresh
        sys.argv = ["-m", *args[2:]]
        sys.path[:] = [os.getcwd(), *base_path]
        run = functools.partial(runpy._run_module_as_main, args[1])  # type: ignore[attr-defined]
    elif args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[:] = ["", *base_path]
        main.__loader__ = importlib.machinery.BuiltinImporter
        run = functools.partial(exec, compile(args[1], "<string>", "exec"), main.__dict__)
    else:
        path = os.path.abspath(args[0])
        sys.argv = list(args)
        sys.path[:] = [os.path.dirname(os.path.realpath(path)), *base_path]
        main.__file__ = path
        main.__dict__["__cached__"] = None
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
        with open(path, "rb") as source:
            code = compile(source.read(), path, "exec", dont_inherit=True)
        run = functools.partial(exec, code, main.__dict__)
    return _run_and_finish(run)


def _main_module(name: str) -> str:
    """The module `python -m NAME` runs: NAME, or NAME.__main__ for a package."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # runpy says so in the interpreter's words
        return name
    if spec is not None and spec.submodule_search_locations is not None:
        return f"{name}.__main__"
    return name


def open_fds() -> set[int]:
    """This process's open descriptors (without the one the listing itself used)."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))
        except OSError:
            continue
        fds.add(int(name))
    return fds


def _run_and_finish(run: Callable[[], Any]) -> int:
    interrupted = False
    try:
        run()
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException as exc:  # noqa: BLE001 - printed as the interpreter prints it
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # this module's frames are not the program's
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        interrupted = isinstance(exc, KeyboardInterrupt)
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, joined
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is None or stream.closed:  # the program closed it: Python skips it too
            continue
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120  # as Python when flushing stdout fails at exit
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code & 0xFF


def _exit_code(code: object) -> int:
    """The process exit code of `sys.exit(code)`, as Python makes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# ---------------------------------------------------------------------- start-up
def _die_with_parent(parent: int) -> None:
    """SIGKILL when the launcher's thread that started us ends (or already ended)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:
        os._exit(1)  # the launcher died before prctl took effect


def script_imports(path: str) -> list[str]:
    """The modules a script imports at its top level, in order: its `import` and absolute
    `from ... import` statements outside functions, classes and conditions (those in a
    top-level `try` too); for `from M import N`, M and M.N (N may be a submodule)."""
    with open(path, "rb") as source:
        tree = ast.parse(source.read(), path)
    names: list[str] = []
    body = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Try):
            body[:0] = node.body
    return names


def preload(spec: Preload) -> list[str]:
    """Import `spec`'s modules (calling "module:function" functions) and its scripts' imports,
    with its folders first on the import path and without letting an availability check
    initialise CUDA; returns the scripts' imports that failed (the program will meet them)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    sys.path[:0] = list(spec.path)
    for entry in spec.modules:
        name, _, function = entry.partition(":")
        module = importlib.import_module(name)
        if function:
            getattr(module, function)()
    failed = []
    for script in spec.scripts:
        for name in script_imports(script):
            parent, _, child = name.rpartition(".")
            if parent and child and hasattr(sys.modules.get(parent), child):
                continue  # `from M import N` of a name, not a submodule
            try:
                importlib.import_module(name)
            except ImportError:
                failed.append(name)
    return failed


def _image(spec: Preload, base_path: list[str], own_fds: set[int]) -> _Image:
    torch = sys.modules.get("torch")
    fresh = torch is not None and torch.initial_seed() == _LEGACY_TORCH_SEED
    return _Image(
        base_path=base_path,
        module_fds=open_fds() - own_fds,
        signals={s: signal.getsignal(s) for s in signal.valid_signals() if _settable(s)},
        torch_seed=_LEGACY_TORCH_SEED if fresh else None,
    )


def _settable(signum: int) -> bool:
    return signum not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(signum) is not None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_deadpool.hotswap.launch.forkserver")
    parser.add_argument("--fd", type=int, required=True, help="the control socket's descriptor")
    parser.add_argument("--parent", type=int, required=True, help="the launcher's pid")
    parser.add_argument("--die-with-parent", action="store_true")
    args = parser.parse_args(argv)
    if args.die_with_parent:
        _die_with_parent(args.parent)
    with socket.socket(fileno=args.fd) as sock:
        return _start(sock)


def _start(sock: socket.socket) -> int:
    """Preload what the launcher's first message names, say "ready", serve."""
    base_path = sys.path[1:]  # [0] is the server's own (its working folder, `-m`)
    own = open_fds()
    message, _ = receive(sock, max_fds=0)
    if message is None:
        return 0
    spec = Preload(tuple(message["modules"]), tuple(message["path"]), tuple(message["scripts"]))
    t0 = time.monotonic()
    try:
        failed = preload(spec)
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, which starts cold
        send(sock, {"op": "error", "error": f"{type(exc).__name__}: {exc}"})
        traceback.print_exc()
        return 1
    gc.freeze()  # the imports' objects: never traversed by a collection, never copied on write
    server = Server(sock, _image(spec, base_path, own))
    send(
        sock,
        {
            "op": "ready",
            "pid": os.getpid(),
            "threads": len(thread_names()),
            "hazards": fork_hazards(),
            "seconds": round(time.monotonic() - t0, 3),
            "not_imported": failed,
        },
    )
    return server.serve()


if __name__ == "__main__":
    sys.exit(main())
