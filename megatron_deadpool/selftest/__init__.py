"""`deadpool selftest`: what a user runs first on a new machine, and pastes into a bug report.

One row per check (communication settings, replication, a killed peer, a frozen peer, replica
memory, the pack kernel), each pass / fail / skipped with its wall time: `table` renders and
judges (pure), `device_checks` and `runs` do the checks, `suite` runs them in order.
"""
