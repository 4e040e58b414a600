"""Device back-ends: the CPU development mode (gloo) and the CUDA/NCCL path.

`select_device(mode)` decides once per process: CUDA when it is really present (unless the
CPU mode is asked for), the CPU development mode otherwise. Everything above this package
talks to `Device` and never checks for CUDA itself.
"""

from __future__ import annotations

from .base import Device, active_device, select_device

__all__ = ["Device", "active_device", "select_device"]
