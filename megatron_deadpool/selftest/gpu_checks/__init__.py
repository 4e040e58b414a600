"""The GPU checks, each written once: used by `scripts/gpu_first_contact.py` (one row each, in
a fresh interpreter), `deadpool selftest` (`selftest.device_checks`) and the GPU suite
(`tests/gpu/test_gpu_suite.py`).

- `pack_check`: the pack kernel (or whichever backend packs on the device) against the host's
  pack and checksum, misaligned and of mixed dtypes, timed against a plain `copy_`;
- `kernel`: whether the fused kernel packs on this device, and the verdict on it (on CUDA the
  torch fallback is a failure that names the fix);
- `round_cost`: one replication round's cost to a matmul loop, beside a plain side-stream copy
  of the same bytes (GPU time added, host time `start_round` holds);
- `n2_probe`: a model buffer changed right after `start_round` is restored with its value
  from before the round;
- `heartbeat`: a plan-watch abort while a heartbeat keeps beating (optionally running
  `DeviceWatch` after every beat, as the driver does);
- `thread_devices`: every thread DeadPool started selected the rank's device.

Each module keeps its verdict pure (`judge`), so that the thresholds and messages are tested on
CPU with made-up measurements; what needs CUDA is the `measure`/`check` function beside it.
`base` holds what they share: `Skip`, the timing helper, a world of one, an Adam shard.
"""
