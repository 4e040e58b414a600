"""A stranger on the job's store cannot steer it: during a real `deadpool train` run, a plain
`TCPStore` client on the store's address (from the run's event log, `store` event) - without
the job's secret - writes every control key DeadPool acts on: forged values first, then values
replayed from other keys of the same store. Training must end exactly as the failure-free run
(losses and parameter digest), and the run's event log or process logs must name every rejected
write. The secret is nowhere a stranger can read it: not in the store (`job/token` holds a
seal, not the secret), not on any process's command line (`/proc/PID/cmdline`, what `ps`
shows).
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from conftest import TrainRun, train_case

from megatron_deadpool.hotswap.protocol.messages import (
    CoordinatorIdentity,
    Decision,
    EndReport,
    HoldingsReport,
    Keys,
    OutOfRedundancy,
    Plan,
    SaveOrder,
)
from megatron_deadpool.hotswap.protocol.seal import ForgedValue, JobSeal, new_job_id

ITERS = 8
ARGS = ["--tp", "2", "--dp", "2", "--spares", "1"]
MAC_CHARS = 64  # a sealed value: its MAC in hex, then the payload (readable, not secret)

FORGED = {
    Keys.LATEST_PLAN: "1",
    Keys.PLAN.format(g=1): Plan(1, 0, 4, (2,), (2,), {2: "s0"}).encode(),
    Keys.DECIDED.format(g=1): Decision.out_of_redundancy().encode(),
    Keys.OUT_OF_REDUNDANCY: OutOfRedundancy("forged", (2,), (2,), {}, None).encode(),
    Keys.END: EndReport("forged", 1, (2,), (2,), SaveOrder(1, {}, False, (2,))).encode(),
    Keys.PREEMPT: "1",
    Keys.SHUTDOWN: "1",
    Keys.REBUILT: "1",
    Keys.COORDINATOR: CoordinatorIdentity(1, "stranger").encode(),
    Keys.CLAIM.format(g=1, rank=2): "lost",
    Keys.HOLDINGS.format(g=1, rank=0): HoldingsReport("a0", 1, {"local": (1,)}).encode(),
}
"""What a stranger writes as soon as the store answers: the job's control messages, well formed."""

REPLAYED = {
    Keys.LATEST_PLAN: Keys.PROGRESS,  # a genuine "an iteration number" as the latest plan
    Keys.PREEMPT: Keys.READY.format(member="a0"),
    Keys.SHUTDOWN: Keys.READY.format(member="a1"),
    Keys.ROSTER.format(g=1): Keys.ROSTER.format(g=0),
    Keys.PLAN.format(g=1): Keys.ROSTER.format(g=0),
    Keys.REBUILT: Keys.TOKEN,
    Keys.OUT_OF_REDUNDANCY: Keys.LAYOUT,
}
"""Then, once training runs: key -> the key whose genuine (sealed) value is copied into it."""


def _store_event(run_dir: Path, timeout_s: float = 120.0) -> dict[str, Any]:
    """Where the run's store listens, and the run's id: the launcher's `store` event."""
    events = run_dir / "events.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if events.exists():
            for line in events.read_text().splitlines():
                entry = json.loads(line)
                if entry["event"] == "store":
                    return dict(entry)
        time.sleep(0.05)
    raise AssertionError(f"no store event in {events}")


def _store_address(run_dir: Path, timeout_s: float = 120.0) -> str:
    """Where the run's store listens."""
    return str(_store_event(run_dir, timeout_s)["address"])


def _wait_keys(client: dist.TCPStore, keys: list[str], timeout_s: float = 120.0) -> None:
    client.wait(keys, datetime.timedelta(seconds=timeout_s))


