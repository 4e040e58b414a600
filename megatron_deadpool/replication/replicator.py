"""Per-iteration asynchronous replication of every rank's snapshot to its k holders.

Round t, started right after optimizer step t (`start_round`):
  (a) the rank captures its state into a local slot (pack + checksum in one pass; on a
      GPU on a side stream, which the next optimizer step waits for);
  (b) it posts non-blocking sends of that slot to its k holders and non-blocking receives
      from the owners it holds, each into a slot, on a dedicated process group;
  then training goes on: the transfers overlap the next iteration's forward/backward.
Round t is settled during step t+1, after its forward/backward and optimizer step (`settle`):
wait for the transfers (normally long done) and verify every received replica's checksum. It
is committed (`commit`) once every rank's verdict is known: the embedded job carries the
verdicts on the world all-reduce every training step makes anyway (`gpt.train_step`), so
replication adds no collective of its own to the critical path; `finish_round` does settle and
commit with one tiny all-reduce on the replication group, for callers without such a step
(restore, end of training, the Megatron-LM hooks). Every pair of slots keeps its newest
verified (for local slots: the committed) copy untouched while round t is in flight, so a
failure mid-transfer always leaves it a complete, verified copy (double buffering). A replica
that fails its checksum is not committed on any rank; the previous one stays in force.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .placement import Placement
from .snapshot import CorruptReplicaError, Header, Snapshotter, read_header, verify

log = logging.getLogger(__name__)


@dataclass
class SlotPair:
    """Two flat buffers and the iteration each holds verified (None: nothing valid)."""

    buffers: tuple[torch.Tensor, torch.Tensor]
    verified: list[int | None] = field(default_factory=lambda: [None, None])

    def free_slot(self) -> int:
        """The slot to overwrite: never the one holding the newest verified iteration."""
        latest = self.latest()
        if latest is None:
            return 0
        return 1 - next(i for i, it in enumerate(self.verified) if it == latest[0])

    def latest(self) -> tuple[int, torch.Tensor] | None:
        """(iteration, buffer) of the newest verified content."""
        best = None
        for slot, it in enumerate(self.verified):
            if it is not None and (best is None or it > best[0]):
                best = (it, self.buffers[slot])
        return best

    def find(self, iteration: int) -> torch.Tensor | None:
        """The buffer holding verified `iteration`, if any."""
        for slot, it in enumerate(self.verified):
            if it == iteration:
                return self.buffers[slot]
        return None

    def iterations(self) -> list[int]:
        return sorted(it for it in self.verified if it is not None)


def _alloc(nbytes: int, device: torch.device, pin: bool) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)


class Replicator:
    """One rank's side of the replication protocol."""

    def __init__(
        self,
        snapshotter: Snapshotter,
        placement: Placement,
        rank: int,
        group: dist.ProcessGroup,
        device: torch.device,
        pin_memory: bool = False,
    ) -> None:
        self.snap = snapshotter
        self.placement = placement
        self.rank = rank
        self.group = group
        self.device = device
        self.holders = placement.holders[rank]
        self.owners = placement.held_by[rank]
        world = placement.layout.world_size
        # Flat sizes differ per rank (shard boundaries, padding): learn them once.
        sizes = torch.zeros(world, dtype=torch.int64)
        sizes[rank] = snapshotter.flat_nbytes()
        dist.all_reduce(sizes, group=group)
        self.sizes = sizes.tolist()
        self.local = SlotPair(tuple(_alloc(self.sizes[rank], device, pin_memory) for _ in "ab"))
        self.held = {
            o: SlotPair(tuple(_alloc(self.sizes[o], device, pin_memory) for _ in "ab"))
            for o in self.owners
        }
        self._pending: list[dist.Work] = []
        self._round: int | None = None
        self._capture_event: torch.cuda.Event | None = None
        self._stream = torch.cuda.Stream() if device.type == "cuda" else None
        self.committed: int | None = None
        self.corrupt_seen: list[tuple[int, int, str]] = []  # (owner, iteration, reason)
        self._flip_on_arrival: tuple[int, int, int] | None = None
        self._held_slots: dict[int, int] = {}
        self.timings: dict[str, float] = {}  # seconds spent in the last round, by part
        self._recvs: dict[int, dist.Work] = {}
        self.bytes_per_round = sum(self.sizes[rank] for _ in self.holders)
        self._group_rank = {r: dist.get_group_rank(group, r) for r in (*self.holders, *self.owners)}

    # ------------------------------------------------------------------ round t
    def start_round(self, iteration: int) -> Header:
        """Capture state `iteration` locally and post its transfers (non-blocking)."""
        assert self._round is None, "finish_round() the previous round first"
        t0 = time.perf_counter()
        slot = self._local_slot()
        buf = self.local.buffers[slot]
        self.local.verified[slot] = None
        if self._stream is not None:  # GPU: capture on a side stream, ordered after the step
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                header = self.snap.capture(iteration, buf)
                self._capture_event = torch.cuda.Event()
                self._capture_event.record()
                self._post(iteration, slot)
        else:
            header = self.snap.capture(iteration, buf)
            self.timings["capture"] = time.perf_counter() - t0
            self._post(iteration, slot)
        self.local.verified[slot] = iteration
        self._round = iteration
        self.timings["capture_post"] = time.perf_counter() - t0
        return header

    def _slot_to_fill(self, pair: SlotPair) -> int:
        """Keep the copy of the committed iteration (else the newest): fill the other slot."""
        for slot, it in enumerate(pair.verified):
            if it is not None and it == self.committed:
                return 1 - slot
        return pair.free_slot()

    def _local_slot(self) -> int:
        return self._slot_to_fill(self.local)

    def _post(self, iteration: int, slot: int) -> None:
        buf = self.local.buffers[slot]
        self._held_slots = {o: self._slot_to_fill(self.held[o]) for o in self.owners}
        for owner, s in self._held_slots.items():
            self.held[owner].verified[s] = None  # being overwritten by round `iteration`
        # The process group's own send/recv: `dist.isend`'s Python checks cost more CPU than
        # the transfer's posting, every round.
        self._pending = [self.group.send([buf], self._group_rank[h], 0) for h in self.holders]
        self._recvs = {
            o: self.group.recv([self.held[o].buffers[s]], self._group_rank[o], 0)
            for o, s in self._held_slots.items()
        }
        self._pending += list(self._recvs.values())

    def before_step(self) -> None:
        """The next optimizer step must not overwrite the shard before the capture read it."""
        if self._capture_event is not None:
            torch.cuda.current_stream().wait_event(self._capture_event)

    def settle(self) -> bool | None:
        """Wait for the in-flight round's transfers and verify what arrived.

        Returns whether every replica this rank received verified (None: no round in
        flight). The round stays in flight until `commit`.
        """
        if self._round is None:
            return None
        iteration = self._round
        t0 = time.perf_counter()
        for work in self._pending:
            work.wait()
        self._pending = []
        t1 = time.perf_counter()
        if self._flip_on_arrival is not None:  # fault injection: damage in transit
            owner, byte, bit = self._flip_on_arrival
            self._flip_on_arrival = None
            target = self.held[owner].buffers[self._held_slots[owner]]
            target[byte % self.sizes[owner]] ^= 1 << bit
        ok = True
        for owner in self.owners:
            pair = self.held[owner]
            slot = self._held_slots[owner]
            try:
                verify(pair.buffers[slot], owner=owner, iteration=iteration)
            except CorruptReplicaError as exc:
                ok = False
                self.corrupt_seen.append((owner, iteration, str(exc)))
                log.warning("replica not committed: %s", exc)
                continue
            pair.verified[slot] = iteration
        self.timings.update(wait=t1 - t0, verify=time.perf_counter() - t1)
        return ok

    def commit(self, all_verified: bool | None) -> int | None:
        """End the settled round: committed if every rank's replicas verified (all ranks
        must pass the same verdict); returns the globally committed iteration."""
        if self._round is not None and all_verified:
            self.committed = self._round
        self._round = None
        self._recvs = {}
        return self.committed

    def finish_round(self) -> int | None:
        """Settle and commit the in-flight round, agreeing on the verdict with one all-reduce."""
        if self._round is None:
            return self.committed
        failed = torch.tensor([0 if self.settle() else 1], dtype=torch.int64)
        t0 = time.perf_counter()
        dist.all_reduce(failed, group=self.group)
        self.timings["commit"] = time.perf_counter() - t0
        return self.commit(int(failed.item()) == 0)

    def abandon(self) -> list[int]:
        """After a failure: keep what already arrived of the in-flight round, drop the rest.

        A replica whose receive completed and whose checksum verifies is as good as a
        committed one for recovery (agreement picks the newest iteration every needed party
        holds), so a failure right after a round's transfers costs no recomputation. Returns
        the owners whose replica of the round was salvaged.
        """
        salvaged: list[int] = []
        if self._round is not None:
            for owner, work in self._recvs.items():
                slot = self._held_slots[owner]
                try:  # bytes that arrived before the owner died complete the receive
                    work.wait(timeout=datetime.timedelta(seconds=0.5))
                except RuntimeError:
                    continue
                try:
                    verify(self.held[owner].buffers[slot], owner=owner, iteration=self._round)
                except CorruptReplicaError:
                    continue
                self.held[owner].verified[slot] = self._round
                salvaged.append(owner)
        self._pending = []
        self._recvs = {}
        self._round = None
        return salvaged

    def drain(self) -> None:
        """Finish an in-flight round (end of training)."""
        self.finish_round()

    # ------------------------------------------------------------------ recovery support
    def verified_copy(self, owner: int, iteration: int) -> torch.Tensor | None:
        """The verified flat snapshot of `owner` (this rank: its local one) of `iteration`."""
        pair = self.local if owner == self.rank else self.held.get(owner)
        return pair.find(iteration) if pair is not None else None

    def holdings(self) -> dict[str, list[int]]:
        """Verified iterations this rank can provide: its own ('local') and each held owner's.

        Every copy is checked against its checksum again first: memory corrupted at rest is
        dropped here, before agreement could pick it (agreement then falls back to another
        copy, or reports the shard lost).
        """
        pairs = {"local": (self.rank, self.local)}
        pairs.update({str(o): (o, pair) for o, pair in self.held.items()})
        out: dict[str, list[int]] = {}
        for key, (owner, pair) in pairs.items():
            for slot, it in enumerate(pair.verified):
                if it is None:
                    continue
                try:
                    verify(pair.buffers[slot], owner=owner, iteration=it)
                except CorruptReplicaError as exc:
                    pair.verified[slot] = None
                    self.corrupt_seen.append((owner, it, str(exc)))
                    log.error("dropping a corrupt copy before recovery: %s", exc)
            out[key] = pair.iterations()
        return out

    def flip_bit_on_arrival(self, owner: int, byte: int, bit: int) -> None:
        """Fault injection: flip one bit of `owner`'s next replica before it is verified."""
        self._flip_on_arrival = (owner, byte, bit)

    def flip_bits_at_rest(self) -> None:
        """Fault injection: flip one bit in every verified replica this rank holds."""
        for owner, pair in self.held.items():
            for slot, it in enumerate(pair.verified):
                if it is not None:
                    pair.buffers[slot][97] ^= 1 << 3
                    log.warning("fault injection: flipped a bit of rank %d's replica %d", owner, it)

    def flip_bit_at_rest(self, owner: int, byte: int, bit: int) -> None:
        """Fault injection: flip one bit of the newest verified replica held for `owner`."""
        latest = self.held[owner].latest()
        target = latest[1] if latest else self.held[owner].buffers[0]
        header = read_header(target)
        target[byte % (header.nbytes if header else target.numel())] ^= 1 << bit
