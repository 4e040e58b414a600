"""Keeps the data position of a rolled-back survivor equal to a failure-free run's.

Megatron-LM's training loop holds its data iterator (a `RerunDataIterator`) in a local
variable that DeadPool cannot rewind. `BatchRecorder` sits underneath it instead (it becomes
the iterator's `iterable`): it remembers the micro-batches fetched during the last few
training steps, and after a rollback to iteration T it serves the batches of steps T+1, T+2,
... again, in their original order, before reading on from the source. Megatron's own per-step
replay (the rerun state machine) keeps working above it.

A newcomer needs none of this: its data loader is built at the restore iteration's position.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from ..errors import DeadpoolRuntimeError

KEEP_STEPS = 3
"""Steps of batches kept: the restore iteration is at most two steps behind the one running."""


class ReplayError(DeadpoolRuntimeError):
    """A rollback needs batches that were not kept (or the iterator cannot be wrapped)."""


class BatchRecorder(Iterator):
    """An iterator over `source` that can replay the batches of recent training steps."""

    def __init__(self, source: Iterator[Any], keep_steps: int = KEEP_STEPS) -> None:
        self.source = source
        self.keep_steps = keep_steps
        self.step = 0
        self.kept: dict[int, list[Any]] = {}
        self.replay: deque[tuple[int, Any]] = deque()

    def begin_step(self, step: int) -> None:
        """Batches fetched from now on belong to training step `step` (1-based)."""
        self.step = step
        self.kept.setdefault(step, [])
        for old in [s for s in self.kept if s <= step - self.keep_steps]:
            del self.kept[old]

    def __next__(self) -> Any:
        if self.replay:
            _, kept = self.replay.popleft()
            batch = _own(kept)
        else:
            batch = next(self.source)
            kept = _own(batch)
        self.kept.setdefault(self.step, []).append(kept)
        return batch

    def rewind_to(self, iteration: int) -> int:
        """Serve the batches of every step after `iteration` again; returns how many."""
        missing = [s for s in range(iteration + 1, self.step + 1) if s not in self.kept]
        if missing:
            raise ReplayError(
                f"cannot roll the data iterator back to iteration {iteration}: the batches of "
                f"step(s) {missing} were not kept"
            )
        pending = list(self.replay)
        self.replay = deque(
            (s, b) for s in sorted(self.kept) if s > iteration for b in self.kept[s]
        )
        self.replay.extend(pending)
        for s in [s for s in self.kept if s > iteration]:
            del self.kept[s]
        self.step = iteration
        return len(self.replay)


def _own(batch: Any) -> Any:
    """A batch the consumer's edits do not reach: a mapping is copied (shallow). Megatron's
    `get_batch` (core_v0.19.0) replaces the entries of the dict the iterator returned - moved to
    the device, then cut to this rank's share of the sequence with context parallelism - so a
    kept dict would be served cut already, and cut again, after a rollback. Tensors are not
    copied: they are replaced, never changed in place."""
    return dict(batch) if isinstance(batch, dict) else batch


def install_recorder(data_iterator: Any) -> list[BatchRecorder]:
    """Put a `BatchRecorder` under every `RerunDataIterator` in `data_iterator` (a list for
    virtual pipelines, or None on ranks that read no data); returns the recorders."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    items = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    recorders: list[BatchRecorder] = []
    for item in items:
        if item is None:
            continue
        if not isinstance(item, RerunDataIterator):
            raise ReplayError(
                f"the training data iterator is a {type(item).__name__}, not Megatron's "
                "RerunDataIterator: DeadPool cannot roll it back after a failure"
            )
        if not isinstance(item.iterable, BatchRecorder):
            item.iterable = BatchRecorder(item.iterable)
        recorders.append(item.iterable)
    return recorders


def reset_rerun_iterators(data_iterator: Any) -> None:
    """Drop a failed step's half-kept batches in Megatron's own replay buffer."""
    items = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    for item in items:
        if item is not None and hasattr(item, "advance"):
            item.advance()