def _secret_of(pid: int) -> str:
    """The job's secret, as its owner (this user) reads it from a worker's environment."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    found = [v.split(b"=", 1)[1] for v in environ if v.startswith(b"DEADPOOL_JOB_TOKEN=")]
    assert found, f"no DEADPOOL_JOB_TOKEN in the environment of process {pid}"
    return found[0].decode()


def _command_lines() -> dict[int, bytes]:
    out = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                out[int(proc.name)] = (proc / "cmdline").read_bytes()
            except OSError:
                pass  # gone meanwhile
    return out


class Stranger(threading.Thread):
    """A plain store client without the secret, writing the job's control keys."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(daemon=True)
        self.run_dir = run_dir
        self.error: BaseException | None = None
        self.seen: dict[str, Any] = {}

    def run(self) -> None:
        try:
            self._attack()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def _attack(self) -> None:
        store = _store_event(self.run_dir)
        host, port = store["address"].rsplit(":", 1)
        client = dist.TCPStore(
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60)
        )
        _wait_keys(client, [Keys.ROSTER.format(g=0)])
        for key, value in FORGED.items():
            client.set(key, value)
        members = [f"a{r}" for r in range(4)] + ["s0"]
        _wait_keys(client, [Keys.READY.format(member=m) for m in members])
        _wait_keys(client, [Keys.PROGRESS, Keys.LAYOUT])  # training runs
        for key, source in REPLAYED.items():
            client.set(key, client.get(source))
        n = client.add(Keys.SPARE_EPOCH, 1)  # wake the spare: it looks at the store again
        client.set(Keys.SPARE_EPOCH_N.format(n=n), "1")
        pids = {
            m: json.loads(client.get(Keys.READY.format(member=m))[MAC_CHARS:])["os_pid"]
            for m in members
        }
        self.seen = {
            "token": client.get(Keys.TOKEN),
            "secret": _secret_of(pids["a0"]),
            "run": store["run"],
            "pids": pids,
            "command_lines": _command_lines(),
        }


@pytest.mark.timeout(600)
def test_a_stranger_on_the_store_cannot_steer_the_job(
    tmp_path: Path, failure_free: Callable[[int], TrainRun]
) -> None:
    reference = failure_free(ITERS)[2]
    stranger = Stranger(tmp_path / "logs")
    stranger.start()
    proc, records, summary = train_case(tmp_path, ARGS, str(ITERS), timeout=400)
    stranger.join(60)
    assert stranger.error is None, repr(stranger.error)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["losses"] == reference["losses"] and len(records) == ITERS
    assert summary["final_param_digest"] == reference["final_param_digest"]
    assert summary["recoveries"] == [] and "preempted" not in proc.stdout
    # Each rejected write is named: by whoever read it (a worker's log, the coordinator's event)
    # or, never read, by the coordinator's audit of the store at the end.
    run_dir = tmp_path / "logs"
    logs = "\n".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("*.log")))
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    rejected = {e["key"] for e in events if e["event"] == "rejected_value"}
    for key in sorted({*FORGED, *REPLAYED}):
        assert key in rejected or f"store key {key}: rejected" in logs, key
    assert f"store key {Keys.PREEMPT}: rejected" in logs  # rank 0 read it, and went on
    assert f"store key {Keys.SHUTDOWN}: rejected" in logs  # the spare read it, and stayed
    assert f"store key {Keys.LATEST_PLAN}: rejected" in logs  # every plan watch read it
    # The secret: not in the store, not on any command line.
    secret = stranger.seen["secret"]
    assert len(secret) >= 32 and secret.encode() not in stranger.seen["token"]
    for pid, cmdline in stranger.seen["command_lines"].items():
        assert secret.encode() not in cmdline, (pid, cmdline.replace(b"\0", b" ")[:300])
    assert set(stranger.seen["pids"].values()) <= set(stranger.seen["command_lines"])
    # The store's seals are bound to this run (the launcher's new run id, which it gave its
    # processes): the same secret with no run id, or another run's, opens nothing of it.
    token, run = stranger.seen["token"], stranger.seen["run"]
    assert JobSeal(secret, run).open(Keys.TOKEN, token) == b"job"
    for other in ("", new_job_id()):
        with pytest.raises(ForgedValue):
            JobSeal(secret, other).open(Keys.TOKEN, token)
