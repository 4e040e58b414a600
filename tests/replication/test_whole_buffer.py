"""Tests of megatron_deadpool.replication.whole_buffer: the torch fallback's whole-buffer pack
and checksum, which GPUs without the fused kernel use.

The scheme is plain torch, so it runs here on host tensors (built directly, as `pack` builds
it for GPU memory) against the references of test_pack.py: bytes and checksums bit-identical
at many sizes, alignments and tails, sums that wrap around 2**64 many times, and a number of
torch ops per pack that does not grow with the buffer (within a slab).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megatron_deadpool.replication import pack, whole_buffer
from tests.replication.test_pack import (
    MASK64,
    make_tensor,
    random_bytes,
    raw_bytes,
    ref_checksum_np,
    ref_checksum_py,
    ref_pack,
)

CPU = torch.device("cpu")


def plan_of(tensors: Sequence[torch.Tensor], slab_rows: int) -> whole_buffer.WholeBufferPlan:
    offsets, nbytes = pack.packed_offsets(tensors), pack.packed_nbytes(tensors)
    built = pack._whole_buffer_plan(tensors, offsets, nbytes, CPU)
    return whole_buffer.WholeBufferPlan(built.sources, built.copies, nbytes, CPU, slab_rows)


def slot_value(slot: torch.Tensor) -> int:
    return int(slot.item()) & MASK64


@pytest.mark.timeout(120)
@pytest.mark.parametrize("slab_rows", [1, 3, whole_buffer.SLAB_ROWS])
def test_checksum_matches_the_references_at_sizes_alignments_and_tails(slab_rows: int) -> None:
    row = whole_buffer.ROW_WORDS * 4
    sizes = [0, 4, 8, 12, row - 4, row, row + 4, 3 * row + 12, 7 * row + row - 4, 50_000 * 4]
    for nbytes in sizes:
        for misalign in range(4):
            buf = random_bytes(nbytes + misalign, seed=nbytes * 4 + misalign)[misalign:]
            slot = torch.full((1,), 7, dtype=torch.int64)
            whole_buffer.DeviceChecksum(nbytes, CPU, slab_rows).enqueue(buf, slot)
            expected = ref_checksum_np(raw_bytes(buf))
            assert slot_value(slot) == expected, (nbytes, misalign)
    small = random_bytes(3 * row + 12, seed=1)
    slot = torch.zeros(1, dtype=torch.int64)
    whole_buffer.DeviceChecksum(small.numel(), CPU, slab_rows).enqueue(small, slot)
    assert slot_value(slot) == ref_checksum_py(raw_bytes(small))


@pytest.mark.timeout(120)
def test_sums_that_wrap_around_2_64_stay_exact() -> None:
    """All words -2**31 (and 2**31 - 1): the rows' weighted sum passes 2**63 many times over."""
    nwords = 300_000 + 77  # 1.2 MB: the total is ~2**66; a tail of 77 words
    for value in (-(2**31), 2**31 - 1):
        buf = torch.full((nwords,), value, dtype=torch.int32).view(torch.uint8)
        slot = torch.zeros(1, dtype=torch.int64)
        whole_buffer.DeviceChecksum(buf.numel(), CPU, 64).enqueue(buf, slot)
        exact = value * nwords * (nwords + 1) // 2
        assert abs(exact) > 2**66
        assert slot_value(slot) == exact % 2**64 == ref_checksum_np(raw_bytes(buf))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("slab_rows", [2, whole_buffer.SLAB_ROWS])
def test_pack_and_unpack_are_bitwise_and_match_the_chunked_backends(slab_rows: int) -> None:
    gen = torch.Generator().manual_seed(5)
    dtypes = [torch.float32, torch.bfloat16, torch.uint8, torch.int64, torch.float16]
    sizes = [1, 2047, 3, 4096, 17, 0, 1000, 5, 3000, 300]
    tensors = [make_tensor(dtypes[i % len(dtypes)], n, gen) for i, n in enumerate(sizes)]
    tensors.append(torch.randn(9, dtype=torch.bfloat16, generator=gen)[1:])  # 2-byte offset
    expected = ref_pack(tensors)
    value = ref_checksum_py(expected)
    plan = plan_of(tensors, slab_rows)
    for misalign in range(4):
        out = torch.full((len(expected) + misalign + 16,), 0xEE, dtype=torch.uint8)[misalign:]
        slot = torch.zeros(1, dtype=torch.int64)
        plan.pack(out, slot)
        assert raw_bytes(out[: len(expected)]) == expected and slot_value(slot) == value
        assert (out[len(expected) :] == 0xEE).all()  # bytes beyond the region untouched
        chunked = torch.empty(len(expected), dtype=torch.uint8)
        assert pack.pack(tensors, chunked) == value  # the host backends agree
        restored = [torch.full_like(t, 3) for t in tensors]
        restored[-1] = torch.empty(9, dtype=torch.bfloat16)[1:]
        slot.zero_()
        plan_of(restored, slab_rows).unpack(out, slot)
        assert slot_value(slot) == value
        assert all(raw_bytes(a) == raw_bytes(b) for a, b in zip(tensors, restored))


