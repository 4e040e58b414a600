"""Resuming from DeadPool's snapshot set with `--load` (resume.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_deadpool.errors import ConfigError


def _snapshot_set(root: Path, iteration: int, **manifest: object) -> None:
    """A set of 4 ranks' files that verify (`--load` checks them), with a manifest."""
    from flats import flat

    from megatron_deadpool.replication import snapshot_set as salvage

    for rank in range(4):
        salvage.write_flat(salvage.rank_file(root, iteration, rank), flat(rank, iteration))
    counters = {"consumed_train": 8 * iteration, "consumed_valid": 0, "skipped_train": 0,
                "flops": 1e9 * iteration}  # fmt: skip
    salvage.write_manifest(root, {"iteration": iteration, "complete": True, "world_size": 4,
                                  "megatron": counters, **manifest})  # fmt: skip


def test_load_resumes_from_a_complete_snapshot_set_newer_than_megatrons(tmp_path: Path) -> None:
    from megatron_deadpool.megatron_lm.resume import snapshot_to_resume

    assert snapshot_to_resume(None, None, 4) is None
    assert snapshot_to_resume(str(tmp_path), None, 4) is None  # nothing saved there
    _snapshot_set(tmp_path, 3)
    point = snapshot_to_resume(str(tmp_path), None, 4)
    assert point is not None and point.iteration == 3
    assert point.counters["consumed_train"] == 24 and point.counters["flops"] == 3e9
    assert snapshot_to_resume(str(tmp_path), 2, 4) is None  # --ckpt-step: Megatron's own
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2\n")
    assert snapshot_to_resume(str(tmp_path), None, 4).iteration == 3  # older than the set
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3\n")  # written from it
    assert snapshot_to_resume(str(tmp_path), None, 4) is None
    with pytest.raises(ConfigError, match="saved by 4 ranks, this run has 8"):
        _snapshot_set(tmp_path, 5)
        snapshot_to_resume(str(tmp_path), None, 8)


def test_an_incomplete_or_foreign_snapshot_set_is_not_resumed(tmp_path: Path) -> None:
    from megatron_deadpool.megatron_lm.resume import snapshot_to_resume
    from megatron_deadpool.replication import snapshot_set as salvage

    _snapshot_set(tmp_path, 3, complete=False, ranks_missing=[2])
    assert salvage.latest_complete(tmp_path) is None
    assert snapshot_to_resume(str(tmp_path), None, 4) is None
    _snapshot_set(tmp_path, 4, megatron=None)  # as `deadpool train` writes them
    with pytest.raises(ConfigError, match="no Megatron counters"):
        snapshot_to_resume(str(tmp_path), None, 4)


def test_resume_hooks_go_only_into_megatrons_training_module() -> None:
    from types import ModuleType

    import torch

    from megatron_deadpool.megatron_lm.resume import install

    assert install(None) is None
    assert install(ModuleType("not_megatron")) is None
    training = ModuleType("training")
    training.setup_model_and_optimizer = lambda *a, **k: ("model", "opt", "sched")
    training.train_step = lambda *a, **k: "stepped"
    training.load_checkpoint = lambda *a, **k: torch.is_grad_enabled()
    resumer = install(training)
    assert resumer is not None and training.train_step._deadpool_resume
    hooked = training.train_step
    install(training)
    assert training.train_step is hooked  # once, not twice
    assert training.train_step(1, iteration=0) == "stepped"  # nothing to resume: inert
    assert training.load_checkpoint() is False  # Megatron's load runs under no_grad
