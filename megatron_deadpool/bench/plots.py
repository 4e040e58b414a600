"""The report of `deadpool bench paper`: results.md and its PNG figures (matplotlib, the `plots`
extra).

`markdown` renders the tables, `draw` the figures next to them; each figure function takes the
plain dictionaries `paper.py` writes to its JSON (so figures can be redrawn from a saved result)
and writes one PNG:

- `iteration_time_bars`: failure-free time per iteration of each configuration, with the ratio
  to the run without fault tolerance above each bar; configurations that could not be measured
  are drawn as an empty, hatched slot with the reason's first words.
- `recovery_timeline`: the recovery of the hot swap and of the restart from a checkpoint as
  stacked horizontal bars, one segment per phase, seconds from the failure.
- `loss_curve`: the hot-swap run's losses against the failure-free run's, a vertical line at
  the failure, the recomputed iteration(s) and the failed iteration marked.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from ..config.faults import parse_fault
from ..errors import ConfigError
from .recovery import phase_rows
from .report import markdown_table, yes_no
from .stats import ratio_text

PHASE_COLORS = {
    "detect": "#d62728",
    "agree": "#ff7f0e",
    "reconstruct": "#9467bd",
    "restore": "#2ca02c",
    "teardown": "#8c564b",
    "relaunch_init": "#7f7f7f",
    "checkpoint_load": "#17becf",
    "recompute": "#bcbd22",
    "first_iteration": "#1f77b4",
}


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files, no display); without matplotlib one
    clear error naming the extra that installs it."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ConfigError(
            "plots need matplotlib: pip install 'megatron-deadpool[plots]' (or matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def iteration_time_bars(failure_free: dict[str, Any], path: str | Path, *, title: str = "") -> Path:
    """Bars of amortised s/iteration per configuration (median over repeats, min-max whiskers)."""
    plt = pyplot()
    modes = failure_free["modes"]
    keys = list(modes)
    fig, ax = plt.subplots(figsize=(max(7.5, 1.45 * len(keys) + 1.5), 4.8), dpi=120)
    measured = [modes[k].get("amortised_s") for k in keys]
    top = max([v for v in measured if v] or [1.0])
    for i, key in enumerate(keys):
        m = modes[key]
        value = m.get("amortised_s")
        if value is None:
            ax.bar(i, top * 0.25, color="white", edgecolor="#999999", hatch="//", linewidth=1)
            why = textwrap.fill("not measured: " + (m.get("reason") or "?"), 16)
            why = "\n".join(why.splitlines()[:4]) + ("..." if why.count("\n") > 3 else "")
            ax.text(i, top * 0.27, why, ha="center", va="bottom", fontsize=7, color="#555555")
            continue
        per_run = m.get("per_run_amortised_s") or [value]
        err = [[value - min(per_run)], [max(per_run) - value]]
        color = "#1f77b4" if key == "deadpool" else ("#999999" if key == "no_ft" else "#ff7f0e")
        ax.bar(i, value, color=color, yerr=err, capsize=4, ecolor="#333333")
        label = f"{value:.3f} s" + (f"\n{_bar_ratio(m['ratio'])}" if key != "no_ft" else "")
        ax.text(
            i,
            value + (err[1][0] if err else 0) + top * 0.02,
            label,
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([textwrap.fill(modes[k]["label"], 14) for k in keys], fontsize=8)
    ax.set_ylabel("time per iteration, amortised (s)")
    ax.set_ylim(0, top * 1.35)
    ax.set_title(title or "Failure-free iteration time (ratio to no fault tolerance)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout()
    return _save(fig, plt, path)


def _bar_ratio(summary: dict[str, Any]) -> str:
    """A bar's ratio label: the figure only when its interval excludes 1."""
    if summary["verdict"] in ("higher", "lower"):
        lo, hi = summary["ci"]
        return f"{summary['median']:.2f}x\n[{lo:.2f}-{hi:.2f}]"
    return (
        "no measurable\ndifference" if summary["verdict"] == "none" else "ratio: too\nfew repeats"
    )


