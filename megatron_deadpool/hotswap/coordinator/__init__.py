"""The coordinator: detection (heartbeats, liveness, error reports), its decisions (who takes
which slot, respawn or spare, the restore plan), the event log, pruning the store, the agents
it orders, and a standby that takes over a lost primary."""
