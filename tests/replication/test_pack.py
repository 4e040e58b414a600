"""Tests of megatron_deadpool.replication.pack: layout, checksum definition, fault detection,
errors.

Both host backends (numpy, and the pure-torch one larger host buffers and GPUs without the
extension use) are checked against independent references (pure Python integers and numpy
uint64 arithmetic), at every size. The CUDA kernel source is compiled and linked with nvcc when
nvcc is on PATH, and its per-vector code is run on the host (`emulate_*`) against the fallback; the
kernels themselves run only where CUDA is available.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import struct
import subprocess
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from megatron_deadpool.replication import pack

MASK64 = (1 << 64) - 1
REPO = Path(__file__).resolve().parents[2]
KERNELS = REPO / "megatron_deadpool" / "replication" / "kernels"


# ---------------------------------------------------------------------------------------------
# References


def ref_checksum_py(data: bytes) -> int:
    """The definition, literally: exact Python ints over signed little-endian int32 words."""
    words = struct.unpack(f"<{len(data) // 4}i", data)
    return sum((i + 1) * w for i, w in enumerate(words)) % (1 << 64)


def ref_checksum_np(data: bytes) -> int:
    """Same value via numpy uint64 arithmetic (unsigned wraparound is exactly mod 2**64)."""
    words = np.frombuffer(data, dtype="<i4").astype(np.int64).astype(np.uint64)
    index = np.arange(1, len(words) + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return int((words * index).sum(dtype=np.uint64))


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().tobytes()


def ref_pack(tensors: Sequence[torch.Tensor]) -> bytes:
    """The packed layout built from the module docstring with plain bytes."""
    out = bytearray()
    for tensor in tensors:
        out += raw_bytes(tensor)
        out += bytes(-len(out) % 16)
    return bytes(out)


def make_tensor(dtype: torch.dtype, numel: int, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.int64:
        return torch.randint(-(2**63), 2**63 - 1, (numel,), dtype=dtype, generator=gen)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (numel,), dtype=dtype, generator=gen)
    return (torch.randn(numel, generator=gen) * 1e3).to(dtype)


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def shard(seed: int = 0) -> list[torch.Tensor]:
    """An optimizer-shard-like list: fp32 params/moments, bf16/fp16 bits, a scalar step."""
    gen = torch.Generator().manual_seed(seed)
    return [
        make_tensor(torch.float32, 1000003, gen),
        make_tensor(torch.float32, 17, gen).reshape(17, 1),
        make_tensor(torch.bfloat16, 3, gen),
        make_tensor(torch.float16, 1, gen),
        torch.tensor(12345, dtype=torch.int64),
        make_tensor(torch.uint8, 5, gen),
        torch.empty(0, dtype=torch.float32),
        make_tensor(torch.int64, 7, gen),
    ]


@pytest.fixture(params=["numpy", "torch"])
def host_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on host memory with each backend, whatever the buffers' sizes: numpy (the
    default for small host buffers) and the pure-torch one (DEADPOOL_PACK_BACKEND=torch)."""
    if request.param == "torch":
        monkeypatch.setenv("DEADPOOL_PACK_BACKEND", "torch")
    else:
        monkeypatch.delenv("DEADPOOL_PACK_BACKEND", raising=False)
        monkeypatch.setattr(pack, "_NUMPY_MAX_BYTES", pack.MAX_PACKED_BYTES)
    assert pack.backend_for(torch.empty(1)) == request.param
    return request.param


# ---------------------------------------------------------------------------------------------
# Checksum definition


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("host_backend")
def test_checksum_pinned_values() -> None:
    def words(*values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).view(torch.uint8)

    assert pack.checksum(words(1, 2, 3)) == 14  # 1*1 + 2*2 + 3*3
    assert pack.checksum(words(-1)) == 2**64 - 1
    assert pack.checksum(torch.empty(0, dtype=torch.uint8)) == 0
    # bytes 01000000 ffffffff 00000080 = words 1, -1, -2**31: 1 - 2 - 3 * 2**31 mod 2**64
    raw = bytes.fromhex("01000000" "ffffffff" "00000080")
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    assert pack.checksum(buf) == 18446744067267100671
    # 3 * (-2**31) + 2 * (2**31 - 1), words 0, 2**31 - 1, -2**31
    assert pack.checksum(words(0, 2**31 - 1, -(2**31))) == 18446744071562067966


