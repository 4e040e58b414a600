"""Every value DeadPool acts on carries the job's MAC: a forged, altered or replayed value (one
copied from another key or generation) is rejected, treated as absent and reported once - by
`JobSeal` itself, by `Membership` on the in-memory store, and by the coordinator (its event log).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from decisions_job import Job
from stores import SEAL, TEST_SECRET

from megatron_deadpool.errors import ConfigError, JobTokenError
from megatron_deadpool.hotswap.protocol import sealed_store
from megatron_deadpool.hotswap.protocol.membership import Membership
from megatron_deadpool.hotswap.protocol.memory_store import MemoryStore
from megatron_deadpool.hotswap.protocol.messages import (
    CLAIMED,
    Decision,
    HoldingsReport,
    Keys,
    OutOfRedundancy,
    Phase,
    Plan,
    Roster,
    holds_sealed,
)
from megatron_deadpool.hotswap.protocol.seal import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    ForgedValue,
    JobSeal,
    job_secret,
    write_secret_file,
)

PLAN = Plan(generation=1, base=0, world_size=4, dead=(2,), needy=(2,), replaced={2: "s0"})


def test_a_seal_opens_only_for_its_key_and_payload_with_the_same_secret() -> None:
    sealed = SEAL.seal("gen1/plan", PLAN.encode())
    assert SEAL.open("gen1/plan", sealed.encode()) == PLAN.encode().encode()
    assert TEST_SECRET not in sealed and TEST_SECRET not in repr(SEAL)
    root = hashlib.sha256(b"deadpool store seal\0" + TEST_SECRET.encode()).digest()
    binding = json.dumps(["deadpool store binding", "", 0]).encode()  # no run id, store 0
    key = hmac.new(root, binding, hashlib.sha256).digest()
    message = b"gen1/plan\0" + PLAN.encode().encode()  # HMAC-SHA256 of key name and payload
    assert sealed[:64] == hmac.new(key, message, hashlib.sha256).hexdigest()
    altered = sealed.replace('"dead": [2]', '"dead": [1]')
    assert altered != sealed
    for key, raw in [
        ("gen1/plan", altered),  # altered payload
        ("gen2/plan", sealed),  # replayed into another generation
        ("gen1/decided", sealed),  # replayed into another key
        ("gen1/plan", PLAN.encode()),  # no MAC at all
        ("gen1/plan", ""),
    ]:
        with pytest.raises(ForgedValue, match=key):
            SEAL.open(key, raw)
    with pytest.raises(ForgedValue):
        JobSeal("another job").open("gen1/plan", sealed)


def test_the_secret_comes_from_the_environment_or_an_owner_only_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    assert job_secret() is None and job_secret("flag") == "flag"
    path = write_secret_file(tmp_path / "secret", "from-file")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    assert job_secret() == "from-file"
    monkeypatch.setenv(SECRET_ENV, "from-env")
    assert job_secret() == "from-env"
    monkeypatch.delenv(SECRET_ENV)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        job_secret()
    with pytest.raises(ForgedValue):  # a process given no secret opens nothing of a job's
        JobSeal("").open("gen1/plan", SEAL.seal("gen1/plan", PLAN.encode()))


def _forge(store: MemoryStore, key: str, raw: str | bytes) -> None:
    """What a stranger on the store's port can do: set any key to any bytes."""
    store.set(key, raw)


def _raw(store: MemoryStore, key: str) -> bytes:
    return store.get(key)


@pytest.fixture
def members() -> tuple[MemoryStore, Membership, list[tuple[str, str]]]:
    store = MemoryStore()
    m = Membership(store, "a0", SEAL)
    rejected: list[tuple[str, str]] = []
    m.on_rejected = lambda key, why: rejected.append((key, why))
    return store, m, rejected


def test_forged_control_values_are_ignored_and_reported_once(members: Any) -> None:
    store, m, rejected = members
    _forge(store, Keys.LATEST_PLAN, "1")
    _forge(store, Keys.PLAN.format(g=1), PLAN.encode())
    _forge(store, Keys.DECIDED.format(g=1), Decision.out_of_redundancy().encode())
    abort = OutOfRedundancy("forged", (1,), (1,), {}, None)
    _forge(store, Keys.OUT_OF_REDUNDANCY, abort.encode())
    _forge(store, Keys.PREEMPT, "1")
    _forge(store, Keys.SHUTDOWN, "1")
    _forge(store, Keys.REBUILT, "1")
    assert m.latest_plan() == 0 and m.latest_plan() == 0  # read twice, reported once
    assert m.plan(1) is None and not m.planned(1)
    assert m.wait_decision(1, 0.2) is None
    assert m.out_of_redundancy() is None
    assert not m.preempt_requested() and not m.shutdown_requested() and not m.rebuilt()
    keys = [key for key, _ in rejected]
    assert sorted(keys) == sorted(
        [
            Keys.LATEST_PLAN,
            Keys.PLAN.format(g=1),
            Keys.DECIDED.format(g=1),
            Keys.OUT_OF_REDUNDANCY,
            Keys.PREEMPT,
            Keys.SHUTDOWN,
            Keys.REBUILT,
        ]
    )
    assert all("does not carry this job's MAC" in why for _, why in rejected)
    # The job's own values replace them, and are read.
    m.request_preempt()
    m.request_shutdown()
    m.publish_plan(PLAN)
    assert m.preempt_requested() and m.shutdown_requested() and m.latest_plan() == 1
    assert m.plan(1) == PLAN


