"""`deadpool megatron-lm`'s fork server imports Megatron from the script's tree, the way the
runner does (`megatron_lm.launch.runner_preload`): a forked process finds the tree's
`megatron.core` and `megatron.training` already imported - never the installed megatron-core -,
the CPU mode on, and nothing of CUDA initialised in the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlm import NEWEST, megatron_lm_tree

from megatron_deadpool.hotswap.launch.warm_start import ForkServer

CODE = """
import json, sys
import megatron, megatron.core, megatron.training
from megatron.core import package_info
from megatron_deadpool.devices.cpu import is_active
print(json.dumps({
    "core": megatron.core.__file__, "training": megatron.training.__file__,
    "version": package_info.__version__, "cpu_mode": is_active(),
    "loaded": sorted({m.__file__ for m in list(sys.modules.values())
                      if m.__name__.startswith("megatron.") and getattr(m, "__file__", None)}),
}))
"""


@pytest.mark.timeout(300)
def test_the_fork_server_imports_the_scripts_tree_never_the_installed_core() -> None:
    from megatron_deadpool.megatron_lm.launch import runner_preload

    tree = megatron_lm_tree(NEWEST)
    script = tree / "pretrain_gpt.py"
    preload = runner_preload(str(script))
    assert preload.path == (str(tree),) and preload.scripts == (str(script),)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    server = ForkServer(preload, env)
    try:
        assert server.hazards == []
        proc = server.spawn([sys.executable, "-c", CODE], env=env, stdout=subprocess.PIPE)
        out, _ = proc.stdout.read(), proc.wait(60)
    finally:
        server.close()
    assert proc.returncode == 0, out
    seen = json.loads(out)
    assert seen["version"].startswith("0.19") and seen["cpu_mode"]
    for path in (seen["core"], seen["training"], *seen["loaded"]):
        assert Path(path).is_relative_to(tree), path  # the tree's, every module of it
    assert len(seen["loaded"]) > 100  # preloaded: Megatron was imported before the fork
