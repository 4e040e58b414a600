"""`deadpool megatron-lm`'s local launcher (megatron_lm/launch.py); its command line is tested
in tests/cli/test_megatron_lm_cli.py."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path


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
