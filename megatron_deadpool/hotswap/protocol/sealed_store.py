"""The sealed key-value core every role's view of the job's store stands on.

One `SealedStore` is one access to the store (a connection, or a view of one) as one named
party: it seals every value it writes with the job's secret (`seal.JobSeal`: an HMAC-SHA256
of the key and the payload) and opens every value it reads. A value that is not the job's -
forged, altered, or copied from another key or generation - is treated as absent, reported
once (a warning, and `on_rejected`, e.g. the coordinator's event `rejected_value`), and never
acted on; a reader that waits for such a key polls until the job's own value replaces it.
Counters (`add`) cannot carry a MAC: they only ever wake or hurry a reader of sealed values,
or hand out the numbers of a numbered list, whose writer claims an empty number (`append`).
A beat is a sealed beat number, set, not added (`beat`, `beat_numbers`).

A read is one request (`peek`); a process that waits for a key blocks on the server (a WAIT)
and then reads it: two requests, where torch's `get` after a wait would make three. Nothing
here knows a key: the keys and who may read and write each are the role views'
(`store_view`, `worker_view`, `coordinator_view`, `agent_view`, `launcher_view`), the key
templates and their documentation `messages.Keys`.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

from .codec import read_float, read_int
from .numbered import numbers_to_read
from .seal import ForgedValue, JobSeal
from .store_protocol import ConfirmedSets, ServingStore, StoreLike

log = logging.getLogger("megatron_deadpool.membership")

ABSENT = "\0absent\0"
"""What `peek` compares with: no value of ours (text, JSON, numbers) is ever equal to it."""

BATCH_KEYS = 1024
"""Keys per batched store request. torch's store server handles a request's keys in time that
grows faster than linearly with their number (measured with torch 2.13 on loopback: 16,384 keys
in one `multi_get` 0.75-0.94 s, in 16 requests of 1,024 keys 0.04-0.05 s)."""

FORGED_POLL_S = 0.05
"""How often a reader waiting for a key polls while the key holds a rejected value."""

FORGED_WAIT_S = 300.0
"""How long a read that must return a value (`roster`, `sources`) waits for the job's own value
to replace a rejected one before it gives up (`ForgedValue`)."""

APPEND_ATTEMPTS = 40
"""Numbers an `append` tries before it gives up (each after a jump twice the last: 2**39 past
where it started)."""

BEAT_ATTEMPTS = 3
"""Compare-and-sets a beat tries before it sets its value outright (a key that holds another
process's beat, a stranger's value, or none)."""

REJECTIONS_REMEMBERED = 4096
"""Rejected (key, value) pairs remembered so that each is reported once."""


class SealedStore:
    """One party's sealed access to the job's store: `member` names it in what it reports."""

    def __init__(self, store: StoreLike, member: str, seal: JobSeal) -> None:
        self.store = store
        self.member = member
        self.seal = seal
        self._set_then_add = store.set_then_add if isinstance(store, ConfirmedSets) else None
        self.on_rejected: Callable[[str, str], None] | None = None  # (key, why): e.g. an event
        self._rejected: set[tuple[str, bytes]] = set()
        self._taken: dict[str, tuple[int, set[int]]] = {}  # counter -> (the `seen` returned,
        # the numbers a value was read at)
        self._beats_sent: dict[str, tuple[bytes, int]] = {}  # key -> (value, number) last beat
        self._beats_seen: dict[str, tuple[bytes, int]] = {}  # key -> (value, newest number)

    def sibling(self, store: StoreLike, member: str | None = None) -> SealedStore:
        """Another access to a store of the same job (another connection, or as `member`), which
        reports its rejections the same way."""
        other = SealedStore(store, self.member if member is None else member, self.seal)
        other.on_rejected = self.on_rejected
        return other

    # ------------------------------------------------------------------ writing
    def set(self, key: str, value: str) -> None:
        """Put `value` in `key`, sealed."""
        self.store.set(key, self.seal.seal(key, value))

    def set_many(self, keys: Sequence[str], value: str) -> None:
        """Put `value` in every one of `keys`, sealed: the serving store's batched requests
        (`BATCH_KEYS` keys each)."""
        store = self.serving()
        for i in range(0, len(keys), BATCH_KEYS):
            batch = list(keys[i : i + BATCH_KEYS])
            store.multi_set(batch, [self.seal.seal(k, value) for k in batch])

    def set_counted(self, key: str, value: str, counter: str) -> int:
        """Set `key`, then add one to `counter` (after the value is in: a reader that sees the
        count finds it); the counter's new value. One request less on a client whose sets
        confirm themselves (`ConfirmedSets`)."""
        sealed = self.seal.seal(key, value)
        if self._set_then_add is not None:
            return self._set_then_add(key, sealed, counter, 1)
        self.store.set(key, sealed)
        return int(self.store.add(counter, 1))

    def stamp(self, key: str) -> None:
        """Put this host's wall time now in `key`."""
        self.set(key, repr(time.time()))

    def stamp_counted(self, key: str, counter: str) -> None:
        """`stamp`, counted in `counter` (`set_counted`)."""
        self.set_counted(key, repr(time.time()), counter)

    def add(self, counter: str, amount: int) -> int:
        """Add `amount` to `counter` (unsealed: created at 0 if missing); its new value."""
        return int(self.store.add(counter, amount))

    def append(
        self, counter: str, key_of: Callable[[int], str], payload_of: Callable[[int], str]
    ) -> int:
        """Write the next value of the list `counter` numbers: take a number from `counter`,
        then put `payload_of(n)` in `key_of(n)` only if that key is empty (compare-and-set);
        the number written. A number below 1 or a key already written (a stranger moved the
        counter back, or wrote there) moves the counter on - past 0 at once, then by jumps
        that double - so that no value already written is overwritten, and a reader of the
        list (`numbered.py`) finds the value at or below the counter. `ForgedValue` after
        `APPEND_ATTEMPTS` numbers taken, never a loop. The honest path: one add and one
        compare-and-set."""
        n, jump = int(self.store.add(counter, 1)), 1
        for _ in range(APPEND_ATTEMPTS):
            if n >= 1:
                key = key_of(n)
                desired = self.seal.seal(key, payload_of(n)).encode()
                if self.store.compare_set(key, "", desired) == desired:  # type: ignore[arg-type]
                    return n
                n, jump = int(self.store.add(counter, jump)), jump * 2
            else:
                n = int(self.store.add(counter, 1 - n))
        raise ForgedValue(
            f"store key {counter}: no free number after {APPEND_ATTEMPTS} tries (the counter "
            f"stands at {n}): a stranger is writing the numbers ahead of it"
        )

    def beat(self, key: str) -> int:
        """One beat in `key`: the next beat number, sealed and set (not added: a stranger's add
        cannot beat for a hung process), one compare-and-set when this access wrote the key's
        value last. Numbers go on from the newest of the job's in the key (another access's
        or an earlier process's beats of the same party, a coordinator's 0); a key that holds
        none of ours, or none at all (pruned, or a store failed over to), is written from this
        access's own count. The number written."""
        expected, n = self._beats_sent.get(key, (b"", 0))
        desired = self.seal.seal(key, str(n + 1))
        for _ in range(BEAT_ATTEMPTS):
            desired = self.seal.seal(key, str(n + 1))
            raw = self.store.compare_set(key, expected, desired)  # type: ignore[arg-type]
            if raw == desired.encode():
                break
            if expected and raw == expected:  # the key is missing: create it
                expected = b""
                continue
            value = self.open(key, raw)  # (reported once when not the job's)
            n = max(n, _beat_number(value))
            expected = raw
        else:
            self.store.set(key, desired)
        self._beats_sent[key] = (desired.encode(), n + 1)
        return n + 1

    def start_beats(self, key: str) -> None:
        """Create `key` with the beat number 0 unless it holds a value (one request)."""
        self.store.compare_set(key, "", self.seal.seal(key, "0"))

    def beat_number(self, key: str, raw: bytes | None) -> int:
        """The newest beat number read from `key` so far, `raw` its value now (None: missing):
        a value that is not the job's, or a number below one read before (a replay of an
        earlier beat), is no beat, and reported once as a forged value is. 0: never beat."""
        seen = self._beats_seen.get(key)
        if raw is None or (seen is not None and seen[0] == raw):
            return 0 if seen is None else seen[1]
        newest = 0 if seen is None else seen[1]
        value = self.open(key, raw)
        n = _beat_number(value) if value is not None else newest
        if n < newest:
            self.reject(key, raw, f"store key {key}: rejected beat {n}, after beat {newest}")
        self._beats_seen[key] = (raw, max(n, newest))
        return max(n, newest)

    def beat_numbers(self, keys: Sequence[str]) -> list[int]:
        """`beat_number` of each of `keys` (which must all exist), in batched requests; only
        a value that changed since the last read is opened."""
        return [self.beat_number(k, raw) for k, raw in zip(keys, self.multi_get(keys))]

    def count(self, key: str) -> int:
        """A counter's value (0, and created, if it did not exist)."""
        return int(self.store.add(key, 0))

    def claim(self, key: str, payload: str) -> bytes:
        """Put `payload` in `key` unless it holds a value of the job's already (a rejected one
        counts as none, and is replaced); the payload the key holds afterwards. `ForgedValue`
        when rejected values keep replacing ours for `FORGED_WAIT_S`."""
        expected: str | bytes = ""
        desired = self.seal.seal(key, payload)
        deadline = time.monotonic() + FORGED_WAIT_S  # a stranger racing us delays, never wins
        while True:  # each round replaces the rejected value it saw
            raw = self.store.compare_set(key, expected, desired)  # type: ignore[arg-type]
            value = self.open(key, raw)
            if value is not None:
                return value
            if time.monotonic() > deadline:
                self.seal.open(key, raw)  # raises ForgedValue, naming key and value
            expected = raw

    # ------------------------------------------------------------------ opening and rejecting
    def open(self, key: str, raw: bytes) -> bytes | None:
        """The payload of `raw`, read from `key`; None (reported once) if it is not the job's."""
        try:
            return self.seal.open(key, raw)
        except ForgedValue as exc:
            self.reject(key, raw, str(exc))
            return None

    def reject(self, key: str, raw: bytes, why: str) -> None:
        """Report `raw`, read from `key`, as not the job's (once per key and value)."""
        if (key, raw) in self._rejected:
            return
        if len(self._rejected) >= REJECTIONS_REMEMBERED:
            self._rejected.clear()
        self._rejected.add((key, raw))
        log.warning("%s: %s", self.member, why)
        if self.on_rejected is not None:
            self.on_rejected(key, why)

    # ------------------------------------------------------------------ reading
    def peek(self, key: str) -> bytes | None:
        """`key`'s value, or None if it does not exist, in one request that neither waits nor
        creates the key: a compare-and-set whose expected value no key holds answers the
        current value, or that expected value for a missing key (torch's TCP, file and hash
        stores alike). torch's own `get` waits for the key first (two requests: WAIT, GET)."""
        value = self.store.compare_set(key, ABSENT, ABSENT)
        return None if value == ABSENT.encode() else value

    def read(self, key: str) -> bytes | None:
        """`key`'s payload, or None when it is missing or not the job's (one request)."""
        raw = self.peek(key)
        return None if raw is None else self.open(key, raw)

    def present(self, key: str) -> bool:
        """Whether `key` holds a value of the job's (one request)."""
        return self.read(key) is not None

    def number(self, key: str) -> int | None:
        """`key`'s payload as a whole number (None when absent or not the job's)."""
        value = self.read(key)
        return None if value is None else read_int(key, value)

    def seconds(self, key: str) -> float | None:
        """`key`'s payload as a time or a duration (None when absent or not the job's)."""
        value = self.read(key)
        return None if value is None else read_float(key, value)

    def get(self, key: str) -> bytes:
        """`key`'s payload, blocking until the key exists (up to the store's timeout) and
        holds a value of the job's (up to `FORGED_WAIT_S` more)."""
        deadline = time.monotonic() + FORGED_WAIT_S
        while True:
            raw = self.store.get(key)
            value = self.open(key, raw)
            if value is not None:
                return value
            if time.monotonic() > deadline:
                self.seal.open(key, raw)  # raises ForgedValue, naming key and value
            time.sleep(FORGED_POLL_S)

    def wait_read(self, key: str, timeout_s: float) -> bytes | None:
        """Block until `key` exists, then its payload (None on timeout): two requests. While
        it holds a rejected value, poll until the job's own replaces it."""
        deadline = time.monotonic() + timeout_s
        while self.wait(key, timeout_s=deadline - time.monotonic()):
            raw = self.peek(key)
            if raw is None:  # deleted in between: only `withdraw` deletes, and not these keys
                raise dist.DistStoreError(f"{key} vanished from the store")
            value = self.open(key, raw)
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                break
            time.sleep(FORGED_POLL_S)
        return None

    def wait(self, *keys: str, timeout_s: float) -> bool:
        """Block until every key exists (the server answers when they are set); False on
        timeout."""
        try:
            self.store.wait(list(keys), datetime.timedelta(seconds=max(timeout_s, 0.001)))
        except dist.DistStoreError:
            return self.store.check(list(keys))  # they may have been set as the wait timed out
        return True

    # ------------------------------------------------------------------ batched reads
    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Values of `keys` (which must all exist: a missing one blocks), in batches."""
        out: list[bytes] = []
        for i in range(0, len(keys), BATCH_KEYS):
            out += self.store.multi_get(list(keys[i : i + BATCH_KEYS]))
        return out

    def all_exist(self, keys: Sequence[str]) -> bool:
        """Whether every key of `keys` exists (batched requests; any value, even a rejected one)."""
        return all(
            self.store.check(list(keys[i : i + BATCH_KEYS]))
            for i in range(0, len(keys), BATCH_KEYS)
        )

    def payloads(self, keys: Sequence[str]) -> list[bytes | None]:
        """The payloads of `keys` (which must all exist), in batches; None for a rejected one."""
        return [self.open(k, raw) for k, raw in zip(keys, self.multi_get(keys))]

    def all_present(self, keys: Sequence[str]) -> bool:
        """Whether every key of `keys` holds a value of the job's (batched requests)."""
        return self.all_exist(keys) and all(v is not None for v in self.payloads(keys))

    def numbered(
        self, counter: str, key_of: Callable[[int], str], seen: int
    ) -> tuple[int, list[tuple[str, bytes]]]:
        """The values numbered by `counter` after the first `seen`: how many were read now,
        and (key, opened value) of those that arrived. A number given out and not written yet
        is read the next time, unless a later one is written (a stranger's bump of the counter
        holds nothing up); a forged value is dropped, and logged. A counter moved back below
        `seen` (`numbered.py`) is read from there, and a number this store read a value at
        before is not read again by a reader that goes on from what this call returned (the
        job's values are never overwritten: `append`); another `seen` starts the reading over."""
        count = int(self.store.add(counter, 0))
        returned, taken = self._taken.get(counter, (seen, set()))
        if returned != seen:  # another reader, or one that starts over
            taken = set()
        numbers = [n for n in numbers_to_read(seen, count, set()) if n not in taken]
        raws = [(n, self.peek(key_of(n))) for n in numbers]
        while raws and raws[-1][1] is None:  # not written yet
            raws.pop()
        opened = [(n, None if r is None else self.open(key_of(n), r)) for n, r in raws]
        taken.update(n for n, v in opened if v is not None)
        last = raws[-1][0] if raws else (seen if count >= seen else max(count, 0))
        self._taken[counter] = (last, taken)
        return last, [(key_of(n), v) for n, v in opened if v is not None]

    # ------------------------------------------------------------------ the serving store
    def serving(self) -> ServingStore:
        """This store as the coordinator serves it (not a member's client of it)."""
        if not isinstance(self.store, ServingStore):
            raise TypeError(f"{type(self.store).__name__} is a client, not the serving store")
        return self.store


def _beat_number(payload: bytes | None) -> int:
    """A beat number in a payload of the job's (0 for none, or for one that is no number)."""
    try:
        return max(0, int(payload)) if payload is not None else 0
    except ValueError:
        return 0
