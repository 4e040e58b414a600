"""A value counted as it is written (a survivor's report, a stamp, a finished member) costs a
rank's client one request less: the counter's add confirms the set before it, where a lone set
needs a check of its own (`store_protocol.ConfirmedSets`, `connection.BoundedStore`). A real store,
torch's client under the bounded one, every call it makes recorded."""

from __future__ import annotations

import datetime

import torch.distributed as dist
from stores import SEAL, Recording

from megatron_deadpool.hotswap.protocol.connection import BoundedStore
from megatron_deadpool.hotswap.protocol.membership import Membership, host_store
from megatron_deadpool.hotswap.protocol.messages import HoldingsReport, Keys


def test_a_counted_value_is_confirmed_by_its_counter_and_lands_before_its_count() -> None:
    store = host_store("127.0.0.1", 0)
    client = dist.TCPStore(
        "127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    recording = Recording(client)
    members = Membership(BoundedStore(recording, 10.0), "a1", SEAL)
    coordinator = Membership(store, "coordinator", SEAL)

    members.set_progress(3)  # a value nobody counts: set, then a check confirms it
    assert [op for op, _ in recording.ops] == ["set", "check"]
    recording.ops.clear()

    report = HoldingsReport(member="a1", last_completed=6, holds={"local": (5, 6)})
    members.report_holdings(1, 1, report)
    members.stamp(1, "joined", 1)
    members.mark_done()
    assert recording.ops == [
        ("set", Keys.HOLDINGS.format(g=1, rank=1)),
        ("add", Keys.HOLDINGS_COUNT.format(g=1)),
        ("set", Keys.STAMP.format(g=1, phase="joined", rank=1)),
        ("add", Keys.STAMP_COUNT.format(g=1, phase="joined")),
        ("set", Keys.DONE.format(member="a1")),
        ("add", Keys.DONE_COUNT),
    ]
    # Each value is in, sealed, when its count says so.
    assert coordinator.holdings_count(1) == 1 and coordinator.holdings(1, 1) == report
    assert coordinator.stamp_count(1, "joined") == 1
    assert coordinator.stamp_time(1, "joined", 1) is not None
    assert coordinator.done_count() == 1 and coordinator.is_done("a1")


def test_an_unbounded_client_sets_and_counts_as_before() -> None:
    """torch's own client (the coordinator's, a test's) has no confirmed sets: a set, then the
    add."""
    store = host_store("127.0.0.1", 0)
    recording = Recording(store)
    Membership(recording, "a1", SEAL).stamp(2, "restored", 0)
    assert [op for op, _ in recording.ops] == ["set", "add"]
    assert Membership(store, "c", SEAL).stamp_count(2, "restored") == 1
