"""Recovery inside Megatron-LM's training step: release, agree, join, attach, restore.

The survivor side (`_recover`) and the newcomer side (`_join_as_newcomer`) of a hot swap for
`MegatronSession` (kept apart from the session's normal-operation half). The protocol is the
embedded runtime's (`runtime.Runtime`): every group handle the model, DDP buffers, optimizer
and replicator hold is swapped for a named placeholder and the groups destroyed
(`rebind.release`); survivors report what they hold and the step they must return to
Megatron; the coordinator fixes the restore iteration T and the replica sources; everyone
creates generation g's default group on `gen{g}`, repeats Megatron's exact
`initialize_model_parallel` call and creates the replication group; `rebind.attach` puts the
new groups in the placeholders; needy ranks receive their shard of T from its holder
(verified by checksum), the others roll back to their local snapshot of T; weights are
re-derived from the main params, replication restarts with a round of T, Megatron's rerun
state machine and the data iterator are set back to T. The protocol's communication is shared
with the embedded runtime (`recovery.py`).

Out of redundancy (no spare left, or a shard with no surviving copy) the coordinator aborts:
survivors write DeadPool's snapshot set of one common iteration under Megatron's `--save`
directory (`recovery.salvage`; Megatron's sample and FLOP counters of that iteration go into
its manifest) and the process exits with code 3. Megatron's own `save_checkpoint` cannot run
then: it is collective over the full world (its distributed-optimizer state is written by
every data-parallel rank, its metadata gathered across all ranks), and the dead ranks are gone.
A complete set is turned into a Megatron checkpoint by the next launch of the same command with
`--load` (`megatron_lm_resume`), where a full world exists again.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

import torch.distributed as dist

from ..devices import nccl
from ..errors import DeadpoolRuntimeError
from ..hotswap import rebind, recovery
from ..hotswap.membership import Roster
from ..logs import set_context
from ..replication.snapshot import RankState
from . import newcomer
from .replay import reset_rerun_iterators
from .report import dump_log_state

log = logging.getLogger("megatron_deadpool.megatron_lm")


class Recovery:
    """The recovery methods of `MegatronSession` (which provides the state they use)."""

    def _recover(self, exc: BaseException, target: int) -> None:
        """Survivor side: abort, agree, rebuild groups in place, restore, ready to recompute."""
        t0 = time.time()
        log.warning(
            "collective failed (%s): entering recovery for step %d",
            str(exc).splitlines()[0][:160],
            target,
        )
        traceback.clear_frames(exc.__traceback__)
        group, self.repl_group = self.repl_group, None  # no reference may outlive the release
        released = recovery.release_groups(self.replicator, self._roots(), group)
        self.fail_in_recovery()
        t_released = time.time()
        roster = self._agree(exc, t0, target)
        t_agreed = time.time()
        self._join(roster)
        self._attach()
        t_joined = time.time()
        log.info("released %d group handles, re-attached the new generation's", released)
        self._check_targets(roster, target)
        self._restore(roster, needy=False)
        self._record(
            roster,
            target,
            t0,
            {
                "release": t_released - t0,
                "agree": t_agreed - t_released,
                "join": t_joined - t_agreed,
                "restore": time.time() - t_joined,
            },
        )

    def _agree(self, exc: BaseException, t0: float, target: int) -> Roster:
        """Report holdings (and Megatron's counters) until a roster includes this process."""
        from megatron.training import get_args

        a = get_args()
        flags = [bool(getattr(a, name, False)) for name in ("do_train", "do_valid", "do_test")]
        return recovery.agree(
            self.members,
            generation=self.generation,
            rank=self.rank,
            pid=self.pid,
            replicator=self.replicator,
            report={
                "last_completed": self.last_completed,
                "target": target,
                "counters": {str(k): v for k, v in self.counters.items()},
                "flags": flags,
                "log_state": dump_log_state(self.total_loss_dict),
            },
            deadline=t0 + self.cfg.heartbeat_timeout + 30.0,
            cause=exc,
            on_abort=self._salvage,
        )

    def _salvage(self, report: dict[str, Any]) -> str:
        """Out of redundancy: this survivor's part of the snapshot set (under `--save`)."""
        from megatron.training import get_args

        save = report.get("save") or {}
        counters = self.counters.get(save.get("iteration", -1))
        return recovery.salvage(
            self.members,
            self.replicator,
            root=get_args().save,
            report=report,
            rank=self.rank,
            world_size=self.roster.world_size,
            extra={"megatron": counters} if counters is not None else None,
            resume_hint="run the same command with --load to resume",
        )

    def _check_targets(self, roster: Roster, target: int) -> None:
        targets = {r["target"] for r in self._survivor_reports(roster).values()}
        if targets != {target}:
            raise DeadpoolRuntimeError(
                f"survivors stopped at different steps {sorted(targets)}: they cannot resume "
                "together (a failure between the commit and the end of a step)"
            )

    def _join(self, roster: Roster) -> None:
        """Create generation g's default group, Megatron's groups (same call as at start-up)
        and the replication group."""
        self.roster = roster
        self.generation = roster.generation
        self.rank = roster.rank_of(self.pid)
        set_context(rank=self.rank, generation=self.generation)
        dist.init_process_group(
            backend=self.pg_kwargs["backend"],
            store=dist.PrefixStore(f"gen{self.generation}", self.members.store),
            rank=self.rank,
            world_size=roster.world_size,
            timeout=self.pg_kwargs["timeout"],
            **nccl.init_kwargs(self.pg_kwargs["backend"], self._device().index),
        )
        real, args, kwargs = self.mp_call
        real(*args, **kwargs)
        self.repl_group = self._new_repl_group()
        log.info(
            "joined generation %d as rank %d of %d", self.generation, self.rank, roster.world_size
        )

    def _attach(self) -> None:
        n = rebind.attach(self._roots(), {"DEADPOOL_REPLICATION": self.repl_group})
        stale = rebind.stale_group_refs(self._roots())
        self.members.store.set(f"gen{self.generation}/stale_refs/{self.rank}", str(len(stale)))
        if stale:
            raise DeadpoolRuntimeError(
                f"objects still reference groups of an old generation: {stale[:3]}"
            )
        log.info("rebound %d process-group references", n)

    def _join_as_newcomer(self, n: int) -> None:
        """First step of a newcomer: leave the private world, join, receive the shard."""
        plan = self.newcomer
        self.newcomer = None  # a failure from here on is recovered like a survivor's
        t0 = time.time()
        if n != plan.target:
            raise DeadpoolRuntimeError(
                f"newcomer reached step {n}, the survivors resume at step {plan.target}"
            )
        rebind.release(self._roots())
        newcomer.leave()
        self._join(plan.roster)
        self._attach()
        t_joined = time.time()
        self._restore(plan.roster, needy=True)
        self._log_state_to_load = plan.log_state
        self._record(plan.roster, n, t0, {"join": t_joined - t0, "restore": time.time() - t_joined})

    def _restore(self, roster: Roster, *, needy: bool) -> None:
        """Bring this rank to the restore iteration T (see `runtime.Runtime._restore`), then
        re-derive the weights, restart replication and rewind the data to T."""
        from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

        model, optimizer, scheduler, _ = self.objs
        t_iter = roster.restore_iteration
        from_holder = recovery.exchange_shards(
            self.members,
            roster,
            rank=self.rank,
            state=RankState(optimizer, scheduler),
            replicator=self.replicator,
            group=self.repl_group,
            needy=needy,
        )
        _reset_ddp(model)
        sync_params_from_main(model, optimizer)
        self.replicator = self._make_replicator()
        self.replicator.start_round(t_iter)
        self.committed = self.replicator.finish_round()
        rsm = get_rerun_state_machine()
        rsm.state = RerunState.NOT_RUNNING_YET
        rsm.current_iteration = t_iter
        reset_rerun_iterators(self.data_iterator)
        if not needy:
            for rec in self.recorders:
                rec.rewind_to(t_iter)
        self._stamp("restored")
        self.next_step = t_iter + 1
        self.resumed_at = t_iter + 1
        self.last_completed = t_iter
        log.info(
            "restored iteration %d (%s)",
            t_iter,
            "from holder" if from_holder else "from local snapshot",
        )

    def _record(self, roster: Roster, target: int, t0: float, phases: dict[str, float]) -> None:
        plan = self.members.read(f"gen{roster.generation}/plan") or {}
        record = {
            "generation": roster.generation,
            "dead": plan.get("dead", []),
            "restore_iteration": roster.restore_iteration,
            "recomputed": max(0, target - 1 - roster.restore_iteration),
            "total_s": time.time() - t0,
            "phases_s": phases,
        }
        self.recoveries.append(record)
        self.unreported.append(record)


def _reset_ddp(model: list[Any]) -> None:
    """Forget in-flight communication handles a failed step left in DDP's bucket groups."""
    for chunk in model:
        for bg in [
            *getattr(chunk, "bucket_groups", []),
            *getattr(chunk, "expert_parallel_bucket_groups", []),
        ]:
            for name in ("grad_reduce_handle", "param_gather_handle"):
                if hasattr(bg, name):
                    setattr(bg, name, None)
            if hasattr(bg, "param_gather_dispatched"):
                bg.param_gather_dispatched = False


def sync_params_from_main(model: list[Any], optimizer: Any) -> None:
    """Model weights from the (restored) main params: copy, then the distributed optimizer's
    param all-gather over data-parallel peers."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in chained:
        if hasattr(opt, "_copy_main_params_to_model_params"):
            opt._copy_main_params_to_model_params()
    for chunk in model:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and ddp_config.use_distributed_optimizer:
            chunk.start_param_sync(force_sync=True)
