"""The picture of one run for `deadpool report --plot`: committed iteration, failures,
recoveries with their phases and the spares left, against wall time (matplotlib, the `plots`
extra)."""

from __future__ import annotations

from pathlib import Path

from ..hotswap.report.timeline import Timeline
from .plots import PHASE_COLORS, pyplot


def draw_timeline(tl: Timeline, path: str | Path, title: str = "") -> None:
    """Two panels sharing the time axis: the committed iteration (a step line; failures as red
    dashed lines; each recovery as a bar of its phases, ending when it completed), and the
    spares waiting."""
    plt = pyplot()

    fig, (top, bottom) = plt.subplots(
        2, 1, sharex=True, figsize=(10.5, 5), gridspec_kw={"height_ratios": [3, 1]}
    )
    if tl.committed:
        xs, ys = zip(*tl.committed)
        top.step(xs, ys, where="post", color="#1f77b4", label="committed iteration")
    top_y = max([y for _, y in tl.committed], default=1)
    for i, t in enumerate(tl.failures):
        top.axvline(t, color="#d62728", linestyle="--", linewidth=1,
                    label="process dead" if i == 0 else None)  # fmt: skip
    shown: set[str] = set()
    for rec in tl.recoveries:
        phases = rec.get("phases_s") or {}
        left = rec["t"] - sum(phases.values())
        for phase, seconds in phases.items():
            top.barh(top_y * 0.5, seconds, left=left, height=max(top_y * 0.15, 0.5),
                     color=PHASE_COLORS.get(phase, "#999999"),
                     label=phase if phase not in shown else None)  # fmt: skip
            shown.add(phase)
            left += seconds
        respawns = len(rec.get("respawned") or {})
        spares = len(rec.get("replaced_by") or {}) - respawns
        how = ", ".join(text for n, text in ((respawns, "respawn"), (spares, "spare")) if n)
        top.annotate(f"{rec.get('total_s', 0):.2f}s\n{how}", (rec["t"], top_y * 0.5),
                     fontsize=8, xytext=(3, 6), textcoords="offset points")  # fmt: skip
    if not tl.committed:  # a run folder without iteration records (`deadpool megatron-lm`'s)
        top.annotate("committed iteration: no per-iteration records in the run folder "
                     "(give --json-log)", (0.01, 0.95), xycoords="axes fraction", fontsize=8,
                     va="top", ha="left")  # fmt: skip
    top.set_ylabel("iteration")
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # beside: no data hidden
    top.set_title(title or "DeadPool run: committed iteration, failures and recoveries")
    end = max([t for t, _ in tl.committed] + [r.t for r in tl.rows] + [1.0])
    steps = [*tl.spares, (end, tl.spares[-1][1])] if tl.spares else [(0.0, 0), (end, 0)]
    sx, sy = zip(*steps)
    bottom.step(sx, sy, where="post", color="#2ca02c")
    bottom.set_ylabel("spares")
    bottom.set_xlabel("seconds from the job's start")
    bottom.set_ylim(-0.2, max(sy) + 0.8)
    if tl.committed:  # the start-up (imports, process groups) said in words, not drawn
        first = tl.committed[0][0]
        left = max(0.0, min([first, *tl.failures]) - 2.0)
        if left > 0:
            bottom.set_xlim(left=left)
            top.annotate(f"start-up: {first:.1f}s", (0.01, 0.95), xycoords="axes fraction",
                         fontsize=8, va="top", ha="left")  # fmt: skip
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
