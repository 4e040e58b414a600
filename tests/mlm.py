"""Shared by the Megatron-LM tests (tests/megatron_lm/, the Slurm lab's): the Megatron-LM trees
to run, the tests' `pretrain_gpt.py` arguments and launcher (`launch`, a `Run`), and a fresh
interpreter for code that must not touch the test process.

The end-to-end tests run each supported tag's own `pretrain_gpt.py`; `fake_megatron_tree` makes
a folder that only looks like a tree of a given release. MEGATRON_LM_PATH lists
the Megatron-LM trees to run them against, separated by the path separator (`:`), in any
order; each tree's tag is read from its `megatron/core/package_info.py`. A test of a tag with
no tree in the list skips, naming what to set (README, "Use with Megatron-LM" > "Tested
combinations"). `.ci/run` sets it to prepared copies of `../shared/megatron-lm/<tag>`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_deadpool.megatron_lm.versions import RELEASES, read_version, release_of

REPO = Path(__file__).resolve().parents[1]
APPLY = REPO / "scripts" / "apply_patches.sh"
TAGS = tuple(r.tag for r in RELEASES)
OLDEST, NEWEST = TAGS[0], TAGS[-1]
RUN_TIMEOUT = 300.0
"""Bound on one `deadpool megatron-lm` run of the tests (4 ranks + spares, CPU)."""


def megatron_args(iters: int) -> list[str]:
    """The tests' `pretrain_gpt.py` arguments: a tiny GPT, TP 2 (with 4 ranks: DP 2), mock
    data, every iteration logged, `iters` iterations."""
    return (
        "--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
        "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 "
        f"--global-batch-size 8 --train-iters {iters} --lr 1e-3 --min-lr 1e-4 "
        "--lr-decay-style cosine --lr-warmup-iters 2 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 128 --eval-iters 0 --eval-interval 1000 --log-interval 1 --seed 1234 "
        "--attention-dropout 0.1 --hidden-dropout 0.1"
    ).split()


HANG_HEARTBEAT = ["--deadpool-heartbeat-timeout", "6", "--deadpool-heartbeat-interval", "0.5"]
"""DeadPool flags of the tests whose rank hangs: named after 6 s of silence."""


def drop_in_flight_env() -> dict[str, str]:
    """Children import tests/hooks/drop_in_flight/sitecustomize.py: a failure drops the
    replication round in flight (as if it cut the transfers), so recovery recomputes a step."""
    hook = REPO / "tests" / "hooks" / "drop_in_flight"
    return {"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}


_LINE = re.compile(
    r" iteration\s+(\d+)/\s*\d+ \|.*?learning rate: ([0-9.E+-]+) \|.*?lm loss: ([0-9.E+-]+) \|"
    r".*?grad norm: ([0-9.]+) \|"
)


@dataclass
class Run:
    """A finished `launch`: exit code, the launcher's and ranks' output, summary.json."""

    returncode: int
    text: str
    summary: dict
    run_dir: Path

    def iterations(self) -> dict[int, tuple[str, str, str]]:
        """iteration -> (learning rate, lm loss, grad norm), each logged exactly once."""
        return logged_iterations(self.text)

    def describe(self) -> str:
        return self.text[-6000:]


def logged_iterations(text: str) -> dict[int, tuple[str, str, str]]:
    """iteration -> (learning rate, lm loss, grad norm) of Megatron's lines in `text`, each
    logged exactly once."""
    found: dict[int, tuple[str, str, str]] = {}
    for m in _LINE.finditer(text):
        it = int(m.group(1))
        assert it not in found, f"iteration {it} logged twice"
        found[it] = m.group(2, 3, 4)
    return found


def launch(tmp: Path, name: str, script: Path, args: list[str], *, patched: bool = False,
           env: dict[str, str] | None = None, nproc: int = 4) -> Run:  # fmt: skip
    """`script ARGS` on `nproc` ranks (+ spares, as ARGS say) through `deadpool megatron-lm`'s
    launcher, in this process; its logs under tmp/NAME, its output in tmp/NAME.out. In-place
    respawn off unless ARGS set --deadpool-respawn-limit (these runs test the spare path)."""
    from megatron_deadpool.megatron_lm.launch import MegatronLauncher

    out = tmp / f"{name}.out"
    if "--deadpool" in args and "--deadpool-respawn-limit" not in args:  # unless it respawns
        args = [*args, "--deadpool-respawn-limit", "0"]
    with open(out, "w") as stream:
        rc = MegatronLauncher(str(script), args, nproc, patched=patched, run_dir=str(tmp / name),
                              timeout_s=RUN_TIMEOUT, stream=stream, env=env).run()  # fmt: skip
    summary = json.loads((tmp / name / "summary.json").read_text())
    return Run(rc, out.read_text(errors="replace"), summary, tmp / name)


def no_attention_env() -> dict[str, str]:
    """Children can build `pretrain_gpt.py --spec no_attention_gpt layer`: a GPT layer without
    attention (tests/hooks/no_attention), the model context parallelism trains on CPU."""
    hook = REPO / "tests" / "hooks" / "no_attention"
    return {"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}


def run_python(code: str, timeout: float = 90.0) -> subprocess.CompletedProcess:
    """Run `code` (dedented) in a fresh interpreter; stdout and stderr captured as text."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def fake_megatron_tree(root: Path, version: tuple[int, int, int], script: bool = True) -> Path:
    """A folder that looks like a Megatron-LM tree of `version` (its
    `megatron/core/package_info.py`), with a `pretrain_gpt.py` that only announces "the script
    ran" (unless `script` is False); `root` itself."""
    info = root / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True)
    info.write_text("MAJOR = {}\nMINOR = {}\nPATCH = {}\nPRE_RELEASE = ''\n".format(*version))
    if script:
        (root / "pretrain_gpt.py").write_text("print('the script ran')\n")
    return root


def _trees() -> dict[str, Path]:
    """tag -> tree, for every supported Megatron-LM tree in MEGATRON_LM_PATH."""
    found: dict[str, Path] = {}
    for entry in filter(None, os.environ.get("MEGATRON_LM_PATH", "").split(os.pathsep)):
        tree = Path(entry).expanduser()
        info = tree / "megatron" / "core" / "package_info.py"
        if info.is_file():
            found.setdefault(release_of(read_version(info)).tag, tree)
    return found


def megatron_lm_tree(tag: str = OLDEST) -> Path:
    """The Megatron-LM tree of `tag` from MEGATRON_LM_PATH, ready to run; skips otherwise."""
    tree = _trees().get(tag)
    if tree is None:
        pytest.skip(
            f"no Megatron-LM tree at tag {tag} in MEGATRON_LM_PATH="
            f"{os.environ.get('MEGATRON_LM_PATH', '')!r}: list one tree per tag, separated by "
            f"{os.pathsep!r}, e.g. from scripts/prepare_megatron_lm.sh (README: Use with "
            "Megatron-LM, Tested combinations)"
        )
    if not (tree / "pretrain_gpt.py").is_file():
        pytest.skip(f"{tree} (MEGATRON_LM_PATH) has no pretrain_gpt.py")
    missing = [m for m in ("six", "regex", "einops", "pydantic", "tqdm")
               if importlib.util.find_spec(m) is None]  # fmt: skip
    if missing:
        pytest.skip(f"pretrain_gpt.py needs these packages: pip install {' '.join(missing)}")
    helpers = (
        tree / "megatron/core/datasets" / ("helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))
    )
    if not helpers.exists():
        pytest.skip(f"build Megatron's dataset helpers first: (cd {helpers.parent} && make "
                    f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')})")  # fmt: skip
    return tree