def test_values_replayed_from_another_key_or_generation_are_rejected(
    members: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, m, rejected = members
    m.publish_roster(Roster(0, 4, {r: f"a{r}" for r in range(4)}))
    m.publish_plan(PLAN)
    m.decide(1, Decision.roster(3))
    _forge(store, Keys.PLAN.format(g=2), _raw(store, Keys.PLAN.format(g=1)))
    _forge(store, Keys.DECIDED.format(g=2), _raw(store, Keys.DECIDED.format(g=1)))
    _forge(store, Keys.ROSTER.format(g=1), _raw(store, Keys.ROSTER.format(g=0)))
    _forge(store, Keys.PREEMPT, _raw(store, Keys.GENERATION))
    assert m.plan(2) is None and m.wait_decision(2, 0.2) is None
    assert not m.preempt_requested()
    assert m.wait_decision(1, 0.2) == Decision.roster(3)  # the job's own still reads
    assert {k for k, _ in rejected} == {
        Keys.PLAN.format(g=2),
        Keys.DECIDED.format(g=2),
        Keys.PREEMPT,
    }
    monkeypatch.setattr(sealed_store, "FORGED_WAIT_S", 0.1)
    with pytest.raises(ForgedValue, match="gen1/roster"):  # a read that must return, gives up
        m.roster(1)


def test_forged_claims_and_reports_count_as_absent(members: Any) -> None:
    store, m, rejected = members
    claim = Keys.CLAIM.format(g=1, rank=2)
    _forge(store, claim, "lost")  # a stranger gives the newcomer's slot up
    assert m.wait_newcomers(1, [2], 0.2) is None
    assert m.claim_slot(1, 2) == CLAIMED  # the forged value is replaced
    assert m.wait_newcomers(1, [2], 0.2) is True
    _forge(store, Keys.CLAIM.format(g=1, rank=3), _raw(store, claim))  # replayed "ready"
    assert m.wait_newcomers(1, [2, 3], 0.2) is None
    m.give_up_slot(1, 3)
    assert m.wait_newcomers(1, [2, 3], 0.2) is False
    report = HoldingsReport("a1", 5, {"local": (4, 5)})
    m.report_holdings(1, 1, report)
    _forge(store, Keys.HOLDINGS.format(g=1, rank=0), report.encode())
    assert m.holdings(1, 1) == report and m.holdings(1, 0) is None
    assert m.all_holdings(1, [0, 1]) is None
    _forge(store, Keys.DONE.format(member="a3"), "1.0")
    assert not m.is_done("a3") and not m.all_done(["a3"])
    assert Keys.CLAIM.format(g=1, rank=3) in {k for k, _ in rejected}


def test_the_token_proves_the_job_without_holding_its_secret(members: Any) -> None:
    store, m, _ = members
    assert m.serves_job() is None
    m.set_token()
    assert TEST_SECRET.encode() not in _raw(store, Keys.TOKEN)
    m.check_token()
    other = Membership(store, "a0", JobSeal("another job"))
    assert other.serves_job() is False
    with pytest.raises(JobTokenError):
        other.check_token()
    _forge(store, Keys.TOKEN, "job")
    with pytest.raises(JobTokenError):
        m.check_token()


def test_the_coordinator_ignores_forged_values_and_logs_each() -> None:
    """A forged `done/a2` does not spare a dead member its recovery, a forged report does not
    stand in for a survivor's; each is an event, and what no one read is named at the end."""
    job = Job(spares=2)
    _forge(job.store, Keys.DONE.format(member="a2"), "1.0")
    job.die("a2")
    job.tick()
    assert job.m().plan(1) is not None  # recovered, not taken for done
    forged = HoldingsReport("a3", 5, job.holds(3)).encode()
    _forge(job.store, Keys.HOLDINGS.format(g=1, rank=3), forged)
    job.report(1, [0, 1])
    job.store.add(Keys.HOLDINGS_COUNT.format(g=1), 1)  # a stranger bumps the counter too
    job.tick()
    assert job.decision(1) is None  # a3's report is still missing
    job.report(1, [3])
    job.tick()
    assert job.decision(1) == Decision.roster(4)
    _forge(job.store, Keys.END, "{}")  # never read by anyone
    job.coord.close()
    rejected = [e["key"] for e in job.events.of("rejected_value")]
    assert Keys.DONE.format(member="a2") in rejected
    assert Keys.HOLDINGS.format(g=1, rank=3) in rejected
    assert Keys.END in rejected


def test_every_key_but_counters_and_rendezvous_holds_a_sealed_value() -> None:
    assert all(
        holds_sealed(k)
        for k in ["job/token", "gen3/plan", "gen3/ready/7", "gen3/joined/2", "preempt", "end"]
    )
    assert not any(
        holds_sealed(k)
        for k in ["errors", "gen3/holdings/count", "failures", "spares/epoch", "gen3/0//cpu//0/1"]
    )


def test_a_reported_error_leaves_no_value_the_audit_rejects() -> None:
    """The error reports' counter (`errors`, bumped by `add`) holds no MAC: the end-of-job
    audit must not name it as a value the job did not write."""
    job = Job(spares=1)
    job.raised("a2", Phase.TRAINING, rank=2)
    job.die("a2")
    job.tick()
    assert job.m().error_count() == 1
    job.coord.close()
    assert job.events.of("rejected_value") == []
