"""Every store value is a typed message: it survives its encoding, and a value that is not the
message its key holds is refused with the key, the message and what is wrong."""

from __future__ import annotations

import json
import math

import pytest

from megatron_deadpool.hotswap.protocol.codec import ProtocolError, read_float, read_int
from megatron_deadpool.hotswap.protocol.messages import (
    Announcement,
    CheckpointFailures,
    CoordinatorIdentity,
    Decision,
    EndReport,
    ErrorReport,
    FailureReport,
    FinalReplication,
    HoldingsReport,
    IterationRecord,
    JobError,
    JobStatus,
    LayoutRecord,
    OutOfRedundancy,
    Phase,
    Plan,
    Preempted,
    Progress,
    Registration,
    Roster,
    SaveOrder,
    Sources,
    decode_holdings,
    member_of,
)
from megatron_deadpool.replication.placement import Layout, RankOrder

SAVE = SaveOrder(iteration=4, sources={2: 3}, complete=False, missing=(1,))
EXAMPLES = [
    LayoutRecord(tp=2, pp=1, dp=2, ranks_per_node=2, replicas=1),
    CoordinatorIdentity(epoch=1, id="f00d"),
    Announcement(host="n1", os_pid=4242),
    Roster(generation=2, world_size=4, slots={0: "a0", 1: "s0", 2: "a2", 3: "s1"}),
    Roster(generation=0, world_size=2, slots={0: "a0", 1: "a1"}, restore_iteration=7),
    Plan(generation=3, base=1, world_size=4, dead=(1, 2), needy=(1, 2), replaced={1: "s1"}),
    Decision.roster(4),
    Decision.superseded(5),
    Decision.out_of_redundancy(),
    HoldingsReport("a3", 5, {"local": (3, 4), "2": (4,)}, {"target": 6, "flags": [True]}),
    Sources({2: 3, 0: 1}),
    SAVE,
    OutOfRedundancy("no spare left", (1, 2), (1,), {1: (2,)}, SAVE),
    OutOfRedundancy("failed before replication started", (0, 1), (0, 1), {0: (), 1: ()}, None),
    EndReport("lost after training", 8, (3,), (), SaveOrder(8, {3: 0}, True, ())),
    FailureReport(number=2, time=1.7e9, why="Connection closed by peer"),
    IterationRecord(5, 1.7e9, 2.41, None, 1e-3, 0.4, 0.01, 1, 4, 405_000, {"capture": 0.002}),
    FinalReplication(committed_iteration=None),
    Preempted(iteration=9, saved=True),
    Registration(member="s2"),
    Registration(
        member="a1",
        host="n2:77",
        rank=1,
        generation=1,
        world_size=2,
        slots={0: "a0", 1: "a1"},
        last_completed=9,
        layout=LayoutRecord(1, 1, 2, 1, 1),
        plan_seen=2,
        recovering=True,
    ),
    Progress(iteration=6, generation=1, committed_iteration=5, replica_bytes=405_000),
    Progress(iteration=1),
    JobStatus(1, 1, 0, 1, 1, under_replicated=2, agreed_generation=1, restore_iteration=4),
]
ERROR = ErrorReport(3, "a2", 2, 0, Phase.START_UP, "FileNotFoundError", "no /data", 1.7e9, ("x",))
EXAMPLES += [
    Preempted(iteration=9, saved=False, unsaved="checkpoint of iteration 9 not saved to D"),
    CheckpointFailures({4: "checkpoint of iteration 4 not saved to D (rank 2: [Errno 28] ...)"}),
    ERROR,
    ErrorReport(1, "s0", None, -1, Phase.WAITING, "KeyError", "", 1.7e9),
    JobError("rank 2 failed in its start-up", ERROR, (0, 2)),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_survives_its_encoding(message: object) -> None:
    raw = message.encode()  # type: ignore[attr-defined]
    assert type(message).decode("some/key", raw.encode()) == message  # type: ignore[attr-defined]
    assert json.loads(raw) == message.to_dict()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("message", "change", "complaint"),
    [
        (EXAMPLES[3], {"generation": "2"}, "field 'generation': expected an integer"),
        (EXAMPLES[3], {"world_size": True}, "field 'world_size': expected an integer"),
        (EXAMPLES[3], {"slots": {"0": "a0", "x": "a1"}}, "field 'slots': 'x' is not a rank"),
        (EXAMPLES[3], {"slots": {"0": "a0", "1": "node7"}}, "not a member name"),
        (EXAMPLES[3], {"slots": {"0": "a0", "9": "a9"}}, "a slot beyond the world size"),
        (EXAMPLES[3], {"generation": -1}, "generation or world size too small"),
        (EXAMPLES[5], {"base": 3}, "a plan's generation follows its base"),
        (EXAMPLES[5], {"dead": [1, -2]}, "dead or needy: a rank below 0"),
        (EXAMPLES[6], {"verdict": "abort"}, "field 'verdict': 'abort' is not one of"),
        (EXAMPLES[6], {"restore_iteration": None}, "needs its restore iteration"),
        (EXAMPLES[9], {"holds": {"local": [3, "4"]}}, "field 'holds': expected an integer"),
        (EXAMPLES[9], {"holds": {"mine": [3]}}, "neither 'local' nor a rank"),
        (EXAMPLES[12], {"save": {"iteration": 4}}, "field 'save': field 'sources' missing"),
        (EXAMPLES[15], {"time": float("nan")}, "field 'time': nan is not finite"),
        (EXAMPLES[16], {"loss": float("inf")}, "field 'loss': inf is not finite"),
        (EXAMPLES[20], {"layout": {**EXAMPLES[0].to_dict(), "tp": 0}}, "sizes >= 1"),
        (ERROR, {"phase": "lunch"}, "field 'phase': 'lunch' is not one of"),
        (ERROR, {"member": "rank2"}, "'rank2' is not a member name"),
        (ERROR, {"tail": ["x", 3]}, "field 'tail': expected text"),
        (ERROR, {"number": 0}, "number below 1"),
        (EXAMPLES[-1], {"report": {**ERROR.to_dict(), "rank": -1}}, "rank below 0"),
    ],
)
def test_a_value_that_is_not_its_message_is_refused_by_name(
    message: object, change: dict, complaint: str
) -> None:
    cls = type(message)
    data = {**message.to_dict(), **change}  # type: ignore[attr-defined]
    with pytest.raises(ProtocolError) as caught:
        cls.decode("gen3/thing", json.dumps(data))  # type: ignore[attr-defined]
    text = str(caught.value)
    assert text.startswith(f"store key gen3/thing: cannot read {cls.__name__} from ")
    assert complaint in text


