"""Failure traces (megatron_deadpool/planner/trace.py): the bundled Llama 3 trace reproduces
the paper's Table 5, the file format reads back what it writes, bad files are refused naming
the line and field, and the synthetic trace follows its rate."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_deadpool.errors import ConfigError
from megatron_deadpool.planner.trace import (
    LLAMA3_CAUSES,
    format_trace,
    llama3_trace,
    load_trace,
    parse_trace,
)

TABLE_5 = {
    "Faulty GPU": 148,
    "GPU HBM3 Memory": 72,
    "Software Bug": 54,
    "Network Switch/Cable": 35,
    "Host Maintenance": 32,
    "GPU SRAM Memory": 19,
    "GPU System Processor": 17,
    "NIC": 7,
    "NCCL Watchdog Timeouts": 7,
    "Silent Data Corruption": 6,
    "GPU Thermal Interface + Sensor": 6,
    "SSD": 3,
    "Power Supply": 3,
    "Server Chassis": 2,
    "IO Expansion Board": 2,
    "Dependency": 2,
    "CPU": 2,
    "System Memory": 2,
}
"""The Llama 3 Herd of Models, Table 5, typed in from the paper independently of the module."""


def test_bundled_llama3_trace_has_the_papers_419_interruptions_by_cause() -> None:
    trace = load_trace("llama3")
    assert len(trace.interruptions) == 419
    assert trace.by_cause() == TABLE_5
    assert trace.duration_h == 54 * 24 and trace.gpus == 16384
    assert "Table 5" in trace.source and "2407.21783" in trace.source
    times = [i.time_h for i in trace.interruptions]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 54 * 24
    assert trace.count(permanent=False) == 54 + 2 + 7
    assert trace.count(scope="hang") == 7


def test_bundled_file_is_what_llama3_trace_makes() -> None:
    assert format_trace(load_trace("llama3")) == format_trace(llama3_trace())
    assert sum(c[2] for c in LLAMA3_CAUSES) == 419


def test_format_reads_back_what_it_writes() -> None:
    trace = load_trace("synthetic:per_day=5,days=3,seed=7,gpus=64")
    again = parse_trace(format_trace(trace), "again")
    assert again.gpus == 64 and again.duration_h == trace.duration_h
    assert again.interruptions == tuple(
        dataclasses.replace(i, time_h=round(i.time_h, 3)) for i in trace.interruptions
    )
    assert format_trace(again) == format_trace(trace)


def test_a_hand_written_trace_with_comments_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(
        "# deadpool failure trace v1\n# duration_h: 10\n# source: my cluster\n\n"
        "time_h,cause,scope,permanent\n1.5,bad GPU,process,yes\n# a comment\n\n"
        "0.5,oom,process,no\n9.99,switch,node,YES\n"
    )
    trace = load_trace(str(path))
    assert [i.time_h for i in trace.interruptions] == [0.5, 1.5, 9.99]
    assert [i.permanent for i in trace.interruptions] == [False, True, True]
    assert trace.source == "my cluster" and trace.gpus is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("time_h,cause,scope,permanent\n1,x,process,no\n", "'# duration_h:' is missing"),
        ("# duration_h: abc\ntime_h,cause,scope,permanent\n", "expected a finite number"),
        ("# duration_h: -1\ntime_h,cause,scope,permanent\n", "must be > 0"),
        ("# duration_h: 10\n# gpus: 1.5\ntime_h,cause,scope,permanent\n", "'# gpus:'"),
        ("# duration_h: 10\ntime,cause,scope,permanent\n", "line 2: the header must be"),
        ("# duration_h: 10\n", "no header line"),
        ("# duration_h: 10\ntime_h,cause,scope,permanent\n1,x,process\n", "line 3: expected 4"),
        ("# duration_h: 10\ntime_h,cause,scope,permanent\nnan,x,process,no\n", "line 3: time_h"),
        ("# duration_h: 10\ntime_h,cause,scope,permanent\n10,x,process,no\n", "outside"),
        ("# duration_h: 10\ntime_h,cause,scope,permanent\n-1,x,process,no\n", "outside"),
        ("# duration_h: 10\ntime_h,cause,scope,permanent\n1,,process,no\n", "cause is empty"),
        ("# duration_h: 10\ntime_h,cause,scope,permanent\n1,x,rack,no\n", "scope 'rack'"),
        ("# duration_h: 10\ntime_h,cause,scope,permanent\n1,x,node,maybe\n", "permanent 'maybe'"),
    ],
)
def test_bad_trace_files_name_the_line_and_field(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match="--trace f.csv") as info:
        parse_trace(text, "f.csv")
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("synthetic", "give the rate"),
        ("synthetic:days=3", "give the rate"),
        ("synthetic:rate=3", "unknown key 'rate'"),
        ("synthetic:per_day=inf", "finite"),
        ("synthetic:per_day=-1", "per_day must be in"),
        ("synthetic:per_day=1,days=0", "days in (0, 3650]"),
        ("synthetic:per_day=1,gpus=0", "gpus must be an integer"),
        ("/nonexistent/trace.csv", "cannot read it"),
    ],
)
def test_bad_trace_specs(spec: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_trace(spec)
    assert message in str(info.value)


def test_synthetic_trace_follows_its_rate_and_seed() -> None:
    a = load_trace("synthetic:per_day=20,days=50,seed=3")
    assert a == load_trace("synthetic:per_day=20,days=50,seed=3")
    assert a != load_trace("synthetic:per_day=20,days=50,seed=4")
    assert 900 < len(a.interruptions) < 1100  # Poisson, mean 1,000 (sd ~32)
    assert a.duration_h == 1200
    assert not load_trace("synthetic:per_day=0").interruptions
    assert set(a.by_cause()) <= set(TABLE_5)
