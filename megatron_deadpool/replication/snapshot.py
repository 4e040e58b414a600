"""What a rank owns and how it becomes one flat, checksummed buffer.

A rank's state is its distributed-optimizer shard - for every inner optimizer of Megatron's
(chained) optimizer, every parameter the inner torch optimizer updates (the fp32 main-param
shard) and every tensor of its optimizer state - plus every buffer of its model chunks, plus
small per-rank state: the iteration, RNG states, the LR scheduler's state, per-group
optimizer values and Megatron's loss scalers (JSON, never pickle). Model weights are not part
of it: they are identical across data-parallel peers and are re-derived from the main-param
shards by Megatron's param all-gather.

Buffers are state a training step may change outside the optimizer (e.g. the MoE router's
``expert_bias``, updated every step, and its ``local_tokens_per_expert`` counter, filled by the
forward pass and zeroed at the step's end): all of them, persistent or not, are captured and
restored, constant ones (rotary ``inv_freq``) included - they are small, and checking which
ones a step changes would be a guess.

Where optimizers keep their step (checked against their sources):
- torch `Adam`/`AdamW` (Megatron's choice without TE and apex): ``state[p]["step"]``, a 0-dim
  float32 tensor on the CPU unless ``capturable``/``fused`` (then on the parameter's device);
- Transformer Engine's and apex's `FusedAdam` (Megatron's choice when they import):
  ``param_groups[i]["step"]``, an int (a CUDA int tensor when ``capturable``), plus, for
  states kept in fp16 (``--use-precision-aware-optimizer``), TE's per-state scales in
  ``optimizer._scales[p][name]`` (`transformer_engine/pytorch/optimizers/fused_adam.py`,
  `FusedAdam.step` and `_initialize_state`).
All of them are captured: tensors in the packed region, int steps in the metadata.
An optimizer whose first steps were skipped (FP16 overflow) has no state when the layout is
fixed: it gets it up front, as its first step would create it (`lazy_state.py`).

Megatron's loss scaler (``--fp16``, or ``--loss-scale``): each inner optimizer of a
(chained) Megatron optimizer holds its own ``grad_scaler`` (`megatron/core/optimizer/
grad_scaler.py`, the same in core_v0.16.1 and core_v0.19.0). `DynamicGradScaler.update`
changes it after every step, overflowing or not: ``_scale`` (a one-element float32 tensor,
replaced by a new one on every change), ``_growth_tracker`` and ``_hysteresis_tracker`` (ints).
It is small and replaced rather than updated in place, so it travels in the metadata like the
LR scheduler: the scale as the exact hex of its float32 value. Reading it syncs the host with
the device, which Megatron's `train_step` has already done by then (it reads `found_inf` and
reduces `update_successful` and the grad norm on the host).

Flat layout (see `pack.py` for the packed region and its checksum):
    [packed region: device tensors..., host blob] [header: 8 x int64]
The device tensors are the state tensors on the shard's device, in the canonical order. The
host blob gathers everything that lives in host memory - 0-dim CPU tensors (torch Adam's
steps), RNG states, and the metadata JSON (fixed size, last) - so that on a GPU it travels as
one host-to-device copy instead of one per scalar; on the CPU it is packed like any tensor.
The header carries magic, owner rank, iteration, packed size, checksum and the size of the
meta region, so a holder can verify a replica, and a newcomer read it, on its own.

On a GPU with the fused kernel, `Snapshotter.capture` only enqueues work (on the side stream it
is given): the checksum stays on the device and the header is assembled there
(`_DeviceHeader`), so the host never waits for the optimizer step it follows; the caller
records an event after it. Model buffers are packed from a copy taken on the training's stream
first (`buffer_stage`), so the next forward pass, which writes some of them, cannot race the
side-stream capture (`capture` gives the ordering argument).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..devices.base import real_cuda
from ..devices.cpu import plain_torch
from ..errors import ConfigError, DeadpoolRuntimeError
from . import pack, parallel_checksum
from .buffer_stage import BufferStage
from .lazy_state import LazyStateWatch, create_lazy_state

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

    def words(self) -> list[int]:
        """The eight int64 words as stored (checksum as its signed bits, then the check word)."""
        words = [MAGIC, self.owner, self.iteration, self.nbytes, _signed(self.checksum)]
        return [*words, self.meta_nbytes, _header_check(words + [self.meta_nbytes]), 0]

    def encode(self) -> bytes:
        return struct.pack(_HEADER_FORMAT, *self.words())


_HEADER_FORMAT = f"<{HEADER_WORDS}q"


def _header_check(words: list[int]) -> int:
    """Checksum of the header's own six words (they are outside the packed region)."""
    return _signed(pack.checksum_bytes(struct.pack("<6q", *words)))


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def read_header(flat: torch.Tensor) -> Header | None:
    """The header of a flat snapshot, or None when the trailer is not a DeadPool header."""
    return parse_header(flat[-HEADER_BYTES:].cpu().numpy().tobytes())


