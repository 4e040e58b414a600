"""One training step as the driver hands it to the job (`Driver.step`).

A job used to make four calls around every step (stop without the coordinator and fire the
faults injected at it; let the optimizer wait for the last capture; end the replication round
and start the step's; record the step as completed). The driver's context around a step makes
them: on entry the first two, on exit the last two. What the job reads and sets in between is
a `Step`: when the step's compute began, the in-flight round's `settle` for a step collective
that carries the replicas' verdict (the embedded job's loss all-reduce), the verdict it
carried, and - after the step - the committed iteration and replication's time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Step:
    """Training step `n` under the driver (`Driver.step`)."""

    n: int
    started: float
    """`time.perf_counter()` as the job's compute began (after the faults of step n)."""
    settle: Callable[[], bool | None] | None
    """The in-flight replication round's `Replicator.settle`, for a step collective that
    carries its verdict (None: no round in flight, or the driver agrees on it itself)."""
    end: Callable[[Step, int], None] = field(repr=False)
    """The driver's end of a step (`Driver.step`): commit, replicate, record it completed."""
    verdict: bool | None = None
    """Set by the job: every rank's verdict on the settled round, carried by its step (None:
    the driver agrees on it with a collective of its own)."""
    committed: int | None = None
    """After the step: the globally committed iteration (None: none yet, or DeadPool off)."""
    replication_s: float = 0.0
    """After the step: how long ending the round and starting the step's took."""
    ended: list[int] = field(default_factory=list)
    """The steps ended so far in this context (`done`)."""

    def done(self, k: int) -> None:
        """Step k's optimizer step is done: replicate it and record it completed. The context
        ends step n itself when the job did not; a job that recomputes steps before n in the
        same context (Megatron-LM's replay after a recovery) ends each of them with this."""
        self.end(self, k)
        self.ended.append(k)
