"""The job's store protocol, shared by every role: the keys (`messages.Keys`, each documented
once) and the typed messages with their codec, the seal every value carries, one sealed
key-value core (`sealed_store`) with a view per role over it (`store_view` for what every role
reads, `worker_view`, `coordinator_view`, `agent_view`; `membership` combines them for the code
that plays every role), bounded connections, the in-memory store the unit tests run on, waking
on store events and the retention of keys."""
