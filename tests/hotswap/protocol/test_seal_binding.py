"""A sealed value opens only in the store and the run of the job it was written for (issue 42).

The same secret is not enough: a value copied from another of the job's stores (the primary's
into a standby's), from another job that reuses the secret (a token file kept between runs) or
from an earlier run of a requeued Slurm job (same job id, a new restart count) is rejected,
treated as absent and reported, as a forged one is. The binding comes from what every process
is given out of band (`DEADPOOL_JOB_ID`, its entry in `--deadpool-coordinator`), never from the
store.
"""

from __future__ import annotations

import pytest
from stores import TEST_SECRET

from megatron_deadpool.errors import ConfigError, JobTokenError
from megatron_deadpool.hotswap.protocol.membership import Membership
from megatron_deadpool.hotswap.protocol.memory_store import MemoryStore
from megatron_deadpool.hotswap.protocol.messages import CoordinatorIdentity, Keys
from megatron_deadpool.hotswap.protocol.seal import (
    JOB_ID_ENV,
    ForgedValue,
    JobSeal,
    job_binding,
    new_job_id,
)

COPIED = [Keys.SHUTDOWN, Keys.PREEMPT, Keys.COORDINATOR, Keys.TOKEN]
"""What an outsider copies from one store to another (issue 42)."""


def _serving(seal: JobSeal) -> tuple[MemoryStore, Membership]:
    """A store of the job `seal` is for, as its coordinator leaves it: serving, ending."""
    store = MemoryStore()
    m = Membership(store, "coordinator", seal)
    m.set_identity(CoordinatorIdentity(seal.store, "c"))
    m.set_token()
    m.request_preempt()
    m.request_shutdown()
    return store, m


def _copied_into(source: MemoryStore, seal: JobSeal) -> tuple[Membership, list[str]]:
    """A fresh store of `seal`'s, into which an outsider copied the raw values of `COPIED`;
    a member's view of it and the keys it reported as rejected."""
    target = MemoryStore()
    for key in COPIED:
        target.set(key, source.get(key))  # bytes as they are: nothing to forge, only to copy
    reader = Membership(target, "a0", seal)
    rejected: list[str] = []
    reader.on_rejected = lambda key, why: rejected.append(key)
    return reader, rejected


@pytest.mark.parametrize(
    "written, read",
    [
        pytest.param(("", 0), ("", 1), id="primary-to-standby"),
        pytest.param(("", 1), ("", 2), id="standby-to-standby"),
        pytest.param(("run-a", 0), ("run-b", 0), id="another-job-same-secret"),
        pytest.param(("slurm-77.0", 0), ("slurm-77.1", 0), id="requeued-slurm-job"),
    ],
)
def test_values_copied_from_another_store_or_run_do_not_open(
    written: tuple[str, int], read: tuple[str, int]
) -> None:
    source, own = _serving(JobSeal(TEST_SECRET, *written))
    assert own.serves_job() and own.shutdown_requested() and own.preempt_requested()
    reader, rejected = _copied_into(source, JobSeal(TEST_SECRET, *read))
    assert reader.serves_job() is False  # another store's or run's token: refused as another job
    with pytest.raises(JobTokenError, match="DEADPOOL_JOB_ID"):
        reader.check_token()
    assert reader.identity() is None
    assert not reader.shutdown_requested() and not reader.preempt_requested()
    assert sorted(rejected) == sorted([Keys.COORDINATOR, Keys.SHUTDOWN, Keys.PREEMPT])
    # ... while the same values, copied into a store of the same run and entry, open there:
    # the binding is the store's entry and the run, not the store's address.
    twin, none = _copied_into(source, JobSeal(TEST_SECRET, *written))
    assert twin.serves_job() and twin.shutdown_requested() and twin.preempt_requested()
    assert twin.identity() == CoordinatorIdentity(written[1], "c") and none == []


def test_a_seal_for_another_store_keeps_the_secret_and_the_run() -> None:
    seal = JobSeal(TEST_SECRET, "run-a", 0)
    standby = seal.for_store(1)
    assert (standby.job, standby.store) == ("run-a", 1)
    sealed = standby.seal("shutdown", "1")
    assert JobSeal(TEST_SECRET, "run-a", 1).open("shutdown", sealed) == b"1"
    assert standby.for_store(0).seal("shutdown", "1") == seal.seal("shutdown", "1")
    for other in (seal, JobSeal(TEST_SECRET, "run-b", 1), JobSeal("another", "run-a", 1)):
        with pytest.raises(ForgedValue, match="another key, generation, store or run"):
            other.open("shutdown", sealed)
    assert TEST_SECRET not in repr(standby) and "run-a" in repr(standby)
    with pytest.raises(ValueError, match="store -1"):
        seal.for_store(-1)


def test_the_run_id_comes_from_the_environment_and_is_checked() -> None:
    assert job_binding({}) == ""
    assert job_binding({JOB_ID_ENV: "slurm-77.1"}) == "slurm-77.1"
    for bad in ("x" * 129, "a\nb", "tab\there"):
        with pytest.raises(ConfigError, match=JOB_ID_ENV):
            job_binding({JOB_ID_ENV: bad})
    assert new_job_id() != new_job_id()
