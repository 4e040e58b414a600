"""Telling the supported Megatron-LM releases apart, and refusing the others (versions.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlm import fake_megatron_tree, run_python

from megatron_deadpool.errors import ConfigError
from megatron_deadpool.megatron_lm import versions

UNSUPPORTED = "supported tags: core_v0.16.1, core_v0.19.0"


def test_each_release_series_maps_to_its_tag(tmp_path: Path) -> None:
    info = fake_megatron_tree(tmp_path, (0, 19, 1)) / "megatron" / "core" / "package_info.py"
    assert versions.read_version(info) == (0, 19, 1)  # what tag core_v0.19.0 states
    assert versions.release_of((0, 19, 1)).tag == "core_v0.19.0"
    assert versions.release_of((0, 16, 1)).tag == "core_v0.16.1"
    assert versions.release_of((0, 19, 1)).script_parses_args
    assert not versions.release_of((0, 16, 1)).script_parses_args
    for other in ((0, 17, 0), (0, 18, 2), (0, 15, 0), (1, 0, 0)):
        with pytest.raises(ConfigError, match=UNSUPPORTED) as refused:
            versions.release_of(other, info)
        text = str(refused.value)
        assert "\n" not in text and ".".join(map(str, other)) in text and str(info) in text


def test_the_tree_first_on_the_import_path_decides(tmp_path: Path) -> None:
    """As the runner arranges it: the script's folder first, before the installed
    megatron-core (0.16.1 here)."""
    code = """
        import json, sys
        sys.path.insert(0, {root!r})
        from megatron_deadpool.megatron_lm import versions
        try:
            print(json.dumps(versions.current().tag))
        except versions.UnsupportedMegatronError as exc:
            print(json.dumps(str(exc)))
        """
    for version, expected in (((0, 19, 1), "core_v0.19.0"), ((0, 17, 0), UNSUPPORTED)):
        root = fake_megatron_tree(tmp_path / ".".join(map(str, version)), version)
        proc = run_python(code.format(root=str(root)))
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert expected in json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_runner_refuses_an_unsupported_tree_in_one_line(tmp_path: Path) -> None:
    script = fake_megatron_tree(tmp_path, (0, 18, 2)) / "pretrain_gpt.py"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_deadpool.megatron_lm", str(script), "--num-layers", "2"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "the script ran" not in proc.stdout
    info = tmp_path / "megatron" / "core" / "package_info.py"
    assert proc.stderr.strip().splitlines() == [
        f"deadpool: error: megatron: Megatron-LM 0.18.2 ({info}) is not supported; {UNSUPPORTED}"
    ]


def test_python_311_gets_typing_override_for_the_newest_tag() -> None:
    proc = run_python("""
        import typing
        from megatron_deadpool.megatron_lm import versions
        before = hasattr(typing, "override")
        versions.prepare_python(versions.release_of((0, 16, 1)))
        after_16 = hasattr(typing, "override")
        versions.prepare_python(versions.release_of((0, 19, 1)))

        @typing.override
        def f():
            return 1

        print(before, after_16, f(), getattr(f, "__override__", None))
        """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, after_16, called, marked = proc.stdout.split()
    assert called == "1" and marked == "True"
    if sys.version_info < (3, 12):
        assert (before, after_16) == ("False", "False")  # only where a release needs it
