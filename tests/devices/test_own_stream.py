"""The replication side stream is DeadPool's own (`devices.streams.own_stream`), not one of
torch's pool of 32 streams per device that every `ProcessGroupNCCL` draws from too (issue 39,
N4): on the stand-in CUDA runtime (tests/devices/cuda_standin.py), the stream is created once
per device with ``cudaStreamCreateWithPriority`` (non-blocking, priority 0) on that device and
wrapped in an `ExternalStream`; the pool is never asked. And no module but `devices/streams.py`
makes a stream. At b213e7a the replicator took `torch.cuda.Stream(device)` from the pool.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from cuda_standin import in_own_process

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_deadpool"


def _streams_on_the_standin() -> dict[str, Any]:
    from cuda_standin import CudaStandIn

    runtime = CudaStandIn()
    runtime.install()
    import torch

    from megatron_deadpool.devices import streams

    streams.cudart = runtime.runtime  # type: ignore[assignment]
    torch.cuda.set_device(0)  # the caller's current device differs from the stream's
    first = streams.own_stream(torch.device("cuda", 3))
    again = streams.own_stream(torch.device("cuda", 3))
    other = streams.own_stream(torch.device("cuda", 5))

    def no_runtime() -> Any:
        raise OSError("libcudart.so.12: cannot open shared object file")

    streams.cudart = no_runtime  # type: ignore[assignment]
    fallback = streams.own_stream(torch.device("cuda", 6))
    return {
        "same": first is again,
        "kinds": [type(s).__name__ for s in (first, other, fallback)],
        "devices": [str(s.device) for s in (first, other, fallback)],
        "handles_differ": first.stream_ptr != other.stream_ptr,
        "calls": [[c.name, c.device, c.detail] for c in runtime.calls],
        "after": torch.cuda.current_device(),
    }


@pytest.mark.timeout(300)
def test_the_side_stream_is_created_outside_torchs_pool() -> None:
    result = in_own_process("test_own_stream:_streams_on_the_standin")
    calls = [(name, device, detail) for name, device, detail in result["calls"]]
    created = [c for c in calls if c[0] == "cudaStreamCreateWithPriority"]
    # Once per device, on that device, non-blocking (no order with the legacy default stream),
    # priority 0 (the pool's low priority).
    assert created == [
        ("cudaStreamCreateWithPriority", 3, "flags=1 priority=0"),
        ("cudaStreamCreateWithPriority", 5, "flags=1 priority=0"),
    ]
    assert result["same"] and result["handles_differ"]
    assert result["kinds"][:2] == ["ExternalStream", "ExternalStream"]
    assert result["devices"][:2] == ["cuda:3", "cuda:5"]
    pool = [c for c in calls if c[0] == "getStreamFromPool"]
    # The pool only where no CUDA runtime library can be loaded (with a warning).
    assert pool == [("getStreamFromPool", 0, "cuda:6")] and result["kinds"][2] == "Stream"
    assert result["after"] == 0  # the caller's current device is left as it was


def _streams_in_cpu_mode() -> dict[str, Any]:
    import torch

    from megatron_deadpool.devices import streams
    from megatron_deadpool.devices.base import select_device
    from megatron_deadpool.errors import ConfigError

    select_device("cpu")
    stream = streams.own_stream(torch.device("cuda"))
    try:
        streams.own_stream(torch.device("cpu"))
        refused = ""
    except ConfigError as exc:
        refused = str(exc)
    return {"kind": type(stream).__name__, "refused": refused}


@pytest.mark.timeout(300)
def test_the_cpu_mode_gets_its_no_op_stream() -> None:
    result = in_own_process("test_own_stream:_streams_in_cpu_mode")
    assert result["kind"] == "_NullStream"
    assert "needs a CUDA device" in result["refused"]


def test_no_module_but_the_devices_layer_makes_a_stream() -> None:
    """By construction: `torch.cuda.Stream(...)` is called in `devices/streams.py` alone (the
    CPU mode's stand-in aside); the replicator asks it for its stream."""
    allowed = {PACKAGE / "devices" / "streams.py", PACKAGE / "devices" / "cpu.py"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("cuda.Stream"):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert found == [], "take the side stream from devices.streams.own_stream"
    replicator = (PACKAGE / "replication" / "replicator.py").read_text()
    assert "own_stream(snapshotter.device)" in replicator


def test_the_loaded_runtime_is_found_in_the_process_maps(tmp_path: Path) -> None:
    from megatron_deadpool.devices.streams import loaded_libraries

    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f10 r-xp 00000000 08:01 42   /opt/venv/nvidia/cuda_runtime/lib/libcudart.so.12\n"
        "7f10-7f20 r--p 00010000 08:01 42   /opt/venv/nvidia/cuda_runtime/lib/libcudart.so.12\n"
        "7f20-7f30 rw-p 00000000 00:00 0 \n"
        "7f30-7f40 r-xp 00000000 08:01 43   /usr/lib/libcudart_static_helper.a (deleted)\n"
        "7f40-7f50 r-xp 00000000 08:01 44   /usr/lib/x86_64-linux-gnu/libcuda.so.1\n"
    )
    assert loaded_libraries("libcudart.so", maps) == [
        "/opt/venv/nvidia/cuda_runtime/lib/libcudart.so.12"
    ]
    assert loaded_libraries("libcudart.so", tmp_path / "absent") == []
