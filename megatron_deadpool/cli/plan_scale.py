"""`deadpool plan`'s recovery-at-scale table and its goodput over a failure trace: text, JSON
and plot (the models: `planner/at_scale.py`, `planner/goodput.py`, `planner/trace.py`).

    deadpool plan --model configs/models/gpt-65b.yaml --tp 4 --pp 8 --dp 16 \\
        --cluster configs/clusters/perlmutter.yaml --global-batch-size 1024 \\
        --trace llama3 --spares 64 --plot goodput.png

The cost of each event in the goodput model comes from the recovery table at the trace's GPU
count (or the plan's) and from the flags, each printed with its source.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from ..config.cluster import GB
from ..planner.at_scale import COMPARISONS, TARGET_GPUS, recovery_at_scale
from ..planner.capacity import PlanReport, format_seconds
from ..planner.goodput import LABELS, WAYS, Costs, simulate, young_interval_s
from ..planner.recovery_terms import TARGET_S, RecoveryTerms
from ..planner.trace import Trace

RESTART_S = 600.0
"""A whole-job restart: Meta's FT-HSDP (arXiv 2602.00277) measured a 10-minute stall per failure
with whole-job restarts."""
STORAGE_GB_S = 2000.0
"""Checkpoint storage bandwidth: Llama 3's Tectonic, 2 TB/s sustained ("The Llama 3 Herd of
Models", Section 3.3.1)."""
ETTR_TARGET = 0.99


def scale_dict(scaled: list[RecoveryTerms], skipped: list[str]) -> dict[str, Any]:
    """The recovery table as plain data (JSON)."""
    return {
        "sizes": [
            {
                "gpus": s.gpus,
                "layout": s.layout,
                "restore_bytes": s.restore_bytes,
                "terms": [dataclasses.asdict(t) for t in s.terms],
                "downtime_s": s.downtime_s,
                "total_s": s.total_s,
                "rebuild": dataclasses.asdict(s.rebuild),
                "rebuild_total_s": s.rebuild_total_s,
                "verdict": s.verdict(),
            }
            for s in scaled
        ],
        "skipped": skipped,
        "comparisons": [dataclasses.asdict(c) for c in COMPARISONS],
        "target": {"gpus": TARGET_GPUS, "seconds": TARGET_S},
    }


def format_scale(scaled: list[RecoveryTerms], skipped: list[str]) -> list[str]:
    """The recovery table as text: a column per size, a source per term."""
    lines = [
        "",
        (
            "recovery at scale: a crashed rank replaced (tp, pp and batch per replica kept, "
            "dp scaled)"
        ),
    ]
    if not scaled:
        return lines + [f"  not at {s}" for s in skipped]
    width = 13
    head = f"  {'term':<22}" + "".join(f"{f'{s.gpus:,} GPUs':>{width}}" for s in scaled)
    lines.append(head + "  source")
    for i, term in enumerate(scaled[0].terms):
        cells = "".join(f"{f'{s.terms[i].seconds:.2f} s':>{width}}" for s in scaled)
        kinds = {s.terms[i].kind for s in scaled}
        kind = term.kind
        if len(kinds) > 1:
            kind = "; ".join(
                f"{k} at " + ", ".join(f"{s.gpus:,}" for s in scaled if s.terms[i].kind == k)
                for k in sorted(kinds)
            )
        lines.append(f"  {term.name:<22}{cells}  [{kind}] {term.source}")
    for label, value in (
        ("= until training runs", lambda s: s.downtime_s),
        ("= with the iteration", lambda s: s.total_s),
    ):
        lines.append(f"  {label:<22}" + "".join(f"{f'{value(s):.2f} s':>{width}}" for s in scaled))
    first = scaled[0]
    lines.append(
        f"  a lost node or a hang is found after the heartbeat timeout ({first.detect_node_s:g} s)"
        f" and its blocked survivors stopped by their plan waiters ({first.stop_node_s:.2f} s)"
        f" instead: +{first.node_delay_s:.2f} s on each column [configured, measured here]"
    )
    rebuild = scaled[0].rebuild
    lines.append(
        f"  {'if groups rebuilt':<22}"
        + "".join(f"{f'{s.rebuild_total_s:.1f} s':>{width}}" for s in scaled)
        + f"  [{rebuild.kind}] {rebuild.source}"
    )
    for c in COMPARISONS:
        where = f"{c.gpus:,} GPUs" if c.gpus else c.note
        lines.append(f"  {c.name:<30}{c.seconds:>7.0f} s at {where:<12} [cited] {c.source}")
    target = next((s for s in scaled if s.gpus == TARGET_GPUS), None)
    if target is not None:
        lines.append(f"  target: {target.verdict()}")
    lines += [f"  not at {s}" for s in skipped]
    return lines


