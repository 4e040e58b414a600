"""Every thread DeadPool started selected the rank's CUDA device (N1).

A new thread's current device is 0: a thread that calls the CUDA runtime without selecting the
rank's device (an event query on the heartbeat thread, an event synchronize on the poster
thread) creates a context on GPU 0 for every other rank of the node. One GPU cannot show the
extra context, but it can show which device each thread selected:
`devices.threads.device_threads()` maps each live thread DeadPool started to the CUDA device
index it selected (None: none). The probe runs a round with pinned host replicas (the poster and
the verifier threads; two ranks sharing the GPU on gloo, since gloo cannot send to its own rank
and one GPU cannot hold two NCCL ranks) while a heartbeat runs the device watch, then asks.
`devices.threads` comes with the N1 fix; without it the row fails saying so.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

from .base import Outcome, adam_state

Lookup = Callable[[], Mapping[str, "int | None"]]


def lookup() -> Lookup | None:
    """`devices.threads.device_threads`, or None where this build lacks it."""
    try:
        module = importlib.import_module("megatron_deadpool.devices.threads")
    except ImportError:
        return None
    found = getattr(module, "device_threads", None)
    return found if callable(found) else None


def judge(found: Mapping[str, int | None] | None, device: int | None) -> tuple[bool, str]:
    """(passed, what was wrong) for the threads' devices `found` (None: no way to ask);
    `device`: the rank's CUDA device index (None in the CPU mode: no thread selects one)."""
    if found is None:
        return False, "devices.threads missing: this build cannot tell which device its threads use"
    if not found:
        return False, "no DeadPool thread recorded (expected the heartbeat, poster and verifier)"
    wrong = {name: dev for name, dev in sorted(found.items()) if dev != device}
    if wrong:
        shown = ", ".join(f"{name} -> {'none' if d is None else d}" for name, d in wrong.items())
        where = "none" if device is None else device
        return False, f"threads not on the rank's device {where}: {shown}"
    return True, ""


SHARD_BYTES = 256 << 20
ROUNDS = 2


def child(rank: int, port: int, out_path: str, kind: str = "cuda") -> None:
    """One of the probe's two ranks (`kind` "cuda": both on the current GPU, on gloo, as one GPU
    cannot hold two NCCL ranks): pinned host replicas (the poster and verifier threads), a
    heartbeat running the device watch, `ROUNDS` rounds; then every DeadPool thread's device,
    as JSON. `kind` "cpu": the same in the CPU mode (host replicas, no device watch), which
    checks the probe itself."""
    import datetime
    import json
    from pathlib import Path

    import torch.distributed as dist

    from ...devices import select_device
    from ...devices.health import DeviceWatch
    from ...devices.memory import ReplicaMemory
    from ...hotswap.protocol.connection import Heartbeat, open_client
    from ...hotswap.protocol.membership import Membership, host_store
    from ...hotswap.protocol.seal import JobSeal, new_secret
    from ...replication.placement import Layout, place_replicas
    from ...replication.replicator import Replicator
    from ...replication.snapshot import Snapshotter

    device = select_device("cuda" if kind == "cuda" else "cpu", local_rank=0)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    group = dist.new_group(backend="gloo", timeout=timeout)
    placement = place_replicas(Layout(tp=1, pp=1, dp=2, ranks_per_node=1), 1)
    nbytes = SHARD_BYTES if kind == "cuda" else 4 << 20  # on the CPU: the probe's logic only
    state = adam_state(nbytes // 12, seed=rank, device=str(device.torch_device))
    repl = Replicator(
        Snapshotter(state, rank), placement, rank, group, ReplicaMemory("cpu", device)
    )
    server = host_store("127.0.0.1", 0)
    membership = Membership(server, f"a{rank}", JobSeal(new_secret()))
    gpu_watch = DeviceWatch(60.0, end=lambda code, why: None) if kind == "cuda" else None
    beat = Heartbeat(membership.sibling(open_client(f"127.0.0.1:{server.port}", 30)), 0.1)
    beat.after_beat = gpu_watch
    beat.start()
    ask = lookup()
    committed = []
    try:
        for it in range(1, ROUNDS + 1):
            repl.start_round(it)
            if gpu_watch is not None:
                gpu_watch.step_done(it)
            repl.before_step()
            committed.append(repl.finish_round())
        found = dict(ask()) if ask is not None else None
    finally:
        beat.stop(5)
    result = {
        "rank": rank,
        "device": device.index if kind == "cuda" else None,
        "pinned": bool(repl.pinned),
        "committed": committed,
        "threads": found,
    }
    Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()


def check(timeout_s: float = 80.0, kind: str = "cuda") -> Outcome:
    """The row: two ranks (`child`; on this GPU, or `kind` "cpu"), each judged."""
    import json
    import os
    import socket
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import sys; from megatron_deadpool.selftest.gpu_checks import thread_devices as t; "
        "t.child(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])"
    )
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"r{r}.json") for r in range(2)]
        logs = [os.path.join(tmp, f"r{r}.log") for r in range(2)]
        procs = []
        for r in range(2):
            with open(logs[r], "w") as err:
                args = [sys.executable, "-c", code, str(r), str(port), paths[r], kind]
                procs.append(subprocess.Popen(args, stderr=err))
        codes: list[int | None] = []
        try:
            codes = [p.wait(timeout=timeout_s) for p in procs]
        except subprocess.TimeoutExpired:
            codes = [p.poll() for p in procs]
        finally:
            for p in procs:  # a child past its time holds the GPU: end it with the row
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(c != 0 for c in codes):
            tails = [Path(log).read_text()[-1500:] for log in logs]
            note = f"a rank did not finish (exit codes {codes})"
            return {"status": "FAIL", "figures": {"stderr_tails": tails}, "note": note}
        ranks = [json.loads(Path(p).read_text()) for p in paths]
    notes = []
    for r in ranks:
        ok, note = judge(r["threads"], r["device"])
        if ok and r["committed"] != list(range(1, ROUNDS + 1)):
            ok, note = False, f"rounds committed {r['committed']}"
        if not ok:
            notes.append(f"rank {r['rank']}: {note}")
    status = "FAIL" if notes else "pass"
    return {"status": status, "figures": {"ranks": ranks}, "note": "; ".join(notes)}
