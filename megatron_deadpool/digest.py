"""Parameter digests that let two runs be compared bit for bit.

`rank_digest` hashes one rank's model parameters (name, dtype, shape, bytes) in
`named_parameters()` order; `job_digest` combines the digests of the data-parallel-rank-0
ranks in rank order - one per model-parallel position, which together hold every parameter
of the model exactly once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch


def rank_digest(modules: Iterable[torch.nn.Module]) -> str:
    """sha256 over this rank's parameters in a canonical order."""
    h = hashlib.sha256()
    for module in modules:
        for name, param in module.named_parameters():
            data = param.detach().contiguous().cpu()
            h.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
            h.update(data.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def job_digest(per_rank: Mapping[int, str]) -> str:
    """sha256 over the given ranks' digests in rank order."""
    h = hashlib.sha256()
    for rank in sorted(per_rank):
        h.update(f"{rank}:{per_rank[rank]};".encode())
    return h.hexdigest()