def _costs(
    report: PlanReport, rec: RecoveryTerms, trace: Trace, args: argparse.Namespace, gpus: int
) -> tuple[Costs, list[str]]:
    """The goodput model's costs for `report`'s job at `gpus` GPUs, with their sources."""
    dp = report.per_gpu
    recover = rec.recover_s
    state = (dp.weights_bytes + dp.optimizer_shard_bytes) * gpus
    save = (
        args.checkpoint_save_s
        if args.checkpoint_save_s is not None
        else state / (args.storage_gb_s * GB)
    )
    n = len(trace.interruptions)
    mtbf = trace.duration_h * 3600 / n if n else float("inf")
    if args.checkpoint_interval_min is not None:
        interval, why = args.checkpoint_interval_min * 60, "--checkpoint-interval-min"
    else:
        interval = young_interval_s(save, mtbf)
        interval = interval if interval != float("inf") else trace.duration_h * 3600
        why = f"Young's optimum sqrt(2 x {format_seconds(save)} x MTBF {mtbf / 3600:.2f} h) (CACM 1974)"
    hb = rec.term("detect").seconds
    node = hb + rec.node_delay_s
    costs = Costs(
        detect_process_s=hb,
        detect_node_s=node,
        detect_hang_s=node,
        recover_s=recover,
        respawn_s=recover,
        iteration_s=rec.term("failed iteration").seconds,
        restart_s=args.restart_s,
        checkpoint_interval_s=interval,
        checkpoint_save_s=save,
    )
    save_why = (
        "--checkpoint-save-s"
        if args.checkpoint_save_s is not None
        else f"{state / GB:,.0f} GB of weights + optimizer state at {args.storage_gb_s:g} GB/s"
        + (" (Llama 3's Tectonic)" if args.storage_gb_s == STORAGE_GB_S else "")
    )
    restart_why = "Meta FT-HSDP's 10-min stall" if args.restart_s == RESTART_S else "--restart-s"
    first = (
        f"  costs at {gpus:,} GPUs: detect a crash {hb:g} s [measured: its node agent's report] "
        f"/ a lost node or hang {node:.2f} s [configured: the heartbeat timeout; measured: the "
        f"plan waiters' wake-up, less a crash's survivors stop]; recover {recover:.2f} s = survivors "
        "stop + agree + build + repair + join + transfer [the table]; a respawn the same (the "
        "node agent's fork server has torch imported); failed iteration "
        f"{costs.iteration_s:.2f} s [computed]"
    )
    every = f"{interval / 60:.1f} min" if interval >= 60 else format_seconds(interval)
    second = (
        f"  restart {costs.restart_s:g} s [{restart_why}]; checkpoint every {every} [{why}], "
        f"each stalling {format_seconds(save)} [{save_why}]; a hang "
        f"under checkpoint-restart found after {costs.restart_detect_hang_s:g} s [the NCCL "
        "watchdog's default 10 min]"
    )
    return costs, [first, second]


