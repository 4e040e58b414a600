"""The checksum of a host buffer on several threads, at memory speed.

A holder verifies every replica it holds in host memory by its checksum (`snapshot.verify`):
GiBs per step. On one core (numpy, 1.0-1.3 s for 2 GiB on an H200 node) a rank holding 9 GiB
of replicas made every step wait ~5 s for its verification. This module computes the same
value (`pack`'s module docstring) split over a bounded pool of threads:

    sum_{k=0}^{n-1} (k + 1) w_k  =  sum over ranges [lo, hi) of
        ( sum_{k<hi-lo} (k + 1) w_{lo+k}  +  lo * sum_{k<hi-lo} w_{lo+k} )      (mod 2**64)

and the same again per cache-sized chunk inside a range, so each chunk is read twice while it
is in cache: once by ``np.einsum`` with the uint64 weights 1..m (int32 words sign-extended to
uint64: products and sums wrap exactly mod 2**64) and once by an int64 sum (exact: at most
2**19 words of at most 2**31). Python ints combine the parts. ``np.einsum`` and ``sum`` release
the GIL (measured: a Python loop on the main thread kept running through a 0.66 s einsum as
through a sleep), so the threads run in parallel.

The threads are DeadPool's own: one pool per process of at most `thread_count` threads, shared
by every caller (concurrent verifications queue for it rather than multiply it), never an
OpenMP team (whose spinning threads cost 27-220 s of CPU beside the training, `pack.checksum`).
They touch host memory only, never the CUDA runtime.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from ..devices.threads import pool
from ..errors import ConfigError
from . import pack

CHUNK_WORDS = 512 << 10
"""Words per chunk (2 MiB): read by both sums while in cache."""
RANGE_MIN_WORDS = 8 * CHUNK_WORDS
"""A buffer is split only into ranges of at least this many words (16 MiB): below it the
threads' hand-off costs more than it saves."""
THREADS_ENV = "DEADPOOL_CHECKSUM_THREADS"
DEFAULT_MAX_THREADS = 4
MAX_THREADS = 64
_MASK64 = (1 << 64) - 1


def thread_count() -> int:
    """Threads of the pool: `THREADS_ENV` when set (1..64), else the cores this process may
    run on, at most `DEFAULT_MAX_THREADS` (eight ranks of a node share its cores)."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if not 1 <= value <= MAX_THREADS:
            raise ConfigError(
                f"{THREADS_ENV}={raw!r}: must be a whole number of threads from 1 to "
                f"{MAX_THREADS}; unset it for the default"
            )
        return value
    return max(1, min(DEFAULT_MAX_THREADS, len(os.sched_getaffinity(0))))


class _Pool:
    """The process's checksum threads, created on first use (and again in a forked child,
    which inherits the pool object but not its threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool = pool(thread_count(), "deadpool-checksum")
                self._pid = os.getpid()
            return self._pool


_POOL = _Pool()


def _range_sum(buf: torch.Tensor, lo: int, hi: int) -> int:
    """sum_{k in [lo, hi)} (k + 1) w_k mod 2**64, chunk by chunk (module docstring): pack's
    host accumulator, each thread with its own weights (`pack._SCRATCH` is per thread)."""
    acc = pack._NumpyAccumulator()
    for start in range(lo, hi, CHUNK_WORDS):
        stop = min(start + CHUNK_WORDS, hi)
        acc.feed(start, buf[start * pack.WORD_BYTES : stop * pack.WORD_BYTES])
    return acc.result()


def ranges(nwords: int, threads: int) -> list[tuple[int, int]]:
    """The word ranges [lo, hi) an `nwords`-word buffer is split into for `threads` threads:
    whole chunks, at least `RANGE_MIN_WORDS` each (one range for small buffers)."""
    if nwords == 0:
        return []
    parts = max(1, min(threads, nwords // RANGE_MIN_WORDS))
    per = -(-nwords // parts)
    per = -(-per // CHUNK_WORDS) * CHUNK_WORDS
    return [(lo, min(lo + per, nwords)) for lo in range(0, nwords, per)]


def checksum(buf: torch.Tensor, *, threads: int | None = None) -> int:
    """`pack.checksum` of a host buffer (1-D contiguous uint8, a multiple of 4 bytes, at most
    `pack.MAX_PACKED_BYTES`), on up to `threads` threads of the pool (default
    `thread_count`; 1: on the calling thread alone)."""
    if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu":
        where = buf.device if isinstance(buf, torch.Tensor) else type(buf).__name__
        raise pack.PackError(f"parallel checksum: the buffer must be in host memory, not {where}")
    pack._check_flat(buf, "checksum")  # what pack.checksum refuses, in its words
    if buf.numel() % pack.WORD_BYTES:
        raise pack.PackError(f"checksum buffer length {buf.numel()} B is not a multiple of 4")
    pack._check_size(buf.numel())
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"threads: {threads} is not from 1 to {MAX_THREADS}")
    parts = ranges(buf.numel() // pack.WORD_BYTES, thread_count() if threads is None else threads)
    if len(parts) <= 1:
        return sum(_range_sum(buf, lo, hi) for lo, hi in parts) & _MASK64
    pool = _POOL.get()
    futures = [pool.submit(_range_sum, buf, lo, hi) for lo, hi in parts]
    return sum(f.result() for f in futures) & _MASK64
