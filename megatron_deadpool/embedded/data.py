"""Deterministic mock data for the embedded job: a pure function of (seed, iteration, rank).

Every micro-batch is computed from its coordinates, so "the data position" is just the
iteration number: a replaced rank or a rolled-back survivor reads exactly the batches a
failure-free run reads. The sequences follow a fixed affine recurrence modulo the vocabulary
(with random starts), which a small GPT learns quickly: losses visibly fall.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def micro_batch(
    *, seed: int, iteration: int, dp_rank: int, micro: int, mbs: int, seq: int, vocab: int
) -> dict[str, torch.Tensor]:
    """Tokens, labels, loss mask and position ids of one micro-batch."""
    gen = torch.Generator().manual_seed(
        (seed * 1_000_003 + iteration) * 10_007 + dp_rank * 101 + micro
    )
    mult = 3 + 2 * (seed % 5)
    start = torch.randint(0, vocab, (mbs, 1), generator=gen)
    steps = torch.arange(seq + 1).unsqueeze(0)
    stream = (start * mult**0 + steps * (start % 7 + 1) * mult) % vocab
    tokens = stream[:, :-1].contiguous()
    labels = stream[:, 1:].contiguous()
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": torch.ones(mbs, seq, dtype=torch.float),
        "position_ids": torch.arange(seq).unsqueeze(0).expand(mbs, seq).contiguous(),
    }


def iteration_batches(
    *,
    seed: int,
    iteration: int,
    dp_rank: int,
    num_microbatches: int,
    mbs: int,
    seq: int,
    vocab: int,
    device: torch.device | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """The micro-batches one data-parallel rank consumes in `iteration`, on `device` (the
    model's; they are always generated on the CPU, so every device sees the same tokens)."""
    for micro in range(num_microbatches):
        batch = micro_batch(
            seed=seed,
            iteration=iteration,
            dp_rank=dp_rank,
            micro=micro,
            mbs=mbs,
            seq=seq,
            vocab=vocab,
        )
        if device is not None and device.type != "cpu":
            batch = {name: t.to(device, non_blocking=True) for name, t in batch.items()}
        yield batch
