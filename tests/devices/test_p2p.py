"""One round of point-to-point transfers posted at once (`devices.p2p.post`) on gloo worlds.

Patterns that hang when sends and receives are posted one by one on NCCL: mutual pairs (two
ranks sending to each other) and rings over 3+ failure domains, also with k=2 (each rank
sends to its two successors and receives from its two predecessors). Each round runs through
`dist.batch_isend_irecv` (the path NCCL takes, `batch=True`) and through gloo's direct
posting (the default on gloo); every received buffer must hold exactly its sender's bytes,
and a batched round must hand back one work per transfer. NCCL itself (its stream ordering,
its communicator set-up) is not exercised here: that is the GPU suite's and `deadpool
selftest`'s job on real nodes.
"""

from __future__ import annotations

from typing import Any

import pytest
from mp import run_world

PATTERNS = {
    "mutual-pairs": (4, lambda r, n: [(r + 2) % n], lambda r, n: [(r + 2) % n]),
    "ring-3-domains": (3, lambda r, n: [(r + 1) % n], lambda r, n: [(r - 1) % n]),
    "ring-4-k2": (
        4,
        lambda r, n: [(r + 1) % n, (r + 2) % n],
        lambda r, n: [(r - 1) % n, (r - 2) % n],
    ),
}


def _payload(src: int, dst: int, nbytes: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(1000 * src + dst)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def _round_rank(*, rank: int, world_size: int, store: Any, pattern: str) -> dict[str, Any]:
    import datetime

    import torch
    import torch.distributed as dist

    from megatron_deadpool.devices.p2p import Transfer, batched, post

    _, to, frm = PATTERNS[pattern]
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    out: dict[str, Any] = {"batched_by_backend": batched(group, torch.device("cpu"))}
    for batch in (True, None):
        sizes = {peer: 4096 + 16 * (peer + rank) for peer in frm(rank, world_size)}
        inbox = {peer: torch.zeros(n, dtype=torch.uint8) for peer, n in sizes.items()}
        transfers = [
            Transfer("send", _payload(rank, dst, 4096 + 16 * (dst + rank)), dst)
            for dst in to(rank, world_size)
        ]
        transfers += [Transfer("recv", buf, src) for src, buf in inbox.items()]
        works = post(transfers, group, batch=batch)
        for work in works:
            work.wait()
        out[str(batch)] = {
            "works": len(works),
            "transfers": len(transfers),
            "exact": all(
                torch.equal(buf, _payload(src, rank, buf.numel())) for src, buf in inbox.items()
            ),
        }
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_one_round_of_sends_and_receives_completes_exactly(pattern: str) -> None:
    world = PATTERNS[pattern][0]
    results = run_world("test_p2p:_round_rank", world, kwargs={"pattern": pattern}, timeout=120)
    for rank, r in enumerate(results):
        assert r["batched_by_backend"] is False  # gloo: no coalescing, direct posting
        for mode in ("True", "None"):
            assert r[mode]["exact"], (rank, mode, r)
            assert r[mode]["works"] == r[mode]["transfers"], (rank, mode, r)


def test_a_round_must_stay_on_one_device() -> None:
    import torch

    from megatron_deadpool.devices.p2p import Transfer, post

    mixed = [
        Transfer("send", torch.zeros(4), 0),
        Transfer("recv", torch.zeros(4, device="meta"), 1),
    ]
    with pytest.raises(ValueError, match="one device"):
        post(mixed, None)  # type: ignore[arg-type]
    assert post([], None) == []  # type: ignore[arg-type]
