"""The shared GPU checks (`megatron_deadpool.selftest.gpu_checks`) on the CPU: every verdict
fed the measurements it exists to judge (the figures issue 39 measured on an H200), the pack
check run on host memory, and the three users importing the one module."""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_deadpool.selftest import device_checks
from megatron_deadpool.selftest.gpu_checks import (
    heartbeat,
    kernel,
    n2_probe,
    pack_check,
    round_cost,
    thread_devices,
)

REPO = Path(__file__).resolve().parents[2]
GB = 10**9


def _cost(gb: float, round_ms: float, host_ms: float, copy_ms: float = 0.9) -> round_cost.SizeCost:
    return round_cost.SizeCost(
        shard_bytes=int(gb * GB),
        loop_ms=64.0,
        noise_ms=0.5,
        copy_added_ms=copy_ms,
        round_added_ms=round_ms,
        host_ms=host_ms,
    )


def test_round_cost_passes_the_kernel_and_fails_the_chunked_fallback_of_issue_39() -> None:
    kernel_rounds = [_cost(0.5, -5.1, 0.5, 2.0), _cost(1.5, -0.3, 0.7), _cost(3.0, -1.0, 1.2, 1.9)]
    assert round_cost.judge(kernel_rounds) == (True, [])
    fallback = [_cost(0.5, -1.3, 1.5, 2.0), _cost(1.5, 15.1, 24.0), _cost(3.0, 31.7, 39.0, 1.9)]
    ok, found = round_cost.judge(fallback)
    assert not ok
    assert found == [
        (
            "1.5 GB: the round adds 15.1 ms of GPU time to the loop, over 2 x the plain copy's "
            "0.9 ms + the loop's noise 0.5 ms"
        ),
        "1.5 GB: start_round holds the host 24.0 ms (limit 2)",
        (
            "3.0 GB: the round adds 31.7 ms of GPU time to the loop, over 2 x the plain copy's "
            "1.9 ms + the loop's noise 0.5 ms"
        ),
        "3.0 GB: start_round holds the host 39.0 ms (limit 2)",
    ]


def test_round_cost_bounds_are_exact_and_a_negative_copy_figure_allows_only_the_noise() -> None:
    at_bound = _cost(1.5, 2 * 0.9 + 0.5, round_cost.HOST_LIMIT_MS)
    assert round_cost.judge([at_bound])[0]
    over = _cost(1.5, 2 * 0.9 + 0.5 + 0.01, round_cost.HOST_LIMIT_MS + 0.01)
    assert len(round_cost.judge([over])[1]) == 2
    # A copy that measured faster than the loop alone (noise) allows no more than the noise.
    assert not round_cost.judge([_cost(1.5, 0.6, 0.1, copy_ms=-3.0)])[0]
    assert round_cost.judge([_cost(1.5, 0.5, 0.1, copy_ms=-3.0)])[0]


def test_round_cost_refuses_what_was_not_measured() -> None:
    assert round_cost.judge([]) == (False, ["nothing measured"])
    ok, found = round_cost.judge([_cost(1.5, math.nan, 0.1)])
    assert not ok and "not a finite number" in found[0]


def test_n2_probe_fails_when_a_round_restores_the_next_forwards_value() -> None:
    n = n2_probe.BUFFER_BYTES // 4
    right = [n2_probe.ProbeRound(i, 0, n, float(i)) for i in range(1, 13)]
    assert n2_probe.judge(right) == (True, "")
    seen_on_the_h200 = [n2_probe.ProbeRound(i, n, n, -1.0) for i in range(1, 13)]
    ok, note = n2_probe.judge(seen_on_the_h200)
    assert not ok
    assert note.startswith(
        "12 of 12 rounds restored a buffer changed after start_round (round 1: 1048576 of "
        "1048576 elements restored as -1, not 1)"
    )
    assert note.endswith("(N2)")
    assert n2_probe.judge(right[:11]) == (False, "11 of 12 rounds ran")


def test_heartbeat_verdict() -> None:
    good = heartbeat.BeatFigures(True, True, 40, None, 40, None)
    assert heartbeat.judge(good) == (True, "")
    assert heartbeat.judge(heartbeat.BeatFigures(True, True, 40, None, None, None))[0]
    ok, note = heartbeat.judge(heartbeat.BeatFigures(True, True, 2, "store gone", 1, "8: hung"))
    assert not ok
    assert note == (
        "2 beats during the abort (at least 5 expected); the heartbeat lost the coordinator: "
        "store gone; the device watch completed 1 checks after beats; the device watch would "
        "have ended the process: 8: hung"
    )
    ok, note = heartbeat.judge(heartbeat.BeatFigures(False, False, 40, None, 40, None))
    assert note == "the plan watch did not act on the plan; no abort of the groups completed"


