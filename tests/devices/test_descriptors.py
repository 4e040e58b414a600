"""The descriptor table a worker grows as it starts (`devices.descriptors`): the sizes planned,
and the real table of a fresh process read from the kernel (``FDSize``) before and after."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap

import pytest

from megatron_deadpool.devices import descriptors


def test_a_worker_reserves_a_base_and_a_few_entries_per_rank() -> None:
    assert descriptors.wanted_entries(4) == descriptors.BASE_ENTRIES + 4 * 4
    assert descriptors.wanted_entries(16384) > 16384 * 4
    with pytest.raises(ValueError, match="world_size=0"):
        descriptors.wanted_entries(0)


def test_the_table_planned_never_passes_the_open_files_limit() -> None:
    assert descriptors.planned_entries(8192, 1024) == 1024
    assert descriptors.planned_entries(8192, 65536) == 8192
    assert descriptors.planned_entries(8192, resource.RLIM_INFINITY) == 8192


def _in_a_fresh_process(body: str) -> dict[str, object]:
    """Run `body` (which sets `out`) in a new interpreter with a second thread running (the
    kernel's case that costs a grace period); `out` as JSON."""
    script = textwrap.dedent("""
        import json, os, threading, resource
        from megatron_deadpool.devices import descriptors
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
        def open_fds():
            return sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
        out = {}
        """) + textwrap.dedent(body) + "\nstop.set()\nprint(json.dumps(out))\n"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_reserve_grows_the_kernels_table_once_and_leaves_no_descriptor_open() -> None:
    out = _in_a_fresh_process("""
        out["before"] = descriptors.table_entries()
        fds = open_fds()
        out["reserved"] = descriptors.reserve(5000)
        out["after"] = descriptors.table_entries()
        out["same_fds"] = open_fds() == fds
        """)
    assert out["before"] is not None and int(out["before"]) < 5000  # type: ignore[arg-type]
    assert out["reserved"] == 5000
    assert int(out["after"]) >= 5000  # type: ignore[arg-type]
    assert out["same_fds"]


def test_reserve_stops_at_the_open_files_limit_without_an_error() -> None:
    out = _in_a_fresh_process("""
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        out["reserved"] = descriptors.reserve(5000)
        out["after"] = descriptors.table_entries()
        """)
    assert out["reserved"] == 300
    assert 300 <= int(out["after"]) < 5000  # type: ignore[arg-type]


def test_reserve_touches_no_open_descriptor_where_the_table_ends() -> None:
    """A descriptor already open at the last entry (a library's): kept open, unchanged."""
    out = _in_a_fresh_process("""
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 4999)
        before = os.fstat(4999).st_ino
        descriptors.reserve(5000)
        out["kept"] = os.fstat(4999).st_ino == before and 4999 in open_fds()
        """)
    assert out["kept"]
