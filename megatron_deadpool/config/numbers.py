"""Numbers from flags and files, checked before use: the right kind, finite, in range.

`check_number` is the one check every config dataclass and command applies to a number it was
given (`nan`, `inf`, a bool or a string where a number belongs, a count of 0 where one is the
least): it raises a `ConfigError` that names the flag or key and the range that fits.
`number_arg` is the same check as an argparse `type=`, for flags a command owns (not generated
from a config dataclass): argparse then prints it as one line naming the flag.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from ..errors import ConfigError

Number = int | float


def _range(
    minimum: Number | None, maximum: Number | None, above: Number | None, below: Number | None
) -> str:
    """ ">= 1", "> 0 and <= 1", ...: the bounds a number must keep, in words."""
    bounds = zip((">=", ">", "<=", "<"), (minimum, above, maximum, below))
    return " and ".join(f"{op} {bound:g}" for op, bound in bounds if bound is not None)


def check_number(
    value: object,
    where: str,
    *,
    integer: bool = False,
    minimum: Number | None = None,
    maximum: Number | None = None,
    above: Number | None = None,
    below: Number | None = None,
    unit: str = "",
) -> Number:
    """`value` when it is a finite number (an `int` with `integer`) within the bounds
    (`minimum`/`maximum` inclusive, `above`/`below` exclusive); else `ConfigError` naming
    `where` and the range, e.g. "deadpool-pg-timeout: expected a finite number of seconds
    > 0, got nan"."""
    kind = "an integer" if integer else f"a finite number{f' of {unit}' if unit else ''}"
    wanted = f"{kind} {_range(minimum, maximum, above, below)}".rstrip()
    ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    ok = ok and math.isfinite(value)  # type: ignore[arg-type]
    if ok:
        number: Number = value  # type: ignore[assignment]
        ok = (
            (minimum is None or number >= minimum)
            and (maximum is None or number <= maximum)
            and (above is None or number > above)
            and (below is None or number < below)
        )
    if not ok:
        raise ConfigError(f"{where}: expected {wanted}, got {value!r}")
    return value  # type: ignore[return-value]


def number_arg(
    *,
    integer: bool = False,
    minimum: Number | None = None,
    maximum: Number | None = None,
    above: Number | None = None,
    below: Number | None = None,
    unit: str = "",
) -> Callable[[str], Number]:
    """An argparse `type=` that parses a flag's text and applies `check_number` to it;
    argparse reports a refusal as "argument --FLAG: expected ..."."""

    def parse(text: str) -> Number:
        try:
            value: Number = int(text) if integer else float(text)
        except ValueError:
            value = text  # type: ignore[assignment]  # refused below, as given
        try:
            return check_number(
                value,
                "value",
                integer=integer,
                minimum=minimum,
                maximum=maximum,
                above=above,
                below=below,
                unit=unit,
            )
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value: ")) from None

    parse.__name__ = "integer" if integer else "number"  # argparse's "invalid ... value"
    return parse
