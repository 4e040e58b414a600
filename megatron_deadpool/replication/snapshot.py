"""What a rank owns and how it becomes one flat, checksummed buffer.

A rank's state is its distributed-optimizer shard - for every inner optimizer of Megatron's
(chained) optimizer, every parameter the inner torch optimizer updates (the fp32 main-param
shard) and every tensor of its optimizer state (Adam's exp_avg, exp_avg_sq, step) - plus small
per-rank state: the iteration, RNG states and the LR scheduler's state (JSON, never pickle).
Model weights are not part of it: they are identical across data-parallel peers and are
re-derived from the main-param shards by Megatron's param all-gather.

Flat layout (see `pack.py` for the packed region and its checksum):
    [packed region: state tensors, RNG tensors, meta JSON (fixed size)] [header: 8 x int64]
The header carries magic, owner rank, iteration, packed size, checksum and the size of the
meta region, so a holder can verify a replica, and a newcomer read it, on its own.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

from ..devices.cpu import plain_torch
from ..errors import DeadpoolRuntimeError
from . import pack

MAGIC = 0x4445414450304F4C
HEADER_WORDS = 8
HEADER_BYTES = HEADER_WORDS * 8
META_ALIGN = 4096


class CorruptReplicaError(DeadpoolRuntimeError):
    """A snapshot or replica failed its checksum (or its header is not ours)."""


@dataclass(frozen=True)
class Header:
    """The trailer of a flat snapshot."""

    owner: int
    iteration: int
    nbytes: int
    checksum: int
    meta_nbytes: int

    def encode(self) -> bytes:
        words = [MAGIC, self.owner, self.iteration, self.nbytes, _signed(self.checksum)]
        words += [self.meta_nbytes, _header_check(words + [self.meta_nbytes]), 0]
        return struct.pack(_HEADER_FORMAT, *words)


_HEADER_FORMAT = f"<{HEADER_WORDS}q"


def _header_check(words: list[int]) -> int:
    """Checksum of the header's own six words (they are outside the packed region)."""
    return _signed(pack.checksum_bytes(struct.pack("<6q", *words)))


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def read_header(flat: torch.Tensor) -> Header | None:
    """The header of a flat snapshot, or None when the trailer is not a DeadPool header."""
    words = struct.unpack(_HEADER_FORMAT, flat[-HEADER_BYTES:].cpu().numpy().tobytes())
    if words[0] != MAGIC or words[6] != _header_check(list(words[:6])):
        return None
    return Header(
        owner=words[1],
        iteration=words[2],
        nbytes=words[3],
        checksum=words[4] % (1 << 64),
        meta_nbytes=words[5],
    )


@plain_torch
def verify(flat: torch.Tensor, *, owner: int | None = None, iteration: int | None = None) -> Header:
    """Check magic, identity and checksum; raise `CorruptReplicaError` naming what failed."""
    header = read_header(flat)
    if header is None:
        raise CorruptReplicaError("snapshot header missing or damaged (bad magic or check word)")
    if header.nbytes != flat.numel() - HEADER_BYTES or not 0 < header.meta_nbytes <= header.nbytes:
        raise CorruptReplicaError(
            f"snapshot header sizes are inconsistent (packed {header.nbytes} B in a "
            f"{flat.numel()} B buffer, meta {header.meta_nbytes} B)"
        )
    if owner is not None and header.owner != owner:
        raise CorruptReplicaError(f"replica belongs to rank {header.owner}, expected {owner}")
    if iteration is not None and header.iteration != iteration:
        raise CorruptReplicaError(
            f"replica of rank {header.owner} is of iteration {header.iteration}, "
            f"expected {iteration}"
        )
    actual = pack.checksum(flat[: header.nbytes])
    if actual != header.checksum:
        raise CorruptReplicaError(
            f"checksum mismatch in replica of rank {header.owner} iteration {header.iteration}: "
            f"stored {header.checksum:#018x}, computed {actual:#018x}"
        )
    return header


def inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside Megatron's (chained) optimizer, in a fixed order."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [opt.optimizer for opt in chained]


class RankState:
    """The live tensors and small state of one rank, in the canonical packing order."""

    def __init__(self, optimizer: Any, scheduler: Any) -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler

    def manifest(self) -> list[list[Any]]:
        """[opt index, param index, state key, dtype, shape] of every optimizer-state tensor."""
        out: list[list[Any]] = []
        for oi, opt in enumerate(inner_optimizers(self.optimizer)):
            for pi, param in enumerate(_params(opt)):
                for key in sorted(opt.state[param]):
                    value = opt.state[param][key]
                    if torch.is_tensor(value):
                        out.append([oi, pi, key, str(value.dtype), list(value.shape)])
        return out

    def ensure_state(self, manifest: list[list[Any]]) -> None:
        """Create empty optimizer-state tensors per `manifest` (a newcomer has none yet)."""
        opts = inner_optimizers(self.optimizer)
        for oi, pi, key, dtype, shape in manifest:
            opt = opts[oi]
            param = _params(opt)[pi]
            if key not in opt.state[param]:
                dt = getattr(torch, dtype.replace("torch.", ""))
                device = param.device if shape else torch.device("cpu")
                opt.state[param][key] = torch.zeros(shape, dtype=dt, device=device)

    def state_tensors(self) -> list[torch.Tensor]:
        """Main-param shards and optimizer-state tensors, in packing order."""
        out: list[torch.Tensor] = []
        for opt in inner_optimizers(self.optimizer):
            for param in _params(opt):
                out.append(param.data)
                for key in sorted(opt.state[param]):
                    value = opt.state[param][key]
                    if torch.is_tensor(value):
                        out.append(value)
        return out

    def small_state(self, iteration: int) -> dict[str, Any]:
        """Iteration and LR-scheduler state (JSON-safe); snapshots add the state manifest."""
        return {"iteration": iteration, "scheduler": dict(self.scheduler.state_dict())}

    def load_small_state(self, meta: dict[str, Any]) -> None:
        # Megatron's load_state_dict steps the scheduler forward by the saved count from its
        # current one: start from zero so a survivor rolling back lands on the saved count.
        self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(meta["scheduler"])


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def rng_tensors() -> list[torch.Tensor]:
    """CPU and CUDA RNG states and Megatron's RNG-tracker states, in a fixed order."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.device_count() and torch.version.cuda:
        states.append(torch.cuda.get_rng_state())
    tracker = get_cuda_rng_tracker().get_states()
    states.extend(tracker[name] for name in sorted(tracker))
    return [s.contiguous() for s in states]


def set_rng_tensors(states: list[torch.Tensor]) -> None:
    """Inverse of `rng_tensors`."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    states = list(states)
    torch.set_rng_state(states.pop(0))
    if torch.cuda.is_available() and torch.cuda.device_count() and torch.version.cuda:
        torch.cuda.set_rng_state(states.pop(0))
    tracker = get_cuda_rng_tracker()
    names = sorted(tracker.get_states())
    tracker.set_states({name: state for name, state in zip(names, states)})


def _encode_meta(small: dict[str, Any], manifest_json: str) -> bytes:
    """`small` plus the state manifest as one JSON object; the manifest never changes, so it
    comes encoded already (it is most of the bytes)."""
    head = json.dumps(small, separators=(",", ":"))
    return f'{head[:-1]},"manifest":{manifest_json}}}'.encode()


def _fill_meta(buf: torch.Tensor, raw: bytes) -> None:
    """Write `raw` into the fixed-size meta buffer, zero-padded."""
    if len(raw) > buf.numel():
        raise DeadpoolRuntimeError(f"per-rank metadata of {len(raw)} B exceeds its {buf.numel()} B")
    buf.zero_()
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _meta_from(buf: torch.Tensor) -> dict[str, Any]:
    raw = bytes(buf.cpu().numpy().tobytes()).rstrip(b"\0")
    return json.loads(raw.decode())