def parse_header(raw: bytes) -> Header | None:
    """The header in the `HEADER_BYTES` bytes `raw` (a flat snapshot's trailer), or None when
    they are not a DeadPool header."""
    if len(raw) != HEADER_BYTES:
        return None
    words = struct.unpack(_HEADER_FORMAT, raw)
    if words[0] != MAGIC or words[6] != _header_check(list(words[:6])):
        return None
    return Header(
        owner=words[1],
        iteration=words[2],
        nbytes=words[3],
        checksum=words[4] % (1 << 64),
        meta_nbytes=words[5],
    )


def size_problem(header: Header, total: int) -> str | None:
    """Why `header` cannot head a flat snapshot of `total` bytes (None: its sizes fit): what a
    reader checks before it allocates anything the header sizes."""
    if header.nbytes != total - HEADER_BYTES or not 0 < header.meta_nbytes <= header.nbytes:
        return (
            f"snapshot header sizes are inconsistent (packed {header.nbytes} B in a "
            f"{total} B buffer, meta {header.meta_nbytes} B)"
        )
    return None


@plain_torch
def verify(
    flat: torch.Tensor,
    *,
    owner: int | None = None,
    iteration: int | None = None,
    one_core: bool = False,
) -> Header:
    """Check magic, identity and checksum; raise `CorruptReplicaError` naming what failed.

    A buffer in host memory is checksummed on DeadPool's bounded checksum threads
    (`parallel_checksum`: memory speed, no OpenMP team), or with `one_core` on the calling
    thread alone; a device buffer on the device (`pack.checksum`)."""
    header = read_header(flat)
    if header is None:
        raise CorruptReplicaError("snapshot header missing or damaged (bad magic or check word)")
    problem = size_problem(header, flat.numel())
    if problem:
        raise CorruptReplicaError(problem)
    if owner is not None and header.owner != owner:
        raise CorruptReplicaError(f"replica belongs to rank {header.owner}, expected {owner}")
    if iteration is not None and header.iteration != iteration:
        raise CorruptReplicaError(
            f"replica of rank {header.owner} is of iteration {header.iteration}, "
            f"expected {iteration}"
        )
    region = flat[: header.nbytes]
    if region.device.type == "cpu":
        actual = parallel_checksum.checksum(region, threads=1 if one_core else None)
    else:
        actual = pack.checksum(region)
    if actual != header.checksum:
        raise CorruptReplicaError(
            f"checksum mismatch in replica of rank {header.owner} iteration {header.iteration}: "
            f"stored {header.checksum:#018x}, computed {actual:#018x}"
        )
    return header


def inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside Megatron's (chained) optimizer, in a fixed order."""
    return [opt.optimizer for opt in _chained(optimizer)]


def _chained(optimizer: Any) -> list[Any]:
    """Megatron's optimizers inside its (chained) optimizer, in `inner_optimizers`' order."""
    return getattr(optimizer, "chained_optimizers", None) or [optimizer]


_TRACKERS = ("_growth_tracker", "_hysteresis_tracker")
"""A `DynamicGradScaler`'s int state besides its scale (a `ConstantGradScaler` has none)."""


