"""`deadpool bench control-plane`: the real coordinator and store protocol at 1,024-16,384 ranks.

No training: the coordinator (`hotswap.coordinator.coordinator.Coordinator`, its store hosted in this
process as `deadpool coordinator` does) at each size, in two settings:

- **coordinator alone** (`coordinator_alone.py`, every `--ranks` size, `--failures` times,
  medians): one client writes what the ranks would (beats, every survivor's report)
  in bulk, so the coordinator's own work is timed: a heartbeat sweep (keys, store requests,
  CPU), crash noticed -> plan published, every report in -> roster published.
- **with simulated ranks** (`--sim-ranks` sizes): simulated ranks (`sim_ranks.py`, several
  processes), each rank with its own store connection, beating, reporting holdings and joining
  generations through `Membership` like a real one:

1. **Steady state** (`--steady` seconds, nothing fails): the coordinator ticks as in
   `deadpool coordinator`. Per heartbeat sweep: keys read, store requests, the coordinator
   thread's CPU and wall time; over the window: the coordinator thread's and the whole
   coordinator process's CPU (the latter includes the store server answering every rank's
   beats) as a share of one core.
2. **Failures** (`--failures`, one at a time): a rank stops beating, stamps its fault and
   is reported exited (as the local launcher sees a crash); every other rank is told a peer
   failed and runs the survivor's side of agreement. Measured: failure -> plan published,
   failure -> roster published (`detect + agree`), failure -> every rank joined, the
   coordinator's phases, and the CPU the coordinator process spent from the failure to the
   roster.
3. **Memory**: the coordinator process's resident memory with every rank connected, and the
   simulated ranks' clients per rank.

    deadpool bench control-plane --ranks 1024 4096 16384 --json control-plane.json

The coordinator is the real one, unchanged, and ticks as `deadpool coordinator` does (every
`supervisor.TICK_S`, at once when a survivor's last report wakes it): the bench watches it
through its observer (`control_plane_job.CostLog`: every sweep's and decision's cost) and reads
its public properties (roster, recoveries, dead members, the detector's sweep interval).

All processes share this machine's cores: a figure that includes the simulated ranks' own work
(failure -> every rank joined, and the reports that precede the roster) is what that many
clients on these cores achieve, not what as many hosts would; the coordinator alone and the
coordinator process's CPU are its own. `planner/measured.py` holds the figures `deadpool plan`
uses.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

from ...config.numbers import number_arg
from ...hotswap.coordinator.coordinator import Coordinator
from ...hotswap.coordinator.events import EventLog
from ...hotswap.coordinator.liveness import kill_groups
from ...hotswap.launch.supervisor import TICK_S
from ...hotswap.protocol.membership import Membership, host_store
from ...hotswap.protocol.seal import SECRET_ENV, JobSeal, new_secret
from ...hotswap.protocol.sealed_store import BATCH_KEYS
from ...hotswap.protocol.store_files import RESERVE, reserve_files
from ...replication.placement import place_replicas
from ..report import publish, text_row
from .control_plane_job import SPARES, CostLog, SimLiveness, layout_for, rss_mib, settings_for
from .coordinator_alone import coordinator_alone


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ranks",
        type=number_arg(integer=True, minimum=1),
        nargs="+",
        default=[1024, 4096, 16384],
        help="job sizes to measure (default 1024 4096 16384; multiples of 32)",
    )
    parser.add_argument(
        "--sim-ranks",
        type=number_arg(integer=True, minimum=1),
        nargs="*",
        default=None,
        help="sizes to also run with simulated ranks, one connection each (default: --ranks)",
    )
    parser.add_argument(
        "--procs",
        type=number_arg(integer=True, minimum=1),
        default=8,
        help="processes that run the simulated ranks (default 8)",
    )
    parser.add_argument(
        "--steady",
        type=number_arg(above=0, unit="seconds"),
        default=10.0,
        help="seconds of steady state per size (default 10)",
    )
    parser.add_argument(
        "--failures",
        type=number_arg(integer=True, minimum=0),
        default=3,
        help=f"failures per size, at most {SPARES} (default 3)",
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=number_arg(above=0, unit="seconds"),
        default=1.0,
        help="seconds between beats (default 1)",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=number_arg(above=0, unit="seconds"),
        default=10.0,
        help="hang timeout in s (default 10)",
    )
    parser.add_argument(
        "--hb-group",
        type=number_arg(integer=True, minimum=1),
        default=64,
        help="simulated ranks per heartbeat connection (default 64; see sim_ranks.py)",
    )
    parser.add_argument(
        "--sim-nice",
        type=number_arg(integer=True, minimum=-20, maximum=19),
        default=10,
        help="niceness of the simulated-rank processes (default 10: the coordinator first)",
    )
    parser.add_argument("--json", dest="json_path", help="write the results as JSON here")
    parser.add_argument(
        "--timeout",
        type=number_arg(above=0, unit="seconds"),
        default=600.0,
        help="limit for connecting or recovering, in s",
    )


class Bench:
    """One job size: the store, the coordinator, the simulated ranks."""

    def __init__(self, ranks: int, args: argparse.Namespace) -> None:
        self.n = ranks
        self.args = args
        self.layout = layout_for(ranks)
        self.procs_n = args.procs
        # One connection per simulated rank, two per heartbeat group (the beats, the plan
        # watch's reads), a few per process.
        groups = -(-(ranks + SPARES) // args.hb_group) + args.procs
        need = ranks + SPARES + 2 * groups + args.procs * 8 + RESERVE
        reserve_files(need, f"the store of {ranks} simulated ranks (or use a larger --hb-group)")
        self.rss0 = rss_mib()
        self.store = host_store("127.0.0.1", 0, timeout_s=args.timeout)
        self.secret = new_secret()  # the simulated ranks get it in their environment
        self.members = Membership(self.store, "coordinator", JobSeal(self.secret))
        self.liveness = SimLiveness()
        self.costs = CostLog()
        self.coord = Coordinator.from_settings(
            settings_for(ranks, args.heartbeat_timeout, args.timeout),
            self.members,
            placement=place_replicas(self.layout, 1),
            liveness=self.liveness,
            events=EventLog(None),
            say=lambda text: print(f"    coordinator: {text[:200]}", file=sys.stderr),
            observer=self.costs,
        )
        self.procs: list[subprocess.Popen] = []
        self._lines: dict[int, bytes] = {}  # stdout fd -> bytes read, not yet a line

    # ------------------------------------------------------------------ set-up
    def start(self) -> float:
        """Publish the first roster, start the simulated ranks; seconds until all connected."""
        t0 = time.monotonic()
        self.coord.start()
        layout = self.layout
        for i in range(self.procs_n):
            cfg = {
                "address": f"127.0.0.1:{self.store.port}",
                "ranks": list(range(i, self.n, self.procs_n)),
                "spares": [f"s{j}" for j in range(SPARES)] if i == 0 else [],
                "layout": {
                    "tp": layout.tp,
                    "pp": layout.pp,
                    "dp": layout.dp,
                    "ranks_per_node": layout.ranks_per_node,
                },
                "replicas": 1,
                "interval": self.args.heartbeat_interval,
                "hb_group": self.args.hb_group,
                "iteration": 100,
                "connect_timeout": self.args.timeout,
            }
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "megatron_deadpool.bench.scale.sim_ranks",
                        json.dumps(cfg),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    start_new_session=True,
                    env={
                        **os.environ,
                        "OMP_NUM_THREADS": "1",
                        SECRET_ENV: self.secret,
                        "DEADPOOL_SIM_NICE": str(self.args.sim_nice),
                    },
                )
            )
        self.client_kib = sum(int(self._expect(p, "ready").split()[2]) for p in self.procs)
        return time.monotonic() - t0

    def _expect(self, proc: subprocess.Popen, word: str) -> str:
        """The next line from a simulated-rank process, which must start with `word`; the
        coordinator keeps ticking meanwhile (it must, for a recovery to complete)."""
        deadline = time.monotonic() + self.args.timeout
        fd = proc.stdout.fileno()  # type: ignore[union-attr]
        while time.monotonic() < deadline:
            pending = self._lines.setdefault(fd, b"")
            if b"\n" in pending:
                line, self._lines[fd] = pending.split(b"\n", 1)
                text = line.decode()
                if not text.startswith(word):
                    raise RuntimeError(f"simulated ranks said {text!r}, not {word}")
                return text
            if select.select([fd], [], [], 0)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(
                        f"a simulated-rank process ended (exit code {proc.wait()}) before {word}"
                    )
                self._lines[fd] += chunk
                continue
            self.coord.tick()
            self.coord.wait(TICK_S)
        raise RuntimeError(f"no {word!r} from the simulated ranks in {self.args.timeout:.0f}s")

    def _send(self, proc: subprocess.Popen, line: str) -> None:
        os.write(proc.stdin.fileno(), (line + "\n").encode())  # type: ignore[union-attr]

    # ------------------------------------------------------------------ measurements
    def steady(self, seconds: float) -> dict[str, Any]:
        """Tick as `deadpool coordinator` does while nothing fails."""
        self.costs.sweeps.clear()
        cpu0, proc0, t0 = time.thread_time(), time.process_time(), time.monotonic()
        while time.monotonic() - t0 < seconds:
            self.coord.tick()
            self.coord.wait(TICK_S)
        wall = time.monotonic() - t0
        self._check_no_false_deaths()
        sweeps = self.costs.sweeps[1:]  # the first may have created counters
        keys = sweeps[0].members if sweeps else 0
        cpu = statistics.median(s.cpu_s for s in sweeps) if sweeps else float("nan")
        wall_s = statistics.median(s.wall_s for s in sweeps) if sweeps else float("nan")
        interval = self.coord.detector.sweep_interval
        return {
            "sweeps": len(sweeps),
            "sweep_interval_s": interval,
            "keys_per_sweep": keys,
            "requests_per_sweep": math.ceil(keys / BATCH_KEYS),
            "sweep_cpu_ms": cpu * 1e3,
            "sweep_wall_ms": wall_s * 1e3,
            "sweep_core_share": cpu / interval,
            "coordinator_thread_core_share": (time.thread_time() - cpu0) / wall,
            "coordinator_process_core_share": (time.process_time() - proc0) / wall,
            "beats_per_s": self.n / self.args.heartbeat_interval,
        }

    def fail_one(self, index: int) -> dict[str, Any]:
        """Crash one rank and measure its recovery."""
        roster = self.coord.roster
        rank = (index + 1) * self.n // (self.args.failures + 1) + 1
        member = roster.slots[rank]
        owner = self.procs[0] if member[0] == "s" else self.procs[int(member[1:]) % self.procs_n]
        self._send(owner, f"kill {member}")
        self._expect(owner, "killed")
        events0 = len(self.coord.events.events)
        decisions0 = len(self.costs.decisions)
        cpu0, proc0 = time.thread_time(), time.process_time()
        t_fail = time.time()
        self.liveness.codes[member] = -signal.SIGKILL
        for proc in self.procs:
            self._send(proc, "fail")
        recovered = len(self.coord.recoveries)
        deadline = time.monotonic() + self.args.timeout
        while len(self.coord.recoveries) == recovered:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the recovery from {member}'s failure did not finish")
            self.coord.tick()
            self.coord.wait(TICK_S)
        for proc in self.procs:
            self._expect(proc, "recovered")
        self._check_no_false_deaths()
        events = {e["event"]: e["t"] for e in self.coord.events.events[events0:]}
        if len(self.costs.decisions) != decisions0 + 1:
            raise RuntimeError(f"the recovery from {member}'s failure was not decided once")
        decided = self.costs.decisions[-1]  # as the roster was published
        record = self.coord.recoveries[-1]
        g = record["generation"]
        stamps = self.members.stamp_times(g, "joined", list(range(self.n)))
        if stamps is None:
            raise RuntimeError(f"generation {g} recovered without every rank's joined stamp")
        joined = max(stamps)
        return {
            "rank": rank,
            "member": member,
            "failure_to_plan_s": events["plan"] - t_fail,
            # the call that decided started when the last report woke the coordinator
            "failure_to_all_reports_s": decided.cost.t_start - t_fail,
            "decide_s": decided.cost.wall_s,
            "decide_cpu_s": decided.cost.cpu_s,
            "failure_to_roster_s": events["agreed"] - t_fail,
            "failure_to_all_joined_s": joined - t_fail,
            "coordinator_thread_cpu_to_roster_s": decided.thread_cpu_s - cpu0,
            "coordinator_process_cpu_to_roster_s": decided.process_cpu_s - proc0,
            "phases_s": record["phases_s"],
        }

    def _check_no_false_deaths(self) -> None:
        """Only the killed ranks may be dead: a live one named hung means its beats did not get
        through in time (the store or this machine could not keep up)."""
        false = sorted(self.coord.dead - set(self.liveness.codes))
        if false:
            raise RuntimeError(
                f"{len(false)} live simulated rank(s) named dead by the heartbeat timeout (e.g. "
                f"{', '.join(false[:5])}): their beats did not reach the store in time"
            )

    def memory(self) -> dict[str, float]:
        return {
            "coordinator_rss_mib": rss_mib(),
            "coordinator_rss_growth_mib": rss_mib() - self.rss0,
            "client_kib_per_rank": self.client_kib / (self.n + SPARES),
        }

    def close(self) -> None:
        for proc in self.procs:
            try:
                self._send(proc, "stop")
            except (BrokenPipeError, OSError):
                pass
        kill_groups(self.procs)
        self.coord.close()


def _median_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over `runs`; the runs themselves under "runs"."""
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {**out, "runs": runs}


