#!/usr/bin/env python3
"""A node failure of a DeadPool job in the Slurm lab, and the timeline Slurm and DeadPool report.

    sudo .venv/bin/python scripts/slurm/lab_scenarios.py SCENARIO [--iters 400] [--at 150]
        [--site vista] [--extra-args "--deadpool-heartbeat-timeout 3 ..."] [--max-wait 600]

SCENARIO is one of
  none              no failure
  kill-tasks        scripts/inject_failure.sh kills the job's processes on node 1 (n2)
  crash-node        n2 dies whole (its PID namespace's process 1 SIGKILLed, slurmd included)
  freeze-node       every process of n2 SIGSTOPped (a hung node, slurmd included)
  crash-batch-host  n1 dies whole: the batch script, the coordinator, ranks 0 and 1

It brings up a fresh lab of 3 nodes (scripts/slurm/lab.py: 2 active + 1 spare, 2 tasks each),
submits the unchanged sbatch file with the embedded CPU job (TP2 x DP2, the CPU demo model),
fails the node once a task logs iteration AT, and prints one JSON object with every time in
seconds after the failure: the coordinator's events (processes named dead, plans, agreement,
the recovery's phases), each rank's first failed collective, the last iteration logged before
and the first after, when Slurm marked the node not responding and DOWN, srun's and the
coordinator's exit status, and how and when the job ended (a job still held after --max-wait
is cancelled, and says so). The lab is taken down at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lab as labmod

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ("none", "kill-tasks", "crash-node", "freeze-node", "crash-batch-host")
JOB_YAML = """model: {{num_layers: 2, hidden_size: 64, num_attention_heads: 4, seq_length: 64, vocab_size: 128}}
parallel: {{tp: 2, pp: 1, dp: 2}}
train: {{iters: {iters}}}
deadpool: {{replicas: 1, ranks_per_node: 2}}
"""
_LOG_TIME = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) \[deadpool r(\d+) g(\d+)\] (\w+) (.*)$")


def _epoch(clock: str, near: float) -> float:
    """HH:MM:SS.mmm of a log line -> epoch seconds, on the day of `near`."""
    day = datetime.datetime.fromtimestamp(near).date()
    t = datetime.datetime.combine(day, datetime.time.fromisoformat(clock))
    return t.timestamp()


def run(args: argparse.Namespace, lab: Any, out: Path) -> dict[str, Any]:
    config = out / "job.yaml"
    config.write_text(JOB_YAML.format(iters=args.iters))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(lab.env())
    env.update(
        GPUS_PER_NODE="2",
        DEADPOOL_MODULES="",
        PYTHON=sys.executable,
        DEADPOOL_CONFIG=str(config),
        DEADPOOL_LOG_DIR=str(out),
        DEADPOOL_EXTRA_ARGS=args.extra_args,
        PYTHONWARNINGS="ignore",
    )
    site = ["-A", "lab"] if args.site == "perlmutter" else []
    submit = subprocess.run(
        ["sbatch", "--parsable", *site, "--nodes=3", "--ntasks-per-node=2",
         f"--output={out}/batch.out", f"scripts/slurm/{args.site}.sbatch"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    job = submit.stdout.strip().split(";")[0]
    t_submit = time.time()
    node = "n1" if args.scenario == "crash-batch-host" else "n2"
    report: dict[str, Any] = {"scenario": args.scenario, "job": job, "node": node, "logs": str(out)}

    def iteration_seen(n: int) -> bool:
        pattern = re.compile(rf"iteration\s+{n}/")
        return any(pattern.search(p.read_text(errors="replace")) for p in out.glob("task-*.log"))

    def job_state() -> str:
        return lab.slurm("squeue", "-h", "-j", job, "-o", "%T", check=False).strip()

    t_fail = None
    if args.scenario != "none":
        while not iteration_seen(args.at):
            if not job_state() or time.time() - t_submit > args.max_wait:
                raise SystemExit(f"iteration {args.at} never came; see {out}")
            time.sleep(0.05)
        t_fail = time.time()  # the kill or stop is under way from here (inject: ~0.5 s later)
        if args.scenario == "kill-tasks":
            subprocess.run(
                ["bash", "scripts/inject_failure.sh", "--job", job, "--node", node,
                 "--at-seconds", "0"],
                cwd=ROOT, env=env, check=True, timeout=60,
            )  # fmt: skip
        elif args.scenario == "freeze-node":
            lab.freeze(node)
        else:
            lab.crash(node)
        report["failure_took_s"] = round(time.time() - t_fail, 2)
    t0 = t_fail or t_submit
    report["failed_at_epoch"] = t_fail

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 2)

    node_states: list[tuple[float | None, str]] = []
    job_states: list[tuple[float | None, str]] = []
    cancelled = False
    while True:
        state = job_state()
        if not job_states or job_states[-1][1] != state:
            job_states.append((rel(time.time()), state or "(gone)"))
        slurm_node = lab.node_states().get(node, "?")
        if not node_states or node_states[-1][1] != slurm_node:
            node_states.append((rel(time.time()), slurm_node))
        if not state:
            break
        if time.time() - t_submit > args.max_wait and not cancelled:
            lab.slurm("scancel", job, check=False)
            cancelled = True
            job_states.append((rel(time.time()), "scancel (--max-wait reached)"))
        time.sleep(0.5)
    record = dict(re.findall(r"(\w+)=(\S+)", lab.slurm("scontrol", "show", "job", job)))
    report["slurm"] = {
        "job_states": job_states,
        "node_states": node_states,
        "job_state": record.get("JobState"),
        "exit_code": record.get("ExitCode"),
        "run_time": record.get("RunTime"),
    }
    batch = (out / "batch.out").read_text(errors="replace") if (out / "batch.out").exists() else ""
    report["batch_log"] = [
        line for line in batch.splitlines() if line.startswith(("deadpool_launch:", "srun:"))
    ]
    events = []
    if (out / "events.jsonl").exists():
        for line in (out / "events.jsonl").read_text().splitlines():
            e = json.loads(line)
            if e["event"] not in ("roster", "settings"):
                e["t"] = rel(e["t"])
                events.append(e)
    report["coordinator_events"] = events
    ranks: dict[str, Any] = {}
    for path in sorted(out.glob("task-*.log")):
        last_before = first_after = first_failure = None
        for line in path.read_text(errors="replace").splitlines():
            m = _LOG_TIME.match(line)
            if not m:
                continue
            t = _epoch(m.group(1), t0)
            text = m.group(5)
            it = re.match(r"iteration (\d+)/", text)
            if it and t < t0:
                last_before = (int(it.group(1)), rel(t))
            if it and t >= t0 and first_after is None:
                first_after = (int(it.group(1)), rel(t), f"g{m.group(3)}")
            if m.group(4) in ("WARNING", "ERROR") and t >= t0 and first_failure is None:
                first_failure = (rel(t), text[:160])
        ranks[path.stem] = {
            "last_iteration_before": last_before,
            "first_iteration_after": first_after,
            "first_warning_after": first_failure,
        }
    report["tasks"] = ranks
    report["submitted_to_failure_s"] = round(t0 - t_submit, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=SCENARIOS)
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--at", type=int, default=150, help="fail after this iteration")
    parser.add_argument("--site", choices=("vista", "perlmutter"), default="vista")
    parser.add_argument("--extra-args", default="", help="DEADPOOL_EXTRA_ARGS for the workers")
    parser.add_argument("--max-wait", type=float, default=600.0)
    parser.add_argument(
        "--state", help="the lab's private state folder (default: a fresh one, removed after)"
    )
    parser.add_argument("--out", help="log folder (default: a new one under /tmp)")
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix=f"deadpool-{args.scenario}-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        lab = labmod.Lab(args.state) if args.state else labmod.Lab.fresh()
    except labmod.LabError as exc:
        print(f"lab_scenarios: error: {exc}", file=sys.stderr)
        return 2
    try:
        lab.down()  # an earlier lab in that folder, if any (the folder goes with it)
        lab.up(nodes=3, gpus_per_node=4)
        report = run(args, lab, out)
    except labmod.LabError as exc:
        print(f"lab_scenarios: error: {exc}", file=sys.stderr)
        return 2
    finally:
        lab.down()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
