"""N2's probe: a model buffer changed right after `start_round` must be restored with the value
it had before the round.

On the Megatron-LM path the next forward pass follows `start_round` at once, and Megatron's MoE
router writes buffers in it (`local_tokens_per_expert`, ...); model buffers are packed last, so
a capture still running on its side stream could read the forward's values. The probe: a
world-of-one `Replicator` with GPU replicas over a >= 1.5 GB Adam shard and a module with a
4 MiB buffer; per round `i` the buffer is set to `i`, `start_round(i)`, at once
`buffer.fill_(-1)` on the main stream (the next forward), `before_step()`, `finish_round()`,
then the state restored from the local copy of round `i`: every element must be `i` again.
On an H200 with the fused kernel, before the fix, 12 of 12 rounds restored -1 (issue 39).
Needs the fused kernel: the torch fallback's host time closes the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .base import MIB, Outcome, Skip, adam_state, replicator_of_one, world_of_one

ROUNDS = 12
SHARD_GB = 1.5
BUFFER_BYTES = 4 * MIB


@dataclass(frozen=True)
class ProbeRound:
    """One round: the value set before `start_round` and how many buffer elements the restore
    got wrong (of `elements`)."""

    value: int
    wrong: int
    elements: int
    seen: float
    """One wrong element's restored value (the value itself when none is wrong)."""


def judge(rounds: Sequence[ProbeRound], expected_rounds: int = ROUNDS) -> tuple[bool, str]:
    """(passed, what was wrong)."""
    if len(rounds) != expected_rounds:
        return False, f"{len(rounds)} of {expected_rounds} rounds ran"
    bad = [r for r in rounds if r.wrong]
    if not bad:
        return True, ""
    first = bad[0]
    return False, (
        f"{len(bad)} of {len(rounds)} rounds restored a buffer changed after start_round "
        f"(round {first.value}: {first.wrong} of {first.elements} elements restored as "
        f"{first.seen:g}, not {first.value}): the capture read the model's buffers after the "
        "next forward pass wrote them (N2)"
    )


def measure(
    shard_gb: float = SHARD_GB, rounds: int = ROUNDS, group: Any = None, kind: str = "cuda"
) -> list[ProbeRound]:
    """The probe's rounds (CUDA, the fused kernel); `group`: an NCCL group of a world of one
    (default: a new world of one and its group). `kind` "cpu": the same in the CPU mode with
    host replicas and no replica holder (gloo cannot send to its own rank), where the capture
    is synchronous: what checks the probe's own logic."""
    import torch.distributed as dist

    from ...replication import pack
    from ...replication.snapshot import Snapshotter

    cuda = kind == "cuda"
    if cuda and pack.backend_for(torch.empty(1, device="cuda")) != "cuda":
        raise Skip("needs the fused pack kernel (the kernel row says why)")
    if group is None:
        world_of_one(kind=kind)
        group = dist.new_group(backend="nccl" if cuda else "gloo")
    device = "cuda" if cuda else "cpu"
    module = torch.nn.Module()
    module.register_buffer("counts", torch.zeros(BUFFER_BYTES // 4, device=device))
    buffer = module.get_buffer("counts")
    state = adam_state(int(shard_gb * 1e9) // 12, model=[module], device=device)
    if cuda:
        repl = replicator_of_one(state, group, "gpu")
    else:
        repl = replicator_of_one(state, group, "cpu", holders=())
    found = []
    for i in range(1, rounds + 1):
        buffer.fill_(float(i))
        repl.start_round(i)
        buffer.fill_(-1.0)  # the next forward pass, on the main stream
        repl.before_step()
        repl.finish_round()
        flat = repl.verified_copy(0, i)
        if flat is None:
            raise RuntimeError(f"round {i}: no verified local copy after finish_round")
        Snapshotter.restore_into(state, flat, owner=0, iteration=i)
        wrong = buffer != float(i)
        count = int(wrong.sum().item())
        seen = float(buffer[wrong][0].item()) if count else float(i)
        found.append(ProbeRound(i, count, buffer.numel(), seen))
    return found


def check() -> Outcome:
    """The row: `ROUNDS` rounds at `SHARD_GB`, every one restoring its value."""
    found = measure()
    ok, note = judge(found)
    figures: dict[str, Any] = {
        "shard_gb": SHARD_GB,
        "rounds_wrong": sum(1 for r in found if r.wrong),
        "rounds": [asdict(r) for r in found if r.wrong][:3],
    }
    return {"status": "pass" if ok else "FAIL", "figures": figures, "note": note}
