"""Megatron-LM integration: flags, hooks, runner, launcher, patches.

The unit tests run everywhere. The end-to-end tests run Megatron-LM's own `pretrain_gpt.py`
(tag core_v0.16.1) on CPU, TP2 x DP2 + 1 spare, and skip unless MEGATRON_LM_PATH points at
that tree (README, "Use with Megatron-LM" > Prerequisites):

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

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_deadpool.config.deadpool import DeadpoolConfig
from megatron_deadpool.config.flags import field_docs, flag_name, from_namespace
from megatron_deadpool.errors import ConfigError, DeadpoolRuntimeError
from megatron_deadpool.megatron_lm import extra_args_provider, preparse, wrap_pretrain
from megatron_deadpool.megatron_lm.cpu import CPU_FLAGS, with_cpu_flags
from megatron_deadpool.megatron_lm.replay import BatchRecorder, ReplayError

REPO = Path(__file__).resolve().parents[2]
APPLY = REPO / "scripts" / "apply_patches.sh"
RUN_TIMEOUT = 300.0


# ====================================================================== unit tests
def test_flags_chain_the_scripts_provider_and_cover_every_field() -> None:
    def user(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--my-flag", type=int, default=0)
        return parser

    provider = extra_args_provider(user)
    assert extra_args_provider(provider) is provider  # chained once, never twice
    parser = provider(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(
        shlex.split(
            "--my-flag 3 --deadpool --deadpool-spares 2 --deadpool-replicas 1 "
            "--deadpool-ranks-per-node 2 --deadpool-heartbeat-interval 0.5 "
            "--deadpool-heartbeat-timeout 5 --deadpool-coordinator node7:29400 "
            "--deadpool-fail 2@5 --deadpool-fail node:1@3:hang --deadpool-log-dir /tmp/x"
        )
    )
    assert args.my_flag == 3
    cfg = from_namespace(DeadpoolConfig, args, prefix="deadpool")
    assert cfg.enabled and cfg.spares == 2 and cfg.ranks_per_node == 2
    assert cfg.coordinator == "node7:29400" and cfg.fail == ["2@5", "node:1@3:hang"]
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    for field in dataclasses.fields(DeadpoolConfig):
        name = flag_name("deadpool", field.name)
        assert name in helps, name
        assert helps[name] == field_docs(DeadpoolConfig)[field.name]


def test_no_provider_gives_just_the_deadpool_flags() -> None:
    parser = extra_args_provider(None)(argparse.ArgumentParser(allow_abbrev=False))
    assert parser.parse_args([]).deadpool_enabled is False


def test_preparse_reads_deadpool_flags_among_megatrons() -> None:
    argv = "--tensor-model-parallel-size 2 --save /ckpt --deadpool --deadpool-ranks-per-node 2"
    cfg = preparse(argv.split())
    assert cfg.enabled and cfg.ranks_per_node == 2 and cfg.spares == 0
    assert not preparse(["--num-layers", "2"]).enabled
    with pytest.raises(ConfigError, match="heartbeat-timeout"):
        preparse(["--deadpool", "--deadpool-heartbeat-timeout", "1"])
    with pytest.raises(ConfigError, match="RANK@ITER"):
        preparse(["--deadpool", "--deadpool-fail", "two@five"])


def test_cpu_flags_fill_in_only_what_the_user_left_out() -> None:
    added = with_cpu_flags([])
    for flag, value in CPU_FLAGS:
        assert flag in added
        if value is not None:
            assert added[added.index(flag) + 1] == value
    user = ["--transformer-impl", "transformer_engine", "--distributed-backend=nccl"]
    out = with_cpu_flags(user + ["--no-rope-fusion"])
    assert out.count("--transformer-impl") == 1 and "local" not in out
    assert "gloo" not in out and out.count("--no-rope-fusion") == 1


def test_task_index_and_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_deadpool.hotswap.membership import pid_of
    from megatron_deadpool.megatron_lm.session import task_from_env

    for name in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert task_from_env() == 0
    monkeypatch.setenv("SLURM_PROCID", "8")
    assert task_from_env() == 8
    monkeypatch.setenv("RANK", "5")
    assert task_from_env() == 5
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ConfigError, match="task index"):
        task_from_env()
    # The coordinator's world size decides: tasks beyond it are spares.
    assert [pid_of(t, 4) for t in (0, 3, 4, 5)] == ["a0", "a3", "s0", "s1"]


def test_batch_recorder_replays_the_steps_after_the_restore_iteration() -> None:
    rec = BatchRecorder(iter(range(100)))
    got = []
    for step, take in ((1, 2), (2, 2), (3, 2), (4, 1)):  # step 4 fails after one batch
        rec.begin_step(step)
        got += [next(rec) for _ in range(take)]
    assert got == [0, 1, 2, 3, 4, 5, 6]
    assert rec.rewind_to(2) == 3  # step 3's two batches and step 4's one
    rec.begin_step(3)
    assert [next(rec), next(rec)] == [4, 5]
    rec.begin_step(4)
    assert [next(rec), next(rec)] == [6, 7]  # replayed, then read on
    with pytest.raises(ReplayError, match="not kept"):
        rec.rewind_to(0)  # step 1's batches are no longer kept


def test_recorder_goes_under_megatrons_rerun_iterator() -> None:
    from megatron.core.rerun_state_machine import RerunDataIterator

    from megatron_deadpool.megatron_lm.replay import install_recorder

    it = RerunDataIterator(iter(range(5)))
    (rec,) = install_recorder(it)
    assert it.iterable is rec and install_recorder(it) == [rec]
    assert install_recorder(None) == []
    with pytest.raises(ReplayError, match="RerunDataIterator"):
        install_recorder(iter(range(3)))


class _FakeSession:
    def __init__(self, joined_late: bool = False) -> None:
        self.joined_late = joined_late
        self.deferred: list[str] = []
        self.logged: list[int] = []
        self.extra_roots: list[object] = []

    def defer(self, exc: BaseException, where: str) -> None:
        self.deferred.append(where)

    def before_log(self, total_loss_dict: dict) -> None:
        total_loss_dict["seen"] = True

    def after_log(self, iteration: int) -> None:
        self.logged.append(iteration)

    def training_returned(self, iteration: object) -> None:
        self.returned = iteration


def _megatron_training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                           report_memory_flag, skipped_iter, grad_norm, params_norm,
                           num_zeros_in_grad, max_attention_logit, pg_collection=None,
                           is_first_iteration=False):  # fmt: skip
    """Megatron-LM's `training_log` signature (core_v0.16.1)."""
    if loss_dict == "fail":
        raise RuntimeError("Connection closed by peer")
    if loss_dict == "bug":
        raise DeadpoolRuntimeError("not a peer failure")
    return ("logged", is_first_iteration)