def loss_scaler_state(optimizer: Any) -> list[dict[str, Any]]:
    """Each inner Megatron optimizer's loss scaler (``grad_scaler``; None under bf16 without
    ``--loss-scale``) as JSON: its index, the scale's float32 value as exact hex, the trackers."""
    out = []
    for oi, opt in enumerate(_chained(optimizer)):
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is None:
            continue
        entry: dict[str, Any] = {"opt": oi, "scale": float(scaler._scale.item()).hex()}
        for name in _TRACKERS:
            if hasattr(scaler, name):
                entry[name] = int(getattr(scaler, name))
        out.append(entry)
    return out


def load_loss_scaler_state(optimizer: Any, entries: list[dict[str, Any]]) -> None:
    """Inverse of `loss_scaler_state` (a new scale tensor on the old one's device, as
    `DynamicGradScaler.update` and `load_state_dict` do)."""
    chained = _chained(optimizer)
    for entry in entries:
        oi, scaler = entry.get("opt"), None
        if isinstance(oi, int) and 0 <= oi < len(chained):
            scaler = getattr(chained[oi], "grad_scaler", None)
        if scaler is None:
            raise CorruptReplicaError(
                f"the snapshot holds a loss scaler for optimizer {oi}, this rank has none: "
                "the runs differ (--fp16, --loss-scale)"
            )
        scale = float.fromhex(entry["scale"])
        if not 0.0 < scale < float("inf"):
            raise CorruptReplicaError(f"loss scale {scale} in the snapshot is not positive finite")
        scaler._scale = torch.tensor([scale], dtype=torch.float32, device=scaler._scale.device)
        for name in _TRACKERS:
            if name in entry:
                setattr(scaler, name, int(entry[name]))


_SCALES = "_scales/"
"""Manifest key prefix of TE FusedAdam's per-state scales (`optimizer._scales[p][name]`)."""

BUFFER = "buffer"
"""First field of a model buffer's manifest entry (an optimizer's entries start with its index)."""


