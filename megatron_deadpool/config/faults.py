"""Fault-injection specs (`--fail ...`): parsing and who-is-hit, nothing else.

Forms (each fault fires once per job, but `raise`):
  RANK@ITER[:kill|hang|flip|raise]  rank RANK fails as it starts iteration ITER, so its peers
                               are caught in that iteration's collectives
  node:N@ITER[:kill|hang|raise]  every rank of failure domain N, likewise (in the generation
                               that first reaches ITER: a spare that later takes one of those
                               ranks runs on another node and is spared)
  spare:I@ITER[:kill|hang]     waiting spare s{I}, once training has reached iteration ITER
  spare:I@recovery[:kill|hang] spare s{I}, as soon as a recovery gives it a slot, before it
                               claims the slot and joins (a spare lost while being swapped in)
  RANK@recovery[:kill|hang|flip]  rank RANK fails in the next recovery, once the
                               coordinator planned it (a second failure during recovery;
                               `flip`: its replicas rot just before agreement would use them)
  RANK@end[:kill|hang]         rank RANK fails right after training completed (its last step
                               done and replicated), before the job's final work (final save,
                               final report)
  RANK@repair[:kill|hang]      the process holding rank RANK fails in its next repair of its
                               groups in place, once it published its handles: a death during
                               the repair, its peers waiting in the reconfigure (where groups
                               are rebuilt, never)
  RANK@handles[:kill|hang]     likewise, before it published its handles: its peers - a
                               newcomer reading the survivors' prefix from them among them -
                               wait for them until the coordinator's next plan marks them lost
Kinds: `kill` (SIGKILL, the default), `hang` (SIGSTOP: alive but silent, as a hung GPU or a
stuck NIC), `flip` (flip one bit of every replica the rank holds, at rest: memory corruption
that checksums must catch before the replica is used), `raise` (an exception in the job's code,
as a bug or a bad input file would raise: a deterministic error, so it fires every time the
rank reaches ITER - in whichever process holds the rank, a spare that took its slot included;
at iteration 1 it is an error of the job's start-up, before anything was replicated).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError

_SPEC = re.compile(
    r"^(?:(?P<node>node:)|(?P<spare>spare:))?(?P<who>\d+)@(?P<when>\d+|recovery|end|repair|handles)"
    r"(?::(?P<kind>kill|hang|flip|raise))?$"
)

FaultKind = Literal["kill", "hang", "flip", "raise"]
FORMS = (
    "RANK@ITER[:kill|hang|flip|raise], node:N@ITER, spare:I@ITER, RANK@recovery, "
    "spare:I@recovery, RANK@end, RANK@repair or RANK@handles"
)


@dataclass(frozen=True)
class FaultSpec:
    """One injected failure; `iteration` is 0 for `@recovery`, `@end`, `@repair` and `@handles`
    faults (`in_repair`: "repair" once its handles are out, "handles" before)."""

    iteration: int
    kind: FaultKind
    rank: int | None = None
    node: int | None = None
    spare: int | None = None
    during_recovery: bool = False
    at_end: bool = False
    in_repair: Literal["", "repair", "handles"] = ""

    def ranks(self, ranks_per_node: int) -> list[int]:
        """The world ranks this fault hits (none for a spare)."""
        if self.rank is not None:
            return [self.rank]
        if self.node is not None:
            return list(range(self.node * ranks_per_node, (self.node + 1) * ranks_per_node))
        return []

    def __str__(self) -> str:
        if self.rank is not None:
            who = f"rank {self.rank}"
        elif self.node is not None:
            who = f"node {self.node}"
        else:
            who = f"spare s{self.spare}"
        if self.during_recovery:
            when = "in recovery"
        elif self.at_end:
            when = "after training"
        elif self.in_repair:
            when = "in a repair of its groups"
            if self.in_repair == "handles":
                when += ", before its handles"
        else:
            when = f"at iteration {self.iteration}"
        return f"{who} {self.kind} {when}"


def parse_fault(text: str) -> FaultSpec:
    """Parse one `--fail` value; raise `ConfigError` naming the expected forms."""
    match = _SPEC.match(text.strip())
    if match is None:
        raise ConfigError(f"fail: {text!r} is not one of {FORMS} (e.g. 2@5:kill, node:1@4)")
    kind: FaultKind = match["kind"] or "kill"  # type: ignore[assignment]
    who = int(match["who"])
    recovery, end = (match["when"] == w for w in ("recovery", "end"))
    repair = match["when"] in ("repair", "handles")
    iteration = 0 if recovery or end or repair else int(match["when"])
    if not (recovery or end or repair) and iteration < 1:
        raise ConfigError(f"fail: iteration in {text!r} must be >= 1")
    if kind == "flip" and (match["node"] or match["spare"]):
        raise ConfigError(f"fail: {text!r}: 'flip' applies to one rank (RANK@ITER:flip)")
    if kind == "raise" and (match["spare"] or recovery or end or repair):
        raise ConfigError(
            f"fail: {text!r}: 'raise' applies to a rank or node as an iteration starts "
            "(RANK@ITER:raise, node:N@ITER:raise)"
        )
    if recovery and match["node"]:
        raise ConfigError(
            f"fail: {text!r}: '@recovery' applies to one rank or spare (RANK@recovery, "
            "spare:I@recovery)"
        )
    if (end or repair) and (match["node"] or match["spare"] or kind == "flip"):
        when = match["when"]
        raise ConfigError(
            f"fail: {text!r}: '@{when}' applies to one rank (RANK@{when}[:kill|hang])"
        )
    if match["node"]:
        return FaultSpec(iteration=iteration, kind=kind, node=who)
    if match["spare"]:
        return FaultSpec(iteration=iteration, kind=kind, spare=who, during_recovery=recovery)
    return FaultSpec(
        iteration=iteration,
        kind=kind,
        rank=who,
        during_recovery=recovery,
        at_end=end,
        in_repair=match["when"] if repair else "",  # type: ignore[arg-type]
    )


def check_faults(
    faults: list[FaultSpec], world_size: int, ranks_per_node: int, iters: int, spares: int = 0
) -> None:
    """Check that every fault targets existing ranks/spares within the run's iterations."""
    nodes = world_size // ranks_per_node
    for fault in faults:
        if fault.rank is not None and fault.rank >= world_size:
            raise ConfigError(f"fail: rank {fault.rank} does not exist (world size {world_size})")
        if fault.node is not None and fault.node >= nodes:
            raise ConfigError(f"fail: node {fault.node} does not exist ({nodes} nodes)")
        if fault.spare is not None and fault.spare >= spares:
            raise ConfigError(f"fail: spare {fault.spare} does not exist ({spares} spares)")
        if fault.iteration > iters:
            raise ConfigError(
                f"fail: iteration {fault.iteration} is past the run's last iteration {iters}"
            )