def test_training_log_hook_defers_peer_failures_and_hides_a_newcomers_first_iteration() -> None:
    from megatron_deadpool.megatron_lm.hooks import wrap_training_log

    session = _FakeSession(joined_late=True)
    log = wrap_training_log(_megatron_training_log, session)
    args = (None, {}, 1e-3, 7, 1.0, True, 0, 1.0, None, None, 0)
    assert log(*args, is_first_iteration=True) == ("logged", False)
    assert session.logged == [7]
    assert log("fail", *args[1:]) is True  # report_memory_flag back, failure deferred
    assert session.deferred == ["training_log"]
    with pytest.raises(DeadpoolRuntimeError):
        log("bug", *args[1:])
    survivor = _FakeSession()
    assert wrap_training_log(_megatron_training_log, survivor)(*args, is_first_iteration=True)[1]


def test_between_steps_guard_returns_megatrons_neutral_value() -> None:
    from megatron_deadpool.megatron_lm.hooks import wrap_between_steps

    def post_training_step_callbacks(model, optimizer, opt_param_scheduler, iteration, prof,
                                     num_floating_point_operations_since_last_log_event,
                                     nsys_nvtx_context=None):  # fmt: skip
        raise RuntimeError("gloo: Connection reset by peer")

    session = _FakeSession()
    guarded = wrap_between_steps(
        post_training_step_callbacks,
        session,
        "post-step callbacks",
        lambda b: b.arguments["num_floating_point_operations_since_last_log_event"],
    )
    assert guarded(1, 2, 3, 4, None, 12.5) == 12.5
    assert session.deferred == ["post-step callbacks"]


def test_train_hook_keeps_the_checkpointing_context_for_rebinding() -> None:
    from megatron_deadpool.megatron_lm.hooks import wrap_train

    def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator,
              valid_data_iterator, process_non_loss_data_func, config, checkpointing_context,
              non_loss_data_func, inference_model=None):  # fmt: skip
        return "trained"

    session = _FakeSession()
    context = {"save_strategy": object()}
    assert wrap_train(train, session)(1, 2, 3, 4, 5, 6, 7, 8, context, 10) == "trained"
    assert session.extra_roots == [context]