def measure(ranks: int, args: argparse.Namespace, progress=print) -> dict[str, Any]:
    """The coordinator against simulated ranks, each with its own store connection."""
    bench = Bench(ranks, args)
    try:
        connect_s = bench.start()
        progress(f"  {ranks} ranks + {SPARES} spares connected in {connect_s:.1f}s")
        steady = bench.steady(args.steady)
        memory = bench.memory()
        failures = [bench.fail_one(i) for i in range(args.failures)]
        for f in failures:
            progress(
                f"  {ranks}: rank {f['rank']} failed -> plan {f['failure_to_plan_s']:.3f}s, "
                f"roster {f['failure_to_roster_s']:.3f}s, all joined "
                f"{f['failure_to_all_joined_s']:.3f}s"
            )
    finally:
        bench.close()
    med = {
        k: statistics.median(f[k] for f in failures)
        for k in (
            "failure_to_plan_s",
            "failure_to_all_reports_s",
            "decide_s",
            "failure_to_roster_s",
            "failure_to_all_joined_s",
            "coordinator_process_cpu_to_roster_s",
        )
    }
    return {
        "ranks": ranks,
        "spares": SPARES,
        "layout": {"tp": bench.layout.tp, "pp": bench.layout.pp, "dp": bench.layout.dp},
        "connect_s": connect_s,
        "steady": steady,
        "memory": memory,
        "failures": failures,
        "median": med,
    }


