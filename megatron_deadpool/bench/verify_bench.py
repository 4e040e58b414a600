"""Benchmark of a held host replica's verification: one core against the checksum threads.

A holder checksums every replica it holds in host memory each round (`replication.verifier`).
For each size (default 2 and 9 GiB: one replica of a 2 GiB shard, and a rank holding 9 GiB)
a buffer of random bytes is checksummed by:

* ``one core``: `pack.checksum(..., one_core=True)`, the verifier's path before
  `parallel_checksum` (numpy on the calling thread);
* ``N threads``: `parallel_checksum.checksum(..., threads=N)` for each N asked for (default 1,
  2 and `parallel_checksum.thread_count()`).

Runs are interleaved, repeated, and every result is checked equal to the one-core value; the
table gives seconds and GB/s (median of the repeats, best in brackets) and the machine's core
count and load, since the figure is a memory-bandwidth one that depends on them, and the CPU
seconds of the process (their ratio to the seconds: the cores the threads did run on at once;
on a loaded machine the wall time cannot show the split). Used as
``deadpool bench pack --verify`` and ``python -m megatron_deadpool.bench.verify_bench``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..config.numbers import number_arg
from ..replication import pack, parallel_checksum
from .report import write_json

DEFAULT_SIZES_GIB = (2.0, 9.0)
DEFAULT_REPEATS = 3
_BLOCK = 64 << 20


def _random_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` (a multiple of 4) of random bytes: a 64 MiB random block, repeated."""
    gen = torch.Generator().manual_seed(0)
    block = torch.randint(0, 256, (min(_BLOCK, nbytes),), dtype=torch.uint8, generator=gen)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for at in range(0, nbytes, block.numel()):
        n = min(block.numel(), nbytes - at)
        buf[at : at + n] = block[:n]
    return buf


def _measure(size_gib: float, repeats: int, threads: Sequence[int]) -> dict[str, Any]:
    nbytes = int(size_gib * (1 << 30)) // 4 * 4
    buf = _random_buffer(nbytes)
    runs: dict[str, list[float]] = {"one core": []}
    runs.update({f"{n} threads": [] for n in threads})
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    expected: int | None = None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        value = pack.checksum(buf, one_core=True)
        runs["one core"].append(time.perf_counter() - t0)
        cpu["one core"].append(time.process_time() - c0)
        expected = value if expected is None else expected
        if value != expected:
            raise AssertionError("pack.checksum is not deterministic")
        for n in threads:
            t0, c0 = time.perf_counter(), time.process_time()
            value = parallel_checksum.checksum(buf, threads=n)
            runs[f"{n} threads"].append(time.perf_counter() - t0)
            cpu[f"{n} threads"].append(time.process_time() - c0)
            if value != expected:
                raise AssertionError(f"parallel checksum on {n} threads differs from pack's")
    del buf
    rows = {
        name: {
            "median_s": statistics.median(times),
            "best_s": min(times),
            "median_gbps": nbytes / statistics.median(times) / 1e9,
            "best_gbps": nbytes / min(times) / 1e9,
            "cpu_s": statistics.median(cpu[name]),
        }
        for name, times in runs.items()
    }
    return {"size_gib": size_gib, "nbytes": nbytes, "rows": rows}


def run_verify_bench(
    sizes_gib: Sequence[float], repeats: int, threads: Sequence[int] | None = None
) -> dict[str, Any]:
    """Measure every size; `threads`: thread counts of the parallel checksum."""
    counts = sorted(set(threads or (1, 2, parallel_checksum.thread_count())))
    return {
        "cores": len(os.sched_getaffinity(0)),
        "load_1min": os.getloadavg()[0],
        "threads": counts,
        "sizes": [_measure(size, repeats, counts) for size in sizes_gib],
    }


def format_table(result: dict[str, Any]) -> str:
    title = (
        f"verification of a host replica ({result['cores']} cores, "
        f"1-minute load {result['load_1min']:.1f})"
    )
    lines = [
        title,
        f"{'size':>8}  {'checksum on':<12} {'seconds':>16} {'GB/s':>16} {'CPU s':>7}",
    ]
    for size in result["sizes"]:
        for name, row in size["rows"].items():
            lines.append(
                f"{size['size_gib']:>6g} G  {name:<12} "
                f"{row['median_s']:>7.3f} ({row['best_s']:6.3f}) "
                f"{row['median_gbps']:>7.2f} ({row['best_gbps']:6.2f}) {row['cpu_s']:>7.3f}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``deadpool bench pack --verify [--sizes-gib 2 9] [--threads 1 2 4]``."""
    parser = argparse.ArgumentParser(
        prog="deadpool bench pack --verify",
        description="Checksum of a held host replica: one core vs DeadPool's checksum threads.",
    )
    parser.add_argument(
        "--sizes-gib", type=number_arg(above=0), nargs="+", default=list(DEFAULT_SIZES_GIB)
    )
    parser.add_argument(
        "--repeats", type=number_arg(integer=True, minimum=1), default=DEFAULT_REPEATS
    )
    parser.add_argument(
        "--threads",
        type=number_arg(integer=True, minimum=1, maximum=parallel_checksum.MAX_THREADS),
        nargs="+",
        default=None,
        help="thread counts of the parallel checksum (default: 1 2 and the pool's size)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    result = run_verify_bench(args.sizes_gib, args.repeats, args.threads)
    print(format_table(result))
    print("median of repeats (best in brackets); every result equal to pack.checksum's")
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
