"""The role views of the job's store (`store_view`, `worker_view`, `coordinator_view`,
`agent_view`) over one sealed core (`sealed_store`): each role reads and writes only what is
its own, views on one core share its connection and its reporting of rejected values, and
`Membership` is exactly the three views together."""

from __future__ import annotations

from megatron_deadpool.hotswap.protocol.agent_view import AgentView
from megatron_deadpool.hotswap.protocol.coordinator_view import CoordinatorView
from megatron_deadpool.hotswap.protocol.membership import Membership
from megatron_deadpool.hotswap.protocol.memory_store import MemoryStore
from megatron_deadpool.hotswap.protocol.messages import Keys, Plan
from megatron_deadpool.hotswap.protocol.sealed_store import SealedStore
from megatron_deadpool.hotswap.protocol.store_view import StoreView
from megatron_deadpool.hotswap.protocol.worker_view import WorkerView
from tests.stores import SEAL

ROLES = (WorkerView, CoordinatorView, AgentView)


def _own(view: type) -> set[str]:
    return {name for name in vars(view) if not name.startswith("_")}


def test_each_role_has_its_own_methods_and_no_other_roles() -> None:
    for view in ROLES:
        others = set().union(*(_own(v) for v in ROLES if v is not view))
        assert not _own(view) & others, view
        assert not _own(view) & _own(StoreView), view
        assert all(not hasattr(view, name) for name in others), view
    assert not hasattr(WorkerView, "publish_plan") and hasattr(CoordinatorView, "publish_plan")
    assert not hasattr(CoordinatorView, "report_holdings") and hasattr(WorkerView, "heartbeat")
    assert not hasattr(AgentView, "decide") and hasattr(AgentView, "report_exit")


def test_membership_is_every_role_at_once() -> None:
    assert issubclass(Membership, ROLES)
    for view in (*ROLES, StoreView):
        assert all(hasattr(Membership, name) for name in _own(view)), view


def test_views_on_one_core_share_it() -> None:
    store = MemoryStore()
    core = SealedStore(store, "coordinator", SEAL)
    rejected: list[str] = []
    coordinator = CoordinatorView(core)
    coordinator.on_rejected = lambda key, why: rejected.append(key)
    plan = Plan(generation=1, base=0, world_size=2, dead=(1,), needy=(1,), replaced={1: "s0"})
    coordinator.publish_plan(plan)
    reader = StoreView(core)  # the same party, reading as every role does
    assert reader.plan(1) == plan and reader.latest_plan() == 1
    assert reader.on_rejected is coordinator.on_rejected and reader.member == "coordinator"

    store.set(Keys.PLAN.format(g=2), "forged")  # not the job's: absent, reported once
    assert reader.plan(2) is None and coordinator.plan(2) is None
    assert rejected == [Keys.PLAN.format(g=2)]

    worker = WorkerView(SealedStore(store.clone(), "a1", SEAL))
    assert worker.planned(1) and worker.plan(1) == plan
    other = worker.sibling(store.clone(), "a2")
    assert type(other) is WorkerView and other.member == "a2" and other.store is not worker.store
