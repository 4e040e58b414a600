"""`is_peer_failure`: is this exception a collective failing because a peer died or hung?

The recovery loop must not take an out-of-memory error, a CUDA fault or a bug for a peer's
failure (each is a `RuntimeError`, like gloo's errors). What torch 2.13 raises:

- NCCL: `torch.distributed.DistBackendError` for a failed, timed-out or aborted collective
  (ProcessGroupNCCL's watchdog and `WorkNCCL` set it; the next collective on an aborted
  communicator raises it too);
- gloo: a plain `RuntimeError` from gloo's transport, e.g. "[.../gloo/transport/tcp/pair.cc]
  Read error", "Connection closed by peer" (a peer died or its connections were shut down by
  `abort_groups`), "Timed out waiting ... for recv operation", "Application timeout caused
  pair closure" (verified with a SIGKILLed and a SIGSTOPped peer);
- `DistStoreError` / `DistNetworkError` come from the store: the coordinator, not a peer.

After `abort_groups` the adapters may see other errors from the aborted groups (e.g. torch's
"Default process group has not been initialized"); the driver knows it aborted and treats
any error of that step as the failure it is recovering from.
"""

from __future__ import annotations

import torch.distributed as dist

GLOO_MARKERS = (
    "gloo/transport/",
    "Connection closed by peer",
    "Connection reset by peer",
    "Application timeout caused pair closure",
    "Timed out waiting",
)


def is_peer_failure(exc: BaseException) -> bool:
    """True for a collective that failed because of a peer (see the module docstring)."""
    if isinstance(exc, (dist.DistStoreError, dist.DistNetworkError)):
        return False
    if isinstance(exc, dist.DistBackendError):
        return True
    if type(exc) is RuntimeError:  # subclasses (OOM, DeadPool's own errors) are not
        text = str(exc)
        return any(marker in text for marker in GLOO_MARKERS)
    return False
