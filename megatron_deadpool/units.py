"""Human-readable quantities for log lines and reports."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """`n` bytes in B, KiB, MiB, GiB or TiB (one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
