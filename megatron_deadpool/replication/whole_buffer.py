"""The torch fallback for device memory: pack and checksum with a handful of whole-buffer ops.

Where the fused kernel (`pack`'s ``cuda`` backend) is not available, GPU memory is packed and
checksummed with torch ops. Feeding it in cache-sized chunks, as the host backends do, costs
thousands of small kernel launches (358 chunks and ~2,900 launches for 1.5 GB: 24 ms of host
time); here every step works on the whole buffer, or on slabs of up to `SLAB_ROWS` rows, and
the result stays on the device:

* the copy is one ``torch.cat`` of the tensors' byte views and the zero padding between them
  into the output (torch batches its inputs into a few copy kernels);
* the checksum (definition in `pack`) uses the row identity with ``L = ROW_WORDS`` words per
  row: for ``k = g * L + c``::

      sum_k (k + 1) w_k = sum_g (g * L) * rowsum_g + sum_g weighted_g + tail,
      rowsum_g = sum_c w_gc,   weighted_g = sum_c (c + 1) w_gc

  Per slab, the int32 words are converted into a float64 scratch (torch reduces int32 into
  int64 only through such a copy, which ``sum(dtype=int64)`` would allocate for the whole
  buffer; the slab bounds it to ``SLAB_ROWS * L * 8`` = 128 MiB), and one matrix product with
  the ``[L, 2]`` weights ``(1, c + 1)`` reads it once for both sums of every row: two ops per
  slab. The sums are converted to int64 and combined on the device into a caller's int64
  slot, so nothing waits for the GPU: the caller reads the slot when it needs the value. A
  pack moves 7N bytes this way (the copy 2N, the conversion 3N, the product 2N), 3.5 times a
  plain copy's; `triton_checksum` does the checksum in one read of the words instead.

Exactness. Every value the float64 product forms is an integer of magnitude below 2**53, so
float64 holds it exactly whatever the order of the additions (cuBLAS's and MKL's blocking
included): ``|w (c + 1)| <= 2**31 * L = 2**39``, ``|rowsum| <= L * 2**31 = 2**39`` and
``|weighted| <= 2**31 * L (L + 1) / 2 < 2**46``. The weighted sums ``(g * L) * rowsum_g`` and
the totals can exceed 2**63, and they are meant to: torch's int64 multiply and add are the
machine's two's-complement operations (``mul.lo.s64``/``add.s64`` on the GPU, ``imul``/``add``
and their vector forms on the CPU), which are exact in the ring of integers mod ``2**64`` - the
checksum's own modulus. The tests check values whose sums wrap around many times.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

ROW_WORDS = 256
"""Words per row of the row/column scheme."""

SLAB_ROWS = 1 << 16
"""Rows converted at once: 64 MiB of words, a float64 scratch of 128 MiB."""

WORD_BYTES = 4
_MAX_SLAB_ROWS = 1 << 24  # 2**32 words at most: one slab holds any buffer


class Checksummer(Protocol):
    """What `WholeBufferPlan` checksums with: `DeviceChecksum` (torch ops) or
    `triton_checksum.TritonChecksum` (one kernel)."""

    nbytes: int
    kind: str
    """How it computes, for messages: ``torch ops`` or ``Triton kernel``."""

    def enqueue(self, buf: torch.Tensor, slot: torch.Tensor) -> None:
        """Enqueue the checksum of `buf` into the int64 [1] `slot`; nothing waits."""


class DeviceChecksum:
    """The checksum of buffers of `nbytes` bytes (a multiple of 4) on `device`, enqueued as
    torch ops into an int64 slot; the buffers and slot must stay alive until the ops ran."""

    def __init__(self, nbytes: int, device: torch.device, slab_rows: int = SLAB_ROWS) -> None:
        if nbytes < 0 or nbytes % WORD_BYTES:
            raise ValueError(f"nbytes {nbytes} must be a non-negative multiple of {WORD_BYTES}")
        if not 1 <= slab_rows <= _MAX_SLAB_ROWS:
            raise ValueError(f"slab_rows {slab_rows} must be in 1..{_MAX_SLAB_ROWS}")
        self.nbytes = nbytes
        self.device = device
        self.kind = "torch ops"
        nwords = nbytes // WORD_BYTES
        self.nrows = nwords // ROW_WORDS
        self.slabs = [
            (r0, min(r0 + slab_rows, self.nrows)) for r0 in range(0, self.nrows, slab_rows)
        ]
        int64, float64 = torch.int64, torch.float64
        self._sums = torch.empty(self.nrows, 2, dtype=float64, device=device)  # rowsum, weighted
        self._exact = torch.empty(self.nrows, 2, dtype=int64, device=device)
        self._weights = torch.stack([torch.ones(ROW_WORDS), torch.arange(1, ROW_WORDS + 1)], 1).to(
            device=device, dtype=float64
        )
        self._row_weights = (
            torch.arange(self.nrows, dtype=int64, device=device) * ROW_WORDS
        )  # g * L
        self._tail_weights = torch.arange(
            self.nrows * ROW_WORDS + 1, nwords + 1, dtype=int64, device=device
        )
        rows = min(slab_rows, self.nrows)
        self._wide = torch.empty(rows, ROW_WORDS, dtype=float64, device=device)
        self._bounce: torch.Tensor | None = None  # for buffers not 4-byte aligned
        self._parts = torch.empty(3, dtype=int64, device=device)

    def enqueue(self, buf: torch.Tensor, slot: torch.Tensor) -> None:
        """Enqueue the checksum of `buf` (1-D uint8, `nbytes` long, any alignment) into
        ``slot`` (int64 [1], the value's uint64 bits); nothing waits for the device."""
        if buf.numel() != self.nbytes or buf.dtype != torch.uint8:
            raise ValueError(f"buffer must be {self.nbytes} uint8 bytes, got {buf.numel()}")
        span = ROW_WORDS * WORD_BYTES
        with torch.no_grad():
            for r0, r1 in self.slabs:
                rows = r1 - r0
                wide = self._wide[:rows]
                wide.copy_(self._words(buf[r0 * span : r1 * span]).view(rows, ROW_WORDS))
                torch.mm(wide, self._weights, out=self._sums[r0:r1])
            if self.nrows:
                self._exact.copy_(self._sums)  # integers below 2**53: exact
                torch.sum(self._exact[:, 0] * self._row_weights, 0, out=self._parts[0])
                torch.sum(self._exact[:, 1], 0, out=self._parts[1])
            else:
                self._parts[:2].zero_()
            if self._tail_weights.numel():
                tail = self._words(buf[self.nrows * span :]).to(torch.int64)
                torch.sum(tail * self._tail_weights, 0, out=self._parts[2])
            else:
                self._parts[2].zero_()
            torch.sum(self._parts, 0, keepdim=True, out=slot)

    def _words(self, piece: torch.Tensor) -> torch.Tensor:
        """`piece` (uint8) as int32 words, through a bounce buffer if it is not 4-aligned."""
        if piece.storage_offset() % WORD_BYTES == 0:
            return piece.view(torch.int32)
        if self._bounce is None:
            size = min(self.nbytes, self._wide.shape[0] * ROW_WORDS * WORD_BYTES + 4 * 256)
            self._bounce = torch.empty(size, dtype=torch.uint8, device=self.device)
        bounce = self._bounce[: piece.numel()]
        bounce.copy_(piece)
        return bounce.view(torch.int32)


class WholeBufferPlan:
    """Pack and unpack of a fixed list of byte `sources` (the tensors' uint8 views and the zero
    padding between them, in packed order, covering exactly `nbytes`), checksummed by
    `checksum` (default: a `DeviceChecksum` with `slab_rows`).

    `copies` lists, for unpack, each tensor's byte range in the packed region and its uint8
    view: ``(start, stop, view)``."""

    def __init__(
        self,
        sources: Sequence[torch.Tensor],
        copies: Sequence[tuple[int, int, torch.Tensor]],
        nbytes: int,
        device: torch.device,
        slab_rows: int = SLAB_ROWS,
        checksum: Checksummer | None = None,
    ) -> None:
        if sum(s.numel() for s in sources) != nbytes:
            raise ValueError(f"sources cover {sum(s.numel() for s in sources)} B, not {nbytes}")
        if checksum is not None and checksum.nbytes != nbytes:
            raise ValueError(f"the checksum is for {checksum.nbytes} B, the plan packs {nbytes}")
        self.sources = list(sources)
        self.copies = list(copies)
        self.nbytes = nbytes
        self.checksum = (
            checksum if checksum is not None else DeviceChecksum(nbytes, device, slab_rows)
        )

    def pack(self, out: torch.Tensor, slot: torch.Tensor) -> None:
        """Enqueue the copy into ``out[:nbytes]`` and the checksum into `slot`."""
        region = out[: self.nbytes]
        with torch.no_grad():
            if self.sources:
                torch.cat(self.sources, out=region)
        self.checksum.enqueue(region, slot)

    def unpack(self, flat: torch.Tensor, slot: torch.Tensor) -> None:
        """Enqueue the checksum of ``flat[:nbytes]`` into `slot` and the copies back into the
        tensors (one fused ``_foreach_copy_``)."""
        self.checksum.enqueue(flat[: self.nbytes], slot)
        if self.copies:
            with torch.no_grad():
                torch._foreach_copy_(
                    [view for _, _, view in self.copies], [flat[a:b] for a, b, _ in self.copies]
                )
