"""Benchmark of the snapshot pack: pack + checksum bandwidth against a plain copy.

For each shard size a synthetic optimizer shard is built (fp32 main params, exp_avg and
exp_avg_sq of equal size, a bf16 tensor and an int64 step) and timed:

* ``copy``: ``out.copy_(src)`` of the same number of bytes from one contiguous buffer - the
  memory-bandwidth limit any pack is measured against;
* ``pack``: `megatron_deadpool.pack.pack` (copy into the packed layout + checksum);
* ``unpack``: `megatron_deadpool.pack.unpack` (scatter back + checksum);
* ``checksum``: `megatron_deadpool.pack.checksum` of the packed region alone;
* on CUDA also ``pack_host_ms``: the host time of enqueueing a pack without waiting
  (`PackPlan.pack_on_device`), with the fused kernel or the torch fallback
  (``DEADPOOL_PACK_BACKEND=torch``).

Runs are interleaved (copy, pack, unpack, checksum, repeat) so that load from elsewhere on the
machine hits all of them alike; the best and the median of the repeats are kept and the ratio
``pack / copy`` uses the medians. On CPU every size runs once per torch thread count (default
and 1). Used as ``deadpool bench pack`` and ``python -m megatron_deadpool.bench.pack_bench``;
``deadpool bench pack --verify`` runs `verify_bench` instead (a held replica's verification).

``deadpool bench pack --traffic`` times nothing: it counts (`traffic`) the bytes that the torch
fallback's GPU round (`pack.whole_buffer_plan`: pack, unpack, checksum) moves through memory
and its number of ops, built on the host - the same ops and shapes as on a GPU, where a round
is memory-bound and its time follows those bytes - against a plain copy of the same N bytes
(2N, one op). The figures are exact and the same on every machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..config.numbers import number_arg
from ..replication import pack
from . import traffic
from .report import write_json

DEFAULT_SIZES_MB = (64, 256)
DEFAULT_REPEATS = 7


def make_shard(nbytes: int, device: torch.device) -> list[torch.Tensor]:
    """A shard of about `nbytes`: three equal fp32 tensors, a bf16 tensor and an int64 step."""
    fp32 = max(1, nbytes // 4 // 3 - 64)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(fp32, generator=gen) for _ in range(3)]
    tensors.append(torch.randn(125, generator=gen).to(torch.bfloat16))
    tensors.append(torch.tensor(1000, dtype=torch.int64))
    return [t.to(device) for t in tensors]


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    def run(fn: Callable[[], Any]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    return run


def _measure(size_mb: float, repeats: int, device: torch.device) -> dict[str, Any]:
    tensors = make_shard(int(size_mb * 2**20), device)
    total = pack.packed_nbytes(tensors)
    out = torch.empty(total, dtype=torch.uint8, device=device)
    src = torch.randint(0, 256, (total,), dtype=torch.uint8).to(device)
    restored = [torch.empty_like(t) for t in tensors]
    cases: dict[str, Callable[[], Any]] = {
        "copy": lambda: out.copy_(src),
        "pack": lambda: pack.pack(tensors, out),
        "unpack": lambda: pack.unpack(out, restored),
        "checksum": lambda: pack.checksum(out),
    }
    timer = _timer(device)
    for fn in cases.values():  # warm up: page faults, scratch buffers, kernel loading
        timer(fn)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            times[name].append(timer(fn))
    checksum = pack.pack(tensors, out)
    if pack.unpack(out, restored) != checksum or pack.checksum(out) != checksum:
        raise RuntimeError("pack, unpack and checksum disagree")
    row: dict[str, Any] = {
        "size_mb": round(total / 2**20, 3),
        "nbytes": total,
        "device": str(device),
        "backend": pack.backend_for(out),
        "threads": torch.get_num_threads(),
    }
    for name, samples in times.items():
        row[f"{name}_gbps"] = total / statistics.median(samples) / 1e9
        row[f"{name}_best_gbps"] = total / min(samples) / 1e9
    row["ratio"] = row["pack_gbps"] / row["copy_gbps"]
    row["ratio_best"] = row["pack_best_gbps"] / row["copy_best_gbps"]
    row["pack_host_ms"] = _enqueue_ms(tensors, out, repeats) if device.type == "cuda" else None
    return row


def _enqueue_ms(tensors: list[torch.Tensor], out: torch.Tensor, repeats: int) -> float:
    """Median host time of enqueueing one pack on a GPU (`PackPlan.pack_on_device`, no sync):
    what a replication round holds the training thread for."""
    plan = pack.PackPlan(tensors, out.device)
    plan.pack_on_device(out)  # warm up (the torch fallback also logs its warning here)
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize(out.device)
        start = time.perf_counter()
        plan.pack_on_device(out)
        samples.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize(out.device)
    return statistics.median(samples)


def run_pack_bench(
    sizes_mb: Sequence[float] = DEFAULT_SIZES_MB,
    repeats: int = DEFAULT_REPEATS,
    device: str = "cpu",
    threads: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Time copy vs pack/unpack/checksum for each size (and each CPU thread count).

    `threads` defaults to ``[torch default, 1]`` on CPU; it is ignored on CUDA. Returns
    ``{"device", "torch", "rows": [...]}``, one row per (size, threads) with bandwidths in GB/s
    (median and best of `repeats`) and ``ratio`` = pack / copy.
    """
    dev = torch.device(device)
    default_threads = torch.get_num_threads()
    if dev.type != "cpu":
        counts = [default_threads]
    else:
        counts = list(threads) if threads else sorted({default_threads, 1}, reverse=True)
    rows = []
    try:
        for count in counts:
            torch.set_num_threads(count)
            for size in sizes_mb:
                rows.append(_measure(size, repeats, dev))
    finally:
        torch.set_num_threads(default_threads)
    return {"device": str(dev), "torch": torch.__version__, "repeats": repeats, "rows": rows}


