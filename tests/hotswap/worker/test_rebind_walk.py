"""The walk over the job's objects that every rebinding makes (hotswap/worker/rebind.py): roots
that share objects - the optimizer holds the model, the model chunks hold the configs - are
walked as one, each object entered once (walked root by root, a newcomer's swap met ~10,500
values where its objects hold ~3,000)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from megatron_deadpool.hotswap.worker import rebind


class Node:
    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


def test_objects_shared_by_roots_are_entered_once(monkeypatch: pytest.MonkeyPatch) -> None:
    config = Node(seq_length=8, layers=[Node(width=2), Node(width=3)])
    model = Node(config=config, chunks=[Node(config=config)])
    optimizer = Node(model=model, config=config, groups=({"params": [model]},))
    met: Counter[int] = Counter()
    real = rebind.is_group

    def counted(value: Any) -> bool:
        met[id(value)] += 1
        return real(value)

    monkeypatch.setattr(rebind, "is_group", counted)
    assert rebind.stale_group_refs([model, optimizer, config]) == []
    # Met at each reference (where it could be replaced), an object once more as it is entered:
    # the config at its 3 references, what it holds at 1 - not again for each root reaching it.
    assert met[id(config)] == 3 + 1
    assert met[id(config.layers)] == met[id(model.chunks)] == 1  # lists: entered, not asked
    assert met[id(config.layers[0])] == 1 + 1