def test_wrap_pretrain_chains_flags_and_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEADPOOL_DEVICE", "cuda")  # no CPU mode in the test process
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--num-layers", "2"])
    seen = {}

    def pretrain(train_valid_test_dataset_provider, model_provider, model_type,
                 forward_step_func, process_non_loss_data_func=None, extra_args_provider=None,
                 args_defaults={}, store=None):  # noqa: B006  # fmt: skip
        seen["provider"] = extra_args_provider
        return "done"

    def user(parser):
        parser.add_argument("--user-flag")
        return parser

    wrapped = wrap_pretrain(pretrain)
    assert wrap_pretrain(wrapped) is wrapped
    assert wrapped(1, 2, 3, 4, extra_args_provider=user) == "done"
    parser = seen["provider"](argparse.ArgumentParser(allow_abbrev=False))
    assert {"--user-flag", "--deadpool", "--deadpool-spares"} <= set(parser._option_string_actions)


def test_session_refuses_what_it_cannot_protect() -> None:
    from megatron_deadpool.megatron_lm.session import MegatronSession

    session = MegatronSession(DeadpoolConfig(enabled=True), 0, "token")
    ok = SimpleNamespace(use_distributed_optimizer=True, data_parallel_size=2,
                         distributed_timeout_minutes=10)  # fmt: skip
    session._check_megatron_args(ok)
    bad = [
        ({"use_distributed_optimizer": False, "data_parallel_size": 1}, "data-parallel size is 1"),
        ({"fp16": True}, "--fp16"),
        ({"rampup_batch_size": [4, 4, 100]}, "rampup"),
        ({"context_parallel_size": 2}, "context or expert"),
        ({"distributed_timeout_minutes": 0.1}, "below --distributed-timeout-minutes"),
    ]
    for change, message in bad:
        with pytest.raises(ConfigError, match=re.escape(message)):
            session._check_megatron_args(SimpleNamespace(**{**vars(ok), **change}))


def _snapshot_set(root: Path, iteration: int, **manifest: object) -> None:
    from megatron_deadpool.replication import snapshot_set as salvage

    salvage.set_dir(root, iteration).mkdir(parents=True)
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


