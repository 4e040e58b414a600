"""The job's wire protocol: every key on the coordinator's store, one named method per access.

Nothing else in the package reads or writes the store directly. Values are JSON or plain
text; nothing is ever unpickled. A process id (pid) is `a{r}` for the initial active of rank r
and `s{i}` for spare i; g is a generation (0 at start, +1 per planned recovery).

Keys:
  job/token                     the job's shared secret; a process presenting another is refused
  job/layout                    {"tp", "pp", "dp", "ranks_per_node", "replicas"} (rank 0, gen 0)
  proc/{pid}/ready              "{host}:{os pid}" once a process connected
  hb/{pid}                      heartbeat: the process's wall clock at its last beat
  gen                           the newest generation with a published roster
  gen{g}/roster                 {"generation", "world_size", "slots": {rank: pid},
                                "restore_iteration"}
  plan/latest                   the newest planned generation (a recovery, or the abort)
  gen{g}/plan                   {"generation", "dead", "needy", "slots"} or {"abort": report}
  gen{g}/holdings/{rank}        a survivor's report: verified iterations it holds ("holds"),
                                "last_completed", "pid", and the job's own fields
  gen{g}/sources                {needy rank: holder} for the restore iteration
  gen{g}/{phase}/{rank}         wall time a rank reached a phase: joined, restored,
                                first_iteration (rank 0 only)
  gen{g}/stale_refs/{rank}      old-generation group handles left after rebinding (must be 0)
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
  done/{pid}                    wall time the process finished its work
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
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..errors import JobTokenError


@dataclass(frozen=True)
class Roster:
    """Generation g's world: which process fills which rank."""

    generation: int
    world_size: int
    slots: dict[int, str]
    restore_iteration: int | None = None

    def rank_of(self, pid: str) -> int | None:
        for rank, p in self.slots.items():
            if p == pid:
                return rank
        return None

    def to_json(self) -> str:
        return json.dumps(
            {
                "generation": self.generation,
                "world_size": self.world_size,
                "slots": {str(r): p for r, p in self.slots.items()},
                "restore_iteration": self.restore_iteration,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Roster:
        d = json.loads(text)
        return cls(
            generation=d["generation"],
            world_size=d["world_size"],
            slots={int(r): p for r, p in d["slots"].items()},
            restore_iteration=d.get("restore_iteration"),
        )


def pid_of(task: int, world_size: int) -> str:
    """The process id of task index `task`: actives first (ranks 0..W-1), then spares."""
    return f"a{task}" if task < world_size else f"s{task - world_size}"


class Membership:
    """One process's (or the coordinator's) access to the job's store."""

    def __init__(self, store: dist.Store, pid: str) -> None:
        self.store = store
        self.pid = pid
        self.plan_seen = 0  # the newest planned generation this process read

    # ------------------------------------------------------------------ plumbing
    def _set(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def _get(self, key: str) -> str | None:
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode()

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
        self._stamp(f"hb/{self.pid}")

    def announced(self, pid: str) -> bool:
        return self.store.check([f"proc/{pid}/ready"])

    def heartbeat_time(self, pid: str) -> float | None:
        return self._time(f"hb/{pid}")

    def mark_done(self) -> None:
        self._stamp(f"done/{self.pid}")

    def is_done(self, pid: str) -> bool:
        return self.store.check([f"done/{pid}"])

    def restore_done(self, pid: str) -> None:
        """A standby's rebuild: `pid` had finished its work (it said so when re-registering)."""
        self._stamp(f"done/{pid}")

    def all_done(self, pids: list[str]) -> bool:
        return self.store.check([f"done/{p}" for p in pids])

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

    def plan(self, generation: int) -> dict[str, Any]:
        return self._read(f"gen{generation}/plan") or {}

    def publish_abort(self, generation: int, report: dict[str, Any]) -> None:
        """Out of redundancy: the report, also as generation g's plan (so waiters see it)."""
        self._publish("abort", report)
        self.publish_plan(generation, {"abort": report})

    def abort(self) -> dict[str, Any] | None:
        return self._read("abort")

    def report_holdings(self, generation: int, rank: int | None, report: dict[str, Any]) -> None:
        self._publish(f"gen{generation}/holdings/{rank}", report)

    def holdings(self, generation: int, rank: int) -> dict[str, Any] | None:
        return self._read(f"gen{generation}/holdings/{rank}")

    def publish_sources(self, generation: int, sources: dict[int, int]) -> None:
        self._publish(f"gen{generation}/sources", {str(k): v for k, v in sources.items()})

    def sources(self, generation: int) -> dict[int, int]:
        """needy rank -> holder, as the coordinator fixed them for `generation`."""
        raw = self._read(f"gen{generation}/sources") or {}
        return {int(k): int(v) for k, v in raw.items()}

    def stamp(self, generation: int, phase: str, rank: int) -> None:
        self._stamp(f"gen{generation}/{phase}/{rank}")

    def stamp_time(self, generation: int, phase: str, rank: int) -> float | None:
        return self._time(f"gen{generation}/{phase}/{rank}")

    def report_stale_refs(self, generation: int, rank: int, count: int) -> None:
        self._set(f"gen{generation}/stale_refs/{rank}", str(count))

    def stale_refs(self, generation: int, rank: int) -> int:
        text = self._get(f"gen{generation}/stale_refs/{rank}")
        return 0 if text is None else int(text)

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


def host_store(
    host: str, port: int, timeout_s: float = 300.0
) -> tuple[dist.TCPStore, socket.socket]:
    """Host the job's store listening on `host` only (torch's own server binds every interface).

    The caller keeps the returned socket alive for as long as the store serves. Port 0 picks a
    free port (read it from the socket).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
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
    return store, sock