def table(alone: list[dict[str, Any]], simulated: list[dict[str, Any]]) -> list[str]:
    """The coordinator alone at every size, then with simulated ranks where they ran."""
    sizes = [r["ranks"] for r in alone]
    specs = ("<48", *([">10"] * len(sizes)))
    by_size = {r["ranks"]: r for r in simulated}

    def ms(value: float) -> str:
        return f"{1e3 * value:.1f}ms"

    def line(label: str, cells: list[str]) -> str:
        return text_row([label, *cells], specs)

    def sim(cell: Any) -> list[str]:
        out = []
        for n in sizes:
            r = by_size.get(n)
            out.append("-" if r is None or "error" in r else cell(r))
        return out

    lines = [line("ranks", [str(n) for n in sizes]), "coordinator alone (ranks' writes in bulk):"]
    for label, key, fmt in (
        ("  crash noticed -> plan published", "notice_to_plan_s", ms),
        ("  every report in -> roster published", "reports_to_roster_s", ms),
        ("  heartbeat sweep: coordinator CPU", "sweep_cpu_ms", lambda v: f"{v:.1f}ms"),
        (
            "  sweep CPU / sweep interval (of one core)",
            "sweep_core_share",
            lambda v: f"{100 * v:.1f}%",
        ),
        (
            "  the same with the store server's part",
            "sweep_process_core_share",
            lambda v: f"{100 * v:.1f}%",
        ),
    ):
        lines.append(line(label, [fmt(r[key]) for r in alone]))
    lines.append(
        line(
            "  sweep: keys / store requests",
            [f"{r['keys_per_sweep']}/{r['requests_per_sweep']}" for r in alone],
        )
    )
    lines.append("with simulated ranks (one store connection each):")
    rows: list[tuple[str, Any]] = [
        ("  failure -> plan published", lambda r: f"{r['median']['failure_to_plan_s']:.3f}s"),
        (
            "  failure -> last report in",
            lambda r: f"{r['median']['failure_to_all_reports_s']:.3f}s",
        ),
        ("  failure -> roster published", lambda r: f"{r['median']['failure_to_roster_s']:.3f}s"),
        (
            "  failure -> every rank joined",
            lambda r: f"{r['median']['failure_to_all_joined_s']:.3f}s",
        ),
        (
            "  coordinator process CPU, failure -> roster",
            lambda r: f"{r['median']['coordinator_process_cpu_to_roster_s']:.3f}s",
        ),
        (
            "  coordinator thread, steady (of one core)",
            lambda r: f"{100 * r['steady']['coordinator_thread_core_share']:.1f}%",
        ),
        (
            "  coordinator process incl. store server",
            lambda r: f"{100 * r['steady']['coordinator_process_core_share']:.1f}%",
        ),
        ("  coordinator resident memory", lambda r: f"{r['memory']['coordinator_rss_mib']:.0f}MiB"),
        (
            "  store client memory per simulated rank",
            lambda r: f"{r['memory']['client_kib_per_rank']:.0f}KiB",
        ),
    ]
    lines += [line(label, sim(cell)) for label, cell in rows]
    for r in simulated:
        if "error" in r:
            lines.append(f"  {r['ranks']} simulated ranks: not measured: {r['error']}")
    return lines


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.failures <= SPARES:
        print(f"deadpool bench control-plane: failures: 1 to {SPARES}", file=sys.stderr)
        return 2
    sim_ranks = args.ranks if args.sim_ranks is None else args.sim_ranks
    try:
        for n in {*args.ranks, *sim_ranks}:
            layout_for(n)
    except ValueError as exc:
        print(f"deadpool bench control-plane: {exc}", file=sys.stderr)
        return 2
    if sim_ranks and importlib.util.find_spec("greenlet") is None:
        print(
            "deadpool bench control-plane: the simulated ranks (--sim-ranks) need greenlet: "
            "pip install 'megatron-deadpool[bench]' (or greenlet), or pass --sim-ranks alone "
            "to measure the coordinator by itself",
            file=sys.stderr,
        )
        return 2
    print(
        f"deadpool bench control-plane: {', '.join(map(str, args.ranks))} ranks (simulated: "
        f"{', '.join(map(str, sim_ranks)) or 'none'}), {args.procs} simulated-rank processes, "
        f"heartbeat every {args.heartbeat_interval}s, {args.steady:.0f}s steady, "
        f"{args.failures} failure(s) each; {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}",
        flush=True,
    )
    alone = []
    for n in args.ranks:
        alone.append(_median_runs([coordinator_alone(n, args) for _ in range(args.failures)]))
        print(f"  coordinator alone at {n} ranks: done", flush=True)
    simulated = []
    for n in sim_ranks:
        try:
            simulated.append(measure(n, args, progress=lambda line: print(line, flush=True)))
        except RuntimeError as exc:
            print(f"  {n} simulated ranks: {exc}", flush=True)
            simulated.append({"ranks": n, "error": str(exc)})
    result = {
        "command": "deadpool bench control-plane " + " ".join(sys.argv[3:]),
        "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
        "coordinator_alone": alone,
        "simulated": simulated,
    }
    publish(table(alone, simulated), result, args.json_path)
    return 1 if any("error" in r for r in simulated) else 0
