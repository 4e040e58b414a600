"""Megatron-LM integration: its own `pretrain_gpt.py` on CPU with DeadPool.

These tests run Megatron-LM's own `pretrain_gpt.py` (tag core_v0.16.1) on CPU, TP2 x DP2 + 1
spare, and skip unless MEGATRON_LM_PATH points at that tree (README, "Use with Megatron-LM" >
Prerequisites):

    mkdir -p ~/.cache/megatron-lm/core_v0.16.1
    git --git-dir <a clone of NVIDIA/Megatron-LM> archive core_v0.16.1 \\
        | tar -x -C ~/.cache/megatron-lm/core_v0.16.1
    pip install six regex tqdm pydantic einops pybind11 tensorboard
    (cd ~/.cache/megatron-lm/core_v0.16.1/megatron/core/datasets && \\
        make LIBEXT=$(python -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))"))
    export MEGATRON_LM_PATH=~/.cache/megatron-lm/core_v0.16.1

They compare every logged iteration (lm loss, grad norm, learning rate) and the final
parameter digests of runs with a killed rank against a failure-free run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlm import APPLY, REPO
from mlm import megatron_lm_tree as _megatron_lm

RUN_TIMEOUT = 300.0


ITERS = 6
MEGATRON_ARGS = (
    "--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
    "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 "
    f"--train-iters {ITERS} --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
    "--eval-iters 0 --eval-interval 1000 --log-interval 1 --seed 1234 --attention-dropout 0.1 "
    "--hidden-dropout 0.1"
).split()
DEADPOOL_ARGS = ["--deadpool", "--deadpool-spares", "1", "--deadpool-ranks-per-node", "2"]
_LINE = re.compile(
    r" iteration\s+(\d+)/\s*\d+ \|.*?learning rate: ([0-9.E+-]+) \|.*?lm loss: ([0-9.E+-]+) \|"
    r".*?grad norm: ([0-9.]+) \|"
)


@dataclass
class Run:
    returncode: int
    text: str
    summary: dict
    run_dir: Path

    def iterations(self) -> dict[int, tuple[str, str, str]]:
        """iteration -> (learning rate, lm loss, grad norm), each logged exactly once."""
        found: dict[int, tuple[str, str, str]] = {}
        for m in _LINE.finditer(self.text):
            it = int(m.group(1))
            assert it not in found, f"iteration {it} logged twice"
            found[it] = m.group(2, 3, 4)
        return found

    def describe(self) -> str:
        return self.text[-6000:]


def _launch(tmp: Path, name: str, script: Path, args: list[str], *, patched: bool = False,
            env: dict[str, str] | None = None) -> Run:  # fmt: skip
    from megatron_deadpool.megatron_lm.launch import MegatronLauncher

    out = tmp / f"{name}.out"
    with open(out, "w") as stream:
        rc = MegatronLauncher(str(script), args, 4, patched=patched, run_dir=str(tmp / name),
                              timeout_s=RUN_TIMEOUT, stream=stream, env=env).run()  # fmt: skip
    summary = json.loads((tmp / name / "summary.json").read_text())
    return Run(rc, out.read_text(errors="replace"), summary, tmp / name)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Failure-free TP2 x DP2 run with DeadPool on, checkpoints at 3 and 6, TensorBoard."""
    tree = _megatron_lm()
    tmp = tmp_path_factory.mktemp("mlm-baseline")
    args = [*MEGATRON_ARGS, "--use-distributed-optimizer", "--save", str(tmp / "ckpt"),
            "--save-interval", "3", "--tensorboard-dir", str(tmp / "tb"), *DEADPOOL_ARGS]  # fmt: skip
    run = _launch(tmp, "baseline", tree / "pretrain_gpt.py", args)
    assert run.returncode == 0, run.describe()
    return run


def _assert_same_training(run: Run, baseline: Run) -> None:
    assert run.returncode == 0, run.describe()
    assert run.iterations() == baseline.iterations(), run.describe()
    assert sorted(run.iterations()) == list(range(1, ITERS + 1))
    assert run.summary["param_digests"] == baseline.summary["param_digests"]


