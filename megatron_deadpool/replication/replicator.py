"""Per-iteration asynchronous replication of every rank's snapshot to its k holders.

Round t, started right after optimizer step t (`start_round`):
  (a) the rank captures its state into a local slot (pack + checksum in one pass; on a GPU
      on a side stream, without the host waiting: the next optimizer step waits for it
      through `before_step`, see `guard_optimizer_step`; the model buffers, which the next
      forward pass may write, are copied on the training's stream before `start_round`
      returns, `buffer_stage`);
  (b) it posts the round's transfers - sends of that slot to its k holders, receives from the
      owners it holds, each into a slot - as one batch on the replication group
      (`devices.p2p.post`); replicas in pinned host memory are sent once the capture's
      device-to-host copy has landed (a helper thread waits on its event, the host does not);
  then training goes on: the transfers overlap the next iteration's forward/backward.
Round t is settled during step t+1, after its forward/backward and optimizer step (`settle`):
wait for the transfers (normally long done) and verify every received replica's checksum -
for replicas in host memory on a worker thread that starts as soon as they are posted
(`verifier.RoundCheck`), so the host checksum of GiBs stays off the main thread. It is
committed (`commit`) once every rank's verdict is known: the embedded job carries the
verdicts on the world all-reduce every training step makes anyway (`gpt.train_step`), so
replication adds no collective of its own to the critical path; `finish_round` does settle and
commit with one tiny all-reduce on the replication group, for callers without such a step
(restore, end of training, the Megatron-LM hooks) - on CUDA (`verdict_ahead`) posted
asynchronously before step t+1's optimizer step and read after it (`verdict.AheadVerdict`).
Every pair of slots keeps its newest
verified (for local slots: the committed) copy untouched while round t is in flight, so a
failure mid-transfer always leaves it a complete, verified copy (double buffering). A replica
that fails its checksum is not committed on any rank; the previous one stays in force.

After a failure the groups are aborted first (`devices.abort_groups`), then `abandon` keeps
the receives of the in-flight round that completed and verify, never waiting on one.

Memory: where the buffers live is agreed at construction (`devices.memory`: GPU memory when
it fits under ``auto``, else pinned host memory, the same on every rank; a rank with buffers
already votes where they are and a newcomer adopts that, so the first choice holds across
recoveries), and a replicator
built after a recovery takes over its predecessor's buffers (`previous`) instead of
allocating a second set next to them (`slots.Pool`). Replicas in host memory next to a GPU
travel on `host_group` (gloo, the data-parallel peers: `devices.groups`), everything else on
`group`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..devices import p2p
from ..devices.failures import is_peer_failure
from ..devices.groups import check_takes, tensor_device
from ..devices.memory import Choice, ReplicaMemory, ReplicaMemoryError, Tally
from ..devices.p2p import Transfer, arrived, post
from ..devices.streams import own_stream
from ..devices.threads import pool as threads_pool
from .daemon_worker import DaemonWorker
from .placement import Placement
from .segments import slot_paths
from .slots import Pool, SlotPair, gpu_bytes
from .snapshot import CorruptReplicaError, Snapshotter, read_header, verify
from .verdict import AheadVerdict
from .verifier import Findings, RoundCheck

log = logging.getLogger(__name__)


class StepGuard:
    """Called by a guarded `optimizer.step()` first: the current replicator's `before_step`."""

    def __init__(self) -> None:
        self.replicator: Replicator | None = None

    def __call__(self) -> None:
        if self.replicator is not None:
            self.replicator.before_step()


def guard_optimizer_step(optimizer: Any) -> StepGuard:
    """Make `optimizer.step()` call the returned guard first (once per optimizer object).

    Megatron-LM's `train_step` calls `optimizer.step()` itself, and that step must not
    overwrite the shard before the capture of the previous round read it; a GPU replicator
    points the guard at itself when it is built, so both jobs get the wait without calling
    `before_step` themselves.
    """
    guard = getattr(optimizer, "_deadpool_step_guard", None)
    if guard is None:
        guard = StepGuard()
        real = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            guard()
            return real(*args, **kwargs)

        optimizer.step = step
        optimizer._deadpool_step_guard = guard
    return guard


