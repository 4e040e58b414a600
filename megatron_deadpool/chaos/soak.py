"""The soak engine: episodes of the job under failures drawn from a seed, checked bitwise.

An episode is one run of the job with failures planned by `schedule.plan_chaos` (kills, hangs
and whole nodes, one event at a time, the spare pool refilled after every swap), compared with
the failure-free run of the same job (run once per iteration count). A failure counts as
recovered when the run's recoveries cover every rank it hit and the run ends with the
failure-free run's losses and parameter digest. `Soak.run` prints one line per episode and per
recovery and returns the report `print_table` shows.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.faults import check_faults, parse_fault
from ..config.job import JobConfig
from ..config.numbers import check_number
from .schedule import (
    episode_seed,
    fired_from_logs,
    match_failures,
    plan_chaos,
    spare_ages,
    time_stats,
)

TEARDOWN_S = 15.0
"""Time a run needs after its limit to stop its processes (the launcher waits up to 10 s)."""
FIRST_FAILURE_COST_S = 15.0
"""Guess of the wall time one failure adds to a run, until a run has measured it."""
YOUNG_SPARE_S = 30.0
"""A replacement spawned less than this before its failure may still be booting (importing
torch and megatron-core takes tens of seconds on a loaded CPU): recovery times are reported
apart for failures that drew such a spare."""


MIN_MINUTES = 1.0
"""The shortest budget a soak accepts: a failure-free reference run and one episode (each some
seconds on an idle CPU, tens under load) with `TEARDOWN_S` after each must fit."""


@dataclass(frozen=True)
class SoakSettings:
    """How long and how hard to soak; checked on creation (`ConfigError` naming the flag)."""

    seed: int
    mtbf_iters: float
    minutes: float
    config: str
    episodes: int | None = None
    run_dir: str | None = None

    def __post_init__(self) -> None:
        check_number(self.minutes, "--minutes", minimum=MIN_MINUTES, unit="minutes")
        check_number(self.mtbf_iters, "--mtbf-iters", minimum=1)
        check_number(self.seed, "--seed", integer=True)
        if self.episodes is not None:
            check_number(self.episodes, "--episodes", integer=True, minimum=1)


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


class _Live:
    """Stands in for the launcher's progress display: prints recoveries and trouble only."""

    KEEP = ("recovered in", "OUT OF REDUNDANCY", "exceeded", "did not report")

    def __init__(self, episode: int) -> None:
        self.episode = episode

    def header(self, text: str) -> None:
        pass

    def iteration(self, rec: dict[str, Any], deadpool: bool) -> None:
        pass

    def event(self, text: str) -> None:
        if any(k in text for k in self.KEEP):
            print(f"  ep {self.episode:3d} | {text}", flush=True)


