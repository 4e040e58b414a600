"""Tests of megatron_deadpool.replication.kernel_build: the fused pack kernel compiled on first
use into a per-user cache.

nvcc is on this machine beside a CPU-only torch, so the real build runs here (nvcc for the
kernels, the host compiler for the binding, nvcc links): two processes race for one cache key
(one builds, the other waits on the lock and loads the result), a later call loads from the
cache without compiling, and the module's host emulation agrees with `pack`. A missing or
failing compiler gives the reason and the fix, and `pack` falls back to torch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_deadpool.replication import kernel_build, pack

REPO = Path(__file__).resolve().parents[2]
ARCH = "90"
RACER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from megatron_deadpool.replication import kernel_build
    start = time.monotonic()
    kernel = kernel_build.load(sys.argv[1], root=Path(sys.argv[2]))
    print(json.dumps({"built": kernel.built, "path": str(kernel.path),
                      "abi": kernel.module.ABI, "seconds": time.monotonic() - start}))
    """)


def env_with(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), **extra}
    env.pop("DEADPOOL_PACK_BACKEND", None)
    return env


@pytest.fixture(scope="module")
def raced_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """A fresh cache two processes built into at once: (root, their reports)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: the kernel cannot be built here")
    root = tmp_path_factory.mktemp("kernel-cache")
    cmd = [sys.executable, "-c", RACER, ARCH, str(root)]
    procs = [
        subprocess.Popen(cmd, env=env_with(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=800)
            assert proc.returncode == 0, err.decode()[-3000:]
            reports.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return root, reports


@pytest.mark.timeout(900)
def test_two_processes_racing_for_one_key_build_once(raced_cache: tuple[Path, list]) -> None:
    root, reports = raced_cache
    assert sorted(r["built"] for r in reports) == [False, True]  # one built, one waited
    assert reports[0]["path"] == reports[1]["path"]
    assert all(r["abi"] == pack.EXTENSION_ABI for r in reports)
    key = kernel_build.build_key(ARCH)
    # only the renamed build folder and the lock remain: no staging folder, no failure marker
    assert sorted(p.name for p in root.iterdir()) == [key, f"{key}.lock"]
    assert (root / key / "build.log").exists()


@pytest.mark.timeout(900)
def test_a_later_call_loads_from_the_cache_and_the_module_agrees_with_pack(
    raced_cache: tuple[Path, list],
) -> None:
    root, reports = raced_cache
    kernel = kernel_build.load(ARCH, root=root)
    assert not kernel.built and str(kernel.path) == reports[0]["path"]
    tensors = [torch.randn(1000), torch.randn(7, dtype=torch.bfloat16), torch.empty(0)]
    offsets, total = pack.packed_offsets(tensors), pack.packed_nbytes(tensors)
    expected = torch.empty(total, dtype=torch.uint8)
    value = pack.pack(tensors, expected)
    out = torch.full((total,), 0xCD, dtype=torch.uint8)
    assert kernel.module.emulate_pack(tensors, offsets, out, total) & (2**64 - 1) == value
    assert torch.equal(out, expected)
    # pack checks a kernel on the device before using it; on the host the entry point refuses
    problem = pack._kernel_problem(kernel.module, torch.device("cpu"))
    assert problem is not None and problem.startswith("the kernel does not run on cpu: ")
    assert "CUDA tensor" in problem


@pytest.mark.timeout(120)
def test_the_key_follows_the_sources_the_arch_and_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    key = kernel_build.build_key(ARCH)
    assert key.startswith("sm90-") and key == kernel_build.build_key(ARCH)
    assert kernel_build.build_key("80") != key
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    assert kernel_build.build_key(ARCH) != key


@pytest.mark.timeout(60)
def test_the_cache_folder_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DEADPOOL_KERNEL_CACHE", str(tmp_path / "explicit"))
    assert kernel_build.cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("DEADPOOL_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_build.cache_root() == tmp_path / "xdg" / "megatron-deadpool" / "kernels"


def run_load(root: Path, path: str) -> subprocess.CompletedProcess[str]:
    """`kernel_build.load` in a child with PATH = `path` and no CUDA_HOME."""
    code = (
        "import sys; from pathlib import Path; from megatron_deadpool.replication import "
        "kernel_build as k\ntry:\n    k.load('90', root=Path(sys.argv[1]))\n"
        "except k.KernelBuildError as e:\n    print('REASON', e.reason); print('FIX', e.fix)"
    )
    env = env_with(PATH=path)
    env.pop("CUDA_HOME", None)
    env.pop("CUDA_PATH", None)
    return subprocess.run(
        [sys.executable, "-c", code, str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.timeout(150)
def test_no_nvcc_on_path_gives_the_reason_and_the_fix(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    done = run_load(tmp_path / "cache", str(bare))
    assert done.returncode == 0, done.stderr
    assert "REASON nvcc not found on PATH" in done.stdout
    assert "FIX put the CUDA toolkit's bin folder on PATH" in done.stdout
    assert not (tmp_path / "cache" / f"{kernel_build.build_key(ARCH)}.failed").exists()


@pytest.mark.timeout(150)
def test_a_failing_compiler_gives_its_first_error_and_the_log_and_is_not_retried(
    tmp_path: Path,
) -> None:
    broken = tmp_path / "bin"
    broken.mkdir()
    nvcc = broken / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\necho 'compiling'\n"
        "echo \"nvcc fatal   : Unsupported gpu architecture 'compute_90'\"\nexit 1\n"
    )
    cxx = broken / "c++"  # compiles nothing, succeeds: the failure is nvcc's
    cxx.write_text("#!/bin/sh\nexit 0\n")
    for tool in (nvcc, cxx):
        tool.chmod(0o755)
    root = tmp_path / "cache"
    key = kernel_build.build_key(ARCH)
    done = run_load(root, f"{broken}:{os.environ['PATH']}")
    assert done.returncode == 0, done.stderr
    log = root / f"{key}.log"
    assert (
        f"REASON build failed: nvcc fatal   : Unsupported gpu architecture 'compute_90' "
        f"(log: {log})" in done.stdout
    )
    assert "Unsupported gpu architecture" in log.read_text()
    marker = root / f"{key}.failed"
    assert marker.exists() and not (root / key).exists()
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []  # staging removed
    # The next process reads the reason instead of compiling again (the fake nvcc is gone).
    nvcc.unlink()
    again = run_load(root, f"{broken}:{os.environ['PATH']}")
    assert "REASON build failed: nvcc fatal" in again.stdout
    assert f"FIX fix the cause, then rm {marker}" in again.stdout


@pytest.mark.timeout(60)
def test_a_bad_arch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="compute capability"):
        kernel_build.load("sm_90", root=tmp_path)


@pytest.mark.timeout(150)
def test_pack_reports_the_reason_and_falls_back_to_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`pack.kernel_status` on a CUDA device (no GPU here: the device's arch is given) when
    the kernel cannot be built: the torch backend, the build's reason and fix."""
    monkeypatch.delenv("DEADPOOL_PACK_BACKEND", raising=False)
    monkeypatch.setenv("DEADPOOL_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvcc
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(kernel_build, "device_arch", lambda device: ARCH)
    monkeypatch.setattr(pack, "_EXTENSION", None)
    monkeypatch.setattr(pack, "_EXTENSION_LOADED", False)
    monkeypatch.setattr(pack, "_BUILD_TRIED", False)
    monkeypatch.setattr(pack, "_WHY_NOT", pack._NO_KERNEL)
    cuda = torch.device("cuda", 0)
    status = pack.kernel_status(cuda)
    assert status.backend == "torch"
    assert status.reason == "nvcc not found on PATH (nor in $CUDA_HOME/bin)"
    assert "PATH" in status.fix and "cuda_kernels" in status.fix
    assert pack._backend(cuda, 1 << 30) == "torch"
    monkeypatch.setenv("DEADPOOL_PACK_BACKEND", "torch")
    assert pack.kernel_status(cuda) == pack.KernelStatus(
        "torch", "forced by DEADPOOL_PACK_BACKEND=torch", "unset DEADPOOL_PACK_BACKEND"
    )
    assert pack.kernel_status(torch.device("cpu")).backend == "torch"
    monkeypatch.delenv("DEADPOOL_PACK_BACKEND")
    assert pack.kernel_status(torch.device("cpu")) == pack.KernelStatus(
        "numpy", "cpu memory: the kernel is for CUDA devices", ""
    )


@pytest.mark.timeout(30)
def test_the_fallback_warning_names_the_reason_the_cost_and_the_fix() -> None:
    status = pack.KernelStatus("torch", "nvcc not found on PATH", "module load cuda")
    assert pack.fallback_message(status, 1_500_000_000, 3.25, 0.75) == (
        "deadpool: replication uses the torch fallback (nvcc not found on PATH): a round of "
        "1.50 GB costs 3.2 ms of GPU and 0.8 ms of host time; fix: module load cuda"
    )
