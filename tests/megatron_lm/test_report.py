"""DeadPool's lines in Megatron's format (report.py)."""

from __future__ import annotations

import re


def test_report_lines_have_megatrons_shape() -> None:
    from megatron_deadpool.megatron_lm.report import megatron_line, replication_fields

    line = megatron_line(*replication_fields(5, 8, 4, 2048, 0.0021))
    assert re.fullmatch(
        r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+\] deadpool \| iteration +5/ +8 \| committed "
        r"replica iteration: 4 \| replica bytes per iteration: 2\.0 KiB \| replication time "
        r"\(ms\): 2\.1 \|",
        line,
    )