class Replicator:
    """One rank's side of the replication protocol."""

    def __init__(
        self,
        snapshotter: Snapshotter,
        placement: Placement,
        rank: int,
        group: dist.ProcessGroup,
        memory: ReplicaMemory,
        previous: Replicator | None = None,
        host_group: dist.ProcessGroup | None = None,
    ) -> None:
        """`group`: the world-wide replication group; `host_group`: where replicas in host
        memory travel when that is another group (CUDA: the data-parallel peers' gloo group);
        `previous`: the replicator this one succeeds (its buffers are taken over)."""
        self.snap = snapshotter
        self.placement = placement
        self.rank = rank
        self.group = group
        self.holders = placement.holders[rank]
        self.owners = placement.held_by[rank]
        world = placement.layout.world_size
        # Flat sizes differ per rank (shard boundaries, padding): learn them once, together
        # with every rank's memory choice (the same for all: what survivors hold, else host
        # memory if any rank needs it; `devices.memory.Tally`).
        own = snapshotter.flat_nbytes()
        need = 2 * own * (1 + len(self.owners))  # held shards: DP peers', of the same size
        kept = previous.buffers() if previous is not None else []
        # Host replicas of GPU state still stage each capture through a GPU buffer of the
        # snapshot's size (`Snapshotter.capture`): counted where free memory decides.
        staging = {"staging": own} if snapshotter.device.type == "cuda" else {}
        short: ReplicaMemoryError | None = None
        try:
            vote = memory.local_choice(
                need,
                previous=previous.choice if previous is not None else None,
                reusable=gpu_bytes(kept),
                **staging,
            )
        except ReplicaMemoryError as exc:  # raised below on every rank, after the exchange
            vote, short = "host", exc
        tally = Tally.of(vote, held=previous is not None, short=short is not None)
        exchange = torch.zeros(world + 4, dtype=torch.int64, device=tensor_device(group))
        exchange[rank] = own
        exchange[world:] = torch.tensor(tally.counts(), dtype=torch.int64)
        dist.all_reduce(exchange, group=group)
        values = exchange.tolist()
        self.sizes = values[:world]
        agreed = Tally.from_counts(values[world:])
        self.choice: Choice = agreed.choice()  # a newcomer adopts what survivors hold
        if self.choice == "host" and agreed.short:
            raise short or ReplicaMemoryError(
                f"deadpool-replica-device auto: on {agreed.short} rank(s) neither GPU replicas "
                "nor the GPU staging buffer of host replicas fit in free GPU memory (their error "
                "names the figures): give each rank a smaller shard or free GPU memory"
            )
        self.device = memory.torch_device(self.choice)
        self.pinned = memory.pinned(self.choice)
        on_host = self.device.type == "cpu"
        self.transfer_group = host_group if on_host and host_group is not None else group
        check_takes(self.transfer_group, self.device)
        mapped = dict(previous.files) if previous is not None else {}
        if previous is not None:
            previous.retire()  # its other buffers are freed before anything new is allocated
        pool = Pool(kept, self.device, self.pinned, mapped)
        if on_host and snapshotter.device.type == "cuda":
            snapshotter.reserve_staging()  # out of memory here, not at the first capture
        del kept, mapped
        where = memory.segments if on_host else None  # GPU replicas die with the process
        paths = {
            o: slot_paths(where, rank, o, self.sizes[o])
            for o in (rank, *self.owners)
            if where is not None
        }
        self.local = pool.pair(self.sizes[rank], paths.get(rank))
        self.held = {o: pool.pair(self.sizes[o], paths.get(o)) for o in self.owners}
        del pool
        self.files: dict[Path, torch.Tensor] = {
            path: buf
            for owner, pair in [(rank, self.local), *self.held.items()]
            for path, buf in zip(paths.get(owner, ()), pair.buffers)
        }
        """The buffers that map segment files (`segments.py`), by file: a successor keeps them."""
        on_gpu = snapshotter.device.type == "cuda"
        self._stream = own_stream(snapshotter.device) if on_gpu else None  # not torch's pool
        # Host replicas of GPU state are sent after the capture's copy lands: a thread waits.
        self._poster = DaemonWorker("deadpool-post") if on_gpu and self.pinned else None
        if on_gpu:
            guard_optimizer_step(snapshotter.state.optimizer).replicator = self
        self._round: int | None = None
        self._capture: tuple[torch.cuda.Event, int] | None = None  # (event, local slot)
        self._works: list[dist.Work] | Future[list[dist.Work]] = []
        self._recv_of: dict[int, int] = {}  # owner -> index of its receive in the round
        self._held_slots: dict[int, int] = {}
        self.committed: int | None = None
        self.corrupt_seen: list[tuple[int, int, str]] = []  # (owner, iteration, reason)
        self._flip_on_arrival: tuple[int, int, int] | None = None
        # Replicas in host memory are verified on a worker thread (`verifier`).
        self._check = RoundCheck() if on_host else None
        self._findings: Future[Findings] | None = None
        self.verdict_ahead = False  # agree on verdicts before the next step (`verdict`)
        self._verdict = AheadVerdict(group)
        self.timings: dict[str, float] = {}  # seconds spent in the last round, by part
        self.bytes_per_round = sum(self.sizes[rank] for _ in self.holders)
        log.info(
            "replicas in %s memory: %d B own snapshot x2, %d held replicas x2",
            "GPU" if self.choice == "gpu" else ("pinned host" if self.pinned else "host"),
            own,
            len(self.owners),
        )

    # ------------------------------------------------------------------ round t
    def start_round(self, iteration: int) -> None:
        """Capture state `iteration` locally and post its transfers (non-blocking)."""
        assert self._round is None, "finish_round() the previous round first"
        t0 = time.perf_counter()
        slot = self._slot_to_fill(self.local)
        buf = self.local.buffers[slot]
        self.local.verified[slot] = None
        self._held_slots = {o: self._slot_to_fill(self.held[o]) for o in self.owners}
        for owner, s in self._held_slots.items():
            self.held[owner].verified[s] = None  # being overwritten by round `iteration`
        transfers = [Transfer("send", buf, h) for h in self.holders]
        self._recv_of = {}
        for owner, s in self._held_slots.items():
            self._recv_of[owner] = len(transfers)
            transfers.append(Transfer("recv", self.held[owner].buffers[s], owner))
        if self._stream is None:
            self.snap.capture(iteration, buf)
            self.local.verified[slot] = iteration
            self.timings["capture"] = time.perf_counter() - t0
            self._works = self._post_now(transfers)
        else:  # GPU: capture on a side stream ordered after the step; the host does not wait
            # The model buffers are staged on the current stream first, so the next forward
            # pass cannot overwrite them under the capture (`Snapshotter.capture`).
            self.snap.capture(iteration, buf, stream=self._stream)
            with torch.cuda.stream(self._stream):
                event = torch.cuda.Event()
                event.record()
                self._capture = (event, slot)
                if self._poster is None:  # GPU replicas: NCCL's stream waits for the capture
                    self._works = self._post_now(transfers)
                else:
                    self._works = self._poster.submit(self._post_after, event, transfers)
        self._round = iteration
        if self._check is not None:  # host replicas: waited for and verified off this thread
            receives = {o: (i, transfers[i].tensor) for o, i in self._recv_of.items()}
            works = self._works
            self._findings = self._check.start(
                lambda: works.result() if isinstance(works, Future) else works,
                receives,
                iteration,
            )
        self.timings["capture_post"] = time.perf_counter() - t0

    def _post_now(self, transfers: list[Transfer]) -> list[dist.Work] | Future[list[dist.Work]]:
        """Post the round's transfers on this thread. A peer seen lost already makes gloo
        raise as it posts: that failure is kept for where the round is waited for (`settle`,
        `abandon`), like any transfer's, so that this rank fails where its peers do, not one
        step before them (Megatron-LM's survivors must agree on the step they resume at)."""
        try:
            return post(transfers, self.transfer_group)
        except Exception as exc:
            if not is_peer_failure(exc):
                raise
            failed: Future[list[dist.Work]] = Future()
            failed.set_exception(exc)
            return failed

    def _post_after(self, event: torch.cuda.Event, transfers: list[Transfer]) -> list[dist.Work]:
        event.synchronize()  # the device-to-host copy into pinned memory has landed
        return post(transfers, self.transfer_group)

    def _slot_to_fill(self, pair: SlotPair) -> int:
        """Keep the copy of the committed iteration (else the newest): fill the other slot."""
        for slot, it in enumerate(pair.verified):
            if it is not None and it == self.committed:
                return 1 - slot
        return pair.free_slot()

    def before_step(self) -> None:
        """Called first by the next optimizer step (`guard_optimizer_step`). That step must not
        overwrite the shard before the capture read it: the current stream waits for the
        capture's event (no host synchronisation). With `verdict_ahead` the round in flight
        is settled here and its verdict posted, to be read after the step (`finish_round`)."""
        if self._capture is not None:
            torch.cuda.current_stream(self.snap.device).wait_event(self._capture[0])
        if self.verdict_ahead and self._round is not None and not self._verdict.pending:
            ok = self.settle()
            self._verdict.post(bool(ok), self._stream)

    def _capture_done(self) -> None:
        """Mark the local slot of a GPU capture verified once its event passed (a local copy:
        waiting on it never waits on a peer)."""
        if self._capture is not None:
            event, slot = self._capture
            event.synchronize()
            self.local.verified[slot] = self._round
            self._capture = None

    def _round_works(self, timeout: float | None = None) -> list[dist.Work]:
        works = self._works
        return works.result(timeout) if isinstance(works, Future) else works

    def settle(self) -> bool | None:
        """Wait for the in-flight round's transfers and verify what arrived.

        Returns whether every replica this rank received verified (None: no round in
        flight). The round stays in flight until `commit`.
        """
        if self._round is None:
            return None
        iteration = self._round
        t0 = time.perf_counter()
        self._capture_done()
        if self._findings is not None:  # host replicas: the worker thread waited and verified
            findings = self._findings.result()  # a failed post raises here
            t1 = time.perf_counter()
            if findings.errors:  # the round stays in flight: `abandon` reads these findings
                raise findings.errors[0]
            self._findings = None
            flipped = self._flip_in_transit()
            verdicts = [
                (
                    self._verify_received(owner, iteration)
                    if owner == flipped
                    else self._take_finding(findings, owner, iteration)
                )
                for owner in self.owners
            ]
            self.timings.update(wait=t1 - t0, verify=time.perf_counter() - t1)
            self.timings.update({f"thread_{k}": v for k, v in findings.seconds.items()})
            return all(verdicts)
        works = self._round_works()
        with self._on_side_stream():  # GPU replicas: only the side stream waits for NCCL
            for work in {id(w): w for w in works}.values():
                work.wait()
            t1 = time.perf_counter()
            self._flip_in_transit()
            verdicts = [self._verify_received(owner, iteration) for owner in self.owners]
            ok = all(verdicts)  # every replica verified (and marked), no short cut
        self.timings.update(wait=t1 - t0, verify=time.perf_counter() - t1)
        return ok

    def wait_in_flight(self, timeout_s: float) -> bool:
        """From another thread: wait up to `timeout_s` until the in-flight round's transfers
        ended - arrived or failed - and (host replicas) the worker thread verified them; whether
        they did (True too with no round in flight). It changes nothing: `settle` or `abandon`
        still takes the round on the main thread. An abort that waits for this first does not
        cut off a replica still arriving, which `abandon` would then not keep."""
        deadline = time.monotonic() + timeout_s
        findings, works = self._findings, self._works
        if findings is not None:
            try:
                findings.exception(timeout=timeout_s)
            except FutureTimeout:
                return False
            return True
        if isinstance(works, Future):
            try:
                works = works.result(timeout=timeout_s)
            except FutureTimeout:
                return False
            except Exception:  # noqa: BLE001 - posting failed: nothing is in flight
                return True
        for work in works:
            while not work.is_completed():
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.001)
        return True

    def _flip_in_transit(self) -> int | None:
        """Fault injection: damage the replica of the owner `flip_bit_on_arrival` named
        before it is verified; returns that owner."""
        if self._flip_on_arrival is None:
            return None
        owner, byte, bit = self._flip_on_arrival
        self._flip_on_arrival = None
        target = self.held[owner].buffers[self._held_slots[owner]]
        target[byte % self.sizes[owner]] ^= 1 << bit
        return owner

    def _take_finding(self, findings: Findings, owner: int, iteration: int) -> bool:
        """The worker thread's verdict on `owner`'s replica, marked as `_verify_received`
        would mark it."""
        reason = findings.corrupt.get(owner)
        if reason is not None:
            self.corrupt_seen.append((owner, iteration, reason))
            log.warning("replica not committed: %s", reason)
            return False
        self.held[owner].verified[self._held_slots[owner]] = iteration
        return True

    def _verify_received(self, owner: int, iteration: int) -> bool:
        pair, slot = self.held[owner], self._held_slots[owner]
        try:
            verify(pair.buffers[slot], owner=owner, iteration=iteration)
        except CorruptReplicaError as exc:
            self.corrupt_seen.append((owner, iteration, str(exc)))
            log.warning("replica not committed: %s", exc)
            return False
        pair.verified[slot] = iteration
        return True

    def _on_side_stream(self) -> Any:
        if self._stream is None or self._poster is not None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def commit(self, all_verified: bool | None) -> int | None:
        """End the settled round: committed if every rank's replicas verified (all ranks
        must pass the same verdict); returns the globally committed iteration."""
        if self._round is not None and all_verified:
            self.committed = self._round
        self._round = None
        self._works = []
        return self.committed

    def finish_round(self) -> int | None:
        """Settle and commit the in-flight round, agreeing on the verdict with one all-reduce
        (read now when `before_step` posted it already)."""
        if self._round is None:
            return self.committed
        if self._verdict.pending:
            t0 = time.perf_counter()
            agreed = self._verdict.read()
            self.timings["commit"] = time.perf_counter() - t0
            return self.commit(agreed)
        ok = self.settle()
        failed = torch.tensor([0 if ok else 1], dtype=torch.int64, device=tensor_device(self.group))
        t0 = time.perf_counter()
        dist.all_reduce(failed, group=self.group)
        self.timings["commit"] = time.perf_counter() - t0
        return self.commit(int(failed.item()) == 0)

    def abandon(self) -> list[int]:
        """After a failure, once the groups are aborted (`devices.abort_groups`): keep what
        already arrived of the in-flight round, drop the rest.

        Only receives that arrived are read (`devices.p2p.arrived`: `Work.is_completed()` on
        NCCL; on gloo a `wait()` that the aborted connections make return at once), and every
        one is verified by its checksum: after an NCCL abort a receive can report completion
        with partial bytes. Nothing here waits on a peer. A replica that verifies is as good
        as a committed one for recovery (agreement picks the newest iteration every needed
        party holds), so a failure right after a round's transfers costs no recomputation.
        Returns the owners whose replica of the round was kept.
        """
        kept: list[int] = []
        self._verdict.drop()  # a verdict in flight belongs to the aborted group
        if self._round is not None:
            self._capture_done()
            if self._findings is not None:
                kept = self._keep_found(self._findings)
            else:
                try:
                    works = self._round_works(timeout=5.0)
                except Exception as exc:  # noqa: BLE001 - posting failed on the broken group
                    log.info("the in-flight round was not posted (%s)", str(exc).splitlines()[0])
                    works = []
                received = {owner: works[i] for owner, i in self._recv_of.items() if works}
                for owner, work in received.items():
                    buf = self.held[owner].buffers[self._held_slots[owner]]
                    if arrived(work, self.transfer_group, buf.device) and self._keep(owner):
                        kept.append(owner)
        self._findings = None
        self._works = []
        self._recv_of = {}
        self._round = None
        return kept

    def _keep_found(self, findings: Future[Findings]) -> list[int]:
        """abandon, host replicas: the worker thread's findings once the abort made its waits
        return (bounded as `devices.p2p.arrived` bounds a wait)."""
        try:
            found = findings.result(timeout=p2p.GLOO_SETTLE_S + 4.0)
        except FutureTimeout:
            log.info("the in-flight round's transfers did not settle: nothing kept")
            return []
        except Exception as exc:  # noqa: BLE001 - posting failed on the broken group
            log.info("the in-flight round was not posted (%s)", str(exc).splitlines()[0])
            return []
        kept = []
        for owner in self.owners:
            if found.verified(owner):
                self.held[owner].verified[self._held_slots[owner]] = self._round
                kept.append(owner)
            elif owner in found.corrupt:
                log.info("in-flight replica of rank %d dropped: %s", owner, found.corrupt[owner])
        return kept

    def _keep(self, owner: int) -> bool:
        slot = self._held_slots[owner]
        try:
            verify(self.held[owner].buffers[slot], owner=owner, iteration=self._round)
        except CorruptReplicaError as exc:
            log.info("in-flight replica of rank %d dropped: %s", owner, exc)
            return False
        self.held[owner].verified[slot] = self._round
        return True

    def drain(self) -> None:
        """Finish an in-flight round (end of training)."""
        self.finish_round()

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer this replicator holds (what a successor may take over)."""
        return [buf for pair in (self.local, *self.held.values()) for buf in pair.buffers]

    def retire(self) -> None:
        """Give up every buffer (a successor took the ones it reuses)."""
        if self._poster is not None:
            self._poster.shutdown()
        if self._check is not None:
            self._check.shutdown()
        self._verdict.drop()
        self._findings = None
        self.local = SlotPair((torch.empty(0, dtype=torch.uint8),) * 2)
        self.held = {}
        self.files = {}
        self._works = []

    # ------------------------------------------------------------------ recovery support
    def verified_copy(self, owner: int, iteration: int) -> torch.Tensor | None:
        """The verified flat snapshot of `owner` (this rank: its local one) of `iteration`."""
        self._capture_done()
        pair = self.local if owner == self.rank else self.held.get(owner)
        return pair.find(iteration) if pair is not None else None

    def holdings(self) -> dict[str, list[int]]:
        """Verified iterations this rank can provide: its own ('local') and each held owner's.

        Every copy is checked against its checksum again first: memory corrupted at rest is
        dropped here, before agreement could pick it (agreement then falls back to another
        copy, or reports the shard lost).
        """
        self._capture_done()
        pairs = {"local": (self.rank, self.local)}
        pairs.update({str(o): (o, pair) for o, pair in self.held.items()})
        copies = [
            (owner, pair, slot, it)
            for owner, pair in pairs.values()
            for slot, it in enumerate(pair.verified)
            if it is not None
        ]
        for (owner, pair, slot, it), error in zip(copies, self._verify_copies(copies)):
            if error is not None:
                pair.verified[slot] = None
                self.corrupt_seen.append((owner, it, error))
                log.error("dropping a corrupt copy before recovery: %s", error)
        return {key: pair.iterations() for key, (_, pair) in pairs.items()}

    def _verify_copies(self, copies: list[tuple[int, SlotPair, int, int]]) -> list[str | None]:
        """Why each copy fails `verify` (None: it verifies). Copies in host memory are checked
        concurrently, one thread each, each on one core (`pack.checksum`'s ``one_core``)."""
        threads = self.device.type == "cpu" and len(copies) > 1

        def one(copy: tuple[int, SlotPair, int, int]) -> str | None:
            owner, pair, slot, it = copy
            try:
                verify(pair.buffers[slot], owner=owner, iteration=it, one_core=threads)
            except CorruptReplicaError as exc:
                return str(exc)
            return None

        if not threads:
            return [one(c) for c in copies]
        with threads_pool(min(len(copies), 8), "deadpool-holdings") as pool:
            return list(pool.map(one, copies))

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