def recovery_timeline(recovery: dict[str, Any], path: str | Path, *, title: str = "") -> Path:
    """Stacked phases of the hot swap and of the restart, from the failure on."""
    plt = pyplot()
    rows = [
        ("DeadPool\nhot swap", recovery["deadpool_phases_s"], recovery["deadpool_recovery_s"]),
        ("restart from\ncheckpoint", recovery["restart_phases_s"], recovery["restart_recovery_s"]),
    ]
    labels = recovery.get("phase_labels", {})
    fig, ax = plt.subplots(figsize=(9, 3.9), dpi=120)
    seen: set[str] = set()
    longest = max(total for _, _, total in rows) or 1.0
    for y, (name, phases, total) in enumerate(rows):
        left = 0.0
        for key, seconds in phases.items():
            seconds = max(0.0, float(seconds))
            ax.barh(
                y,
                seconds,
                left=left,
                height=0.55,
                color=PHASE_COLORS.get(key, "#cccccc"),
                edgecolor="white",
                linewidth=0.5,
                label=None if key in seen else labels.get(key, key),
            )
            seen.add(key)
            if seconds > longest * 0.08:
                ax.text(
                    left + seconds / 2,
                    y,
                    f"{seconds:.1f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
            left += seconds
        ax.text(
            left + longest * 0.01, y, f"{total:.1f} s", va="center", fontsize=9, fontweight="bold"
        )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r[0] for r in rows], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, longest * 1.15)
    ax.set_xlabel("seconds from the failure until the failed iteration has completed again")
    ax.set_title(title or "Recovery by phase", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3, fontsize=7.5, frameon=False)
    fig.tight_layout()
    return _save(fig, plt, path)