@pytest.mark.timeout(30)
@pytest.mark.parametrize("nbytes", [4, 12, 16, 1020, 1024, 4096 + 8, (2 << 20) + 1024, 5_000_004])
@pytest.mark.usefixtures("host_backend")
def test_checksum_matches_references(nbytes: int) -> None:
    buf = random_bytes(nbytes, seed=nbytes)
    data = raw_bytes(buf)
    expected = ref_checksum_np(data)
    if nbytes <= 1 << 16:
        assert ref_checksum_py(data) == expected
    assert pack.checksum(buf) == expected


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("host_backend")
def test_checksum_extreme_words() -> None:
    values = [-(2**31), 2**31 - 1, -1, 0, 1] * 300  # 1500 words: several rows and a tail
    buf = torch.tensor(values, dtype=torch.int32).view(torch.uint8)
    assert pack.checksum(buf) == ref_checksum_py(raw_bytes(buf))
    worst = torch.full((1 << 20,), -(2**31), dtype=torch.int32).view(torch.uint8)
    assert pack.checksum(worst) == ref_checksum_np(raw_bytes(worst))


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("host_backend")
def test_checksum_of_misaligned_view() -> None:
    base = random_bytes(3 * 4096 + 7, seed=7)
    view = base[3 : 3 + 3 * 4096]  # storage offset not a multiple of 4
    assert pack.checksum(view) == ref_checksum_np(raw_bytes(view))


