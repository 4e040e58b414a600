"""megatron-core's checkpoint writer reports its writes through a queue of the rank's own process.

The torch_dist writer (`megatron.core.dist_checkpointing.strategies.filesystem_async`) passes
the results of a save's writes from the function that writes to the one that finishes the save
through a queue it makes once per process, at the first save:
`multiprocessing.get_context("spawn").Manager().Queue()`. That starts a manager's server
process, which imports torch afresh to unpickle the results (2-2.5 s of CPU per rank, measured
here) and does not watch its parent: when a failure kills the rank, the server stays. Where a
failure ends the job that is harmless; where DeadPool keeps the job running, every killed rank
that had saved leaves one such process on its node until the job ends (on a lost node they go
with it).

DeadPool's saves are synchronous - the embedded job's own (`embedded/checkpoint.py`) and
Megatron-LM's under `--deadpool` (`megatron_lm/save.py`; `--async-save` is refused,
`megatron_lm/interplay.py`): megatron-core's `execute_sync` writes (through worker threads, or
write processes it forks that report to the caller over a queue of their own), puts the results
in that queue and takes them out again in the rank's own process. A `queue.Queue` carries them
the same way, with no process: `keep_in_process()` puts one in megatron-core's cache before
the first save (both supported tags keep it in the module's `_results_queue`). An
asynchronous save, whose writing runs in another process, would need the manager's queue.
"""

from __future__ import annotations

import queue


def keep_in_process() -> bool:
    """Make megatron-core's torch_dist writer report through a queue of this process (call
    before the first save; the saves must be synchronous). False where the writer has no such
    cache (another megatron-core) or already made its queue."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", ...) is not None:
        return False
    filesystem_async._results_queue = queue.Queue()
    return True