def traffic_rows(
    sizes_mb: Sequence[float] = DEFAULT_SIZES_MB, device: str = "cpu"
) -> list[dict[str, Any]]:
    """Per size and per checksum the torch fallback can run on `device` (the torch ops always;
    the Triton kernel where it is usable, on the host only under ``TRITON_INTERPRET=1``): the
    bytes and ops of one round, counted (`traffic`) on a shard of that size."""
    dev = torch.device(device)
    kinds = ["torch"]
    if dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        from ..replication import triton_checksum

        if not triton_checksum.unusable(dev):
            kinds.append("triton")
    return [_traffic_row(size, dev, kind) for size in sizes_mb for kind in kinds]


def _traffic_row(size_mb: float, device: torch.device, kind: str) -> dict[str, Any]:
    """``pack``, ``unpack`` and ``checksum`` of one round as multiples of N (the packed bytes),
    ``*_ratio`` against a plain copy's 2N, ``*_ops``, and ``pack_hidden`` (bytes through
    temporaries the ops allocate themselves, in N)."""
    plan = pack.whole_buffer_plan(make_shard(int(size_mb * 2**20), device), kind)
    total = plan.nbytes
    out = torch.empty(total, dtype=torch.uint8, device=device)
    slot = torch.zeros(1, dtype=torch.int64, device=device)
    src = torch.zeros(total, dtype=torch.uint8, device=device)
    copy = traffic.measure(lambda: out.copy_(src))
    rounds = {
        "pack": traffic.measure(lambda: plan.pack(out, slot)),
        "unpack": traffic.measure(lambda: plan.unpack(out, slot)),
        "checksum": traffic.measure(lambda: plan.checksum.enqueue(out, slot)),
    }
    row: dict[str, Any] = {"size_mb": round(total / 2**20, 3), "nbytes": total, "checksum_by": kind}
    row["copy"], row["copy_ops"] = copy.nbytes / total, copy.ops
    for name, counted in rounds.items():
        row[name] = counted.nbytes / total
        row[f"{name}_ratio"] = counted.nbytes / copy.nbytes
        row[f"{name}_ops"] = counted.ops
    row["pack_hidden"] = rounds["pack"].hidden_bytes / total
    return row