class RankState:
    """The live tensors and small state of one rank, in the canonical packing order.

    The manifest lists every optimizer tensor as ``[opt, ref, key, dtype, shape, where]``:
    ``ref`` a parameter index (per-parameter state, or TE's scales under ``_scales/NAME``) or
    ``"g<group index>"`` (a tensor-valued group entry, e.g. a capturable FusedAdam's step);
    ``where`` is ``"param"`` (the parameter's device) or ``"cpu"``. Then every buffer of the
    model chunks as ``["buffer", chunk, name, dtype, shape, "model"]`` (on the buffer's own
    device).
    """

    def __init__(self, optimizer: Any, scheduler: Any, model: Sequence[Any] = ()) -> None:
        """`model`: the rank's model chunks, whose buffers travel with the shard."""
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.model = list(model)

    def holds(self, other: RankState) -> bool:
        """Whether `other` is a view of the same optimizer, scheduler and model chunks."""
        return (
            other.optimizer is self.optimizer
            and other.scheduler is self.scheduler
            and len(other.model) == len(self.model)
            and all(a is b for a, b in zip(other.model, self.model))
        )

    def _buffers(self) -> list[tuple[int, str, torch.Tensor]]:
        """(chunk, name, buffer) of every model chunk, in `named_buffers()` order."""
        return [
            (ci, name, buf)
            for ci, chunk in enumerate(self.model)
            for name, buf in chunk.named_buffers()
            if buf is not None
        ]

    def model_buffers(self) -> list[torch.Tensor]:
        """Every buffer of the model chunks, in packing order: the captured tensors that
        something besides the optimizer step writes (the forward pass)."""
        return [buf for _, _, buf in self._buffers()]

    def _walk(self) -> list[tuple[list[Any] | None, torch.Tensor]]:
        """(manifest entry, tensor) in packing order: each parameter (entry None: the main
        param itself), then its state tensors and TE scales; after each optimizer's
        parameters, its tensor-valued group entries; last the model's buffers."""
        out: list[tuple[list[Any] | None, torch.Tensor]] = []
        for oi, opt in enumerate(inner_optimizers(self.optimizer)):
            scales = getattr(opt, "_scales", None) or {}
            for pi, param in enumerate(_params(opt)):
                out.append((None, param.data))
                state = opt.state[param]
                named = [(key, state[key]) for key in sorted(state)]
                named += [(_SCALES + n, t) for n, t in sorted(scales.get(param, {}).items())]
                for key, value in named:
                    if torch.is_tensor(value):
                        out.append(([oi, pi, key, *_describe(value, key, param)], value))
            for gi, group in enumerate(opt.param_groups):
                value = group.get("step")
                if torch.is_tensor(value) and group["params"]:
                    where = _describe(value, "step", group["params"][0])
                    out.append(([oi, f"g{gi}", "step", *where], value))
        for ci, name, buf in self._buffers():
            _check_plain(buf, f"model buffer {name!r}")
            out.append(([BUFFER, ci, name, str(buf.dtype), list(buf.shape), "model"], buf))
        return out

    def manifest(self) -> list[list[Any]]:
        """Every optimizer-state tensor (see the class docstring)."""
        return [entry for entry, _ in self._walk() if entry is not None]

    def state_tensors(self) -> list[torch.Tensor]:
        """Main-param shards and optimizer-state tensors, in packing order."""
        return [value for _, value in self._walk()]

    def ensure_state(self, manifest: list[list[Any]]) -> None:
        """Create empty optimizer-state tensors per `manifest` (a newcomer has none yet)."""
        opts = inner_optimizers(self.optimizer)
        buffers = {(ci, name): buf for ci, name, buf in self._buffers()}
        for entry in manifest:
            if entry[0] == BUFFER:
                _ensure_buffer(buffers, entry)
                continue
            oi, ref, key, dtype, shape = entry[:5]
            where = entry[5] if len(entry) > 5 else ("param" if shape else "cpu")
            opt = opts[oi]
            if isinstance(ref, str):  # a group entry
                group = opt.param_groups[int(ref[1:])]
                if not torch.is_tensor(group.get(key)):
                    device = group["params"][0].device if where == "param" else None
                    group[key] = _empty(dtype, shape, device)
                continue
            param = _params(opt)[ref]
            device = param.device if where == "param" else None
            if key.startswith(_SCALES):
                holder = opt._scales.setdefault(param, {})
                holder.setdefault(key[len(_SCALES) :], _empty(dtype, shape, device))
            elif key not in opt.state[param]:
                opt.state[param][key] = _empty(dtype, shape, device)

    def small_state(self, iteration: int) -> dict[str, Any]:
        """Iteration, LR-scheduler state and non-tensor group steps (JSON-safe); snapshots add
        the state manifest."""
        steps = [
            [oi, gi, group["step"]]
            for oi, opt in enumerate(inner_optimizers(self.optimizer))
            for gi, group in enumerate(opt.param_groups)
            if isinstance(group.get("step"), (int, float)) and not isinstance(group["step"], bool)
        ]
        out: dict[str, Any] = {
            "iteration": iteration,
            "scheduler": dict(self.scheduler.state_dict()),
        }
        if steps:
            out["group_steps"] = steps
        scalers = loss_scaler_state(self.optimizer)
        if scalers:
            out["loss_scalers"] = scalers
        return out

    def load_small_state(self, meta: dict[str, Any]) -> None:
        # Megatron's load_state_dict steps the scheduler forward by the saved count from its
        # current one: start from zero so a survivor rolling back lands on the saved count.
        self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(meta["scheduler"])
        opts = inner_optimizers(self.optimizer)
        for oi, gi, value in meta.get("group_steps", []):
            opts[oi].param_groups[gi]["step"] = value
        load_loss_scaler_state(self.optimizer, meta.get("loss_scalers", []))

    def create_lazy_state(self) -> LazyStateWatch:
        """Optimizer state that skipped first steps have not created yet, created as they
        would (`lazy_state.py`); the returned watch notices any that still appears later."""
        opts = inner_optimizers(self.optimizer)
        for opt in opts:
            create_lazy_state(opt)
        return LazyStateWatch(opts)


def _ensure_buffer(buffers: dict[tuple[int, str], torch.Tensor], entry: list[Any]) -> None:
    """The model buffer a replica's manifest `entry` names, in the replica's dtype: Megatron
    changes some buffers' dtype on their first use (the MoE router keeps ``expert_bias`` in
    float32 under --bf16), which a newcomer's model has not seen yet."""
    _, ci, name, dtype, shape = entry[:5]
    buf = buffers.get((ci, name))
    if buf is None or list(buf.shape) != list(shape):
        have = "none" if buf is None else f"shape {list(buf.shape)}"
        raise CorruptReplicaError(
            f"the replica holds model buffer {name!r} of chunk {ci} with shape {shape}, this "
            f"rank's model has {have}: the models differ"
        )
    if str(buf.dtype) != dtype:
        buf.data = _empty(dtype, shape, buf.device)