@pytest.mark.timeout(60)
def test_an_empty_shard_packs_to_nothing_with_checksum_zero() -> None:
    plan = plan_of([torch.empty(0)], whole_buffer.SLAB_ROWS)
    slot = torch.full((1,), 5, dtype=torch.int64)
    out = torch.full((16,), 0xEE, dtype=torch.uint8)
    plan.pack(out, slot)
    assert slot_value(slot) == 0 and (out == 0xEE).all()


VIEWS = {"aten::slice", "aten::view", "aten::select", "aten::as_strided"}


def aten_ops_per_pack(nbytes: int, slab_rows: int = whole_buffer.SLAB_ROWS) -> int:
    """Top-level torch ops of one pack that do work (views left out): on a GPU, kernels."""
    tensors = [torch.randn(nbytes // 8 + 5), torch.randn(nbytes // 8 - 3)]  # with a tail
    plan = plan_of(tensors, slab_rows)
    out = torch.empty(plan.nbytes, dtype=torch.uint8)
    slot = torch.zeros(1, dtype=torch.int64)
    plan.pack(out, slot)  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        plan.pack(out, slot)
    # an op's internal calls (cat's resize, sum's out handling) are its own
    top = [event.name for event in prof.events() if event.cpu_parent is None]
    return sum(1 for name in top if name not in VIEWS)


@pytest.mark.timeout(120)
def test_the_number_of_torch_ops_per_pack_does_not_grow_with_the_buffer() -> None:
    """The chunked scheme issues ~8 ops per 4 MiB (~2,900 launches at 1.5 GB); this one a
    fixed handful plus two per 64 MiB slab: 11 at 64 KiB and at 16 MiB (one slab)."""
    small, large = aten_ops_per_pack(64 << 10), aten_ops_per_pack(16 << 20)
    assert small == large == 11
    assert aten_ops_per_pack(64 << 10, slab_rows=16) == small + 3 * 2  # 64 rows: 4 slabs


@pytest.mark.timeout(30)
def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        whole_buffer.DeviceChecksum(6, CPU)
    with pytest.raises(ValueError, match="slab_rows"):
        whole_buffer.DeviceChecksum(8, CPU, 0)
    with pytest.raises(ValueError, match="sources cover"):
        whole_buffer.WholeBufferPlan([torch.empty(4, dtype=torch.uint8)], [], 8, CPU)


# ---------------------------------------------------------------------------------------------
# Memory traffic per round (bench.traffic): what a GPU's time follows


def round_traffic(nbytes: int, checksum: str) -> tuple[float, int]:
    """One fallback pack over a shard of about `nbytes`: bytes moved / a plain copy's, ops."""
    from megatron_deadpool.bench import traffic

    tensors = [torch.randn(nbytes // 8 + 5), torch.randn(nbytes // 8 - 3)]  # with a tail
    plan = pack.whole_buffer_plan(tensors, checksum)
    out = torch.empty(plan.nbytes, dtype=torch.uint8)
    slot = torch.zeros(1, dtype=torch.int64)
    counted = traffic.measure(lambda: plan.pack(out, slot))
    return counted.nbytes / (2 * plan.nbytes), counted.ops


@pytest.mark.timeout(120)
def test_the_torch_ops_move_three_and_a_half_copies_per_pack() -> None:
    """The copy (2N), then per slab the int32 words converted into the float64 scratch (N + 2N)
    and one product reading it for both sums of every row (2N); the row sums' combination
    adds ~N/11 (it was 4.52 copies with an int64 scratch and separate row and column sums)."""
    for nbytes in (1 << 20, 4 << 20):
        ratio, ops = round_traffic(nbytes, "torch")
        assert 3.5 < ratio < 3.55 and ops == 11


# ---------------------------------------------------------------------------------------------
# The Triton checksum (on the host under TRITON_INTERPRET=1, where triton is installed)


def triton_unusable() -> str:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "set TRITON_INTERPRET=1 (and install triton) to run the Triton kernel on the host"
    from megatron_deadpool.replication import triton_checksum

    return triton_checksum.unusable(CPU)


needs_triton = pytest.mark.skipif(bool(triton_unusable()), reason=triton_unusable())


@needs_triton
@pytest.mark.timeout(300)
def test_the_triton_checksum_matches_the_references_at_sizes_alignments_and_tails() -> None:
    from megatron_deadpool.replication import triton_checksum

    block = triton_checksum.BLOCK_WORDS * 4
    for nbytes in [0, 4, 12, block - 4, block, block + 4, 3 * block + 1000 * 4]:
        for misalign in range(4):
            buf = random_bytes(nbytes + misalign, seed=nbytes * 4 + misalign)[misalign:]
            slot = torch.full((1,), 7, dtype=torch.int64)
            triton_checksum.TritonChecksum(nbytes, CPU).enqueue(buf, slot)
            assert slot_value(slot) == ref_checksum_np(raw_bytes(buf)), (nbytes, misalign)
    nwords = 2 * triton_checksum.BLOCK_WORDS + 77
    for value in (-(2**31), 2**31 - 1):  # sums that wrap around 2**64 many times
        buf = torch.full((nwords,), value, dtype=torch.int32).view(torch.uint8)
        slot = torch.zeros(1, dtype=torch.int64)
        triton_checksum.TritonChecksum(buf.numel(), CPU).enqueue(buf, slot)
        assert slot_value(slot) == value * nwords * (nwords + 1) // 2 % 2**64


@needs_triton
@pytest.mark.timeout(300)
def test_a_plan_with_the_triton_checksum_packs_and_unpacks_bitwise() -> None:
    gen = torch.Generator().manual_seed(6)
    dtypes = [torch.float32, torch.bfloat16, torch.uint8, torch.int64]
    sizes = [5000, 3, 4096, 17, 0, 9000]
    tensors = [make_tensor(dtypes[i % len(dtypes)], n, gen) for i, n in enumerate(sizes)]
    expected = ref_pack(tensors)
    plan = pack.whole_buffer_plan(tensors, "triton")
    assert plan.checksum.kind == "Triton kernel"
    out = torch.full((len(expected) + 16,), 0xEE, dtype=torch.uint8)
    slot = torch.zeros(1, dtype=torch.int64)
    plan.pack(out, slot)
    assert raw_bytes(out[: len(expected)]) == expected
    assert slot_value(slot) == ref_checksum_py(expected) == pack.pack(tensors, out.clone())
    restored = [torch.full_like(t, 3) for t in tensors]
    slot.zero_()
    pack.whole_buffer_plan(restored, "triton").unpack(out, slot)
    assert slot_value(slot) == ref_checksum_py(expected)
    assert all(raw_bytes(a) == raw_bytes(b) for a, b in zip(tensors, restored))


@needs_triton
@pytest.mark.timeout(300)
def test_with_the_triton_checksum_a_pack_moves_one_and_a_half_copies_in_three_ops() -> None:
    """Issue 39's bound by construction (a round within 2x a plain copy): the copy (2N) and
    the words read once (N), in the same three ops at any size - not chunk by chunk."""
    for nbytes in (1 << 20, 8 << 20):
        ratio, ops = round_traffic(nbytes, "triton")
        assert ratio < 1.501 and ops == 3


@needs_triton
@pytest.mark.timeout(120)
def test_a_triton_kernel_that_computes_a_wrong_checksum_is_not_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from megatron_deadpool.replication import triton_checksum

    def wrong(words: torch.Tensor, partials: torch.Tensor) -> None:
        partials.fill_(1)

    monkeypatch.setattr(triton_checksum, "_checksum_blocks_op", wrong)
    monkeypatch.setattr(triton_checksum, "_verdicts", {})
    reason = triton_checksum.unusable(CPU)
    assert "the kernel's checksum on cpu is wrong" in reason and "is wrong" in caplog.text
    with pytest.raises(pack.PackError, match="cannot run on cpu: the kernel's checksum"):
        pack.fallback_checksum(64, CPU, "triton")


@pytest.mark.timeout(60)
def test_the_checksum_kind_is_checked_and_auto_keeps_host_memory_on_the_torch_ops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert isinstance(pack.fallback_checksum(64, CPU), whole_buffer.DeviceChecksum)
    assert pack.fallback_checksum(64, CPU, "torch").kind == "torch ops"
    with pytest.raises(pack.PackError, match="'fast' is not one of auto, torch, triton"):
        pack.fallback_checksum(64, CPU, "fast")
    monkeypatch.setenv("DEADPOOL_PACK_TRITON", "0")
    with pytest.raises(pack.PackError, match="turned off by DEADPOOL_PACK_TRITON=0"):
        pack.fallback_checksum(64, CPU, "triton")
    monkeypatch.delenv("DEADPOOL_PACK_TRITON")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(pack.PackError, match="cpu is not a CUDA device"):
        pack.fallback_checksum(64, CPU, "triton")
