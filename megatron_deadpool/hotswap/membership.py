"""The job's roster on the coordinator's store: who is who, per generation.

Keys (all JSON or plain text; nothing is ever unpickled):
  job/token                 the job token every process must present
  proc/{pid}/ready          a process connected (value: its host and OS pid)
  hb/{pid}                  heartbeat: wall-clock seconds of the last beat
  gen                       the current generation number g
  gen{g}/roster             {"world_size": W, "slots": {rank: pid}, "restore_iteration": T}
  metrics/{it}              rank 0's record of iteration `it` (the launcher renders progress)
  digest/{rank}             final per-rank parameter digest
  shutdown                  set by the launcher: spares and helpers exit
A process id (pid) is `a{r}` for the initial active of rank r and `s{i}` for spare i.
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


class Membership:
    """A process's view of the roster, over its own store client."""

    def __init__(self, store: dist.Store, pid: str) -> None:
        self.store = store
        self.pid = pid

    def check_token(self, token: str) -> None:
        """Refuse to join a job whose token differs (another job's coordinator)."""
        theirs = self.store.get("job/token").decode()
        if theirs != token:
            raise JobTokenError(
                f"deadpool-job-token: this process's token does not match the coordinator's "
                f"job; pass the job's --deadpool-job-token (process {self.pid})"
            )

    def announce(self) -> None:
        self.store.set(f"proc/{self.pid}/ready", f"{socket.gethostname()}:{os.getpid()}")
        self.heartbeat()

    def heartbeat(self) -> None:
        self.store.set(f"hb/{self.pid}", repr(time.time()))

    def generation(self) -> int:
        return int(self.store.get("gen").decode()) if self.store.check(["gen"]) else -1

    def roster(self, generation: int) -> Roster:
        return Roster.from_json(self.store.get(f"gen{generation}/roster"))

    def publish_roster(self, roster: Roster) -> None:
        self.store.set(f"gen{roster.generation}/roster", roster.to_json())
        self.store.set("gen", str(roster.generation))

    def shutdown_requested(self) -> bool:
        return self.store.check(["shutdown"])

    def publish(self, key: str, value: dict[str, Any]) -> None:
        self.store.set(key, json.dumps(value))

    def read(self, key: str) -> dict[str, Any] | None:
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))


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
