"""Replica buffers of exactly the size asked for (`devices.pinned`), on the CPU with a stand-in
CUDA runtime: the allocation maps whole pages only, registers exactly that range once, and
unregisters it when the last tensor viewing it is freed. (The CUDA calls themselves, and
`is_pinned()` on such memory, are checked on a GPU: `scripts/gpu_first_contact.py`.)"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from megatron_deadpool.devices import pinned
from megatron_deadpool.errors import DeadpoolRuntimeError

GIB = 1 << 30


class _Runtime:
    """Records `cudaHostRegister` / `cudaHostUnregister` calls; answers `code`."""

    def __init__(self, code: int = 0) -> None:
        self.code = code
        self.calls: list[tuple] = []

    def cudaHostRegister(self, pointer: int, size: int, flags: int) -> int:
        self.calls.append(("register", pointer, size, flags))
        return self.code

    def cudaHostUnregister(self, pointer: int) -> int:
        self.calls.append(("unregister", pointer))
        return 0

    def cudaGetLastError(self) -> int:
        self.calls.append(("get last error",))
        return self.code


@pytest.mark.parametrize("nbytes", [1, 4096, 9 * (1 << 20) + 17])
def test_a_pinned_buffer_has_the_exact_size_and_registers_whole_pages_once(nbytes: int) -> None:
    runtime = _Runtime()
    buf = pinned.buffer(nbytes, torch.device("cpu"), pinned=True, runtime=runtime)
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes and buf.dim() == 1
    assert int(buf.sum()) == 0  # zero-filled, like torch.zeros
    ((kind, pointer, size, flags),) = runtime.calls
    assert kind == "register" and pointer == buf.data_ptr() and pointer % pinned.PAGE == 0
    assert size == pinned.mapped_length(nbytes) < nbytes + pinned.PAGE  # no power-of-two
    assert flags == pinned.PORTABLE
    buf[-1] = 7  # the memory is writable to its last byte
    del buf
    gc.collect()
    assert runtime.calls[1:] == [("unregister", pointer)]


def test_a_view_keeps_the_registration_until_the_last_tensor_goes() -> None:
    runtime = _Runtime()
    buf = pinned.buffer(10_000, torch.device("cpu"), pinned=True, runtime=runtime)
    pointer = buf.data_ptr()
    view = buf[100:200]
    del buf
    gc.collect()
    assert [c[0] for c in runtime.calls] == ["register"]  # still in use
    view.fill_(1)
    del view
    gc.collect()
    assert runtime.calls[-1] == ("unregister", pointer)


def test_the_mapped_length_rounds_to_pages_not_powers_of_two() -> None:
    nine = 9 * GIB + 5
    assert pinned.mapped_length(nine) == 9 * GIB + pinned.PAGE  # torch's host allocator: 16 GiB
    assert pinned.mapped_length(0) == pinned.PAGE


def test_a_failed_registration_is_one_clear_error_and_nothing_is_left_registered() -> None:
    runtime = _Runtime(code=2)  # cudaErrorMemoryAllocation
    with pytest.raises(DeadpoolRuntimeError, match=r"cudaHostRegister of \d+ B .*\(cudaError 2\)"):
        pinned.buffer(1 << 20, torch.device("cpu"), pinned=True, runtime=runtime)
    gc.collect()
    assert [c[0] for c in runtime.calls] == ["register", "get last error"]


def test_a_segment_file_that_cannot_be_page_locked_names_its_folder_and_the_fix(
    tmp_path: Path,
) -> None:
    runtime = _Runtime(code=1)  # cudaErrorInvalidValue: a file system Linux does not pin
    path = tmp_path / "r0-o0-s0.4096"
    with pytest.raises(DeadpoolRuntimeError) as failed:
        pinned.buffer(4096, torch.device("cpu"), pinned=True, runtime=runtime, path=path)
    said = str(failed.value)
    assert str(path) in said and "memory file system (tmpfs, e.g. /dev/shm)" in said
    assert "DEADPOOL_SEGMENTS" in said and "--deadpool-replica-device gpu" in said
    assert runtime.calls[-1] == ("get last error",)


def test_unpinned_host_buffers_need_no_runtime() -> None:
    buf = pinned.buffer(123, torch.device("cpu"), pinned=False, runtime=object())
    assert buf.numel() == 123 and int(buf.sum()) == 0