def iteration_faults(
    specs: Sequence[str], rank: int, ranks_per_node: int
) -> dict[int, tuple[int, FaultKind]]:
    """iteration -> (spec index, kind) of the `--fail` specs that hit `rank` as an iteration
    starts (`RANK@ITER`, `node:N@ITER`)."""
    out: dict[int, tuple[int, FaultKind]] = {}
    for index, spec in enumerate(specs):
        fault = parse_fault(spec)
        if fault.iteration and rank in fault.ranks(ranks_per_node):
            out[fault.iteration] = (index, fault.kind)
    return out


def _rank_faults(
    specs: Sequence[str], rank: int, when: Callable[[FaultSpec], bool]
) -> list[tuple[int, FaultKind]]:
    """(spec index, kind) of the specs naming `rank` that strike `when` says."""
    return [
        (index, fault.kind)
        for index, fault in enumerate(map(parse_fault, specs))
        if fault.rank == rank and when(fault)
    ]


def recovery_faults(specs: Sequence[str], rank: int) -> list[tuple[int, FaultKind]]:
    """(spec index, kind) of the specs that hit `rank` as it enters a recovery."""
    return _rank_faults(specs, rank, lambda fault: fault.during_recovery)


def spare_faults(
    specs: Sequence[str], member: str, *, assigned: bool = False
) -> list[tuple[int, int, FaultKind]]:
    """(spec index, iteration, kind) of the specs that hit spare `member` (`s{I}`): while it
    waits, or (`assigned`) once a recovery gave it a slot (`spare:I@recovery`)."""
    out: list[tuple[int, int, FaultKind]] = []
    for index, spec in enumerate(specs):
        fault = parse_fault(spec)
        hits = fault.spare is not None and member == f"s{fault.spare}"
        if hits and fault.during_recovery == assigned:
            out.append((index, fault.iteration, fault.kind))
    return out


def repair_faults(
    specs: Sequence[str], rank: int, published: bool = True
) -> list[tuple[int, FaultKind]]:
    """(spec index, kind) of the specs that hit `rank` in a repair of its groups in place, once
    its handles are `published` (`RANK@repair`), or before (`RANK@handles`)."""
    point = "repair" if published else "handles"
    return _rank_faults(specs, rank, lambda fault: fault.in_repair == point)


def end_faults(specs: Sequence[str], rank: int) -> list[tuple[int, FaultKind]]:
    """(spec index, kind) of the specs that hit `rank` right after training completed."""
    return _rank_faults(specs, rank, lambda fault: fault.at_end)