class Soak:
    """The soak's state: reference runs, episodes, time budget."""

    def __init__(self, job: JobConfig, kinds: tuple[str, ...], settings: SoakSettings) -> None:
        """`job`: the job of every episode (DeadPool on, its spare pool sized for `kinds`)."""
        self.settings = settings
        self.kinds = kinds
        self.job = job
        self._validate()
        self.t0 = time.monotonic()
        self.deadline = self.t0 + 60.0 * settings.minutes
        self.root = Path(settings.run_dir or tempfile.mkdtemp(prefix="deadpool-chaos-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.references: dict[int, dict[str, Any]] = {}
        self.episodes: list[dict[str, Any]] = []
        self.runs = 0

    def _validate(self) -> None:
        """Plan episode 1 and check its specs: bad input fails before any (slow) run."""
        iters, world = self.job.train.iters, self.job.parallel.world_size
        rpn, spares = self.job.ranks_per_node, self.job.deadpool.spares
        specs = self._plan(1)
        check_faults([parse_fault(x) for x in specs], world, rpn, iters, spares)

    def _plan(self, episode: int) -> list[str]:
        """The failures of episode `episode` (`plan_chaos`, seeded by the soak's seed and the
        episode's number)."""
        return plan_chaos(
            episode_seed(self.settings.seed, episode),
            self.job.train.iters,
            self.settings.mtbf_iters,
            self.job.parallel.world_size,
            self.job.ranks_per_node,
            self.job.deadpool.spares,
            self.kinds,
        )

    # ------------------------------------------------------------------ runs
    def _launch(self, job: JobConfig, name: str, limit_s: float, episode: int) -> Any:
        from ..embedded.launch import LocalLauncher

        run_dir = self.root / name
        launcher = LocalLauncher(
            job,
            json_log=str(run_dir / "run.jsonl"),
            run_dir=str(run_dir),
            timeout_s=max(1.0, limit_s),
            quiet=True,
            replenish_spares=True,
        )
        launcher.progress = _Live(episode)  # type: ignore[assignment]
        self.runs += 1
        t = time.monotonic()
        result = launcher.run()
        return result, time.monotonic() - t

    def reference(self, iters: int) -> dict[str, Any] | None:
        """The failure-free run of `iters` iterations (run once, then cached)."""
        if iters in self.references:
            return self.references[iters]
        deadpool = self.job.deadpool.replace(spares=0, fail=[])
        job = dataclasses.replace(
            self.job, train=dataclasses.replace(self.job.train, iters=iters), deadpool=deadpool
        )
        print(f"reference: failure-free run of {iters} iterations ...", flush=True)
        result, wall = self._launch(job, f"reference-{iters}", self._remaining(), 0)
        s = result.summary
        if result.returncode != 0 or not s.get("final_param_digest"):
            print(
                f"reference: FAILED (exit {result.returncode}); logs in {result.run_dir}",
                flush=True,
            )
            return None
        ref = {
            "iters": iters,
            "losses": s["losses"],
            "digest": s["final_param_digest"],
            "wall_s": round(wall, 2),
            "run_dir": str(result.run_dir),
        }
        print(f"reference: {wall:.1f}s, digest {ref['digest'][:16]}", flush=True)
        self.references[iters] = ref
        return ref

    def _remaining(self) -> float:
        return self.deadline - time.monotonic() - TEARDOWN_S

    def estimate(self, n_failures: int, ref: dict[str, Any]) -> float:
        """Expected wall time of an episode with `n_failures`, from the runs so far."""
        done = [e for e in self.episodes if not e["cut"]]
        per_failure = FIRST_FAILURE_COST_S
        times = [f["recovery"]["total_s"] for e in done for f in e["failures"] if f["recovery"]]
        if times:
            per_failure = max(5.0, sum(times) / len(times) + 3.0)
        bases = [
            e["wall_s"] - sum(f["recovery"]["total_s"] for f in e["failures"] if f["recovery"])
            for e in done
        ]
        base = max(bases) if bases else 1.5 * ref["wall_s"]
        return 1.1 * (base + per_failure * n_failures)

    # ------------------------------------------------------------------ episodes
    def episode(self, n: int, ref: dict[str, Any], specs: list[str], estimate: float) -> None:
        job = dataclasses.replace(self.job, deadpool=self.job.deadpool.replace(fail=specs))
        hang_limit = 3.0 * estimate + 120.0
        limit = min(self._remaining(), hang_limit)
        result, wall = self._launch(job, f"ep{n:03d}", limit, n)
        s = result.summary
        cut = result.returncode == 124 and limit < hang_limit
        logs = [p.read_text(errors="replace") for p in Path(result.run_dir).glob("*.log")]
        digest_equal = s.get("final_param_digest") == ref["digest"]
        losses_equal = s.get("losses") == ref["losses"]
        ok = result.returncode == 0 and digest_equal and losses_equal
        failures, unexplained = match_failures(
            specs,
            self.job.ranks_per_node,
            fired_from_logs(logs),
            s.get("recoveries") or [],
            run_ok=ok,
        )
        ages = spare_ages(_events(Path(result.run_dir) / "events.jsonl"))
        for f in failures:
            if f.recovery:
                g = f.recovery["generations"][-1]
                f.recovery["replacement_age_s"] = {
                    member: ages.get(g, {}).get(member)
                    for member in f.recovery["replaced_by"].values()
                }
        record = {
            "episode": n,
            "plan_seed": episode_seed(self.settings.seed, n),
            "iters": job.train.iters,
            "faults": specs,
            "returncode": result.returncode,
            "cut": cut,
            "hung": result.returncode == 124 and not cut,
            "digest": s.get("final_param_digest"),
            "digest_equal": digest_equal,
            "losses_equal": losses_equal,
            "out_of_redundancy": s.get("out_of_redundancy"),
            "failures_injected": sum(f.injected for f in failures),
            "failures_recovered": sum(f.recovered for f in failures),
            "iterations_recomputed": sum(
                r.get("recomputed_iterations", 0) for r in s.get("recoveries") or []
            ),
            "unexplained_recoveries": unexplained,
            "failures": [{"episode": n, **f.to_dict()} for f in failures],
            "estimate_s": round(estimate, 1),
            "wall_s": round(wall, 2),
            "run_dir": str(result.run_dir),
        }
        self.episodes.append(record)
        if cut:
            verdict = "CUT at the soak's deadline (not counted)"
        elif result.returncode == 124:
            verdict = f"HUNG: stopped after {wall:.0f}s (expected ~{estimate:.0f}s)"
        elif ok:
            verdict = f"digest equal ({str(record['digest'])[:16]})"
        elif result.returncode != 0:
            why = (s.get("out_of_redundancy") or {}).get("reason", "")
            verdict = f"FAILED: exit {result.returncode}" + (f" ({why})" if why else "")
        else:
            verdict = "DIGEST MISMATCH" if not digest_equal else "LOSSES DIFFER"
        print(
            f"episode {n}: {wall:.1f}s, {record['failures_recovered']}/"
            f"{record['failures_injected']} failures recovered, "
            f"{record['iterations_recomputed']} iteration(s) recomputed; {verdict}"
            + ("" if ok else f"; logs in {result.run_dir}"),
            flush=True,
        )

    def run(self) -> dict[str, Any]:
        iters = self.job.train.iters
        world, rpn = self.job.parallel.world_size, self.job.ranks_per_node
        spares = self.job.deadpool.spares
        print(
            f"deadpool chaos: seed {self.settings.seed}, MTBF {self.settings.mtbf_iters:g} iterations, "
            f"kinds {','.join(self.kinds)}, {iters} iterations per episode, "
            f"tp={self.job.parallel.tp} pp={self.job.parallel.pp} dp={self.job.parallel.dp} "
            f"({world} ranks, {rpn} per node) + {spares} spares (refilled), "
            f"budget {self.settings.minutes:g} min; logs in {self.root}",
            flush=True,
        )
        ref = self.reference(iters)
        n = 0
        while ref is not None:
            if self.settings.episodes is not None and n >= self.settings.episodes:
                break
            n += 1
            specs = self._plan(n)
            est = self.estimate(len(specs), ref)
            if est > self._remaining():
                print(
                    f"stopping: {self._remaining():.0f}s left, episode {n} needs ~{est:.0f}s",
                    flush=True,
                )
                break
            print(
                f"episode {n}: {len(specs)} failure(s) planned: "
                + (", ".join(specs) or "none")
                + f" (~{est:.0f}s)",
                flush=True,
            )
            self.episode(n, ref, specs, est)
        return self.report(ref)

    # ------------------------------------------------------------------ report
    def report(self, ref: dict[str, Any] | None) -> dict[str, Any]:
        counted = [e for e in self.episodes if not e["cut"]]
        failures = [f for e in counted for f in e["failures"]]
        injected = [f for f in failures if f["injected"]]
        recovered = [f for f in injected if f["recovered"]]
        totals = [f["recovery"]["total_s"] for f in injected if f["recovery"]]
        by_kind = {
            kind: time_stats(
                [f["recovery"]["total_s"] for f in injected if f["recovery"] and f["kind"] == kind]
            )
            for kind in sorted({f["kind"] for f in injected})
        }

        def young(f: dict[str, Any]) -> bool:
            ages = f["recovery"].get("replacement_age_s") or {}
            return any(a is not None and a < YOUNG_SPARE_S for a in ages.values())

        by_age = {
            f"spare_older_than_{YOUNG_SPARE_S:g}s": time_stats(
                [f["recovery"]["total_s"] for f in injected if f["recovery"] and not young(f)]
            ),
            f"spare_younger_than_{YOUNG_SPARE_S:g}s": time_stats(
                [f["recovery"]["total_s"] for f in injected if f["recovery"] and young(f)]
            ),
        }
        phases: dict[str, list[float]] = {}
        for f in injected:
            for k, v in ((f["recovery"] or {}).get("phases_s") or {}).items():
                phases.setdefault(k, []).append(v)
        digest_equal = bool(counted) and all(
            e["digest_equal"] and e["losses_equal"] for e in counted
        )
        return {
            "seed": self.settings.seed,
            "mtbf_iters": self.settings.mtbf_iters,
            "minutes": self.settings.minutes,
            "config": self.settings.config,
            "kinds": list(self.kinds),
            "iters_per_episode": self.job.train.iters,
            "world_size": self.job.parallel.world_size,
            "ranks_per_node": self.job.ranks_per_node,
            "spares": self.job.deadpool.spares,
            "heartbeat_timeout_s": self.job.deadpool.heartbeat_timeout,
            "wall_s": round(time.monotonic() - self.t0, 1),
            "runs": self.runs,
            "episodes": len(counted),
            "episodes_cut": len(self.episodes) - len(counted),
            "iterations_trained": sum(e["iters"] for e in counted),
            "failures_planned": len(failures),
            "failures_injected": len(injected),
            "failures_recovered": len(recovered),
            "failures_by_kind": {
                k: sum(f["kind"] == k for f in injected)
                for k in sorted({f["kind"] for f in injected})
            },
            "iterations_recomputed": sum(e["iterations_recomputed"] for e in counted),
            "digest_equal": digest_equal,
            "episodes_failed": [
                e["episode"]
                for e in counted
                if not (e["digest_equal"] and e["losses_equal"] and e["returncode"] == 0)
                or e["failures_recovered"] != e["failures_injected"]
                or e["unexplained_recoveries"]
            ],
            "recovery_time_s": time_stats(totals),
            "recovery_time_by_kind_s": by_kind,
            "recovery_time_by_spare_age_s": by_age,
            "recovery_phases_mean_s": {
                k: round(sum(v) / len(v), 3) for k, v in phases.items() if v
            },
            "reference": {k: v for k, v in (ref or {}).items() if k != "losses"},
            "run_dir": str(self.root),
            "per_episode": [{k: v for k, v in e.items() if k != "failures"} for e in self.episodes],
            "failures": [f for e in self.episodes for f in e["failures"]],
        }


def print_table(report: dict[str, Any]) -> None:
    rows = report["per_episode"]
    print()
    print(
        f"{'episode':>7} {'iters':>5} {'planned':>7} {'injected':>8} {'recovered':>9} "
        f"{'recomputed':>10} {'wall_s':>7}  result"
    )
    for e in rows:
        result = (
            "cut"
            if e["cut"]
            else (
                "equal"
                if e["digest_equal"] and e["losses_equal"] and e["returncode"] == 0
                else f"FAILED (exit {e['returncode']}, digest "
                f"{'equal' if e['digest_equal'] else 'differs'})"
            )
        )
        print(
            f"{e['episode']:>7} {e['iters']:>5} {len(e['faults']):>7} "
            f"{e['failures_injected']:>8} {e['failures_recovered']:>9} "
            f"{e['iterations_recomputed']:>10} {e['wall_s']:>7.1f}  {result}"
        )
    print(
        f"{'total':>7} {report['iterations_trained']:>5} {report['failures_planned']:>7} "
        f"{report['failures_injected']:>8} {report['failures_recovered']:>9} "
        f"{report['iterations_recomputed']:>10} {report['wall_s']:>7.1f}  digest "
        f"{'equal' if report['digest_equal'] else 'NOT equal'}"
    )
    st = report["recovery_time_s"]
    if st["count"]:
        print(
            f"recovery time (s): n={st['count']} min {st['min']} median {st['median']} "
            f"mean {st['mean']} p90 {st['p90']} max {st['max']}"
        )
        print(
            "  by kind: "
            + ", ".join(
                f"{k} median {v['median']} (n={v['count']})"
                for k, v in report["recovery_time_by_kind_s"].items()
            )
        )
        print(
            "  by replacement spare's age: "
            + ", ".join(
                f"{k.replace('_', ' ')} median {v['median']} (n={v['count']})"
                for k, v in report["recovery_time_by_spare_age_s"].items()
            )
        )
        print(
            "  mean phases: "
            + ", ".join(f"{k} {v}" for k, v in report["recovery_phases_mean_s"].items())
        )