def test_what_is_not_a_message_at_all() -> None:
    with pytest.raises(ProtocolError, match=r"store key k: cannot read Plan .*not JSON"):
        Plan.decode("k", b"\xff\xfe")
    with pytest.raises(ProtocolError, match="expected a JSON object, got list"):
        Plan.decode("k", "[1, 2]")
    with pytest.raises(ProtocolError, match="field 'needy' missing"):
        Plan.decode("k", json.dumps({"generation": 2, "base": 1, "world_size": 2, "dead": []}))
    with pytest.raises(ProtocolError, match=r"cannot read Roster from '.{200}\.\.\.'"):
        Roster.decode("k", "x" * 5000)  # a long value is cut in the message


def test_many_reports_at_once_name_the_bad_one() -> None:
    good = HoldingsReport("a0", 3, {"local": (3,)})
    keys = ["gen1/holdings/0", "gen1/holdings/1"]
    assert decode_holdings(keys, [good.encode().encode()] * 2) == [good, good]
    bad = json.dumps({**good.to_dict(), "member": "root"}).encode()
    with pytest.raises(ProtocolError, match="gen1/holdings/1: cannot read HoldingsReport"):
        decode_holdings(keys, [good.encode().encode(), bad])
    with pytest.raises(ProtocolError, match="gen1/holdings/1: .*not JSON"):
        decode_holdings(keys, [good.encode().encode(), b"{"])


def test_scalars_are_checked_too() -> None:
    assert read_int("gen", b"12") == 12 and read_float("t", b"1.5") == 1.5
    with pytest.raises(ProtocolError, match="store key gen: 'twelve' is not an integer"):
        read_int("gen", b"twelve")
    with pytest.raises(ProtocolError, match="store key gen: -2 is below -1"):
        read_int("gen", b"-2", minimum=-1)
    for text in (b"nan", b"inf"):
        with pytest.raises(ProtocolError, match="is not finite"):
            read_float("t", text)
    assert math.isclose(read_float("t", "1e9"), 1e9)


def test_members_are_named_by_task() -> None:
    assert [member_of(t, 4) for t in (0, 3, 4, 5)] == ["a0", "a3", "s0", "s1"]


def test_an_error_report_names_its_cause_in_one_line() -> None:
    assert ERROR.cause() == "rank 2 start-up: FileNotFoundError: no /data"
    assert EXAMPLES[-2].cause() == "spare s0 waiting: KeyError"
    assert ERROR.signature() == (Phase.START_UP, "FileNotFoundError", "no /data")


def test_the_layout_record_carries_megatrons_rank_order() -> None:
    """The coordinator and a standby place replicas from the record: the order travels with it;
    a record without one (an older release's) means Megatron's default."""
    layout = Layout(tp=1, pp=2, dp=2, ranks_per_node=2, order=RankOrder.TP_PP_DP)
    record = LayoutRecord.of(layout, 1)
    assert record.to_dict()["order"] == "tp-cp-ep-pp-dp"
    read = LayoutRecord.decode("job/layout", record.encode())
    assert read == record and read.layout() == layout
    assert read.layout().dp_groups == [[0, 2], [1, 3]]
    older = {k: v for k, v in record.to_dict().items() if k != "order"}
    assert LayoutRecord.decode("job/layout", json.dumps(older)).order is RankOrder.TP_DP_PP
    with pytest.raises(ProtocolError, match="field 'order': 'pp-dp-tp' is not one of"):
        LayoutRecord.decode("job/layout", json.dumps({**older, "order": "pp-dp-tp"}))