def _run_python(code: str, timeout: float = 90.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


def test_newcomer_builds_in_a_private_world() -> None:
    proc = _run_python("""
        import datetime, json
        import torch, torch.distributed as dist
        from megatron_deadpool.megatron_lm import newcomer
        asked = []
        real_new_group = dist.new_group
        newcomer.enter(2, 4, asked.append)
        dist.init_process_group(backend="gloo", timeout=datetime.timedelta(minutes=3))
        g = dist.new_group([0, 1, 2, 3], backend="gloo")
        keys = [None] * 4
        dist.all_gather_object(keys, ["a", "b"])
        out = dict(rank=dist.get_rank(), world=dist.get_world_size(),
                   backend=dist.get_backend(), group_rank=dist.get_rank(g), keys=keys,
                   asked=asked[0]["backend"], active=newcomer.active())
        newcomer.leave()
        out["restored"] = dist.new_group is real_new_group and not newcomer.active()
        print(json.dumps(out))
        """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {
        "rank": 2, "world": 4, "backend": "fake", "group_rank": 2, "keys": [["a", "b"]] * 4,
        "asked": "gloo", "active": True, "restored": True,
    }  # fmt: skip


def test_data_loader_workers_drop_inherited_tcp_sockets() -> None:
    proc = _run_python("""
        import os, socket
        from megatron_deadpool.megatron_lm.workers import close_inherited_tcp_sockets
        tcp = socket.socket(); tcp.bind(("127.0.0.1", 0)); tcp.listen()
        unix_a, unix_b = socket.socketpair()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            n = close_inherited_tcp_sockets()
            def is_open(fd):
                try:
                    os.fstat(fd)
                    return 1
                except OSError:
                    return 0
            os.write(w, f"{n} {is_open(tcp.fileno())} {is_open(unix_a.fileno())}".encode())
            os._exit(0)
        os.waitpid(pid, 0)
        print(os.read(r, 100).decode(), tcp.fileno() >= 0)
        """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    closed, tcp_open, unix_open, parent_keeps = proc.stdout.split()
    assert int(closed) >= 1 and tcp_open == "0" and unix_open == "1" and parent_keeps == "True"


def test_launcher_gives_each_rank_torchruns_environment(tmp_path: Path) -> None:
    from megatron_deadpool.megatron_lm.launch import MegatronLauncher

    script = tmp_path / "show_env.py"
    script.write_text(
        "import os, sys\n"
        "print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'],"
        " os.environ['LOCAL_RANK'], os.environ['MASTER_PORT'], sys.argv[1:], flush=True)\n"
    )
    out = tmp_path / "out.txt"
    with open(out, "w") as stream:
        rc = MegatronLauncher(str(script), ["--x", "1"], 3, patched=True, timeout_s=60,
                              run_dir=str(tmp_path / "run"), stream=stream).run()  # fmt: skip
    text = out.read_text()
    assert rc == 0, text
    for r in range(3):
        assert re.search(rf"rank {r} of 3 {r} \d+ \['--x', '1'\]", text), text
        assert (tmp_path / "run" / f"a{r}.log").exists()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["returncode"] == 0 and summary["exit_codes"] == {"a0": 0, "a1": 0, "a2": 0}


def test_launcher_stops_the_job_when_a_rank_fails_without_deadpool(tmp_path: Path) -> None:
    from megatron_deadpool.megatron_lm.launch import MegatronLauncher

    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n    sys.exit(7)\n"
        "time.sleep(120)\n"
    )
    t0 = time.monotonic()
    with open(tmp_path / "out.txt", "w") as stream:
        rc = MegatronLauncher(str(script), [], 2, patched=True, timeout_s=60,
                              run_dir=str(tmp_path / "run"), stream=stream).run()  # fmt: skip
    assert rc == 7 and time.monotonic() - t0 < 40
    assert "a1 exited with code 7" in (tmp_path / "out.txt").read_text()


def test_deadpool_megatron_lm_subcommand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`deadpool megatron-lm ...` through the real CLI entry (registered here in case cli.py
    does not list it yet)."""
    from megatron_deadpool.cli import main as cli

    monkeypatch.setitem(
        cli.COMMANDS, "megatron-lm", ("megatron_deadpool.cli.megatron_lm", "Megatron-LM runner")
    )
    script = tmp_path / "echo.py"
    script.write_text("import os, sys\nprint('task', os.environ['RANK'], sys.argv[1:])\n")
    rc = cli.main(["megatron-lm", "--nproc-per-node", "2", "--patched", "--run-dir",
                   str(tmp_path / "run"), str(script), "--timeout", "5"])  # fmt: skip
    assert rc == 0
    log = (tmp_path / "run" / "a1.log").read_text()
    assert "task 1 ['--timeout', '5']" in log
    assert cli.main(["megatron-lm", "--nproc-per-node", "0", str(script)]) == 2


def test_cli_passes_everything_after_the_script_through() -> None:
    from megatron_deadpool.cli.megatron_lm import configure

    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(
        ["--nproc-per-node", "4", "pretrain_gpt.py", "--timeout", "9", "--deadpool"]
    )
    assert args.nproc_per_node == 4 and args.script == "pretrain_gpt.py"
    assert args.script_args == ["--timeout", "9", "--deadpool"] and args.timeout == 3600.0


def test_report_lines_have_megatrons_shape() -> None:
    from megatron_deadpool.megatron_lm.report import megatron_line, replication_fields

    line = megatron_line(*replication_fields(5, 8, 4, 2048, 0.0021))
    assert re.fullmatch(
        r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+\] deadpool \| iteration +5/ +8 \| committed "
        r"replica iteration: 4 \| replica bytes per iteration: 2\.0 KiB \| replication time "
        r"\(ms\): 2\.1 \|",
        line,
    )


def _fake_tree(root: Path, version: tuple[int, int, int]) -> Path:
    info = root / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True)
    info.write_text("MAJOR = {}\nMINOR = {}\nPATCH = {}\nPRE_RELEASE = ''\n".format(*version))
    return root


def test_apply_patches_refuses_other_versions_and_non_trees(tmp_path: Path) -> None:
    tree = _fake_tree(tmp_path / "mlm", (0, 15, 0))
    proc = subprocess.run(
        ["bash", str(APPLY), str(tree)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 3
    assert "core_v0.15.0" in proc.stderr and "supported tags: core_v0.16.1" in proc.stderr
    proc = subprocess.run(
        ["bash", str(APPLY), str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2 and "not a Megatron-LM tree" in proc.stderr


# ====================================================================== Megatron-LM on CPU
def _megatron_lm() -> Path:
    path = os.environ.get("MEGATRON_LM_PATH")
    if not path:
        pytest.skip(
            "MEGATRON_LM_PATH is not set: export MEGATRON_LM_PATH=<Megatron-LM tree at tag "
            "core_v0.16.1> to run pretrain_gpt.py on CPU (README: Use with Megatron-LM, Prerequisites)"
        )
    tree = Path(path).expanduser()
    if not (tree / "pretrain_gpt.py").is_file():
        pytest.skip(f"MEGATRON_LM_PATH={path} has no pretrain_gpt.py")
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
    assert all(int(c) == int(it) - 1 for it, c in committed[1:-1]) and len(committed) == ITERS
    assert committed[-1] == (str(ITERS), str(ITERS))  # the last step commits its own round
    assert baseline.summary["recoveries"] == []
    digests = baseline.summary["param_digests"]
    assert len(digests) == 4 and digests["0"] == digests["2"] and digests["1"] == digests["3"]
    if importlib.util.find_spec("tensorboard") is not None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        (events,) = (baseline.run_dir.parent / "tb").glob("events.out.tfevents.*")
        acc = EventAccumulator(str(events))
        acc.Reload()
        scalars = acc.Scalars("deadpool/committed-iteration")
        assert [(s.step, s.value) for s in scalars][-1] == (ITERS, ITERS)
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
def test_rank_lost_after_training_completed_costs_nothing(baseline: Run, tmp_path: Path) -> None:
    """Rank 2 is SIGKILLed right after the last step completed and was replicated, before
    pretrain()'s final save: no recovery, the run succeeds with the failure-free iterations,
    and the survivors save the final state - rank 2's from its holder - as a complete snapshot
    set, which the same command with --load turns into Megatron's checkpoint of that step."""
    from megatron_deadpool.replication import snapshot_set as salvage

    tree = _megatron_lm()
    ckpt = tmp_path / "ckpt"
    base = [*MEGATRON_ARGS, "--use-distributed-optimizer", "--save", str(ckpt),
            "--save-interval", "4", *DEADPOOL_ARGS]  # fmt: skip
    run = _launch(tmp_path, "end", tree / "pretrain_gpt.py", [*base, "--deadpool-fail", "2@end"])
    assert run.returncode == 0, run.describe()
    assert run.iterations() == baseline.iterations(), run.describe()
    assert run.summary["recoveries"] == []
    lost = run.summary["lost_after_training"]
    assert lost["dead_ranks"] == [2] and lost["completed_iteration"] == ITERS
    assert lost["save"]["complete"] and lost["save"]["sources"] == {"2": 0}
    actives = {p: c for p, c in run.summary["exit_codes"].items() if p.startswith("a")}
    assert actives == {"a0": 0, "a1": 0, "a2": -9, "a3": 0}
    expected = {r: d for r, d in baseline.summary["param_digests"].items() if r != "2"}
    assert run.summary["param_digests"] == expected
    assert re.search(
        rf"training completed at iteration {ITERS}; rank\(s\) \[2\] lost "
        r"afterwards, in Megatron's final work after training: saved every rank's state",
        run.text,
    )
    manifest = salvage.read_manifest(ckpt, ITERS)
    assert manifest["complete"] and manifest["ranks_present"] == [0, 1, 2, 3]
    assert manifest["megatron"]["consumed_train"] == 8 * ITERS  # global batch 8
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"

    converted = _launch(tmp_path, "converted", tree / "pretrain_gpt.py", [*base, "--load",
                        str(ckpt)])  # fmt: skip
    assert converted.returncode == 0, converted.describe()
    assert re.search(rf"resumed from DeadPool's snapshot set of iteration {ITERS}", converted.text)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    torch = pytest.importorskip("torch")
    ours = torch.load(ckpt / f"iter_{ITERS:07d}/common.pt", weights_only=False)
    theirs = torch.load(baseline.run_dir.parent / f"ckpt/iter_{ITERS:07d}/common.pt",
                        weights_only=False)  # fmt: skip
    for key in ("iteration", "opt_param_scheduler", "num_floating_point_operations_so_far"):
        assert ours[key] == theirs[key], key


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


def test_patch_applies_cleanly_to_the_supported_tag() -> None:
    tree = _megatron_lm()
    proc = subprocess.run(
        ["bash", str(APPLY), str(tree), "--check"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"(applies cleanly|already applied) \(core_v0\.16\.1\)", proc.stdout)
