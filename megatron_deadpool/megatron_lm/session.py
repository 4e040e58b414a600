"""DeadPool inside one Megatron-LM process: its place in the job, replication, recovery.

The `MegatronSession` is the Megatron-LM twin of `runtime.Runtime`, driven by Megatron's own
training loop through the hooks in `megatron_lm_hooks`:

- `begin()` (before `pretrain()`): connect to the coordinator, heartbeat, and - for a spare -
  wait for a slot. A spare that gets one becomes a *newcomer*: it runs Megatron's start-up in a
  private world (`megatron_lm_newcomer`) positioned at the agreed iteration.
- `train_step(...)` wraps Megatron's `train_step`: after each optimizer step the `Replicator`
  finishes the previous round and starts this one. When a collective fails, survivors
  recover *inside* the call - release every group handle, agree on the restore iteration T
  through the coordinator, join the next generation, re-attach the new groups, roll back to
  (or receive) the snapshot of T - then recompute the steps after T (the data iterator
  replays their batches) and return the step Megatron asked for. Megatron's loop never
  notices: survivors never re-run `pretrain()`.
- Failures seen between steps (in `training_log`, evaluation) are deferred to the next step,
  so that every survivor resumes at the same step.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from ..config import faults
from ..config.deadpool import DeadpoolConfig
from ..devices import nccl
from ..devices.base import Device
from ..devices.groups import replication_backend
from ..devices.memory import ReplicaMemory
from ..errors import ConfigError, DeadpoolRuntimeError
from ..hotswap.connection import Heartbeat, connect_store
from ..hotswap.injection import inject
from ..hotswap.membership import Membership, Roster
from ..logs import set_context
from ..replication.placement import Layout, Placement, place_replicas
from ..replication.replicator import Replicator
from ..replication.snapshot import RankState, Snapshotter
from . import newcomer, report
from .recovery import Recovery
from .replay import BatchRecorder, install_recorder

log = logging.getLogger("megatron_deadpool.megatron_lm")


@dataclass(frozen=True)
class Identity:
    """Who this process is: its task index, actives first (ranks 0..world-1), then spares."""

    task: int
    world: int

    @property
    def pid(self) -> str:
        return f"a{self.task}" if self.task < self.world else f"s{self.task - self.world}"


def task_from_env() -> int:
    """This process's task index: RANK (torchrun, `deadpool megatron-lm`, the Slurm script)
    or SLURM_PROCID. Tasks at or beyond the coordinator's world size are spares."""
    text = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    if not text.isdigit():
        raise ConfigError(f"RANK: expected a task index (0, 1, ...), got {text!r}")
    return int(text)


@dataclass
class NewcomerPlan:
    """What a spare taking a slot must know before Megatron's start-up."""

    roster: Roster
    target: int  # the step every survivor is about to return to Megatron
    counters: dict[str, dict[str, float]]  # step -> Megatron's sample/FLOP counters after it
    flags: tuple[bool, bool, bool]  # Megatron's args.do_train, do_valid, do_test
    log_state: dict[str, Any] | None = None  # a same-position survivor's training_log sums


