"""What a launcher prints when its job ended out of redundancy (exit 3): why, what the survivors
saved (as the save folder holds it now, verified as a `--load` would), and the command that
resumes from it - on the launcher's own output, not only in the workers' logs."""

from __future__ import annotations

from pathlib import Path

from ...replication.save_dir import choose_resume
from ..protocol.messages import OutOfRedundancy


def salvage_lines(oor: OutOfRedundancy, save: str | None, resume_command: str) -> list[str]:
    """The lines to print: the reason and lost ranks; what `save` holds that a `--load` resumes
    from (or that it holds nothing resumable, or that no save folder was given); and
    `resume_command`, where there is something to resume."""
    lines = [f"out of redundancy: {oor.reason}"]
    if oor.lost_ranks:
        lines.append(f"ranks whose state no process holds any more: {list(oor.lost_ranks)}")
    if not save:
        lines.append(
            "nothing was saved: no save folder was given (--save); the run starts again from "
            "its last checkpoint, if any"
        )
        return lines
    order = oor.save
    if order is not None and order.missing:
        lines.append(
            f"the survivors' save of iteration {order.iteration} lacks ranks "
            f"{list(order.missing)}: no copy of their state survived"
        )
    resume = choose_resume(save) if Path(save).is_dir() else None
    if resume is None or resume.kind is None:
        lines.append(f"nothing resumable was saved in {save}")
        return lines
    what = "snapshot set" if resume.kind == "snapshots" else "Megatron checkpoint"
    lines.append(f"resumable in {save}: the {what} of iteration {resume.iteration}")
    lines.append(f"resume with: {resume_command}")
    return lines
