"""The hot-swap protocol, for any job, in rooms by who runs the code:

- `protocol/`: the store's keys and typed, sealed values every side reads and writes
  (`membership`, `messages`, `seal`, `connection`, the in-memory store of the unit tests);
- `coordinator/`: failure detection and the decisions (slots, respawn or spare, the restore
  plan), the event log, a standby's takeover;
- `worker/`: one training process's life cycle (`driver`), its recovery steps, group repair
  and rebinding, the plan watch, a newcomer's private world;
- `report/`: what a job says about itself to its operator (metrics file, timeline, the
  out-of-redundancy note, the redundancy status for the ranks' scalars);
- `launch/`: starting the processes (fork server, local and srun jobs, node agents) and the
  supervision loop that ticks the coordinator.

Import rules (import-linter): launch over report over coordinator | worker (independent) over
protocol; nothing below the commands and jobs imports `launch`. Knows no concrete job: the
embedded job and Megatron-LM plug in through `worker.adapter`."""
