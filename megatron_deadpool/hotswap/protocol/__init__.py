"""The job's store protocol, shared by every role: every key (`messages.Keys`, documented once
there), the typed messages and their codec, the seal every value carries, the sealed key-value
core (`sealed_store`) and the role views over it (`store_view`, `worker_view`,
`coordinator_view`, `agent_view`; `membership` combines them), bounded connections, the
in-memory store the unit tests run on, waking on store events and the retention of keys."""