def trace_goodput(
    report: PlanReport, trace: Trace, args: argparse.Namespace
) -> tuple[dict[str, Any], list[str]]:
    """ETTR of the three ways through `trace` for `report`'s job: JSON data and text."""
    lay = report.layout
    gpus = trace.gpus or lay.world_size
    scaled, _ = recovery_at_scale(report, (gpus,))
    rec = scaled[0] if scaled else report.failure
    gpus = rec.gpus
    costs, notes = _costs(report, rec, trace, args, gpus)
    results = {way: simulate(trace, way, costs, report.spares, lay.ranks_per_node) for way in WAYS}
    hours = trace.duration_h
    title = (
        f"goodput over {trace.name}: {len(trace.interruptions)} interruptions in {hours:g} h "
        f"({trace.count(permanent=True)} take their node out for good, "
        f"{trace.count(scope='node')} lose a node, {trace.count(scope='hang')} hang), "
        f"modelled at {gpus:,} GPUs with {report.spares} spare ranks (--spares; "
        f"{report.spare_nodes:g} node(s) of {lay.ranks_per_node})"
    )
    lines = ["", title]
    if trace.source:
        lines.append(f"  trace: {trace.source}")
    lines.append(
        f"  {'way':<28}{'ETTR':>8}{'lost h':>9}{'survived':>10}{'respawns':>10}{'restarts':>10}"
        f"{'spares':>8}"
    )
    for way, r in results.items():
        lines.append(
            f"  {LABELS[way]:<28}{r.ettr:>8.4f}{r.lost_total_s / 3600:>9.1f}{r.recoveries:>10}"
            f"{r.respawns:>10}{r.restarts:>10}{r.spares_used:>8}"
        )
    for way, r in results.items():
        parts = ", ".join(f"{k} {v / 3600:.2f} h" for k, v in r.lost_s.items() if v)
        lines.append(f"  {LABELS[way]} lost: {parts or 'nothing'}")
    lines += notes
    ettr = results["respawn"].ettr
    lines.append(
        f"  DeadPool's ETTR {ettr:.4f} {'meets' if ettr >= ETTR_TARGET else 'misses'} the "
        f"{ETTR_TARGET} target; Meta reports ~90% for Llama 3 with checkpoint-restart, "
        "ByteRobust 97% (arXiv 2509.16293)"
    )
    if results["respawn"].restarts:
        lines.append(
            f"  spares ran out {results['respawn'].restarts} time(s) with respawn (each a "
            "restart): more spares (--spares) trade GPUs for restarts"
        )
    data = {
        "trace": {
            "name": trace.name,
            "duration_h": hours,
            "interruptions": len(trace.interruptions),
            "by_cause": trace.by_cause(),
            "permanent": trace.count(permanent=True),
            "gpus": trace.gpus,
            "source": trace.source,
        },
        "gpus": gpus,
        "spares": report.spares,
        "costs": dataclasses.asdict(costs),
        "ways": {way: dataclasses.asdict(r) for way, r in results.items()},
    }
    return data, lines


def plot_goodput(data: dict[str, Any], path: str | Path) -> Path:
    """The spare pool of the DeadPool ways along the trace and each way's ETTR (matplotlib,
    the `plots` extra)."""
    from ..bench.plots import pyplot  # matplotlib only where a plot is asked for

    plt = pyplot()

    ways = data["ways"]
    fig, (pool_ax, bar_ax) = plt.subplots(
        1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [2.2, 1]}
    )
    end = data["trace"]["duration_h"]
    for way in ("respawn", "spares"):
        points = [*ways[way]["pool"], (end, ways[way]["pool"][-1][1])]
        pool_ax.step(
            [p[0] for p in points], [p[1] for p in points], where="post", label=LABELS[way]
        )
    pool_ax.set_xlabel("hours into the trace")
    pool_ax.set_ylabel("spare ranks waiting")
    pool_ax.set_xlim(0, end)
    pool_ax.set_ylim(bottom=-0.2)
    pool_ax.legend(loc="lower left", fontsize="small")
    pool_ax.set_title(f"spare pool through {data['trace']['name']}")
    values = [ways[w]["ettr"] for w in WAYS]
    bars = bar_ax.bar(range(len(WAYS)), values, color=["#2ca02c", "#1f77b4", "#7f7f7f"])
    for bar, value in zip(bars, values):
        bar_ax.text(
            bar.get_x() + bar.get_width() / 2,
            value,
            f"{value:.3f}",
            ha="center",
            va="bottom",
            fontsize="small",
        )
    bar_ax.set_xticks(range(len(WAYS)), ["respawn", "spares", "ckpt-restart"])
    bar_ax.set_ylim(0, 1.08)
    bar_ax.set_ylabel("effective training time ratio")
    bar_ax.set_title(f"ETTR at {data['gpus']:,} GPUs")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
