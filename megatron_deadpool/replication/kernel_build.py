"""Build the fused pack kernel (`deadpool_cuda_kernels`) on first use, into a per-user cache.

`pack` uses the extension when it imports; a plain ``pip install`` does not build it (that
needs ``pip install --no-build-isolation ./cuda_kernels``). So when it does not import and a
CUDA device is in use, `load` compiles the sources shipped in the package
(``replication/kernels/``) once and caches the module, and every later process loads it from
the cache in milliseconds.

The build is the one the tests run on a machine without a GPU: nvcc compiles
``pack_checksum.cu`` (the kernels and their launchers, no torch headers), the host C++ compiler
compiles ``binding.cpp`` against torch's headers, and nvcc links both with the CUDA runtime
linked statically - so it needs neither torch's CUDA libraries nor ``CUDA_HOME`` matching
torch's CUDA, only an nvcc that can target the device.

Cache layout: ``${DEADPOOL_KERNEL_CACHE:-${XDG_CACHE_HOME:-~/.cache}/megatron-deadpool/kernels}``
holds one folder per `build_key` (a hash of the sources, torch's version and CUDA version and
C++ ABI, the target architecture and the Python ABI), so a changed source or a new torch gets a
new build and old ones stay valid for the environments that made them. The ranks of a node
take an exclusive ``fcntl.flock`` on ``<key>.lock``: one builds, the others wait and then load
its result. The build happens in a temporary folder beside the target that is renamed into
place in one step, so a cache on a home shared by several nodes never shows a half-written
module (a rename that loses the race keeps the winner's). A failed build leaves
``<key>.failed`` (its reason) and ``<key>.log`` (the compiler's output); later processes read
the reason instead of spending the build time again, until the marker is removed.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

EXTENSION_NAME = "deadpool_cuda_kernels"
EXTENSION_ABI = 2
"""The ``ABI`` attribute the CUDA extension must carry to be used (2: the GPU entry points
only enqueue; segment tables and checksum slots are device tensors owned by `pack`)."""

SOURCE_DIR = Path(__file__).resolve().with_name("kernels")
SOURCES = ("pack_checksum.cu", "pack_checksum.h", "binding.cpp")
"""The extension's source files in `SOURCE_DIR` (all of them enter `build_key`)."""

BUILD_TIMEOUT_S = 900.0
"""Longest a compiler step may run, and longest a rank waits for another rank's build."""

_POLL_S = 0.2


