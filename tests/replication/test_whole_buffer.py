"""Tests of megatron_deadpool.replication.whole_buffer: the torch fallback's whole-buffer pack
and checksum, which GPUs without the fused kernel use.

The scheme is plain torch, so it runs here on host tensors (built directly, as `pack` builds
it for GPU memory) against the references of test_pack.py: bytes and checksums bit-identical
at many sizes, alignments and tails, sums that wrap around 2**64 many times, and a number of
torch ops per pack that does not grow with the buffer (within a slab).
"""

from __future__ import annotations

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
    fixed handful plus three per 64 MiB slab: 13 at 64 KiB and at 16 MiB (one slab)."""
    small, large = aten_ops_per_pack(64 << 10), aten_ops_per_pack(16 << 20)
    assert small == large == 13
    assert aten_ops_per_pack(64 << 10, slab_rows=16) == small + 3 * 3  # 64 rows: 4 slabs


@pytest.mark.timeout(30)
def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        whole_buffer.DeviceChecksum(6, CPU)
    with pytest.raises(ValueError, match="slab_rows"):
        whole_buffer.DeviceChecksum(8, CPU, 0)
    with pytest.raises(ValueError, match="sources cover"):
        whole_buffer.WholeBufferPlan([torch.empty(4, dtype=torch.uint8)], [], 8, CPU)
