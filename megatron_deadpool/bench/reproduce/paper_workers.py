"""The workers of `deadpool bench paper`'s `async_1` and `nvrx_local_1` configurations.

`checkpoint.py` saves neither asynchronously nor through nvidia-resiliency-ext, so these
configurations run workers with a saver of their own (`EmbeddedJob(saver=...)`) that calls
those APIs the way Megatron-LM does:

- launcher side: `launch` runs a job like `bench recovery` does (`timed_launch.launch`), its
  processes `python -m megatron_deadpool.bench.reproduce.paper_workers KIND ARGS`; `nvrx_python` and
  `probe_nvrx` find an interpreter that has nvidia-resiliency-ext;
- worker side: `main`, `_save_async` and `_save_nvrx_local`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...config.job import JobConfig
from .. import timed_launch
from ..timed_launch import Launch

KINDS = ("async", "nvrx-local")

Runner = Callable[[JobConfig, Path, bool, str], Launch]
"""(job, run_dir, stop_on_failure, worker) -> Launch; worker is "" (the usual one) or a KIND."""


# ---------------------------------------------------------------------- launcher side
def nvrx_python(explicit: str | None) -> tuple[str | None, str]:
    """(interpreter, why not) for the nvidia-resiliency-ext workers."""
    if explicit:
        return explicit, ""
    if importlib.util.find_spec("nvidia_resiliency_ext") is not None:
        return sys.executable, ""
    env = os.environ.get("DEADPOOL_NVRX_PYTHON")
    if env:
        return env, ""
    return None, (
        "nvidia-resiliency-ext is not installed for this interpreter; install it (0.4.1 is "
        "the newest for Python 3.11) or pass --nvrx-python"
    )


def probe_nvrx(python: str, job: JobConfig) -> str:
    """'' when `python` can run the local-checkpoint worker for `job`, else why not."""
    world, jump = job.parallel.world_size, job.ranks_per_node
    if world % (2 * jump):
        return (
            f"replication factor 2 with jump {jump} (ranks per node) needs a world size "
            f"divisible by {2 * jump}, this job has {world}"
        )
    code = (
        "import nvidia_resiliency_ext as n, megatron.core.dist_checkpointing."
        "tensor_aware_state_dict as t, megatron_deadpool.embedded.job; assert t.HAVE_NVRX; "
        "from importlib.metadata import version; print(version('nvidia-resiliency-ext'))"
    )
    try:
        out = subprocess.run(
            [python, "-c", code],
            capture_output=True,
            text=True,
            timeout=300,
            env=_worker_env(),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python}: {exc}"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return f"{python} cannot import it: {last[:200]}"
    return ""


def _worker_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=root + (os.pathsep + path if path else ""))


def launch(
    job: JobConfig, run_dir: Path, stop: bool, worker: str, *, timeout_s: float, python: str
) -> Launch:
    """`bench recovery`'s timed launch; a `worker` KIND runs its processes through `main`
    (`python -m megatron_deadpool.bench.reproduce.paper_workers KIND` instead of the embedded worker).
    """
    if not worker:
        return timed_launch.launch(job, run_dir, stop, timeout_s)
    return timed_launch.launch(
        job,
        run_dir,
        stop,
        timeout_s,
        worker_command=[python, "-m", "megatron_deadpool.bench.reproduce.paper_workers", worker],
        worker_env=_worker_env(),
    )


# ---------------------------------------------------------------------- worker side
def _save_async(job: Any, iteration: int) -> None:
    """Megatron-LM's `--async-save` for torch_dist: schedule, finalize before the next one."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from ...embedded import checkpoint as ck

    queue = _WORKER.setdefault("queue", AsyncCallsQueue(persistent=False))
    queue.maybe_finalize_async_calls(blocking=True)  # at most one save in flight
    root = job.spec.train.save
    path = ck.iteration_dir(root, iteration)
    path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    metadata = ck._metadata()
    state = ck._state_dict(job.objs, metadata=metadata, is_loading=False, iteration=iteration)
    request = dist_checkpointing.save(
        state,
        str(path),
        get_default_save_sharded_strategy(ck.CKPT_FORMAT),
        content_metadata=ck._serialisable(metadata),
        async_sharded_save=True,
    )

    def marker() -> None:  # runs after megatron's own finalize (metadata + barrier)
        if dist.get_rank() == 0:
            ck.write_tracker(root, iteration)

    request.add_finalize_fn(marker)
    queue.schedule_async_request(request)


def _save_nvrx_local(job: Any, iteration: int) -> None:
    """Megatron-LM's `--non-persistent-ckpt-type local --replication` save path."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager,
    )
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
        LazyCliqueReplicationStrategy,
    )

    from ...embedded import checkpoint as ck

    if "manager" not in _WORKER:
        strategy = LazyCliqueReplicationStrategy(job.spec.ranks_per_node, 2)
        _WORKER["manager"] = LocalCheckpointManager(job.spec.train.save, repl_strategy=strategy)
    metadata = ck._metadata()
    state = ck._state_dict(job.objs, metadata=metadata, is_loading=False, iteration=iteration)
    tasd, cache = MCoreTensorAwareStateDict.from_state_dict(
        state,
        algo="fully_parallel",
        parallelization_group=ps.get_data_parallel_group(with_context_parallel=True),
        cached_metadata=_WORKER.get("cache"),
    )
    _WORKER["cache"] = cache
    _WORKER["manager"].save(tasd, iteration, is_async=False)


_WORKER: dict[str, Any] = {}


def main(argv: list[str]) -> int:
    """`python -m megatron_deadpool.bench.reproduce.paper_workers KIND ARGS`: a worker whose saves are
    KIND (async, nvrx-local) instead of checkpoint.save; ARGS as for the embedded worker."""
    from ...embedded import worker

    kind, rest = argv[0], argv[1:]
    save = {"async": _save_async, "nvrx-local": _save_nvrx_local}[kind]

    def finish_pending() -> None:
        queue = _WORKER.get("queue")
        if queue is not None:  # every async save complete before the groups go away
            queue.maybe_finalize_async_calls(blocking=True)
            queue.close()

    return worker.main(rest, saver=save, on_finish=finish_pending)


if __name__ == "__main__":  # a guard: spawned helpers re-import this module as __mp_main__
    if len(sys.argv) > 1 and sys.argv[1] in KINDS:
        sys.exit(main(sys.argv[1:]))
    sys.exit(
        f"usage: python -m megatron_deadpool.bench.reproduce.paper_workers {'|'.join(KINDS)} ARGS"
    )
