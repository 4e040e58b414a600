"""What every role may read of the job's store, and the few writes two roles make: the base of
the role views (`worker_view`, `coordinator_view`, `agent_view`; `membership.Membership` holds
every role at once, for the launchers that host the coordinator and for tests).

A view is a set of named methods over one `sealed_store.SealedStore` (the store handle, the
seal, the batched reads): each method is one key of `messages.Keys` (whose docstrings say who
writes and who reads each key) read or written with its typed message. Several views may stand
on one core (`StoreView(core)`, `WorkerView(core)`, ...): they share its connection, its name
and its reporting of rejected values. A member is `a{r}` (the initial active of rank r) or
`s{i}` (spare i); g is a generation (0 at start, +1 per planned recovery). The words:
`docs/glossary.md`.

Here: the coordinator's inbox (any process wakes it), the job's token and layout, who announced
itself, the newest generation and its roster, the plans and survivors' holdings, the waiting
spares' wake-ups and names, the verdicts everyone stops on (out of redundancy, the job's own
error, the end, the shutdown), progress and the job's status; and the values a worker writes
that a standby coordinator writes again when it rebuilds the job's state from the
re-registrations (the layout, done, finished, progress).
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Callable
from typing import Self

from ...errors import JobTokenError
from .messages import (
    WAKE,
    Announcement,
    CoordinatorIdentity,
    EndReport,
    HoldingsReport,
    JobError,
    JobStatus,
    Keys,
    LayoutRecord,
    OutOfRedundancy,
    Plan,
    Progress,
    Roster,
)
from .seal import ForgedValue, JobSeal
from .sealed_store import SealedStore
from .store_protocol import StoreLike

SERVES_JOB = "job"
"""The payload of `job/token`: sealed, it proves the store serves the job of this secret."""


class StoreView:
    """One party's view of the job's store: the reads every role makes."""

    def __init__(self, core: SealedStore) -> None:
        """`core`: the sealed access this view reads and writes through (shared by the views
        of the same party)."""
        self.core = core
        # the newest generation this view read planned, or (a survivor) reported holdings for
        self.plan_seen = 0

    @property
    def store(self) -> StoreLike:
        """The store (or the client of it) this view reads and writes."""
        return self.core.store

    @property
    def member(self) -> str:
        """Who this view reads and writes as (a member, `coordinator`, `agent{n}`, ...)."""
        return self.core.member

    @property
    def seal(self) -> JobSeal:
        """The job's seal on every value."""
        return self.core.seal

    @property
    def on_rejected(self) -> Callable[[str, str], None] | None:
        """Called with (key, why) for every value rejected as not the job's (once each)."""
        return self.core.on_rejected

    @on_rejected.setter
    def on_rejected(self, report: Callable[[str, str], None] | None) -> None:
        self.core.on_rejected = report

    def sibling(self, store: StoreLike, member: str | None = None) -> Self:
        """The same view over another access to a store of the same job (another connection,
        or as `member`), which reports its rejections the same way."""
        other = copy.copy(self)
        other.core = self.core.sibling(store, member)
        other.plan_seen = 0
        return other

    # ------------------------------------------------------------------ the job and its coordinator
    def notify_coordinator(self) -> None:
        """Wake the coordinator (`next_message` returns)."""
        self.core.store.queue_push(Keys.INBOX, WAKE)

    def check_token(self) -> None:
        """Refuse to join a store that serves no job of this secret (another job's
        coordinator, or a store whose token someone else wrote)."""
        if not self.serves_job():
            raise JobTokenError(
                f"deadpool-job-token: this process's secret or run id (DEADPOOL_JOB_ID="
                f"{self.core.seal.job!r}) does not match the coordinator's job; give it the job's "
                f"DEADPOOL_JOB_TOKEN or DEADPOOL_JOB_TOKEN_FILE and DEADPOOL_JOB_ID "
                f"(member {self.core.member})"
            )

    def serves_job(self) -> bool | None:
        """Whether this store serves the job of this secret: None when it serves no job (a
        standby that has not taken over), False when its token is not this job's."""
        raw = self.core.peek(Keys.TOKEN)
        if raw is None:
            return None
        try:  # another job's token is no forgery to report: a probe finds it
            return self.core.seal.open(Keys.TOKEN, raw) == SERVES_JOB.encode()
        except ForgedValue:
            return False

    def identity(self) -> CoordinatorIdentity | None:
        """The coordinator serving this store; None: none has taken it yet."""
        value = self.core.read(Keys.COORDINATOR)
        return None if value is None else CoordinatorIdentity.decode(Keys.COORDINATOR, value)

    def publish_layout(self, layout: LayoutRecord) -> None:
        """Rank 0 (or a standby rebuilding the job's state): the job's parallel layout."""
        self.core.set(Keys.LAYOUT, layout.encode())

    def layout(self) -> LayoutRecord | None:
        """The job's parallel layout (None until rank 0 published it)."""
        value = self.core.read(Keys.LAYOUT)
        return None if value is None else LayoutRecord.decode(Keys.LAYOUT, value)

    # ------------------------------------------------------------------ members
    def announcement(self, member: str) -> Announcement | None:
        """Where `member` runs: its host and OS pid (`announce`)."""
        key = Keys.READY.format(member=member)
        value = self.core.read(key)
        return None if value is None else Announcement.decode(key, value)

    def announced(self, member: str) -> bool:
        """Whether `member` announced itself to this store (`announce`)."""
        return self.core.present(Keys.READY.format(member=member))

    def restore_done(self, member: str) -> None:
        """`member` finished its work (itself, or - a standby's rebuild - as it said when it
        re-registered)."""
        # (`done_count` only screens: `all_done` decides)
        self.core.stamp_counted(Keys.DONE.format(member=member), Keys.DONE_COUNT)

    # ------------------------------------------------------------------ generations
    def generation(self) -> int:
        """The newest generation with a roster (-1 before the first)."""
        g = self.core.number(Keys.GENERATION)
        return -1 if g is None else g

    def roster(self, generation: int) -> Roster:
        """Generation g's roster, waiting for it (up to the store's timeout)."""
        key = Keys.ROSTER.format(g=generation)
        return Roster.decode(key, self.core.get(key))

    def wait_newest_roster(self, timeout_s: float) -> Roster:
        """The newest roster, once there is one: what a starting process reads the job's world
        size from (generation 0's is not in a standby's store that took the job over later)."""
        self.core.store.wait([Keys.GENERATION], datetime.timedelta(seconds=timeout_s))
        return self.roster(self.generation())

    # ------------------------------------------------------ waiting spares and their names
    def spare_epoch(self) -> int:
        """How many events waiting spares were woken for so far."""
        return self.core.count(Keys.SPARE_EPOCH)

    def wake_spares(self) -> None:
        """Wake every spare blocked in `wait_spare_epoch` (a roster, or the shutdown)."""
        n = self.core.add(Keys.SPARE_EPOCH, 1)
        self.core.set(Keys.SPARE_EPOCH_N.format(n=n), "1")

    def number_spares_from(self, first: int) -> None:
        """The coordinator: spare names handed to joining processes start at s{first} (or
        after every name handed out already, when a standby takes over a job)."""
        current = self.core.count(Keys.SPARES_NEXT)
        if current < first:
            self.core.add(Keys.SPARES_NEXT, first - current)

    def claim_spare_name(self) -> str:
        """A process joining a running job: its spare member name, unique in the job."""
        return f"s{self.core.add(Keys.SPARES_NEXT, 1) - 1}"

    def spare_names_claimed(self) -> int:
        """How many spare names were handed out (s0 .. s{n-1}), the initial spares' included."""
        return self.core.count(Keys.SPARES_NEXT)

    # ------------------------------------------------------------------ recovery
    def latest_plan(self) -> int:
        """The newest planned generation (0: none planned yet)."""
        latest = self.core.number(Keys.LATEST_PLAN) or 0
        self.plan_seen = max(self.plan_seen, latest)
        return latest

    def plan(self, generation: int) -> Plan | None:
        """Generation g's plan (None: not planned, or not the job's)."""
        key = Keys.PLAN.format(g=generation)
        value = self.core.read(key)
        return None if value is None else Plan.decode(key, value)

    def holdings(self, generation: int, rank: int) -> HoldingsReport | None:
        """A survivor's report for generation g (None: not in yet)."""
        key = Keys.HOLDINGS.format(g=generation, rank=rank)
        value = self.core.read(key)
        return None if value is None else HoldingsReport.decode(key, value)

    # ------------------------------------------------------ verdicts, the end and progress
    def out_of_redundancy(self) -> OutOfRedundancy | None:
        """Why memory cannot recover, once the coordinator said so (None before)."""
        value = self.core.read(Keys.OUT_OF_REDUNDANCY)
        return None if value is None else OutOfRedundancy.decode(Keys.OUT_OF_REDUNDANCY, value)

    def job_error(self) -> JobError | None:
        """The coordinator's verdict that a failure is the job's own error (None: none)."""
        value = self.core.read(Keys.JOB_ERROR)
        return None if value is None else JobError.decode(Keys.JOB_ERROR, value)

    def report_finished(self, rank: int, iteration: int) -> None:
        """`rank` finished training at `iteration`, its final state replicated."""
        self.core.set(Keys.FINISHED.format(rank=rank), str(iteration))
        self.core.set(Keys.TRAINING_COMPLETE, str(iteration))

    def end(self) -> EndReport | None:
        """The coordinator's report of the end of training (None before)."""
        value = self.core.read(Keys.END)
        return None if value is None else EndReport.decode(Keys.END, value)

    def set_progress(
        self, iteration: int, generation: int = 0, committed: int | None = None, nbytes: int = 0
    ) -> None:
        """Rank 0 completed `iteration` in `generation` (or a standby's rebuild of it); the
        committed iteration then, and the bytes of replicas it sends per iteration
        (`Progress`)."""
        self.core.set(Keys.PROGRESS, Progress(iteration, generation, committed, nbytes).encode())

    def progress(self) -> int:
        """The newest iteration rank 0 completed (0 before the first)."""
        record = self.progress_record()
        return record.iteration if record is not None else 0

    def progress_record(self) -> Progress | None:
        """Rank 0's newest `Progress` (None before the first)."""
        value = self.core.read(Keys.PROGRESS)
        return None if value is None else Progress.decode(Keys.PROGRESS, value)

    def job_status(self) -> JobStatus | None:
        """The job's redundancy as the coordinator last published it."""
        value = self.core.read(Keys.JOB_STATUS)
        return None if value is None else JobStatus.decode(Keys.JOB_STATUS, value)

    def rebuilt(self) -> bool:
        """Whether a standby that took over rebuilt the job's state."""
        return self.core.present(Keys.REBUILT)

    def shutdown_requested(self) -> bool:
        """Whether waiting spares are to leave."""
        return self.core.present(Keys.SHUTDOWN)
