"""The traffic meter (`bench/traffic.py`): the bytes and ops it counts for single torch ops whose
memory traffic is known, including the temporary that an integer sum widening its input
allocates inside its own kernel, and `deadpool bench pack --traffic` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_deadpool.bench import pack_bench, traffic

pytestmark = pytest.mark.timeout(120)

N = 1 << 20


def test_a_plain_copy_moves_2n_in_one_op() -> None:
    src, dst = torch.ones(N, dtype=torch.uint8), torch.empty(N, dtype=torch.uint8)
    counted = traffic.measure(lambda: dst.copy_(src))
    assert (counted.nbytes, counted.ops, counted.hidden_bytes) == (2 * N, 1, 0)
    assert counted.by_op == {"aten::copy_": [1, 2 * N]}


def test_views_move_nothing_and_out_tensors_count_once() -> None:
    words = torch.ones(N // 4, dtype=torch.int32)
    out = torch.empty(N // 1024, dtype=torch.int32)
    counted = traffic.measure(
        lambda: torch.sum(words.view(-1, 256)[:, :], 1, dtype=torch.int32, out=out)
    )
    assert counted.nbytes == N + N // 256  # the words once, the row sums once
    assert counted.ops == 1 and counted.hidden_bytes == 0


def test_an_integer_sum_that_widens_its_input_is_charged_for_the_hidden_copy() -> None:
    """``torch.sum(int32, dtype=int64)`` reads N, writes the int64 copy (2N) and reads it (2N):
    arguments and results alone would say N."""
    words = torch.ones(N // 4, dtype=torch.int32).view(-1, 256)
    counted = traffic.measure(lambda: torch.sum(words, 1, dtype=torch.int64))
    assert counted.hidden_bytes == 4 * N
    assert counted.nbytes == N + N // 128 + 4 * N
    assert counted.ops == 2  # the widening copy and the sum
    assert traffic.measure(lambda: words.to(torch.int64)).nbytes == 3 * N  # returned: no hidden


def test_the_counts_do_not_depend_on_the_values_or_the_run() -> None:
    plan = pack_bench.pack.whole_buffer_plan(pack_bench.make_shard(N, torch.device("cpu")))
    out = torch.empty(plan.nbytes, dtype=torch.uint8)
    slot = torch.zeros(1, dtype=torch.int64)
    first = traffic.measure(lambda: plan.pack(out, slot))
    for tensor in plan.sources[::2]:  # the shard's tensors (the odd ones are zero padding)
        tensor.fill_(3)
    assert traffic.measure(lambda: plan.pack(out, slot)) == first


def test_bench_pack_traffic_prints_the_table_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "traffic.json"
    assert pack_bench.main(["--traffic", "--sizes-mb", "1", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "pack/copy" in printed and "2.00N" in printed
    row, *triton = json.loads(path.read_text())["traffic"]  # the Triton row where it runs
    assert row["checksum_by"] == "torch" and row["copy"] == 2.0 and row["copy_ops"] == 1
    assert row["pack_ratio"] == pytest.approx(row["pack"] / 2)
    assert [r["checksum_by"] for r in triton] in ([], ["triton"])


@torch.library.custom_op("deadpool_test::halve_into", mutates_args=("out",))
def halve_into(src: torch.Tensor, out: torch.Tensor) -> None:
    """A custom op whose inside (like Triton's interpreter) makes a temporary of its own."""
    out.copy_(src.clone()[::2])


def test_a_custom_op_counts_by_its_arguments_not_by_what_runs_inside() -> None:
    """A Triton kernel registered as a custom op reads and writes its arguments; the torch
    calls that emulate it on the host (Triton's interpreter) are not its traffic."""
    src, out = torch.ones(N, dtype=torch.uint8), torch.empty(N // 2, dtype=torch.uint8)
    counted = traffic.measure(lambda: halve_into(src, out))
    assert counted.by_op == {"deadpool_test::halve_into": [1, N + N // 2]}
    assert counted.hidden_bytes == 0 and bool((out == 1).all())
