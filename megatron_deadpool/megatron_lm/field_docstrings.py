"""Megatron-LM's argument parser built again at a fraction of the cost: a newcomer's start-up
builds it on the hot swap's critical path.

Megatron-LM builds part of its argument parser from dataclasses (`TransformerConfig` and the
others `ArgumentGroupFactory` turns into argument groups), each field's help from the docstring
under it, which `ArgumentGroupFactory._get_field_docstrings` reads from the class's source
(`inspect.getsource`, then `ast.parse`, for the class and each of its bases) every time a parser
is built. `pretrain()` builds one again for `ft_integration.setup` before `initialize_megatron`;
each costs ~65-85 ms (measured on one core: core_v0.16.1 65-74, core_v0.19.0 77-85). A
newcomer begins that start-up when the coordinator's plan names it, and the survivors wait for it.

A class's source does not change while the process runs, so `install` reads each class's field
docstrings once (every caller gets a copy): the parser built before the plan (core_v0.19.0's
script parses the arguments itself, before `pretrain()`) leaves the later ones ~6 ms each. The
parser is the same; nothing else changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def install() -> bool:
    """Read each dataclass's field docstrings once (idempotent); False for a Megatron-LM tree
    without `ArgumentGroupFactory` (nothing to do)."""
    try:
        from megatron.training import argument_utils
    except ImportError:
        return False
    factory = getattr(argument_utils, "ArgumentGroupFactory", None)
    real = getattr(factory, "_get_field_docstrings", None)
    if factory is None or real is None:
        return False
    if not getattr(real, "_deadpool", False):
        factory._get_field_docstrings = once_per_class(real)
    return True


def once_per_class(real: Callable[[Any, type], dict[str, str]]) -> Callable[..., dict[str, str]]:
    """`real(self, cls)` computed once per class; each call returns a copy of the result."""
    known: dict[type, dict[str, str]] = {}

    @functools.wraps(real)
    def field_docstrings(self: Any, src_cfg_class: type) -> dict[str, str]:
        if src_cfg_class not in known:
            known[src_cfg_class] = real(self, src_cfg_class)
        return dict(known[src_cfg_class])

    field_docstrings._deadpool = True  # type: ignore[attr-defined]
    return field_docstrings