def test_thread_devices_verdict() -> None:
    assert thread_devices.judge(None, 0) == (
        False,
        "devices.threads missing: this build cannot tell which device its threads use",
    )
    assert not thread_devices.judge({}, 0)[0]
    assert thread_devices.judge({"deadpool-heartbeat": 3, "deadpool-post": 3}, 3) == (True, "")
    ok, note = thread_devices.judge({"deadpool-heartbeat": None, "deadpool-post": 3, "v": 0}, 3)
    assert not ok
    assert note == "threads not on the rank's device 3: deadpool-heartbeat -> none, v -> 0"
    found = thread_devices.lookup()  # None on a build without `devices.threads`
    assert found is None or callable(found)


def test_kernel_verdict_fails_the_fallback_on_cuda_naming_the_fix() -> None:
    assert kernel.judge(None) == ("skipped", "skipped: no CUDA")
    fix = "TORCH_CUDA_ARCH_LIST=9.0 pip install --no-build-isolation ./cuda_kernels"
    status, detail = kernel.judge(kernel.KernelState("torch", "not installed", fix))
    assert status == "fail"
    assert "not installed" in detail and detail.endswith(f"Fix: {fix}")
    status, detail = kernel.judge(kernel.KernelState("cuda", "deadpool_cuda_kernels loaded", ""))
    assert status == "pass" and "loaded" in detail
    row = device_checks.pack_kernel(cuda=False)
    assert (row.status, row.detail) == ("skipped", "skipped: no CUDA")


@pytest.mark.timeout(120)
def test_the_pack_check_passes_on_host_memory() -> None:
    """The shared pack check's own logic where it runs here (on CUDA it also times the pack
    and compares the torch fallback's checksum with the kernel's)."""
    problems, figures = pack_check.pack_against_host(1 << 20, device="cpu")
    assert problems == []
    assert figures["bytes"] % 16 == 0 and figures["backend"] in ("numpy", "torch")
    assert "pack_ms" not in figures
    with pytest.raises(ValueError, match="nbytes"):
        pack_check.pack_against_host(1024, device="cpu")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(("." * node.level) + node.module)
    return found


def test_the_three_users_take_the_pack_check_from_the_one_module() -> None:
    """The first contact, the selftest and the GPU suite check the pack kernel against the host
    through `gpu_checks.pack_check`, and no longer keep their own timing or Adam helpers."""
    script = REPO / "scripts" / "gpu_first_contact.py"
    suite = REPO / "tests" / "gpu" / "test_gpu_suite.py"
    selftest = REPO / "megatron_deadpool" / "selftest" / "device_checks.py"
    assert "megatron_deadpool.selftest.gpu_checks.pack_check" in _imports(script)
    assert "megatron_deadpool.selftest.gpu_checks.pack_check" in _imports(suite)
    assert ".gpu_checks.pack_check" in _imports(selftest)
    for path, gone in (
        (script, ("def _ms(", "def _adam_state(", "def _world_of_one(", "class Skip(")),
        (suite, ("def _elapsed_ms(",)),
    ):
        text = path.read_text()
        assert [g for g in gone if g in text] == [], path
    for row in ("round_cost", "n2_probe", "heartbeat_dw", "thread_devices"):
        assert f'"{row}":' in script.read_text()


@pytest.mark.timeout(240)
def test_the_thread_devices_probe_runs_its_two_ranks_in_the_cpu_mode() -> None:
    """The probe's two processes, rounds and report, in the CPU mode (no thread selects a CUDA
    device there): without `devices.threads` the row fails saying so, with it it passes."""
    result = thread_devices.check(timeout_s=150, kind="cpu")
    ranks = result["figures"].get("ranks")
    assert ranks is not None, result
    assert [r["committed"] for r in ranks] == [[1, 2], [1, 2]]
    if thread_devices.lookup() is None:
        assert result["status"] == "FAIL"
        assert result["note"] == "; ".join(
            f"rank {r}: devices.threads missing: this build cannot tell which device its "
            "threads use"
            for r in (0, 1)
        )
    else:
        assert result["status"] == "pass", result


@pytest.mark.timeout(240)
def test_the_n2_probe_runs_its_rounds_in_the_cpu_mode() -> None:
    """The probe's rounds, restore and count, in the CPU mode (a fresh interpreter: it makes a
    world of one), where the capture is synchronous and every round restores its value."""
    code = (
        "import json; from megatron_deadpool.selftest.gpu_checks import n2_probe as n; "
        "r = n.measure(shard_gb=0.01, rounds=3, kind='cpu'); "
        "print('RESULT', json.dumps([[x.value, x.wrong, x.elements, x.seen] for x in r]))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    rounds = [n2_probe.ProbeRound(*x) for x in json.loads(line[len("RESULT ") :])]
    n = n2_probe.BUFFER_BYTES // 4
    assert rounds == [n2_probe.ProbeRound(i, 0, n, float(i)) for i in (1, 2, 3)]
    assert n2_probe.judge(rounds, expected_rounds=3) == (True, "")
