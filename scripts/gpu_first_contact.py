#!/usr/bin/env python3
"""First contact with one GPU: ten minutes that check what the CPU tests cannot, in one table.

    python scripts/gpu_first_contact.py [--json FILE] [--budget 600] [--only a,b] [--no-build]

Every row runs in a fresh interpreter, bounded in time (the whole run by `--budget`); a row
that finds a problem says FAIL, one that cannot run here says skip and why, one that only
reports says info. Without CUDA every row is skipped and the exit code is 0; otherwise 0 when
no row failed, 1 when one did. `--json` writes every row's figures. Rows:

  versions        torch, CUDA, NCCL, the device; `ProcessGroupNCCL.get_error` and its error
                  types present
  kernel          the fused pack kernel: built (for this device's architecture only, e.g. sm_90,
                  unless installed already), the architectures in its binary, one pack checked;
                  FAIL when the GPU packs with the torch fallback (the note says how to fix it)
  pack            the pack kernel against the host (misaligned, mixed dtypes, unpack, the torch
                  fallback's checksum) and timed against a plain copy at 1 MiB and 1 GiB (GB/s)
  gens_split      three generations of init -> Megatron's groups -> abort in a world of one,
  gens_warm       each step timed, memory and threads watched for leaks: communicators split
                  from the world's (default) or set up by each group (DEADPOOL_NCCL_INIT=warm)
  abort_deadpool  an abort while another stream is busy and NCCL work waits behind it: every
  abort_torch     group's abort started together (DeadPool) vs torch's one-by-one loop
  plan_watch      a plan-watch abort while a real heartbeat keeps beating (and the GPU is busy)
  heartbeat_dw    the same with `DeviceWatch` after every beat (as the driver runs it): the
                  heartbeat keeps beating and the watch neither raises nor ends the process
  pinned_repl     a Replicator with pinned host replicas, three rounds at 2 GiB (settle timed;
                  two processes sharing the GPU on gloo: one GPU cannot hold two NCCL ranks)
  auto_rebuilt    a rebuilt `auto` replicator must stay on the GPU with its predecessor's buffers
                  still allocated
  pinned_size     pinned replica buffers of the exact size (`host_memory_stats` untouched,
                  `is_pinned()`, an asynchronous copy) vs torch's power-of-two `pin_memory`
  round_cost      a round's cost to a 40 x 8192^3 bf16 matmul loop beside a plain side-stream
  round_cost_torch copy of the same bytes, shards of 0.5/1.5/3 GB, minimum of 4 rounds, with
                  the fused kernel and with DEADPOOL_PACK_BACKEND=torch: FAIL when a round adds
                  over 2 x the copy's GPU time (+ the loop's noise) or holds the host over 2 ms
  overlap_conn1   the same at 1.5 GB with CUDA_DEVICE_MAX_CONNECTIONS=1 (figures only)
  n2_probe        a model buffer changed right after `start_round` is restored with its value
                  from before the round (12 rounds, 1.5 GB shard, the fused kernel)
  thread_devices  after a round, every thread DeadPool started selected the rank's device
                  (`devices.threads.device_threads`)
  device_watch    a step's work not done within the bound is noticed; `get_error()` polled
  selftest        `deadpool selftest --nproc 1` (no cross-rank check on one GPU: its
                  "incomplete" exit code and no failed row pass)

The checks themselves live in `megatron_deadpool.selftest.gpu_checks` (shared with
`deadpool selftest` and the GPU suite); this script runs them, one interpreter per row.
The lent machine may lack megatron-core: rows that need it say so (carry its wheel).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIB, GIB = 1 << 20, 1 << 30


def _cuda() -> Any:
    """torch, once a CUDA device is known present (else `Skip`)."""
    import torch

    from megatron_deadpool.selftest.gpu_checks.base import require_cuda

    require_cuda()
    return torch


def _megatron() -> None:
    from megatron_deadpool.selftest.gpu_checks.base import require_megatron

    require_megatron()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


# ---------------------------------------------------------------------- rows


def check_versions() -> dict[str, Any]:
    torch = _cuda()
    c10d = torch._C._distributed_c10d
    # `get_error` is bound on ProcessGroupNCCL (the backend `nccl.nccl_backend` returns), not on
    # the generic Backend.
    has = hasattr(getattr(c10d, "ProcessGroupNCCL", None), "get_error")
    kinds = getattr(c10d, "ErrorType", None)
    figures = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "device": torch.cuda.get_device_name(),
        "capability": "sm_{}{}".format(*torch.cuda.get_device_capability()),
        "torch_archs": torch.cuda.get_arch_list(),
        "get_error": has,
        "error_types": [
            t for t in ("SUCCESS", "TIMEOUT", "COMM_ERROR", "REMOTE_ERROR") if hasattr(kinds, t)
        ],
        "python": sys.version.split()[0],
    }
    status = "pass" if has else "FAIL"
    note = "" if has else "no ProcessGroupNCCL.get_error: NCCL errors are not polled"
    return {"status": status, "figures": figures, "note": note}


def check_kernel() -> dict[str, Any]:
    torch = _cuda()
    from megatron_deadpool.replication import pack
    from megatron_deadpool.selftest.gpu_checks import kernel
    from megatron_deadpool.selftest.gpu_checks.pack_check import pack_against_host

    state = kernel.kernel_state(torch.device("cuda", torch.cuda.current_device()))
    verdict, detail = kernel.judge(state)
    if verdict != "pass":
        return {"status": "FAIL", "figures": {"backend": state.backend}, "note": detail}
    ext = getattr(pack, "_extension", lambda: None)()  # the loaded module, for its binary
    archs: list[str] = []
    try:
        if ext is None or not getattr(ext, "__file__", None):
            raise OSError("the extension module's file is not known")
        listing = subprocess.run(
            ["cuobjdump", "--list-elf", str(ext.__file__)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout
        archs = sorted({w for w in listing.replace(".", " ").split() if w.startswith("sm_")})
    except (OSError, subprocess.SubprocessError) as exc:
        archs = [f"cuobjdump not found ({exc})"]
    problems, _ = pack_against_host(4 * MIB + 16, timed=False)
    own = "sm_{}{}".format(*torch.cuda.get_device_capability())
    ok = not problems and (own in archs or not archs or "cuobjdump" in archs[0])
    figures = {"archs": archs, "device": own, "checksum_ok": not problems}
    return {"status": "pass" if ok else "FAIL", "figures": figures, "note": "; ".join(problems)}


def check_pack() -> dict[str, Any]:
    torch = _cuda()
    from megatron_deadpool.selftest.gpu_checks import kernel
    from megatron_deadpool.selftest.gpu_checks.base import Skip
    from megatron_deadpool.selftest.gpu_checks.pack_check import pack_against_host

    if kernel.kernel_state(torch.device("cuda", torch.cuda.current_device())).backend != "cuda":
        raise Skip("the fused kernel does not pack here: the kernel row says why")
    figures: dict[str, Any] = {}
    problems: list[str] = []
    for label, nbytes in (("1MiB", MIB), ("1GiB", GIB)):
        found, figures[label] = pack_against_host(nbytes)
        problems += [f"{label}: {p}" for p in found]
    return {
        "status": "FAIL" if problems else "pass",
        "figures": figures,
        "note": "; ".join(problems),
    }


def check_generations(mode: str) -> dict[str, Any]:
    torch = _cuda()
    os.environ["DEADPOOL_NCCL_INIT"] = mode
    import datetime

    import torch.distributed as dist

    from megatron_deadpool.devices import nccl, select_device
    from megatron_deadpool.devices.abort import abort_groups

    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        ps = None
    select_device("cuda", local_rank=0)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    generations = []
    for g in range(3):
        row: dict[str, Any] = {}
        t0 = time.perf_counter()
        dist.init_process_group(
            backend="nccl",
            store=dist.PrefixStore(f"gen{g}", store),
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
            **nccl.init_kwargs("nccl"),
        )
        t1 = time.perf_counter()
        if ps is not None:
            ps.initialize_model_parallel(1, 1)
        else:
            for _ in range(40):
                dist.new_group([0])
        dist.new_group(backend="nccl")  # DeadPool's replication group
        t2 = time.perf_counter()
        row["warmed"] = nccl.warm_groups()
        t3 = time.perf_counter()
        x = torch.ones(1, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        row["groups"] = len(nccl.known_groups())
        abort_groups()
        if ps is not None:
            ps.destroy_model_parallel()
        t5 = time.perf_counter()
        torch.cuda.synchronize()
        row.update(
            init_s=round(t1 - t0, 3),
            groups_s=round(t2 - t1, 3),
            warm_s=round(t3 - t2, 3),
            first_collective_s=round(t4 - t3, 3),
            abort_s=round(t5 - t4, 3),
            threads=_threads(),
            allocated_mib=round(torch.cuda.memory_allocated() / MIB, 1),
            free_mib=round(torch.cuda.mem_get_info()[0] / MIB, 1),
        )
        generations.append(row)
    leak_threads = generations[2]["threads"] - generations[0]["threads"]
    leak_mib = generations[0]["free_mib"] - generations[2]["free_mib"]
    status = "pass" if leak_threads <= 2 and leak_mib < 256 else "FAIL"
    note = "" if ps is not None else "no megatron-core: 40 plain groups stand in"
    return {
        "status": status,
        "figures": {
            "generations": generations,
            "threads_gained": leak_threads,
            "free_mib_lost": round(leak_mib, 1),
        },
        "note": note,
    }


def check_abort(kind: str) -> dict[str, Any]:
    torch = _cuda()
    import torch.distributed as dist

    from megatron_deadpool.devices.abort import abort_groups
    from megatron_deadpool.selftest.gpu_checks.base import world_of_one

    groups = world_of_one(groups=20)
    busy = torch.cuda.Stream()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(int(3e9))  # a couple of seconds of GPU time
    main = torch.cuda.current_stream()
    main.wait_stream(busy)  # NCCL work queued behind the busy stream
    x = torch.ones(1 << 20, device="cuda")
    works = [dist.all_reduce(x, group=g, async_op=True) for g in groups[:4]]
    t0 = time.perf_counter()
    if kind == "deadpool":
        abort_groups()
    else:
        dist.distributed_c10d._abort_process_group()
    seconds = time.perf_counter() - t0
    still_busy = not busy.query()
    del works
    try:  # the NCCL work queued behind the busy stream meets aborted communicators
        torch.cuda.synchronize()
        after = "clean"
    except RuntimeError as exc:
        after = str(exc).splitlines()[0][:160]
    figures = {
        "abort_s": round(seconds, 3),
        "stream_still_busy_after": still_busy,
        "device_after_queued_work_ran": after,
    }
    return {"status": "pass" if seconds < 30 else "FAIL", "figures": figures}


def check_plan_watch(device_watch: bool = False) -> dict[str, Any]:
    _cuda()
    from megatron_deadpool.selftest.gpu_checks import heartbeat

    return heartbeat.check(device_watch)


def _pinned_child(rank: int, port: int, numel: int, out_path: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from megatron_deadpool.devices import select_device
    from megatron_deadpool.devices.memory import ReplicaMemory
    from megatron_deadpool.replication.placement import Layout, place_replicas
    from megatron_deadpool.replication.replicator import Replicator
    from megatron_deadpool.replication.snapshot import Snapshotter
    from megatron_deadpool.selftest.gpu_checks.base import adam_state

    device = select_device("cuda", local_rank=0)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    state = adam_state(numel, seed=rank)
    placement = place_replicas(Layout(tp=1, pp=1, dp=2, ranks_per_node=1), 1)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=120))
    t0 = time.perf_counter()
    repl = Replicator(
        Snapshotter(state, rank), placement, rank, group, ReplicaMemory("cpu", device)
    )
    build_s = time.perf_counter() - t0
    rounds = []
    for it in range(1, 4):
        t0 = time.perf_counter()
        repl.start_round(it)
        post_s = time.perf_counter() - t0
        torch.cuda._sleep(int(1e9))  # "the next iteration"
        repl.before_step()
        t0 = time.perf_counter()
        committed = repl.finish_round()
        rounds.append(
            {
                "capture_post_host_s": round(post_s, 4),
                "settle_s": round(time.perf_counter() - t0, 3),
                "wait_s": round(repl.timings.get("wait", -1), 3),
                "verify_s": round(repl.timings.get("verify", -1), 3),
                **{
                    f"{k}_s": round(v, 3)
                    for k, v in repl.timings.items()
                    if k.startswith("thread_")
                },
                "committed": committed,
            }
        )
    result = {
        "rank": rank,
        "flat_bytes": repl.sizes[rank],
        "pinned": repl.local.buffers[0].is_pinned(),
        "build_s": round(build_s, 2),
        "rounds": rounds,
    }
    Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()


def check_pinned_replicator() -> dict[str, Any]:
    _cuda()
    _megatron()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    numel = 2 * GIB // 12  # fp32 params + Adam's two moments: a 2 GiB shard
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"r{r}.json") for r in range(2)]
        code = (
            f"import sys; sys.path.insert(0, {str(REPO / 'scripts')!r}); "
            "import gpu_first_contact as g; g._pinned_child(int(sys.argv[1]), "
            f"{port}, {numel}, sys.argv[2])"
        )
        logs = [os.path.join(tmp, f"r{r}.log") for r in range(2)]
        procs = []
        for r in range(2):
            with open(logs[r], "w") as err:
                procs.append(
                    subprocess.Popen([sys.executable, "-c", code, str(r), paths[r]], stderr=err)
                )
        try:
            codes = [p.wait(timeout=220) for p in procs]
        finally:
            for p in procs:  # a child past its time holds the GPU: end it with the row
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes):
            tails = [Path(log).read_text()[-1500:] for log in logs]
            return {"status": "FAIL", "figures": {"exit_codes": codes, "stderr_tails": tails}}
        results = [json.loads(Path(p).read_text()) for p in paths]
    ok = all(r["pinned"] and [x["committed"] for x in r["rounds"]] == [1, 2, 3] for r in results)
    return {"status": "pass" if ok else "FAIL", "figures": {"ranks": results}}


def check_auto_rebuilt() -> dict[str, Any]:
    torch = _cuda()
    _megatron()
    import torch.distributed as dist

    from megatron_deadpool.devices.base import Device
    from megatron_deadpool.devices.memory import ReplicaMemory, fits_on_gpu
    from megatron_deadpool.replication.placement import Layout, Placement
    from megatron_deadpool.replication.replicator import Replicator
    from megatron_deadpool.replication.snapshot import Snapshotter
    from megatron_deadpool.selftest.gpu_checks.base import adam_state, world_of_one

    world_of_one()
    group = dist.new_group(backend="nccl")
    free, total = torch.cuda.mem_get_info()
    # Own ~12 % of free, so that 4 buffers (self-held) take ~50 %; at most 8 GiB (a shard's
    # checksum covers 16 GiB), the rest of a large card taken by ballast.
    own_bytes = min(int(free * 0.12), 8 * GIB)
    ballast = torch.empty(max(0, free - int(own_bytes / 0.12)), dtype=torch.uint8, device="cuda")
    numel = own_bytes // 12
    state = adam_state(numel, seed=0)
    placement = Placement(Layout(tp=1, pp=1, dp=1, ranks_per_node=1), 1, ((0,),))
    memory = ReplicaMemory("auto", Device("cuda", "nccl", torch.cuda.current_device()))
    first = Replicator(Snapshotter(state, 0), placement, 0, group, memory)
    first.start_round(1)
    first.finish_round()
    own = first.sizes[0]
    need = 4 * own
    free_now, total = torch.cuda.mem_get_info()
    naive = "gpu" if fits_on_gpu(need, free_now, total) else "host"
    second = Replicator(Snapshotter(state, 0), placement, 0, group, memory, previous=first)
    second.start_round(2)
    committed = second.finish_round()
    figures = {
        "own_gib": round(own / GIB, 2),
        "need_gib": round(need / GIB, 2),
        "free_gib_at_rebuild": round(free_now / GIB, 2),
        "vote_from_free_memory_alone": naive,
        "first": first.choice,
        "rebuilt": second.choice,
        "committed": committed,
        "ballast_gib": round(ballast.numel() / GIB, 1),
    }
    ok = first.choice == second.choice == "gpu" and committed == 2
    return {"status": "pass" if ok else "FAIL", "figures": figures}


def check_pinned_size() -> dict[str, Any]:
    torch = _cuda()
    from megatron_deadpool.devices.pinned import buffer

    def stats() -> dict[str, int]:
        found = torch.cuda.host_memory_stats().items()
        return {k: v for k, v in found if "bytes" in k and isinstance(v, int)}

    nbytes = 9 * MIB + 17
    before = stats()
    ours = buffer(nbytes, torch.device("cpu"), pinned=True)
    after_ours = stats()
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    ours.copy_(src, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    copied = torch.equal(ours, src.cpu())
    theirs = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    after_theirs = stats()
    changed_by_ours = {k: after_ours[k] - before.get(k, 0) for k in after_ours}
    changed_by_torch = {k: after_theirs[k] - after_ours.get(k, 0) for k in after_theirs}
    figures = {
        "requested": nbytes,
        "ours_pinned": ours.is_pinned(),
        "ours_host_allocator_delta": {k: v for k, v in changed_by_ours.items() if v},
        "torch_host_allocator_delta": {k: v for k, v in changed_by_torch.items() if v},
        "async_copy_ok": copied,
    }
    del theirs
    ok = ours.is_pinned() and copied and not figures["ours_host_allocator_delta"]
    return {"status": "pass" if ok else "FAIL", "figures": figures}


def check_round_cost(judged: bool = True, shards_gb: tuple[float, ...] = ()) -> dict[str, Any]:
    torch = _cuda()
    _megatron()
    from megatron_deadpool.replication import pack
    from megatron_deadpool.selftest.gpu_checks import round_cost
    from megatron_deadpool.selftest.gpu_checks.base import Skip

    backend = pack.backend_for(torch.empty(1, device="cuda"))
    wanted = "torch" if os.environ.get("DEADPOOL_PACK_BACKEND") == "torch" else "cuda"
    if backend != wanted:
        raise Skip(f"packs with {backend}, not {wanted}: the kernel row says why")
    return round_cost.check(shards_gb or round_cost.SHARDS_GB, judged=judged)


def check_n2_probe() -> dict[str, Any]:
    _cuda()
    _megatron()
    from megatron_deadpool.selftest.gpu_checks import n2_probe

    return n2_probe.check()


def check_thread_devices() -> dict[str, Any]:
    _cuda()
    _megatron()
    from megatron_deadpool.selftest.gpu_checks import thread_devices

    return thread_devices.check()


def check_device_watch() -> dict[str, Any]:
    torch = _cuda()
    import torch.distributed as dist

    from megatron_deadpool.devices import nccl
    from megatron_deadpool.devices.health import DeviceWatch
    from megatron_deadpool.selftest.gpu_checks.base import world_of_one

    world_of_one(groups=3)
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    errors = nccl.backend_errors()
    ended: list[tuple[int, str]] = []
    watch = DeviceWatch(1.0, end=lambda code, why: ended.append((code, why)))
    torch.cuda._sleep(int(6e9))  # a step whose work is not done for seconds
    watch.step_done(1)
    t0 = time.monotonic()
    while not ended and time.monotonic() - t0 < 10:
        watch(None)
        time.sleep(0.1)
    noticed = time.monotonic() - t0
    torch.cuda.synchronize()
    ended_after_done: list[tuple[int, str]] = []
    done = DeviceWatch(1.0, end=lambda code, why: ended_after_done.append((code, why)))
    done.step_done(2)
    torch.cuda.synchronize()
    time.sleep(1.5)
    done(None)
    figures = {
        "backend_errors": errors,
        "stall_noticed_after_s": round(noticed, 2) if ended else None,
        "exit_code": ended[0][0] if ended else None,
        "false_alarm_on_done_work": bool(ended_after_done),
    }
    ok = errors == [] and bool(ended) and not ended_after_done
    return {"status": "pass" if ok else "FAIL", "figures": figures}


def check_selftest() -> dict[str, Any]:
    _cuda()
    from megatron_deadpool.selftest.table import EXIT_INCOMPLETE

    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "selftest.json")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "megatron_deadpool.cli",
                "selftest",
                "--nproc",
                "1",
                "--json",
                report,
                "--timeout",
                "200",
            ],
            capture_output=True,
            text=True,
            timeout=230,
            check=False,
        )
        rows = json.loads(Path(report).read_text()) if os.path.exists(report) else None
    figures = {"exit_code": proc.returncode, "table": proc.stdout.strip().splitlines()[-12:]}
    if rows is not None:
        figures["json"] = rows
    # One rank checks nothing across ranks: "incomplete" (no row failed) is what one GPU gives.
    ok = proc.returncode in (0, EXIT_INCOMPLETE)
    return {"status": "pass" if ok else "FAIL", "figures": figures}


CHECKS: dict[str, tuple[float, Callable[[], dict[str, Any]], dict[str, str]]] = {
    "versions": (60, check_versions, {}),
    "kernel": (60, check_kernel, {}),
    "pack": (120, check_pack, {}),
    "gens_split": (120, lambda: check_generations("split"), {}),
    "gens_warm": (120, lambda: check_generations("warm"), {}),
    "abort_deadpool": (60, lambda: check_abort("deadpool"), {}),
    "abort_torch": (60, lambda: check_abort("torch"), {}),
    "plan_watch": (60, check_plan_watch, {}),
    "heartbeat_dw": (60, lambda: check_plan_watch(device_watch=True), {}),
    "pinned_repl": (240, check_pinned_replicator, {}),
    "auto_rebuilt": (120, check_auto_rebuilt, {}),
    "pinned_size": (60, check_pinned_size, {}),
    "round_cost": (150, check_round_cost, {}),
    "round_cost_torch": (150, check_round_cost, {"DEADPOOL_PACK_BACKEND": "torch"}),
    "overlap_conn1": (
        90,
        lambda: check_round_cost(judged=False, shards_gb=(1.5,)),
        {"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
    ),
    "n2_probe": (120, check_n2_probe, {}),
    "thread_devices": (90, check_thread_devices, {}),
    "device_watch": (60, check_device_watch, {}),
    "selftest": (240, check_selftest, {}),
}


# ---------------------------------------------------------------------- the run


def _run_one(name: str) -> None:
    """In the child: run one row, print its result as the last line."""
    from megatron_deadpool.selftest.gpu_checks.base import Skip

    try:
        result = CHECKS[name][1]()
    except Skip as exc:
        result = {"status": "skip", "note": str(exc)}
    except Exception as exc:  # noqa: BLE001 - the row failed; say how
        result = {"status": "FAIL", "note": f"{type(exc).__name__}: {str(exc)[:300]}"}
    sys.stdout.flush()
    print("RESULT " + json.dumps(result, default=str), flush=True)
    os._exit(0)  # no teardown: aborted groups and busy streams are this row's, not the next's


def _build_kernel(env: dict[str, str], budget: float) -> tuple[str, str]:
    """Build the pack kernel for this device's architecture only into a temporary folder;
    (folder for PYTHONPATH or "", what happened)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print('%d.%d' % torch.cuda.get_device_capability())"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    if probe.returncode != 0:
        return "", "no CUDA device"
    arch = probe.stdout.strip()
    target = tempfile.mkdtemp(prefix="deadpool-kernel-")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-build-isolation",
            "--no-deps",
            "-q",
            "--target",
            target,
            str(REPO / "cuda_kernels"),
        ],
        capture_output=True,
        text=True,
        timeout=budget,
        check=False,
        env={**env, "TORCH_CUDA_ARCH_LIST": arch},
    )
    if proc.returncode != 0:
        return "", f"build failed: {proc.stderr.strip().splitlines()[-1:]}"
    return target, f"built for sm_{arch.replace('.', '')} only into {target}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write every row's figures to this file")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--only", help="comma-separated rows to run")
    parser.add_argument("--no-build", action="store_true", help="do not build the pack kernel")
    parser.add_argument("--check", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.check:
        _run_one(args.check)
    t_start = time.monotonic()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    names = args.only.split(",") if args.only else list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"gpu_first_contact: error: --only: unknown rows {unknown}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    try:
        import torch

        has_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    except ImportError:
        has_cuda = False
    if has_cuda and not args.no_build:
        code = (
            "import torch; from megatron_deadpool.selftest.gpu_checks.kernel import kernel_state; "
            "print(kernel_state(torch.device('cuda', 0)).backend == 'cuda')"
        )
        try:  # where the package builds the kernel on first use, this may take a while
            have = subprocess.run(
                [sys.executable, "-c", code],
                capture_output=True,
                text=True,
                env=env,
                timeout=240,
                check=False,
            ).stdout.strip()
        except subprocess.TimeoutExpired:
            have = "timed out"
        if have != "True":
            folder, said = _build_kernel(env, min(300.0, args.budget / 2))
            print(f"[first contact] pack kernel: {said}", flush=True)
            if folder:
                env["PYTHONPATH"] = os.pathsep.join([folder, env["PYTHONPATH"]])
    print(f"{'row':<16} {'status':<6} {'s':>6}  figures / note", flush=True)
    for name in names:
        timeout, _, extra = CHECKS[name]
        left = args.budget - (time.monotonic() - t_start)
        t0 = time.monotonic()
        if not has_cuda:
            result: dict[str, Any] = {"status": "skip", "note": "no CUDA device"}
        elif left < 10:
            result = {"status": "skip", "note": "out of the run's time budget"}
        else:
            try:
                proc = subprocess.run(
                    [sys.executable, str(Path(__file__).resolve()), "--check", name],
                    capture_output=True,
                    text=True,
                    timeout=min(timeout, left),
                    env={**env, **extra},
                    check=False,
                )
                lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if lines:
                    result = json.loads(lines[-1][len("RESULT ") :])
                else:
                    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                    result = {"status": "FAIL", "note": f"exit {proc.returncode}: {tail[:200]}"}
            except subprocess.TimeoutExpired:
                result = {"status": "FAIL", "note": f"timed out after {min(timeout, left):.0f}s"}
        result["row"] = name
        result["seconds"] = round(time.monotonic() - t0, 1)
        rows.append(result)
        shown = result.get("note") or json.dumps(result.get("figures", {}), default=str)
        print(f"{name:<16} {result['status']:<6} {result['seconds']:>6}  {shown[:300]}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    failed = [r["row"] for r in rows if r["status"] == "FAIL"]
    print(
        f"[first contact] {len(rows)} rows, {len(failed)} failed {failed or ''} in "
        f"{time.monotonic() - t_start:.0f}s",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