def _check_plain(value: torch.Tensor, what: str, hint: str = "") -> None:
    """Refuse what cannot be packed: anything but a plain dense tensor."""
    if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.layout != torch.strided:
        raise ConfigError(
            f"{what} is a {type(value).__name__} ({value.layout}): DeadPool replicates plain "
            f"dense tensors only{hint}"
        )


def _describe(value: torch.Tensor, key: str, param: torch.Tensor) -> list[Any]:
    """dtype, shape and place of an optimizer tensor (refusing what cannot be packed)."""
    _check_plain(
        value,
        f"optimizer state {key!r}",
        "; FP8 optimizer states (exp_avg_dtype uint8) are not supported, use fp32, bf16 or "
        "fp16 states",
    )
    where = "param" if value.device == param.device else "cpu"
    if where == "cpu" and value.device.type != "cpu":
        raise ConfigError(
            f"optimizer state {key!r} is on {value.device}, its parameter on {param.device}"
        )
    return [str(value.dtype), list(value.shape), where]


def _empty(dtype: str, shape: list[int], device: torch.device | None) -> torch.Tensor:
    dt = getattr(torch, dtype.replace("torch.", ""))
    return torch.zeros(shape, dtype=dt, device=device or torch.device("cpu"))


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def _is_host_scalar(tensor: torch.Tensor) -> bool:
    """0-dim tensors in host memory (torch Adam's steps) go into the host blob."""
    return tensor.dim() == 0 and tensor.device.type == "cpu"


def rng_tensors() -> list[torch.Tensor]:
    """CPU and CUDA RNG states and Megatron's RNG-tracker states, in a fixed order.

    With Megatron's CUDA-graph-safe RNG (``use_cudagraphable_rng``) the tracker holds
    `torch.Generator` objects; their state is read with `Generator.get_state()`.
    """
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    states = [torch.get_rng_state()]
    if real_cuda():
        states.append(torch.cuda.get_rng_state())
    tracker = get_cuda_rng_tracker().get_states()
    for name in sorted(tracker):
        state = tracker[name]
        states.append(state.get_state() if isinstance(state, torch.Generator) else state)
    return [s.contiguous() for s in states]


def set_rng_tensors(states: list[torch.Tensor]) -> None:
    """Inverse of `rng_tensors` (a tracker's `Generator` objects are kept and set in place)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    states = list(states)
    torch.set_rng_state(states.pop(0))
    if real_cuda():
        torch.cuda.set_rng_state(states.pop(0))
    tracker = get_cuda_rng_tracker()
    current = tracker.get_states()
    restored: dict[str, Any] = {}
    for name, state in zip(sorted(current), states):
        if isinstance(current[name], torch.Generator):
            current[name].set_state(state)
            restored[name] = current[name]
        else:
            restored[name] = state
    tracker.set_states(restored)


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


def _verified(flat: torch.Tensor, owner: int, iteration: int) -> tuple[Header, dict[str, Any]]:
    """The header and metadata of `flat`, `owner`'s snapshot of `iteration` once verified."""
    header = verify(flat, owner=owner, iteration=iteration)
    return header, _meta_from(flat[header.nbytes - header.meta_nbytes : header.nbytes])


def _load(
    state: RankState,
    flat: torch.Tensor,
    header: Header,
    meta: dict[str, Any],
    plan: pack.PackPlan,
    staged: torch.Tensor,
    blob: _Blob,
    scalars: list[torch.Tensor],
) -> None:
    """Load verified `flat` into `state`: its packed region by `plan` (the live tensors, then
    `staged`, which receives the host blob laid out as `blob`), then the host scalars, RNG
    states and small state from the blob."""
    plan.unpack(flat[: header.nbytes].to(plan.device))
    host = staged.cpu()
    at = blob.scalars[0]
    for scalar in scalars:
        _byte_view(scalar).copy_(host[at : at + scalar.element_size()])
        at += scalar.element_size()
    set_rng_tensors([host[a:b].clone() for a, b in blob.rng])
    state.load_small_state(meta)


