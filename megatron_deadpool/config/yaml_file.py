"""Reading a YAML config file (a job config, a cluster description): every way it can fail -
missing, a directory, unreadable, not UTF-8, not YAML - is one `ConfigError` line naming the
file and, for a syntax error, its `FILE:LINE:COLUMN` and the problem."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, first_line


def read_yaml(path: str | Path, what: str) -> Any:
    """The parsed document of `path` (None when empty); `what` names the flag or section that
    gave the path, at the start of every refusal."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what}: file {str(p)!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what}: {str(p)!r} is a directory; give a YAML file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what}: {p} is not UTF-8 text (byte {exc.start}: {exc.object[exc.start:exc.end]!r});"
            " save it as UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {p} ({exc.strerror or exc})") from None
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        problem = " ".join(filter(None, (exc.context, exc.problem)))
        raise ConfigError(f"{what}: {where}: not valid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what}: {p}: not valid YAML: {first_line(exc)}") from None
