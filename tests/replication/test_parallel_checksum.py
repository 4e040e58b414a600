"""`parallel_checksum.checksum` is `pack.checksum`, bit for bit, however the buffer is split,
and verification of held host replicas runs on the bounded checksum threads."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
import torch

from megatron_deadpool.replication import pack
from megatron_deadpool.replication import parallel_checksum as pc


def _buffer(nbytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    # Extreme words too: -1, INT_MIN, INT_MAX, 0 (wraparound of the uint64 products).
    extremes = torch.tensor([-1, -(2**31), 2**31 - 1, 0], dtype=torch.int32).view(torch.uint8)
    for at in (0, nbytes // 2 - nbytes // 2 % 4, max(0, nbytes - 16)):
        n = min(16, nbytes - at)
        buf[at : at + n] = extremes[:n]
    return buf


@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize("offset", [0, 1, 2, 3, 4])
def test_equal_to_pack_checksum_at_odd_sizes_offsets_and_splits(
    monkeypatch: pytest.MonkeyPatch, threads: int, offset: int
) -> None:
    # Small chunks and ranges: many of both, boundaries everywhere, in a few hundred KB.
    monkeypatch.setattr(pc, "CHUNK_WORDS", 1000)
    monkeypatch.setattr(pc, "RANGE_MIN_WORDS", 3000)
    for words in (0, 1, 999, 1000, 1001, 2999, 3000, 3001, 12_345, 64_001):
        base = _buffer(words * 4 + offset, seed=words)
        buf = base[offset:]  # an unaligned start when offset % 4
        assert pc.checksum(buf, threads=threads) == pack.checksum(buf), (words, offset, threads)
    assert len(pc.ranges(64_001, threads)) == min(threads, 64_001 // 3000)


@pytest.mark.timeout(120)
def test_equal_at_full_size_on_several_threads() -> None:
    base = _buffer(40 * (1 << 20) + 4 * 7 + 3, seed=5)  # 40 MiB + 7 words, unaligned start
    buf = base[3:]
    assert len(pc.ranges(buf.numel() // 4, 4)) == 2  # 16 MiB ranges at least
    assert pc.checksum(buf, threads=4) == pack.checksum(buf) == pc.checksum(buf, threads=1)
    buf[12_345_678] ^= 1 << 3  # one flipped bit changes it
    assert pc.checksum(buf, threads=4) == pack.checksum(buf)


def test_refuses_what_pack_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(pack.PackError, match="multiple of 4"):
        pc.checksum(torch.zeros(6, dtype=torch.uint8))
    for bad in (
        torch.zeros(4, dtype=torch.int32),
        torch.zeros(2, 4, dtype=torch.uint8),
        torch.zeros(16, dtype=torch.uint8)[::2],
    ):  # refused in pack's own words
        with pytest.raises(pack.PackError) as refused:
            pack.checksum(bad)
        with pytest.raises(pack.PackError, match=re.escape(str(refused.value))):
            pc.checksum(bad)
    with pytest.raises(ValueError, match="threads"):
        pc.checksum(torch.zeros(4, dtype=torch.uint8), threads=0)
    monkeypatch.setenv(pc.THREADS_ENV, "lots")
    with pytest.raises(ValueError, match="DEADPOOL_CHECKSUM_THREADS='lots'"):
        pc.thread_count()
    monkeypatch.setenv(pc.THREADS_ENV, "3")
    assert pc.thread_count() == 3


@pytest.mark.timeout(120)
def test_verify_of_a_host_replica_runs_on_the_checksum_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`snapshot.verify` splits a large host replica over the pool (the verifier's and the
    CPU mode's path) and still finds a flipped bit; `one_core` keeps it on the caller."""
    from megatron_deadpool.replication.snapshot import (
        HEADER_BYTES,
        CorruptReplicaError,
        Header,
        verify,
    )

    payload = _buffer(48 << 20, seed=9)
    header = Header(owner=1, iteration=4, nbytes=payload.numel(), checksum=pack.checksum(payload),
                    meta_nbytes=4096)  # fmt: skip
    flat = torch.cat([payload, torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)])
    assert flat.numel() == payload.numel() + HEADER_BYTES
    seen: list[str] = []
    real = pc._range_sum

    def recording(*args: Any) -> int:
        seen.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(pc, "_range_sum", recording)
    monkeypatch.setenv(pc.THREADS_ENV, "3")
    monkeypatch.setattr(pc, "_POOL", pc._Pool())
    assert verify(flat, owner=1, iteration=4) == header
    assert len(seen) == 3 and all(name.startswith("deadpool-checksum") for name in seen), seen
    seen.clear()
    assert verify(flat, owner=1, iteration=4, one_core=True) == header
    assert seen == [threading.current_thread().name]
    flat[(40 << 20) + 3] ^= 1
    with pytest.raises(CorruptReplicaError, match="checksum mismatch"):
        verify(flat, owner=1, iteration=4)


@pytest.mark.timeout(120)
def test_the_verify_bench_runs_and_checks_its_results(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_deadpool.bench import pack_bench

    argv = ["--verify", "--sizes-gib", "0.02", "--repeats", "1", "--threads", "1", "2"]
    assert pack_bench.main(argv) == 0  # `deadpool bench pack --verify ...`
    out = capsys.readouterr().out
    assert "one core" in out and "2 threads" in out and "equal to pack.checksum" in out