# ---------------------------------------------------------------------------------------------
# Pack / unpack


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("numel", [1, 3, 17, 1000003])
@pytest.mark.usefixtures("host_backend")
def test_pack_matches_reference(dtype: torch.dtype, numel: int) -> None:
    gen = torch.Generator().manual_seed(numel)
    tensors = [make_tensor(dtype, numel, gen), make_tensor(torch.float32, 5, gen)]
    tensors.append(make_tensor(dtype, numel // 2 + 1, gen))
    expected = ref_pack(tensors)
    total = pack.packed_nbytes(tensors)
    assert total == len(expected) and total % pack.ALIGN == 0
    out = torch.full((total + 32,), 0xAB, dtype=torch.uint8)
    value = pack.pack(tensors, out)
    assert raw_bytes(out[:total]) == expected
    assert raw_bytes(out[total:]) == b"\xab" * 32  # beyond the packed region: untouched
    assert value == ref_checksum_np(expected)


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("host_backend")
def test_layout_offsets_and_zero_padding() -> None:
    tensors = shard()
    offsets = pack.packed_offsets(tensors)
    total = pack.packed_nbytes(tensors)
    assert offsets[0] == 0 and all(o % pack.ALIGN == 0 for o in offsets)
    out = torch.full((total,), 0xFF, dtype=torch.uint8)
    pack.pack(tensors, out)
    ends = [o + t.numel() * t.element_size() for o, t in zip(offsets, tensors)]
    for end, nxt in zip(ends, [*offsets[1:], total]):
        assert nxt == -(-end // pack.ALIGN) * pack.ALIGN
        assert not out[end:nxt].any(), f"gap [{end}, {nxt}) not zero"
    assert pack.packed_nbytes([]) == 0 and pack.pack([], torch.empty(0, dtype=torch.uint8)) == 0


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("host_backend")
def test_round_trip_is_bitwise_and_checksums_agree() -> None:
    tensors = shard(seed=1)
    tensors[2] = torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.bfloat16)
    total = pack.packed_nbytes(tensors)
    out = torch.empty(total, dtype=torch.uint8)
    packed = pack.pack(tensors, out)
    restored = [torch.full_like(t, 7) for t in tensors]
    unpacked = pack.unpack(out, restored)
    assert unpacked == packed == pack.checksum(out) == ref_checksum_np(raw_bytes(out))
    for original, copy in zip(tensors, restored):
        assert raw_bytes(original) == raw_bytes(copy)
    flipped = out.clone()
    flipped[total // 2] ^= 1
    assert pack.unpack(flipped, restored) != packed  # the caller sees corruption on restore


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("host_backend")
def test_tensors_that_require_grad() -> None:
    params = [torch.randn(33, requires_grad=True), torch.randn(4, 4, requires_grad=True)]
    out = torch.empty(pack.packed_nbytes(params), dtype=torch.uint8)
    value = pack.pack(params, out)
    restored = [torch.zeros_like(p, requires_grad=True) for p in params]
    assert pack.unpack(out, restored) == value
    assert all(torch.equal(a, b) for a, b in zip(params, restored))


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("host_backend")
def test_many_chunks_and_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pack, "_CPU_CHUNK_BYTES", 2 * 4 * pack._ROW_WORDS)  # 2 rows per chunk
    gen = torch.Generator().manual_seed(3)
    sizes = [1, 2047, 3, 4096, 17, 0, 1000, 5, 3000]
    tensors = [
        make_tensor(torch.float16 if i % 2 else torch.float32, n, gen) for i, n in enumerate(sizes)
    ]
    expected = ref_pack(tensors)
    out = torch.empty(len(expected) + 4, dtype=torch.uint8)[4:]  # offset 4: aligned words
    value = pack.pack(tensors, out)
    assert raw_bytes(out) == expected and value == ref_checksum_py(expected)
    restored = [torch.empty_like(t) for t in tensors]
    assert pack.unpack(out, restored) == value
    assert all(raw_bytes(a) == raw_bytes(b) for a, b in zip(tensors, restored))
    odd = torch.empty(len(expected) + 1, dtype=torch.uint8)[1:]  # misaligned out
    assert pack.pack(tensors, odd) == value and raw_bytes(odd) == expected


@pytest.mark.timeout(30)
def test_backend_on_cpu_is_numpy_for_small_buffers_unless_torch_is_forced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DEADPOOL_PACK_BACKEND", raising=False)
    assert pack.backend_for(torch.empty(1)) == "numpy"
    assert pack.backend_for(torch.empty(pack._NUMPY_MAX_BYTES, dtype=torch.uint8)) == "numpy"
    assert pack.backend_for(torch.empty(pack._NUMPY_MAX_BYTES + 4, dtype=torch.uint8)) == "torch"
    assert pack.backend_for(torch.empty(1, device="meta")) == "torch"
    monkeypatch.setenv("DEADPOOL_PACK_BACKEND", "torch")
    assert pack.backend_for(torch.empty(1)) == "torch"


@pytest.mark.timeout(30)
def test_a_checksum_on_one_core_is_numpys_at_any_size_and_the_same_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checks beside the training (`verifier`) must not start an OpenMP team (`checksum`)."""
    monkeypatch.delenv("DEADPOOL_PACK_BACKEND", raising=False)
    big = torch.randint(-128, 128, (3 * pack._NUMPY_MAX_BYTES + 12,), dtype=torch.int8)
    buf = big.view(torch.uint8)
    assert pack.backend_for(buf) == "torch"
    assert pack.backend_for(buf, one_core=True) == "numpy"
    assert pack.backend_for(torch.empty(1, device="meta"), one_core=True) == "torch"
    assert pack.checksum(buf, one_core=True) == pack.checksum(buf)


@pytest.mark.timeout(30)
def test_pack_on_device_needs_cuda_memory() -> None:
    plan = pack.PackPlan([torch.randn(4)])
    with pytest.raises(pack.PackError, match="needs CUDA memory, this plan packs cpu memory"):
        plan.pack_on_device(torch.empty(plan.nbytes, dtype=torch.uint8))


@pytest.mark.timeout(30)
def test_chunk_geometry_respects_the_int64_bounds() -> None:
    rows = pack._chunk_rows()  # host memory only: GPU memory is checksummed whole-buffer
    assert 1 <= rows <= pack._MAX_CHUNK_ROWS
    # per-chunk sum_r r * rowsum_r stays below 2**63 (module comment: <= 2**62)
    assert rows * rows // 2 * pack._ROW_WORDS * 2**31 < 2**63


@pytest.mark.timeout(60)
def test_pack_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_deadpool.bench import pack_bench

    result = pack_bench.run_pack_bench(sizes_mb=[0.25], repeats=1, threads=[1])
    (row,) = result["rows"]
    assert row["backend"] == "numpy" and row["threads"] == 1 and row["copy_gbps"] > 0
    assert row["ratio"] == pytest.approx(row["pack_gbps"] / row["copy_gbps"])
    path = tmp_path / "pack.json"
    argv = ["--sizes-mb", "0.25", "--repeats", "1", "--threads", "1", "--json", str(path)]
    assert pack_bench.main(argv) == 0
    assert "pack/copy" in capsys.readouterr().out
    assert json.loads(path.read_text())["rows"][0]["nbytes"] == row["nbytes"]


# ---------------------------------------------------------------------------------------------
# Fault detection


def small_buffers() -> list[torch.Tensor]:
    extreme = [-(2**31), 2**31 - 1, -1, 0, 1, 2, -2, 2**30] * 2
    return [random_bytes(64, seed=11), torch.tensor(extreme, dtype=torch.int32).view(torch.uint8)]


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("host_backend")
def test_every_single_bit_flip_is_detected() -> None:
    for buf in small_buffers():
        base = pack.checksum(buf)
        data = bytearray(raw_bytes(buf))
        for bit in range(len(data) * 8):
            data[bit // 8] ^= 1 << (bit % 8)
            flipped = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            value = pack.checksum(flipped)
            assert value != base, f"flip of bit {bit} undetected"
            assert value == ref_checksum_py(bytes(data))
            data[bit // 8] ^= 1 << (bit % 8)


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("host_backend")
def test_random_bit_flips_in_large_buffer() -> None:
    buf = random_bytes((3 << 20) + 64, seed=5)
    base = pack.checksum(buf)
    rng = random.Random(5)
    for _ in range(24):
        bit = rng.randrange(buf.numel() * 8)
        buf[bit // 8] ^= 1 << (bit % 8)
        assert pack.checksum(buf) != base, f"flip of bit {bit} undetected"
        buf[bit // 8] ^= 1 << (bit % 8)
    assert pack.checksum(buf) == base


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("host_backend")
def test_every_word_swap_is_detected() -> None:
    for buf in small_buffers():
        words = buf.view(torch.int32)
        base = pack.checksum(buf)
        n = words.numel()
        for i in range(n):
            for j in range(i + 1, n):
                if words[i] == words[j]:
                    continue  # swapping equal words changes nothing
                swapped = words.clone()
                swapped[i], swapped[j] = words[j], words[i]
                assert pack.checksum(swapped.view(torch.uint8)) != base, f"swap {i}<->{j}"


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("host_backend")
def test_random_word_swaps_in_large_buffer() -> None:
    buf = random_bytes(3 << 20, seed=9)
    words = buf.view(torch.int32)
    base = pack.checksum(buf)
    rng = random.Random(9)
    for _ in range(24):
        i, j = rng.sample(range(words.numel()), 2)
        if words[i] == words[j]:
            continue
        a, b = int(words[i]), int(words[j])
        words[i], words[j] = b, a
        assert pack.checksum(buf) != base, f"swap {i}<->{j} undetected"
        words[i], words[j] = a, b
    assert pack.checksum(buf) == base


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.timeout(30)
def test_errors_name_the_problem() -> None:
    t = torch.randn(4, 4)
    out = torch.empty(pack.packed_nbytes([t]), dtype=torch.uint8)
    with pytest.raises(pack.PackError, match="not contiguous"):
        pack.pack([t.t()], out)
    with pytest.raises(pack.PackError, match="too small"):
        pack.pack([t], out[:-1])
    with pytest.raises(pack.PackError, match="torch.uint8"):
        pack.pack([t], torch.empty(64, dtype=torch.float32))
    with pytest.raises(pack.PackError, match="1-D"):
        pack.pack([t], torch.empty(4, 16, dtype=torch.uint8))
    with pytest.raises(pack.PackError, match="contiguous"):
        pack.pack([t], torch.empty(128, dtype=torch.uint8)[::2])
    with pytest.raises(pack.PackError, match="device mismatch"):
        pack.pack([t.to("meta")], out)
    with pytest.raises(pack.PackError, match="not a torch.Tensor"):
        pack.pack([t.numpy()], out)  # type: ignore[list-item]
    with pytest.raises(pack.PackError, match="not contiguous"):
        pack.unpack(out, [torch.empty(4, 4).t()])
    with pytest.raises(pack.PackError, match="too small"):
        pack.unpack(out[:8], [t])
    with pytest.raises(pack.PackError, match="device mismatch"):
        pack.unpack(out, [torch.empty(4, 4, device="meta")])
    with pytest.raises(pack.PackError, match="multiple of 4"):
        pack.checksum(torch.empty(6, dtype=torch.uint8))
    with pytest.raises(pack.PackError, match="torch.uint8"):
        pack.checksum(torch.empty(4, dtype=torch.int32))
    assert issubclass(pack.PackError, ValueError)


@pytest.mark.timeout(30)
def test_buffers_beyond_the_proof_are_refused() -> None:
    huge = torch.empty(pack.MAX_PACKED_BYTES + 4, dtype=torch.uint8, device="meta")
    with pytest.raises(pack.PackError, match="exceeds the checksum limit"):
        pack.checksum(huge)
    halves = [torch.empty(pack.MAX_PACKED_BYTES // 2, dtype=torch.uint8, device="meta")] * 2
    halves.append(torch.empty(1, device="meta"))
    with pytest.raises(pack.PackError, match="exceeds the checksum limit"):
        pack.pack(halves, torch.empty(16, dtype=torch.uint8, device="meta"))


# ---------------------------------------------------------------------------------------------
# CUDA source: compile + link with nvcc, run the kernels' per-vector code on the host


def _build_extension(build: Path) -> Path:
    """Compile pack_checksum.cu (nvcc) and binding.cpp (host C++), link; return the .so."""
    nvcc = shutil.which("nvcc")
    cxx = shutil.which("c++") or shutil.which("g++")
    python_include = sysconfig.get_paths()["include"]
    if nvcc is None:
        pytest.skip("nvcc is not on PATH: the CUDA kernel source cannot be compiled here")
    if cxx is None or not (Path(python_include) / "Python.h").exists():
        pytest.skip("no host C++ compiler or Python headers to compile the binding")
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    kernel_obj, binding_obj = build / "pack_checksum.o", build / "binding.o"
    kernel_cmd = [
        nvcc,
        "-c",
        "-O2",
        "-std=c++17",
        "-Xcompiler",
        "-fPIC",
        "-gencode",
        "arch=compute_90,code=sm_90",
        str(KERNELS / "pack_checksum.cu"),
        "-o",
        str(kernel_obj),
    ]
    binding_cmd = [
        cxx,
        "-c",
        "-O1",
        "-std=c++20",
        "-fPIC",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        "-DTORCH_EXTENSION_NAME=deadpool_cuda_kernels",
        *[f"-I{p}" for p in include_paths()],
        f"-I{python_include}",
        str(KERNELS / "binding.cpp"),
        "-o",
        str(binding_obj),
    ]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd in (kernel_cmd, binding_cmd)
    ]  # in parallel
    for cmd, proc in zip((kernel_cmd, binding_cmd), procs):
        output, _ = proc.communicate(timeout=280)
        assert proc.returncode == 0, f"{cmd[0]} failed:\n{output[-4000:]}"
    target = build / f"deadpool_cuda_kernels{sysconfig.get_config_var('EXT_SUFFIX')}"
    torch_lib = library_paths()[0]
    link_cmd = [
        nvcc,
        "-shared",
        "-o",
        str(target),
        str(kernel_obj),
        str(binding_obj),
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_python",
        "-Xlinker",
        f"-rpath,{torch_lib}",
    ]  # nvcc links cudart statically
    done = subprocess.run(link_cmd, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"link failed:\n{done.stdout}{done.stderr}"
    return target


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("deadpool_cuda_kernels", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_cuda_source_compiles_links_and_matches_fallback(tmp_path: Path) -> None:
    ext = _load(_build_extension(tmp_path))
    assert ext.ABI == pack.EXTENSION_ABI
    tensors = shard(seed=4)
    tensors.append(torch.randn(9, dtype=torch.bfloat16)[1:])  # 2-byte aligned source pointer
    offsets, total = pack.packed_offsets(tensors), pack.packed_nbytes(tensors)
    expected_out = torch.empty(total, dtype=torch.uint8)
    expected = pack.pack(tensors, expected_out)

    out = torch.full((total,), 0xCD, dtype=torch.uint8)
    assert ext.emulate_pack(tensors, offsets, out, total) & MASK64 == expected
    assert torch.equal(out, expected_out)
    restored = [torch.empty_like(t) for t in tensors]
    restored[-1] = torch.empty(9, dtype=torch.bfloat16)[1:]  # misaligned destination
    assert ext.emulate_unpack(out, restored, offsets, total) & MASK64 == expected
    assert all(raw_bytes(a) == raw_bytes(b) for a, b in zip(tensors, restored))
    for nbytes in (0, 4, 12, 20, 4096 + 12):
        buf = random_bytes(nbytes + 1, seed=nbytes)[1:]  # misaligned, with 0-3 tail words
        assert ext.emulate_checksum(buf) & MASK64 == pack.checksum(buf)
    # The segment table pack.py moves to the device once: (address, offset, bytes) per
    # non-empty tensor, checked against the layout.
    table = ext.segment_table(tensors, offsets, total)
    expected_rows = [
        [t.data_ptr(), off, t.numel() * t.element_size()]
        for t, off in zip(tensors, offsets)
        if t.numel()
    ]
    assert table.dtype == torch.int64 and table.tolist() == expected_rows
    with pytest.raises(RuntimeError, match="not 16-aligned"):
        ext.segment_table(tensors, [o + 4 for o in offsets], total)
    # The GPU entry points bind with the argument order pack.py uses, and refuse CPU tensors.
    slot = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        ext.pack(table, out, total, slot, 0)
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        ext.unpack(out, table, total, slot, 0)
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        ext.checksum(out, slot, 0)


# ---------------------------------------------------------------------------------------------
# On a GPU


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def to_cuda(tensor: torch.Tensor) -> torch.Tensor:
    """A CUDA copy that keeps the storage offset (so a misaligned view stays misaligned)."""
    offset = tensor.storage_offset()
    base = torch.empty(offset + tensor.numel(), dtype=tensor.dtype, device="cuda")
    view = base[offset:].view(tensor.shape)
    view.copy_(tensor)
    return view


def _cuda_cases() -> list[list[torch.Tensor]]:
    big = shard(seed=6)
    big.append(torch.randn(9, dtype=torch.bfloat16)[1:])  # source not 16-byte aligned
    many = [torch.randn(n) for n in range(0, 300, 7)]
    return [big, many, [torch.empty(0)], [torch.randn((64 << 20) // 4 + 3)]]


@needs_cuda
@pytest.mark.timeout(120)
def test_cuda_fallback_matches_cpu() -> None:
    for tensors in _cuda_cases():
        total = pack.packed_nbytes(tensors)
        cpu_out = torch.empty(total, dtype=torch.uint8)
        expected = pack.pack(tensors, cpu_out)
        gpu = [to_cuda(t) for t in tensors]
        gpu_out = torch.empty(total, dtype=torch.uint8, device="cuda")
        os.environ["DEADPOOL_PACK_BACKEND"] = "torch"
        try:
            assert pack.backend_for(gpu_out) == "torch"
            assert pack.pack(gpu, gpu_out) == expected
            assert torch.equal(gpu_out.cpu(), cpu_out)
            assert pack.checksum(gpu_out) == expected
            assert pack.unpack(gpu_out, [torch.empty_like(t) for t in gpu]) == expected
        finally:
            del os.environ["DEADPOOL_PACK_BACKEND"]


@needs_cuda
@pytest.mark.timeout(120)
def test_cuda_kernel_matches_fallback_bit_for_bit() -> None:
    if pack.backend_for(torch.empty(1, device="cuda")) != "cuda":
        pytest.skip("deadpool_cuda_kernels is not installed (pip install ./cuda_kernels)")
    for tensors in _cuda_cases():
        total = pack.packed_nbytes(tensors)
        cpu_out = torch.empty(total, dtype=torch.uint8)
        expected = pack.pack(tensors, cpu_out)
        gpu = [to_cuda(t) for t in tensors]
        gpu_out = torch.full((total + 16,), 0xEE, dtype=torch.uint8, device="cuda")
        assert pack.pack(gpu, gpu_out) == expected
        assert torch.equal(gpu_out[:total].cpu(), cpu_out)
        assert (gpu_out[total:] == 0xEE).all()
        restored = [torch.empty_like(t) for t in gpu]
        if tensors[-1].storage_offset():  # also scatter into a misaligned destination
            restored[-1] = torch.empty(tensors[-1].numel() + 1, dtype=tensors[-1].dtype)
            restored[-1] = restored[-1].cuda()[1:]
        assert pack.unpack(gpu_out, restored) == expected
        assert all(raw_bytes(a) == raw_bytes(b.cpu()) for a, b in zip(tensors, restored))
        assert pack.checksum(gpu_out[:total]) == expected
        odd = torch.empty(total + 1, dtype=torch.uint8, device="cuda")[1:]  # misaligned out
        assert pack.pack(gpu, odd) == expected and torch.equal(odd.cpu(), cpu_out)
    for nbytes in (4, 12, 20, 4096 + 12, (8 << 20) + 4):
        buf = random_bytes(nbytes + 1, seed=nbytes)
        on_gpu = buf.cuda()[1:]  # misaligned device pointer
        expected = ref_checksum_np(raw_bytes(buf[1:]))
        assert pack.checksum(on_gpu) == pack.checksum(buf[1:]) == expected


@needs_cuda
@pytest.mark.timeout(120)
def test_cuda_fallback_enqueues_into_a_slot_and_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("DEADPOOL_PACK_BACKEND", "torch")
    monkeypatch.setattr(pack, "_FALLBACK_ANNOUNCED", False)
    tensors = shard(seed=7)
    total = pack.packed_nbytes(tensors)
    cpu_out = torch.empty(total, dtype=torch.uint8)
    expected = pack.pack(tensors, cpu_out)
    plan = pack.PackPlan([to_cuda(t) for t in tensors])
    out = torch.empty(total, dtype=torch.uint8, device="cuda")
    with caplog.at_level("WARNING", logger=pack.__name__):
        for _ in range(2):
            slot = plan.pack_on_device(out)
            assert slot.device.type == "cuda" and int(slot.item()) & MASK64 == expected
    assert torch.equal(out.cpu(), cpu_out)
    warnings = [r.getMessage() for r in caplog.records if "torch fallback" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith(
        "deadpool: replication uses the torch fallback (forced by DEADPOOL_PACK_BACKEND=torch)"
    )
