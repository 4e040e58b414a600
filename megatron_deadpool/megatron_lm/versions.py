"""The Megatron-LM releases DeadPool supports, and what differs between them.

The release is read from the tree that `import megatron` finds first (the runner puts the
script's folder first on the import path): `megatron/core/package_info.py`, read as text, so
nothing of Megatron is imported to decide. Each supported release series has one `Release`
naming the tag it was tested at and the few facts the integration needs where Megatron-LM
changed between them; everything else (the hooks, the newcomer, resume) is shared. A tree of
any other series is refused with one line naming the supported tags.

What differs, core_v0.16.1 -> core_v0.19.0:

- Arguments: in 0.16 `pretrain(..., extra_args_provider=...)` parses the command line inside
  `initialize_megatron`; in 0.19 the script calls `parse_and_validate_args(extra_args_provider=
  ...)` itself and passes `pretrain` a config container, so DeadPool's flags are chained there.
- Python: 0.19 declares Python >= 3.12 and uses `typing.override` (3.12) in
  `megatron/training/models/`; on 3.11 `typing_extensions.override` (the same decorator, which
  Megatron itself imports elsewhere) stands in for it.
- `megatron.core` imports a Triton kernel module unconditionally in 0.19 (in 0.16 only
  `megatron.training.initialize` did): the CPU mode's Triton stand-in must exist before the
  first import of `megatron.core`.
- `train_step` takes `pg_collection` and `p2p_communicator` keywords in 0.19 (the hooks pass
  what they do not know through).
- 0.19's optimizer answers `has_grad_norm_group` with a world all-reduce on its first step and
  caches the answer; a newcomer's optimizer has no answer yet, so after a swap every rank
  drops it and computes it again, together (`hotswap.worker.weights.forget_cached_collectives`, for
  every job: the embedded job's optimizer is megatron-core's too).
- 0.19 writes Megatron's common checkpoint state inside the `torch_dist` files instead of
  `common.pt` (nothing DeadPool reads; the tests do).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError


@dataclass(frozen=True)
class Release:
    """One supported Megatron-LM release series and what DeadPool must know about it."""

    tag: str
    """The Megatron-LM git tag this series is tested at."""
    series: tuple[int, int]
    """(MAJOR, MINOR) as `megatron/core/package_info.py` states them."""
    script_parses_args: bool
    """The training script calls `parse_and_validate_args` before `pretrain(cfg_container, ...)`
    (0.19); otherwise `pretrain(extra_args_provider=...)` parses them (0.16)."""
    needs_typing_override: bool
    """Megatron-LM imports `typing.override`, which Python 3.11 lacks."""


RELEASES = (
    Release("core_v0.16.1", (0, 16), script_parses_args=False, needs_typing_override=False),
    # package_info.py at tag core_v0.19.0 reads 0.19.1
    Release("core_v0.19.0", (0, 19), script_parses_args=True, needs_typing_override=True),
)
SUPPORTED_TAGS = ", ".join(r.tag for r in RELEASES)


class UnsupportedMegatronError(ConfigError):
    """The Megatron-LM tree is not of a release series DeadPool supports."""


def read_version(info: Path) -> tuple[int, int, int]:
    """(MAJOR, MINOR, PATCH) of a `megatron/core/package_info.py`."""
    text = info.read_text()
    parts = []
    for name in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(rf"^{name}\s*=\s*(\d+)", text, re.MULTILINE)
        if m is None:
            raise UnsupportedMegatronError(
                f"megatron: cannot read {name} from {info}; point the import path at a "
                f"Megatron-LM tree of a supported tag ({SUPPORTED_TAGS})"
            )
        parts.append(int(m.group(1)))
    return parts[0], parts[1], parts[2]


def package_info() -> Path:
    """The `megatron/core/package_info.py` that `import megatron.core` would load."""
    spec = importlib.util.find_spec("megatron")  # a namespace package: imports nothing
    for folder in (spec.submodule_search_locations or []) if spec else []:
        info = Path(folder) / "core" / "package_info.py"
        if info.is_file():
            return info
    raise UnsupportedMegatronError(
        "megatron: no Megatron-LM tree on the import path; run the tree's script (its folder "
        f"comes first) with a supported tag ({SUPPORTED_TAGS})"
    )


def release_of(version: tuple[int, int, int], where: object = "") -> Release:
    """The supported release of `version`; `UnsupportedMegatronError` for any other."""
    for release in RELEASES:
        if version[:2] == release.series:
            return release
    text = ".".join(map(str, version))
    raise UnsupportedMegatronError(
        f"megatron: Megatron-LM {text}{f' ({where})' if where else ''} is not supported; "
        f"supported tags: {SUPPORTED_TAGS}"
    )


def current() -> Release:
    """The release of the Megatron-LM tree on the import path."""
    info = package_info()
    return release_of(read_version(info), info)


def prepare_python(release: Release) -> None:
    """Python 3.11 running a release written for 3.12: `typing.override` from
    `typing_extensions` (call before Megatron-LM's modules are imported)."""
    import typing

    if release.needs_typing_override and sys.version_info < (3, 12):
        if not hasattr(typing, "override"):
            from typing_extensions import override

            typing.override = override  # type: ignore[attr-defined]
