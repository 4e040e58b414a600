"""Shared by tests of the store protocol: a store that records every call it forwards, so a test
can check which operations a party made, or wait until it made one (blocked in a `wait` on
known keys) instead of sleeping.
"""

from __future__ import annotations

from typing import Any

from megatron_deadpool.hotswap.protocol.seal import JobSeal

TEST_SECRET = "test-job-secret"
"""The job secret of the tests' stores."""

SEAL = JobSeal(TEST_SECRET)
"""What seals their values (`Membership(store, member, SEAL)`)."""


class Recording:
    """A store that records (operation, first argument) of every call, then makes it."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.ops: list[tuple[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.store, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.ops.append((name, args[0] if args else None))
            return call(*args, **kwargs)

        return recorded

    def waited_on(self, keys: list[str]) -> bool:
        """Whether a `wait` was issued (it is recorded as it starts) on every key of `keys`."""
        return any(op == "wait" and set(keys) <= set(arg) for op, arg in list(self.ops))


def keys_waited_on(store: Any, call: Any) -> list[str]:
    """The keys a Membership call waits on, without spelling them out here: `call(members)` runs
    against a recording clone of `store` (give it a short timeout; its answer is ignored)."""
    from megatron_deadpool.hotswap.protocol.membership import Membership

    probe = Recording(store.clone())
    call(Membership(probe, "probe", SEAL))
    waits = [arg for op, arg in probe.ops if op == "wait"]
    assert len(waits) == 1, probe.ops
    return list(waits[0])
