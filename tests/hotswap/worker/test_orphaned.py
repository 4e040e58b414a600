"""A worker with no coordinator left cancels the Slurm job only once Slurm reports every
coordinator host gone (`hotswap/worker/orphaned.py`). The whole path - save, Slurm's verdict, scancel
- runs in the Slurm lab (`tests/cluster/test_slurm_lab.py`); here the decisions."""

from __future__ import annotations

import shutil

import pytest

from megatron_deadpool.hotswap.worker.orphaned import end_slurm_job, gone


def test_slurms_verdict_is_not_responding_or_down() -> None:
    assert gone("down*") and gone("mixed*") and gone("allocated*") and gone("down")
    assert not gone("mixed") and not gone("allocated") and not gone("idle")


def test_outside_a_slurm_job_nothing_is_cancelled() -> None:
    asked = []
    said = end_slurm_job(["n1:29400"], states=asked.append, environ={})
    assert said == "not in a Slurm job: nothing to end" and asked == []


@pytest.mark.skipif(not (shutil.which("sinfo") and shutil.which("scancel")), reason="no Slurm")
def test_a_node_cut_off_cancels_nothing_while_slurm_says_the_coordinators_respond() -> None:
    """Seen from a node cut off from the network the coordinators vanish; Slurm (which
    reaches them) reports them responding, so the job goes on without this node."""
    asked: list[list[str]] = []

    def states(hosts: list[str]) -> dict[str, str]:
        asked.append(hosts)
        return {"n1": "mixed", "n3": "mixed*"}  # n3 gone, n1 still answers Slurm

    environ = {"SLURM_JOB_ID": "7", "DEADPOOL_NODE_DOWN_WAIT": "10"}
    said = end_slurm_job(
        ["n1:29400", "n3:29400"], states=states, environ=environ, sleep=lambda s: None
    )
    assert (
        said.startswith("Slurm still reports the coordinators' hosts as")
        and "not cancelling" in said
    )
    assert asked[0] == ["n1", "n3"] and len(asked) == 6  # every 2 s for 10 s, then once more