class MegatronSession(Recovery):
    """DeadPool's state and protocol in one Megatron-LM process (recovery: `Recovery`)."""

    def __init__(self, cfg: DeadpoolConfig, task: int, token: str) -> None:
        self.cfg = cfg
        self.task = task
        self.token = token
        self.pid = ""  # a{rank} or s{i}, once the coordinator's world size is known
        self.rank: int | None = None
        self.generation = 0
        self.roster: Roster | None = None
        self.newcomer: NewcomerPlan | None = None
        self.joined_late = False  # a spare that took a slot after the start
        self.layout: Layout | None = None
        self.placement: Placement | None = None
        self.replicator: Replicator | None = None
        self.repl_group: dist.ProcessGroup | None = None
        self.pg_kwargs: dict[str, Any] = {}
        self.mp_call: tuple[Any, tuple, dict] | None = None
        self.objs: tuple[Any, Any, Any, Any] | None = None
        self.extra_roots: list[Any] = []
        self.data_iterator: Any = None
        self.recorders: list[BatchRecorder] = []
        self.next_step = 1
        self.last_completed = 0
        self.resumed_at: int | None = None
        self.pending: BaseException | None = None
        self.counters: dict[int, dict[str, float]] = {}
        self.committed: int | None = None
        self.repl_seconds = 0.0
        self.recoveries: list[dict[str, Any]] = []
        self.unreported: list[dict[str, Any]] = []
        self.total_loss_dict: dict[str, Any] | None = None  # Megatron's training_log sums
        self._log_state_to_load: dict[str, Any] | None = None

    # ------------------------------------------------------------------ start-up
    def begin(self) -> bool:
        """Connect, heartbeat, wait for a slot; False when this spare was never needed."""
        coordinator = self.cfg.coordinator or os.environ.get("DEADPOOL_COORDINATOR")
        if not coordinator:
            raise ConfigError(
                "deadpool-coordinator: --deadpool needs the coordinator's HOST:PORT; use "
                "`deadpool megatron-lm` (which hosts it) or start `deadpool coordinator`"
            )
        from . import workers as megatron_lm_workers

        megatron_lm_workers.install()
        store = connect_store(coordinator, self.cfg.connect_timeout)
        Membership(store, f"task{self.task}").check_token(self.token)
        # The coordinator's first roster is the authority on the active world size (a
        # launcher's WORLD_SIZE may count the spares, or not).
        store.wait(["gen0/roster"], datetime.timedelta(seconds=self.cfg.pg_timeout))
        world = Roster.from_json(store.get("gen0/roster")).world_size
        self.pid = Identity(self.task, world).pid
        self.members = Membership(store, self.pid)
        if self.pid.startswith("s"):
            set_context(spare=self.pid)
        self.members.announce()
        self.heartbeat = Heartbeat(
            coordinator, self.pid, self.cfg.heartbeat_interval, self.cfg.connect_timeout
        )
        self.heartbeat.start()
        roster = self._wait_for_slot()
        if roster is None:
            log.info("released: the job ended without needing this spare")
            self.heartbeat.stopped.set()
            return False
        self.roster = roster
        self.generation = roster.generation
        self.rank = roster.rank_of(self.pid)
        set_context(rank=self.rank, generation=self.generation)
        # What Megatron reads: the rank this process fills and the active world (not the tasks).
        os.environ["RANK"] = str(self.rank)
        os.environ["WORLD_SIZE"] = str(roster.world_size)
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
        if roster.generation > 0:
            self.newcomer = self._newcomer_plan(roster)
            self.joined_late = True
            newcomer.enter(self.rank, roster.world_size, self._record_pg_kwargs)
            log.info(
                "taking rank %d in generation %d: Megatron start-up in a private world, "
                "joining at step %d",
                self.rank,
                self.generation,
                self.newcomer.target,
            )
        return True

    def _wait_for_slot(self) -> Roster | None:
        spare_faults = faults.spare_faults(self.cfg.fail, self.pid)
        while True:
            if self.members.shutdown_requested():
                return None
            store = self.members.store
            for index, iteration, kind in spare_faults:  # `spare:I@ITER`: a waiting spare fails
                last = int(store.get("progress/last")) if store.check(["progress/last"]) else 0
                if last >= iteration and self._fire(index):
                    self._inject(kind, f"while waiting (training at iteration {last})")
            g = self.members.generation()
            if g >= 0:
                roster = self.members.roster(g)
                if roster.rank_of(self.pid) is not None:
                    return roster
            time.sleep(0.05 if self.pid.startswith("a") else 0.2)

    def _newcomer_plan(self, roster: Roster) -> NewcomerPlan:
        reports = self._survivor_reports(roster)
        targets = {r["target"] for r in reports.values()}
        if len(targets) != 1:
            raise DeadpoolRuntimeError(f"survivors report different steps to resume: {targets}")
        first = reports[min(reports)]
        sources = self.members.read(f"gen{roster.generation}/sources") or {}
        peer = reports.get(sources.get(str(self.rank)), first)  # same (tp, pp) position
        return NewcomerPlan(
            roster=roster,
            target=targets.pop(),
            counters=first["counters"],
            flags=tuple(bool(f) for f in first["flags"]),
            log_state=peer.get("log_state"),
        )

    def _survivor_reports(self, roster: Roster) -> dict[int, dict[str, Any]]:
        plan = self.members.read(f"gen{roster.generation}/plan") or {}
        needy = set(plan.get("needy", []))
        out = {}
        for r in range(roster.world_size):
            if r not in needy:
                value = self.members.read(f"gen{roster.generation}/holdings/{r}")
                if value is not None and "target" in value:
                    out[r] = value
        return out

    # ------------------------------------------------------------------ Megatron's start-up
    def init_process_group(self, real: Any, kwargs: dict[str, Any]) -> None:
        """Generation 0: Megatron's `init_process_group` on the coordinator's store."""
        if kwargs.get("store") is not None:
            raise ConfigError(
                "--deadpool cannot share Megatron's in-process restart store: turn "
                "--inprocess-restart off (DeadPool replaces failed ranks itself)"
            )
        self._record_pg_kwargs(kwargs)
        kwargs = dict(kwargs)
        kwargs.update(
            store=dist.PrefixStore(f"gen{self.generation}", self.members.store),
            rank=self.rank,
            world_size=self.roster.world_size,
            **nccl.init_kwargs(self.pg_kwargs["backend"], self._device().index),
        )
        real(**kwargs)

    def _record_pg_kwargs(self, kwargs: dict[str, Any]) -> None:
        self.pg_kwargs = {
            "backend": kwargs.get("backend") or "gloo",
            "timeout": kwargs.get("timeout") or datetime.timedelta(minutes=10),
        }

    def model_parallel_ready(
        self, real: Any, args: tuple, kwargs: dict[str, Any], margs: Any
    ) -> None:
        """After Megatron's `initialize_model_parallel(*args, **kwargs)` (`real`): check the
        set-up and place replicas; later generations repeat the same call."""
        self.mp_call = (real, args, kwargs)
        self._check_megatron_args(margs)
        if getattr(margs, "deadpool_job_token", None):  # Megatron saves its args in checkpoints
            margs.deadpool_job_token = "<redacted>"
        tp = ps.get_tensor_model_parallel_world_size()
        pp = ps.get_pipeline_model_parallel_world_size()
        dp = ps.get_data_parallel_world_size()
        per_node = self.cfg.ranks_per_node or int(
            os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or tp
        )
        self.layout = Layout(tp=tp, pp=pp, dp=dp, ranks_per_node=per_node)
        self.placement = place_replicas(self.layout, self.cfg.replicas)
        faults.check_faults(
            [faults.parse_fault(spec) for spec in self.cfg.fail],
            self.layout.world_size,
            per_node,
            margs.train_iters or 0,
        )
        if self.generation == 0 and self.rank == 0:
            self.members.publish(
                "job/layout",
                {
                    "tp": tp,
                    "pp": pp,
                    "dp": dp,
                    "ranks_per_node": per_node,
                    "replicas": self.cfg.replicas,
                },
            )

    def _check_megatron_args(self, a: Any) -> None:
        problems = []
        if not getattr(a, "use_distributed_optimizer", False) and a.data_parallel_size < 2:
            problems.append(
                "without --use-distributed-optimizer every data-parallel peer holds the same "
                "optimizer state, but data-parallel size is 1: no peer can stand in for a "
                "failed rank; use data-parallel size >= 2 or run without --deadpool"
            )
        if getattr(a, "fp16", False):
            problems.append("--fp16: the loss scaler's state is not replicated; use --bf16")
        if getattr(a, "rampup_batch_size", None):
            problems.append("--rampup-batch-size: replaying steps needs a constant batch size")
        if (
            getattr(a, "context_parallel_size", 1) > 1
            or getattr(a, "expert_model_parallel_size", 1) > 1
        ):
            problems.append("context or expert parallelism: placement covers tp x pp x dp only")
        if getattr(a, "use_tp_pp_dp_mapping", False):
            problems.append("--use-tp-pp-dp-mapping: placement assumes Megatron's default order")
        timeout_s = getattr(a, "distributed_timeout_minutes", 10) * 60
        if self.cfg.heartbeat_timeout >= timeout_s:
            problems.append(
                f"--deadpool-heartbeat-timeout ({self.cfg.heartbeat_timeout:.0f}s) must stay "
                f"below --distributed-timeout-minutes ({timeout_s:.0f}s): a hung peer must be "
                "named by the heartbeat monitor before collectives time out"
            )
        if problems:
            raise ConfigError("--deadpool cannot protect this run: " + "; ".join(problems))

    # ------------------------------------------------------------------ the training step
    def train_step(
        self,
        real: Any,
        fwd: Any,
        data_iterator: Any,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        config: Any,
        fb_func: Any,
        iteration: int,
    ) -> Any:
        """Megatron's `train_step(iteration)` (step n = iteration + 1) with replication and
        in-place recovery; returns step n's result."""
        n = iteration + 1
        if self.objs is None:
            self._bind(model, optimizer, scheduler, config, data_iterator, n)
        self._note_counters(n)
        failure, self.pending = self.pending, None
        running = _running_timers()
        call = (real, fwd, data_iterator, model, optimizer, scheduler, config, fb_func)
        while True:
            try:
                if self.newcomer is not None:
                    self._join_as_newcomer(n)
                elif failure is not None:  # also when a recovery itself was cut short
                    self._recover(failure, target=n)
                failure = None
                self._maybe_fail(n)
                while self.next_step < n:
                    self._run(call, self.next_step)
                return self._run(call, n)
            except (DeadpoolRuntimeError, ConfigError):
                raise
            except RuntimeError as exc:  # a collective failed: a peer died or hung
                _stop_timers_since(running)
                failure = exc

    def _bind(self, model, optimizer, scheduler, config, data_iterator, n: int) -> None:
        self.objs = (model, optimizer, scheduler, config)
        self.data_iterator = data_iterator
        self.recorders = install_recorder(data_iterator)
        self.next_step = n
        if self.newcomer is None:
            self.repl_group = self._new_repl_group()

    def _note_counters(self, n: int) -> None:
        """Megatron's counters after step n-1 (train() updates them after each step)."""
        from megatron.training import get_args
        from megatron.training.training import num_floating_point_operations

        a = get_args()
        prev = self.counters.get(n - 2)
        if prev is None:
            flops = float(a.num_floating_point_operations_so_far)
        else:
            batch = a.micro_batch_size * a.data_parallel_size * _num_microbatches()
            flops = prev["flops"] + num_floating_point_operations(a, batch)
        self.counters[n - 1] = {
            "consumed_train": a.consumed_train_samples,
            "consumed_valid": a.consumed_valid_samples,
            "skipped_train": a.skipped_train_samples,
            "flops": flops,
        }
        for old in [k for k in self.counters if k < n - 4]:
            del self.counters[old]

    def _run(self, call: tuple, k: int) -> Any:
        from megatron.training import get_args

        real, fwd, data_iterator, model, optimizer, scheduler, config, fb_func = call
        for rec in self.recorders:
            rec.begin_step(k)
        get_args().curr_iteration = k - 1
        result = real(
            fwd, data_iterator, model, optimizer, scheduler, config, fb_func, iteration=k - 1
        )
        self._replicate(k)
        self.next_step = k + 1
        self.last_completed = k
        if self.rank == 0:
            self.members.store.set("progress/last", str(k))
            if self.resumed_at == k:
                self._stamp("first_iteration")
        return result

    def _replicate(self, k: int) -> None:
        t0 = time.perf_counter()
        if self.replicator is None:
            self.replicator = self._make_replicator()
        self.committed = self.replicator.finish_round()
        self.replicator.start_round(k)
        self.repl_seconds = time.perf_counter() - t0

    def _maybe_fail(self, n: int) -> None:
        """Fault injection, `--deadpool-fail RANK@ITER[:kill|hang|flip]` / `node:N@ITER`:
        as step n starts; each spec fires once per job (not again for the process that takes
        the slot, nor when the step is recomputed)."""
        hit = faults.iteration_faults(self.cfg.fail, self.rank, self.layout.ranks_per_node).get(n)
        if hit is not None and self._fire(hit[0]):
            self._inject(hit[1], f"at iteration {n}")

    def fail_in_recovery(self) -> None:
        """`--deadpool-fail RANK@recovery[:kind]`: this rank fails as it enters a recovery."""
        for index, kind in faults.recovery_faults(self.cfg.fail, self.rank):
            if self._fire(index):
                self._inject(kind, "while in recovery")

    def _fire(self, index: int) -> bool:
        who = self.pid if self.rank is None else self.rank  # a rank's fault fires once per job
        return self.members.store.add(f"fault/fired/{index}/{who}", 1) == 1

    def _inject(self, kind: str, when: str) -> None:
        if kind == "flip":  # memory corruption of the replicas this rank holds
            if self.replicator is not None:
                log.warning("fault injection: flip %s", when)
                self.replicator.flip_bits_at_rest()
            return
        log.warning("fault injection: %s %s", kind, when)
        self.members.store.set(f"fault/{self.pid}", repr(time.time()))
        inject(kind)

    def _device(self) -> Device:
        if torch.cuda.is_available() and torch.version.cuda and torch.cuda.device_count():
            return Device(kind="cuda", backend="nccl", index=torch.cuda.current_device())
        return Device(kind="cpu", backend="gloo")

    def _new_repl_group(self) -> dist.ProcessGroup:
        ReplicaMemory(self.cfg.replica_device, self._device())  # refuses 'gpu' without CUDA now
        return dist.new_group(
            backend=replication_backend(self._device()),
            timeout=datetime.timedelta(seconds=self.cfg.pg_timeout),
        )

    def _make_replicator(self) -> Replicator:
        _, optimizer, scheduler, _ = self.objs
        return Replicator(
            Snapshotter(RankState(optimizer, scheduler), self.rank),
            self.placement,
            self.rank,
            self.repl_group,
            ReplicaMemory(self.cfg.replica_device, self._device()),
            previous=self.replicator,
        )

    def _roots(self) -> list[Any]:
        """Everything that holds process-group handles DeadPool must rebind: model chunks, DDP,
        optimizer, scheduler, config, Megatron's checkpointing context (its save strategy
        keeps the data-parallel group), the replicator."""
        return [*self.objs, *self.extra_roots, self.replicator]

    def _stamp(self, what: str) -> None:
        self.members.store.set(f"gen{self.generation}/{what}/{self.rank}", repr(time.time()))

    # ------------------------------------------------------------------ between steps
    def defer(self, exc: BaseException, where: str) -> None:
        """A collective failed outside a training step: recover at the next step."""
        log.warning(
            "collective failed in %s (%s): recovering at the next step",
            where,
            str(exc).splitlines()[0][:160],
        )
        traceback.clear_frames(exc.__traceback__)
        self.pending = exc

    def before_log(self, total_loss_dict: dict[str, Any]) -> None:
        """Before Megatron's `training_log`: keep a handle on its running sums (a train()
        local); a newcomer first takes over its predecessor's, which a data-parallel peer at
        the same position holds identically, so its log lines read as the dead rank's would."""
        from .report import load_log_state

        self.total_loss_dict = total_loss_dict
        if self._log_state_to_load is not None:
            load_log_state(total_loss_dict, self._log_state_to_load)
            self._log_state_to_load = None

    def after_log(self, iteration: int) -> None:
        """After Megatron's `training_log`: DeadPool's line and scalars (last rank)."""
        from megatron.training import get_args

        a = get_args()
        nbytes = self.replicator.bytes_per_round if self.replicator else 0
        if iteration % a.log_interval == 0:
            report.print_last(
                *report.replication_fields(
                    iteration, a.train_iters, self.committed, nbytes, self.repl_seconds
                )
            )
        for record in self.unreported:
            report.print_last(*report.recovery_fields(record))
        if report.is_last_rank() and iteration % a.tensorboard_log_interval == 0:
            scalars = {
                "committed-iteration": float(self.committed if self.committed is not None else -1),
                "replica-bytes-per-iteration": float(nbytes),
                "replication-time-ms": self.repl_seconds * 1000,
                "generation": float(self.generation),
                "recoveries": float(len(self.recoveries)),
            }
            if self.recoveries:
                scalars["last-recovery-s"] = self.recoveries[-1]["total_s"]
            report.write_scalars(iteration, scalars)
        self.unreported = []

    def finish(self) -> None:
        """After `pretrain()` returned: drain the last round, mark this process done."""
        from ..digest import rank_digest

        if self.replicator is not None and self.repl_group is not None:
            self.replicator.finish_round()
        if self.objs is not None:
            self.members.store.set(f"digest/{self.rank}", rank_digest(self.objs[0]))
        self.members.store.set(f"done/{self.pid}", repr(time.time()))
        self.heartbeat.stopped.set()


# ---------------------------------------------------------------------- helpers
def _num_microbatches() -> int:
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    return get_num_microbatches()


def _running_timers() -> set[str]:
    from megatron.training import get_timers

    timers = getattr(get_timers(), "_timers", {})
    return {name for name, t in timers.items() if getattr(t, "_started", False)}


def _stop_timers_since(running: set[str]) -> None:
    """Timers a failed step started and never stopped (Megatron asserts on a second start)."""
    from megatron.training import get_timers

    for name, t in getattr(get_timers(), "_timers", {}).items():
        if getattr(t, "_started", False) and name not in running:
            t.reset()
