"""Model-state digests that let two runs be compared bit for bit.

`rank_digest` hashes one rank's model parameters and then its buffers (name, dtype, shape,
bytes) in `named_parameters()` / `named_buffers()` order, for every model chunk: every buffer,
persistent or not - state a step changes outside the optimizer (the MoE router's
``expert_bias``) as well as constants (rotary ``inv_freq``), which are equal anyway.
`job_digest` combines the digests of one rank per group of ranks holding the same weights, in
rank order - together they hold every parameter of the model exactly once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence

import torch


def rank_digest(modules: Iterable[torch.nn.Module]) -> str:
    """sha256 over this rank's parameters, then its buffers, chunk by chunk, in a canonical
    order."""
    h = hashlib.sha256()
    for module in modules:
        named: list[tuple[str, torch.Tensor]] = [
            (f"param:{n}", p) for n, p in module.named_parameters()
        ]
        named += [(f"buffer:{n}", b) for n, b in module.named_buffers() if b is not None]
        for name, tensor in named:
            data = tensor.detach().contiguous().cpu()
            h.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
            h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def job_digest(per_rank: Mapping[int, str]) -> str:
    """sha256 over the given ranks' digests in rank order."""
    h = hashlib.sha256()
    for rank in sorted(per_rank):
        h.update(f"{rank}:{per_rank[rank]};".encode())
    return h.hexdigest()


def final_digest(
    groups: Iterable[Sequence[int]], per_rank: Mapping[int, str]
) -> tuple[str | None, bool]:
    """The job's digest from the ranks' digests, and whether the ranks of each group agree.

    `groups`: the groups of ranks that hold the same weights - data-parallel peers, or with
    expert parallelism `placement.Layout.peer_groups` (data-parallel peers of the dense part
    may hold different experts) - so each group's digest is any member's that is known (a rank
    lost after training completed published none); `job_digest` of one per group, keyed by the
    group's first rank. None when a whole group is missing.
    """
    groups = [list(g) for g in groups]
    known = [[per_rank[r] for r in g if r in per_rank] for g in groups]
    if not all(known):
        return None, False
    digest = job_digest({g[0]: k[0] for g, k in zip(groups, known)})
    return digest, all(len(set(k)) == 1 for k in known)
