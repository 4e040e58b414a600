"""A stand-in for CUDA's stream semantics on the CPU, to check the ordering of GPU work.

CPU work runs in program order, so a race between two CUDA streams cannot show on the CPU.
This stand-in records what CUDA would be told instead: every torch kernel (each aten op that
touches data, caught by a `TorchDispatchMode`) is issued on the calling thread's current
stream, with the byte ranges it reads and writes; `Stream.wait_stream`, `Stream.wait_event`,
`Event.record` and host synchronisation (`Event.synchronize`, `Stream.synchronize`,
`torch.cuda.synchronize`) are recorded as CUDA defines them. Happens-before then follows
with vector clocks: an op's clock holds, per stream, how many of that stream's ops are
ordered before it (its own stream's earlier ops; what a waited-for stream or event covered
when the wait was issued; what the host had waited for when the op was issued).

`violations` lists the pairs that CUDA would not order: a read on one stream and a later write
of the same bytes on another (write-after-read), and a read with the last earlier write of its
bytes on another stream (read-after-write). It is a test helper about stream order only
(helper B's stand-in runtime in tests/devices/ is about each thread's current device).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

Clock = dict[int, int]
Span = tuple[int, int]  # [start, stop) addresses


def _merge(into: Clock, other: Clock) -> None:
    for key, value in other.items():
        if into.get(key, 0) < value:
            into[key] = value


@dataclass
class Op:
    """One kernel as CUDA would run it."""

    name: str
    stream: int
    index: int  # 1-based position on its stream
    seq: int  # issue order over all streams
    clock: Clock
    reads: list[Span]
    writes: list[Span]
    phase: str


class FakeStream:
    """`torch.cuda.Stream`'s ordering methods."""

    def __init__(self, model: StreamModel, name: str) -> None:
        self.model = model
        self.name = name
        self.id = len(model.streams)
        self.count = 0
        self.clock: Clock = {}
        self.cuda_stream = 1000 + self.id
        model.streams.append(self)

    def wait_stream(self, other: FakeStream) -> None:
        _merge(self.clock, other.clock)

    def wait_event(self, event: FakeEvent) -> None:
        _merge(self.clock, event.clock)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent(self.model)
        event.record(self)
        return event

    def synchronize(self) -> None:
        _merge(self.model.host, self.clock)

    def query(self) -> bool:
        return True


class FakeEvent:
    """`torch.cuda.Event`: the clock of its stream when it was recorded."""

    def __init__(self, model: StreamModel, *args: Any, **kwargs: Any) -> None:
        self.model = model
        self.clock: Clock = {}

    def record(self, stream: FakeStream | None = None) -> None:
        self.clock = dict((stream or self.model.current()).clock)

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.model.current()).wait_event(self)

    def synchronize(self) -> None:
        _merge(self.model.host, self.clock)

    def query(self) -> bool:
        return True


class StreamModel:
    """The streams, events and ops of one process, and the patch of `torch.cuda` for them."""

    def __init__(self) -> None:
        self.streams: list[FakeStream] = []
        self.host: Clock = {}
        self.ops: list[Op] = []
        self.phase = ""
        self._local = threading.local()
        self.main = FakeStream(self, "main")

    def current(self) -> FakeStream:
        return getattr(self._local, "stream", self.main)

    @contextlib.contextmanager
    def on(self, stream: FakeStream | None) -> Iterator[None]:
        """`torch.cuda.stream(stream)`."""
        before = self.current()
        self._local.stream = stream or before
        try:
            yield
        finally:
            self._local.stream = before

    def issue(self, name: str, reads: list[Span], writes: list[Span]) -> None:
        stream = self.current()
        _merge(stream.clock, self.host)
        stream.count += 1
        stream.clock[stream.id] = stream.count
        op = Op(name, stream.id, stream.count, len(self.ops), dict(stream.clock), reads, writes,
                self.phase)  # fmt: skip
        self.ops.append(op)

    def synchronize(self, device: Any = None) -> None:
        for stream in self.streams:
            _merge(self.host, stream.clock)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Patch `torch.cuda`'s streams and events with this model, and record every op."""
        cuda = torch.cuda
        patches = {
            "Stream": lambda *a, **k: FakeStream(self, f"side{len(self.streams)}"),
            "Event": lambda *a, **k: FakeEvent(self),
            "stream": self.on,
            "current_stream": lambda device=None: self.current(),
            "default_stream": lambda device=None: self.main,
            "synchronize": self.synchronize,
        }
        saved = {name: getattr(cuda, name) for name in patches}
        for name, value in patches.items():
            setattr(cuda, name, value)
        try:
            with _Recorder(self):
                yield
        finally:
            for name, value in saved.items():
                setattr(cuda, name, value)

    def violations(self, watch: list[torch.Tensor] | None = None) -> list[str]:
        """Every unordered read/write pair of the same bytes on different streams; with
        `watch`, of the bytes of those tensors only (the device tensors of a scenario: on a
        CPU every tensor is in host memory, and a host tensor's ops are not stream work)."""
        watched = None if watch is None else [s for s in map(_span, watch) if s is not None]

        def clash(a: list[Span], b: list[Span]) -> bool:
            if watched is None:
                return _overlap(a, b)
            return any(
                _overlap([(max(x0, y0), min(x1, y1))], watched)
                for x0, x1 in a
                for y0, y1 in b
                if x0 < y1 and y0 < x1
            )

        found = []
        for i, read in enumerate(self.ops):
            if not read.reads:
                continue
            last_write: Op | None = None
            for write in self.ops[:i]:
                if write.stream != read.stream and clash(write.writes, read.reads):
                    last_write = write
            if last_write is not None and not _before(last_write, read):
                found.append(
                    f"read-after-write unordered: {_describe(last_write)} -> {_describe(read)}"
                )
            for write in self.ops[i + 1 :]:
                if (
                    write.stream != read.stream
                    and clash(read.reads, write.writes)
                    and not _before(read, write)
                ):
                    found.append(
                        f"write-after-read unordered: {_describe(read)} -> {_describe(write)}"
                    )
        return found


def _before(a: Op, b: Op) -> bool:
    return b.clock.get(a.stream, 0) >= a.index


def _describe(op: Op) -> str:
    return f"{op.name} on stream {op.stream} #{op.index} ({op.phase})"


def _overlap(a: list[Span], b: list[Span]) -> bool:
    return any(x0 < y1 and y0 < x1 for x0, x1 in a for y0, y1 in b)


def _span(tensor: torch.Tensor) -> Span | None:
    if tensor.numel() == 0 or tensor.device.type != "cpu":
        return None
    size = tensor.element_size()
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride()))
    start = tensor.untyped_storage().data_ptr() + tensor.storage_offset() * size
    return start, start + extent * size


class _Recorder(TorchDispatchMode):
    """Issues every data-touching aten op on the current stand-in stream."""

    def __init__(self, model: StreamModel) -> None:
        super().__init__()
        self.model = model

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return out  # a view: no kernel touches data
        reads: list[Span] = []
        writes: list[Span] = []
        for index, arg in enumerate(schema.arguments):
            value = args[index] if index < len(args) else kwargs.get(arg.name)
            tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
            written = arg.alias_info is not None and arg.alias_info.is_write
            spans = [s for s in map(_span, tensors) if s is not None]
            (writes if written else reads).extend(spans)
        self.model.issue(str(func), reads, writes)
        return out