@pytest.mark.timeout(2 * RUN_TIMEOUT)
def test_failure_free_run_replicates_every_iteration(baseline: Run) -> None:
    assert sorted(baseline.iterations()) == list(range(1, ITERS + 1))
    committed = re.findall(r"deadpool \| iteration +(\d+)/ +\d+ \| committed replica iteration: "
                           r"(\d+|none yet)", baseline.text)  # fmt: skip
    assert committed[0] == ("1", "none yet")
    assert all(int(c) == int(it) - 1 for it, c in committed[1:]) and len(committed) == ITERS
    assert baseline.summary["recoveries"] == []
    digests = baseline.summary["param_digests"]
    assert len(digests) == 4 and digests["0"] == digests["2"] and digests["1"] == digests["3"]
    if importlib.util.find_spec("tensorboard") is not None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        (events,) = (baseline.run_dir.parent / "tb").glob("events.out.tfevents.*")
        acc = EventAccumulator(str(events))
        acc.Reload()
        scalars = acc.Scalars("deadpool/committed-iteration")
        assert [(s.step, s.value) for s in scalars][-1] == (ITERS, ITERS - 1)
        assert "lm loss" in acc.Tags()["scalars"]  # Megatron's own, same writer


def _drop_in_flight_env() -> dict[str, str]:
    """Children import tests/hooks/drop_in_flight/sitecustomize.py: a failure drops the
    replication round in flight (as if it cut the transfers), so recovery recomputes a step."""
    hook = REPO / "tests" / "hooks" / "drop_in_flight"
    return {"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_killed_rank_is_hot_swapped_bitwise(baseline: Run, tmp_path: Path) -> None:
    """Rank 2 is SIGKILLed as iteration 4 starts; the in-flight round is dropped, so the
    survivors roll back to iteration 2 and recompute iteration 3 with replayed data."""
    tree = _megatron_lm()
    args = [*MEGATRON_ARGS, "--use-distributed-optimizer", "--save", str(tmp_path / "ckpt"),
            "--save-interval", "3", *DEADPOOL_ARGS, "--deadpool-fail", "2@4"]  # fmt: skip
    run = _launch(tmp_path, "swap", tree / "pretrain_gpt.py", args, env=_drop_in_flight_env())
    _assert_same_training(run, baseline)
    (rec,) = run.summary["recoveries"]
    assert rec["dead_ranks"] == [2] and rec["replaced_by"] == {"2": "s0"}
    assert rec["restore_iteration"] == 2 and rec["recomputed_iterations"] == 1
    assert rec["stale_group_refs"] == 0
    assert re.search(r"deadpool \| recovered \| generation: 1 \| dead ranks: \[2\] \| "
                     r"restored iteration: 2 \| recomputed iterations: 1", run.text)  # fmt: skip
    # Megatron's own checkpoint after the swap holds the failure-free run's weights.
    torch = pytest.importorskip("torch")
    ours = torch.load(tmp_path / "ckpt/iter_0000006/common.pt", weights_only=False)
    theirs = torch.load(baseline.run_dir.parent / "ckpt/iter_0000006/common.pt",
                        weights_only=False)  # fmt: skip
    for key in ("iteration", "opt_param_scheduler", "num_floating_point_operations_so_far"):
        assert ours[key] == theirs[key], key
    assert ours["args"].consumed_train_samples == theirs["args"].consumed_train_samples


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_out_of_redundancy_saves_every_shard_and_load_resumes_bitwise(
    baseline: Run, tmp_path: Path
) -> None:
    """No spare: rank 2 is SIGKILLed as iteration 4 starts. Its shard survives on its holder,
    so the survivors save a complete snapshot set of the last common iteration and exit 3; the
    same command with --load resumes from it (writing it as a Megatron checkpoint through
    Megatron's save_checkpoint) and logs the failure-free run's iterations from there on."""
    from megatron_deadpool.replication import snapshot_set as salvage

    tree = _megatron_lm()
    ckpt = tmp_path / "ckpt"
    base = [*MEGATRON_ARGS, "--use-distributed-optimizer", "--save", str(ckpt),
            "--save-interval", "100", "--deadpool", "--deadpool-ranks-per-node", "2"]  # fmt: skip
    run = _launch(tmp_path, "oor", tree / "pretrain_gpt.py", [*base, "--deadpool-fail", "2@4"])
    assert run.returncode == 3, run.describe()
    oor = run.summary["out_of_redundancy"]
    assert oor["dead_ranks"] == [2] and "no spare left" in oor["reason"]
    t = oor["save"]["iteration"]
    assert oor["save"]["complete"] and t in (2, 3), oor
    assert {c for p, c in run.summary["exit_codes"].items() if p != "a2"} == {3}
    assert re.search(rf"saved every rank's state of iteration {t} to \S+: run the same "
                     "command with --load", run.text), run.describe()  # fmt: skip
    manifest = salvage.read_manifest(ckpt, t)
    assert manifest["complete"] and manifest["ranks_present"] == [0, 1, 2, 3]
    assert manifest["megatron"]["consumed_train"] == 8 * t  # global batch 8
    assert not (ckpt / "latest_checkpointed_iteration.txt").exists()  # none before the failure

    resumed = _launch(tmp_path, "resumed", tree / "pretrain_gpt.py", [*base, "--load", str(ckpt)])
    assert resumed.returncode == 0, resumed.describe()
    assert re.search(rf"resumed from DeadPool's snapshot set of iteration {t}", resumed.text)
    assert (ckpt / f"iter_{t:07d}" / "metadata.json").is_file()  # Megatron's format now
    ours, theirs = resumed.iterations(), baseline.iterations()
    assert sorted(ours) == list(range(t + 1, ITERS + 1)), resumed.describe()
    assert resumed.summary["param_digests"] == baseline.summary["param_digests"]
    # Megatron does not reset its running loss sums after a process's first logged iteration
    # (`should_reset = not is_first_iteration`), so in any resumed run the line of T+2
    # averages T+1 and T+2; every other value is the failure-free run's, bit for bit.
    for it in ours:
        lr, loss, grad_norm = ours[it]
        assert (lr, grad_norm) == (theirs[it][0], theirs[it][2]), (it, ours[it], theirs[it])
        if it == t + 2:
            mean = (float(theirs[t + 1][1]) + float(theirs[t + 2][1])) / 2
            assert float(loss) == pytest.approx(mean, rel=1e-6), (it, loss, theirs)
        else:
            assert loss == theirs[it][1], (it, ours[it], theirs[it])
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_out_of_redundancy_with_shards_lost_saves_what_survives(tmp_path: Path) -> None:
    """Ranks 0 and 2, each other's replica holder, are SIGKILLed as iteration 5 starts: their
    shards are gone. The survivors save their own snapshots (an incomplete set), name the lost
    ranks and exit 3; --load then resumes from Megatron's checkpoint of iteration 3."""
    from megatron_deadpool.replication import snapshot_set as salvage

    tree = _megatron_lm()
    ckpt = tmp_path / "ckpt"
    base = [*MEGATRON_ARGS, "--use-distributed-optimizer", "--save", str(ckpt),
            "--save-interval", "3", "--deadpool", "--deadpool-ranks-per-node", "2"]  # fmt: skip
    fail = ["--deadpool-fail", "0@5", "--deadpool-fail", "2@5"]
    run = _launch(tmp_path, "lost", tree / "pretrain_gpt.py", [*base, *fail])
    assert run.returncode == 3, run.describe()
    oor = run.summary["out_of_redundancy"]
    assert oor["lost_ranks"] == [0, 2] and oor["lost_shards_holders"] == {"0": [2], "2": [0]}
    assert not oor["save"]["complete"] and oor["save"]["missing"] == [0, 2]
    t = oor["save"]["iteration"]
    assert re.search(rf"shards lost: ranks \[0, 2\]; saved the surviving snapshots of "
                     rf"iteration {t} to \S+; the shards of ranks \[0, 2\] are lost",
                     run.text), run.describe()  # fmt: skip
    manifest = salvage.read_manifest(ckpt, t)
    assert manifest["ranks_present"] == [1, 3] and manifest["ranks_missing"] == [0, 2]
    assert salvage.latest_complete(ckpt) is None

    resumed = _launch(tmp_path, "resumed", tree / "pretrain_gpt.py", [*base, "--load", str(ckpt)])
    assert resumed.returncode == 0, resumed.describe()
    assert "resumed from DeadPool's snapshot set" not in resumed.text
    assert sorted(resumed.iterations()) == [4, 5, 6], resumed.describe()


@pytest.fixture(scope="module")
def nodistopt(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Without --use-distributed-optimizer, rank 1 killed as iteration 4 starts; checkpoint
    of iteration 3 (written before the failure) for the resume test."""
    tree = _megatron_lm()
    tmp = tmp_path_factory.mktemp("mlm-nodistopt")
    args = [*MEGATRON_ARGS, "--save", str(tmp / "ckpt"), "--save-interval", "3",
            *DEADPOOL_ARGS, "--deadpool-fail", "1@4"]  # fmt: skip
    return _launch(tmp, "nodistopt", tree / "pretrain_gpt.py", args)


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_without_distributed_optimizer_the_newcomer_copies_a_dp_peer(
    baseline: Run, nodistopt: Run
) -> None:
    run = nodistopt
    assert run.returncode == 0, run.describe()
    (rec,) = run.summary["recoveries"]
    assert rec["dead_ranks"] == [1] and rec["restore_iteration"] == 3
    # Same data and Adam as the baseline; only the gradient-norm reduction differs from the
    # distributed optimizer's, in the last bits.
    ours, theirs = run.iterations(), baseline.iterations()
    assert sorted(ours) == sorted(theirs)
    for it in ours:
        for a, b in zip(ours[it], theirs[it]):
            assert float(a) == pytest.approx(float(b), rel=1e-5), (it, ours[it], theirs[it])
    digests = run.summary["param_digests"]
    assert digests["0"] == digests["2"] and digests["1"] == digests["3"]


@pytest.mark.timeout(4 * RUN_TIMEOUT)
def test_patched_script_resumes_from_megatrons_checkpoint_and_hot_swaps(
    nodistopt: Run, tmp_path: Path
) -> None:
    """Both resume with --load from the checkpoint of iteration 3: the runner on the
    unmodified script without a failure, the patched script with the last rank (the one that
    prints Megatron's iteration lines) killed as iteration 5 starts. They must agree bit for
    bit (a resumed run is compared with a resumed run: Megatron's own resume is not bitwise
    equal to an uninterrupted run)."""
    tree = _megatron_lm()
    assert nodistopt.returncode == 0, nodistopt.describe()
    load = ["--load", str(nodistopt.run_dir.parent / "ckpt"), "--ckpt-step", "3"]
    reference = _launch(tmp_path, "resumed", tree / "pretrain_gpt.py",
                        [*MEGATRON_ARGS, *load, *DEADPOOL_ARGS])  # fmt: skip
    assert reference.returncode == 0, reference.describe()
    view = tmp_path / "mlm"
    view.mkdir()
    for name in ("megatron", "gpt_builders.py", "model_provider.py"):
        (view / name).symlink_to(tree / name)
    (view / "pretrain_gpt.py").write_bytes((tree / "pretrain_gpt.py").read_bytes())
    applied = subprocess.run(
        ["bash", str(APPLY), str(view)], capture_output=True, text=True, check=False
    )
    assert applied.returncode == 0, applied.stderr
    args = [*MEGATRON_ARGS, *load, *DEADPOOL_ARGS, "--deadpool-fail", "3@5"]
    run = _launch(tmp_path, "patched", view / "pretrain_gpt.py", args, patched=True)
    assert run.returncode == 0, run.describe()
    (rec,) = run.summary["recoveries"]
    assert rec["dead_ranks"] == [3] and rec["restore_iteration"] == 4
    assert sorted(run.iterations()) == [4, 5, 6]
    # Megatron logs a resumed run's first iteration without resetting its running sums, so
    # the line of iteration 5 averages 4 and 5: the newcomer printing it took the sums over.
    assert run.iterations() == reference.iterations(), run.describe()
    assert run.summary["param_digests"] == reference.summary["param_digests"]