def _meta_from(buf: torch.Tensor) -> dict[str, Any]:
    raw = bytes(buf.cpu().numpy().tobytes()).rstrip(b"\0")
    return json.loads(raw.decode())


class _Blob:
    """Layout of the host blob: scalar bytes, RNG states (each 16-aligned), meta (last)."""

    def __init__(self, scalar_nbytes: int, rng_nbytes: list[int], meta_nbytes: int) -> None:
        self.scalars = (0, scalar_nbytes)
        offset = pack.ALIGN * -(-scalar_nbytes // pack.ALIGN)
        self.rng: list[tuple[int, int]] = []
        for n in rng_nbytes:
            self.rng.append((offset, offset + n))
            offset += pack.ALIGN * -(-n // pack.ALIGN)
        self.meta = (offset, offset + meta_nbytes)
        self.nbytes = offset + meta_nbytes  # a multiple of 16: meta_nbytes is of 4096

    @staticmethod
    def of(scalars: list[torch.Tensor], meta_nbytes: int) -> _Blob:
        rng = [t.numel() * t.element_size() for t in rng_tensors()]
        return _Blob(sum(t.element_size() for t in scalars), rng, meta_nbytes)


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class _DeviceHeader:
    """Assembles a header on the GPU from a device checksum slot, without a host sync.

    The check word is `_header_check` of the first six words: their 12 int32 halves widened
    to int64, times 1..12, summed - at most 78 * 2**31 in magnitude, exact in int64, and equal
    to the signed value `_header_check` stores.
    """

    def __init__(self, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(HEADER_WORDS, dtype=torch.int64, pin_memory=pin)
        self.words = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=device)
        self.weights = torch.arange(1, 13, dtype=torch.int64, device=device)

    def write(self, header: Header, slot: torch.Tensor, out: torch.Tensor) -> None:
        """Enqueue: `header` with the checksum taken from `slot`, into `out` (64 bytes)."""
        self.host.copy_(torch.tensor(header.words(), dtype=torch.int64))
        self.words.copy_(self.host, non_blocking=True)
        self.words[4:5].copy_(slot)
        halves = self.words[:6].view(torch.int32).to(torch.int64)
        torch.sum(halves * self.weights, dim=0, keepdim=True, out=self.words[6:7])
        out.copy_(self.words.view(torch.uint8))


class Snapshotter:
    """Captures `RankState` into flat buffers and restores it from them."""

    def __init__(self, state: RankState, owner: int) -> None:
        """`state` must hold optimizer state already (after the first step, or restored);
        what skipped first steps have not created is created here (`lazy_state.py`)."""
        self.state = state
        self.owner = owner
        self._lazy = state.create_lazy_state()
        # The optimizer updates its tensors in place: their list, manifest and packed layout
        # are fixed from here on (a restore that creates tensors builds a new Snapshotter), so
        # work them out once, off the hot path.
        self.manifest = state.manifest()
        self._manifest_json = json.dumps(self.manifest, separators=(",", ":"))
        live = state.state_tensors()
        self._live = [t for t in live if not _is_host_scalar(t)]
        self._scalars = [t for t in live if _is_host_scalar(t)]
        self.device = self._live[0].device if self._live else torch.device("cpu")
        # Model buffers are packed from a copy taken on the training's stream (`buffer_stage`).
        buffers = {id(t) for t in state.model_buffers() if not _is_host_scalar(t)}
        self._stage = BufferStage([t for t in self._live if id(t) in buffers], self.device)
        views = iter(self._stage.views)
        packed = [next(views) if id(t) in buffers else t for t in self._live]
        self._scalar_views = [_byte_view(t) for t in self._scalars]
        probe = len(_encode_meta(state.small_state(0), self._manifest_json))
        self.meta_nbytes = -(-(probe * 2 + 1024) // META_ALIGN) * META_ALIGN
        self.blob = _Blob.of(self._scalars, self.meta_nbytes)
        self._restore_plan: tuple[pack.PackPlan, torch.Tensor] | None = None  # (`restore`)
        on_gpu = self.device.type == "cuda"
        self._host = torch.zeros(self.blob.nbytes, dtype=torch.uint8, pin_memory=on_gpu)
        self._blob = torch.empty_like(self._host, device=self.device) if on_gpu else self._host
        self.plan = pack.PackPlan([*packed, self._blob], self.device)
        self._header = _DeviceHeader(self.device) if self.device.type == "cuda" else None
        self._staging: torch.Tensor | None = None
        self._host_free: torch.cuda.Event | None = None
        """Recorded after the last capture on its stream: its reads of the pinned host blob
        and of the buffers' staging area are done (both are written again by the next)."""

    def reserve_staging(self) -> None:
        """Allocate now the GPU buffer that captures of GPU state into host memory pack into
        (the snapshot's size; `devices.memory` counts it), so that a shortage shows when the
        replicator is built, not at its first capture."""
        if self.device.type == "cuda" and self._staging is None:
            self._staging = torch.empty(self.flat_nbytes(), dtype=torch.uint8, device=self.device)

    def flat_nbytes(self) -> int:
        """Size of this rank's flat snapshot (packed region + header)."""
        return self.plan.nbytes + HEADER_BYTES

    def _fill_blob(self, iteration: int) -> None:
        if self._host_free is not None:  # pinned host memory the last capture still copies
            self._host_free.synchronize()
        a, b = self.blob.scalars
        if self._scalar_views:
            torch.cat(self._scalar_views, out=self._host[a:b])
        for (a, b), state in zip(self.blob.rng, rng_tensors()):
            self._host[a:b].copy_(_byte_view(state))
        a, b = self.blob.meta
        raw = _encode_meta(self.state.small_state(iteration), self._manifest_json)
        _fill_meta(self._host[a:b], raw)
        if self._blob is not self._host:
            self._blob.copy_(self._host, non_blocking=True)

    @plain_torch
    def capture(
        self, iteration: int, out: torch.Tensor, stream: torch.cuda.Stream | None = None
    ) -> Header | None:
        """Copy the live state of `iteration` into `out` (one pass: pack + checksum).

        Returns the header, or None when the state is on a GPU (the checksum stays there, from
        the fused kernel or the torch fallback): then the capture is only enqueued (header
        included) and the caller records an event on the capture's stream after this call;
        `out` is complete once that event has passed.

        `stream` (CUDA): the side stream the capture runs on, the host not waiting for it.
        Ordering, by construction:
        - the model buffers - the only captured device tensors that something besides the
          optimizer step writes (the forward pass: the MoE router's counters) - are copied to
          a staging area first, on the current stream (`buffer_stage`): after the step being
          captured and before anything issued after this call, by that stream's own order.
          The staging copy waits for the previous capture's completion event, which is the
          last reader of the area (one capture is in flight at a time: the local slots are
          double-buffered, the staging area is not and need not be);
        - then `stream` waits for the current stream (the step and the staging copy) and the
          pack runs on it; the optimizer tensors it reads are next written by the next
          optimizer step, which waits for the capture's event (`Replicator.before_step`);
        - everything else - host scalars, RNG states, scheduler, loss scalers, the metadata -
          is read on the host before this call returns (`_fill_blob`) into the pinned blob,
          whose reuse waits for the same completion event.
        """
        self._lazy.check()
        on_gpu = self.device.type == "cuda"
        if on_gpu and self._host_free is not None:  # the last capture read the staging area
            torch.cuda.current_stream(self.device).wait_event(self._host_free)
        self._stage.take()
        if stream is None:
            return self._capture(iteration, out)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            return self._capture(iteration, out)

    def _capture(self, iteration: int, out: torch.Tensor) -> Header | None:
        """`capture` on the current stream, the buffers staged."""
        self._fill_blob(iteration)
        nbytes = self.plan.nbytes
        header = Header(
            owner=self.owner,
            iteration=iteration,
            nbytes=nbytes,
            checksum=0,
            meta_nbytes=self.meta_nbytes,
        )
        target = out
        if out.device != self.plan.device:  # GPU state, host replicas: one copy of everything
            if self._staging is None or self._staging.numel() != out.numel():
                self._staging = torch.empty(out.numel(), dtype=torch.uint8, device=self.device)
            target = self._staging
        if self._header is not None:
            slot = self.plan.pack_on_device(target[:nbytes])
            self._header.write(header, slot, target[-HEADER_BYTES:])
            result = None
        else:
            checksum = self.plan.pack(target[:nbytes])
            result = Header(**{**header.__dict__, "checksum": checksum})
            raw = torch.frombuffer(bytearray(result.encode()), dtype=torch.uint8)
            target[-HEADER_BYTES:].copy_(raw)
        if target is not out:
            out.copy_(target, non_blocking=True)
        if self.device.type == "cuda":
            self._host_free = torch.cuda.Event()
            self._host_free.record()
        return result

    @staticmethod
    def restore_into(state: RankState, flat: torch.Tensor, *, owner: int, iteration: int) -> dict:
        """Verify `flat` (raises `CorruptReplicaError`), then load it into `state`.

        Works for a newcomer whose optimizer has no state yet: the manifest in the replica's
        metadata creates the tensors first.
        """
        header, meta = _verified(flat, owner, iteration)
        _load_anew(state, flat, header, meta, owner)
        return meta

    def restore(self, flat: torch.Tensor, *, iteration: int) -> bool:
        """Load `flat`, the owner's verified snapshot of `iteration` (raises
        `CorruptReplicaError`), into the state this snapshotter captures, by the layout it
        worked out once: a recovery's restore - a survivor's rollback, a newcomer's load through
        the snapshotter it built ahead - skips `restore_into`'s walks of the state and keeps this
        snapshotter. False - nothing loaded - when the snapshot's manifest or layout is not this
        state's (then `restore_into`, and a new Snapshotter)."""
        return self._load_own(flat, *_verified(flat, self.owner, iteration))

    def _load_own(self, flat: torch.Tensor, header: Header, meta: dict[str, Any]) -> bool:
        """`restore` of verified `flat` (its `header` and `meta`)."""
        if meta["manifest"] != self.manifest or header.meta_nbytes != self.meta_nbytes:
            return False
        if self._restore_plan is None:
            staged = torch.empty(self.blob.nbytes, dtype=torch.uint8, device=self.device)
            self._restore_plan = (pack.PackPlan([*self._live, staged], self.device), staged)
        plan, staged = self._restore_plan
        if plan.nbytes != header.nbytes:
            return False
        _load(self.state, flat, header, meta, plan, staged, self.blob, self._scalars)
        return True


def load_snapshot(
    snap: Snapshotter | None, state: RankState, flat: torch.Tensor, *, owner: int, iteration: int
) -> Snapshotter | None:
    """Verify `flat`, `owner`'s snapshot of `iteration`, once (raises `CorruptReplicaError`) and
    load it into `state`: by `snap` where it captures this very state for this owner, with the
    snapshot's layout (`Snapshotter.restore`) - then it is returned, for the next replicator to
    keep -, else as `Snapshotter.restore_into` does (creating what the state lacks)."""
    header, meta = _verified(flat, owner, iteration)
    if (
        snap is not None
        and snap.owner == owner
        and snap.state.holds(state)
        and snap._load_own(flat, header, meta)
    ):
        return snap
    _load_anew(state, flat, header, meta, owner)
    return None


def _load_anew(
    state: RankState, flat: torch.Tensor, header: Header, meta: dict[str, Any], owner: int
) -> None:
    """`restore_into` of verified `flat` (its `header` and `meta`): the state's missing tensors
    created per the manifest, its layout walked and checked against the snapshot's."""
    state.ensure_state(meta["manifest"])
    live = state.state_tensors()
    packed = [t for t in live if not _is_host_scalar(t)]
    scalars = [t for t in live if _is_host_scalar(t)]
    device = packed[0].device if packed else flat.device
    blob = _Blob.of(scalars, header.meta_nbytes)
    staged = torch.empty(blob.nbytes, dtype=torch.uint8, device=device)
    tensors = [*packed, staged]
    if pack.packed_nbytes(tensors) != header.nbytes:
        raise CorruptReplicaError(
            f"replica of rank {owner} has {header.nbytes} B, this rank's state packs "
            f"to {pack.packed_nbytes(tensors)} B: the layouts differ"
        )
    _load(state, flat, header, meta, pack.PackPlan(tensors, device), staged, blob, scalars)
