"""DeadPool's log level in a Megatron-LM run follows Megatron's own convention.

Megatron-LM (`megatron/training/initialize.py: setup_logging`, both supported tags) sets the
root logger's level from `--logging-level N`, else from the environment variable
`MEGATRON_LOGGING_LEVEL`, else leaves INFO. DeadPool's logger keeps its own handler (its lines
carry the rank and generation prefix, and must not be printed twice through the root logger),
so it does not inherit that level: it is given the same one, decided the same way, before
DeadPool's first line (Megatron parses its arguments later).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence

from ..errors import ConfigError

ENV = "MEGATRON_LOGGING_LEVEL"


def megatron_logging_level(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """The level Megatron-LM logs at for this command line and environment (INFO if unset)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--logging-level", default=None)
    known, _ = parser.parse_known_args(list(argv))
    for name, text in (("--logging-level", known.logging_level), (ENV, environ.get(ENV))):
        if text is None:
            continue
        try:
            return int(text)
        except ValueError:
            raise ConfigError(
                f"{name}: expected a numeric logging level as Megatron-LM reads it (e.g. 10 "
                f"DEBUG, 20 INFO, 30 WARNING), got {text!r}"
            ) from None
    return logging.INFO
