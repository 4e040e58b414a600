"""`scripts/apply_patches.sh` and the patches under patches/megatron-lm/."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from mlm import APPLY, TAGS, fake_megatron_tree, megatron_lm_tree


def test_apply_patches_refuses_other_versions_and_non_trees(tmp_path: Path) -> None:
    tree = fake_megatron_tree(tmp_path / "mlm", (0, 15, 0), script=False)
    proc = subprocess.run(
        ["bash", str(APPLY), str(tree)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 3
    assert "core_v0.15.0" in proc.stderr
    assert "supported tags: core_v0.16.1, core_v0.19.0." in proc.stderr
    proc = subprocess.run(
        ["bash", str(APPLY), str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2 and "not a Megatron-LM tree" in proc.stderr


@pytest.mark.parametrize("tag", TAGS)
def test_patch_applies_cleanly_to_each_supported_tag(tag: str) -> None:
    tree = megatron_lm_tree(tag)
    proc = subprocess.run(
        ["bash", str(APPLY), str(tree), "--check"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(rf"(applies cleanly|already applied) \({re.escape(tag)}\)", proc.stdout)