def loss_curve(loss: dict[str, Any], path: str | Path, *, title: str = "") -> Path:
    """Hot-swap losses vs the failure-free run; failure and recomputed iterations marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.0), dpi=120)
    ref = loss.get("reference_losses") or []
    hot = loss["deadpool_losses"]
    fail_it = int(loss["fail_iteration"])
    recomputed = [int(i) for i in loss.get("recomputed_iterations", [])]
    if ref:
        ax.plot(
            range(1, len(ref) + 1),
            ref,
            color="#999999",
            linewidth=3,
            alpha=0.6,
            label="failure-free run (DeadPool off)",
        )
    its = list(range(1, len(hot) + 1))
    ax.plot(
        its, hot, color="#1f77b4", marker="o", markersize=4, linewidth=1.2, label="hot-swap run"
    )
    x_fail = fail_it - 0.5
    ax.axvline(
        x_fail,
        color="#d62728",
        linestyle="--",
        linewidth=1.2,
        label=f"failure: {loss.get('failure', '')}",
    )
    again = [i for i in recomputed if 1 <= i <= len(hot)]
    if again:
        ax.scatter(
            again,
            [hot[i - 1] for i in again],
            s=110,
            facecolors="none",
            edgecolors="#ff7f0e",
            linewidths=2,
            zorder=5,
            label="recomputed after rollback: " + ", ".join(map(str, again)),
        )
    if 1 <= fail_it <= len(hot):
        ax.scatter(
            [fail_it],
            [hot[fail_it - 1]],
            s=120,
            marker="s",
            facecolors="none",
            edgecolors="#d62728",
            linewidths=1.8,
            zorder=5,
            label=f"failed iteration {fail_it}, run again (restored "
            f"{loss.get('restore_iteration', '?')} from replicas)",
        )
    same = loss.get("bitwise_identical")
    heading = title or "Loss with a failure and a hot swap"
    if same is not None:
        heading += "\nlosses and final parameters bitwise identical to the failure-free run: "
        heading += yes_no(same)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss")
    ax.set_xticks(its if len(its) <= 30 else its[:: max(1, len(its) // 15)])
    ax.set_title(heading, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.tight_layout()
    return _save(fig, plt, path)


def _s(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    """results.md: the failure-free table, the recovery table, the figures."""
    c, s = result["config"], result["settings"]
    lines = [
        "# DeadPool's claims in miniature (`deadpool bench paper`)",
        "",
        (
            f"Job: tp {c['tp']} x pp {c['pp']} x dp {c['dp']} ({c['world']} ranks, "
            f"{c['ranks_per_node']} per node), DeadPool k = {c['replicas']}, {c['spares']} spare(s); "
            f"{s['iters']} iterations per run, N = {s['interval']}, {s['repeats']} repeat(s) of the "
            f"failure-free matrix, {s['recovery_repeats']} of the recovery pair."
        ),
        (
            f"Machine: {result['machine']}. Measured on a shared CPU machine: noisy; every figure "
            "is a median over repeats."
        ),
        f"Command: `{result['command']}` ({result['wall_s'] / 60:.1f} min)",
        "",
        "## Failure-free time per iteration",
        "",
        (
            f"Amortised = mean gap between consecutive iteration ends over iterations "
            f"{s['warmup'] + 1}..{s['iters']} (every save in that window counted; the first save's "
            "one-time start-up, before the window, is shown apart). Ratio = amortised time / the "
            "no-fault-tolerance run's of the same repeat: median over repeats with its 95% "
            "interval, a figure only when the interval excludes 1."
        ),
        "",
    ]
    rows: list[list[str]] = []
    for m in result["failure_free"]["modes"].values():
        if m.get("amortised_s") is None:
            rows.append([m["label"], f"not measured: {m['reason']}", *[""] * 5, m["protects"]])
            continue
        rows.append(
            [
                m["label"],
                _s(m["amortised_s"]),
                _s(m["median_s"]),
                (
                    "-"
                    if m is result["failure_free"]["modes"].get("no_ft")
                    else ratio_text(m["ratio"])
                ),
                str(m["saves_in_window"]),
                _s(m["first_save_s"], 2),
                yes_no(m["losses_match_no_ft"] and m["digests_match_no_ft"]),
                m["protects"],
            ]
        )
    header = [
        "configuration",
        "amortised s/iter",
        "median s/iter",
        "vs no FT",
        "saves in window",
        "first-save start-up (s)",
        "losses = no FT",
        "protection",
    ]
    lines += markdown_table(header, rows)
    notes = result["failure_free"].get("notes") or []
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    r = result.get("recovery")
    if r:
        lines += [
            "",
            (
                f"## Recovery: {r['config']['fail']} (crash), restart baseline checkpoints every "
                f"{r['config']['save_interval']}"
            ),
            "",
            (
                "Seconds from the failure (the dying process's timestamp) until the iteration during "
                f"which it failed has completed again; median of {r['repeats']} repeat(s)."
            ),
            "",
        ]
        rows = [
            *phase_rows(r, _s),
            [
                "**total**",
                f"**{_s(r['deadpool_recovery_s'], 2)} s**",
                f"**{_s(r['restart_recovery_s'], 2)} s**",
            ],
            ["iterations recomputed", str(r["deadpool_recomputed"]), str(r["restart_recomputed"])],
            [
                "same losses + parameters as no failure",
                yes_no(r["deadpool_matches_reference"]),
                yes_no(r["restart_matches_reference"]),
            ],
        ]
        lines += markdown_table(["phase", "DeadPool hot swap", "restart from checkpoint"], rows)
        lines += [
            "",
            (
                f"Restart / hot swap: {ratio_text(r['speedup_ratio'], 1)}; DeadPool restored "
                f"iteration {r['deadpool_restore_iteration']} from memory, the restart loaded the "
                f"checkpoint of iteration {r['restart_checkpoint_iteration']}."
            ),
        ]
    lines += ["", "## Figures", ""]
    for name, what in result.get("figures", {}).items():
        lines.append(f"![{what}]({name})")
    for err in result.get("figure_errors", []):
        lines.append(f"- figure not drawn: {err}")
    return "\n".join(lines) + "\n"


def draw(result: dict[str, Any], out: Path) -> None:
    """The three PNGs next to results.md; a missing matplotlib is noted, not fatal."""
    figures: dict[str, str] = {}
    errors: list[str] = []
    todo = [
        (
            "iteration_time.png",
            "failure-free iteration time",
            lambda p: iteration_time_bars(result["failure_free"], p),
        )
    ]
    if result.get("recovery"):
        todo.append(
            (
                "recovery_timeline.png",
                "recovery by phase",
                lambda p: recovery_timeline(result["recovery"], p),
            )
        )
    if result.get("loss"):
        todo.append(
            (
                "loss_curve.png",
                "loss with the failure",
                lambda p: loss_curve(result["loss"], p),
            )
        )
    for name, what, fn in todo:
        try:
            fn(out / name)
            figures[name] = what
        except RuntimeError as exc:
            errors.append(f"{name}: {exc}")
    result["figures"], result["figure_errors"] = figures, errors


def spare_pool(result: dict[str, Any], path: str | Path, labels: dict[str, str]) -> Path:
    """`deadpool bench goodput`: the spare pool along each DeadPool way's run (it refills when
    a run starts again), the trace's failures dotted."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for mode in ("respawn", "spares"):
        points = [*result["modes"][mode]["spare_pool"]]
        points.append((result["config"]["iters"], points[-1][1]))  # on to the run's end
        ax.step([p[0] for p in points], [p[1] for p in points], where="post", label=labels[mode])
    for spec in result["trace"]:
        ax.axvline(parse_fault(spec).iteration, color="grey", lw=0.5, ls=":")
    ax.set_xlabel("iteration (dotted: a failure of the trace)")
    ax.set_ylabel("spares waiting")
    ax.set_xlim(0, result["config"]["iters"])
    ax.set_ylim(bottom=-0.2)
    ax.legend(loc="lower left", fontsize="small")
    ax.set_title("deadpool bench goodput: the spare pool")
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
