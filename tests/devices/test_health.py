"""What the heartbeat thread checks beyond "a Python thread lives" (CUDA), on stand-ins:
`devices.health.DeviceWatch` (the step's event), `devices.nccl.backend_errors` (the NCCL
backends' `get_error()`), and how a generation's communicators are set up
(`devices.nccl.init_mode`, `init_kwargs`, `warm_groups`)."""

from __future__ import annotations

from enum import Enum

import pytest
import torch

from megatron_deadpool.devices import nccl
from megatron_deadpool.devices.health import DeviceWatch
from megatron_deadpool.errors import ConfigError, ExitCode


class _Event:
    def __init__(self) -> None:
        self.done = False
        self.error: str | None = None

    def query(self) -> bool:
        if self.error:
            raise RuntimeError(self.error)
        return self.done


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _watch(bound: float = 130.0) -> tuple[DeviceWatch, list[_Event], _Clock, list]:
    events: list[_Event] = []
    clock = _Clock()
    ended: list[tuple[int, str]] = []

    def new_event() -> _Event:
        events.append(_Event())
        return events[-1]

    watch = DeviceWatch(
        bound, new_event=new_event, clock=clock, end=lambda c, w: ended.append((c, w))
    )
    return watch, events, clock, ended


def test_a_step_whose_work_completes_is_never_a_stall() -> None:
    watch, events, clock, ended = _watch()
    assert watch.check() is None  # no step yet
    watch.step_done(1)
    clock.now += 10
    assert watch.check() is None  # queued, within the bound
    events[0].done = True
    clock.now += 1000
    assert watch.check() is None  # done: nothing to watch until the next step
    watch(None)
    assert ended == []


def test_work_not_done_past_the_bound_ends_the_process_with_code_8() -> None:
    watch, _, clock, ended = _watch(bound=130.0)
    watch.step_done(7)
    clock.now += 129.0
    watch(None)
    assert ended == []
    clock.now += 2.0
    why = watch.check()
    assert why is not None and "step 7" in why and "130s" in why
    watch(None)
    assert [code for code, _ in ended] == [ExitCode.DEVICE_FAULT] and ExitCode.DEVICE_FAULT == 8
    assert "spare takes its slot" in ended[0][1]


def test_a_newer_step_replaces_the_one_watched() -> None:
    watch, _, clock, _ = _watch(bound=10.0)
    watch.step_done(1)
    clock.now += 8
    watch.step_done(2)  # the host went on: step 2's event covers step 1's work too
    clock.now += 5
    assert watch.check() is None  # step 2 is 5 s old
    clock.now += 6
    assert "step 2" in (watch.check() or "")


def test_a_cuda_error_from_the_query_ends_the_process_at_once() -> None:
    watch, events, _, ended = _watch()
    watch.step_done(3)
    events[0].error = "CUDA error: an illegal memory access was encountered"
    watch(None)
    assert ended and ended[0][0] == ExitCode.DEVICE_FAULT and "illegal memory" in ended[0][1]


# ---------------------------------------------------------------------- NCCL backends' errors


class ErrorType(Enum):  # torch's `ErrorType` names
    SUCCESS = 0
    TIMEOUT = 1
    COMM_ERROR = 2
    REMOTE_ERROR = 3


class ProcessGroupNCCL:  # named as torch's backend: `nccl_backend` checks the type's name
    def __init__(self, error: ErrorType) -> None:
        self.error = error

    def get_error(self) -> ErrorType:
        return self.error


class _Group:
    def __init__(self, name: str, backend: object | None) -> None:
        self.group_name = name
        self.backend = backend

    def _get_backend(self, device: torch.device) -> object:
        if self.backend is None:
            raise RuntimeError("No backend type associated with device type cuda")
        return self.backend


def test_backend_errors_name_every_group_whose_collective_failed() -> None:
    groups = [
        _Group("0", ProcessGroupNCCL(ErrorType.SUCCESS)),
        _Group("tp", ProcessGroupNCCL(ErrorType.TIMEOUT)),
        _Group("gloo-only", None),
        _Group("dp", ProcessGroupNCCL(ErrorType.REMOTE_ERROR)),
        _Group("other", object()),  # not an NCCL backend
    ]
    assert nccl.backend_errors(groups) == ["tp: TIMEOUT", "dp: REMOTE_ERROR"]
    assert nccl.backend_errors(groups[:1]) == []
    assert nccl.backend_errors([]) == []  # also: no process group at all (CPU, or torch w/o)


def test_a_torch_without_get_error_reports_nothing() -> None:
    class ProcessGroupNCCL:  # an older torch's backend: no get_error
        pass

    assert nccl.backend_errors([_Group("0", ProcessGroupNCCL())]) == []


# ---------------------------------------------------------------------- communicator set-up


def test_the_init_mode_is_split_unless_warm_is_asked_for() -> None:
    assert nccl.init_mode({}) == "split"
    assert nccl.init_mode({"DEADPOOL_NCCL_INIT": "warm"}) == "warm"
    assert nccl.init_mode({"DEADPOOL_NCCL_INIT": " Split "}) == "split"
    with pytest.raises(ConfigError) as info:
        nccl.init_mode({"DEADPOOL_NCCL_INIT": "lazy"})
    assert str(info.value).startswith("DEADPOOL_NCCL_INIT=lazy: ") and "\n" not in str(info.value)


def test_warm_mode_binds_no_device_and_split_mode_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert nccl.init_kwargs("nccl", "split") == {"device_id": torch.device("cuda", 2)}
    assert nccl.init_kwargs("nccl", "warm") == {}  # new groups are not split from the world's
    assert nccl.init_kwargs("gloo", "split") == {}


def test_warming_does_nothing_in_split_mode_or_without_groups() -> None:
    assert nccl.warm_groups([], mode="split") == 0
    assert nccl.warm_groups([], mode="warm") == 0  # no default group in this process
