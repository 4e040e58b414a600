"""Fault injection (`--deadpool-fail`): where each injected fault strikes a process, and how.

The driver calls one method at each point of a process's life where a fault can strike:
  - `while_waiting`   a waiting spare, once training reached the spec's iteration
                      (`spare:I@ITER`);
  - `on_assignment`   a spare a recovery gave a slot, before it claims it (`spare:I@recovery`);
  - `at_iteration`    a rank as it starts an iteration (`RANK@ITER`, `node:N@ITER`);
  - `in_recovery`     a rank in a recovery, once the coordinator planned it (`RANK@recovery`);
  - `in_repair`       a rank in a repair of its groups in place, its handles published
                      (`RANK@repair`) or not yet (`RANK@handles`; called by `group_repair`);
  - `after_training`  a rank right after training completed (`RANK@end`).
Which specs hit whom is `config.faults` (pure); each spec fires once per job, whoever holds the
slot - not again for the process that takes it over, nor when a step is recomputed - which the
store counts (`WorkerView.fire_once`). A fault strikes as SIGKILL (`kill`: a crash), SIGSTOP
(`hang`: alive but silent) or by flipping a bit in every replica the rank holds (`flip`:
memory corruption that checksums must catch); the time it struck is stamped in the store, so
that the coordinator measures detection from it. `raise` is the exception: a deterministic
error of the job (`InjectedError`, which the process reports as its own error), it fires every
time its rank reaches the iteration, in whichever process holds the rank.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Sequence

from ...config.faults import (
    FaultKind,
    end_faults,
    iteration_faults,
    parse_fault,
    recovery_faults,
    repair_faults,
    spare_faults,
)
from ...replication.replicator import Replicator
from ..protocol.worker_view import WorkerView

log = logging.getLogger("megatron_deadpool.injection")

PLAN_WAIT_S = 60.0
"""Longest wait of a `RANK@recovery` fault for the plan of the recovery it strikes in."""


class InjectedError(RuntimeError):
    """What a `raise` fault raises: a stand-in for a bug in the job or a bad input file."""


class FaultInjector:
    """The `--deadpool-fail` specs of one process, fired at their points."""

    def __init__(self, specs: Sequence[str], membership: WorkerView) -> None:
        self.specs = list(specs)
        self.membership = membership

    def waiting_faults(self, member: str) -> bool:
        """Whether a fault may strike `member` while it waits for a slot (it then looks at the
        job's progress more often)."""
        return bool(spare_faults(self.specs, member))

    def while_waiting(self, member: str) -> None:
        """A waiting spare: `spare:I@ITER` once training reached ITER."""
        for index, iteration, kind in spare_faults(self.specs, member):
            progress = self.membership.progress()
            if progress >= iteration and self.membership.fire_once(index, member):
                self._strike(kind, f"while waiting (training at iteration {progress})")

    def on_assignment(self, member: str, rank: int, generation: int) -> None:
        """A spare given `rank` of `generation`, its objects built, before it claims the slot."""
        for index, _, kind in spare_faults(self.specs, member, assigned=True):
            if self.membership.fire_once(index, member):
                self._strike(
                    kind, f"given rank {rank} of generation {generation}, before claiming it"
                )

    def at_iteration(
        self,
        rank: int,
        n: int,
        ranks_per_node: int,
        replicator: Replicator | None,
        generation: int,
    ) -> None:
        """`rank` of `generation` starts iteration n."""
        hit = iteration_faults(self.specs, rank, ranks_per_node).get(n)
        if hit is None:
            return
        if hit[1] == "raise":  # deterministic: every time, whoever holds it
            raise InjectedError(f"fault injection: rank {rank} raises at iteration {n}")
        node = parse_fault(self.specs[hit[0]]).node is not None
        if node and self.membership.fault_generation(hit[0], generation) != generation:
            return  # the node went down in an earlier generation; this process runs elsewhere
        if self.membership.fire_once(hit[0], rank):
            if node:
                self.membership.record_node_lost()  # the node goes whole, its agent with it
            self._strike(hit[1], f"at iteration {n}", replicator)

    def in_recovery(self, rank: int, replicator: Replicator | None, generation: int) -> None:
        """`rank` enters the recovery that plans `generation`: a fault strikes once the plan
        is out (or `PLAN_WAIT_S` passed), so that it always is a second failure, which the
        next plan supersedes - not one the coordinator may see with the first."""
        for index, kind in recovery_faults(self.specs, rank):
            if self.membership.fire_once(index, rank):
                self.membership.wait_plan(generation, PLAN_WAIT_S)
                self._strike(kind, "while in recovery", replicator)

    def in_repair(self, rank: int, published: bool = True) -> None:
        """`rank` repairs its groups in place and published its handles (`RANK@repair`: its
        peers wait for it in the reconfigure), or is about to (`RANK@handles`: they wait for its
        handles)."""
        for index, kind in repair_faults(self.specs, rank, published):
            if self.membership.fire_once(index, rank):
                before = "" if published else ", before its handles"
                self._strike(kind, f"in a repair of its groups{before}")

    def after_training(self, rank: int) -> None:
        """`rank` completed training; its final work comes next."""
        for index, kind in end_faults(self.specs, rank):
            if self.membership.fire_once(index, rank):
                self._strike(kind, "after training completed")

    def _strike(self, kind: FaultKind, when: str, replicator: Replicator | None = None) -> None:
        if kind == "flip":  # memory corruption of the replicas this rank holds
            if replicator is not None:  # nothing held before the first round
                log.warning("fault injection: flip %s", when)
                replicator.flip_bits_at_rest()
            return
        log.warning("fault injection: %s %s", kind, when)
        self.membership.record_fault()
        strike(kind)


def strike(kind: str) -> None:
    """Fail this process now: SIGKILL (crash) or SIGSTOP (hang)."""
    os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
