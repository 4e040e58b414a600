"""An outsider on a running job's store writes every key the job reads and adds to every counter
it uses - the keys generated from the key table (`messages.Keys`), so a key added there is
covered here without a line of this test changing.

The outsider is a plain `TCPStore` client without the job's secret, on `deadpool train --tp 2
--dp 2 --spares 1 --fail 1@4 --fail 2@8 --save S` (a hot swap into generation 1, then out of
redundancy: the survivors save, exit 3). As soon as the store answers it
  - puts a forged value into every sealed key of the table that is not there yet, for every
    generation, rank, member and phase the job can reach (`compare_set` on an absent key: the
    job's own later value replaces it, as it would replace any stranger's);
  - adds a large negative, then a large positive amount (net: far out of range) to every
    counter, and pushes junk into the coordinator's wake-up queue.
The job must end as it does without the outsider - exit 3 with a complete set that `--load`
resumes from to the failure-free run's losses and parameter digest - or with a stated error;
never a silent wrong result, a lost save or a hang (the test's timeout).

Left out, and why: torch's own rendezvous keys (`Keys.PROCESS_GROUPS`: the README's trust model -
a stranger can break a rendezvous, as with torch alone), the fault-injection counters
(`Keys.FAULT_FIRED`: the test's own failures, not the job's protocol), and overwriting a value
the job already wrote (that deletes it: a denial of service, which no MAC prevents).
"""

from __future__ import annotations

import datetime
import itertools
import json
import string
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import TrainRun, run_deadpool, train_case
from test_forged_store import _store_address

from megatron_deadpool.hotswap.protocol.messages import Keys
from megatron_deadpool.replication import snapshot_set

ITERS = 8
ARGS = ["--tp", "2", "--dp", "2", "--spares", "1", "--fail", "1@4", "--fail", "2@8"]

VALUES: dict[str, tuple[object, ...]] = {
    "g": (0, 1, 2, 3),
    "rank": (0, 1, 2, 3),
    "member": ("a0", "a1", "a2", "a3", "s0", "s1", "task0"),
    "phase": ("joined", "restored", "first_iteration"),
    "iteration": (1, 4, 7, 8),
    "n": (1, 2, 3),
    "number": (1, 2, 3),
    "node": (0, 1, 2),
    "index": (0, 1),
    "who": (0, 1, 2, "s0"),
}
"""What each field of a key template takes: every generation, rank, member, phase ... this job
can reach (a field the table gains and this lacks fails the test, naming it)."""

LEFT_OUT = {Keys.PROCESS_GROUPS, Keys.FAULT_FIRED}
"""Templates the outsider leaves alone (module docstring)."""

QUEUES = {Keys.INBOX}
"""Unsealed keys that are queues, not counters: junk is pushed there."""


def templates() -> list[str]:
    """Every key template of the table."""
    return sorted(
        {v for k, v in vars(Keys).items() if k.isupper() and isinstance(v, str)} - LEFT_OUT
    )


def instances(template: str) -> list[str]:
    """Every key of `template` this job can reach."""
    fields = sorted({f for _, f, _, _ in string.Formatter().parse(template) if f})
    missing = [f for f in fields if f not in VALUES]
    assert not missing, f"{template}: give VALUES the field(s) {missing}"
    combos = itertools.product(*(VALUES[f] for f in fields))
    return [template.format(**dict(zip(fields, combo))) for combo in combos]


def unsealed(template: str) -> bool:
    return template in Keys.UNSEALED


class Outsider(threading.Thread):
    """The plain store client, writing and adding as the module docstring says."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(daemon=True)
        self.run_dir = run_dir
        self.error: BaseException | None = None
        self.forged: list[str] = []
        self.counted: list[str] = []

    def run(self) -> None:
        try:
            self._act()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def _act(self) -> None:
        host, port = _store_address(self.run_dir).rsplit(":", 1)
        client = dist.TCPStore(
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60)
        )
        client.wait([Keys.ROSTER.format(g=0)], datetime.timedelta(seconds=120))
        for template in templates():
            for key in instances(template):
                if template in QUEUES:
                    client.queue_push(key, "junk")
                elif unsealed(template):
                    client.add(key, -1_000_000)
                    client.add(key, 3_000_000)
                    self.counted.append(key)
                else:
                    value = json.dumps({"forged": key, "generation": 1, "rank": 0})
                    client.compare_set(key, "", value)  # only where the job wrote nothing yet
                    self.forged.append(key)


def test_the_key_table_is_covered() -> None:
    """Every template but those left out is written or counted (a new key is, too)."""
    for template in templates():
        assert instances(template), template
    assert Keys.HOLDINGS_COUNT in Keys.UNSEALED and Keys.HOLDINGS_COUNT in templates()


@pytest.mark.timeout(900)
def test_an_outsider_on_every_key_cannot_lose_the_save_or_stall_the_job(
    tmp_path: Path, failure_free: Callable[[int], TrainRun]
) -> None:
    reference = failure_free(ITERS)[2]
    outsider = Outsider(tmp_path / "logs")
    outsider.start()
    proc, _, summary = train_case(tmp_path, [*ARGS, "--save", "{ckpt}"], str(ITERS), timeout=600)
    outsider.join(120)
    assert outsider.error is None, repr(outsider.error)
    assert len(outsider.forged) > 100 and len(outsider.counted) > 20
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode in (0, 3), out  # 0: the spare's recovery went as the run without
    if proc.returncode == 0:  # the outsider's counters kept the second fault from firing
        assert summary["final_param_digest"] == reference["final_param_digest"], out
        assert summary["losses"] == reference["losses"], out
        return
    save = summary["out_of_redundancy"]["save"]
    assert save["complete"], save
    manifest = snapshot_set.read_manifest(tmp_path / "ckpt", save["iteration"])
    assert manifest["complete"] and manifest["ranks_present"] == [0, 1, 2, 3], manifest
    log = tmp_path / "resume.jsonl"
    resumed = run_deadpool(
        "train", "--tp", "2", "--dp", "2", "--iters", str(ITERS), "--load", str(tmp_path / "ckpt"),
        "--json-log", str(log), "--run-dir", str(tmp_path / "resume"), timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    last = json.loads(log.read_text().splitlines()[-1])
    assert last["losses"] == reference["losses"][save["iteration"] :]
    assert last["final_param_digest"] == reference["final_param_digest"]