class KernelBuildError(RuntimeError):
    """The kernel could not be built or loaded: `reason` says why, `fix` what to run."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(f"{reason}; fix: {fix}")
        self.reason = reason
        self.fix = fix


@dataclass(frozen=True)
class BuiltKernel:
    """The loaded extension module, the file it came from, and whether this call compiled it
    (False: it was in the cache)."""

    module: ModuleType
    path: Path
    built: bool


def cache_root() -> Path:
    """The cache folder: ``$DEADPOOL_KERNEL_CACHE``, else
    ``${XDG_CACHE_HOME:-~/.cache}/megatron-deadpool/kernels``."""
    explicit = os.environ.get("DEADPOOL_KERNEL_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "megatron-deadpool" / "kernels"


def device_arch(device: torch.device) -> str:
    """The compute capability of a CUDA device as nvcc spells it (``"90"`` for an H100)."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def build_key(arch: str) -> str:
    """The cache key of a build for compute capability `arch`: a hash of everything that makes
    a built module unusable elsewhere (sources, torch and its CUDA and C++ ABI, Python ABI)."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes() + b"\0")
    parts = (
        torch.__version__,
        str(torch.version.cuda),
        str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
        arch,
        sys.implementation.cache_tag or "",
        str(sysconfig.get_config_var("EXT_SUFFIX")),
        str(EXTENSION_ABI),
    )
    digest.update("\0".join(parts).encode())
    return f"sm{arch}-{digest.hexdigest()[:16]}"


def load(arch: str, *, root: Path | None = None) -> BuiltKernel:
    """The extension for compute capability `arch` (e.g. ``"90"``): loaded from the cache
    under `root` (default `cache_root`), built there first if no process has built it yet.

    Raises `KernelBuildError` with the reason and the fix when no compiler is found, the build
    fails (or failed before: ``<key>.failed``), or the module does not load."""
    if not arch.isdigit():
        raise ValueError(f"arch {arch!r} must be a compute capability like '90'")
    root = cache_root() if root is None else root
    key = build_key(arch)
    target = root / key / f"{EXTENSION_NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if target.exists():  # the common case: built before, no lock needed (renamed in whole)
        return BuiltKernel(_import(target), target, built=False)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelBuildError(
            f"cannot create the kernel cache {root}: {exc.strerror}",
            "set DEADPOOL_KERNEL_CACHE to a writable folder",
        ) from exc
    with _locked(root / f"{key}.lock"):
        if target.exists():  # another rank built it while this one waited
            return BuiltKernel(_import(target), target, built=False)
        failed = root / f"{key}.failed"
        if failed.exists():
            reason = failed.read_text().strip() or "an earlier build failed"
            raise KernelBuildError(
                reason, f"fix the cause, then rm {failed} (the next job rebuilds)"
            )
        tools = _tools()
        staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        try:
            _compile(tools, arch, staging, staging / target.name, root / f"{key}.log", failed)
            try:
                os.rename(staging, target.parent)
            except OSError as exc:  # another node's build won the rename: keep the winner's
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not target.exists():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return BuiltKernel(_import(target), target, built=True)


# ---------------------------------------------------------------------------------------------
# Steps


@dataclass(frozen=True)
class _Tools:
    nvcc: str
    cxx: str
    python_include: str


def _tools() -> _Tools:
    nvcc = shutil.which("nvcc")
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if nvcc is None and cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        nvcc = str(Path(cuda_home) / "bin" / "nvcc")
    if nvcc is None:
        raise KernelBuildError(
            "nvcc not found on PATH (nor in $CUDA_HOME/bin)",
            "put the CUDA toolkit's bin folder on PATH (e.g. module load cuda, or export "
            "PATH=/usr/local/cuda/bin:$PATH) and rerun, or pip install --no-build-isolation "
            "./cuda_kernels",
        )
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise KernelBuildError(
            "no host C++ compiler (c++, g++ or $CXX) on PATH",
            "install a C++ compiler (e.g. apt-get install g++) or set CXX",
        )
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise KernelBuildError(
            f"Python headers not found (no Python.h in {include})",
            "install the Python development headers (e.g. apt-get install python3-dev)",
        )
    return _Tools(nvcc, cxx, include)


def _compile(tools: _Tools, arch: str, build: Path, target: Path, log: Path, failed: Path) -> None:
    """Compile both translation units (in parallel) and link `target`; on failure write the
    log and the failure marker and raise."""
    from torch.utils.cpp_extension import include_paths, library_paths

    kernel_obj, binding_obj = build / "pack_checksum.o", build / "binding.o"
    gencode = f"arch=compute_{arch},code=[sm_{arch},compute_{arch}]"
    kernel_cmd = [tools.nvcc, "-c", "-O3", "-std=c++17", "-Xcompiler", "-fPIC"]
    kernel_cmd += ["-gencode", gencode, str(SOURCE_DIR / "pack_checksum.cu"), "-o", str(kernel_obj)]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    binding_cmd = [tools.cxx, "-c", "-O2", "-std=c++20", "-fPIC", "-w"]
    binding_cmd += [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    binding_cmd += [f"-DTORCH_EXTENSION_NAME={EXTENSION_NAME}"]
    binding_cmd += [*[f"-I{p}" for p in include_paths()], f"-I{tools.python_include}"]
    binding_cmd += [str(SOURCE_DIR / "binding.cpp"), "-o", str(binding_obj)]
    torch_lib = library_paths()[0]
    link_cmd = [tools.nvcc, "-shared", "-o", str(target), str(kernel_obj), str(binding_obj)]
    link_cmd += [f"-L{torch_lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    link_cmd += ["-Xlinker", f"-rpath,{torch_lib}"]  # nvcc links the CUDA runtime statically
    transcript: list[str] = []
    ok = _run_parallel([kernel_cmd, binding_cmd], transcript) and _run_parallel(
        [link_cmd], transcript
    )
    if ok:
        (build / "build.log").write_text("\n".join(transcript))
        return
    log.write_text("\n".join(transcript))
    reason = f"build failed: {_first_error(transcript)} (log: {log})"
    failed.write_text(reason + "\n")
    raise KernelBuildError(reason, f"see {log}; fix the cause, then rm {failed}")


def _run_parallel(cmds: Sequence[list[str]], transcript: list[str]) -> bool:
    procs = []
    for cmd in cmds:
        transcript.append("$ " + " ".join(cmd))
        try:
            procs.append(
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )
        except OSError as exc:
            transcript.append(f"error: cannot run {cmd[0]}: {exc.strerror}")
            for proc in procs:
                proc.kill()
                proc.wait()
            return False
    ok = True
    for cmd, proc in zip(cmds, procs):
        try:
            output, _ = proc.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            output += f"\nerror: {cmd[0]} ran past {BUILD_TIMEOUT_S:.0f} s and was stopped"
        transcript.append(output.rstrip())
        if proc.returncode != 0:
            transcript.append(f"error: {Path(cmd[0]).name} exited with {proc.returncode}")
            ok = False
    return ok


def _first_error(transcript: list[str]) -> str:
    """The first line that reads like an error (compilers prefix them), else the last line."""
    lines = [
        line.strip()
        for entry in transcript
        if not entry.startswith("$ ")
        for line in entry.splitlines()
        if line.strip()
    ]
    for line in lines:
        if "error" in line.lower() or "fatal" in line.lower():
            return line[:300]
    return lines[-1][:300] if lines else "no output"


class _locked:
    """An exclusive `fcntl.flock` on `path` for the `with` block, waited for up to
    `BUILD_TIMEOUT_S` (another rank's build)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise KernelBuildError(
                        f"waited {BUILD_TIMEOUT_S:.0f} s for another process's kernel build "
                        f"(lock {self.path})",
                        f"check for a hung build holding {self.path}, or set "
                        "DEADPOOL_KERNEL_CACHE to another folder",
                    ) from None
                time.sleep(_POLL_S)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _import(path: Path) -> ModuleType:
    """Load the extension module from `path` and check its ABI."""
    try:
        spec = importlib.util.spec_from_file_location(EXTENSION_NAME, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"no loader for {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise KernelBuildError(
            f"the built kernel {path} does not load: {str(exc).splitlines()[0]}",
            f"rm -r {path.parent} (the next job rebuilds it)",
        ) from exc
    if getattr(module, "ABI", None) != EXTENSION_ABI:
        raise KernelBuildError(
            f"the built kernel {path} has ABI {getattr(module, 'ABI', None)}, "
            f"need {EXTENSION_ABI}",
            f"rm -r {path.parent} (the next job rebuilds it)",
        )
    return module
