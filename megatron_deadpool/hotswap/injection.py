"""Fault injection: how an injected failure strikes this process."""

from __future__ import annotations

import os
import signal


def inject(kind: str) -> None:
    """Fail this process now: SIGKILL (crash) or SIGSTOP (hang)."""
    os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