def format_traffic(rows: Sequence[dict[str, Any]]) -> str:
    """The rows of `traffic_rows` as a fixed-width table."""
    header = (
        f"{'size MB':>8} {'checksum':>8} {'copy':>12} {'pack':>16} {'unpack':>16} {'checksum':>16} "
        f"{'pack/copy':>9} {'hidden':>7}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:

        def cell(name: str, row: dict[str, Any] = row) -> str:
            return f"{row[name]:6.2f}N {row[name + '_ops']:4d} ops"

        lines.append(
            f"{row['size_mb']:8.1f} {row['checksum_by']:>8} {row['copy']:5.2f}N {row['copy_ops']:2d} op {cell('pack')} "
            f"{cell('unpack')} {cell('checksum')} {row['pack_ratio']:9.2f} "
            f"{row['pack_hidden']:6.2f}N"
        )
    return "\n".join(lines)


def format_table(result: dict[str, Any]) -> str:
    """The rows of `run_pack_bench` as a fixed-width table (GB/s, medians; best in brackets)."""
    header = (
        f"{'size MB':>8} {'thr':>3} {'backend':>7} {'copy':>14} {'pack+cksum':>14} "
        f"{'unpack':>14} {'checksum':>14} {'pack/copy':>9}"
    )
    lines = [header, "-" * len(header)]
    for row in result["rows"]:

        def cell(name: str, row: dict[str, Any] = row) -> str:
            return f"{row[name + '_gbps']:6.2f} ({row[name + '_best_gbps']:5.2f})"

        lines.append(
            f"{row['size_mb']:8.1f} {row['threads']:3d} {row['backend']:>7} {cell('copy')} "
            f"{cell('pack')} {cell('unpack')} {cell('checksum')} {row['ratio']:9.2f}"
            + ("" if row.get("pack_host_ms") is None else f"  host {row['pack_host_ms']:.2f} ms")
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``deadpool bench pack [--sizes-mb 64 256] [--json PATH] [--traffic]``."""
    parser = argparse.ArgumentParser(
        prog="deadpool bench pack",
        description="Bandwidth of snapshot pack + checksum vs a plain copy of the same bytes.",
    )
    parser.add_argument(
        "--sizes-mb", type=number_arg(above=0), nargs="+", default=list(DEFAULT_SIZES_MB)
    )
    parser.add_argument(
        "--repeats", type=number_arg(integer=True, minimum=1), default=DEFAULT_REPEATS
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--threads", type=int, nargs="+", default=None, help="CPU thread counts (default: N 1)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument(
        "--traffic",
        action="store_true",
        help="instead of timing: count the bytes and ops of the torch fallback's GPU round "
        "against a plain copy (exact, the same on any machine)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="instead: a held host replica's verification, one core vs DeadPool's checksum "
        "threads (`verify_bench`; its options follow, see --verify --help)",
    )
    if argv is None:
        argv = sys.argv[1:]
    if "--verify" in argv:
        from . import verify_bench

        return verify_bench.main([a for a in argv if a != "--verify"])
    args = parser.parse_args(argv)
    if args.traffic:
        rows = traffic_rows(args.sizes_mb, args.device)
        print(format_traffic(rows))
        print(
            "Bytes each round's torch ops read and write (N = packed bytes; a plain copy moves "
            "2N), counted op by op: the torch fallback a GPU without the kernel runs."
        )
        if args.json:
            write_json(args.json, {"torch": torch.__version__, "traffic": rows})
        return 0
    result = run_pack_bench(args.sizes_mb, args.repeats, args.device, args.threads)
    print(format_table(result))
    print("GB/s: median of repeats (best in brackets); pack/copy uses the medians.")
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
