"""A newcomer builds its job's objects in a world of its own, then steps into the real one.

A spare that takes rank r builds everything rank r trains with - for Megatron-LM its whole
start-up (`initialize_megatron`, model and optimizer set-up, data loaders, the start of
`train()`), for the embedded job its model and optimizer - exactly as rank r did. That start-up
is full of world collectives (`all_gather_object` aligning optimizer parameter groups,
timestamp all-reduces, barriers, timer gathers) that the survivors, who are in the middle of
training, cannot mirror. So the newcomer runs it in a *private* world: torch's `fake` process
group with rank r of W, where every collective returns at once with this rank's own data
(an all-gather of identical keys, as here, yields exactly what the real one would). Megatron
asks for explicit gloo groups, which a fake world cannot create, so while the private world
stands `new_group` is told to use the world's own (fake) backend.

Then torch forgets the private world while the objects keep its groups (`rebind.forget`), the
newcomer creates its real groups - as it takes its slot, or (`newcomer_build`) as soon as a plan names
it, before the agreement - and `rebind.swap` puts the real group of the same name in place of
each private one, in one walk (`Driver.take_slot`, `Driver._create_ahead`): from then on its
objects are indistinguishable from a survivor's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_ORIGINAL: dict[str, Callable[..., Any]] = {}


def _fake_store() -> Any:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    return FakeStore()


def enter(
    rank: int, world_size: int, record: Callable[[dict[str, Any]], None] = lambda kwargs: None
) -> None:
    """From now on `init_process_group` creates a fake world (rank of world_size) and
    `new_group` fake groups; `record` receives the arguments the job asked for."""
    if _ORIGINAL:
        return
    _ORIGINAL["init"] = dist.init_process_group
    _ORIGINAL["new_group"] = dist.new_group
    real_init, real_new_group = dist.init_process_group, dist.new_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        record(dict(kwargs))
        real_init(backend="fake", store=_fake_store(), rank=rank, world_size=world_size)

    def new_group(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("backend", None)
        kwargs.pop("pg_options", None)
        return real_new_group(*args, **kwargs)

    dist.init_process_group = init_process_group
    dist.new_group = new_group
    c10d.new_group = new_group


def leave() -> None:
    """Restore the real `init_process_group` and `new_group` (torch forgets the fake world
    itself in `rebind.forget`)."""
    if not _ORIGINAL:
        return
    dist.init_process_group = _ORIGINAL.pop("init")
    real_new_group = _ORIGINAL.pop("new_group")
    dist.new_group = real_new_group
    c10d.new_group = real_new_group


def active() -> bool:
    """True while this process lives in its private world."""
    return bool(_ORIGINAL)
