"""The job's wire protocol: every key on the coordinator's store, one named method per access.

Nothing else in the package reads or writes the store directly. Values are JSON or plain
text; nothing is ever unpickled. A read is one request (`_peek`); a process that waits for a
key blocks on the server (a WAIT) and then reads it: two requests, where torch's `get` after a
wait would make three. A process id (pid) is `a{r}` for the initial active of rank r
and `s{i}` for spare i; g is a generation (0 at start, +1 per planned recovery).

Keys:
  job/token                     the job's shared secret; a process presenting another is refused
  job/layout                    {"tp", "pp", "dp", "ranks_per_node", "replicas"} (rank 0, gen 0)
  proc/{pid}/ready              "{host}:{os pid}" once a process connected
  hb/{pid}                      heartbeat counter: +1 per beat, 0 before the first (created by
                                the coordinator). No clock travels: the coordinator times each
                                change on its own monotonic clock (`heartbeats.py`), so clock
                                skew between hosts cannot make a live process look hung.
  coord/inbox                   queue of wake-ups for the coordinator (a report it waits for
                                is complete); it blocks on the queue instead of polling
  spares/epoch                  counter of events waiting spares must look at (a roster, the
                                shutdown); spares/epoch/{n} appears with event n: spares block
                                on the next one instead of polling
  gen                           the newest generation with a published roster
  gen{g}/roster                 {"generation", "world_size", "slots": {rank: pid},
                                "restore_iteration"}
  plan/latest                   the newest planned generation (a recovery, or the abort)
  gen{g}/plan                   {"generation", "base", "world_size", "dead", "needy",
                                "replaced"}: the slots that change from roster `base` (rank ->
                                pid), or {"abort": report}
  gen{g}/holdings/{rank}        a survivor's report: verified iterations it holds ("holds"),
                                "last_completed", "pid", and the job's own fields
  gen{g}/holdings/count         counter of those reports; once the coordinator planned g, less
                                the reports it waits for (`expect_reports`): the report that
                                brings it to 0 is the last one, and wakes the coordinator
  gen{g}/decided                the coordinator's decision on plan g, which survivors block on:
                                {"roster": T}, {"abort": true} or {"superseded": g2}
  gen{g}/sources                {needy rank: holder} for the restore iteration
  gen{g}/ready/{rank}           "ready": the newcomer of a needy rank claimed its slot, before
                                it joins; "lost": the coordinator gave the slot up first (the
                                newcomer died before claiming it). Survivors wait for these
                                before joining, so that none waits in a rendezvous for a
                                newcomer that will never come
  gen{g}/{phase}/{rank}         wall time a rank reached a phase: joined, restored,
                                first_iteration (rank 0 only); gen{g}/{phase}/count counts them
  gen{g}/stale_refs             counter: old-generation group handles ranks found left after
                                rebinding (must stay 0)
  gen{g}/...                    torch's own rendezvous keys of generation g's process groups
                                (`process_group_store`)
  abort                         the out-of-redundancy report (reason, dead, lost, what to save)
  failures                      counter: survivors that saw a collective fail (the coordinator
                                then suspects silent ranks sooner than the heartbeat timeout)
  failure/{pid}                 what the survivor saw fail: the report's number (the counter's
                                value), its wall time and the error
  finished/{rank}               the iteration the rank finished training at (replicated)
  training/complete             the iteration training completed at (every rank's last step
                                done and replicated: a later loss needs no recomputation)
  end                           the coordinator's report of processes lost after training
                                completed: dead ranks and who writes their final state
  fault/{pid}                   wall time an injected fault struck `pid`
  fault/fired/{index}/{who}     counter: fault spec `index` fired for rank/pid `who`
  progress/last                 the newest iteration rank 0 completed
  metrics/g{g}/{it}             rank 0's record of iteration `it` in generation g
  replication/final             {"committed_iteration"} at the end of training
  digest/{rank}                 the rank's final parameter digest
  done/{pid}                    wall time the process finished its work (done/count: how many)
  preempt                       set by a launcher: stop after the current iteration
  preempted                     {"iteration", "saved"}: where training stopped on purpose
  load/{rank}                   seconds the rank took to load a persistent checkpoint
  salvaged/{rank}               the rank wrote its part of the out-of-redundancy snapshot set
  salvage/manifest              counter: the first survivor to add 1 writes the manifest
  shutdown                      set by a launcher or the coordinator: waiting spares leave
  coordinator                   {"epoch", "id"}: who serves this store - epoch 0 the primary, i the
                                standby at entry i of --deadpool-coordinator once it took over; id
                                one per coordinator process. Set before job/token: a store without
                                the token serves no job (yet)
  rejoin/{pid}                  a process's re-registration with a standby that took over: what it
                                knows of the job (`rebuild.Registration`); task{i} for a process
                                that does not know its pid yet (task i: actives first, then spares)
  rebuilt                       the standby rebuilt the job's state from the re-registrations
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ..errors import JobTokenError
from .roster import Roster

ABSENT = "\0absent\0"
"""What `_peek` compares with: no value of ours (text, JSON, numbers) is ever equal to it."""

BATCH_KEYS = 1024
"""Keys per batched store request. torch's store server handles a request's keys in time that
grows faster than linearly with their number (measured with torch 2.13 on loopback: 16,384 keys
in one `multi_get` 0.75-0.94 s, in 16 requests of 1,024 keys 0.04-0.05 s)."""

INBOX = "coord/inbox"


class Membership:
    """One process's (or the coordinator's) access to the job's store."""

    def __init__(self, store: dist.Store, pid: str) -> None:
        self.store = store
        self.pid = pid
        self.plan_seen = 0  # the newest planned generation this process read

    # ------------------------------------------------------------------ plumbing
    def _set(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def _peek(self, key: str) -> bytes | None:
        """`key`'s value, or None if it does not exist, in one request that neither waits nor
        creates the key: a compare-and-set whose expected value no key holds answers the
        current value, or that expected value for a missing key (torch's TCP, file and hash
        stores alike). torch's own `get` waits for the key first (two requests: WAIT, GET)."""
        value = self.store.compare_set(key, ABSENT, ABSENT)
        return None if value == ABSENT.encode() else value

    def _get(self, key: str) -> str | None:
        value = self._peek(key)
        return None if value is None else value.decode()

    def _wait_read(self, key: str, timeout_s: float) -> bytes | None:
        """Block until `key` exists, then its value (None on timeout): two requests."""
        if not self._wait(key, timeout_s=timeout_s):
            return None
        value = self._peek(key)
        if value is None:  # deleted in between: only `withdraw` deletes, and not these keys
            raise dist.DistStoreError(f"{key} vanished from the store")
        return value

    def _publish(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value))

    def _read(self, key: str) -> Any:
        text = self._get(key)
        return None if text is None else json.loads(text)

    def _stamp(self, key: str) -> None:
        self.store.set(key, repr(time.time()))

    def _time(self, key: str) -> float | None:
        text = self._get(key)
        return None if text is None else float(text)

    def _multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Values of `keys` (which must all exist: a missing one blocks), in batches."""
        out: list[bytes] = []
        for i in range(0, len(keys), BATCH_KEYS):
            out += self.store.multi_get(list(keys[i : i + BATCH_KEYS]))
        return out

    def _all_exist(self, keys: Sequence[str]) -> bool:
        return all(
            self.store.check(list(keys[i : i + BATCH_KEYS]))
            for i in range(0, len(keys), BATCH_KEYS)
        )

    def _wait(self, *keys: str, timeout_s: float) -> bool:
        """Block until every key exists (the server answers when they are set); False on
        timeout."""
        try:
            self.store.wait(list(keys), datetime.timedelta(seconds=max(timeout_s, 0.001)))
        except dist.DistStoreError:
            return self.store.check(list(keys))  # they may have been set as the wait timed out
        return True

    def _count(self, key: str) -> int:
        """A counter's value (0, and created, if it did not exist)."""
        return int(self.store.add(key, 0))

    # ------------------------------------------------------------------ waking the coordinator
    def notify_coordinator(self, message: str) -> None:
        """Wake the coordinator (`next_message` returns `message`)."""
        self.store.queue_push(INBOX, message)

    def next_message(self) -> str:
        """Block until a process notifies the coordinator (up to the store's timeout)."""
        return self.store.queue_pop(INBOX).decode()

    # ------------------------------------------------------------------ the job
    def set_token(self, token: str) -> None:
        self._set("job/token", token)

    def check_token(self, token: str) -> None:
        """Refuse to join a job whose token differs (another job's coordinator)."""
        if self._get("job/token") != token:
            raise JobTokenError(
                f"deadpool-job-token: this process's token does not match the coordinator's "
                f"job; pass the job's --deadpool-job-token (process {self.pid})"
            )

    def job_token(self) -> str | None:
        return self._get("job/token")

    def set_identity(self, epoch: int, nonce: str) -> None:
        """Say which coordinator serves this store (before `set_token`)."""
        self._publish("coordinator", {"epoch": epoch, "id": nonce})

    def identity(self) -> tuple[int, str] | None:
        """(epoch, id) of the coordinator serving this store; None: none has taken it yet."""
        d = self._read("coordinator")
        return None if d is None else (int(d["epoch"]), str(d["id"]))

    def withdraw(self, pids: list[str]) -> None:
        """A standby that did not take over after all: the store serves no job again, and the
        re-registrations of `pids` it got are forgotten."""
        for key in ["job/token", "coordinator", *(f"rejoin/{p}" for p in pids)]:
            self.store.delete_key(key)

    def publish_layout(self, layout: dict[str, int]) -> None:
        self._publish("job/layout", layout)

    def layout(self) -> dict[str, int] | None:
        return self._read("job/layout")

    # ------------------------------------------------------------------ processes
    def announce(self) -> None:
        self._set(f"proc/{self.pid}/ready", f"{socket.gethostname()}:{os.getpid()}")
        self.heartbeat()

    def heartbeat(self) -> None:
        """One beat: this process's counter + 1 (no clock is sent)."""
        self.store.add(f"hb/{self.pid}", 1)

    def watch_heartbeats(self, pids: Sequence[str]) -> None:
        """Create the counters of `pids` at 0 where missing (an existing count is kept), so
        that `heartbeat_counts` never waits for a key."""
        for pid in pids:
            self.store.add(f"hb/{pid}", 0)

    def heartbeat_counts(self, pids: Sequence[str]) -> list[int]:
        """The beat counters of `pids` (watched first), in batched requests."""
        return [int(v) for v in self._multi_get([f"hb/{p}" for p in pids])]

    def announced(self, pid: str) -> bool:
        """Whether `pid` announced itself to this store (`announce`)."""
        return self.store.check([f"proc/{pid}/ready"])

    def mark_done(self) -> None:
        self._stamp(f"done/{self.pid}")
        self.store.add("done/count", 1)

    def is_done(self, pid: str) -> bool:
        return self.store.check([f"done/{pid}"])

    def done_count(self) -> int:
        """How many processes finished their work (one store round trip)."""
        return self._count("done/count")

    def restore_done(self, pid: str) -> None:
        """A standby's rebuild: `pid` had finished its work (it said so when re-registering)."""
        self._stamp(f"done/{pid}")
        self.store.add("done/count", 1)  # (`done_count` only screens: `all_done` decides)

    def all_done(self, pids: list[str]) -> bool:
        return self._all_exist([f"done/{p}" for p in pids])

    # ------------------------------------------------------------------ generations
    def generation(self) -> int:
        """The newest generation with a roster (-1 before the first)."""
        text = self._get("gen")
        return -1 if text is None else int(text)

    def roster(self, generation: int) -> Roster:
        return Roster.from_json(self.store.get(f"gen{generation}/roster"))

    def has_roster(self, generation: int) -> bool:
        return self.store.check([f"gen{generation}/roster"])

    def wait_roster(self, generation: int, timeout_s: float) -> Roster:
        self.store.wait([f"gen{generation}/roster"], datetime.timedelta(seconds=timeout_s))
        return self.roster(generation)

    def publish_roster(self, roster: Roster) -> None:
        self._set(f"gen{roster.generation}/roster", roster.to_json())
        self._set("gen", str(roster.generation))
        self.wake_spares()

    # ------------------------------------------------------------------ waiting spares
    def spare_epoch(self) -> int:
        """How many events waiting spares were woken for so far."""
        return self._count("spares/epoch")

    def wake_spares(self) -> None:
        """Wake every spare blocked in `wait_spare_epoch` (a roster, or the shutdown)."""
        n = self.store.add("spares/epoch", 1)
        self._set(f"spares/epoch/{n}", "1")

    def wait_spare_epoch(self, n: int, timeout_s: float) -> bool:
        """Block until wake-up `n` happened; False on timeout."""
        return self._wait(f"spares/epoch/{n}", timeout_s=timeout_s)

    def process_group_store(self, generation: int) -> dist.Store:
        """The store generation g's process groups rendezvous on (for a bounded or failover
        client, `connection.BoundedStore`: its current torch connection)."""
        return dist.PrefixStore(f"gen{generation}", getattr(self.store, "client", self.store))

    # ------------------------------------------------------------------ recovery
    def latest_plan(self) -> int:
        """The newest planned generation (0: none planned yet)."""
        text = self._get("plan/latest")
        latest = 0 if text is None else int(text)
        self.plan_seen = max(self.plan_seen, latest)
        return latest

    def publish_plan(self, generation: int, plan: dict[str, Any]) -> None:
        self._publish(f"gen{generation}/plan", plan)
        self._set("plan/latest", str(generation))

    def planned(self, generation: int) -> bool:
        """Whether generation g is planned (one round trip, nothing read)."""
        return self.store.check([f"gen{generation}/plan"])

    def plan(self, generation: int) -> dict[str, Any]:
        return self._read(f"gen{generation}/plan") or {}

    def decide(self, generation: int, decision: dict[str, Any]) -> None:
        """The coordinator's decision on plan g (see the module docstring)."""
        self._publish(f"gen{generation}/decided", decision)

    def wait_decision(self, generation: int, timeout_s: float) -> dict[str, Any] | None:
        """Block until plan g is decided; None on timeout."""
        value = self._wait_read(f"gen{generation}/decided", timeout_s)
        return None if value is None else json.loads(value)

    def publish_abort(self, generation: int, report: dict[str, Any]) -> None:
        """Out of redundancy: the report, also as generation g's plan and decision (so waiters
        see it)."""
        self._publish("abort", report)
        self.publish_plan(generation, {"abort": report})
        self.decide(generation, {"abort": True})

    def abort(self) -> dict[str, Any] | None:
        return self._read("abort")

    def report_holdings(self, generation: int, rank: int | None, report: dict[str, Any]) -> None:
        """Publish a survivor's report for generation g (planned or not yet); the last one the
        coordinator waits for wakes it."""
        self._publish(f"gen{generation}/holdings/{rank}", report)
        if self.store.add(f"gen{generation}/holdings/count", 1) == 0:
            self.notify_coordinator(f"holdings {generation}")

    def expect_reports(self, generation: int, count: int) -> None:
        """The coordinator planned g and waits for `count` reports (some may be in already:
        `reports_missing` counts down from here)."""
        self.store.add(f"gen{generation}/holdings/count", -count)

    def reports_missing(self, generation: int) -> int:
        """How many of the reports `expect_reports` waits for have not arrived (one round
        trip)."""
        return -self._count(f"gen{generation}/holdings/count")

    def claim_slot(self, generation: int, rank: int) -> bool:
        """A newcomer about to join generation g as `rank`: True, unless the coordinator gave
        the slot up first (it took this process for lost: `give_up_slot`)."""
        key = f"gen{generation}/ready/{rank}"
        return self.store.compare_set(key, "", "ready") == b"ready"

    def give_up_slot(self, generation: int, rank: int) -> None:
        """The coordinator: generation g's newcomer for `rank` was lost before it claimed its
        slot (a claim that came first stands)."""
        self.store.compare_set(f"gen{generation}/ready/{rank}", "", "lost")

    def wait_newcomers(self, generation: int, ranks: list[int], timeout_s: float) -> bool | None:
        """Block until every newcomer of generation g (`ranks`) claimed its slot or was given
        up: True when all claimed, False when one was given up, None on timeout."""
        keys = [f"gen{generation}/ready/{r}" for r in ranks]
        if not keys:
            return True
        if not self._wait(*keys, timeout_s=timeout_s):
            return None
        values = [self._peek(keys[0])] if len(keys) == 1 else self.store.multi_get(keys)
        return all(value == b"ready" for value in values)

    def holdings_count(self, generation: int) -> int:
        """The report counter of generation g: how many reports arrived, until the coordinator
        planned g (`expect_reports`)."""
        return self._count(f"gen{generation}/holdings/count")

    def holdings(self, generation: int, rank: int) -> dict[str, Any] | None:
        return self._read(f"gen{generation}/holdings/{rank}")

    def all_holdings(self, generation: int, ranks: Sequence[int]) -> dict[int, Any] | None:
        """Every report of `ranks` for plan g, in batched requests; None while one is missing."""
        keys = [f"gen{generation}/holdings/{r}" for r in ranks]
        if not self._all_exist(keys):
            return None
        # One parse of all the reports (JSON objects each): half the CPU of one parse each
        # (measured at 16,384 reports: 31 ms against 68 ms).
        reports = json.loads(b"[" + b",".join(self._multi_get(keys)) + b"]")
        return dict(zip(ranks, reports))

    def publish_sources(self, generation: int, sources: dict[int, int]) -> None:
        self._publish(f"gen{generation}/sources", {str(k): v for k, v in sources.items()})

    def sources(self, generation: int) -> dict[int, int]:
        """needy rank -> holder, as the coordinator fixed them for `generation` (published
        before its roster: read it once the roster is known)."""
        raw = json.loads(self.store.get(f"gen{generation}/sources"))
        return {int(k): int(v) for k, v in raw.items()}

    def stamp(self, generation: int, phase: str, rank: int) -> None:
        """`rank` reached `phase` of generation g now (its wall clock), and is counted."""
        self._stamp(f"gen{generation}/{phase}/{rank}")
        self.store.add(f"gen{generation}/{phase}/count", 1)

    def stamp_count(self, generation: int, phase: str) -> int:
        """How many ranks stamped `phase` of generation g (one store round trip)."""
        return self._count(f"gen{generation}/{phase}/count")

    def stamp_time(self, generation: int, phase: str, rank: int) -> float | None:
        return self._time(f"gen{generation}/{phase}/{rank}")

    def stamp_times(self, generation: int, phase: str, ranks: Sequence[int]) -> list[float]:
        """The stamps of `ranks` (which must all have stamped), in batched requests."""
        return [float(v) for v in self._multi_get([f"gen{generation}/{phase}/{r}" for r in ranks])]

    def report_stale_refs(self, generation: int, rank: int, count: int) -> None:
        """Add `rank`'s count of old-generation handles left after rebinding to g's total."""
        self.store.add(f"gen{generation}/stale_refs", count)

    def stale_refs(self, generation: int) -> int:
        """Old-generation handles all ranks found after rebinding into generation g."""
        return self._count(f"gen{generation}/stale_refs")

    def report_failure(self, why: str) -> None:
        """This survivor saw a collective fail (a peer died or hung)."""
        number = self.store.add("failures", 1)
        self._publish(f"failure/{self.pid}", {"number": number, "time": time.time(), "why": why})

    def failure_number(self, pid: str) -> int:
        """The number of `pid`'s latest failure report (0: none): reports are numbered in the
        order they reach the store."""
        report = self._read(f"failure/{pid}")
        return 0 if report is None else int(report["number"])

    def failure_count(self) -> int:
        """How many failure reports survivors made so far."""
        return self.store.add("failures", 0)

    # ------------------------------------------------------------------ the end of training
    def report_finished(self, rank: int, iteration: int) -> None:
        """`rank` finished training at `iteration`, its final state replicated."""
        self._set(f"finished/{rank}", str(iteration))
        self._set("training/complete", str(iteration))

    def training_complete(self) -> int | None:
        """The iteration training completed at, once any rank finished (None before)."""
        text = self._get("training/complete")
        return None if text is None else int(text)

    def publish_end(self, report: dict[str, Any]) -> None:
        self._publish("end", report)

    def end(self) -> dict[str, Any] | None:
        return self._read("end")

    # ------------------------------------------------------------------ faults
    def record_fault(self) -> None:
        """An injected fault strikes this process now."""
        self._stamp(f"fault/{self.pid}")

    def fault_time(self, pid: str) -> float | None:
        return self._time(f"fault/{pid}")

    def fire_once(self, index: int, who: int | str) -> bool:
        """True the first time fault spec `index` fires for `who` in the whole job."""
        return self.store.add(f"fault/fired/{index}/{who}", 1) == 1

    # ------------------------------------------------------------------ progress and results
    def set_progress(self, iteration: int) -> None:
        self._set("progress/last", str(iteration))

    def progress(self) -> int:
        text = self._get("progress/last")
        return 0 if text is None else int(text)

    def publish_metrics(self, generation: int, iteration: int, record: dict[str, Any]) -> None:
        self._publish(f"metrics/g{generation}/{iteration}", record)

    def metrics(self, generation: int, iteration: int) -> dict[str, Any] | None:
        return self._read(f"metrics/g{generation}/{iteration}")

    def publish_final_replication(self, committed: int | None) -> None:
        self._publish("replication/final", {"committed_iteration": committed})

    def final_replication(self) -> dict[str, Any]:
        return self._read("replication/final") or {}

    def publish_digest(self, rank: int, digest: str) -> None:
        self._set(f"digest/{rank}", digest)

    def digest(self, rank: int) -> str | None:
        return self._get(f"digest/{rank}")

    def record_load_time(self, rank: int, seconds: float) -> None:
        self._set(f"load/{rank}", repr(seconds))

    def load_time(self, rank: int) -> float | None:
        return self._time(f"load/{rank}")

    # ------------------------------------------------------------------ a standby takes over
    def register(self, record: dict[str, Any]) -> None:
        """This process's re-registration with a standby coordinator that took over."""
        self._publish(f"rejoin/{self.pid}", record)

    def registration(self, pid: str) -> dict[str, Any] | None:
        return self._read(f"rejoin/{pid}")

    def publish_rebuilt(self, epoch: int) -> None:
        self._set("rebuilt", str(epoch))

    def rebuilt(self) -> bool:
        return self.store.check(["rebuilt"])

    # ------------------------------------------------------------------ stopping
    def request_preempt(self) -> None:
        self._set("preempt", "1")

    def preempt_requested(self) -> bool:
        return self.store.check(["preempt"])

    def publish_preempted(self, iteration: int, saved: bool) -> None:
        self._publish("preempted", {"iteration": iteration, "saved": saved})

    def preempted(self) -> dict[str, Any] | None:
        return self._read("preempted")

    def request_shutdown(self) -> None:
        self._set("shutdown", "1")
        self.wake_spares()

    def shutdown_requested(self) -> bool:
        return self.store.check(["shutdown"])

    # ------------------------------------------------------------------ out of redundancy
    def mark_salvaged(self, rank: int) -> None:
        self._set(f"salvaged/{rank}", "1")

    def all_salvaged(self, ranks: list[int]) -> bool:
        return self.store.check([f"salvaged/{r}" for r in ranks])

    def claim_manifest(self) -> bool:
        """True for the one survivor that writes the snapshot set's manifest."""
        return self.store.add("salvage/manifest", 1) == 1


def host_store(host: str, port: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """Host the job's store listening on `host` only (torch's own server binds every interface).

    Port 0 picks a free port (`store.port`). The listening socket is handed to torch, which
    closes it when the store goes: Python's socket object is detached, so that its own close
    cannot hit the same descriptor number a second time - by then possibly another socket's (a
    race seen as EBADF on an unrelated socket's close).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        store = dist.TCPStore(
            host,
            sock.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # torch's server owns the descriptor now
    return store