class Snapshotter:
    """Captures `RankState` into flat buffers and restores it from them."""

    def __init__(self, state: RankState, owner: int) -> None:
        """`state` must hold optimizer state already (after the first step, or restored)."""
        self.state = state
        self.owner = owner
        # The optimizer updates its tensors in place: their list, manifest and packed layout
        # are fixed from here on (a restore builds a new Snapshotter), so work them out once,
        # off the hot path. RNG states and metadata are staged into buffers of their own.
        self.manifest = state.manifest()
        self._manifest_json = json.dumps(self.manifest, separators=(",", ":"))
        live = state.state_tensors()
        device = live[0].device if live else torch.device("cpu")
        probe = len(_encode_meta(state.small_state(0), self._manifest_json))
        self.meta_nbytes = -(-(probe * 2 + 1024) // META_ALIGN) * META_ALIGN
        self.meta_buf = torch.zeros(self.meta_nbytes, dtype=torch.uint8)
        self._meta_staged = self.meta_buf.to(device)
        self._rng_staged = [t.to(device, copy=True) for t in rng_tensors()]
        self.plan = pack.PackPlan([*live, *self._rng_staged, self._meta_staged], device)
        self._staging: torch.Tensor | None = None

    def flat_nbytes(self) -> int:
        """Size of this rank's flat snapshot (packed region + header)."""
        return self.plan.nbytes + HEADER_BYTES

    @plain_torch
    def capture(self, iteration: int, out: torch.Tensor) -> Header:
        """Copy the live state of `iteration` into `out` (one pass: pack + checksum)."""
        _fill_meta(
            self.meta_buf, _encode_meta(self.state.small_state(iteration), self._manifest_json)
        )
        for staged, rng in zip(self._rng_staged, rng_tensors()):
            staged.copy_(rng, non_blocking=True)
        if self._meta_staged is not self.meta_buf:
            self._meta_staged.copy_(self.meta_buf, non_blocking=True)
        nbytes = self.plan.nbytes
        if out.device == self.plan.device:
            checksum = self.plan.pack(out[:nbytes])
        else:  # GPU state, host replicas: pack on the GPU, then one copy to pinned memory
            if self._staging is None:
                self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.plan.device)
            checksum = self.plan.pack(self._staging)
            out[:nbytes].copy_(self._staging, non_blocking=True)
        header = Header(
            owner=self.owner,
            iteration=iteration,
            nbytes=nbytes,
            checksum=checksum,
            meta_nbytes=self.meta_nbytes,
        )
        out[-HEADER_BYTES:].copy_(torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8))
        return header

    @staticmethod
    def restore_into(state: RankState, flat: torch.Tensor, *, owner: int, iteration: int) -> dict:
        """Verify `flat` (raises `CorruptReplicaError`), then load it into `state`.

        Works for a newcomer whose optimizer has no state yet: the manifest in the replica's
        metadata creates the tensors first.
        """
        header = verify(flat, owner=owner, iteration=iteration)
        meta = _meta_from(flat[header.nbytes - header.meta_nbytes : header.nbytes])
        state.ensure_state(meta["manifest"])
        live = state.state_tensors()
        device = live[0].device if live else flat.device
        rng = [torch.empty_like(t, device=device) for t in rng_tensors()]
        meta_buf = torch.empty(header.meta_nbytes, dtype=torch.uint8, device=device)
        tensors = [*live, *rng, meta_buf]
        if pack.packed_nbytes(tensors) != header.nbytes:
            raise CorruptReplicaError(
                f"replica of rank {owner} has {header.nbytes} B, this rank's state packs "
                f"to {pack.packed_nbytes(tensors)} B: the layouts differ"
            )
        pack.unpack(flat[: header.nbytes].to(device), tensors)
        set_rng_tensors([t.cpu() for t in rng])
        state.load_small_state(meta)
        return meta
